"""FLUX.2 (dev, klein) on the workers: detection in ComfyUI's and diffusers' layouts, the serial model against
diffusers' own Flux2Transformer2DModel on the same file, the strategies, the storage kinds and a LoRA.

The reference loads the file with diffusers' single-file converter (convert_flux2_transformer_checkpoint_to_
diffusers: nothing of the family module's key map) and feeds it as ComfyUI feeds its Flux model for FLUX.2: the
prompt padded at the front to 512 zero tokens (model_base.Flux2.extra_conds), text ids (0, 0, 0, i), image ids
(0, row, col, 0), reference ids (10 k, row, col, 0) for the k-th reference ("index", FLUX.2's default).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.flux2 import Flux2Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

PREFIX = "model.diffusion_model."
# dev-like (guidance embedder) and klein-like (none): 4 heads of 32 (RoPE axes 8 x 4), 2 double + 2 single
# blocks, the SwiGLU 3x wide as released, a 64-wide prompt (Mistral's 15360 / Qwen3's 7680 in real files).
DEV = Flux2Config(hidden_size=128, num_heads=4, head_dim=32, num_layers=2, num_single_layers=2, mlp_hidden=384,
                  context_dim=64)
KLEIN = dataclasses.replace(DEV, guidance_embeds=False)
H, W = 6, 8  # latent height x width: 48 image tokens (a token per latent pixel)
REF_SHAPES = ((4, 6), (5, 3))  # two reference latents: 24 + 15 reference tokens
# One fp32 forward in another op order than diffusers': ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
STORAGE_RTOL = 1e-5  # the quantized file and its fp32 twin hold the same numbers (see tests/test_wan.py)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2")
    return {name: write_checkpoint(str(folder / f"flux2_{name}_tiny.safetensors"), config, seed=seed, prefix=PREFIX)
            for name, config, seed in (("dev", DEV, 1), ("klein", KLEIN, 2))}


def conditioning(seed: int, tokens: int = 7, references: bool = False) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    refs = tuple(torch.randn(1, 128, h, w, generator=g) for h, w in REF_SHAPES) if references else ()
    return Conditioning(torch.randn(1, tokens, DEV.context_dim, generator=g), torch.zeros(1, 0), guidance=4.0,
                        references=refs)


def call_job(path: str, strategy: S, negative: bool = True, references: bool = False) -> Job:
    """One stock-sampler call: cond and uncond rows, prompts of 7 and 11 tokens (both padded to 512)."""
    g = torch.Generator().manual_seed(3)
    rows = 2 if negative else 1
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(rows, 128, H, W, generator=g),
               conditioning(1, references=references),
               conditioning(2, tokens=11, references=references) if negative else None,
               timestep=torch.tensor([0.87, 0.87][:rows]))


# -- the reference ---------------------------------------------------------------------------------------


def diffusers_model(path: str, config: Flux2Config):
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    sd = {k.removeprefix(PREFIX): v for k, v in load_file(path).items()}
    model = Flux2Transformer2DModel(**config.diffusers_kwargs())
    model.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(sd), strict=True)
    return model.eval()


def grid(rows: int, cols: int, index: float) -> torch.Tensor:
    ids = torch.zeros(rows, cols, 4)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(-1, 4)


@torch.no_grad()
def reference_call(path: str, job: Job, config: Flux2Config) -> torch.Tensor:
    model = diffusers_model(path, config)
    out = []
    for row, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        cond = torch.nn.functional.pad(branch.cond, (0, 0, 512 - branch.cond.shape[1], 0))
        txt_ids = torch.zeros(512, 4)
        txt_ids[:, 3] = torch.arange(512)
        x = job.latent[row:row + 1].flatten(2).transpose(1, 2)
        tokens, ids = [x], [grid(H, W, 0)]
        for k, ref in enumerate(branch.references):
            tokens.append(ref.flatten(2).transpose(1, 2))
            ids.append(grid(*ref.shape[-2:], 10 * (k + 1)))
        guidance = torch.tensor([branch.guidance]) if config.guidance_embeds else None
        v = model(hidden_states=torch.cat(tokens, 1), encoder_hidden_states=cond, timestep=job.timestep[row:row + 1],
                  img_ids=torch.cat(ids), txt_ids=txt_ids, guidance=guidance).sample[:, :H * W]
        out.append(v.transpose(1, 2).reshape(1, 128, H, W))
    return torch.cat(out)


# -- detection -------------------------------------------------------------------------------------------


def test_flux2_files_are_detected_in_both_layouts(files, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    for name, config in (("dev", DEV), ("klein", KLEIN)):
        with open_checkpoint(files[name]) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("flux2", "bfl", PREFIX)
        assert model_config(files[name]) == config
        twin = write_checkpoint(str(tmp_path / f"{name}_diffusers.safetensors"), config, seed=1, layout="diffusers",
                                prefix="transformer.")
        assert model_config(twin) == config
    assert (DEV.variant, DEV.title, KLEIN.variant, KLEIN.title) == ("dev", "FLUX.2 dev", "klein", "FLUX.2 klein")
    assert (DEV.axes_dims_rope, DEV.num_blocks, DEV.latent_channels, DEV.patch_size) == ((8, 8, 8, 8), 4, 128, 1)
    released = dataclasses.replace(KLEIN, hidden_size=3072, num_heads=24, head_dim=128, context_dim=7680)
    assert (released.title, released.text_encoders) == ("FLUX.2 klein 4B", "Qwen3 4B (CLIPLoader type flux2)")


def test_flux2_look_alikes_are_refused_in_one_sentence(files, tmp_path):
    sd = load_file(files["dev"])
    biased = str(tmp_path / "biased.safetensors")
    save_file({**sd, PREFIX + "img_in.bias": torch.zeros(128)}, biased)
    with pytest.raises(ModelFileError, match="has FLUX.2's shared modulation but also 'img_in.bias'"):
        model_config(biased)
    wide = str(tmp_path / "wide_input.safetensors")
    save_file({**sd, PREFIX + "img_in.weight": torch.zeros(128, 256)}, wide)
    with pytest.raises(ModelFileError, match="reads 256 latent channels but predicts 128"):
        model_config(wide)
    # Flux.1's detection never takes a FLUX.2 file; one stripped of its modulation reads as a damaged Flux.1 file.
    from parallel_runtime.models.families.flux import match_layout

    assert match_layout(list(sd)) is None
    headless = str(tmp_path / "no_modulation.safetensors")
    save_file({k: v for k, v in sd.items() if "stream_modulation" not in k}, headless)
    with pytest.raises(ModelFileError, match="so it is not a complete Flux.1 .* re-download it"):
        model_config(headless)


# -- one worker against diffusers --------------------------------------------------------------------------


@pytest.mark.parametrize("name,references", [("dev", False), ("dev", True), ("klein", True)],
                         ids=["dev", "dev_references", "klein_references"])
def test_flux2_one_worker_equals_diffusers(files, client1, name, references):
    config = DEV if name == "dev" else KLEIN
    job = call_job(files[name], S(), references=references)
    out = client1.run(job).latent
    assert out.shape == (2, 128, H, W)
    err = rel_err(out, reference_call(files[name], job, config))
    print(f"\nFLUX.2 {name}{' + references' if references else ''} serial rel. error {err:.2e}")
    assert err < SERIAL_RTOL


# -- strategies ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
@pytest.mark.parametrize("references", [False, True], ids=["plain", "references"])
def test_flux2_exact_strategies_equal_one_worker(files, client1, client2, strategy, references):
    """Prompts of 7 and 11 tokens (both padded to 512, run as separate forward passes as ComfyUI batches them by
    their unpadded length); PipeFusion's call without a schedule step is its warm-up (exact)."""
    job = call_job(files["dev"], strategy, references=references)
    serial = client1.run(dataclasses.replace(job, strategy=S())).latent
    err = rel_err(client2.run(job).latent, serial)
    print(f"\nFLUX.2 {strategy}{' + references' if references else ''} rel. error {err:.2e} vs 1 worker")
    assert err < EXACT_RTOL


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ulysses_degree=2)],
                         ids=["ulysses2xring2", "cfg2xulysses2"])
def test_flux2_four_worker_hybrids_with_references_equal_diffusers(files, client4, strategy):
    job = call_job(files["klein"], strategy, references=True)
    err = rel_err(client4.run(job).latent, reference_call(files["klein"], job, KLEIN))
    print(f"\nFLUX.2 klein + references {strategy} rel. error {err:.2e} vs diffusers")
    assert err < EXACT_RTOL


def test_flux2_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(files, client1, client2):
    """A whole 6-step run at cfg 3 with two references (Parallel Sampler's path): exact strategies equal serial;
    PipeFusion after one warm-up step reads stale K/V and lands nearer serial than naive patch parallelism,
    which never sees the other half of the image."""
    g = torch.Generator().manual_seed(7)
    job = Job(ModelSpec(files["dev"]), S(), SamplingSpec(steps=6, cfg=3.0, seed=1),
              torch.randn(1, 128, H, W, generator=g) * 0.5, conditioning(1, references=True),
              conditioning(2, references=True))  # one prompt length: PipeFusion pipelines both branches
    check_denoise_loop(job, client1, client2, "FLUX.2", EXACT_RTOL)


def test_flux2_prompts_of_different_lengths_pipeline_together_once_padded(files, client1, client2):
    """Prompts of 7 and 11 tokens both pad to FLUX.2's 512, so they share one token layout: PipeFusion without CFG
    parallel pipelines them in one lane (Flux.1 runs unequal prompt lengths as two), all steps warm-up = serial
    (exact), and one stale step lands nearer serial than naive patch."""
    g = torch.Generator().manual_seed(8)
    job = Job(ModelSpec(files["dev"]), S(), SamplingSpec(steps=4, cfg=3.0, seed=2),
              torch.randn(1, 128, H, W, generator=g) * 0.5, conditioning(1), conditioning(2, tokens=11))
    assert job.positive.cond.shape[1] != job.negative.cond.shape[1]
    serial = client1.run(job).latent
    warm = rel_err(client2.run(dataclasses.replace(job, strategy=S(pipefusion_degree=2, num_pipeline_patch=2,
                                                                   warmup_steps=4))).latent, serial)
    stale = rel_err(client2.run(dataclasses.replace(job, strategy=S(pipefusion_degree=2, num_pipeline_patch=2,
                                                                    warmup_steps=1))).latent, serial)
    naive = rel_err(client2.run(dataclasses.replace(job, strategy=S(naive_patch_degree=2))).latent, serial)
    print(f"\nFLUX.2, prompts 7 / 11 tokens, PipeFusion-2: warm {warm:.2e}, stale {stale:.2e}, naive patch {naive:.2e}")
    assert warm < EXACT_RTOL and stale < naive


# -- the file kinds users download: fp8 scaled, ComfyUI-quantized fp8 (fp8mixed), GGUF -------------------------


@pytest.fixture(scope="module")
def storage_twins(tmp_path_factory):
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins
    from test_gguf import gguf_twins

    folder = tmp_path_factory.mktemp("flux2-storage")
    return [("fp8_scaled", *fp8_twins(folder, "flux2", torch.float8_e4m3fn, True, config=DEV)),
            ("fp8mixed", *comfy_quant_twins(folder, "flux2", "float8_e4m3fn", config=DEV)),
            ("gguf", *gguf_twins(folder, "flux2", config=DEV, arch="flux"))]


def test_flux2_quantized_files_equal_their_fp32_twins_and_stay_compact(storage_twins, client1, client2):
    """Each kind at 1 worker equals the twin; under Ulysses-2 too; each rank holds the compact weights."""
    for kind, quant, meant in storage_twins:
        assert model_config(quant) == DEV, kind
        got, ref = client1.run(call_job(quant, S(), references=True)), client1.run(call_job(meant, S(), references=True))
        err, held = rel_err(got.latent, ref.latent), got.stats[0]["param_bytes"] / ref.stats[0]["param_bytes"]
        split = rel_err(client2.run(call_job(quant, S(ulysses_degree=2), references=True)).latent, got.latent)
        print(f"\nFLUX.2 {kind}: {err:.2e} vs fp32 twin, {held:.2f} of its bytes; Ulysses-2 {split:.2e}")
        assert err <= STORAGE_RTOL, kind
        assert held < 0.6, kind  # 1-byte (or less) matrices
        assert split <= EXACT_RTOL, kind


# -- LoRA ------------------------------------------------------------------------------------------------------


def test_flux2_lora_in_comfyui_names_lands(files, client1, client2, tmp_path):
    """A LoRA named as ComfyUI names FLUX.2's weights (fused qkv rows by offset, the fused single-block input,
    a shared modulation and the final layer's swapped modulation) equals the file with the deltas merged in."""
    from parallel_runtime.spec import WeightPatch, WeightPatches

    g = torch.Generator().manual_seed(9)
    sd = load_file(files["dev"])
    weights, merged = {}, dict(sd)
    for key, offset in (("double_blocks.0.img_attn.qkv.weight", (0, 128, 128)), ("double_blocks.1.txt_mlp.0.weight", None),
                        ("single_blocks.1.linear1.weight", None), ("double_stream_modulation_img.lin.weight", None),
                        ("final_layer.adaLN_modulation.1.weight", None)):
        rows = offset[2] if offset else sd[PREFIX + key].shape[0]
        up, down = torch.randn(rows, 2, generator=g) * 0.1, torch.randn(2, sd[PREFIX + key].shape[1], generator=g) * 0.1
        weights[key] = [WeightPatch("lora", {"up": up, "down": down}, strength=0.8, alpha=4.0, offset=offset)]
        w = merged[PREFIX + key].clone()
        (w.narrow(*offset) if offset else w).add_((0.8 * 4.0 / 2) * (up @ down))
        merged[PREFIX + key] = w
    merged_path = str(tmp_path / "merged.safetensors")
    save_file(merged, merged_path)
    patches = WeightPatches("flux2-lora", weights)
    want = client1.run(call_job(merged_path, S())).latent
    assert rel_err(want, client1.run(call_job(files["dev"], S())).latent) > 1e-3  # the LoRA matters
    for client, strategy in ((client1, S()), (client2, S(ulysses_degree=2))):
        got = client.run(dataclasses.replace(call_job(files["dev"], strategy), weight_patches=patches)).latent
        err = rel_err(got, want)
        print(f"\nFLUX.2 LoRA {strategy} rel. error {err:.2e} vs merged file")
        assert err < 1e-5  # the merged file rounds each patched weight to fp32 once, as the workers do


# -- memory of the released sizes -------------------------------------------------------------------------------


def test_flux2_memory_per_rank_for_the_released_sizes():
    """Parameters counted from the module tree match the releases (dev 32.2B: flux2_dev bf16 is 64.4 GB; klein 9B
    and 4B); at 1024 px (4,096 tokens, the prompt's 512) in bf16 dev fits one 80 GB GPU whole, and its PipeFusion-4
    stages fit 24 GB cards (each holds a quarter of the blocks plus the shared modulations), Ulysses/Ring do not."""
    from parallel_runtime.bench.models import RELEASE_SHAPES
    from parallel_runtime.models.families.flux2 import _meta_model
    from parallel_runtime.planning.costmodel import rank_memory

    dev, klein9 = RELEASE_SHAPES["flux2"][0], RELEASE_SHAPES["flux2_klein"][0]
    klein4 = dataclasses.replace(klein9, hidden_size=3072, num_heads=24, num_layers=5, num_single_layers=20,
                                 mlp_hidden=9216, context_dim=7680)
    for config, released in ((dev, 32.2e9), (klein9, 9.08e9), (klein4, 3.88e9)):
        params = sum(p.numel() for p in _meta_model(config).parameters())
        assert abs(params / released - 1) < 0.01, (config.title, params)

    def plan(strategy):
        return rank_memory(strategy, dev, text_tokens=512, image_tokens=4096, batch=1, cfg=1.0, weight_bytes=2,
                           act_bytes=2)

    gib = 2**30
    assert plan(S())["total"] < 0.9 * 79 * gib  # one 80 GB GPU (ComfyUI's usable 90%)
    assert plan(S(ulysses_degree=4))["total"] > 0.9 * 23.5 * gib  # replicated weights never fit a 24 GB card
    assert plan(S(pipefusion_degree=4))["total"] < 0.9 * 23.5 * gib
    assert 0.25 < plan(S(pipefusion_degree=4))["params"] / plan(S())["params"] < 0.3
