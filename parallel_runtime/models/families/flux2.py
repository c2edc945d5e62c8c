"""FLUX.2 (Black Forest Labs): dev (32B, guidance-distilled, Mistral Small 3 text features) and klein 4B / 9B
(step-distilled, cfg 1, Qwen3 text features; no guidance input).

The blocks are Flux.1's (double-stream, then single-stream, joint attention over [prompt, image]) with four
changes: one modulation per block kind shared by every block (the image stream's and the prompt's of the double
blocks, and the single blocks'), computed once per step from the timestep (and guidance) embedding; no biases
and no pooled text vector; SwiGLU MLPs (the single block's fused input projection carries both halves); and a
4-axis RoPE (theta 2000) whose ids are [index, row, column, prompt position]. The latent has 128 channels at
1/16 scale (the VAE's 32 channels in 2x2 patches), so the DiT's patch is 1: a token is a latent pixel.
Reference images (multi-reference editing) join the image stream as extra tokens, placed as Kontext's are by
`flux_adapter.reference_placements`, with FLUX.2's defaults: method "index", index 10, 20, ...

Blocks are diffusers' `Flux2Transformer2DModel` blocks with our attention processors; ComfyUI's keys (BFL's
names) map onto them (fused qkv rows split, the final modulation's halves swapped). Where this follows ComfyUI
rather than diffusers' pipeline: a prompt shorter than 512 tokens is padded at the front with zeros
(model_base.Flux2.extra_conds), sampling is ModelSamplingFlux with shift 2.02 (supported_models.Flux2), the
default guidance is 3.5 (model_base.Flux.extra_conds), and the timestep sinusoid is cast to the compute dtype
before its MLP. ComfyUI's "index_timestep_zero" reference method is refused (spec.REFERENCE_METHODS).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...sampling import FLUX2_LATENT
from ...sampling.flow import FluxModelSampling
from ...strategies.attention.processor import ParallelFluxAttnProcessor
from ...weights.keymap import Source, block_count, has_block, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..family import DiTFamily, Match, TwoBlockListConfig, diffusers_meta_model
from ..patchify import PatchTokens
from ..rope import grid_ids
from ..shapes import CheckpointShapes
from .flux import BFL_PREFIXES, DIFFUSERS_PREFIXES, DOUBLE_BLOCK, SINGLE_BLOCK, TIME_FEATURES
from .flux_adapter import reference_placements

# Every stage modulates its blocks: the time embedding and the three shared modulations live on each.
ALWAYS_OWNED = ("time_guidance_embed.", "double_stream_modulation_img.", "double_stream_modulation_txt.",
                "single_stream_modulation.")
FIRST_STAGE = ("x_embedder.", "context_embedder.")
LAST_STAGE = ("norm_out.", "proj_out.")
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
ROPE_THETA = 2000
PROMPT_TOKENS = 512  # model_base.Flux2.extra_conds pads shorter prompts at the front to this length
REFERENCE_INDEX_STEP = 10  # model_detection: ref_index_scale 10 (the "index" method's step)
# Text features per released width (txt_in's input: three hidden layers of the text encoder, stacked).
_TEXT_ENCODERS = {15360: "Mistral Small 3.1 24B", 7680: "Qwen3 4B", 12288: "Qwen3 8B"}
_KLEIN_SIZES = {3072: "4B", 4096: "9B"}


@dataclass(frozen=True)
class Flux2Config(TwoBlockListConfig):
    first_kind, second_kind = DOUBLE_BLOCK, SINGLE_BLOCK  # the pipeline's one list: these, then single blocks
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    mlp_hidden: int  # SwiGLU width (3 x hidden in the releases)
    context_dim: int = 15360
    in_channels: int = 128
    guidance_embeds: bool = True

    family = "flux2"
    pooled_dim = 0  # no pooled text vector
    reads_references = True  # ReferenceLatent images join the image stream
    patch_size = 1  # a token is one pixel of the 128-channel latent
    latent_downscale = 16  # the latent is 1/16 of the image

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.hidden_size or self.head_dim % 8:
            raise ModelFileError(f"FLUX.2 config is inconsistent: {self.num_heads} heads x {self.head_dim} != "
                                 f"hidden size {self.hidden_size} (or a head not in four even RoPE axes); the file "
                                 f"is damaged, so re-download it.")

    @property
    def variant(self) -> str:
        return "dev" if self.guidance_embeds else "klein"

    @property
    def title(self) -> str:
        if self.guidance_embeds:
            return "FLUX.2 dev"
        size = _KLEIN_SIZES.get(self.hidden_size)
        return f"FLUX.2 klein {size}" if size else "FLUX.2 klein"

    @property
    def text_encoders(self) -> str:
        name = _TEXT_ENCODERS.get(self.context_dim, f"the {self.context_dim}-wide FLUX.2 text encoder")
        return f"{name} (CLIPLoader type flux2)"

    @property
    def axes_dims_rope(self) -> tuple[int, int, int, int]:
        """Four equal axes: (32, 32, 32, 32) for the released 128-wide heads."""
        return (self.head_dim // 4,) * 4

    @property
    def latent_channels(self) -> int:
        return self.in_channels



    def diffusers_kwargs(self) -> dict:
        return dict(patch_size=1, in_channels=self.in_channels, num_layers=self.num_layers,
                    num_single_layers=self.num_single_layers, attention_head_dim=self.head_dim,
                    num_attention_heads=self.num_heads, joint_attention_dim=self.context_dim,
                    timestep_guidance_channels=TIME_FEATURES, mlp_ratio=self.mlp_hidden / self.hidden_size,
                    axes_dims_rope=self.axes_dims_rope, rope_theta=ROPE_THETA, guidance_embeds=self.guidance_embeds)


# -- checkpoint layout --------------------------------------------------------------------------------

# The tensors whose shapes give a config away, per layout.
_CONFIG_KEYS = {
    "bfl": dict(double="double_blocks", single="single_blocks", img_in="img_in.weight", txt_in="txt_in.weight",
                final="final_layer.linear.weight", guidance="guidance_in.in_layer.weight",
                double_norm="double_blocks.0.img_attn.norm.query_norm.scale", double_mlp="double_blocks.0.img_mlp.0.weight",
                single_norm="single_blocks.0.norm.query_norm.scale", single_in="single_blocks.0.linear1.weight"),
    "diffusers": dict(double="transformer_blocks", single="single_transformer_blocks", img_in="x_embedder.weight",
                      txt_in="context_embedder.weight", final="proj_out.weight",
                      guidance="time_guidance_embed.guidance_embedder.linear_1.weight",
                      double_norm="transformer_blocks.0.attn.norm_q.weight",
                      double_mlp="transformer_blocks.0.ff.linear_in.weight",
                      single_norm="single_transformer_blocks.0.attn.norm_q.weight",
                      single_in="single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"),
}
_MODULATION = {"bfl": "double_stream_modulation_img.lin.weight",
               "diffusers": "double_stream_modulation_img.linear.weight"}


def match_layout(keys: list[str]) -> Match | None:
    """The shared double-block modulation (what ComfyUI's detection keys FLUX.2 on) beside the image input and a
    block list, in BFL's (ComfyUI's) names or diffusers'."""
    key_set = set(keys)
    for layout, prefixes in (("bfl", BFL_PREFIXES), ("diffusers", DIFFUSERS_PREFIXES)):
        k = _CONFIG_KEYS[layout]
        for prefix in prefixes:
            if ({prefix + _MODULATION[layout], prefix + k["img_in"]} <= key_set
                    and (has_block(keys, prefix, k["double"]) or has_block(keys, prefix, k["single"]))):
                return Match(layout, prefix)
    return None


def infer_config(reader, match: Match, name: str) -> Flux2Config:
    """The config from shapes alone: width and input channels from the image input, head size from a q norm, the
    SwiGLU width from an MLP input (two halves), guidance from its embedder, dev or klein from that."""
    p, k = match.prefix, _CONFIG_KEYS[match.layout]
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete FLUX.2 DiT")
    _refuse_look_alikes(reader, match, name)
    keys = reader.keys()
    double, single = block_count(keys, p, k["double"], name), block_count(keys, p, k["single"], name)
    hidden, in_channels = shape(k["img_in"])
    out_channels = shape(k["final"])[0]
    if in_channels != out_channels:
        raise ModelFileError(f"{name} reads {in_channels} latent channels but predicts {out_channels}: a FLUX.2 "
                             f"variant with extra input channels, which ParaDiT does not run; choose FLUX.2 dev or "
                             f"klein.")
    if double:
        head_dim, mlp_hidden = shape(k["double_norm"])[0], shape(k["double_mlp"])[0] // 2
    else:
        head_dim, mlp_hidden = shape(k["single_norm"])[0], (shape(k["single_in"])[0] - 3 * hidden) // 2
    if head_dim <= 0 or hidden % head_dim:
        raise ModelFileError(f"{name}: width {hidden} is not a multiple of the head size {head_dim}; the file is "
                             f"damaged, so re-download it.")
    return Flux2Config(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim, num_layers=double,
                       num_single_layers=single, mlp_hidden=mlp_hidden, context_dim=shape(k["txt_in"])[1],
                       in_channels=in_channels, guidance_embeds=p + k["guidance"] in reader)


def _refuse_look_alikes(reader, match: Match, name: str) -> None:
    """Files with FLUX.2's shared modulation but layers FLUX.2 lacks: biases or a pooled text input."""
    p = match.prefix
    extra = [key for key in ("img_in.bias", "vector_in.in_layer.weight", "x_embedder.bias",
                             "time_guidance_embed.text_embedder.linear_1.weight", "txt_norm.weight")
             if p + key in reader]
    if extra:
        raise ModelFileError(f"{name} has FLUX.2's shared modulation but also {extra[0]!r}, which FLUX.2 dev and "
                             f"klein do not have: it is another model built on FLUX.2's blocks, which ParaDiT does "
                             f"not run; choose a FLUX.2 dev or klein file.")


def _weight(out: dict, dst: str, src: str, rows: slice | None = None, transform: str | None = None) -> None:
    """One bias-free Linear."""
    out[f"{dst}.weight"] = Source(f"{src}.weight", rows, transform)


def _map_double_block(out: dict, d: str, b: str, hidden: int) -> None:
    for dst, src in (("", "img"), ("add_", "txt")):
        for j, name in enumerate(("q", "k", "v")):
            proj = f"to_{name}" if not dst else f"add_{name}_proj"
            _weight(out, f"{d}.attn.{proj}", f"{b}.{src}_attn.qkv", slice(j * hidden, (j + 1) * hidden))
    out[f"{d}.attn.norm_q.weight"] = Source(f"{b}.img_attn.norm.query_norm.scale")
    out[f"{d}.attn.norm_k.weight"] = Source(f"{b}.img_attn.norm.key_norm.scale")
    out[f"{d}.attn.norm_added_q.weight"] = Source(f"{b}.txt_attn.norm.query_norm.scale")
    out[f"{d}.attn.norm_added_k.weight"] = Source(f"{b}.txt_attn.norm.key_norm.scale")
    _weight(out, f"{d}.attn.to_out.0", f"{b}.img_attn.proj")
    _weight(out, f"{d}.attn.to_add_out", f"{b}.txt_attn.proj")
    for ff, stream in (("ff", "img"), ("ff_context", "txt")):
        _weight(out, f"{d}.{ff}.linear_in", f"{b}.{stream}_mlp.0")
        _weight(out, f"{d}.{ff}.linear_out", f"{b}.{stream}_mlp.2")


def source_map(config: Flux2Config, layout: str, prefix: str = "") -> dict[str, Source]:
    """Every diffusers parameter -> its Source in a file of `layout` ("bfl": ComfyUI's names; "diffusers")."""
    if layout == "diffusers":
        return same_names((n for n, _ in _meta_model(config).named_parameters()), prefix)
    p, out = prefix, {}
    _weight(out, "x_embedder", p + "img_in")
    _weight(out, "context_embedder", p + "txt_in")
    embedders = [("timestep_embedder", "time_in")] + [("guidance_embedder", "guidance_in")] * config.guidance_embeds
    for dst, src in embedders:
        _weight(out, f"time_guidance_embed.{dst}.linear_1", f"{p}{src}.in_layer")
        _weight(out, f"time_guidance_embed.{dst}.linear_2", f"{p}{src}.out_layer")
    for modulation in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        _weight(out, f"{modulation}.linear", f"{p}{modulation}.lin")
    for i in range(config.num_layers):
        _map_double_block(out, f"transformer_blocks.{i}", f"{p}double_blocks.{i}", config.hidden_size)
    for i in range(config.num_single_layers):
        s, b = f"single_transformer_blocks.{i}", f"{p}single_blocks.{i}"
        _weight(out, f"{s}.attn.to_qkv_mlp_proj", f"{b}.linear1")  # [q, k, v, gate, up] rows, as diffusers fuses
        _weight(out, f"{s}.attn.to_out", f"{b}.linear2")
        out[f"{s}.attn.norm_q.weight"] = Source(f"{b}.norm.query_norm.scale")
        out[f"{s}.attn.norm_k.weight"] = Source(f"{b}.norm.key_norm.scale")
    _weight(out, "norm_out.linear", p + "final_layer.adaLN_modulation.1", transform="swap_halves")
    _weight(out, "proj_out", p + "final_layer.linear")
    return out


def checkpoint_shapes(config: Flux2Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a FLUX.2 file, for writing random test checkpoints."""
    H, M, D = config.hidden_size, config.mlp_hidden, config.head_dim
    out = CheckpointShapes()

    def weight(name, n_out, n_in, kind="weight"):
        out.linear(name, n_out, n_in, kind, bias=False)  # FLUX.2's layers have no biases

    weight("img_in", H, config.in_channels)
    weight("txt_in", H, config.context_dim)
    for embedder in ("time_in", "guidance_in")[:1 + config.guidance_embeds]:
        weight(f"{embedder}.in_layer", H, TIME_FEATURES)
        weight(f"{embedder}.out_layer", H, H)
    weight("double_stream_modulation_img.lin", 6 * H, H, "mod")
    weight("double_stream_modulation_txt.lin", 6 * H, H, "mod")
    weight("single_stream_modulation.lin", 3 * H, H, "mod")
    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            weight(f"{b}_attn.qkv", 3 * H, H)
            out.norm(f"{b}_attn.norm.query_norm", D, "scale")
            out.norm(f"{b}_attn.norm.key_norm", D, "scale")
            weight(f"{b}_attn.proj", H, H)
            weight(f"{b}_mlp.0", 2 * M, H)
            weight(f"{b}_mlp.2", H, M)
    for i in range(config.num_single_layers):
        b = f"single_blocks.{i}"
        weight(f"{b}.linear1", 3 * H + 2 * M, H)
        weight(f"{b}.linear2", H, H + M)
        out.norm(f"{b}.norm.query_norm", D, "scale")
        out.norm(f"{b}.norm.key_norm", D, "scale")
    weight("final_layer.adaLN_modulation.1", 2 * H, H, "mod")
    weight("final_layer.linear", config.in_channels, H)
    return out


_meta_model = diffusers_meta_model("Flux2Transformer2DModel")


# -- the strategies' view -----------------------------------------------------------------------------

class ParallelFlux2SingleProcessor:
    """Flux2ParallelSelfAttnProcessor's math (one fused projection into q, k, v and the SwiGLU halves; one
    fused output projection) with the attention handed to the job's strategy, as ParallelFluxAttnProcessor does
    for the double blocks."""

    def __init__(self, layer: int, context):
        self.layer, self.context = layer, context

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        qkv, mlp = attn.to_qkv_mlp_proj(hidden_states).split(
            [3 * attn.inner_dim, 2 * attn.mlp_hidden_dim], dim=-1)
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in qkv.chunk(3, dim=-1))
        query = apply_rotary_emb(attn.norm_q(query), image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(attn.norm_k(key), image_rotary_emb, sequence_dim=1)
        out = self.context.attention(query, key, value, self.layer, masked=False).flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def sequence_ids(text_len: int, grids: list[tuple]) -> torch.Tensor:
    """FLUX.2's 4-axis RoPE ids: prompt token i at (0, 0, 0, i); each (rows, cols, index, row0, col0) grid's
    tokens at (index, row0 + r, col0 + c, 0)."""
    text = torch.zeros(text_len, 4)
    text[:, 3] = torch.arange(text_len)
    parts = [text] + [torch.cat([grid_ids(*grid), torch.zeros(grid[0] * grid[1], 1)], dim=1) for grid in grids]
    return torch.cat(parts)


def block_inputs(config: Flux2Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, text, (temb, modulations), RoPE of a near-square grid after the prompt) of a block call."""
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    h, cols = config.hidden_size, max(1, math.isqrt(image))
    ids = sequence_ids(text, [(-(-image // cols), cols, 0, 0, 0)])[:text + image]
    rope = Flux2PosEmbed(ROPE_THETA, list(config.axes_dims_rope))(ids)
    temb = tuple(torch.randn(1, n * h, generator=generator) * 0.3 for n in (1, 6, 6, 3))
    return torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator), temb, rope


class Flux2Adapter(PatchTokens, BlockLoop):
    patch = 1  # [B, C, H, W] -> [B, H W, C]: one token per latent pixel, row-major
    latent_format = FLUX2_LATENT
    default_guidance = 3.5  # model_base.Flux.extra_conds: guidance when no FluxGuidance node set one (klein ignores it)
    prompt_tokens = PROMPT_TOKENS  # shorter prompts are padded at the front with zeros (model_base.Flux2)

    def __init__(self, config: Flux2Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.latent_channels = config.latent_channels
        self._blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
        for i in (i for chunk in chunks for i in chunk):
            attn = self._blocks[i].attn
            attn.set_processor(ParallelFluxAttnProcessor(i, context, masked=False) if i < config.num_layers
                               else ParallelFlux2SingleProcessor(i, context))
        self.dtype, self.device = compute_placement(model.time_guidance_embed)

    @property
    def variant(self) -> str:
        return self.config.variant

    @functools.cached_property
    def model_sampling(self):
        return FluxModelSampling(2.02, 1.0, kind="flux")  # supported_models.Flux2: ModelSamplingFlux, shift 2.02

    def rope(self, text_len: int, h: int, w: int, references: tuple[tuple[int, int], ...] = (),
             method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for [prompt, image, references]: the prompt along axis 3, the image's grid at index 0, each
        reference where ComfyUI's Flux places it for FLUX.2 (method "index" by default, index 10, 20, ...)."""
        placed = reference_placements((h, w), references, method or "index", patch=1,
                                      index_step=REFERENCE_INDEX_STEP)
        ids = sequence_ids(text_len, [(h, w, 0, 0, 0), *placed])
        return self.model.pos_embed(ids.to(self.device))

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        return self.model.x_embedder(tokens.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.context_embedder(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled, guidance: torch.Tensor | None, hw=None) -> tuple:
        """(temb, double blocks' image and prompt modulations, single blocks' modulation): the shared modulations
        once per step. t (= sigma) x 1000 stays float32 as ComfyUI passes it; guidance is cast to the compute
        dtype before its x1000, as ComfyUI casts extra conds; each sinusoid meets its MLP in the compute dtype."""
        embed = self.model.time_guidance_embed
        t = t.to(self.device, torch.float32) * 1000
        temb = embed.timestep_embedder(embed.time_proj(t).to(self.dtype))
        if embed.guidance_embedder is not None:
            g = guidance.to(self.device, self.dtype) * 1000
            temb = temb + embed.guidance_embedder(embed.time_proj(g).to(self.dtype))
        return (temb, self.model.double_stream_modulation_img(temb), self.model.double_stream_modulation_txt(temb),
                self.model.single_stream_modulation(temb))

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb: tuple, rope, chunk: int = 0) -> tuple:
        _, mod_img, mod_txt, mod_single = temb
        for i in self.active_blocks(chunk):
            block = self._blocks[i]
            if i < self.config.num_layers:
                text, image = block(hidden_states=image, encoder_hidden_states=text, temb_mod_img=mod_img,
                                    temb_mod_txt=mod_txt, image_rotary_emb=rope)
            else:
                text, image = block(hidden_states=image, encoder_hidden_states=text, temb_mod=mod_single,
                                    image_rotary_emb=rope, split_hidden_states=True)
        return image, text

    def head(self, image: torch.Tensor, temb: tuple, rope=None) -> torch.Tensor:
        """Velocity in float32, one latent pixel's channels per token."""
        return self.model.proj_out(self.model.norm_out(image, temb[0])).float()


FLUX2 = DiTFamily(
    name="flux2", title="FLUX.2 (dev, klein)", match=match_layout, infer_config=infer_config, meta_model=_meta_model,
    source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=Flux2Adapter, block_lists=BLOCK_LISTS,
    always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE, comfy_layout="bfl",
    block_inputs=block_inputs)
