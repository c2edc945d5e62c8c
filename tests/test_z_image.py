"""Z-Image (NextDiT with learned pad tokens) on the workers: detection in ComfyUI's and diffusers' layouts, the
serial model against diffusers' own ZImageTransformer2DModel on the same file, every exact strategy, the
denoise loop, storage kinds and a LoRA in ComfyUI's key names.

The reference is diffusers' model, loaded through diffusers' own single-file converter (not this project's key
map), with two settings where the family follows ComfyUI instead (stated in z_image.py): the per-head q/k RMS
norms use float32's eps (ComfyUI's RMSNorm without eps; diffusers' 1e-5 moves the output by ~1e-6 here, printed),
and the tiny model's t_embedder is as wide as ComfyUI builds it (min(dim, 1024); diffusers fixes 1024, which the
released 3840-wide model has either way). ComfyUI's NextDiT returns the negated head output, as the diffusers
pipeline negates it. The 4 x 6 token image has 8 pad rows and the 9- and 11-token prompts 23 and 21: a pad row
that went missing, took the wrong RoPE id or was dropped from one shard's keys is an O(1e-2) error.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.lumina2 import Lumina2Config
from parallel_runtime.models.families.z_image import ZImageConfig
from parallel_runtime.models.registry import detect_family, family_of
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, WeightPatch, WeightPatches
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

PREFIX = "model.diffusion_model."
# 6 heads of 32 (RoPE axes 8, 12, 12: the released 32/48/48 of 128 scaled), 2 refiner blocks per stream and 2
# layers; width 192 keeps diffusers' int(dim / 3 * 8) MLP equal to ComfyUI's multiple-of-256 one (512). The prompt
# is 32 wide (Qwen3 4B's 2560 in real files); adaLN input min(192, 256) = 192, t_embedder hidden min(192, 1024).
TINY = ZImageConfig(hidden_size=192, num_heads=6, num_kv_heads=6, num_layers=2, num_refiner_layers=2, ffn_dim=512,
                    cap_feat_dim=32, time_hidden=192)
H, W = 8, 12  # latent height x width: 4 x 6 = 24 image tokens, padded with 8 x_pad_token rows to 32
# One fp32 forward in another op order than the reference: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
# A quantized file against its fp32 twin holding the values it means: only the blocking of equal operands differs
# (GGUF dequantizes per layer in fp32), as in tests/test_fp8.py and tests/test_gguf.py.
STORAGE_RTOL = 1e-5


@pytest.fixture(scope="module")
def z_paths(tmp_path_factory):
    """(ComfyUI-layout file, its diffusers-layout twin with the same values)."""
    folder = tmp_path_factory.mktemp("z_image")
    comfy = write_checkpoint(str(folder / "z_image_tiny.safetensors"), TINY, seed=1, prefix=PREFIX)
    diffusers = write_checkpoint(str(folder / "z_image_tiny_diffusers.safetensors"), TINY, seed=1, layout="diffusers")
    return comfy, diffusers


def conditioning(seed: int, tokens: int = 9) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, tokens, TINY.cap_feat_dim, generator=g), torch.zeros(1, 0))


def call_job(path: str, strategy: S, negative: bool = True) -> Job:
    g = torch.Generator().manual_seed(3)
    rows = 2 if negative else 1
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(rows, 16, H, W, generator=g),
               conditioning(1), conditioning(2, tokens=11) if negative else None, timestep=torch.full((rows,), 0.87))


# -- the reference ---------------------------------------------------------------------------------------


def diffusers_model(path: str, comfy_eps: bool = True):
    """diffusers' ZImageTransformer2DModel holding the ComfyUI file's tensors (converted by diffusers)."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    from diffusers.models.transformers.transformer_z_image import TimestepEmbedder

    c = TINY
    model = ZImageTransformer2DModel(in_channels=16, dim=c.hidden_size, n_layers=c.num_layers,
                                     n_refiner_layers=c.num_refiner_layers, n_heads=c.num_heads,
                                     n_kv_heads=c.num_kv_heads, cap_feat_dim=c.cap_feat_dim, axes_dims=[8, 12, 12])
    model.t_embedder = TimestepEmbedder(min(c.hidden_size, 256), mid_size=min(c.hidden_size, 1024))  # ComfyUI's width
    model.load_state_dict(convert_z_image_transformer_checkpoint_to_diffusers(load_file(path)), strict=True)
    if comfy_eps:  # ComfyUI's per-head RMSNorm has no eps: float32's
        for name, module in model.named_modules():
            if name.endswith(("norm_q", "norm_k")):
                module.eps = torch.finfo(torch.float32).eps
    return model.eval()


@torch.no_grad()
def reference_call(path: str, job: Job, comfy_eps: bool = True) -> torch.Tensor:
    """Each branch's row through diffusers' forward at t = 1 - sigma, negated as ComfyUI's NextDiT returns it."""
    model = diffusers_model(path, comfy_eps)
    out = []
    for row, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        sample = model([job.latent[row][:, None]], 1.0 - job.timestep[row:row + 1], [branch.cond[0]]).sample[0]
        out.append(-sample[:, 0][None])
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference(z_paths):
    job = call_job(z_paths[0], S())
    return job, reference_call(z_paths[0], job)


# -- detection -------------------------------------------------------------------------------------------


def test_z_image_files_are_detected_in_both_layouts_and_look_alikes_refused(z_paths, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    comfy, diffusers = z_paths
    for path, layout, prefix in ((comfy, "comfy", PREFIX), (diffusers, "diffusers", "")):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("z_image", layout, prefix)
        assert model_config(path) == TINY
    assert (TINY.rope_axes, TINY.adaln_dim, TINY.num_blocks) == ((8, 12, 12), 192, 4)
    assert [k.name for k in TINY.block_kinds] == ["noise_refiner"] * 2 + ["joint"] * 2

    # A Lumina 2 file stays Lumina 2's.
    lumina = Lumina2Config(hidden_size=96, num_heads=4, num_kv_heads=2, num_layers=2, num_refiner_layers=2,
                           ffn_dim=256, cap_feat_dim=32)
    lumina_path = write_checkpoint(str(tmp_path / "lumina2.safetensors"), lumina, seed=1, prefix=PREFIX)
    with open_checkpoint(lumina_path) as reader:
        assert detect_family(reader.keys())[0].name == "lumina2"

    sd = load_file(comfy)
    cases = {
        # Z-Image's layers without its pad tokens: Ming-Image, or a file cut short.
        "no_pad": ({k: v for k, v in sd.items() if not k.endswith("x_pad_token")},
                   "has Z-Image's layers but not its learned pad tokens"),
        # Lumina 2's layers with pad tokens: no Z-Image modulation to read.
        "lumina_pad": ({**load_file(lumina_path), PREFIX + "cap_pad_token": torch.zeros(1, 96),
                        PREFIX + "x_pad_token": torch.zeros(1, 96)},
                       "so it is not a complete Z-Image DiT"),
        "pixel": ({**sd, PREFIX + "dec_net.cond_embed.weight": torch.zeros(8, 8)}, "is the pixel-space Z-Image model"),
        "omni": ({**sd, PREFIX + "siglip_embedder.0.weight": torch.zeros(8)}, "is Z-Image Omni model"),
        "modulation": ({**sd, PREFIX + "layers.0.adaLN_modulation.0.weight": torch.zeros(4 * 192, 96)},
                       "modulation reads a 96-wide input"),
    }
    for name, (tensors, sentence) in cases.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file(tensors, path)
        with pytest.raises(ModelFileError, match=sentence):
            model_config(path)


# -- one worker against diffusers --------------------------------------------------------------------------


def test_z_image_one_worker_equals_diffusers_in_both_layouts(z_paths, reference, client1):
    job, ref = reference
    with_diffusers_eps = reference_call(z_paths[0], job, comfy_eps=False)
    print(f"\nZ-Image: diffusers' own q/k eps (1e-5) moves the output by {rel_err(with_diffusers_eps, ref):.2e}")
    for path in z_paths:
        out = client1.run(dataclasses.replace(job, model=ModelSpec(path))).latent
        assert out.shape == (2, 16, H, W)
        err = rel_err(out, ref)
        print(f"Z-Image serial ({path.rsplit('/', 1)[-1]}) rel. error {err:.2e} vs diffusers")
        assert err < SERIAL_RTOL


# -- strategies ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_z_image_exact_strategies_equal_diffusers(reference, client2, strategy):
    """Prompts of different lengths (9 and 11 tokens, both padded to 32): separate forward passes, as ComfyUI runs
    them. The 32 prompt rows and the 24 image + 8 pad rows are split over the shards (PipeFusion: the pad rows over
    its patches); PipeFusion's call without a schedule step is its warm-up (exact)."""
    job, ref = reference
    err = rel_err(client2.run(dataclasses.replace(job, strategy=strategy)).latent, ref)
    print(f"\nZ-Image {strategy.label()} rel. error {err:.2e}")
    assert err < EXACT_RTOL


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ulysses_degree=2)],
                         ids=["ulysses2xring2", "cfg2xulysses2"])
def test_z_image_four_worker_hybrids_equal_diffusers(reference, client4, strategy):
    job, ref = reference
    err = rel_err(client4.run(dataclasses.replace(job, strategy=strategy)).latent, ref)
    print(f"\nZ-Image {strategy.label()} rel. error {err:.2e}")
    assert err < EXACT_RTOL


def test_z_image_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(z_paths, client1, client2):
    """A whole 6-step run at cfg 4 (Parallel Sampler's path, Z-Image base's way; Turbo's cfg 1 is the same loop
    without the negative): exact strategies equal serial; PipeFusion after one warm-up step reads stale K/V (pad
    rows included) and lands nearer serial than naive patch parallelism, which never sees the other half."""
    job = Job(ModelSpec(z_paths[0]), S(), SamplingSpec(steps=6, cfg=4.0, seed=1), torch.zeros(1, 16, H, W),
              conditioning(1), conditioning(2))  # one length: the denoise loop's PipeFusion pipelines both prompts
    check_denoise_loop(job, client1, client2, "Z-Image", EXACT_RTOL)


# -- storage kinds and LoRA --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def z_storage_twins(tmp_path_factory):
    """(kind, quantized file, fp32 twin) of the tiny model: the fused qkv of every kind read in row thirds."""
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins
    from test_gguf import gguf_twins

    folder = tmp_path_factory.mktemp("z-image-storage")
    return [("fp8_scaled", *fp8_twins(folder, "z_image", torch.float8_e4m3fn, True, config=TINY)),
            ("comfy_quant_int8", *comfy_quant_twins(folder, "z_image", "int8_tensorwise", config=TINY)),
            ("gguf", *gguf_twins(folder, "z_image", config=TINY, arch="lumina2"))]


def test_z_image_quantized_files_equal_their_fp32_twins_and_stay_compact(z_storage_twins, client1, client2):
    """Each kind at 1 worker equals the twin; under Ulysses-2 too; each rank holds the compact weights."""
    for kind, quant, meant in z_storage_twins:
        assert model_config(quant) == TINY, kind
        got, ref = client1.run(call_job(quant, S())), client1.run(call_job(meant, S()))
        err = rel_err(got.latent, ref.latent)
        print(f"\nZ-Image {kind}: {err:.2e} vs its fp32 twin, {got.stats[0]['param_bytes']} vs "
              f"{ref.stats[0]['param_bytes']} bytes")
        assert err <= STORAGE_RTOL, kind
        assert got.stats[0]["param_bytes"] < 0.6 * ref.stats[0]["param_bytes"], kind  # 1-byte (or less) matrices
        split = client2.run(call_job(quant, S(ulysses_degree=2)))
        assert rel_err(split.latent, got.latent) <= EXACT_RTOL, kind


def test_z_image_lora_in_comfyui_names_equals_the_merged_file(z_paths, client1, client2, tmp_path):
    """LoRA patches keyed by ComfyUI's parameter names, as LoraLoaderModelOnly hands them over: one on the fused
    qkv's key rows only (offset: a diffusers-format to_k LoRA, as comfy/lora.py lands it), one on a whole qkv (each
    third lands on its own projection), and on renamed first- and last-stage weights. Against the base file with
    the deltas written in (float32), at 1 worker, Ulysses-2 and PipeFusion-2 (each stage patches its blocks)."""
    from test_weight_patches import merged_file

    d, g = TINY.hidden_size, torch.Generator().manual_seed(5)
    shapes = {k: shape for k, (shape, _) in family_of(TINY).checkpoint_shapes(TINY).items()}
    targets = {"layers.0.attention.qkv.weight": (0, d, d), "context_refiner.1.attention.qkv.weight": None,
               "noise_refiner.0.feed_forward.w2.weight": None, "x_embedder.weight": None,
               "final_layer.adaLN_modulation.1.weight": None, "layers.1.adaLN_modulation.0.weight": None}
    weights, deltas = {}, {}
    for key, offset in targets.items():
        rows, cols = (offset[2] if offset else shapes[key][0]), shapes[key][1]
        up, down = torch.randn(rows, 2, generator=g) * 0.1, torch.randn(2, cols, generator=g) * 0.1
        weights[key] = [WeightPatch("lora", {"up": up, "down": down}, strength=0.8, alpha=4.0, offset=offset)]
        deltas[key] = [(offset, 0.8 * (4.0 / 2) * (up @ down))]
    patches = WeightPatches("z-image-lora", weights)
    merged = merged_file(z_paths[0], str(tmp_path / "merged.safetensors"), [deltas])
    job = call_job(z_paths[0], S())
    expected = client1.run(dataclasses.replace(job, model=ModelSpec(merged))).latent
    assert rel_err(expected, client1.run(job).latent) > 1e-2  # the LoRA really changes the output
    got = client1.run(dataclasses.replace(job, weight_patches=patches))
    assert rel_err(got.latent, expected) <= SERIAL_RTOL
    assert got.stats[0]["patched_tensors"] == len(targets)
    for strategy in (S(ulysses_degree=2), S(pipefusion_degree=2, num_pipeline_patch=2)):
        result = client2.run(dataclasses.replace(job, strategy=strategy, weight_patches=patches)).latent
        assert rel_err(result, expected) <= EXACT_RTOL, strategy.label()
