"""PixArt-α and PixArt-Σ: a DiT with cross-attention to the prompt and eps prediction.

Unlike the MMDiTs, the prompt is not in the attention sequence: each block runs self-attention over image
tokens only (split across ranks like any image-only attention), then cross-attention from its image rows to
the whole prompt (no communication: every rank holds the prompt), then the MLP. One timestep embedding
(plus size and aspect-ratio embeddings on PixArt-α) gives every block's six modulation rows. Positions are
2D sin/cos rows computed per image size with ComfyUI's base-size rule (the file's table is not used). The
model predicts noise and a variance; ComfyUI keeps the first 4 channels and samples with
ModelSamplingDiscrete (sqrt_linear betas) + EPS on the SD1.5 (α) or SDXL (Σ) latent format.

Blocks are diffusers' `PixArtTransformer2DModel` blocks with our attention processors. diffusers computes
positions with a fixed base size; ComfyUI's follows the request, so the rows are computed here. Key layouts:
the original (ComfyUI) one, mapped as comfy/utils.py's PIXART_MAP does, and diffusers'.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...sampling import DiscreteEPSSampling, LatentFormat
from ...weights.keymap import Source, block_count, linear, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..detection import DIFFUSERS_PREFIXES, Signature, signature_match
from ..family import BlockKind, DiTFamily, FixedHeadSizeConfig, Match, OneBlockListConfig, diffusers_meta_model
from ..shapes import CheckpointShapes
from .flux_adapter import FluxAdapter, channels_first, patch_conv

HEAD_DIM = 72  # ComfyUI hard-codes 16 heads of 72 (1152 wide) for every PixArt
ALWAYS_OWNED = ("adaln_single.",)
FIRST_STAGE = ("pos_embed.", "caption_projection.")
LAST_STAGE = ("norm_out.", "proj_out.", "scale_shift_table")
BLOCK_LISTS = ("transformer_blocks",)
PIXART_BLOCK = BlockKind("self+cross", ("image", "prompt"))
SD15_LATENT = LatentFormat("sd15", 0.18215, 0.0)
SDXL_LATENT = LatentFormat("sdxl", 0.13025, 0.0)


@dataclass(frozen=True)
class PixArtConfig(FixedHeadSizeConfig, OneBlockListConfig):
    hidden_size: int
    num_layers: int
    micro_condition: bool  # PixArt-α (1024): size and aspect-ratio embeddings
    caption_channels: int = 4096
    pe_interpolation: int | None = None  # from a stored table's size; None: from the image size, per call
    in_channels: int = 4
    out_channels: int = 8  # eps and the learned variance
    patch_size: int = 2

    family = "pixart"
    pooled_dim = 0
    text_encoders = "T5-XXL (CLIPLoader type pixart)"

    head_dim = HEAD_DIM

    def __post_init__(self):
        self.check_width("PixArt width")

    @property
    def title(self) -> str:
        return "PixArt-α" if self.micro_condition else "PixArt-Σ"

    @property
    def variant(self) -> str:
        return "alpha" if self.micro_condition else "sigma"

    @property
    def context_dim(self) -> int:
        return self.caption_channels

    # The position grid scales to a base of (h + w) / 2 rounded to 64 latent px: at 32 or less that is 0 and
    # ComfyUI's PixArt divides by it, so images must average more than 256 px a side.
    min_mean_latent_side = 33

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        """Image-only self-attention, then cross-attention to the prompt, which every rank holds whole."""
        return (PIXART_BLOCK,) * self.num_layers

    def diffusers_kwargs(self) -> dict:
        return dict(num_attention_heads=self.num_heads, attention_head_dim=HEAD_DIM, in_channels=self.in_channels,
                    out_channels=self.out_channels, num_layers=self.num_layers, cross_attention_dim=self.hidden_size,
                    caption_channels=self.caption_channels, sample_size=8, patch_size=self.patch_size,
                    norm_type="ada_norm_single", use_additional_conditions=self.micro_condition,
                    attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=1)


# -- checkpoint layout --------------------------------------------------------------------------------

match_layout = signature_match(
    Signature("original", ("t_block.1.weight",), ("blocks",)),
    Signature("diffusers", ("adaln_single.linear.weight", "caption_projection.linear_1.weight"),
              ("transformer_blocks",), DIFFUSERS_PREFIXES))


_SHAPE_KEYS = {
    "original": dict(proj="x_embedder.proj.weight", out="final_layer.linear.weight", blocks="blocks",
                     caption="y_embedder.y_proj.fc1.weight", micro="ar_embedder.mlp.0.weight", table="pos_embed"),
    "diffusers": dict(proj="pos_embed.proj.weight", out="proj_out.weight", blocks="transformer_blocks",
                      caption="caption_projection.linear_1.weight",
                      micro="adaln_single.emb.aspect_ratio_embedder.linear_1.weight", table=None),
}


def infer_config(reader, match: Match, name: str) -> PixArtConfig:
    p, k = match.prefix, _SHAPE_KEYS[match.layout]
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))

    shape = tensor_shapes(reader, p, name, "a complete PixArt DiT")

    hidden, in_channels, patch, _ = shape(k["proj"])
    pe_interpolation = None
    if k["table"] is not None and p + k["table"] in reader:  # model_detection: input_size // 64
        pe_interpolation = round(reader.shape(p + k["table"])[1] ** 0.5) * patch // 64
    return PixArtConfig(hidden_size=hidden, num_layers=block_count(reader.keys(), p, k["blocks"], name),
                        micro_condition=p + k["micro"] in reader, caption_channels=shape(k["caption"])[1],
                        pe_interpolation=pe_interpolation, in_channels=in_channels,
                        out_channels=shape(k["out"])[0] // (patch * patch), patch_size=patch)


_diffusers_model = diffusers_meta_model("PixArtTransformer2DModel")


def source_map(config: PixArtConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    """comfy/utils.py's PIXART_MAP_BASIC / PIXART_MAP_BLOCK, read in the other direction."""
    if layout == "diffusers":
        return same_names(_diffusers_model(config).state_dict(), prefix)
    p, H = prefix, config.hidden_size
    out: dict[str, Source] = {}
    linear(out, "pos_embed.proj", p + "x_embedder.proj")
    linear(out, "adaln_single.emb.timestep_embedder.linear_1", p + "t_embedder.mlp.0")
    linear(out, "adaln_single.emb.timestep_embedder.linear_2", p + "t_embedder.mlp.2")
    linear(out, "adaln_single.linear", p + "t_block.1")
    linear(out, "caption_projection.linear_1", p + "y_embedder.y_proj.fc1")
    linear(out, "caption_projection.linear_2", p + "y_embedder.y_proj.fc2")
    if config.micro_condition:
        for ours, theirs in (("resolution_embedder", "csize_embedder"), ("aspect_ratio_embedder", "ar_embedder")):
            linear(out, f"adaln_single.emb.{ours}.linear_1", f"{p}{theirs}.mlp.0")
            linear(out, f"adaln_single.emb.{ours}.linear_2", f"{p}{theirs}.mlp.2")
    for i in range(config.num_layers):
        d, b = f"transformer_blocks.{i}", f"{p}blocks.{i}"
        out[f"{d}.scale_shift_table"] = Source(f"{b}.scale_shift_table")
        for name, rows in (("to_q", slice(0, H)), ("to_k", slice(H, 2 * H)), ("to_v", slice(2 * H, 3 * H))):
            linear(out, f"{d}.attn1.{name}", f"{b}.attn.qkv", rows)
        linear(out, f"{d}.attn1.to_out.0", f"{b}.attn.proj")
        linear(out, f"{d}.attn2.to_q", f"{b}.cross_attn.q_linear")
        linear(out, f"{d}.attn2.to_k", f"{b}.cross_attn.kv_linear", slice(0, H))
        linear(out, f"{d}.attn2.to_v", f"{b}.cross_attn.kv_linear", slice(H, 2 * H))
        linear(out, f"{d}.attn2.to_out.0", f"{b}.cross_attn.proj")
        linear(out, f"{d}.ff.net.0.proj", f"{b}.mlp.fc1")
        linear(out, f"{d}.ff.net.2", f"{b}.mlp.fc2")
    linear(out, "proj_out", p + "final_layer.linear")
    out["scale_shift_table"] = Source(p + "final_layer.scale_shift_table")
    return out


def checkpoint_shapes(config: PixArtConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{original key: (shape, kind)} of a PixArt file, for writing random test checkpoints."""
    H, P = config.hidden_size, config.patch_size
    out = CheckpointShapes()
    lin = out.linear
    out.conv("x_embedder.proj", H, config.in_channels, P, P)
    lin("t_embedder.mlp.0", H, 256)
    lin("t_embedder.mlp.2", H, H)
    lin("t_block.1", 6 * H, H, "mod")
    lin("y_embedder.y_proj.fc1", H, config.caption_channels)
    lin("y_embedder.y_proj.fc2", H, H)
    out.table("y_embedder.y_embedding", 8, config.caption_channels)  # unused at inference
    if config.micro_condition:
        for name in ("csize_embedder", "ar_embedder"):
            lin(f"{name}.mlp.0", H // 3, 256)
            lin(f"{name}.mlp.2", H // 3, H // 3)
    if config.pe_interpolation is not None:  # a stored table of (64 * pe_interpolation / 2)^2 rows pins it
        side = 32 * config.pe_interpolation
        out.table("pos_embed", 1, side * side, H)
    for i in range(config.num_layers):
        b = f"blocks.{i}"
        out.table(f"{b}.scale_shift_table", 6, H)
        lin(f"{b}.attn.qkv", 3 * H, H)
        lin(f"{b}.attn.proj", H, H)
        lin(f"{b}.cross_attn.q_linear", H, H)
        lin(f"{b}.cross_attn.kv_linear", 2 * H, H)
        lin(f"{b}.cross_attn.proj", H, H)
        lin(f"{b}.mlp.fc1", 4 * H, H)
        lin(f"{b}.mlp.fc2", H, 4 * H)
    lin("final_layer.linear", P * P * config.out_channels, H)
    out.table("final_layer.scale_shift_table", 2, H)
    return out


# -- the strategies' view -----------------------------------------------------------------------------

class SelfAttnProcessor:
    """attn1: self-attention over image tokens, handed to the job's image-only attention strategy."""

    def __init__(self, layer: int, context):
        self.layer, self.context = layer, context

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        out = self.context.image_attention(q, k, v, self.layer).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


class CrossAttnProcessor:
    """attn2: this rank's image rows attend to the whole prompt, which every rank holds (no communication)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        def heads(t):
            return t.unflatten(-1, (attn.heads, -1)).transpose(1, 2)

        q = heads(attn.to_q(hidden_states))
        k, v = heads(attn.to_k(encoder_hidden_states)), heads(attn.to_v(encoder_hidden_states))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def block_inputs(config: PixArtConfig, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, projected prompt, (six modulation rows, embedded timestep), no RoPE) of one block call."""
    h = config.hidden_size
    temb = (torch.randn(1, 6 * h, generator=generator), torch.randn(1, h, generator=generator))
    return torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator), temb, None


class PixArtAdapter:
    patch = 2
    default_guidance = 0.0  # no guidance input
    joint_text = False  # the prompt is cross-attended, not part of the attention sequence
    pack = staticmethod(FluxAdapter.pack)  # (c, ph, pw) per patch: the order of the patch conv's weights
    unpack = staticmethod(FluxAdapter.unpack)

    def __init__(self, config: PixArtConfig, model, chunks: list[range], context):
        self.config, self.model, self.chunks = config, model, chunks
        self.latent_channels = config.in_channels
        self.latent_format = SD15_LATENT if config.micro_condition else SDXL_LATENT
        for i in (i for chunk in chunks for i in chunk):
            model.transformer_blocks[i].attn1.set_processor(SelfAttnProcessor(i, context))
            model.transformer_blocks[i].attn2.set_processor(CrossAttnProcessor())
        self.dtype, self.device = compute_placement(model.adaln_single)
        self._positions: dict = {}
        self._micro: dict = {}

    @functools.cached_property
    def model_sampling(self):
        return DiscreteEPSSampling("sqrt_linear")  # supported_models.PixArtAlpha (Σ inherits it)

    def rope(self, text_len: int, h: int, w: int, references=(), method=None):
        return None  # absolute positions, added in embed_image

    def _position_table(self, hw: tuple[int, int]) -> torch.Tensor:
        """PixArtMS.forward_orig's sin/cos rows for an h x w latent, in the compute dtype as ComfyUI makes them:
        the grid is scaled to a base size that follows the image ((h + w) / 2 rounded to 64, halved)."""
        if hw not in self._positions:
            h, w = hw
            c_res = (h + w) // 2
            interp = self.config.pe_interpolation
            if interp is None:
                interp = round(c_res / (512 / 8.0))
            base = (round(c_res / 64) * 64) // self.patch
            rows, cols, dtype = h // self.patch, w // self.patch, self.dtype
            grid_h, grid_w = torch.meshgrid(torch.arange(rows, dtype=dtype) / (rows / base) / interp,
                                            torch.arange(cols, dtype=dtype) / (cols / base) / interp, indexing="ij")
            half = self.config.hidden_size // 2
            self._positions[hw] = torch.cat([_sincos(half, grid_w, dtype), _sincos(half, grid_h, dtype)],
                                            dim=1).to(self.device)
        return self._positions[hw]

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """The patch conv as a matmul on packed tokens, plus the position rows of `index`."""
        image = patch_conv(tokens.to(self.device, self.dtype), self.model.pos_embed.proj)
        return image + self._position_table(hw)[index]

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.caption_projection(cond.to(self.device, self.dtype))

    reads_image_size = True  # PixArt-α's c_size / c_ar (CLIPTextEncodePixArtAlpha's width and height)

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None, sizes: tuple = ()):
        """(six modulation rows per item, the embedded timestep the head uses) at t = the nearest table index
        of sigma (ModelSamplingDiscrete's units), as float32; PixArt-α adds its size and aspect-ratio embeddings: per branch, the (height, width,
        aspect) its text encode node attached, else the h x w latent's image in pixels with aspect height / width
        (ComfyUI's PixArt.forward defaults)."""
        t = t.to(self.device, torch.float32)
        extra = self._micro_conditions(hw, t.shape[0], tuple(sizes))
        return self.model.adaln_single(t, extra, batch_size=t.shape[0], hidden_dtype=self.dtype)

    def _micro_conditions(self, hw: tuple[int, int], n: int, sizes: tuple) -> dict:
        """c_size and c_ar of n items (the branches' sizes, each repeated over its share of the batch),
        uploaded once per job shape rather than once per step."""
        if not self.config.micro_condition:
            return {"resolution": None, "aspect_ratio": None}
        key = (hw, n, sizes)
        if key not in self._micro:
            default = (hw[0] * 8, hw[1] * 8, hw[0] / hw[1])
            rows = [size or default for size in sizes] or [default]
            per = n // len(rows)
            table = torch.tensor([row for row in rows for _ in range(per)], dtype=self.dtype, device=self.device)
            self._micro[key] = {"resolution": table[:, :2].contiguous(), "aspect_ratio": table[:, 2:].contiguous()}
        return self._micro[key]

    def run_blocks(self, image, text, temb, rope, chunk: int = 0) -> tuple:
        for i in self.chunks[chunk]:
            image = self.model.transformer_blocks[i](image, encoder_hidden_states=text, timestep=temb[0])
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        """eps in float32 (the first 4 of the 8 output channels), re-ordered from (ph, pw, c) to pack's (c, ph, pw)."""
        shift, scale = (self.model.scale_shift_table[None] + temb[1][:, None]).chunk(2, dim=1)
        out = self.model.proj_out(self.model.norm_out(image) * (1 + scale) + shift).float()
        return channels_first(out, self.patch, self.config.out_channels, keep=self.latent_channels)


def _sincos(dim: int, pos: torch.Tensor, dtype) -> torch.Tensor:
    """get_1d_sincos_pos_embed_from_grid_torch: [sin, cos] of pos x omega, all in `dtype`."""
    omega = torch.arange(dim // 2, dtype=dtype)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = torch.einsum("m,d->md", pos.reshape(-1), omega)
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


PIXART = DiTFamily(
    name="pixart", title="PixArt-α / PixArt-Σ", match=match_layout, infer_config=infer_config,
    meta_model=_diffusers_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=PixArtAdapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="original", replace_keys=(), block_inputs=block_inputs)
