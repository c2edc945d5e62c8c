"""The parallel MODEL (Load Parallel DiT) against ComfyUI 2026's rules for FLUX.2, Z-Image, HunyuanVideo 1.5 and
Qwen-Image 2.1, on a fake host.

This host's ComfyUI (late 2025) knows none of these families, so `comfy` here is a stand-in written from reading
ComfyUI 2026's source: `BRANCHES` is comfy/model_detection.py's detect_unet_config as data (the keys that take a
file into each branch, in the order ComfyUI tries them, and which config values a branch reads off which shapes),
`SUPPORTED` the comfy/supported_models.py classes these branches meet (their unet_config match, sampling settings,
latent channels) and the `*_conds` functions comfy/model_base.py's extra_conds of those classes: what a model call
carries beyond x, timestep and context. `model_call` batches cond and uncond and calls the diffusion model as
BaseModel._apply_model does.

For each family, on a tiny file written with write_checkpoint: parallel_model builds the MODEL (the fake detection
finds the family from the file's keys), ComfyUI's derived config agrees with ours, and one model call through
RemoteDiT equals the same job run directly on the runtime at 1 worker, and under Ulysses-2 on two.
"""
from __future__ import annotations

import json
import math
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.registry import family_of
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.sampling.flow import FluxModelSampling
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------------------------------
# comfy/model_detection.py's detect_unet_config, the branches that concern these families, as data.

def _present(keys: set, name: str) -> bool:
    """A key, or (ending in '.') any key under that prefix; 'a|b' is either."""
    return any((any(k.startswith(n) for k in keys) if n.endswith(".") else n in keys) for n in name.split("|"))


def _count(keys: set, prefix: str) -> int:
    n = 0
    while any(k.startswith(f"{prefix}{n}.") for k in keys):
        n += 1
    return n


@dataclass(frozen=True)
class Branch:
    """One branch of detect_unet_config: the keys that all must be present ('a|b': either), and the config it
    reads: `shapes` {value: (key, dim)} (None where the key is absent), `counts` {value: block list prefix},
    `flags` {value: key present}, `fixed` constants, then `derive(config, sd, keys)` for what depends on those."""
    image_model: str
    needs: tuple[str, ...]
    shapes: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    derive: Callable | None = None

    def read(self, sd: dict) -> dict:
        keys = set(sd)
        config = {"image_model": self.image_model, **self.fixed}
        config.update({k: sd[key].shape[dim] if key in keys else None for k, (key, dim) in self.shapes.items()})
        config.update({k: _count(keys, prefix) for k, prefix in self.counts.items()})
        config.update({k: _present(keys, key) for k, key in self.flags.items()})
        if self.derive is not None:
            config.update(self.derive(config, sd, keys))
        return config


def _hunyuan_video(config, sd, keys) -> dict:
    patch = list(sd["img_in.proj.weight"].shape[2:])
    return {"patch_size": patch, "out_channels": sd["final_layer.linear.weight"].shape[0] // math.prod(patch),
            "num_heads": config["hidden_size"] // 128, "axes_dim": [64, 64] if len(patch) == 2 else [16, 56, 56],
            "vec_in_dim": 768 if _present(keys, "vector_in.") else None,
            "meanflow_sum": config["vision_in_dim"] is not None}  # HunyuanVideo 1.5's vision_in decides it


def _flux(config, sd, keys) -> dict:
    """The Flux branch's FLUX.2 constants (a shared image modulation decides it), heads from the width."""
    if "double_stream_modulation_img.lin.weight" not in keys:
        return {"image_model": "flux"}  # Flux.1 / Chroma: none of this module's families
    out = {"image_model": "flux2", "axes_dim": [32, 32, 32, 32], "mlp_ratio": 3.0, "theta": 2000,
           "out_channels": 128, "patch_size": 1, "qkv_bias": False, "default_ref_method": "index",
           "ref_index_scale": 10.0}
    out["num_heads"] = config["hidden_size"] // sum(out["axes_dim"])
    return out


# Lumina 2's branch sets these by width alone: the released Lumina 2 (2304) and Z-Image (3840).
_NEXTDIT_WIDTHS = {
    2304: {"n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0},
    3840: {"n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48], "rope_theta": 256.0,
           "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0},
}


def _lumina2(config, sd, keys) -> dict:
    out = dict(_NEXTDIT_WIDTHS.get(config["dim"], {}))
    if config["dim"] == 3840:
        if "cap_pad_token" in keys:
            out["pad_tokens_multiple"] = 32
        elif "dec_net.cond_embed.weight" not in keys:
            out["image_model"] = "ming_image"  # Z-Image's layers without its pad tokens
        if "dec_net.cond_embed.weight" in keys:
            out["image_model"] = "zimage_pixel"
    return out


def _qwen_image21(config, sd, keys) -> dict:
    inner = sd["img_in.weight"].shape[0]
    gate_up = sd.get("transformer_blocks.0.img_mlp.gate_up.weight")
    ratio = (gate_up.shape[0] // 2 if gate_up is not None else sd["transformer_blocks.0.img_mlp.proj.weight"].shape[0])
    return {"num_attention_heads": inner // config["attention_head_dim"], "mlp_ratio": ratio // inner,
            "fused_mlp": gate_up is not None}


# Every branch up to Qwen-Image 2.1's, in detect_unet_config's order; the other models' by their deciding keys only
# (a file of ours holding one would be read as that model; Mage-Flow's and SeedVR2's shape conditions are left out,
# which only makes this stricter).
BRANCHES = (
    Branch("mmdit", ("joint_blocks.0.context_block.attn.qkv.weight",)),
    Branch("stable_cascade", ("clf.1.weight",)),
    Branch("trellis2", ("img2shape.t_embedder.mlp.0.weight|shape2txt.t_embedder.mlp.0.weight",)),
    Branch("stable_audio", ("transformer.rotary_pos_emb.inv_freq",)),
    Branch("aura_flow", ("double_layers.0.attn.w1q.weight",)),
    Branch("hydit", ("mlp_t5.0.weight",)),
    Branch("hunyuan_video", ("txt_in.individual_token_refiner.blocks.0.norm1.weight",),
           shapes={"in_channels": ("img_in.proj.weight", 1), "hidden_size": ("img_in.proj.weight", 0),
                   "context_in_dim": ("txt_in.input_embedder.weight", 1), "vision_in_dim": ("vision_in.proj.0.weight", 0)},
           counts={"depth": "double_blocks.", "depth_single_blocks": "single_blocks."},
           flags={"meanflow": "time_r_in.", "byt5": "byt5_in.fc1.weight", "guidance_embed": "guidance_in.",
                  "use_cond_type_embedding": "cond_type_embedding.weight"},
           fixed={"mlp_ratio": 4.0, "theta": 256, "qkv_bias": True}, derive=_hunyuan_video),
    Branch("flux", ("double_blocks.0.img_attn.norm.key_norm.weight|double_blocks.0.img_attn.norm.key_norm.scale",
                    "img_in.weight|distilled_guidance_layer.norms.0.weight|distilled_guidance_layer.norms.0.scale"),
           shapes={"hidden_size": ("img_in.weight", 0), "in_channels": ("img_in.weight", 1),  # patch 1: no division
                   "context_in_dim": ("txt_in.weight", 1), "vec_in_dim": ("vector_in.in_layer.weight", 1)},
           counts={"depth": "double_blocks.", "depth_single_blocks": "single_blocks."},
           flags={"guidance_embed": "guidance_in.in_layer.weight"}, derive=_flux),
    Branch("mochi_preview", ("t5_yproj.weight",)),
    Branch("minimax_h3", ("video_patch_proj.weight", "audio_patch_proj.weight")),
    Branch("ltxv", ("adaln_single.emb.timestep_embedder.linear_1.bias",)),  # PixArt's diffusers layout too
    Branch("ace", ("genre_embedder.weight",)),
    Branch("pixart", ("t_block.1.weight",)),
    Branch("cosmos", ("blocks.block0.blocks.0.block.attn.to_q.0.weight",)),
    Branch("pid", ("lq_proj.latent_proj.0.weight",)),
    Branch("pixeldit_t2i", ("core.pixel_embedder.proj.weight",)),
    Branch("lumina2", ("cap_embedder.1.weight", "noise_refiner.0.attention.k_norm.weight"),
           shapes={"dim": ("cap_embedder.1.weight", 0), "cap_feat_dim": ("cap_embedder.1.weight", 1)},
           counts={"n_layers": "layers."}, fixed={"patch_size": 2, "in_channels": 16, "qk_norm": True},
           derive=_lumina2),
    Branch("cogvideox", ("blocks.0.norm1.linear.weight",)),
    Branch("seedvr2", ("blocks.35.mlp.vid.proj_out.weight|blocks.35.mlp.all.proj_in_gate.weight|"
                       "blocks.31.mlp.all.proj_in_gate.weight",)),
    Branch("wan2.1", ("head.modulation",)),
    Branch("hunyuan3d2", ("latent_in.weight",)),
    Branch("hunyuan3d2_1", ("t_embedder.mlp.2.weight", "blocks.0.attn1.k_norm.weight")),
    Branch("triposplat", ("cam_out_layer.weight", "repo_layers.0.final_map.weight")),
    Branch("hidream_o1", ("t_embedder1.mlp.0.weight", "x_embedder.proj1.weight")),
    Branch("hidream", ("caption_projection.0.linear.weight",)),
    Branch("cosmos_predict2", ("blocks.0.mlp.layer1.weight",)),
    Branch("boogu", ("double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight",)),
    Branch("omnigen2", ("time_caption_embed.timestep_embedder.linear_1.bias",)),
    Branch("lens", ("transformer_blocks.0.attn.norm_added_q.weight", "transformer_blocks.0.img_mlp.w1.weight")),
    Branch("mage_flow", ("txt_norm.weight", "proj_out.weight")),
    Branch("qwen_image21", ("txt_in.text_norm.weight", "modulation.1.weight", "transformer_blocks.0.attn.norm_q.weight",
                            "img_in.weight", "proj_out.weight",
                            "transformer_blocks.0.img_mlp.gate_up.weight|transformer_blocks.0.img_mlp.proj.weight"),
           shapes={"attention_head_dim": ("transformer_blocks.0.attn.norm_q.weight", 0),
                   "in_channels": ("img_in.weight", 1), "out_channels": ("proj_out.weight", 0),
                   "context_in_dim": ("txt_in.text_norm.weight", 0)},
           counts={"num_layers": "transformer_blocks."}, derive=_qwen_image21),
)


def detect_unet_config(sd: dict) -> dict | None:
    for branch in BRANCHES:
        if all(_present(set(sd), name) for name in branch.needs):
            return branch.read(sd)
    return None


# ---------------------------------------------------------------------------------------------
# comfy/model_base.py: what each BaseModel class's extra_conds hands the diffusion model (from a conditioning's keys).

def _flux_conds(base, cross_attn, pooled_output=None, guidance=3.5, reference_latents=None,
                reference_latents_method=None, **_):
    """model_base.Flux (c_concat only for Fill-style inputs wider than the output: never for FLUX.2's 128 in/out).
    The text encoder's prompt mask reaches the model only beside StyleModelApply's attention_mask_img_shape: a
    prompt alone never carries one."""
    out = {"c_crossattn": cross_attn, "guidance": torch.tensor([guidance])}
    if pooled_output is not None:
        out["y"] = pooled_output
    if reference_latents is not None:
        out["ref_latents"] = [base.latent_format.process_in(r) for r in reference_latents]
        if reference_latents_method is not None:
            out["ref_latents_method"] = reference_latents_method
    return out


def flux2_conds(base, cross_attn, **kwargs):
    """model_base.Flux2: Flux's, with a prompt shorter than 512 tokens padded at the front with zeros."""
    out = _flux_conds(base, cross_attn, **kwargs)
    out["c_crossattn"] = F.pad(cross_attn, (0, 0, max(0, 512 - cross_attn.shape[1]), 0))
    return out


def lumina2_conds(base, cross_attn, attention_mask=None, clip_vision_outputs=None, reference_latents=None, **_):
    """model_base.Lumina2 (Lumina 2 and Z-Image): a prompt mask only when it hides padding, always num_tokens;
    Z-Image Omni's SigLIP features and ReferenceLatent's latents when a node adds them."""
    out = {"c_crossattn": cross_attn, "num_tokens": cross_attn.shape[1]}
    if attention_mask is not None:
        if attention_mask.numel() != attention_mask.sum():
            out["attention_mask"] = attention_mask
        out["num_tokens"] = max(1, int(attention_mask.sum()))
    if clip_vision_outputs:
        out["siglip_feats"] = list(clip_vision_outputs)
    if reference_latents is not None:
        out["ref_latents"] = [base.latent_format.process_in(r) for r in reference_latents]
    return out


def qwen_image21_conds(base, cross_attn, attention_mask=None, reference_latents=None, reference_latents_method=None,
                       image_slots=None, **_):
    """model_base.QwenImage21: QwenImage's (mask, prompt, references) and the prompt's image slots."""
    out = {"c_crossattn": cross_attn}
    if attention_mask is not None:
        out["attention_mask"] = attention_mask
    if reference_latents is not None:
        out["ref_latents"] = [base.latent_format.process_in(r) for r in reference_latents]
        if reference_latents_method is not None:
            out["ref_latents_method"] = reference_latents_method
    if image_slots is not None:
        out["image_slots"] = image_slots
    return out


def hunyuan_video15_conds(base, cross_attn, noise, pooled_output=None, attention_mask=None, guidance=6.0,
                          conditioning_byt5small=None, clip_vision_output=None, concat_latent_image=None,
                          concat_mask=None, guiding_frame_index=None, **_):
    """model_base.HunyuanVideo15 (over HunyuanVideo's): c_concat = the start image (zeros without one) and the
    inverted mask, always (the model reads 65 channels); the glyph tokens, SigLIP's last hidden state, guidance 6."""
    extra = base.in_channels - noise.shape[1] - 1
    image = (torch.zeros(noise.shape[0], extra, *noise.shape[2:]) if concat_latent_image is None
             else base.latent_format.process_in(concat_latent_image))  # at the latent's size: no resize needed
    mask = torch.zeros_like(noise[:, :1]) if concat_mask is None else 1.0 - concat_mask
    out = {"c_concat": torch.cat([image, mask], dim=1), "c_crossattn": cross_attn, "guidance": torch.tensor([guidance])}
    for name, value in (("y", pooled_output), ("attention_mask", attention_mask), ("txt_byt5", conditioning_byt5small),
                        ("guiding_frame_index", guiding_frame_index)):
        if value is not None:
            out[name] = value
    if clip_vision_output is not None:
        out["clip_fea"] = clip_vision_output.last_hidden_state
    return out


# ---------------------------------------------------------------------------------------------
# comfy/supported_models.py: the classes these branches meet, in comfy.supported_models.models' order.

@dataclass(frozen=True)
class Supported:
    name: str
    match: dict  # unet_config values a detected config must equal
    sampling: str  # "flux": ModelSamplingFlux (ModelType.FLUX); "discrete_flow": ModelSamplingDiscreteFlow (FLOW)
    shift: float
    multiplier: float  # ModelSamplingDiscreteFlow's (1000 unless sampling_settings sets one)
    latent_channels: int | None = None
    conds: Callable | None = None  # the BaseModel class's extra_conds (None: a class this module does not drive)

    def matches(self, config: dict) -> bool:
        return all(k in config and config[k] == v for k, v in self.match.items())


SUPPORTED = (
    Supported("HunyuanVideo15_SR_Distilled", {"image_model": "hunyuan_video", "vision_in_dim": 1152, "in_channels": 98},
              "discrete_flow", 2.0, 1000.0, 32),
    Supported("HunyuanVideo15", {"image_model": "hunyuan_video", "vision_in_dim": 1152}, "discrete_flow", 7.0, 1000.0,
              32, hunyuan_video15_conds),
    Supported("HunyuanImage21Refiner", {"image_model": "hunyuan_video", "patch_size": [1, 1, 1], "vec_in_dim": None},
              "discrete_flow", 4.0, 1000.0),
    Supported("HunyuanImage21", {"image_model": "hunyuan_video", "vec_in_dim": None}, "discrete_flow", 5.0, 1000.0),
    Supported("HunyuanVideo", {"image_model": "hunyuan_video"}, "discrete_flow", 7.0, 1000.0),
    Supported("ZImagePixelSpace", {"image_model": "zimage_pixel"}, "discrete_flow", 3.0, 1.0),
    Supported("MingImage", {"image_model": "ming_image"}, "discrete_flow", 3.16, 1.0),
    Supported("ZImage", {"image_model": "lumina2", "dim": 3840}, "discrete_flow", 3.0, 1.0, 16, lumina2_conds),
    Supported("Lumina2", {"image_model": "lumina2"}, "discrete_flow", 6.0, 1.0, 16, lumina2_conds),
    Supported("QwenImage21", {"image_model": "qwen_image21"}, "flux", 0.69, 1.0, 64, qwen_image21_conds),
    Supported("Flux2", {"image_model": "flux2"}, "flux", 2.02, 1.0, 128, flux2_conds),
)


# ---------------------------------------------------------------------------------------------
# The fake host: comfy.model_detection, utils, model_management, model_patcher, patcher_extension.

class FakeLatentFormat:
    """ComfyUI's latent format of the class: its channel count; process_in/out are the family's own numbers (their
    agreement with ComfyUI's is the family tests' business; here they carry reference latents across)."""

    def __init__(self, channels: int, ours):
        self.latent_channels, self._ours = channels, ours

    def process_in(self, latent):
        return self._ours.process_in(latent)

    def process_out(self, latent):
        return self._ours.process_out(latent)


class FakeBaseModel:
    def __init__(self, config: "FakeModelConfig", sd: dict):
        s, family = config.supported, family_of_keys(sd)
        self.model_config, self.current_patcher = config, None
        self.latent_format = FakeLatentFormat(s.latent_channels, family.adapter_class.latent_format)
        self.model_sampling = FluxModelSampling(s.shift, s.multiplier, kind=s.sampling)
        self.in_channels = config.unet_config.get("in_channels")
        self.diffusion_model = None

    def extra_conds(self, **kwargs):
        return self.model_config.supported.conds(self, **kwargs)


class FakeModelConfig:
    def __init__(self, supported: Supported, unet_config: dict):
        self.supported, self.unet_config = supported, dict(unet_config)
        self.supported_inference_dtypes = [torch.bfloat16, torch.float32]
        self.inference_dtype = None

    def set_inference_dtype(self, dtype, manual_cast_dtype):
        self.inference_dtype = (dtype, manual_cast_dtype)

    def get_model(self, sd, prefix=""):
        return FakeBaseModel(self, sd)


def family_of_keys(sd: dict):
    from parallel_runtime.models.registry import detect_family

    return detect_family(list(sd))[0]


def model_config_from_unet(sd: dict, prefix: str):
    config = detect_unet_config(sd)
    if config is None:
        return None
    return next((FakeModelConfig(s, config) for s in SUPPORTED if s.matches(config)), None)


def unet_prefix_from_state_dict(sd: dict) -> str:
    counts = {c: sum(k.startswith(c) for k in sd) for c in ("model.diffusion_model.", "model.model.", "net.")}
    top = max(counts, key=counts.get)
    return top if counts[top] > 5 else "model."


class FakePatcher:
    """comfy.model_patcher.ModelPatcher, as far as parallel_model and RemoteDiT use it."""

    def __init__(self, model, load_device=None, offload_device=None, size=0):
        self.model, self.patches, self.patches_uuid, self.wrappers = model, {}, None, {}

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers[(kind, key)] = fn


def get_all_wrappers(kind: str, transformer_options: dict) -> list:
    """comfy.patcher_extension.get_all_wrappers: transformer_options["wrappers"][kind] holds {key: [wrapper, ...]}."""
    return [fn for fns in (transformer_options.get("wrappers") or {}).get(kind, {}).values() for fn in fns]


class WrapperExecutor:
    """comfy.patcher_extension.WrapperExecutor: wrapper i gets (executor, *args, **kwargs); calling the executor
    runs wrapper i + 1, the last one the original; `class_obj` is the object the original is a method of."""

    def __init__(self, original, class_obj, wrappers: list, idx: int):
        self.original, self.class_obj, self.wrappers, self.idx = original, class_obj, list(wrappers), idx

    @classmethod
    def new_class_executor(cls, original, class_obj, wrappers: list, idx: int = 0):
        return cls(original, class_obj, wrappers, idx)

    def execute(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(*args, **kwargs)


@pytest.fixture
def comfy(monkeypatch):
    detection = types.ModuleType("comfy.model_detection")
    detection.unet_prefix_from_state_dict = unet_prefix_from_state_dict
    detection.model_config_from_unet = model_config_from_unet
    detection.convert_diffusers_mmdit = lambda sd, prefix: None  # our files are in ComfyUI's layout
    utils = types.ModuleType("comfy.utils")
    utils.state_dict_prefix_replace = lambda sd, replace, filter_keys=False: {
        k[len(p):]: v for k, v in sd.items() for p in replace if k.startswith(p)}
    utils.calculate_parameters = lambda sd: sum(t.numel() for t in sd.values())
    utils.weight_dtype = lambda sd: next(iter(sd.values())).dtype
    mm = types.ModuleType("comfy.model_management")
    mm.unet_dtype = lambda model_params, supported_dtypes, weight_dtype: torch.float32  # a CPU host
    mm.unet_manual_cast = lambda dtype, device, supported: None
    mm.get_torch_device = mm.unet_offload_device = lambda: torch.device("cpu")
    mm.processing_interrupted = lambda: False
    mm.unload_all_models = mm.soft_empty_cache = lambda: None
    patcher = types.ModuleType("comfy.model_patcher")
    patcher.ModelPatcher = FakePatcher
    extension = types.ModuleType("comfy.patcher_extension")
    extension.WrappersMP = types.SimpleNamespace(OUTER_SAMPLE="outer_sample", DIFFUSION_MODEL="diffusion_model")
    extension.get_all_wrappers = get_all_wrappers
    extension.WrapperExecutor = WrapperExecutor
    package = types.ModuleType("comfy")
    for name, module in (("model_detection", detection), ("utils", utils), ("model_management", mm),
                         ("model_patcher", patcher), ("patcher_extension", extension)):
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"comfy.{name}", module)
    monkeypatch.setitem(sys.modules, "comfy", package)
    return package


def model_call(patcher, x: torch.Tensor, sigma: float, chunks: list[dict],
               wrappers: dict | None = None, labels: list[int] | None = None) -> torch.Tensor:
    """BaseModel._apply_model on one batch of chunks (cond, uncond: one latent row each) as ComfyUI's sampler makes
    it: each chunk's extra_conds concatenated along the batch (tensors; lists element by element; constants, which
    ComfyUI batches only when equal, once), c_concat joined to the input-scaled latent, the timestep in the model's
    units; `wrappers`: the call's transformer_options["wrappers"] (as the sampler copies them from the patcher).
    Returns the diffusion model's output."""
    base = patcher.model
    conds = [base.extra_conds(noise=x[k:k + 1], **chunk) for k, chunk in enumerate(chunks)]
    kwargs = {}
    for key, first in conds[0].items():
        values = [c[key] for c in conds]
        if isinstance(first, torch.Tensor):
            kwargs[key] = torch.cat(values)
        elif isinstance(first, list) and first and isinstance(first[0], torch.Tensor):
            kwargs[key] = [torch.cat(parts) for parts in zip(*values)]
        else:
            assert all(v == first for v in values), key
            kwargs[key] = first
    sigmas = torch.full((x.shape[0],), sigma)
    xc = base.model_sampling.calculate_input(sigmas, x)
    if "c_concat" in kwargs:
        xc = torch.cat([xc, kwargs.pop("c_concat")], dim=1)
    t = base.model_sampling.timestep(sigmas).float()
    options = {"cond_or_uncond": labels or list(range(len(chunks))), "sigmas": sigmas, "wrappers": wrappers or {}}
    return base.diffusion_model(xc, t, context=kwargs.pop("c_crossattn"), control=None, transformer_options=options,
                                **kwargs)


# ---------------------------------------------------------------------------------------------
# The four families: tiny configs, one chunk's conditioning as ComfyUI's nodes make it and the same as a runtime
# Conditioning, ComfyUI's derived config against ours, and an input nothing reads.

def _flux2_config():
    from parallel_runtime.models.families.flux2 import Flux2Config

    # head_dim 128: ComfyUI's FLUX.2 branch counts heads as width // 128 (four 32-wide RoPE axes)
    return Flux2Config(hidden_size=256, num_heads=2, head_dim=128, num_layers=1, num_single_layers=1, mlp_hidden=768,
                       context_dim=64, in_channels=128, guidance_embeds=True)


def _z_image_config(released: bool = False):
    from parallel_runtime.models.families.z_image import ZImageConfig

    dim = 3840 if released else 256  # the released width is the one ComfyUI's branch knows Z-Image by
    # two refiners of each kind: NextDiT's default, which ComfyUI's detection does not read off the file
    return ZImageConfig(hidden_size=dim, num_heads=dim // 128, num_kv_heads=dim // 128, num_layers=1,
                        num_refiner_layers=2, ffn_dim=int(dim / 3 * 8), cap_feat_dim=2560 if released else 64,
                        time_hidden=min(dim, 1024))


def _qwen_image21_config():
    from parallel_runtime.models.families.qwen_image21 import QwenImage21Config

    return QwenImage21Config(hidden_size=128, num_heads=4, head_dim=32, num_layers=2, context_dim=32)


def _hunyuan_video15_config():
    from parallel_runtime.models.families.hunyuan_video15 import HunyuanVideo15Config

    return HunyuanVideo15Config(hidden_size=256, num_layers=1, text_dim=64)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _flux2_chunk(g, k):
    # FLUX.2's text encoders return a prompt mask (klein's pads to 512 tokens), which model_base.Flux drops
    mask = torch.tensor([[1.0, 1, 1, 0, 0]])
    chunk = {"cross_attn": _randn(g, 1, 5, 64), "pooled_output": None, "attention_mask": mask,
             "reference_latents": [_randn(g, 1, 128, 2, 2)]}
    if k == 0:
        chunk["guidance"] = 4.0  # FluxGuidance on the positive prompt; the negative keeps extra_conds' 3.5
    return chunk


def _flux2_branch(chunk):  # the raw prompt: the adapter pads it to 512 tokens itself
    return Conditioning(chunk["cross_attn"], torch.zeros(1, 0), guidance=chunk.get("guidance", 3.5),
                        references=tuple(chunk["reference_latents"]))


def _flux2_agreement(u, c):
    return [("hidden_size", u["hidden_size"], c.hidden_size), ("num_heads", u["num_heads"], c.num_heads),
            ("depth", u["depth"], c.num_layers), ("depth_single_blocks", u["depth_single_blocks"], c.num_single_layers),
            ("in_channels", u["in_channels"], c.in_channels), ("context_in_dim", u["context_in_dim"], c.context_dim),
            ("guidance_embed", u["guidance_embed"], c.guidance_embeds),
            ("mlp width", u["mlp_ratio"] * u["hidden_size"], c.mlp_hidden),
            ("axes_dim", u["axes_dim"], list(c.axes_dims_rope))]


def _z_image_chunk(g, k):
    # Qwen3 4B: no pooled vector; an unpadded prompt's all-ones mask, which extra_conds turns into num_tokens
    return {"cross_attn": _randn(g, 1, 7, 64), "pooled_output": None, "attention_mask": torch.ones(1, 7)}


def _z_image_branch(chunk):
    return Conditioning(chunk["cross_attn"], torch.zeros(1, 0))


def _z_image_agreement(u, c):
    out = [("dim", u["dim"], c.hidden_size), ("cap_feat_dim", u["cap_feat_dim"], c.cap_feat_dim),
           ("n_layers", u["n_layers"], c.num_layers), ("in_channels", u["in_channels"], c.in_channels),
           ("n_refiner_layers (NextDiT's default)", 2, c.num_refiner_layers)]
    if "n_heads" in u:  # set by width: the released one
        from parallel_runtime.models.families.z_image import PAD_MULTIPLE

        out += [("n_heads", u["n_heads"], c.num_heads), ("n_kv_heads", u["n_kv_heads"], c.num_kv_heads),
                ("axes_dims", u["axes_dims"], list(c.rope_axes)), ("rope_theta", u["rope_theta"], c.rope_theta),
                ("time_scale", u["time_scale"], c.time_scale),
                ("pad_tokens_multiple", u["pad_tokens_multiple"], PAD_MULTIPLE)]
    return out


def _qwen_image21_chunk(g, k):
    """TextEncodeQwenImage21 with one image: the reference placed before prompt row 2 (its image slot)."""
    return {"cross_attn": _randn(g, 1, 6, 32), "reference_latents": [_randn(g, 1, 64, 2, 2)], "image_slots": [2]}


def _qwen_image21_branch(chunk):
    return Conditioning(chunk["cross_attn"], torch.zeros(1, 0), references=tuple(chunk["reference_latents"]),
                        reference_slots=tuple(chunk["image_slots"]))


def _qwen_image21_agreement(u, c):
    return [("num_attention_heads", u["num_attention_heads"], c.num_heads),
            ("attention_head_dim", u["attention_head_dim"], c.head_dim), ("num_layers", u["num_layers"], c.num_layers),
            ("in_channels", u["in_channels"], c.in_channels), ("out_channels", u["out_channels"], c.out_channels),
            ("context_in_dim", u["context_in_dim"], c.context_dim), ("mlp_ratio", u["mlp_ratio"], c.mlp_ratio)]


_VIDEO = (2, 4, 4)  # frames, rows, columns of HunyuanVideo 1.5's latent


def _hunyuan_video15_chunk(g, k):
    mask = torch.ones(1, 1, *_VIDEO)
    mask[:, :, 0] = 0  # HunyuanVideo15ImageToVideo: the start frame is given
    # model_base.HunyuanVideo passes any prompt mask; an all-ones one (no padding) hides nothing
    return {"cross_attn": _randn(g, 1, 6, 64), "pooled_output": None, "attention_mask": torch.ones(1, 6),
            "conditioning_byt5small": _randn(g, 1, 3, 1472),
            "clip_vision_output": types.SimpleNamespace(last_hidden_state=_randn(g, 1, 4, 1152)),
            "concat_latent_image": _randn(g, 1, 32, *_VIDEO), "concat_mask": mask}


def _hunyuan_video15_branch(chunk):
    from parallel_runtime.sampling import HUNYUAN_VIDEO15_LATENT

    concat = torch.cat([HUNYUAN_VIDEO15_LATENT.process_in(chunk["concat_latent_image"]), 1 - chunk["concat_mask"]], 1)
    return Conditioning(chunk["cross_attn"], torch.zeros(1, 0), guidance=6.0, concat=concat,
                        clip_vision=chunk["clip_vision_output"].last_hidden_state,
                        glyph=chunk["conditioning_byt5small"])


def _hunyuan_video15_agreement(u, c):
    from parallel_runtime.models.families.hunyuan_video15 import GLYPH_WIDTH, ROPE_AXES, VISION_WIDTH

    return [("hidden_size", u["hidden_size"], c.hidden_size), ("num_heads", u["num_heads"], c.num_heads),
            ("depth", u["depth"], c.num_layers), ("depth_single_blocks", u["depth_single_blocks"], c.num_single_layers),
            ("in_channels", u["in_channels"], c.in_channels), ("out_channels", u["out_channels"], c.latent_channels),
            ("context_in_dim", u["context_in_dim"], c.text_dim), ("vision_in_dim", u["vision_in_dim"], VISION_WIDTH),
            ("byt5", u["byt5"], GLYPH_WIDTH > 0), ("patch_size", u["patch_size"], [c.patch_size] * 3),
            ("axes_dim", u["axes_dim"], list(ROPE_AXES))]


@dataclass(frozen=True)
class Case:
    config: Callable
    latent: tuple  # one latent row
    comfy_class: str  # the supported_models class ComfyUI 2026 picks for the tiny file
    chunk: Callable  # (generator, k) -> chunk k's conditioning as ComfyUI's nodes make it
    branch: Callable  # that chunk as a runtime Conditioning
    agreement: Callable  # (ComfyUI's unet_config, our config) -> [(value, ComfyUI's, ours)]
    refused: tuple  # (conditioning keys a node adds that nothing here reads, the refusal's pattern)


CASES = {
    "flux2": Case(_flux2_config, (128, 4, 4), "Flux2", _flux2_chunk, _flux2_branch, _flux2_agreement,
                  ({"reference_latents_method": "index_timestep_zero"},
                   r"reference latent method 'index_timestep_zero' is unknown; choose one of offset, index, uxo in "
                   r"FluxKontextMultiReferenceLatentMethod\.")),
    # At this width ComfyUI's branch takes a Z-Image file for Lumina 2 (it knows Z-Image by width 3840 only, see
    # test_released_z_image_is_comfyuis_z_image): the same BaseModel class, model_base.Lumina2, so the same call.
    "z_image": Case(_z_image_config, (16, 8, 8), "Lumina2", _z_image_chunk, _z_image_branch, _z_image_agreement,
                    ({"clip_vision_outputs": [torch.ones(1, 2, 2, 1152)]},
                     r"the model call carries inputs ParaDiT does not run \(siglip_feats: Z-Image Omni's SigLIP image "
                     r"features\); remove the node that adds them or load the model with UNETLoader\.")),
    "qwen_image21": Case(_qwen_image21_config, (64, 4, 4), "QwenImage21", _qwen_image21_chunk, _qwen_image21_branch,
                         _qwen_image21_agreement,
                         ({"image_slots": [9]},  # a slot past the 6-row prompt: damaged, refused before any work
                          r"the positive conditioning's image slots \[9\] do not fit its 6-row prompt and 1 reference "
                          r"latent\(s\); encode the prompt and its images with one TextEncodeQwenImage21 node\.")),
    "hunyuan_video15": Case(_hunyuan_video15_config, (32, *_VIDEO), "HunyuanVideo15", _hunyuan_video15_chunk,
                            _hunyuan_video15_branch, _hunyuan_video15_agreement,
                            ({"guiding_frame_index": torch.tensor([0.0])},
                             r"the model call carries inputs ParaDiT does not run \(guiding_frame_index: HunyuanVideo "
                             r"1\.0 image-to-video's guiding frame\); remove the node that adds them or load the model "
                             r"with UNETLoader\.")),
}


def write_header_only(path: str, config) -> str:
    """A bf16 safetensors file of `config`'s tensors whose data is a hole (reads as zeros, takes no disk): enough
    for whatever reads only the header (ComfyUI's detection, our model_config) at a released size."""
    header, offset = {}, 0
    for key, (shape, _) in family_of(config).checkpoint_shapes(config).items():
        size = math.prod(shape) * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        f.truncate(8 + len(blob) + offset)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_path_2026")
    out = {name: write_checkpoint(str(folder / f"{name}-tiny.safetensors"), case.config(), seed=5)
           for name, case in CASES.items()}
    out["z_image_released"] = write_header_only(str(folder / "z_image-3840-header.safetensors"), _z_image_config(True))
    return out


def _model(path: str, devices: str = "cpu:1", **degrees):
    from nodes import convert, remote_model

    strategy = convert.strategy_choice("manual", **degrees)
    return remote_model.parallel_model(convert.model_handle(path, "default", devices, strategy))


def _sampling_of(config):
    """Our family's model_sampling as (kind, shift, multiplier), read off its adapter without a model."""
    prop = family_of(config).adapter_class.model_sampling
    ms = (prop.func if hasattr(prop, "func") else prop.fget)(types.SimpleNamespace(config=config))
    return ms.kind, ms.shift, ms.multiplier


# ---------------------------------------------------------------------------------------------
# The tests.

@pytest.mark.parametrize("name", list(CASES))
def test_comfyui_2026_detects_our_file_with_our_config(name, files, comfy):
    """Load Parallel DiT's MODEL on our tiny file: the detection reaches this family's branch from the file's keys
    (no earlier branch takes it), picks the supported_models class, and derives the config we infer."""
    from nodes.remote_model import RemoteDiT
    from parallel_runtime.validate import model_config

    case, ours = CASES[name], model_config(files[name])
    model = _model(files[name])
    comfy_config = model.model.model_config
    assert comfy_config.supported.name == case.comfy_class
    assert isinstance(model.model.diffusion_model, RemoteDiT)
    assert comfy_config.unet_config["disable_unet_model_creation"] is True  # no weights on the host
    for value, theirs, mine in case.agreement(comfy_config.unet_config, ours):
        assert theirs == mine, f"{name}: ComfyUI's {value} {theirs!r} != ours {mine!r}"
    assert model.model.latent_format.latent_channels == ours.latent_channels
    ms = model.model.model_sampling
    # Z-Image at this width is Lumina 2's class to ComfyUI (shift 6); its own (shift 3) at the released width below.
    expected = ("discrete_flow", 6.0, 1.0) if case.comfy_class == "Lumina2" else _sampling_of(ours)
    assert (ms.kind, ms.shift, ms.multiplier) == expected
    # The token patch ComfyUI's Flux extra_conds reads off the diffusion model: the family adapter's (FLUX.2 1,
    # Qwen-Image 2.1 1: one token per latent pixel; a config's own patch_size may be a video's tuple).
    from parallel_runtime.models.registry import token_patch

    assert model.model.diffusion_model.patch_size == token_patch(ours)
    assert name not in ("flux2", "qwen_image21") or token_patch(ours) == 1


def test_released_z_image_is_comfyuis_z_image(files, comfy):
    """At the released width (3840, its header only) ComfyUI's Lumina 2 branch sets Z-Image's heads, RoPE and pad
    tokens and supported_models picks ZImage (shift 3, multiplier 1): all as our Z-Image config and sampling."""
    from parallel_runtime.validate import model_config

    ours = model_config(files["z_image_released"])
    model = _model(files["z_image_released"])
    comfy_config = model.model.model_config
    assert comfy_config.supported.name == "ZImage" and ours.family == "z_image"
    for value, theirs, mine in _z_image_agreement(comfy_config.unet_config, ours):
        assert theirs == mine, f"ComfyUI's {value} {theirs!r} != ours {mine!r}"
    ms = model.model.model_sampling
    assert (ms.kind, ms.shift, ms.multiplier) == _sampling_of(ours) == ("discrete_flow", 3.0, 1.0)


def _call(name, path, devices, clients, monkeypatch, extra=None, **degrees):
    """One stock-sampler model call (cond and uncond, sigma 0.7) through the parallel MODEL; returns it with the
    latent, timesteps and chunks it was made of."""
    case = CASES[name]
    g = torch.Generator().manual_seed(11)
    chunks = [{**case.chunk(g, k), **(extra or {})} for k in range(2)]
    x = _randn(g, 2, *case.latent)
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    model = _model(path, devices, **degrees)
    out = model_call(model, x, 0.7, chunks)
    t = model.model.model_sampling.timestep(torch.full((2,), 0.7)).float()
    return out, x, t, chunks


@pytest.mark.parametrize("name", list(CASES))
def test_one_model_call_equals_the_runtime_job(name, files, comfy, client1, client2, monkeypatch):
    """The call ComfyUI 2026's BaseModel makes (this class's extra_conds batched over cond and uncond) through
    RemoteDiT equals the job built by hand from the same conditioning run on the runtime client, and Ulysses-2
    equals both."""
    case, clients = CASES[name], {"cpu:1": client1, "cpu:2": client2}
    remote, x, t, chunks = _call(name, files[name], "cpu:1", clients, monkeypatch)
    job = Job(ModelSpec(files[name]), StrategySpec(), SamplingSpec(steps=1), x.clone(), case.branch(chunks[0]),
              case.branch(chunks[1]), timestep=t)
    direct = client1.run(job).latent
    assert remote.shape == direct.shape == x.shape and torch.isfinite(direct).all()
    # Same worker, same job; the only rounding between the two is the reference latents' trip through the host's
    # process_in and back (float32, ~1e-7 relative) and FLUX.2's prompt padded by the host instead of the adapter.
    assert rel_err(remote, direct) <= 1e-6, (name, rel_err(remote, direct))
    ulysses, *_ = _call(name, files[name], "cpu:2", clients, monkeypatch, ulysses_degree=2)
    # Exact strategy: attention's sums in another order over the two head groups (float32 round-off).
    assert rel_err(ulysses, direct) <= 1e-4, (name, rel_err(ulysses, direct))
    print(f"{name}: MODEL vs job {rel_err(remote, direct):.1e}, Ulysses-2 {rel_err(ulysses, direct):.1e}")


@pytest.mark.parametrize("name", list(CASES))
def test_an_input_nothing_reads_is_refused_in_one_sentence(name, files, comfy, client1, monkeypatch):
    """A conditioning key ComfyUI 2026 turns into a model input that no family here reads is refused before any
    work, in one sentence naming what adds it, rather than dropped."""
    case = CASES[name]
    keys, pattern = case.refused
    with pytest.raises(ConfigError, match=f"^{pattern}$") as refusal:
        _call(name, files[name], "cpu:1", {"cpu:1": client1}, monkeypatch, extra=dict(keys))
    assert ". " not in str(refusal.value)


def test_the_parallel_models_token_patch_is_an_int_for_every_family_kind(tmp_path):
    """RemoteDiT.patch_size (read by ComfyUI's Flux extra_conds and by the per-call strategy fit) is the adapter's
    token patch for a video family too, whose config's own patch_size is a (t, h, w) tuple: Wan's 2, not (1, 2, 2)
    (a tuple there failed every Wan graph with a TypeError)."""
    from nodes.remote_model import RemoteDiT
    from parallel_runtime.models.families.wan import WanConfig

    path = write_checkpoint(str(tmp_path / "wan.safetensors"), WanConfig(hidden_size=256, num_layers=1, ffn_dim=512,
                                                                         text_dim=64), seed=0)
    dit = types.SimpleNamespace(_patch_size=None, handle=types.SimpleNamespace(model=types.SimpleNamespace(path=path)))
    assert RemoteDiT.patch_size.fget(dit) == 2


class RecordingClient:
    """A runtime client that hands each job it runs to `record` first, then runs it on `client`."""

    def __init__(self, client, record):
        self._client, self._record = client, record

    def __getattr__(self, name):
        return getattr(self._client, name)

    def run(self, job, **kw):
        self._record(job)
        return self._client.run(job, **kw)


def test_a_step_cache_wrapper_runs_on_the_host_and_a_skipped_call_never_reaches_the_workers(files, comfy, client1,
                                                                                          monkeypatch):
    """ComfyUI's DIFFUSION_MODEL wrappers (EasyCache's step cache) run around the parallel MODEL's call as they run
    around ComfyUI's own diffusion model: a call the wrapper answers from its cache sends no job to the workers,
    and a call it passes on returns the workers' output. (Before, RemoteDiT ran no wrapper: EasyCache silently
    never skipped a step on the parallel MODEL.)"""
    jobs = []

    seen, cached = [], {}

    def step_cache(executor, *args, **kwargs):
        """Computes the first call and answers every later one with the first's output, as a cache would."""
        seen.append((type(executor.class_obj).__name__, isinstance(args[-1], dict) and "sigmas" in args[-1]))
        if "out" in cached:
            return cached["out"].clone()
        cached["out"] = executor(*args, **kwargs)
        return cached["out"]

    case = CASES["flux2"]
    g = torch.Generator().manual_seed(11)
    chunks = [case.chunk(g, k) for k in range(2)]
    x = _randn(g, 2, *case.latent)
    counting = RecordingClient(client1, lambda job: jobs.append(job.call_step))
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: counting)
    model = _model(files["flux2"])
    plain = model_call(model, x, 0.7, chunks)
    wrappers = {"diffusion_model": {"easycache": [step_cache]}}
    first, second = (model_call(model, x, sigma, chunks, wrappers) for sigma in (0.7, 0.6))
    # The wrapper saw RemoteDiT and ComfyUI's transformer_options (positional, as EasyCache reads them) twice;
    # the workers got the unwrapped call and the wrapper's first, not its cached second.
    assert seen == [("RemoteDiT", True)] * 2
    assert len(jobs) == 2
    assert torch.equal(first, plain) and torch.equal(second, plain)


def test_cond_and_uncond_in_separate_calls_keep_separate_stale_kv_slots(files, comfy, client1, monkeypatch):
    """ComfyUI runs cond and uncond as two calls where their shapes differ: each job's slot says which it carries,
    so PipeFusion's stale K/V of the one is never read by the other (before, both were slot 0)."""
    slots = []

    case = CASES["flux2"]
    g = torch.Generator().manual_seed(12)
    cond, uncond = (case.chunk(g, k) for k in range(2))
    x = _randn(g, 1, *case.latent)
    recording = RecordingClient(client1, lambda job: slots.append(job.call_slot))
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: recording)
    model = _model(files["flux2"])
    model_call(model, x, 0.7, [cond], labels=[0])
    model_call(model, x, 0.7, [uncond], labels=[1])
    model_call(model, x.repeat(2, 1, 1, 1), 0.7, [cond, uncond], labels=[0, 1])
    assert slots == [0, 1, 0]  # cond alone, uncond alone, both in one job (one more job of the call: 2, 3, ...)
