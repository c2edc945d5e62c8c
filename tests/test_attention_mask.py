"""ComfyUI's attention_mask on the workers: an additive bias over the joint [text, image] sequence, cut per rank.

The reference is test_controlnet's: diffusers' Flux blocks with their stock attention processors, which add
`attention_mask` to the scores as ComfyUI's Flux does (SDPA's float attn_mask, broadcast over heads), run serially
on the whole sequence; the mask reaches the DiT's blocks only, as ComfyUI's ControlNetFlux takes none.
The masks are built to catch every way a rank could read the wrong block: random biases everywhere, keys masked
out entirely (-inf columns, as StyleModelApply's strength 0 gives Redux's tokens), queries that see keys of one
sequence shard only (so Ring meets K/V blocks it must ignore), and one query that sees no key at all (torch's SDPA
gives it 0). A bias on the wrong rows or columns is an O(1e-1) error.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_conditioning, rel_err
from test_controlnet import reference_call
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.tiny import TINY, write_checkpoint, write_controlnet
from parallel_runtime.spec import ControlInput, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.strategies.attention.local import attention_with_lse, merge_partials

pytestmark = pytest.mark.timeout(600)

# Exact strategies reorder float32 sums (~1e-7 per op); the reference runs diffusers' stock processors in
# another op order (~1e-6). A bias block cut at the wrong rows or columns is ~1e-1.
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
H, W, TEXT = 12, 16, 7  # latent 12 x 16: 6 x 8 = 48 image tokens; 7 prompt tokens (uneven shards)
L = TEXT + (H // 2) * (W // 2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mask")
    return {"dit": write_checkpoint(str(d / "flux.safetensors"), TINY, seed=5),
            "xlabs": write_controlnet(d / "xlabs.safetensors", TINY, "xlabs", double=2, seed=1)}


def make_mask(seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.randn(batch, L, L, generator=g) * 0.7
    mask[:, :, 2:4] = float("-inf")  # prompt keys masked out for everyone (StyleModelApply strength 0)
    mask[:, 10:13, :] = float("-inf")  # these queries see only the last image rows: other K/V blocks are empty
    mask[:, 10:13, L - 8:] = 0.0
    mask[:, 20, :] = float("-inf")  # a query that sees nothing: SDPA's output is 0
    return mask


def masked(c, mask: torch.Tensor | None, key: str | None = None):
    """The conditioning with a mask, kept on the workers under a key of its bytes (as RemoteDiT names it)."""
    if mask is None:
        return c
    import hashlib

    key = key or hashlib.blake2b(mask.contiguous().numpy().tobytes(), digest_size=8).hexdigest()
    return dataclasses.replace(c, attention_mask=mask, attention_mask_key=key)


def call_job(files, strategy: S, pos_mask=None, neg_mask=None, negative=True, control=()) -> Job:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 if negative else 1, 16, H, W, generator=g)
    pos = dataclasses.replace(masked(make_conditioning(1, TEXT), pos_mask), control=tuple(control))
    neg = masked(make_conditioning(2, TEXT), neg_mask) if negative else None
    t = torch.full((x.shape[0],), 0.7)
    return Job(ModelSpec(files["dit"]), strategy, SamplingSpec(steps=1), x, pos, neg, timestep=t)


# -- the kernels -------------------------------------------------------------------------------------------


def test_blocks_merged_with_a_bias_equal_one_masked_attention():
    """Ring's rule over key blocks with a bias: a block that masks a query entirely contributes nothing, and a
    query masked everywhere ends at 0 (what torch's SDPA, ComfyUI's attention, returns for it)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g) for _ in range(3))
    bias = torch.randn(2, 1, 9, 9, generator=g)
    bias[:, :, 1, :6] = float("-inf")  # query 1: nothing in the first two blocks
    bias[:, :, 4, :] = float("-inf")  # query 4: nothing at all
    full = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            attn_mask=bias).transpose(1, 2)
    assert torch.all(full[:, 4] == 0)
    for kernel in ("flash_cpu", "math"):
        out = lse = None
        for a, b in ((0, 3), (3, 6), (6, 9)):
            block = attention_with_lse(q, k[:, a:b], v[:, a:b], kernel=kernel, bias=bias[..., a:b])
            out, lse = merge_partials(out, lse, *block)
        assert torch.isfinite(out).all()
        assert rel_err(out, full) < 1e-6, kernel  # float32 merge order: ~1e-7


# -- the runtime -------------------------------------------------------------------------------------------


def test_one_worker_equals_the_reference(files, client1):
    """A masked positive and a differently masked negative (batched together, as ComfyUI batches them)."""
    job = call_job(files, S(), make_mask(1), make_mask(2))
    ref = reference_call(files, job)
    assert rel_err(ref, reference_call(files, call_job(files, S()))) > 1e-2  # the mask matters
    assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2), S(ulysses_degree=2, ring_degree=2),
                                      S(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup", "ulysses2_ring2", "pp2_ulysses2_warmup"])
def test_exact_strategies_equal_the_reference(files, request, strategy):
    """Masked positive, unmasked negative: ComfyUI runs them as two calls' worth of rows, ParaDiT as two
    forward passes (or one per CFG rank). PipeFusion's call without a schedule step is its warm-up (exact)."""
    client = request.getfixturevalue(f"client{strategy.world_size}")
    job = call_job(files, strategy, make_mask(3))
    assert rel_err(client.run(job).latent, reference_call(files, job)) < EXACT_RTOL


def test_a_batch_of_masks_and_the_mask_crossing_once(files, client2):
    """A latent batch of 2 whose rows have different masks; the second call names the kept mask by key only."""
    g = torch.Generator().manual_seed(4)
    pos = masked(make_conditioning(1, TEXT), make_mask(5, batch=2), "two-rows")
    job = Job(ModelSpec(files["dit"]), S(ulysses_degree=2), SamplingSpec(steps=1),
              torch.randn(2, 16, H, W, generator=g), pos, None, timestep=torch.full((2,), 0.4))
    first = client2.run(job).latent
    single = [dataclasses.replace(job, latent=job.latent[i:i + 1], timestep=job.timestep[:1],
                                  positive=masked(make_conditioning(1, TEXT), make_mask(5, batch=2)[i:i + 1], f"r{i}"))
              for i in range(2)]
    assert rel_err(first, torch.cat([reference_call(files, j) for j in single])) < EXACT_RTOL
    bare = dataclasses.replace(job, positive=dataclasses.replace(pos, attention_mask=None))
    assert torch.equal(client2.run(bare).latent, first)


def test_controlnet_blocks_run_without_the_mask(files, client1, client2):
    """ComfyUI's ControlNetFlux takes no attention_mask: the reference (from ComfyUI's ControlNet code) masks the
    DiT's blocks only; serial and Ulysses equal it, and so differ from a masked ControlNet by far more than
    round-off."""
    g = torch.Generator().manual_seed(9)
    control = ControlInput(files["xlabs"], "mask-hint-9", 0.8, torch.rand(1, 3, 8 * H, 8 * W, generator=g))
    job = call_job(files, S(), make_mask(6), negative=False, control=[control])
    ref = reference_call(files, job)
    without = dataclasses.replace(job, positive=dataclasses.replace(job.positive, control=()))
    assert rel_err(ref, reference_call(files, without)) > 1e-2  # the ControlNet acts
    assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL
    assert rel_err(client2.run(dataclasses.replace(job, strategy=S(ulysses_degree=2))).latent, ref) < EXACT_RTOL


def test_refusals(files, client1):
    bad = make_mask(7)[:, :-1]
    with pytest.raises(ConfigError, match=r"mask has shape \(1, 54, 55\) but this call needs \[batch, 55, 55\]"):
        client1.run(call_job(files, S(), bad, negative=False))
    nan = make_mask(7)
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="attention mask holds NaN values .* set that strength above 0"):
        client1.run(call_job(files, S(), nan, negative=False))
    job = call_job(files, S(), make_mask(7), negative=False)
    refs = dataclasses.replace(job.positive, references=(torch.randn(1, 16, 4, 4),))
    with pytest.raises(ConfigError, match="attention mask and reference latents"):
        client1.run(dataclasses.replace(job, positive=refs))
