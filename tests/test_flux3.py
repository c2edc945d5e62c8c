"""FLUX.3 image klein on the workers: detection and refusals, the serial model against diffusers' own
Flux3Transformer2DModel on the same file and against a model call written here from BFL's FLUX.3 reference on the
file's raw tensors, the strategies, tensor parallelism and the file kinds the templates load.

The diffusers reference loads the file with diffusers' single-file converter (convert_flux3_transformer_checkpoint_
to_diffusers: nothing of the family module's key map). The model-call reference takes nothing from diffusers or the
family module: BFL's JointSingleSeq forward (the module tree whose names ComfyUI's FLUX.3 files keep) for the image
and prompt modes: the sinusoid x1000, per-mode modulation (the prompt at timestep 0), the mode blocks, the single
blocks over [prompt, image], BFL's final layer ([shift, scale] rows) and BFL's rope. Both get the position ids of the
FLUX.3 recipe: prompt token i at (0, 0, 0, i), latent pixel (r, c) at (0, r / 2, c / 2, 0).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.models.families.flux3 import Flux3Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

PREFIX = "model.diffusion_model."
# 4 heads of 32 (RoPE axes 8 x 4), 2 mode blocks per mode and 2 single blocks, the SwiGLU 3x wide as released,
# a 64-wide prompt (eight stacked Qwen3-VL states, 20480 wide, in real files).
TINY = Flux3Config(hidden_size=128, num_heads=4, head_dim=32, num_layers=2, num_single_layers=2, mlp_hidden=384,
                   context_dim=64)
H, W = 6, 8  # latent height x width: 48 image tokens (a token per latent pixel)
# One fp32 forward in another op order than the references: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
STORAGE_RTOL = 1e-5  # the quantized file and its fp32 twin hold the same numbers (see tests/test_wan.py)


@pytest.fixture(scope="module")
def flux3_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("flux3") / "flux3_tiny.safetensors"), TINY, seed=1,
                            prefix=PREFIX)


def conditioning(seed: int, tokens: int = 7, references: bool = False) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    refs = (torch.randn(1, 128, 4, 6, generator=g),) if references else ()
    return Conditioning(torch.randn(1, tokens, TINY.context_dim, generator=g), torch.zeros(1, 0), references=refs)


def call_job(path: str, strategy: S, negative: bool = True) -> Job:
    """One stock-sampler call: cond and uncond rows, prompts of 7 and 11 tokens."""
    g = torch.Generator().manual_seed(3)
    rows = 2 if negative else 1
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(rows, 128, H, W, generator=g),
               conditioning(1), conditioning(2, tokens=11) if negative else None,
               timestep=torch.tensor([0.87, 0.87][:rows]))


def positions(text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids, image ids) of the FLUX.3 recipe."""
    txt = torch.zeros(text_len, 4)
    txt[:, 3] = torch.arange(text_len)
    img = torch.zeros(H, W, 4)
    img[..., 1] = torch.arange(H)[:, None] * 0.5
    img[..., 2] = torch.arange(W)[None, :] * 0.5
    return txt, img.reshape(-1, 4)


def branches(job: Job):
    return [(row, b) for row, b in enumerate(b for b in (job.positive, job.negative) if b is not None)]


# -- reference 1: diffusers' Flux3Transformer2DModel ---------------------------------------------------------


def diffusers_model(path: str, config: Flux3Config):
    from diffusers import Flux3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

    # The reference stream's output layer is in the file but not in diffusers' model (its tokens produce no output).
    sd = {k.removeprefix(PREFIX): v for k, v in load_file(path).items() if ".image_cond." not in k or "final" not in k}
    model = Flux3Transformer2DModel(**config.diffusers_kwargs())
    model.load_state_dict(convert_flux3_transformer_checkpoint_to_diffusers(sd), strict=True)
    return model.eval()


@torch.no_grad()
def diffusers_call(path: str, job: Job, config: Flux3Config = TINY) -> torch.Tensor:
    model, out = diffusers_model(path, config), []
    for row, branch in branches(job):
        txt_ids, img_ids = positions(branch.cond.shape[1])
        x = job.latent[row:row + 1].flatten(2).transpose(1, 2)
        v = model(hidden_states=x, encoder_hidden_states=branch.cond, timestep=job.timestep[row:row + 1],
                  img_ids=img_ids, txt_ids=txt_ids).sample
        out.append(v.transpose(1, 2).reshape(1, 128, H, W))
    return torch.cat(out)


# -- reference 2: the model call, from BFL's FLUX.3 reference (JointSingleSeq) on the raw tensors ----------------


def _rope(ids: torch.Tensor, axes: tuple[int, ...], theta: int = 10000) -> torch.Tensor:
    """BFL's EmbedND: per axis [L, D/2, 2, 2] rotation matrices, concatenated."""
    parts = []
    for i, dim in enumerate(axes):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        out = torch.einsum("n,d->nd", ids[:, i].double(), omega)
        parts.append(torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], -1)
                     .reshape(len(ids), -1, 2, 2))
    return torch.cat(parts, dim=1).float()


def _apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """BFL's apply_rope on [B, heads, L, D] with [L, D/2, 2, 2]."""
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def _sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    half = dim // 2
    args = (1000.0 * t)[:, None].float() * torch.exp(-math.log(10000) * torch.arange(half) / half)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _block(sd: dict, b: str, x: torch.Tensor, freqs: torch.Tensor, heads: int) -> torch.Tensor:
    """ModeBlock / SingleStreamBlock's shared math on one modulated sequence (the single block modulates its two
    parts apart before joining them): parallel attention and SwiGLU MLP, one gate."""
    def mm(h, name):
        return F.linear(h, sd[f"{b}.{name}.weight"])

    def rms(h, name):
        rrms = torch.rsqrt(torch.mean(h.float() ** 2, dim=-1, keepdim=True) + 1e-6)
        return (h.float() * rrms).to(h.dtype) * sd[f"{b}.norm.{name}.scale"]

    q, k, v = (mm(x, p).unflatten(-1, (heads, -1)).transpose(1, 2) for p in ("q_proj", "k_proj", "v_proj"))
    q, k = _apply_rope(rms(q, "query_norm"), freqs), _apply_rope(rms(k, "key_norm"), freqs)
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
    gate, up = mm(x, "mlp_in").chunk(2, dim=-1)
    return mm(attn, "attn_out") + mm(F.silu(gate) * up, "mlp_out")


@torch.no_grad()
def model_call(path: str, job: Job, c: Flux3Config = TINY) -> torch.Tensor:
    sd = {k.removeprefix(PREFIX): v for k, v in load_file(path).items()}

    def mlp_embed(t):
        return F.linear(F.silu(F.linear(_sinusoid(t), sd["time_in.in_layer.weight"])), sd["time_in.out_layer.weight"])

    def modulation(kind, mode, vec):
        return F.linear(F.silu(vec), sd[f"{kind}.{mode}.lin.weight"])[:, None].chunk(3, dim=-1)  # shift, scale, gate

    def modulate(x, mod):
        return (1 + mod[1]) * F.layer_norm(x, (c.hidden_size,), eps=1e-6) + mod[0]

    out = []
    for row, branch in branches(job):
        vec, vec_ctx = mlp_embed(job.timestep[row:row + 1]), mlp_embed(torch.zeros(1))
        txt_ids, img_ids = positions(branch.cond.shape[1])
        pe_txt, pe_img = _rope(txt_ids, TINY.axes_dims_rope), _rope(img_ids, TINY.axes_dims_rope)
        img = F.linear(job.latent[row:row + 1].flatten(2).transpose(1, 2), sd["emb_in.image.weight"])
        txt = F.linear(branch.cond, sd["txt_in.weight"])
        for d in range(c.num_layers):
            for stream, b, vec_m, pe, mode in ((img, f"content_mode_blocks.image.{d}", vec, pe_img, "image"),
                                               (txt, f"txt_mode_blocks.{d}", vec_ctx, pe_txt, "txt")):
                mod = modulation("early_stream_modulations", mode, vec_m)
                new = stream + mod[2] * _block(sd, b, modulate(stream, mod), pe, c.num_heads)
                img, txt = (new, txt) if mode == "image" else (img, new)
        mod_x = modulation("single_stream_modulations", "image", vec)
        mod_ctx = modulation("single_stream_modulations", "txt", vec_ctx)
        pe = torch.cat([pe_txt, pe_img])
        for i in range(c.num_single_layers):
            y = _block(sd, f"single_blocks.{i}", torch.cat([modulate(txt, mod_ctx), modulate(img, mod_x)], 1), pe,
                       c.num_heads)
            txt, img = txt + mod_ctx[2] * y[:, :txt.shape[1]], img + mod_x[2] * y[:, txt.shape[1]:]
        s = F.silu(vec)[:, None]
        shift_w, scale_w = sd["final_layer.image.adaLN_modulation.1.weight"].chunk(2)
        x = F.layer_norm(img, (c.hidden_size,), eps=1e-6) * (1 + F.linear(s, scale_w)) + F.linear(s, shift_w)
        out.append(F.linear(x, sd["final_layer.image.linear.weight"]).transpose(1, 2).reshape(1, 128, H, W))
    return torch.cat(out)


# -- detection and refusals ------------------------------------------------------------------------------------


def test_flux3_files_are_detected_and_their_config_read_from_shapes(flux3_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(flux3_path) as reader:
        family, match = detect_family(reader.keys())
    assert (family.name, match.prefix) == ("flux3", PREFIX)
    config = model_config(flux3_path)
    assert config == TINY
    assert (config.num_blocks, config.axes_dims_rope, config.latent_channels) == (4, (8, 8, 8, 8), 128)
    assert [k.name for k in config.block_kinds] == ["mode"] * 2 + ["single"] * 2


def test_flux3_distilled_files_look_alikes_and_references_are_refused_in_one_sentence(flux3_path, tmp_path):
    sd = load_file(flux3_path)
    cases = {"ref_time_in.in_layer.weight": "step-distilled \\(flow-map\\) model.*load flux3-image-klein-base",
             "vector_in.in_layer.weight": "also a pooled-vector input"}
    for key, message in cases.items():
        path = str(tmp_path / f"{key.split('.')[0]}.safetensors")
        save_file({**sd, PREFIX + key: torch.zeros(128, 256)}, path)
        with pytest.raises(ModelFileError, match=message):
            model_config(path)
    from parallel_runtime.validate import validate_references

    with pytest.raises(ConfigError, match="ReferenceMultiLatent\\) do not run on ParaDiT yet"):
        validate_references("positive", conditioning(1, references=True), TINY)


# -- one worker against both references ------------------------------------------------------------------------


def test_flux3_one_worker_equals_diffusers_and_the_model_call(flux3_path, client1):
    job = call_job(flux3_path, S())
    out = client1.run(job).latent
    assert out.shape == (2, 128, H, W)
    ref, call = diffusers_call(flux3_path, job), model_call(flux3_path, job)
    err, err_call, between = rel_err(out, ref), rel_err(out, call), rel_err(ref, call)
    print(f"\nFLUX.3 serial rel. error {err:.2e} vs diffusers, {err_call:.2e} vs the model call "
          f"(references apart {between:.2e})")
    assert err < SERIAL_RTOL and err_call < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tp2", "pp2_warmup"])
def test_flux3_exact_strategies_equal_one_worker(flux3_path, client1, client2, strategy):
    """Prompts of 7 and 11 tokens: separate forward passes, as ComfyUI runs them; the prompt's mode blocks cross
    every shard boundary (they run on the whole prompt). PipeFusion's call without a schedule step is its warm-up."""
    job = call_job(flux3_path, strategy)
    err = rel_err(client2.run(job).latent, client1.run(dataclasses.replace(job, strategy=S())).latent)
    print(f"\nFLUX.3 {strategy.label()} rel. error {err:.2e} vs 1 worker")
    assert err < EXACT_RTOL


def test_flux3_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(flux3_path, client1, client2):
    """A whole 6-step run at cfg 4 (Parallel Sampler's path): exact strategies equal serial; PipeFusion after one
    warm-up step (stale K/V) lands nearer serial than naive patch parallelism."""
    job = Job(ModelSpec(flux3_path), S(), SamplingSpec(steps=6, cfg=4.0, seed=1), torch.zeros(1, 128, H, W),
              conditioning(1), conditioning(2))
    check_denoise_loop(job, client1, client2, "FLUX.3", EXACT_RTOL)


# -- the file kinds the templates load: int8 ConvRot (Comfy-Org's), fp8 scaled ----------------------------------


@pytest.fixture(scope="module")
def storage_twins(tmp_path_factory):
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins

    folder = tmp_path_factory.mktemp("flux3-storage")
    return [("int8_convrot", *comfy_quant_twins(folder, "flux3", "int8_convrot", config=TINY)),
            ("fp8_scaled", *fp8_twins(folder, "flux3", torch.float8_e4m3fn, True, config=TINY))]


def compact_share(quant: str, meant: str) -> float:
    """Bytes one worker should hold per byte of the fp32 twin: the file's 1-byte matrices at 1 byte, the rest (the
    third of the matrices comfy_quant_twins leaves bf16, norms) at the fp32 compute dtype's 4."""
    from parallel_runtime.models.families.flux3 import source_map

    q, m = load_file(quant), load_file(meant)
    keys = [s.key for s in source_map(TINY, "bfl", PREFIX if PREFIX + "txt_in.weight" in m else "").values()]
    held = sum(q[k].numel() * (1 if q[k].dtype.itemsize == 1 else 4) for k in keys)
    return held / sum(m[k].numel() * 4 for k in keys)


def test_flux3_quantized_files_equal_their_fp32_twins(storage_twins, client1, client2):
    """Each kind at 1 worker equals its dequantized fp32 twin (the dequantization is ComfyUI's, so the numbers
    are the same); under Ulysses-2 too; each rank holds the compact weights."""
    for kind, quant, meant in storage_twins:
        assert model_config(quant) == TINY, kind
        got, ref = client1.run(call_job(quant, S())), client1.run(call_job(meant, S()))
        err, held = rel_err(got.latent, ref.latent), got.stats[0]["param_bytes"] / ref.stats[0]["param_bytes"]
        split = rel_err(client2.run(call_job(quant, S(ulysses_degree=2))).latent, got.latent)
        print(f"\nFLUX.3 {kind}: {err:.2e} vs fp32 twin, {held:.2f} of its bytes; Ulysses-2 {split:.2e}")
        assert err <= STORAGE_RTOL, kind
        share = compact_share(quant, meant)
        assert share < 0.65 and held < share + 0.01, kind  # + per-row / per-tensor scales
        assert split <= EXACT_RTOL, kind


# -- LoRA ------------------------------------------------------------------------------------------------------


def test_flux3_lora_in_comfyui_names_lands(flux3_path, client1, client2, tmp_path):
    """A LoRA named as ComfyUI names FLUX.3's weights (a prompt mode block, which runs once per job, an image mode
    block, a single block, a shared modulation and the final layer's swapped modulation) equals the file with the
    deltas merged in, at 1 worker and under Ulysses-2 and TP-2."""
    from parallel_runtime.spec import WeightPatch, WeightPatches

    g = torch.Generator().manual_seed(9)
    sd = load_file(flux3_path)
    weights, merged = {}, dict(sd)
    for key in ("txt_mode_blocks.0.q_proj.weight", "content_mode_blocks.image.1.mlp_in.weight",
                "single_blocks.1.attn_out.weight", "single_stream_modulations.txt.lin.weight",
                "final_layer.image.adaLN_modulation.1.weight"):
        rows, cols = sd[PREFIX + key].shape
        up, down = torch.randn(rows, 2, generator=g) * 0.1, torch.randn(2, cols, generator=g) * 0.1
        weights[key] = [WeightPatch("lora", {"up": up, "down": down}, strength=0.8, alpha=4.0)]
        merged[PREFIX + key] = merged[PREFIX + key] + (0.8 * 4.0 / 2) * (up @ down)
    merged_path = str(tmp_path / "merged.safetensors")
    save_file(merged, merged_path)
    patches = WeightPatches("flux3-lora", weights)
    want = client1.run(call_job(merged_path, S())).latent
    assert rel_err(want, client1.run(call_job(flux3_path, S())).latent) > 1e-3  # the LoRA matters
    for client, strategy in ((client1, S()), (client2, S(ulysses_degree=2)), (client2, S(tensor_degree=2))):
        got = client.run(dataclasses.replace(call_job(flux3_path, strategy), weight_patches=patches)).latent
        err = rel_err(got, want)
        print(f"\nFLUX.3 LoRA {strategy.label()} rel. error {err:.2e} vs merged file")
        assert err < 1e-5  # the merged file rounds each patched weight to fp32 once, as the workers do
