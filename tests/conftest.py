"""Shared fixtures: a tiny Flux checkpoint, conditioning, and a guard that no test leaves a process."""
from __future__ import annotations

import importlib.util
import os

import psutil
import pytest
import torch

from parallel_runtime.bench.measure import rel_err  # noqa: F401 - the tests' parity metric
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-flux.safetensors"), TINY, seed=0)


def make_conditioning(seed: int, text_len: int = 7, config=TINY) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, text_len, config.context_dim, generator=g),
                        torch.randn(1, config.pooled_dim, generator=g), guidance=3.5)


def make_job(path: str, strategy: StrategySpec | None = None, *, steps: int = 8, cfg: float = 2.0, size: int = 16,
             sampler: str = "euler", scheduler: str = "simple", text_len: int = 7, seed: int = 3,
             denoise: float = 1.0, latent: torch.Tensor | None = None) -> Job:
    # text_len 7 is deliberately odd: shards of text are uneven under every sequence-parallel degree.
    return Job(ModelSpec(path), strategy or StrategySpec(),
               SamplingSpec(seed=seed, steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                            denoise=denoise),
               torch.zeros(1, 16, size, size) if latent is None else latent,
               make_conditioning(1, text_len), make_conditioning(2, text_len))




def checkpoint_without(path: str, folder, dropped: str, name: str = "damaged.safetensors") -> str:
    """A copy of the checkpoint at `path` in `folder` without the tensors whose names contain `dropped` (a damaged or
    truncated file, for the refusals at load)."""
    from safetensors.torch import load_file, save_file

    out = os.path.join(str(folder), name)
    save_file({k: v for k, v in load_file(path).items() if dropped not in k}, out)
    return out


def diffusers_flux_call(path: str, job: Job, skip: tuple[tuple[str, int], ...] = ()) -> torch.Tensor:
    """One stock-sampler call of a Flux file, computed by diffusers' own FluxTransformer2DModel as ComfyUI feeds
    its model: each chunk's c_concat joined to its input-scaled latent before 2x2 patches, and blocks named in
    `skip` (ComfyUI's patches_replace keys) replaced by their input. The independent reference for the runtime."""
    from parallel_runtime.models.families.flux_adapter import FluxAdapter, load_flux

    class Skipped(torch.nn.Module):
        def forward(self, hidden_states, encoder_hidden_states, **kwargs):
            return encoder_hidden_states, hidden_states

    _, model = load_flux(path)
    for kind, i in skip:
        blocks = model.transformer_blocks if kind == "double_block" else model.single_transformer_blocks
        if i < len(blocks):
            blocks[i] = Skipped()
    h, w = job.latent.shape[-2:]
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    rows = []
    for k, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        x = job.latent[k:k + 1]
        x = torch.cat([x, branch.concat], dim=1) if branch.concat is not None else x
        with torch.no_grad():
            out = model(hidden_states=FluxAdapter.pack(x), encoder_hidden_states=branch.cond,
                        pooled_projections=branch.pooled, timestep=job.timestep[k:k + 1],
                        img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(branch.cond.shape[1], 3),
                        guidance=torch.tensor([branch.guidance])).sample
        rows.append(FluxAdapter.unpack(out, h, w))
    return torch.cat(rows)


def check_denoise_loop(job: Job, client1, client2, what: str, rtol: float, *, warm_patches: int = 2,
                       stale_patches: int = 2) -> None:
    """A whole run of `job` (Parallel Sampler's path) on 2 workers against serial on 1: Ulysses, Ring, CFG and
    PipeFusion with every step warm-up within `rtol` (exact strategies), and PipeFusion after one warm-up step,
    which reads stale K/V, nearer serial than naive patch parallelism, which never sees the other half."""
    import dataclasses

    S = StrategySpec
    serial = client1.run(job).latent
    assert serial.shape == job.latent.shape and torch.isfinite(serial).all()
    steps = job.sampling.steps
    for strategy in (S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2),
                     S(pipefusion_degree=2, num_pipeline_patch=warm_patches, warmup_steps=steps)):
        err = rel_err(client2.run(dataclasses.replace(job, strategy=strategy)).latent, serial)
        print(f"\n{what}, {steps} steps, {strategy.label()}: rel. error {err:.2e} vs serial")
        assert err < rtol, strategy
    pipefusion = rel_err(client2.run(dataclasses.replace(job, strategy=S(
        pipefusion_degree=2, num_pipeline_patch=stale_patches, warmup_steps=1))).latent, serial)
    naive = rel_err(client2.run(dataclasses.replace(job, strategy=S(naive_patch_degree=2))).latent, serial)
    print(f"\n{what}, {steps} steps: PipeFusion (1 warm-up step) {pipefusion:.2e}, naive patch {naive:.2e}")
    assert pipefusion < naive


def comfy_rope(ids: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """comfy/ldm/flux/math.py's rope per axis, concatenated (EmbedND), for references written from ComfyUI's code:
    [L, D/2, 2, 2] rotation matrices of integer position ids [L, len(axes)]."""
    parts = []
    for i, dim in enumerate(axes):
        scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64)
        out = torch.einsum("n,d->nd", ids[:, i].double(), 1.0 / (10000 ** scale))
        parts.append(torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], -1)
                     .reshape(len(ids), -1, 2, 2))
    return torch.cat(parts, dim=1).float()


def apply_comfy_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ComfyUI's apply_rope1 on [B, L, heads, D] with comfy_rope's [L, D/2, 2, 2], in float32."""
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    f = freqs[None, :, None]
    return (f[..., 0] * x_[..., 0] + f[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


@pytest.fixture
def one_thread_per_rank():
    """One torch thread for the test's duration, for tests whose ranks are threads of this process (in-process
    fabrics: they share the 2 cores already)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def _runtimes():
    """One RuntimeClient per worker count for the whole session, started on first use and shared by the modules'
    client1/client2/client4 and the bench tests' pool: a cold worker spends ~6 CPU-s importing torch and diffusers
    before its first job, which on 2 cores made starting workers most of the suite's time."""
    clients: dict = {}
    yield clients
    for client in clients.values():
        client.shutdown()


def _cpu_client(runtimes: dict, n: int):
    from parallel_runtime.runtime.client import RuntimeClient

    where = f"cpu:{n}"  # keyed as the bench's pool is (bench_workers)
    if where not in runtimes:
        runtimes[where] = RuntimeClient(where, threads_per_worker=1)  # 1 thread each: 2-4 workers share 2 cores
    client = runtimes[where]
    yield client
    # The next module finds the same processes holding no model, as a fresh client's would (a test that killed
    # them leaves a client that starts new ones at its next job).
    client.release()


@pytest.fixture(scope="module")
def bench_workers(_runtimes):
    """The session's clients as the bench's `workers` pool (bench.cli.main): --quick rows run on them (1 thread per
    worker, as the quick preset's) and leave them running; released at the module's end like client1..4."""
    yield _runtimes
    for client in _runtimes.values():
        client.release()


@pytest.fixture(scope="module")
def serial(tiny_path, client1):
    """make_job's default job on the tiny model at one worker: the reference of the modules that split it (a module
    with other references defines its own `serial`)."""
    return client1.run(make_job(tiny_path)).latent


@pytest.fixture(scope="module")
def client1(_runtimes):
    yield from _cpu_client(_runtimes, 1)


@pytest.fixture(scope="module")
def client2(_runtimes):
    yield from _cpu_client(_runtimes, 2)


@pytest.fixture(scope="module")
def client4(_runtimes):
    yield from _cpu_client(_runtimes, 4)


def load_queue_script():
    """scripts/queue_workflow.py as a module (it is a script, not part of a package)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "queue_workflow.py")
    spec = importlib.util.spec_from_file_location("queue_workflow", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True, scope="session")
def no_leaked_processes():
    yield
    # Every client is shut down by the tests (and by atexit); a child still alive here is a leak.
    children = [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()]
    for p in children:
        p.kill()
    assert not children, f"test session leaked processes: {[p.pid for p in children]}"
