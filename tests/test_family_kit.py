"""The family kit (models/detection, shapes, patchify, rope, blocks, conditioning): a newcomer written from it alone
(tests/kit_flux.py, a Flux.1-like family) is small and runs; and the kit's pieces are the ones the families it was
pulled from compute, so adopting them changes no number.

What the newcomer is checked against, on one tiny random diffusers-layout file:
  * diffusers' FluxTransformer2DModel.forward (one model call), rel. L2 <= 1e-5 in fp32;
  * the runtime's own Flux family, the whole denoise run serially in-process (Denoiser at world 1): identical.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import rel_err
from parallel_runtime.bench.runs import make_job
from parallel_runtime.distributed.comm import Comm
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.models import registry
from parallel_runtime.models.conditioning import modulate
from parallel_runtime.models.detection import Signature, match_signatures
from parallel_runtime.models.patchify import patchify, unpatchify
from parallel_runtime.models.rope import grid_ids, video_grid_ids
from parallel_runtime.models.tiny import _random_tensors
from parallel_runtime.spec import StrategySpec
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.strategies.denoise import Denoiser
from parallel_runtime.weights.checkpoint import open_checkpoint

import kit_flux
from kit_flux import KIT_FLUX, KitFluxConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from family_lines import count  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TINY = KitFluxConfig(hidden_size=64, num_heads=2, num_layers=2, num_single_layers=2, context_dim=32, pooled_dim=24)
LATENT = (1, 16, 8, 12)  # 4 x 6 patches


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kit") / "kit-flux.safetensors")
    tensors = _random_tensors(KIT_FLUX.checkpoint_shapes(TINY), seed=5, dtype=torch.float32)
    save_file({"transformer." + k: v for k, v in tensors.items()}, path)  # a pipeline's transformer, saved whole
    return path


def _load(family, path: str):
    with open_checkpoint(path) as reader:
        match = family.match(reader.keys())
        config = family.infer_config(reader, match, os.path.basename(path))
        model = family.build(config, reader, match, owned=lambda name: True, dtype=torch.float32, device="cpu")
    context = AttentionContext()
    return config, family.adapter(config, model, family.pipeline_stages(config, 1)[0], context), model, context


def test_the_newcomer_is_a_small_module():
    # The bound for a Flux-like or Wan-like newcomer once the kit exists (measured: docs/adding-a-family.md).
    lines, _, _ = count(pathlib.Path(kit_flux.__file__))
    assert lines <= 200, f"tests/kit_flux.py is {lines} lines"


def test_the_newcomer_reads_its_file_from_shapes_alone(tiny_file):
    with open_checkpoint(tiny_file) as reader:
        match = KIT_FLUX.match(reader.keys())
        assert (match.layout, match.prefix) == ("diffusers", "transformer.")
        assert KIT_FLUX.infer_config(reader, match, "kit") == TINY
    # the seam plans it like any family: 4 blocks over 2 PipeFusion stages, every parameter owned by one stage's set
    stages = KIT_FLUX.pipeline_stages(TINY, 2)
    assert [sum(len(r) for r in s) for s in stages] == [2, 2]
    names = KIT_FLUX.meta_model(TINY).state_dict()
    first = KIT_FLUX.stage_ownership(TINY, stages[0], True, False)
    last = KIT_FLUX.stage_ownership(TINY, stages[1], False, True)
    assert all(first(n) or last(n) for n in names)
    assert not any(first(n) for n in names if n.startswith("proj_out."))


def test_one_model_call_matches_diffusers(tiny_file):
    """pack -> embed -> blocks -> head -> unpack against FluxTransformer2DModel.forward on the same weights."""
    from diffusers import FluxTransformer2DModel

    config, adapter, model, _ = _load(KIT_FLUX, tiny_file)
    reference = FluxTransformer2DModel(**config.diffusers_kwargs()).eval()
    reference.load_state_dict(model.state_dict())  # diffusers' own attention processors, not the strategies'
    g = torch.Generator().manual_seed(0)
    latent, text = torch.randn(LATENT, generator=g), torch.randn(1, 7, config.context_dim, generator=g)
    pooled, sigma, guidance = torch.randn(1, config.pooled_dim, generator=g), torch.tensor([0.6]), torch.tensor([3.5])
    h, w = LATENT[2:]
    with torch.no_grad():
        image, prompt = adapter.embed_image(adapter.pack(latent), None, (h, w)), adapter.embed_text(text)
        temb, rope = adapter.timestep_embedding(sigma, pooled, guidance), adapter.rope(7, h, w)
        image, _ = adapter.run_blocks(image, prompt, temb, rope)
        ours = adapter.unpack(adapter.head(image, temb), h, w)
        out = reference(hidden_states=adapter.pack(latent), encoder_hidden_states=text, pooled_projections=pooled,
                        timestep=sigma, img_ids=grid_ids(h // 2, w // 2), txt_ids=torch.zeros(7, 3),
                        guidance=guidance).sample
    # fp32 bound: the strategies' local attention and diffusers' SDPA sum in another order (~1e-7 per op)
    assert rel_err(ours, adapter.unpack(out, h, w)) <= 1e-5


def test_serial_denoise_equals_the_runtime_flux_family(tiny_file):
    """The same file run by the newcomer and by families/flux*.py (which claims diffusers-layout Flux.1 files too):
    the same diffusers modules, positions, embeddings and sampler, so the same latent."""
    results = []
    with open_checkpoint(tiny_file) as reader:
        flux = registry.detect_family(reader.keys())[0]
    assert flux.name == "flux"
    for family in (KIT_FLUX, flux):
        config, adapter, _, context = _load(family, tiny_file)
        job = make_job(tiny_file, config, StrategySpec(), LATENT, 7, cfg=2.0, steps=3)
        with torch.no_grad():
            results.append(Denoiser(adapter, Topology(), Comm(Topology()), context).run(job))
    assert results[1] is not None and torch.isfinite(results[1]).all()
    assert torch.equal(results[0], results[1])  # same ops in the same order: not a bit apart


def test_the_cost_probe_runs_a_newcomer_block():
    probe = KIT_FLUX.probe_block(TINY, 3, AttentionContext(), 8, 24, torch.float32, "cpu")
    with torch.no_grad():
        image, text = probe()
    assert image.shape == (1, 24, 64) and text.shape == (1, 8, 64) and torch.isfinite(image).all()


@pytest.mark.parametrize("shape", [(2, 16, 3, 8, 12), (2, 16, 8, 12)])
def test_patchify_is_the_patch_convolution_s_token_layout(shape):
    """The kit's 1x2x2 patches carry (c, ph, pw) in a patch conv's weight order, frame after frame and row-major (as
    Wan's patch_embedding reads them; Wan packs with the kit): a linear layer on the tokens with the conv's
    flattened weights is the conv. A 4-D reference image packs as one frame."""
    latent = torch.randn(shape, dtype=torch.float64)
    video = latent if latent.ndim == 5 else latent.unsqueeze(2)
    weight = torch.randn(5, shape[1], 1, 2, 2, dtype=torch.float64)
    conv = F.conv3d(video, weight, stride=(1, 2, 2)).flatten(2).transpose(1, 2)
    tokens = patchify(latent, 2)
    assert torch.allclose(tokens @ weight.flatten(1).T, conv, rtol=0, atol=1e-12)  # float64: round-off only
    size = (shape[2], *shape[3:]) if len(shape) == 5 else (1, *shape[2:])
    assert torch.equal(unpatchify(tokens, size, 2).reshape(latent.shape), latent)
    assert torch.equal(patchify(unpatchify(tokens, size, 2), 2), tokens)
    ids = video_grid_ids(3, 4, 6)  # token j of that grid: frame j // 24, row (j // 6) % 4, column j % 6
    assert ids[29].tolist() == [1.0, 0.0, 5.0] and ids.shape == (72, 3)


def test_one_token_per_pixel_round_trips_in_both_directions():
    video = torch.randn(1, 32, 3, 4, 6)
    tokens = patchify(video, 1)
    assert tokens.shape == (1, 72, 32) and torch.equal(tokens[0, 7], video[0, :, 0, 1, 1])
    assert torch.equal(unpatchify(tokens, (3, 4, 6), 1), video)


def test_modulate_is_one_fused_multiply_add():
    g = torch.Generator().manual_seed(1)
    x, shift, scale = (torch.randn(2, 5, 8, generator=g) for _ in range(3))
    assert torch.equal(modulate(x, shift, scale), torch.addcmul(shift, x, 1 + scale))


@pytest.mark.parametrize("keys, found", [
    (["model.diffusion_model.a.weight", "model.diffusion_model.blocks.0.x"], ("comfy", "model.diffusion_model.")),
    (["a.weight", "blocks.0.x"], ("comfy", "")),
    (["a.weight", "blocks.0.x", "b.weight"], None),  # a key the layout must not have
    (["a.weight"], None),  # no block
    (["transformer.a.weight", "transformer.blocks.3.x"], None),  # a prefix the layout is not read under
])
def test_a_signature_reads_keys_blocks_absent_keys_and_prefixes(keys, found):
    signature = Signature("comfy", ("a.weight",), ("blocks",), absent=("b.weight",))
    match = match_signatures(keys, signature)
    assert (None if match is None else (match.layout, match.prefix)) == found


def test_checkpoint_shapes_read_the_rank_where_asked_and_the_files_names():
    """shapes_of_model: a kind of (name, tensor) sees the tensor (a 1-d weight is a norm), `key` gives the file's
    names, and a kind of the name alone still works (Wan's, Lumina 2's)."""
    from parallel_runtime.models.shapes import plain_kind, shapes_of_model

    with torch.device("meta"):
        tree = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    shapes = shapes_of_model(tree.state_dict(), plain_kind, key=lambda n: "diffusion." + n)
    assert shapes == {"diffusion.0.weight": ((3, 4), "weight"), "diffusion.0.bias": ((3,), "bias"),
                      "diffusion.1.weight": ((3,), "norm"), "diffusion.1.bias": ((3,), "bias")}
    assert shapes_of_model(tree.state_dict(), lambda name: "table")["1.weight"] == ((3,), "table")


# sha256 of each family's list(checkpoint_shapes(bench model).items()), read before these families moved onto
# shapes_of_model: the key order, shapes and kinds set every random fixture's numbers, so they must not move.
SHAPES_DIGESTS = {"hidream": "c4545b009bd6c575", "kandinsky5": "79530cf49fcc84d1", "kandinsky6": "9e82c1dbfaab8afb",
                  "ltx2": "a91358135e719d6a", "wan": "24df7166f91f691d"}


@pytest.mark.parametrize("family", sorted(SHAPES_DIGESTS))
def test_families_on_the_shapes_helper_write_the_fixtures_they_wrote_by_hand(family):
    import hashlib
    import importlib

    from parallel_runtime.bench.models import BENCH_FAMILIES

    module = importlib.import_module(f"parallel_runtime.models.families.{family}")
    items = list(module.checkpoint_shapes(BENCH_FAMILIES[family]).items())
    assert hashlib.sha256(repr(items).encode()).hexdigest()[:16] == SHAPES_DIGESTS[family]
