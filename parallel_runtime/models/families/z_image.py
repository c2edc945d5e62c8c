"""Z-Image (Tongyi-MAI Z-Image Turbo and Z-Image base): NextDiT, Lumina 2's single-stream DiT, with learned pad
tokens (ComfyUI's comfy/ldm/lumina/model.py with z_image_modulation; diffusers' ZImageTransformer2DModel).

What differs from Lumina 2 (lumina2.py, whose adapter this module reuses through its hooks):
- Pad tokens. ComfyUI pads the embedded prompt with `cap_pad_token` and the embedded image with `x_pad_token`,
  each to a multiple of 32 rows, and attends over the pad rows unmasked. Both ride as ordinary rows of the
  sequence: the padded prompt is what embed_text returns (`prompt_rows`), refined whole and split like Lumina 2's;
  the image's pad rows follow the image in the image stream (`stream_pad`, `pad_rows`), so the noise refiner and
  the main layers see them on every strategy, split over shards and PipeFusion patches like reference rows. That
  keeps every exact strategy exact: the same rows attend to the same rows, wherever they are held.
- RoPE: theta 256, axes (32, 48, 48) of the 128-wide head (here: a quarter and two three-eighths of any head),
  prompt row i at (1 + i, 0, 0), image rows at (padded prompt + 1, row, col), image pad rows at (0, 0, 0).
- Modulation: 256-wide adaLN input (min(dim, 256)); the blocks' modulation is one Linear without SiLU
  (`adaLN_modulation.0`), the final layer's keeps its SiLU; t_embedder reads (1 - sigma) x 1000 through a
  min(dim, 1024)-wide hidden layer. No GQA (30 heads, 30 key/value heads), SwiGLU of 8/3 x width.
- Qwen3 4B's 2560-wide prompt features (CLIPLoader type lumina2); sampling ModelSamplingDiscreteFlow with shift 3,
  multiplier 1 (supported_models.ZImage) on Flux's latent format. Turbo (cfg 1, ~8 steps) and base (cfg 3-5,
  28-50 steps) have the same shapes: nothing in the file tells them apart, and both run alike.

The module tree is diffusers' ZImageTransformer2DModel (separate to_q/to_k/to_v), so diffusers-layout files map
one to one and ComfyUI's fused `attention.qkv` maps to row thirds; LoRA patches on ComfyUI's names land on those
rows. Where this follows ComfyUI rather than diffusers: the per-head q/k RMS norms use float32's eps (ComfyUI's
RMSNorm without eps) where diffusers' use 1e-5, and a model narrower than 1024 keeps its file's t_embedder width
(diffusers fixes it at 1024; the released 3840-wide model has 1024 either way). Refused in one sentence each:
Ming-Image (Z-Image's layers without pad tokens), Z-Image Omni (SigLIP) and the pixel-space variant.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ..detection import DIFFUSERS_PREFIXES, Signature, match_signatures
from ..family import DiTFamily, Match
from .lumina2 import BLOCK_LISTS, Lumina2Adapter, Lumina2Config, block_inputs, parameter_kind, z_image_keys

PAD_MULTIPLE = 32  # ComfyUI's pad_tokens_multiple, diffusers' SEQ_MULTI_OF
PATCH_KEY = "2-1"  # diffusers' all_x_embedder / all_final_layer entry for 2x2 patches of one frame
ALWAYS_OWNED = ("t_embedder.",)
FIRST_STAGE = ("all_x_embedder.", "cap_embedder.", "context_refiner.", "x_pad_token", "cap_pad_token")
LAST_STAGE = ("all_final_layer.",)
# ComfyUI name -> diffusers name, for the parameters whose names differ (besides the fused qkv).
_COMFY_NAMES = (("x_embedder.", f"all_x_embedder.{PATCH_KEY}."), ("final_layer.", f"all_final_layer.{PATCH_KEY}."),
                (".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
                (".attention.k_norm.", ".attention.norm_k."))
_QKV = re.compile(r"(.+\.attention)\.to_([qkv])\.weight$")
# The keys comfy/model_detection.py tells these NextDiT relatives by.
_UNSUPPORTED = {"dec_net.cond_embed.weight": "the pixel-space Z-Image", "siglip_embedder.0.weight": "Z-Image Omni"}


def _pad(n: int) -> int:
    return (-n) % PAD_MULTIPLE


@dataclass(frozen=True)
class ZImageConfig(Lumina2Config):
    time_hidden: int = 1024  # t_embedder's hidden width: ComfyUI's min(dim, 1024)

    family = "z_image"
    title = "Z-Image"
    variant = "z_image"
    text_encoders = "Qwen3 4B (CLIPLoader type lumina2)"
    rope_theta = 256.0
    time_scale = 1000.0
    sampling_shift = 3.0

    def __post_init__(self):
        heads_fit = self.hidden_size % self.num_heads == 0 and self.num_kv_heads == self.num_heads
        if not heads_fit or self.head_dim % 16 or self.ffn_dim != int(self.hidden_size / 3 * 8):
            raise ModelFileError(f"Z-Image config is inconsistent ({self.hidden_size} wide, {self.num_heads} heads, "
                                 f"{self.num_kv_heads} key/value heads, a {self.ffn_dim}-wide MLP); the file is "
                                 f"damaged, so re-download it.")

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """ComfyUI's axes_dims, (32, 48, 48) for the released 128-wide heads: a quarter, then three-eighths twice."""
        return self.head_dim // 4, self.head_dim * 3 // 8, self.head_dim * 3 // 8

    @property
    def adaln_dim(self) -> int:
        return min(self.hidden_size, 256)


# -- checkpoint layout --------------------------------------------------------------------------------

def match_layout(keys: list[str]) -> Match | None:
    """ComfyUI's layout: NextDiT's keys with Z-Image's pad tokens or modulation (`lumina2.z_image_keys`); diffusers':
    `all_x_embedder.2-1` beside the caption embedder."""
    patches = f"all_x_embedder.{PATCH_KEY}.weight"
    return match_signatures(
        keys, Signature("comfy", ("cap_embedder.1.weight",), ("layers",), absent=(patches,), also=z_image_keys),
        Signature("diffusers", (patches, "cap_embedder.1.weight"), prefixes=DIFFUSERS_PREFIXES))


def _comfy_name(name: str) -> str:
    """The ComfyUI key of a diffusers parameter whose name differs only by renaming (not to_q/to_k/to_v)."""
    for comfy, diffusers in _COMFY_NAMES:
        name = name.replace(diffusers, comfy)
    return name


def infer_config(reader, match: Match, name: str) -> ZImageConfig:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    for key, what in _UNSUPPORTED.items():
        if p + key in reader:
            raise ModelFileError(f"{name} is {what} model, which ParaDiT does not run yet; load it with UNETLoader or "
                                 f"choose a Z-Image Turbo or Z-Image base file.")
    if p + "cap_pad_token" not in reader or p + "x_pad_token" not in reader:
        raise ModelFileError(f"{name} has Z-Image's layers but not its learned pad tokens (cap_pad_token, "
                             f"x_pad_token): it is a Ming-Image model or an incomplete Z-Image file; ParaDiT runs "
                             f"Z-Image Turbo and base, so re-download the Z-Image file or load this one with "
                             f"UNETLoader.")
    comfy = match.layout == "comfy"

    def key(diffusers_name: str) -> str:
        return _comfy_name(diffusers_name) if comfy else diffusers_name

    shape = tensor_shapes(reader, p, name, "a complete Z-Image DiT")
    dim, patch_in = shape(key(f"all_x_embedder.{PATCH_KEY}.weight"))
    head_dim = shape(key("layers.0.attention.norm_q.weight"))[0]
    if patch_in % 4 or dim % head_dim:
        raise ModelFileError(f"{name}: a {patch_in}-wide patch input or {head_dim}-wide heads in a {dim}-wide model "
                             f"are no Z-Image shape; the file is damaged, so re-download it.")
    heads = dim // head_dim
    if comfy:
        kv_heads = (shape("layers.0.attention.qkv.weight")[0] // head_dim - heads) // 2
    else:
        kv_heads = shape("layers.0.attention.to_k.weight")[0] // head_dim
    adaln = shape("layers.0.adaLN_modulation.0.weight")[1]
    if adaln != min(dim, 256):
        raise ModelFileError(f"{name}'s modulation reads a {adaln}-wide input where a {dim}-wide Z-Image reads "
                             f"{min(dim, 256)}; the file is damaged, so re-download it.")
    keys = reader.keys()
    return ZImageConfig(hidden_size=dim, num_heads=heads, num_kv_heads=kv_heads,
                        num_layers=block_count(keys, p, "layers", name),
                        num_refiner_layers=block_count(keys, p, "noise_refiner", name),
                        ffn_dim=shape("layers.0.feed_forward.w1.weight")[0],
                        cap_feat_dim=shape("cap_embedder.1.weight")[1], in_channels=patch_in // 4,
                        time_hidden=shape("t_embedder.mlp.0.weight")[0])


def _meta_model(config: ZImageConfig) -> torch.nn.Module:
    """diffusers' ZImageTransformer2DModel of this config on the meta device (its t_embedder at the file's width)."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.models.transformers.transformer_z_image import TimestepEmbedder

    with torch.device("meta"):
        model = ZImageTransformer2DModel(
            in_channels=config.in_channels, dim=config.hidden_size, n_layers=config.num_layers,
            n_refiner_layers=config.num_refiner_layers, n_heads=config.num_heads, n_kv_heads=config.num_kv_heads,
            cap_feat_dim=config.cap_feat_dim, rope_theta=config.rope_theta, t_scale=config.time_scale,
            axes_dims=list(config.rope_axes))
        if config.time_hidden != 1024:
            model.t_embedder = TimestepEmbedder(config.adaln_dim, mid_size=config.time_hidden)
    return model


def source_map(config: ZImageConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    """Every diffusers parameter -> its key: its own name in a diffusers file; in ComfyUI's (any other layout name)
    renamed, with to_q / to_k / to_v as thirds of the fused `attention.qkv`."""
    names = _meta_model(config).state_dict()
    if layout == "diffusers":
        return same_names(names, prefix)
    d = config.hidden_size
    out = {}
    for n in names:
        qkv = _QKV.match(n)
        if qkv:
            part = "qkv".index(qkv.group(2))
            out[n] = Source(f"{prefix}{_comfy_name(qkv.group(1))}.qkv.weight", slice(part * d, (part + 1) * d))
        else:
            out[n] = Source(prefix + _comfy_name(n))
    return out


def checkpoint_shapes(config: ZImageConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a Z-Image file, for writing random test checkpoints."""
    shapes = {}
    for name, p in _meta_model(config).state_dict().items():
        key = _comfy_name(name)
        if _QKV.match(name):
            key, shape = _comfy_name(_QKV.match(name).group(1)) + ".qkv.weight", (3 * p.shape[0], p.shape[1])
        else:
            shape = tuple(p.shape)
        # pad tokens: learned rows in the hidden space, O(1) like embedded tokens
        shapes[key] = (shape, "table" if name.endswith("pad_token") else parameter_kind(name))
    return shapes


# -- the strategies' view -----------------------------------------------------------------------------

def sequence_ids(text_len: int, rows: int, cols: int) -> torch.Tensor:
    """RoPE ids of ComfyUI's embed_all over [padded prompt, image, image pads]: prompt row i at (1 + i, 0, 0), image
    tokens at (text_len + 1, row, col), the image's pad rows at (0, 0, 0)."""
    image = rows * cols
    ids = torch.zeros(text_len + image + _pad(image), 3)
    ids[:text_len, 0] = torch.arange(1, text_len + 1)
    ids[text_len:text_len + image, 0] = text_len + 1
    ids[text_len:text_len + image, 1] = torch.arange(rows).repeat_interleave(cols)
    ids[text_len:text_len + image, 2] = torch.arange(cols).repeat(rows)
    return ids


class ZImageAdapter(Lumina2Adapter):
    variant = "z_image"
    _sequence_ids = staticmethod(sequence_ids)

    @staticmethod
    def prompt_rows(tokens: int) -> int:
        """Rows of the embedded prompt: padded with cap_pad_token to a multiple of 32."""
        return tokens + _pad(tokens)

    @staticmethod
    def stream_pad(rows: int) -> int:
        """x_pad_token rows after an image stream of `rows` rows, to a multiple of 32."""
        return _pad(rows)

    def pad_rows(self, count: int, batch: int) -> torch.Tensor:
        return self.model.x_pad_token.to(self.dtype).expand(batch, count, -1)

    @property
    def _x_embedder(self) -> torch.nn.Module:
        return self.model.all_x_embedder[PATCH_KEY]

    @property
    def _final_layer(self) -> torch.nn.Module:
        return self.model.all_final_layer[PATCH_KEY]

    def _embed_prompt(self, cond: torch.Tensor) -> torch.Tensor:
        """cap_embedder, then cap_pad_token rows up to a multiple of 32 (ComfyUI's pad_zimage)."""
        text = self.model.cap_embedder(cond.to(self.device, self.dtype))
        pad = self.model.cap_pad_token.to(text.dtype).expand(text.shape[0], _pad(text.shape[1]), -1)
        return torch.cat([text, pad], dim=1)

    def _qkv(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Separate q/k/v projections; the per-head RMS norms with float32's eps, as ComfyUI's (diffusers: 1e-5)."""
        q, k, v = (proj(x).unflatten(-1, (-1, self.config.head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        return _head_norm(q, attn.norm_q.weight), _head_norm(k, attn.norm_k.weight), v

    def _out(self, attn, y: torch.Tensor) -> torch.Tensor:
        return attn.to_out[0](y)


def _head_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(torch.float32).eps
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


Z_IMAGE = DiTFamily(
    name="z_image", title="Z-Image (Turbo, base)", match=match_layout, infer_config=infer_config,
    meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=ZImageAdapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="comfy", replace_keys=(), block_inputs=block_inputs)
