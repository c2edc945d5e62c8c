"""HunyuanVideo 1.5 on the workers: detection and refusals, the serial model against diffusers'
HunyuanVideo15Transformer3DModel on the same file, every exact strategy, PipeFusion's denoise loop, the storage kinds
and a LoRA in ComfyUI's names.

The reference is diffusers' own model, loaded with a key conversion written here (the released names -> diffusers',
as Tencent's names map to diffusers'), so it shares nothing with the family module but the file. Where ParaDiT follows
ComfyUI instead (the docstring of parallel_runtime/models/families/hunyuan_video15.py says where): a text-to-video call
has no vision or glyph tokens at all, which diffusers reproduces with zeroed tokens masked out of attention; the prompt
is unpadded (an all-ones mask in diffusers).
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.hunyuan_video15 import HunyuanVideo15Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

# 2 heads of 128 (every HunyuanVideo's head size), 2 double blocks, the refiner's 2; the prompt 64 wide (Qwen2.5-VL's
# 3584 in real files); 65 input channels as every released 480p/720p file (latent 32 + start frame 32 + mask 1).
TINY = HunyuanVideo15Config(hidden_size=256, num_layers=2, text_dim=64)
T, H, W = 3, 4, 6  # latent frames x height x width: 72 video tokens, 12 token rows (1x1x1 patches)
VISION_TOKENS, GLYPH_TOKENS = 5, 4  # SigLIP gives 729 per image, ByT5 one per byte of quoted text
# One fp32 forward in another op order than the reference: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def hv_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("hv15") / "hunyuanvideo1.5_tiny.safetensors"), TINY, seed=1,
                            prefix="model.diffusion_model.")


def conditioning(seed: int, tokens: int = 9, vision: bool = False, glyph: bool = False,
                 concat: bool = False) -> Conditioning:
    """A branch as ComfyUI's conds give it: Qwen tokens, and for image-to-video HunyuanVideo15ImageToVideo's concat
    (start-frame latent, then the mask: 1 where the frame is given) and SigLIP tokens; glyph tokens for quoted text."""
    g = torch.Generator().manual_seed(seed)
    c = Conditioning(torch.randn(1, tokens, TINY.text_dim, generator=g), torch.zeros(1, 0))
    if vision:
        c = dataclasses.replace(c, clip_vision=torch.randn(1, VISION_TOKENS, 1152, generator=g))
    if glyph:
        c = dataclasses.replace(c, glyph=torch.randn(1, GLYPH_TOKENS, 1472, generator=g))
    if concat:
        start = torch.zeros(1, 32, T, H, W)
        start[:, :, 0] = torch.randn(1, 32, H, W, generator=g)
        mask = torch.zeros(1, 1, T, H, W).index_fill_(2, torch.tensor([0]), 1.0)
        c = dataclasses.replace(c, concat=torch.cat([start, mask], dim=1))
    return c


def call_job(path: str, strategy: S, i2v: bool = False, glyph: bool = False) -> Job:
    """Both branches of one KSampler call; prompts of different lengths (9 and 11 tokens) run as separate passes."""
    g = torch.Generator().manual_seed(3)
    pos = conditioning(1, vision=i2v, glyph=glyph, concat=i2v)
    neg = conditioning(2, tokens=11, vision=i2v, concat=i2v)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(2, 32, T, H, W, generator=g), pos, neg,
               timestep=torch.full((2,), 870.0))


# -- the reference: diffusers' model ---------------------------------------------------------------------------

_BLOCK = {"img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
          "img_attn_q_norm": "attn.norm_q", "img_attn_k_norm": "attn.norm_k", "txt_attn_q_norm": "attn.norm_added_q",
          "txt_attn_k_norm": "attn.norm_added_k", "img_attn_proj": "attn.to_out.0", "txt_attn_proj": "attn.to_add_out",
          "img_mlp.fc1": "ff.net.0.proj", "img_mlp.fc2": "ff.net.2", "txt_mlp.fc1": "ff_context.net.0.proj",
          "txt_mlp.fc2": "ff_context.net.2"}
_REFINER = {"self_attn_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2", "norm1": "norm1",
            "norm2": "norm2", "adaLN_modulation.1": "norm_out.linear"}
_TOP = {"img_in.proj": "x_embedder.proj", "time_in.mlp.0": "time_embed.timestep_embedder.linear_1",
        "time_in.mlp.2": "time_embed.timestep_embedder.linear_2", "vision_in.proj.0": "image_embedder.norm_in",
        "vision_in.proj.1": "image_embedder.linear_1", "vision_in.proj.3": "image_embedder.linear_2",
        "vision_in.proj.4": "image_embedder.norm_out", "byt5_in.layernorm": "context_embedder_2.norm",
        "byt5_in.fc1": "context_embedder_2.linear_1", "byt5_in.fc2": "context_embedder_2.linear_2",
        "byt5_in.fc3": "context_embedder_2.linear_3", "final_layer.linear": "proj_out",
        "final_layer.adaLN_modulation.1": "norm_out.linear", "txt_in.input_embedder": "context_embedder.proj_in",
        "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
        "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
        "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
        "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
        "cond_type_embedding": "cond_type_embed"}


def to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released names -> diffusers': fused q/k/v split in three, the final modulation's (shift, scale) swapped."""
    out = {}
    for key, t in sd.items():
        module, param = key.removeprefix("model.diffusion_model.").rsplit(".", 1)
        if m := re.fullmatch(r"double_blocks\.(\d+)\.(img|txt)_attn_qkv", module):
            names = ("to_q", "to_k", "to_v") if m[2] == "img" else ("add_q_proj", "add_k_proj", "add_v_proj")
            for name, part in zip(names, t.chunk(3)):
                out[f"transformer_blocks.{m[1]}.attn.{name}.{param}"] = part
        elif m := re.fullmatch(r"double_blocks\.(\d+)\.(.+)", module):
            out[f"transformer_blocks.{m[1]}.{_BLOCK[m[2]]}.{param}"] = t
        elif m := re.fullmatch(r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.(.+)", module):
            base = f"context_embedder.token_refiner.refiner_blocks.{m[1]}"
            if m[2] == "self_attn_qkv":
                for name, part in zip(("to_q", "to_k", "to_v"), t.chunk(3)):
                    out[f"{base}.attn.{name}.{param}"] = part
            else:
                out[f"{base}.{_REFINER[m[2]]}.{param}"] = t
        elif module == "final_layer.adaLN_modulation.1":
            shift, scale = t.chunk(2)
            out[f"norm_out.linear.{param}"] = torch.cat([scale, shift])
        else:
            out[f"{_TOP[module]}.{param}"] = t
    return out


@torch.no_grad()
def diffusers_call(path: str, job: Job, config: HunyuanVideo15Config = TINY) -> torch.Tensor:
    """Each branch through diffusers' HunyuanVideo15Transformer3DModel: the latent beside its concat channels
    (zeros for text-to-video, as ComfyUI's concat_cond makes them), SigLIP and ByT5 tokens where the branch has
    them, else zeroed tokens masked out (diffusers' text-to-video; ComfyUI has none)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    model = HunyuanVideo15Transformer3DModel(**config.diffusers_kwargs()).eval()
    model.load_state_dict(to_diffusers(load_file(path)), strict=True)
    rows = []
    for k, branch in enumerate((job.positive, job.negative)):
        x = job.latent[k:k + 1]
        concat = branch.concat if branch.concat is not None else torch.zeros(1, config.concat_channels, T, H, W)
        glyph = branch.glyph if branch.glyph is not None else torch.zeros(1, 1, 1472)
        image = branch.clip_vision if branch.clip_vision is not None else torch.zeros(1, 1, 1152)
        rows.append(model(hidden_states=torch.cat([x, concat], dim=1), timestep=job.timestep[k:k + 1],
                          encoder_hidden_states=branch.cond,
                          encoder_attention_mask=torch.ones(1, branch.cond.shape[1]),
                          encoder_hidden_states_2=glyph,
                          encoder_attention_mask_2=torch.full((1, glyph.shape[1]), float(branch.glyph is not None)),
                          image_embeds=image).sample)
    return torch.cat(rows)


# -- detection and refusals ------------------------------------------------------------------------------------


# ComfyUI's renaming of the released names on load (supported_models.HunyuanVideo.process_unet_state_dict): its
# model's parameter names, which a ComfyUI-saved file and a LoRA's patches use.
_COMFY_RENAMES = (("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
                  ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
                  ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
                  ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."), ("_mod.linear.", "_mod.lin."),
                  ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
                  ("_attn_q_norm.weight", "_attn.norm.query_norm.weight"),
                  ("_attn_k_norm.weight", "_attn.norm.key_norm.weight"), ("_attn_proj.", "_attn.proj."),
                  ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."))


def comfy_name(key: str) -> str:
    for old, new in _COMFY_RENAMES:
        key = key.replace(old, new)
    return key


@pytest.fixture(scope="module")
def layout_twins(hv_path, tmp_path_factory):
    """The same numbers in ComfyUI's parameter names, in diffusers' and with Tencent's split q/k/v."""
    folder, sd = tmp_path_factory.mktemp("hv15-layouts"), load_file(hv_path)
    split = {}
    for key, t in sd.items():
        m = re.fullmatch(r"(.*double_blocks\.\d+\.(?:img|txt)_attn_)qkv\.(weight|bias)", key)
        split.update({f"{m[1]}{part}.{m[2]}": piece for part, piece in zip("qkv", t.chunk(3))} if m else {key: t})
    twins = {"comfy": {comfy_name(k): t for k, t in sd.items()}, "diffusers": to_diffusers(sd),
             "hunyuan_split": split}
    paths = {}
    for layout, tensors in twins.items():
        paths[layout] = str(folder / f"{layout}.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, paths[layout])
    return paths


def test_files_are_detected_in_every_layout(hv_path, layout_twins):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(hv_path) as reader:
        family, match = detect_family(reader.keys())
    assert (family.name, match.layout, match.prefix) == ("hunyuan_video15", "hunyuan", "model.diffusion_model.")
    config = model_config(hv_path)
    assert config == TINY and (config.num_heads, config.concat_channels, config.latent_channels) == (2, 33, 32)
    assert config.latent_format.dimensions == 3 and config.latent_format.scale == 1.03682
    assert config.title == "HunyuanVideo 1.5 256-wide"
    for layout, path in layout_twins.items():
        with open_checkpoint(path) as reader:
            assert detect_family(reader.keys())[1].layout == layout
        assert model_config(path) == TINY, layout


def _variant(sd: dict, path, drop=(), add=None, reshape=None) -> str:
    sd = {k: v for k, v in sd.items() if not any(k.startswith("model.diffusion_model." + d) for d in drop)}
    sd.update(add or {})
    for key, shape in (reshape or {}).items():
        sd[key] = torch.zeros(shape)
    save_file(sd, str(path))
    return str(path)


def test_look_alikes_and_other_variants_are_refused(hv_path, tmp_path):
    sd = load_file(hv_path)
    p = "model.diffusion_model."
    hv10 = _variant(sd, tmp_path / "hunyuan_video_t2v_720p.safetensors", drop=("cond_type_embedding", "vision_in"),
                    add={p + "single_blocks.0.linear1.weight": torch.zeros(4, 4)})
    with pytest.raises(ModelFileError, match=r"is the original HunyuanVideo \(1.0\) .* not HunyuanVideo 1.5.*UNETLoader"):
        model_config(hv10)
    image21 = _variant(sd, tmp_path / "hunyuanimage2.1.safetensors", drop=("cond_type_embedding",),
                       reshape={p + "img_in.proj.weight": (256, 64, 1, 1)})
    with pytest.raises(ModelFileError, match="is a HunyuanImage 2.1 model"):
        model_config(image21)
    sr = _variant(sd, tmp_path / "hunyuanvideo1.5_1080p_sr_distilled.safetensors",
                  reshape={p + "img_in.proj.weight": (256, 98, 1, 1, 1)})
    with pytest.raises(ModelFileError, match=r"super-resolution model \(1080p SR distilled\), which upsamples"):
        model_config(sr)
    meanflow = _variant(sd, tmp_path / "hunyuanvideo1.5_meanflow.safetensors",
                        add={p + "time_r_in.mlp.0.weight": torch.zeros(256, 256)})
    with pytest.raises(ModelFileError, match="MeanFlow-distilled .* reads the sampler's next sigma"):
        model_config(meanflow)


# -- one worker = diffusers --------------------------------------------------------------------------------------


def test_text_to_video_one_worker_equals_diffusers(hv_path, layout_twins, client1):
    """Every layout of the same numbers gives the same call (the key maps), equal to diffusers' model."""
    job = call_job(hv_path, S())
    reference = diffusers_call(hv_path, job)
    assert torch.isfinite(reference).all()
    for path in [hv_path, *layout_twins.values()]:
        out = client1.run(dataclasses.replace(job, model=ModelSpec(path))).latent
        assert out.shape == (2, 32, T, H, W)
        assert rel_err(out, reference) < SERIAL_RTOL, path


def test_image_to_video_and_glyph_tokens_one_worker_equal_diffusers(hv_path, client1):
    """HunyuanVideo15ImageToVideo's concat and SigLIP tokens, and glyph tokens, join ComfyUI's prompt stream
    [vision, glyph, text] as diffusers joins its valid tokens."""
    for job in (call_job(hv_path, S(), i2v=True), call_job(hv_path, S(), glyph=True),
                call_job(hv_path, S(), i2v=True, glyph=True)):
        out = client1.run(job).latent
        assert rel_err(out, diffusers_call(hv_path, job)) < SERIAL_RTOL
    plain = client1.run(call_job(hv_path, S())).latent
    assert rel_err(out, plain) > 1e-2  # the start frame and its tokens matter


# -- the strategies ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=3)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_exact_strategies_equal_diffusers(hv_path, client2, strategy):
    """Image-to-video with glyph tokens: the prompt stream [vision, glyph, text] is embedded whole on every rank
    that embeds it and split with the video; the concat channels split with their tokens. PipeFusion's patches are
    whole latent rows (12 / 3); its call without a schedule step is its warm-up (exact)."""
    job = call_job(hv_path, strategy, i2v=True, glyph=True)
    assert rel_err(client2.run(job).latent, diffusers_call(hv_path, job)) < EXACT_RTOL


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ulysses_degree=2)],
                         ids=["ulysses2xring2", "cfg2xulysses2"])
def test_hybrids_on_four_equal_diffusers(hv_path, client4, strategy):
    job = call_job(hv_path, strategy, i2v=True)
    assert rel_err(client4.run(job).latent, diffusers_call(hv_path, job)) < EXACT_RTOL


def test_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(hv_path, client1, client2):
    """A whole 6-step image-to-video run at cfg 5 (Parallel Sampler's path, the prompt re-embedded at every step's
    timestep): exact strategies equal serial; PipeFusion after one warm-up step reads stale K/V and lands nearer
    serial than naive patch parallelism, which never sees the other half of the video."""
    pos, neg = conditioning(1, vision=True, concat=True), conditioning(2, vision=True, concat=True)
    job = Job(ModelSpec(hv_path), S(), SamplingSpec(steps=6, cfg=5.0, seed=1), torch.zeros(1, 32, T, H, W), pos, neg)
    check_denoise_loop(job, client1, client2, "HunyuanVideo 1.5", EXACT_RTOL, warm_patches=3, stale_patches=3)


def test_text_to_video_runs_without_concat_and_refuses_bad_inputs(hv_path, client1):
    """A text-to-video branch carries no concat (ComfyUI's concat_cond fills zeros: the same call); wrong SigLIP
    or glyph widths are refused in one sentence."""
    from parallel_runtime.errors import ConfigError

    job = call_job(hv_path, S())
    zeros = dataclasses.replace(job.positive, concat=torch.zeros(1, 33, T, H, W))
    explicit = dataclasses.replace(job, positive=zeros, negative=dataclasses.replace(job.negative,
                                                                                      concat=zeros.concat))
    assert rel_err(client1.run(explicit).latent, client1.run(job).latent) < 1e-6  # zeros add nothing but order
    wide = dataclasses.replace(job.positive, clip_vision=torch.randn(1, 257, 1280))
    with pytest.raises(ConfigError, match=r"reads \[batch, tokens, 1152\]; load sigclip_vision_patch14_384"):
        client1.run(dataclasses.replace(job, positive=wide))
    glyph = dataclasses.replace(job.positive, glyph=torch.randn(1, 4, 1024))
    with pytest.raises(ConfigError, match=r"glyph tokens have shape \(1, 4, 1024\) .* 1472\] \(ByT5 small\)"):
        client1.run(dataclasses.replace(job, positive=glyph))


# -- the file kinds users download, and LoRAs -------------------------------------------------------------------

# The quantized file and its fp32 twin hold the same numbers (the twin the values the file means): equal up to BLAS
# blocking of equal operands (GGUF dequantizes per layer in fp32), as in tests/test_fp8.py and tests/test_gguf.py.
STORAGE_RTOL = 1e-5


@pytest.fixture(scope="module")
def storage_twins(tmp_path_factory):
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins
    from test_gguf import gguf_twins

    folder = tmp_path_factory.mktemp("hv15-storage")
    return [("fp8_scaled", *fp8_twins(folder, "hv15", torch.float8_e4m3fn, True, config=TINY)),
            ("comfy_quant_int8", *comfy_quant_twins(folder, "hv15", "int8_tensorwise", config=TINY)),
            ("gguf", *gguf_twins(folder, "hv15", config=TINY, arch="hyvid"))]


def test_quantized_files_equal_their_fp32_twins_and_stay_compact(storage_twins, client1, client2):
    """Each kind at 1 worker equals the twin; under Ulysses-2 too; each rank holds the compact weights."""
    for kind, quant, meant in storage_twins:
        got, ref = client1.run(call_job(quant, S(), i2v=True)), client1.run(call_job(meant, S(), i2v=True))
        assert rel_err(got.latent, ref.latent) <= STORAGE_RTOL, kind
        assert got.stats[0]["param_bytes"] < 0.6 * ref.stats[0]["param_bytes"], kind  # 1-byte (or less) matrices
        split = client2.run(call_job(quant, S(ulysses_degree=2), i2v=True))
        assert rel_err(split.latent, got.latent) <= EXACT_RTOL, kind
    client1.release()
    client2.release()


def test_lora_in_comfyui_names_lands(hv_path, tmp_path, client1, client2):
    """A LoRA on ComfyUI's fused q/k/v and on a refiner MLP (its parameter names, as a LoRA loader patches them)
    equals the file with the merged weights, at 1 worker and under Ring-2."""
    from parallel_runtime.spec import WeightPatch, WeightPatches

    g = torch.Generator().manual_seed(21)
    targets = {"double_blocks.1.img_attn.qkv.weight": "double_blocks.1.img_attn_qkv.weight",
               "txt_in.individual_token_refiner.blocks.0.mlp.0.weight":
                   "txt_in.individual_token_refiner.blocks.0.mlp.fc1.weight"}
    sd, weights = load_file(hv_path), {}
    for comfy, released in targets.items():
        w = sd["model.diffusion_model." + released]
        up, down = torch.randn(w.shape[0], 4, generator=g) * 0.1, torch.randn(4, w.shape[1], generator=g) * 0.1
        weights[comfy] = [WeightPatch("lora", {"up": up, "down": down}, alpha=4.0)]
        sd["model.diffusion_model." + released] = w + up @ down  # alpha / rank = 1
    merged = str(tmp_path / "merged.safetensors")
    save_file(sd, merged)
    lora = WeightPatches("hv15-lora", weights)
    for client, strategy in ((client1, S()), (client2, S(ring_degree=2))):
        got = client.run(dataclasses.replace(call_job(hv_path, strategy, i2v=True), weight_patches=lora)).latent
        want = client.run(call_job(merged, strategy, i2v=True)).latent
        assert rel_err(got, want) < EXACT_RTOL
    assert rel_err(got, client2.run(call_job(hv_path, S(ring_degree=2), i2v=True)).latent) > 1e-3  # it mattered
