"""LTX-2 / LTX-2.3 (audio-video) on the workers: detection in both layouts, config from shapes, the serial model
against diffusers' LTX2VideoTransformer3DModel on the same file, and the two streams split over real gloo ranks
(Ulysses, Ring and both) against the serial call.

The reference is diffusers' own model, loaded through diffusers' own single-file converter
(convert_ltx2_transformer_to_diffusers: Lightricks' names -> diffusers'), plus the one rename it leaves out
(LTX-2.3's prompt_adaln_single), so it shares nothing with the family module but the file. Timesteps are per token:
the first latent frame's video tokens are a conditioning frame (timestep 0), as image-to-video gives them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.strategies.attention import LocalAttention
from parallel_runtime.models.families.ltx2 import LTX2Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(300)

# 32 heads as every released file (ComfyUI's detection fixes them): video 32 x 4 wide, audio 32 x 2; 2 blocks.
# LTX-2.0 projects a 32-wide caption itself; LTX-2.3 gates its heads, modulates the prompt cross-attention, reads
# the connectors' rows as they are and rotates with split RoPE.
LTX20 = LTX2Config(hidden_size=128, audio_hidden_size=64, num_layers=2, in_channels=16, audio_in_channels=16,
                   cross_attention_dim=128, audio_cross_attention_dim=64, caption_channels=32)
LTX23 = LTX2Config(hidden_size=128, audio_hidden_size=64, num_layers=2, in_channels=16, audio_in_channels=16,
                   cross_attention_dim=128, audio_cross_attention_dim=64, gated_attn=True, cross_attn_mod=True,
                   prompt_adaln=True, rope_type="split", cross_timestep=True)
CONFIGS = {"ltx2.0": LTX20, "ltx2.3": LTX23}
T, H, W = 3, 4, 6  # latent frames x height x width: 72 video tokens
AUDIO_FRAMES = 13  # audio latent frames: 13 tokens (not a multiple of 2 or 4: uneven shards)
AUDIO_CHANNELS = 2  # x 8 mel bins = 16 channels per token in the tiny files
PROMPT = 7
# One fp32 forward in another op order than the reference: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx2")
    return {name: write_checkpoint(str(folder / f"{name}.safetensors"), config, seed=3,
                                   prefix="model.diffusion_model.") for name, config in CONFIGS.items()}


def inputs(config: LTX2Config, batch: int = 2, seed: int = 5) -> dict:
    """One model call's inputs: packed video and audio tokens, both prompts, per-token timesteps (the first frame a
    conditioning frame at 0; audio at the step's timestep), sigmas."""
    g = torch.Generator().manual_seed(seed)
    ctx_width = config.caption_channels or None
    video_t = torch.full((batch, T * H * W), 800.0)
    video_t[:, :H * W] = 0.0
    return dict(video=torch.randn(batch, T * H * W, config.in_channels, generator=g),
                audio=torch.randn(batch, AUDIO_FRAMES, config.audio_in_channels, generator=g),
                video_context=torch.randn(batch, PROMPT, ctx_width or config.cross_attention_dim, generator=g),
                audio_context=torch.randn(batch, PROMPT, ctx_width or config.audio_cross_attention_dim, generator=g),
                video_t=video_t, audio_t=torch.full((batch, AUDIO_FRAMES), 800.0),
                sigma=torch.full((batch,), 800.0), audio_sigma=torch.full((batch,), 760.0))


@torch.no_grad()
def diffusers_call(path: str, config: LTX2Config, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    sd = convert_ltx2_transformer_to_diffusers(load_file(path))
    sd = {k.replace("prompt_adaln_single.", "prompt_adaln."): v for k, v in sd.items()}
    model = LTX2VideoTransformer3DModel(**config.diffusers_kwargs()).eval()
    model.load_state_dict(sd, strict=True)
    out = model(hidden_states=x["video"], audio_hidden_states=x["audio"], encoder_hidden_states=x["video_context"],
                audio_encoder_hidden_states=x["audio_context"], timestep=x["video_t"], audio_timestep=x["audio_t"],
                sigma=x["sigma"], audio_sigma=x["audio_sigma"], num_frames=T, height=H, width=W, fps=24.0,
                audio_num_frames=AUDIO_FRAMES, use_cross_timestep=config.cross_timestep, return_dict=False)
    return out[0], out[1]


@functools.lru_cache(maxsize=8)
def built(path: str, shard: tuple[int, int] | None = None, tensor: tuple[int, int] | None = None):
    """(family, config, model) of a file, built once per process (each adapter points it at its own strategies);
    `shard` (index, degree): shard_weights' slice of every block's bytes; `tensor` (index, degree): a tensor rank's
    heads and MLP units."""
    from parallel_runtime.strategies.tensor import TensorSplit, parallelize_tensor
    from parallel_runtime.weights.checkpoint import open_checkpoint

    split = TensorSplit(*tensor) if tensor is not None else None
    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
        config = family.infer_config(reader, match, os.path.basename(path))
        model = family.build(config, reader, match, lambda n: True, torch.float32, "cpu", shard=shard,
                             tensor=split).eval()
    if split is not None:
        parallelize_tensor(model, split)
    if shard is not None:
        from parallel_runtime.strategies.sharded_weights import parallelize_sharded

        parallelize_sharded(model)
    return family, config, model


@functools.lru_cache(maxsize=4)
def built_as_stored(path: str):
    """(family, config, model) built as a worker builds it: the storage the file's dtypes ask for (fp8 matrices
    kept fp8, computed in fp32 on the CPU)."""
    from parallel_runtime.runtime.worker import resolve_storage
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
        config = family.infer_config(reader, match, os.path.basename(path))
        storage = resolve_storage("default", torch.device("cpu")).for_file(reader)
        return family, config, family.build(config, reader, match, lambda n: True, storage, torch.device("cpu")).eval()


def serial_call(path: str, x: dict, video_rows=None, audio_rows=None, context=None, shard=None, tensor=None,
                stored: bool = False, fps: float = 24.0, **settings):
    """ParaDiT's family on one rank: the file read through its key map, every row (or the rows given); `stored`:
    built in the file's own storage (fp8 kept fp8); `settings`: config fields that replace the inferred ones."""
    from parallel_runtime.strategies.attention.processor import AttentionContext

    family, config, model = built_as_stored(path) if stored else built(path, shard, tensor)
    config = dataclasses.replace(config, **settings)
    adapter = family.adapter(config, model, [range(config.num_blocks)], context or AttentionContext())
    v = torch.arange(T * H * W) if video_rows is None else video_rows
    a = torch.arange(AUDIO_FRAMES) if audio_rows is None else audio_rows
    rope = adapter.rope((T, H, W), v, AUDIO_FRAMES, a, fps=fps, batch=x["video"].shape[0])
    with torch.no_grad():
        return adapter.forward_rows(x["video"][:, v], x["audio"][:, a], x["video_context"], x["audio_context"],
                                    x["video_t"][:, v], x["audio_t"][:, a], x["sigma"], x["audio_sigma"], rope)


# -- detection --------------------------------------------------------------------------------------------------

def _diffusers_twin(path: str, folder) -> str:
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    sd = convert_ltx2_transformer_to_diffusers(load_file(path))
    sd = {"transformer." + k.replace("prompt_adaln_single.", "prompt_adaln."): v.contiguous() for k, v in sd.items()}
    out = str(folder / ("diffusers-" + os.path.basename(path)))
    save_file(sd, out)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_files_are_detected_in_both_layouts(paths, name, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    twin = _diffusers_twin(paths[name], tmp_path)
    for path, layout, prefix in ((paths[name], "original", "model.diffusion_model."), (twin, "diffusers", "transformer.")):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("ltx2", layout, prefix)
        # A released-layout file is read as ComfyUI reads it, with LTXAVModel's gate timestep scale (no metadata).
        comfyui = dict(reading="comfyui", av_timestep_multiplier=1.0) if layout == "original" else {}
        assert model_config(path) == dataclasses.replace(CONFIGS[name], **comfyui), layout


def test_ltx_video_09_is_still_refused(tmp_path):
    """LTX-Video 0.9's keys (no audio stream) stay refused in one sentence; LTX-2's are no longer."""
    sd = {k: torch.zeros(1) for k in ("adaln_single.emb.timestep_embedder.linear_1.bias",
                                      "transformer_blocks.0.attn2.to_k.weight", "patchify_proj.weight")}
    with pytest.raises(ModelFileError, match=r"LTX-Video \(LTXV 0\.9\.x\).*does not run yet"):
        detect_family(sd.keys(), "ltxv.safetensors")


# -- parity with diffusers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_serial_matches_diffusers(paths, name, layout, tmp_path):
    config, x = CONFIGS[name], inputs(CONFIGS[name])
    path = paths[name] if layout == "original" else _diffusers_twin(paths[name], tmp_path)
    want_v, want_a = diffusers_call(paths[name], config, x)
    # A released-layout file is read as ComfyUI reads it (test_ltx2_comfyui.py); read as diffusers reads it, with
    # diffusers' gate timestep scale, it equals diffusers' class: the key map is the same either way.
    diffusers_reading = dict(reading="diffusers", av_timestep_multiplier=1000.0) if layout == "original" else {}
    got_v, got_a = serial_call(path, x, **diffusers_reading)
    assert want_v.abs().mean() > 0.1 and want_a.abs().mean() > 0.1  # outputs of O(1): a real comparison
    assert rel_err(got_v, want_v) < SERIAL_RTOL and rel_err(got_a, want_a) < SERIAL_RTOL, (
        rel_err(got_v, want_v), rel_err(got_a, want_a))


# -- both streams split over real gloo ranks -------------------------------------------------------------------

# Every 4-rank layout of the exact strategies: each rank's video and audio shards (13 audio rows over 4 or 2
# ranks: uneven), cond and uncond over CFG.
TOPOLOGIES = {"ulysses4": dict(ulysses=4), "ring4": dict(ring=4), "ulysses2xring2": dict(ulysses=2, ring=2),
              "cfg2xulysses2": dict(cfg=2, ulysses=2), "cfg2xring2": dict(cfg=2, ring=2),
              "ulysses2xring2-sharded": dict(ulysses=2, ring=2, shard_weights=True), "tensor4": dict(tensor=4),
              "tensor2xulysses2": dict(tensor=2, ulysses=2)}

RANK = r"""
import json, sys
import torch, torch.distributed as dist
from safetensors.torch import save_file
sys.path.insert(0, "tests")
from test_ltx2 import CONFIGS, TOPOLOGIES, built, inputs, serial_call, shards
from parallel_runtime.distributed.comm import Comm
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.strategies.attention.streams import stream_attention

rank, world, store, paths, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
try:
    for topo_name, degrees in TOPOLOGIES.items():
        topology = Topology(**degrees)
        comm = Comm(topology, rank)
        coords, sp = topology.coords(rank), topology.sp
        for name, path in paths.items():
            x = inputs(CONFIGS[name])
            if topology.cfg > 1:  # this rank's CFG branch: one row of the batch (cond, uncond)
                x = {k: v[coords["cfg"]:coords["cfg"] + 1] for k, v in x.items()}
            video, audio = shards(x["video"].shape[1], sp), shards(x["audio"].shape[1], sp)
            me = topology.sp_rank(rank)
            lengths_v, lengths_a = [len(r) for r in video], [len(r) for r in audio]

            def attention(q, kv):
                return stream_attention(comm, topology.ulysses, coords["ring"], q, kv)

            context = AttentionContext(attention=attention(lengths_v, lengths_v),
                                       streams={"audio": attention(lengths_a, lengths_a),
                                                "a2v": attention(lengths_v, lengths_a),
                                                "v2a": attention(lengths_a, lengths_v)})
            shard = tensor = None
            if topology.tensor > 1:  # heads and MLP units split over the tensor group, its row-wise sums reduced
                from parallel_runtime.strategies.tensor import bind_tensor_group

                tensor = (coords["tensor"], topology.tensor)
                bind_tensor_group(built(path, shard, tensor)[2], comm)
            if topology.shard_weights:  # every block's bytes split over the replica group, gathered as it runs
                weights = comm.group("weights")
                shard = (weights.index, weights.size)
                built(path, shard, tensor)[2].weight_gatherer.bind(comm)
            v, a = serial_call(path, x, video[me], audio[me], context, shard, tensor)
            if shard is not None:
                built(path, shard, tensor)[2].weight_gatherer.finish()
            save_file({"video": v.contiguous(), "audio": a.contiguous(), "video_rows": video[me], "audio_rows": audio[me],
                       "batch": torch.tensor([coords["cfg"] if topology.cfg > 1 else -1])},
                      f"{out}/{topo_name}-{name}-{rank}.safetensors")
        comm.close()
finally:
    dist.destroy_process_group()
"""


def shards(n: int, k: int) -> list[torch.Tensor]:
    """Row indices of k contiguous shards of n rows, the first n % k one longer (uneven where k does not divide n)."""
    sizes = [n // k + (j < n % k) for j in range(k)]
    return list(torch.arange(n).split(sizes))


@pytest.fixture(scope="module")
def four_ranks(paths, tmp_path_factory):
    """Every topology's outputs, from one launch of 4 gloo ranks (one process start for every strategy)."""
    out = tmp_path_factory.mktemp("ltx2-ranks")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), "4", str(out / "store"), json.dumps(paths),
                               str(out)], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(4)]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return out


def gathered(folder, topology: str, name: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full video and audio outputs put back together from every rank's rows."""
    video = torch.full((batch, T * H * W, CONFIGS[name].in_channels), float("nan"))
    audio = torch.full((batch, AUDIO_FRAMES, CONFIGS[name].audio_in_channels), float("nan"))
    for rank in range(4):
        part = load_file(str(folder / f"{topology}-{name}-{rank}.safetensors"))
        rows = slice(None) if part["batch"].item() < 0 else slice(part["batch"].item(), part["batch"].item() + 1)
        video[rows, part["video_rows"]] = part["video"]
        audio[rows, part["audio_rows"]] = part["audio"]
    return video, audio


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_exact_strategies_equal_serial(paths, four_ranks, topology, name):
    """Both streams split over the ranks (neither replicated): self-attention per stream and a2v / v2a across the
    streams through Ulysses, Ring, their hybrid and CFG, with each block's weights sharded over the ranks, and with
    heads and MLP units split by tensor parallelism (alone and under Ulysses), equal the serial call to fp32
    round-off."""
    x = inputs(CONFIGS[name])
    want_v, want_a = serial_call(paths[name], x)
    got_v, got_a = gathered(four_ranks, topology, name, x["video"].shape[0])
    assert not got_v.isnan().any() and not got_a.isnan().any()  # every row came back from some rank
    errs = rel_err(got_v, want_v), rel_err(got_a, want_a)
    assert max(errs) < EXACT_RTOL, errs


# -- PipeFusion's and naive patch's error on a multi-step run ---------------------------------------------------

STEPS, WARMUP = 6, 1


def _euler_run(path: str, config: LTX2Config, x: dict, passes) -> tuple[torch.Tensor, torch.Tensor]:
    """A flow-matching Euler run (sigma 1 -> 0 over STEPS steps) from x's tokens as noise; the first frame is a
    conditioning frame (timestep 0, never updated), as image-to-video keeps it. `passes(step, video, audio, t)`
    returns the step's velocities, computed as the strategy computes them."""
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    video, audio = x["video"].clone(), x["audio"].clone()
    frame = H * W
    for i in range(STEPS):
        t = float(sigmas[i]) * 1000.0
        v, a = passes(i, video, audio, t)
        video[:, frame:] += (sigmas[i + 1] - sigmas[i]) * v[:, frame:]
        audio += (sigmas[i + 1] - sigmas[i]) * a
    return video, audio


def _pass_inputs(x: dict, video: torch.Tensor, audio: torch.Tensor, t: float) -> dict:
    batch = video.shape[0]
    video_t = torch.full((batch, video.shape[1]), t)
    video_t[:, :H * W] = 0.0
    return {**x, "video": video, "audio": audio, "video_t": video_t, "audio_t": torch.full((batch, audio.shape[1]), t),
            "sigma": torch.full((batch,), t), "audio_sigma": torch.full((batch,), t)}


def _patched(path: str, x: dict, patches: int, stale: bool):
    """Each step's velocities, patch by patch over the video rows. PipeFusion (`stale`): every attention layer keeps
    a full K/V buffer per stream pair, a patch writes its fresh rows and reads the rest as the last pass left them
    (the patches before it this step, the rest the step before: the runtime's StaleKVAttention, which gives the
    pipeline's numbers whatever the stage count); the audio rows ride with patch 0 (audio is ~1% of the tokens),
    so later patches' audio-to-video reads this step's audio K/V; step 0 is a whole warmup pass. Naive patch: each
    patch alone with its share of the audio rows, no K/V from the others."""
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.strategies.pipefusion import StaleKVAttention, StaleKVCache

    nv, na = T * H * W, AUDIO_FRAMES
    caches = {k: StaleKVAttention(StaleKVCache(n), LocalAttention()) for k, n in
              (("video", nv), ("audio", na), ("a2v", na), ("v2a", nv))}
    context = AttentionContext(attention=caches["video"], streams={k: caches[k] for k in ("audio", "a2v", "v2a")})
    video_patches, audio_patches = shards(nv, patches), shards(na, patches)

    def passes(step, video, audio, t):
        xs = _pass_inputs(x, video, audio, t)
        if stale and step < WARMUP:
            return _pass(path, xs, context, caches, torch.arange(nv), torch.arange(na))
        v, a = torch.empty_like(video), torch.empty_like(audio)
        for p, rows in enumerate(video_patches):
            audio_rows = (torch.arange(na) if p == 0 else torch.arange(0)) if stale else audio_patches[p]
            v[:, rows], a_rows = _pass(path, xs, context if stale else None, caches, rows, audio_rows)
            a[:, audio_rows] = a_rows
        return v, a

    return passes


def _pass(path, xs, context, caches, video_rows, audio_rows):
    for (key, attention), rows in zip(caches.items(), (video_rows, audio_rows, audio_rows, video_rows)):
        attention.positions = rows  # the rows whose fresh K/V this pass writes into each buffer
    return serial_call(path, xs, video_rows, audio_rows, context)


@pytest.mark.parametrize("name", CONFIGS)
def test_pipefusion_and_naive_patch_errors_on_a_multistep_run(paths, name):
    """PipeFusion over 4 video patches (stale K/V, audio rows with patch 0) stays near the serial run; naive patch
    (patches alone, each with its share of the audio rows) drifts over ten times further. Measured on the tiny
    random files (6 Euler steps, 1 warmup; video, audio relative L2): PipeFusion 0.015, 0.025 (2.0) and 0.015, 0.032
    (2.3); naive 0.21, 0.25 and 0.24, 0.29. Bounds: PipeFusion under 0.07 (2x the largest) and under half of naive."""
    config, x = CONFIGS[name], inputs(CONFIGS[name])

    def serial(step, video, audio, t):
        return serial_call(paths[name], _pass_inputs(x, video, audio, t))

    want = _euler_run(paths[name], config, x, serial)
    pipefusion = _euler_run(paths[name], config, x, _patched(paths[name], x, 4, stale=True))
    naive = _euler_run(paths[name], config, x, _patched(paths[name], x, 4, stale=False))
    errors = {kind: (rel_err(got[0], want[0]), rel_err(got[1], want[1])) for kind, got in
              (("pipefusion", pipefusion), ("naive", naive))}
    assert max(errors["pipefusion"]) < 0.07 and max(errors["pipefusion"]) < 0.5 * min(errors["naive"]), errors


def test_jobs_are_refused_in_one_sentence_before_any_work(paths):
    """A Parallel Sampler job for an LTX-2 file without its audio latent is refused by validate_job (what the client
    runs before sending anything) naming the ComfyUI nodes that make the whole latent (jobs with it run:
    test_av_sampler.py; the parallel MODEL's calls: test_ltx2_door.py)."""
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
    from parallel_runtime.validate import validate_job

    cond = Conditioning(torch.zeros(1, PROMPT, 128), torch.zeros(1, 0))
    job = Job(ModelSpec(paths["ltx2.3"]), StrategySpec(), SamplingSpec(steps=1), torch.zeros(1, 16, T, H, W), cond,
              None)
    with pytest.raises(ConfigError, match=r"^LTX-2\.3 128-wide x 2 denoises its video and its sound together, but "
                                          r"this job carries no audio latent; .*LTXVConcatAVLatent.*\.$") as refused:
        validate_job(job, 1)
    assert str(refused.value).count(". ") == 0  # one sentence


@pytest.mark.parametrize("name", CONFIGS)
def test_one_block_runs_as_the_cost_model_times_it(name):
    """probe_block: one block with random weights on its family's random inputs (video rows, their share of audio
    rows, both prompts, modulation, RoPE), on the CPU (what the cost model times) and on meta (its FLOP count)."""
    from parallel_runtime.models.families.ltx2 import LTX2
    from parallel_runtime.strategies.attention.processor import AttentionContext

    video, audio = LTX2.probe_block(CONFIGS[name], 1, AttentionContext(), 7, 96, torch.float32, "cpu")()
    assert video.shape == (1, 96, 128) and audio.shape == (1, 2, 64)  # 96 video rows: 2 audio rows (1 per 48)
    assert torch.isfinite(video).all() and video.abs().mean() > 0.1
    video, _ = LTX2.probe_block(CONFIGS[name], 0, AttentionContext(), 7, 96, torch.float32, "meta")()
    assert video.device.type == "meta"


def test_settings_shapes_cannot_show_come_from_the_files_metadata(paths, tmp_path):
    """A released file's `config` metadata (ComfyUI's LTXAVModel argument names) sets RoPE type, precision, theta
    and extent, the cross-attention gate's timestep scale and the head counts; the serial model still matches
    diffusers built with those settings."""
    import dataclasses

    meta = {"rope_type": "split", "frequencies_precision": "float32", "positional_embedding_theta": 5000.0,
            "positional_embedding_max_pos": [16, 1024, 1536], "audio_positional_embedding_max_pos": [24],
            "av_ca_timestep_scale_multiplier": 500.0, "num_attention_heads": 16, "audio_num_attention_heads": 16}
    path = str(tmp_path / "ltx-2-meta.safetensors")
    save_file(load_file(paths["ltx2.0"]), path, metadata={"config": json.dumps({"transformer": meta})})
    want = dataclasses.replace(LTX20, rope_type="split", rope_double_precision=False, rope_theta=5000.0,
                               max_positions=(16, 1024, 1536), audio_max_position=24, av_timestep_multiplier=500.0,
                               num_heads=16, audio_heads=16)  # 500: neither ComfyUI's default (1) nor diffusers' (1000)
    assert model_config(path) == dataclasses.replace(want, reading="comfyui")
    x = inputs(want)
    (got_v, got_a), (want_v, want_a) = serial_call(path, x, reading="diffusers"), diffusers_call(path, want, x)
    assert rel_err(got_v, want_v) < SERIAL_RTOL and rel_err(got_a, want_a) < SERIAL_RTOL


@pytest.mark.parametrize("scaled", [False, True], ids=["fp8", "scaled-fp8"])
def test_fp8_file_equals_its_fp32_twin_and_stays_fp8(tmp_path, scaled):
    """An fp8 file (ComfyUI's fp8 and scaled-fp8 layouts: every matrix in float8_e4m3fn) equals its fp32 twin of the
    values it means, with its matrices kept in fp8 on the rank."""
    from test_fp8 import fp8_twins

    quant, meant = fp8_twins(tmp_path, "ltx2", torch.float8_e4m3fn, scaled, config=LTX20)
    x = inputs(LTX20)
    (got_v, got_a), (want_v, want_a) = serial_call(quant, x, stored=True), serial_call(meant, x)
    # fp32 from the same fp8 numbers: only a scaled layer's multiply moves (one fp32 rounding; test_fp8's FP8_RTOL)
    assert rel_err(got_v, want_v) < 1e-5 and rel_err(got_a, want_a) < 1e-5
    model = built_as_stored(quant)[2]
    held = {n: b for n, b in model.named_buffers()} | dict(model.named_parameters())
    fp8 = [n for n, t in held.items() if t.dtype == torch.float8_e4m3fn]
    matrices = [n for n, t in load_file(meant).items() if n.endswith(".weight") and t.ndim == 2]
    assert len(fp8) == len(matrices) == 82  # every matrix: 2 blocks x (6 attentions x 4 + 2 MLPs x 2) + 26 outside


def test_gguf_file_equals_its_fp32_twin_and_stays_quantized(tmp_path):
    """A GGUF file (ComfyUI-GGUF's converter: keys without prefix, architecture "ltxv"; K-quant and legacy blocks
    over the matrices) equals the fp32 file of the values it holds, its quantized matrices kept in their blocks."""
    from test_gguf import gguf_twins

    quant, meant = gguf_twins(tmp_path, "ltx2", config=LTX20, arch="ltxv")
    x = inputs(LTX20)
    (got_v, got_a), (want_v, want_a) = serial_call(quant, x, stored=True), serial_call(meant, x)
    # the same dequantized numbers in fp32 on both sides: only summation order may differ
    assert rel_err(got_v, want_v) < 1e-5 and rel_err(got_a, want_a) < 1e-5
    kept = [n for n, t in built_as_stored(quant)[2].named_buffers() if t.dtype == torch.uint8]
    assert len(kept) == 69, kept[:3]  # every matrix whose rows hold whole blocks (32 or 256 values) stays in them


@pytest.mark.parametrize("name", CONFIGS)
def test_pipeline_stages_load_only_their_blocks_and_chain_to_the_serial_call(paths, name):
    """PipeFusion's stage split: each of 2 stages built with only what `stage_ownership` gives it (its block, the
    modulation and prompt projections every stage needs, the input projections on the first, the heads on the
    last) runs its blocks in turn; the chain equals the serial call."""
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.weights.checkpoint import open_checkpoint

    x, path = inputs(CONFIGS[name]), paths[name]
    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
        config = family.infer_config(reader, match, name)
        stages = family.pipeline_stages(config, 2)
        adapters = []
        for k, chunks in enumerate(stages):
            owned = family.stage_ownership(config, chunks, first=k == 0, last=k == len(stages) - 1)
            model = family.build(config, reader, match, owned, torch.float32, torch.device("cpu")).eval()
            adapters.append(family.adapter(config, model, chunks, AttentionContext()))
    assert [list(c[0]) for c in stages] == [[0], [1]]
    with torch.no_grad():
        first = adapters[0]
        video, audio = first.embed_video(x["video"]), first.embed_audio(x["audio"])
        for adapter in adapters:  # every stage computes its modulation, RoPE and prompt rows itself
            mod = adapter.modulation(x["video_t"], x["audio_t"], x["sigma"], x["audio_sigma"])
            rope = adapter.rope((T, H, W), torch.arange(T * H * W), AUDIO_FRAMES, torch.arange(AUDIO_FRAMES),
                                batch=video.shape[0])
            video, audio = adapter.run_blocks(video, audio, adapter.embed_prompt(x["video_context"], x["audio_context"]),
                                              mod, rope)
        got_v, got_a = adapters[-1].head(video, audio, mod)
    want_v, want_a = serial_call(path, x)
    assert rel_err(got_v, want_v) < SERIAL_RTOL and rel_err(got_a, want_a) < SERIAL_RTOL


@pytest.mark.parametrize("name", CONFIGS)
def test_rope_of_any_rows_is_those_rows_of_the_whole_tables(paths, name):
    """3-D video RoPE, 1-D audio RoPE and both temporal cross tables for any set of rows (a shard, a patch, rows in
    any order) are exactly those rows of the whole sequence's tables: every table is per token."""
    from parallel_runtime.strategies.attention.processor import AttentionContext

    family, config, model = built(paths[name])
    adapter = family.adapter(config, model, [range(config.num_blocks)], AttentionContext())
    whole = adapter.rope((T, H, W), torch.arange(T * H * W), AUDIO_FRAMES, torch.arange(AUDIO_FRAMES), batch=2)
    video_rows, audio_rows = torch.tensor([71, 3, 40, 24]), torch.tensor([12, 0, 5])
    part = adapter.rope((T, H, W), video_rows, AUDIO_FRAMES, audio_rows, batch=2)
    for got, want, rows in zip(part, whole, (video_rows, audio_rows, video_rows, audio_rows)):
        dim = 2 if want[0].dim() == 4 else 1  # split tables [B, heads, rows, r]; interleaved [B, rows, width]
        for g, w in zip(got, want):
            assert torch.equal(g, w.index_select(dim, rows))
    cos = whole.video[0]
    dim = 2 if cos.dim() == 4 else 1
    assert not torch.equal(cos.select(dim, 0), cos.select(dim, H * W))  # frame 0 and 1 differ: a real table
