"""LoRA stacks applied on the workers, to the weights each rank holds.

The reference is a second checkpoint holding the merged weights, computed here with the plain formula
(W + strength * alpha / rank * up @ down, in float32, patch after patch as ComfyUI adds them); the runtime gets
the base file plus the patches. Equal within fp32 round-off at one worker and under every exact strategy
(PipeFusion with warm-up over all steps is exact too); swapping or removing a stack re-patches without
reading the file again. ComfyUI's own result on the same LoRA files: tests/test_comfyui_integration.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rel_err
from test_families import FAMILIES, job
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.registry import family_of
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.weights.patches import patched_weight
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.spec import WeightPatch, WeightPatches
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

PREFIX = "model.diffusion_model."
# The merged file rounds each patched weight to float32 once, as the workers do; what remains is the strategies'
# summation order (see test_families.EXACT_RTOL). A patch missed on one rank, or applied twice, moves the
# result by ~1e-2 (the LoRAs below change the weights by ~5%).
PATCH_RTOL = 1e-5
EXACT_RTOL = 1e-4
NAMES = ["kontext", "sd3_medium_dual", "qwen_image", "pixart", "chroma"]


# -- the arithmetic, against the plain formulas ----------------------------------------------------------------

def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_lora_adds_strength_times_scaled_product_in_float32():
    w, up, down = torch.randn(6, 5, generator=_g(1)), torch.randn(6, 2, generator=_g(2)), torch.randn(2, 5, generator=_g(3))
    p = WeightPatch("lora", {"up": up, "down": down}, strength=0.8, alpha=1.0)
    assert torch.equal(patched_weight(w.clone(), [p]), w + (0.8 * (1.0 / 2)) * (up @ down))
    no_alpha = dataclasses.replace(p, alpha=None, strength_model=0.5)
    assert torch.allclose(patched_weight(w.clone(), [no_alpha]), 0.5 * w + 0.8 * (up @ down), atol=1e-6)


def test_an_offset_patch_changes_only_its_rows_and_functions_act_on_the_delta():
    w, up, down = torch.randn(6, 4, generator=_g(1)), torch.randn(2, 1, generator=_g(2)), torch.randn(1, 4, generator=_g(3))
    out = patched_weight(w.clone(), [WeightPatch("lora", {"up": up, "down": down}, offset=(0, 2, 2))])
    assert torch.equal(out[:2], w[:2]) and torch.equal(out[4:], w[4:])
    assert torch.allclose(out[2:4], w[2:4] + up @ down, atol=1e-6)
    diff = torch.randn(6, 4, generator=_g(4))
    swapped = patched_weight(w.clone(), [WeightPatch("diff", {"diff": diff}, strength=-0.5, function="swap_halves")])
    assert torch.allclose(swapped, w - 0.5 * torch.cat([diff[3:], diff[:3]]), atol=1e-6)
    assert torch.equal(patched_weight(w.clone(), [WeightPatch("set", {"value": diff})]), diff)


def test_loha_lokr_locon_and_dora_follow_their_formulas():
    g = _g(5)
    w = torch.randn(6, 4, generator=g)
    a1, b1, a2, b2 = (torch.randn(*s, generator=g) for s in ((6, 2), (2, 4), (6, 2), (2, 4)))
    loha = patched_weight(w.clone(), [WeightPatch("loha", {"w1a": a1, "w1b": b1, "w2a": a2, "w2b": b2}, 0.7, alpha=1.0)])
    assert torch.allclose(loha, w + 0.7 * 0.5 * (a1 @ b1) * (a2 @ b2), atol=1e-5)
    k1, k2a, k2b = torch.randn(2, 2, generator=g), torch.randn(3, 1, generator=g), torch.randn(1, 2, generator=g)
    lokr = patched_weight(w.clone(), [WeightPatch("lokr", {"w1": k1, "w2_a": k2a, "w2_b": k2b}, 1.0, alpha=3.0)])
    assert torch.allclose(lokr, w + 3.0 * torch.kron(k1, k2a @ k2b), atol=1e-5)
    conv = torch.randn(4, 3, 3, 3, generator=g)
    up, down, mid = torch.randn(4, 2, 1, 1, generator=g), torch.randn(2, 3, 1, 1, generator=g), torch.randn(2, 2, 3, 3, generator=g)
    locon = patched_weight(conv.clone(), [WeightPatch("lora", {"up": up, "down": down, "mid": mid})])
    direct = torch.einsum("or,rsxy,si->oixy", up[:, :, 0, 0], mid, down[:, :, 0, 0])
    assert torch.allclose(locon, conv + direct, atol=1e-5)
    scale = torch.rand(6, 1, generator=g) + 0.5
    dora = patched_weight(w.clone(), [WeightPatch("lora", {"up": a1, "down": b1, "dora_scale": scale}, 1.0)])
    moved = w + a1 @ b1
    assert torch.allclose(dora, moved * scale / (w.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps),
                          atol=1e-5)


# -- on the workers ---------------------------------------------------------------------------------------------

def lora_stack(name: str, seed: int, strength: float, tag: str) -> tuple[WeightPatches, dict]:
    """A rank-2 LoRA on every matrix of the model (fused q/k/v and modulation tensors patched part by part, as
    a diffusers-format LoRA lands), plus a bias diff; returns the patches and {key: [(offset, delta)]}."""
    config = FAMILIES[name]
    family = family_of(config)
    shapes = {k: shape for k, (shape, _) in family.checkpoint_shapes(config).items()}
    g = _g(seed)
    weights, deltas = {}, {}
    for key, sources in family.weight_patch_targets(config).items():
        shape = shapes[key]
        if len(shape) != 2:
            continue
        parts = [s.rows for _, s in sources if s.rows is not None] or [slice(0, shape[0])]
        for rows in parts:
            length = rows.stop - rows.start
            up, down = torch.randn(length, 2, generator=g) * 0.05, torch.randn(2, shape[1], generator=g) * 0.05
            offset = (0, rows.start, length) if length != shape[0] else None
            patch = WeightPatch("lora", {"up": up, "down": down}, strength=strength, alpha=4.0, offset=offset)
            weights.setdefault(key, []).append(patch)
            deltas.setdefault(key, []).append((offset, (strength * (4.0 / 2)) * (up @ down)))
    bias = next(k for k in weights if k.endswith(".weight") and k[:-7] + ".bias" in shapes)[:-7] + ".bias"
    diff = torch.randn(shapes[bias], generator=g) * 0.05
    weights[bias] = [WeightPatch("diff", {"diff": diff}, strength=strength)]
    deltas[bias] = [(None, strength * diff)]
    return WeightPatches(f"{name}-{tag}", weights), deltas


def stacked(*stacks: tuple[WeightPatches, dict]) -> tuple[WeightPatches, list[dict]]:
    """Several LoRA loaders in a row: each weight's patches in loader order."""
    weights: dict = {}
    for patches, _ in stacks:
        for key, ps in patches.weights.items():
            weights.setdefault(key, []).extend(ps)
    return WeightPatches("+".join(p.id for p, _ in stacks), weights), [d for _, d in stacks]


def merged_file(base: str, path: str, deltas: list[dict]) -> str:
    """The base file with each delta added in order, in float32, at the ComfyUI key it names."""
    sd = load_file(base)
    for stack in deltas:
        for key, parts in stack.items():
            w = sd[PREFIX + key].float()
            for offset, delta in parts:
                region = w.narrow(*offset) if offset is not None else w
                region += delta
            sd[PREFIX + key] = w
    save_file(sd, path)
    return path


@pytest.fixture(scope="module", params=NAMES)
def patched(client1, request, tmp_path_factory):
    """(family, the base file, two stacked LoRAs at 0.8 and -0.5, the merged twin's serial latent)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    base = write_checkpoint(str(folder / f"{name}.safetensors"), FAMILIES[name], seed=11, prefix=PREFIX)
    patches, deltas = stacked(lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b"))
    merged = merged_file(base, str(folder / f"{name}-merged.safetensors"), deltas)
    reference = client1.run(job((name, merged))).latent
    plain = client1.run(job((name, base))).latent
    assert rel_err(reference, plain) > 1e-2  # the LoRAs really change the image
    return name, base, patches, reference


def assert_lora_on_file(client1, client2, name: str, path: str, reference_path: str, patches, rtol: float) -> None:
    """A LoRA stack on the file at `path` equals the plain run of `reference_path` (the LoRA's effect written into
    a file) within `rtol` at one worker, with the same bytes per rank as without it, and within EXACT_RTOL under
    Ulysses-2 and PipeFusion-2 (each stage patches its blocks); taking it off restores the file's result."""
    plain = client1.run(job((name, path)))
    reference = client1.run(job((name, reference_path))).latent
    got = client1.run(with_patches(job((name, path)), patches))
    assert rel_err(reference, plain.latent) > 1e-2  # the LoRAs really change the image
    assert rel_err(got.latent, reference) <= rtol
    assert got.stats[0]["param_bytes"] == plain.stats[0]["param_bytes"]  # no dense copy held
    for strategy in (S(ulysses_degree=2), S(pipefusion_degree=2, warmup_steps=6)):
        result = client2.run(with_patches(job((name, path), strategy), patches))
        assert rel_err(result.latent, reference) <= EXACT_RTOL, strategy.label()
    assert rel_err(client2.run(job((name, path), S(ulysses_degree=2))).latent, plain.latent) <= EXACT_RTOL


def with_patches(family_job, patches):
    return dataclasses.replace(family_job, weight_patches=patches)


def test_lora_stack_at_one_worker_equals_the_merged_file(client1, patched):
    name, base, patches, reference = patched
    result = client1.run(with_patches(job((name, base)), patches))
    assert rel_err(result.latent, reference) <= PATCH_RTOL
    assert result.stats[0]["patched_tensors"] == len(patches.weights)


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2),
                                      S(pipefusion_degree=2, warmup_steps=6)], ids=lambda s: s.label())
def test_lora_stack_under_exact_strategies_equals_the_merged_file(patched, client2, strategy):
    name, base, patches, reference = patched
    result = client2.run(with_patches(job((name, base), strategy), patches))
    assert rel_err(result.latent, reference) <= EXACT_RTOL
    counts = [s["patched_tensors"] for s in result.stats]
    if strategy.pipefusion_degree > 1:  # each stage patches only the weights it holds
        assert max(counts) < len(patches.weights) <= sum(counts)
    else:
        assert counts == [len(patches.weights)] * 2


def test_swapping_and_removing_loras_repatches_without_reloading(tmp_path, client2):
    name = "kontext"
    base = write_checkpoint(str(tmp_path / "base.safetensors"), FAMILIES[name], seed=11, prefix=PREFIX)
    a, b = lora_stack(name, 1, 0.8, "a"), lora_stack(name, 2, -0.5, "b")
    expected = {}
    client = client2  # the module's workers: the count of model loads below is taken relative to theirs
    for tag, deltas in (("a", [a[1]]), ("b", [b[1]]), ("none", [])):
        expected[tag] = client.run(job((name, merged_file(base, str(tmp_path / f"{tag}.safetensors"), deltas)),
                                       S(ulysses_degree=2))).latent
    loads = client.model_loads
    runs = [("a", a[0]), ("b", b[0]), ("none", None), ("a", a[0])]
    for tag, patches in runs:
        result = client.run(with_patches(job((name, base), S(ulysses_degree=2)), patches))
        assert rel_err(result.latent, expected[tag]) <= EXACT_RTOL, tag
    assert client.model_loads == loads + 1  # the base file once; every swap after it only re-patched
    # The workers keep the patches they were sent: a job naming the same id does not send the tensors again
    # (here: zeros under a's id, which would undo the LoRA if they were used).
    zeros = WeightPatches(a[0].id, {k: [dataclasses.replace(p, tensors={s: torch.zeros_like(t) for s, t in
                                                                         p.tensors.items()}) for p in ps]
                                    for k, ps in a[0].weights.items()})
    result = client.run(with_patches(job((name, base), S(ulysses_degree=2)), zeros))
    assert rel_err(result.latent, expected["a"]) <= EXACT_RTOL
    client.kill()  # fresh workers hold nothing: the client sends the tensors again
    result = client.run(with_patches(job((name, base), S(ulysses_degree=2)), a[0]))
    assert rel_err(result.latent, expected["a"]) <= EXACT_RTOL


def test_a_strategy_change_reloads_and_repatches_the_new_stage(tmp_path, client2):
    """PipeFusion's stages hold other blocks than Ulysses' ranks: the reload re-applies the kept patches."""
    name = "kontext"
    base = write_checkpoint(str(tmp_path / "base.safetensors"), FAMILIES[name], seed=11, prefix=PREFIX)
    patches, deltas = lora_stack(name, 1, 0.8, "a")
    merged = merged_file(base, str(tmp_path / "merged.safetensors"), [deltas])
    reference = client2.run(job((name, merged), S(ulysses_degree=2))).latent
    for strategy in (S(ulysses_degree=2), S(pipefusion_degree=2, warmup_steps=6), S(ulysses_degree=2)):
        got = client2.run(with_patches(job((name, base), strategy), patches)).latent
        assert rel_err(got, reference) <= EXACT_RTOL, strategy.label()


def test_bad_patches_fail_with_one_sentence_before_work(tmp_path):
    name = "kontext"
    base = write_checkpoint(str(tmp_path / "base.safetensors"), FAMILIES[name], seed=11, prefix=PREFIX)
    patches, _ = lora_stack(name, 1, 0.8, "a")
    unknown = WeightPatches("u", {"input_blocks.0.0.weight": next(iter(patches.weights.values()))})
    nan = WeightPatches("n", {k: [dataclasses.replace(p, strength=float("nan")) for p in ps]
                              for k, ps in patches.weights.items()})
    client = RuntimeClient("cpu:1", threads_per_worker=1)
    try:
        with pytest.raises(ConfigError, match="a LoRA patches 'input_blocks.0.0.weight', which this Flux"):
            client.run(with_patches(job((name, base)), unknown))
        with pytest.raises(ConfigError, match="set a finite strength on the LoRA loader"):
            client.run(with_patches(job((name, base)), nan))
        assert not client.procs  # refused before any worker started
    finally:
        client.shutdown()


def test_patches_cross_the_channel_as_tensors_not_code():
    patches, _ = lora_stack("kontext", 1, 0.8, "a")
    from parallel_runtime.runtime.protocol import decode, encode

    kind, meta, tensors = decode(encode("job", {"weight_patches": patches.meta()}, patches.tensors()))
    back = WeightPatches.from_message(meta["weight_patches"], tensors)
    assert back.id == patches.id and list(back.weights) == list(patches.weights)
    for key in patches.weights:
        for p, q in zip(patches.weights[key], back.weights[key]):
            assert (p.kind, p.strength, p.alpha, p.offset) == (q.kind, q.strength, q.alpha, q.offset)
            assert all(torch.equal(p.tensors[s], q.tensors[s]) for s in p.tensors)
    assert patches.nbytes() == sum(t.numel() * 4 for t in tensors.values())
