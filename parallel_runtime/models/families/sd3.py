"""Stable Diffusion 3 / 3.5 (Medium and Large): the MMDiT.

Joint attention over [text, image] as Flux, but: absolute 2D position embeddings (a stored table,
centre-cropped to the image) instead of RoPE; one conditioning vector c = t_embed(1000 sigma) + y_embed(pooled
CLIP) modulating every block; only joint blocks, the last one "pre-only" for text (its text output is never
used); SD3.5 Medium adds a second, image-only self-attention (`attn2`) to its first blocks. Sampling is
ComfyUI's ModelSamplingDiscreteFlow (shift 3, timestep = 1000 sigma) on the SD3 latent format.

Blocks are diffusers' `SD3Transformer2DModel` blocks with our attention processor; the image embedding,
position crop and output un-patching are done here on token rows, so a rank embeds only the rows it holds.
Where diffusers and ComfyUI order work differently (diffusers joins [image, text], ComfyUI [text, image];
ComfyUI sums the two SD3.5M attentions at once), results differ by round-off only.

ControlNets (InstantX's SD3 ControlNets, ComfyUI's comfy.cldm.mmdit.ControlNet) run beside the blocks: see
sd3_controlnet.py; `run_blocks` adds their residuals to every image row after each block, as ComfyUI's MMDiT does.

Key layouts: ComfyUI/original (`joint_blocks.N.x_block...`, optionally under `model.diffusion_model.`) and
diffusers (`transformer_blocks.N...`, `transformer.` prefix optional).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...sampling import SD3_LATENT, FluxModelSampling
from ...weights.keymap import Source, block_count, linear, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..detection import DIFFUSERS_PREFIXES, Signature, signature_match
from ..family import (JOINT_BLOCK, BlockKind, DiTFamily, FixedHeadSizeConfig, Match, OneBlockListConfig,
                      diffusers_meta_model)
from ..patchify import PatchTokens
from ..shapes import CheckpointShapes
from .flux_adapter import channels_first, patch_conv

HEAD_DIM = 64  # every SD3 release; ComfyUI's MMDiT derives heads = hidden / 64
ALWAYS_OWNED = ("time_text_embed.",)
FIRST_STAGE = ("pos_embed.", "context_embedder.")
LAST_STAGE = ("norm_out.", "proj_out.")
BLOCK_LISTS = ("transformer_blocks",)
DUAL_BLOCK = BlockKind("attn2", ("joint", "image"))  # SD3.5 Medium's first blocks: joint, then image-only attention


@dataclass(frozen=True)
class SD3Config(FixedHeadSizeConfig, OneBlockListConfig):
    hidden_size: int
    num_layers: int
    pos_embed_max_size: int
    context_dim: int = 4096
    pooled_dim: int = 2048
    qk_norm: bool = True  # SD3.5 (SD3 Medium 1.0 has none)
    dual_attention_layers: tuple[int, ...] = ()  # SD3.5 Medium: 0..12
    in_channels: int = 16
    patch_size: int = 2

    family = "sd3"
    variant = "sd3"
    text_encoders = "the SD3 text encoders (TripleCLIPLoader: clip_l, clip_g and t5xxl)"

    head_dim = HEAD_DIM

    def __post_init__(self):
        self.check_width("SD3 hidden size")
        object.__setattr__(self, "dual_attention_layers", tuple(self.dual_attention_layers))

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        """Joint attention in every block, then SD3.5 Medium's image-only attn2 in its dual blocks."""
        return tuple(DUAL_BLOCK if i in self.dual_attention_layers else JOINT_BLOCK for i in range(self.num_layers))

    @property
    def max_latent_size(self) -> int:
        """The largest latent side the stored position table covers (validate.py refuses larger)."""
        return self.pos_embed_max_size * self.patch_size

    @property
    def title(self) -> str:
        if self.dual_attention_layers:
            return "SD3.5 Medium"
        return "SD3.5 Large" if self.qk_norm else "SD3 Medium"

    def diffusers_kwargs(self) -> dict:
        return dict(sample_size=self.pos_embed_max_size, patch_size=self.patch_size, in_channels=self.in_channels,
                    num_layers=self.num_layers, attention_head_dim=HEAD_DIM, num_attention_heads=self.num_heads,
                    joint_attention_dim=self.context_dim, caption_projection_dim=self.hidden_size,
                    pooled_projection_dim=self.pooled_dim, out_channels=self.in_channels,
                    pos_embed_max_size=self.pos_embed_max_size, dual_attention_layers=self.dual_attention_layers,
                    qk_norm="rms_norm" if self.qk_norm else None)


# -- checkpoint layout --------------------------------------------------------------------------------

match_layout = signature_match(
    Signature("original", ("x_embedder.proj.weight",), ("joint_blocks",)),
    Signature("diffusers", ("pos_embed.proj.weight", "context_embedder.weight",
                            "transformer_blocks.0.norm1_context.linear.weight"), ("transformer_blocks",),
              DIFFUSERS_PREFIXES))


_SHAPE_KEYS = {
    "original": dict(blocks="joint_blocks", proj="x_embedder.proj.weight", pos="pos_embed", ctx="context_embedder.weight",
                     pooled="y_embedder.mlp.0.weight", ln_q="joint_blocks.0.x_block.attn.ln_q.weight",
                     attn2=r"joint_blocks\.(\d+)\.x_block\.attn2\.qkv\.weight$"),
    "diffusers": dict(blocks="transformer_blocks", proj="pos_embed.proj.weight", pos="pos_embed.pos_embed",
                      ctx="context_embedder.weight", pooled="time_text_embed.text_embedder.linear_1.weight",
                      ln_q="transformer_blocks.0.attn.norm_q.weight",
                      attn2=r"transformer_blocks\.(\d+)\.attn2\.to_q\.weight$"),
}


def infer_config(reader, match: Match, name: str) -> SD3Config:
    keys, p, k = reader.keys(), match.prefix, _SHAPE_KEYS[match.layout]

    shape = tensor_shapes(reader, p, name, "a complete SD3 DiT")

    hidden, in_ch, patch, _ = shape(k["proj"])
    table = shape(k["pos"])[1]
    side = round(table ** 0.5)
    if side * side != table:
        raise ModelFileError(f"{name}: the position table has {table} entries, not a square grid; re-download it.")
    dual = re.compile(re.escape(p) + k["attn2"])
    return SD3Config(hidden_size=hidden, num_layers=block_count(keys, p, k["blocks"], name), pos_embed_max_size=side,
                     context_dim=shape(k["ctx"])[1], pooled_dim=shape(k["pooled"])[1], qk_norm=p + k["ln_q"] in reader,
                     dual_attention_layers=tuple(sorted(int(m.group(1)) for key in keys if (m := dual.match(key)))),
                     in_channels=in_ch, patch_size=patch)


_diffusers_model = diffusers_meta_model("SD3Transformer2DModel")


def _map_attention(out: dict, dst: str, src: str, H: int, qk_norm: bool, q="to_q", k="to_k", v="to_v",
                   norm_q="norm_q", norm_k="norm_k") -> None:
    for name, rows in ((q, slice(0, H)), (k, slice(H, 2 * H)), (v, slice(2 * H, 3 * H))):
        linear(out, f"{dst}.{name}", f"{src}.qkv", rows)
    if qk_norm:
        out[f"{dst}.{norm_q}.weight"] = Source(f"{src}.ln_q.weight")
        out[f"{dst}.{norm_k}.weight"] = Source(f"{src}.ln_k.weight")


def source_map(config: SD3Config, layout: str, prefix: str = "", controlnet: bool = False) -> dict[str, Source]:
    """`controlnet`: the blocks of an SD3 ControlNet (diffusers' SD3ControlNetModel: no pre-only last block, no
    head; its own layers are mapped by sd3_controlnet)."""
    if layout == "diffusers":
        return same_names(_diffusers_model(config).state_dict(), prefix)
    p, H = prefix, config.hidden_size
    out: dict[str, Source] = {}
    linear(out, "pos_embed.proj", p + "x_embedder.proj")
    out["pos_embed.pos_embed"] = Source(p + "pos_embed")
    linear(out, "time_text_embed.timestep_embedder.linear_1", p + "t_embedder.mlp.0")
    linear(out, "time_text_embed.timestep_embedder.linear_2", p + "t_embedder.mlp.2")
    linear(out, "time_text_embed.text_embedder.linear_1", p + "y_embedder.mlp.0")
    linear(out, "time_text_embed.text_embedder.linear_2", p + "y_embedder.mlp.2")
    linear(out, "context_embedder", p + "context_embedder")
    for i in range(config.num_layers):
        d, x, c = f"transformer_blocks.{i}", f"{p}joint_blocks.{i}.x_block", f"{p}joint_blocks.{i}.context_block"
        pre_only = i == config.num_layers - 1 and not controlnet
        linear(out, f"{d}.norm1.linear", f"{x}.adaLN_modulation.1")
        _map_attention(out, f"{d}.attn", f"{x}.attn", H, config.qk_norm)
        linear(out, f"{d}.attn.to_out.0", f"{x}.attn.proj")
        linear(out, f"{d}.ff.net.0.proj", f"{x}.mlp.fc1")
        linear(out, f"{d}.ff.net.2", f"{x}.mlp.fc2")
        # The pre-only text block keeps (shift, scale); diffusers' AdaLayerNormContinuous reads (scale, shift).
        linear(out, f"{d}.norm1_context.linear", f"{c}.adaLN_modulation.1", transform="swap_halves" if pre_only else None)
        _map_attention(out, f"{d}.attn", f"{c}.attn", H, config.qk_norm, "add_q_proj", "add_k_proj", "add_v_proj",
                       "norm_added_q", "norm_added_k")
        if not pre_only:
            linear(out, f"{d}.attn.to_add_out", f"{c}.attn.proj")
            linear(out, f"{d}.ff_context.net.0.proj", f"{c}.mlp.fc1")
            linear(out, f"{d}.ff_context.net.2", f"{c}.mlp.fc2")
        if i in config.dual_attention_layers:
            _map_attention(out, f"{d}.attn2", f"{x}.attn2", H, config.qk_norm)
            linear(out, f"{d}.attn2.to_out.0", f"{x}.attn2.proj")
    if not controlnet:
        linear(out, "norm_out.linear", p + "final_layer.adaLN_modulation.1", transform="swap_halves")
        linear(out, "proj_out", p + "final_layer.linear")
    return out


def checkpoint_shapes(config: SD3Config, controlnet: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """{original key: (shape, kind)} of an SD3 file, for writing random test checkpoints; `controlnet`: the shared
    part of an SD3 ControlNet's (every block with a whole text stream, no final layer)."""
    H, P, C = config.hidden_size, config.patch_size, config.in_channels
    out = CheckpointShapes()
    lin = out.linear
    out.conv("x_embedder.proj", H, C, P, P)
    out.table("pos_embed", 1, config.pos_embed_max_size ** 2, H)
    lin("t_embedder.mlp.0", H, 256)
    lin("t_embedder.mlp.2", H, H)
    lin("y_embedder.mlp.0", H, config.pooled_dim)
    lin("y_embedder.mlp.2", H, H)
    lin("context_embedder", H, config.context_dim)

    def attention(name):
        lin(f"{name}.qkv", 3 * H, H)
        if config.qk_norm:
            out.norm(f"{name}.ln_q", HEAD_DIM)
            out.norm(f"{name}.ln_k", HEAD_DIM)

    for i in range(config.num_layers):
        pre_only = i == config.num_layers - 1 and not controlnet
        dual = i in config.dual_attention_layers
        for stream in ("x_block", "context_block"):
            b = f"joint_blocks.{i}.{stream}"
            text_pre_only = stream == "context_block" and pre_only
            chunks = 2 if text_pre_only else (9 if stream == "x_block" and dual else 6)
            lin(f"{b}.adaLN_modulation.1", chunks * H, H, "mod")
            attention(f"{b}.attn")
            if not text_pre_only:
                lin(f"{b}.attn.proj", H, H)
                lin(f"{b}.mlp.fc1", 4 * H, H)
                lin(f"{b}.mlp.fc2", H, 4 * H)
            if stream == "x_block" and dual:
                attention(f"{b}.attn2")
                lin(f"{b}.attn2.proj", H, H)
    if not controlnet:
        lin("final_layer.linear", P * P * C, H)
        lin("final_layer.adaLN_modulation.1", 2 * H, H, "mod")
    return out


# -- the strategies' view -----------------------------------------------------------------------------

class ParallelJointAttnProcessor:
    """diffusers' JointAttnProcessor2_0 with the attention itself handed to the job's strategy: the joint
    [text, image] attention to `context.attention`, SD3.5 Medium's image-only `attn2` to
    `context.image_attention`."""

    def __init__(self, layer: int, context, image_only: bool = False):
        self.layer, self.context, self.image_only = layer, context, image_only

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))

        def qkv(x, to_q, to_k, to_v, norm_q, norm_k):
            q, k, v = heads(to_q(x)), heads(to_k(x)), heads(to_v(x))
            return (norm_q(q) if norm_q is not None else q), (norm_k(k) if norm_k is not None else k), v

        q, k, v = qkv(hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
        text_len = 0
        if encoder_hidden_states is not None:  # text rows first: the canonical [text, image] sequence
            text_len = encoder_hidden_states.shape[1]
            tq, tk, tv = qkv(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                             attn.norm_added_q, attn.norm_added_k)
            q, k, v = torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1)
        attend = self.context.image_attention if self.image_only else self.context.attention
        out = attend(q, k, v, self.layer).flatten(2, 3).to(q.dtype)
        image = attn.to_out[1](attn.to_out[0](out[:, text_len:].contiguous()))
        if encoder_hidden_states is None:
            return image
        text = None if attn.context_pre_only else attn.to_add_out(out[:, :text_len].contiguous())
        return image, text


def block_inputs(config: SD3Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, text, temb, no RoPE) of one block call (what `DiTFamily.probe_block` runs)."""
    h = config.hidden_size
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator),
            torch.randn(1, h, generator=generator), None)


class SD3Adapter(PatchTokens, BlockLoop):
    latent_channels = 16
    patch = 2  # (c, ph, pw) per token: the order of the patch conv's weights
    latent_format = SD3_LATENT
    default_guidance = 0.0  # SD3 has no guidance input

    def __init__(self, config: SD3Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks = config, model, chunks
        for i in (i for chunk in chunks for i in chunk):
            block = model.transformer_blocks[i]
            block.attn.set_processor(ParallelJointAttnProcessor(i, context))
            if block.attn2 is not None:
                block.attn2.set_processor(ParallelJointAttnProcessor(i, context, image_only=True))
        self.dtype, self.device = compute_placement(model.time_text_embed)
        self._positions: dict = {}

    @functools.cached_property
    def model_sampling(self):
        """supported_models.SD3: ModelSamplingDiscreteFlow, shift 3.0, multiplier 1000."""
        return FluxModelSampling(3.0, 1000.0, kind="discrete_flow")

    def rope(self, text_len: int, h: int, w: int, references=(), method=None):
        return None  # absolute positions, added in embed_image

    def _position_table(self, grid: tuple[int, int]) -> torch.Tensor:
        """MMDiT.cropped_pos_embed: the centre crop of the stored table, row-major over the patch grid."""
        rows, cols = grid
        if grid not in self._positions:
            side = self.config.pos_embed_max_size
            if rows > side or cols > side:  # validate.py refuses these before any work; this is the backstop
                raise ValueError(f"a {rows}x{cols} patch grid exceeds this SD3 model's {side}x{side} position table")
            top, left = (side - rows) // 2, (side - cols) // 2
            table = self.model.pos_embed.pos_embed.reshape(side, side, -1)[top:top + rows, left:left + cols]
            self._positions[grid] = table.reshape(rows * cols, -1).to(self.dtype)
        return self._positions[grid]

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """The patch conv as a matmul on packed tokens, plus the position rows of `index` in the h x w latent."""
        image = patch_conv(tokens.to(self.device, self.dtype), self.model.pos_embed.proj)
        return image + self._position_table((hw[0] // self.patch, hw[1] // self.patch))[index]

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.context_embedder(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """c = t_embedder(t) + y_embedder(pooled), t = 1000 sigma (ModelSamplingSD3's units) in float32 as
        model_base passes it."""
        t = t.to(self.device, torch.float32)
        return self.model.time_text_embed(t, pooled.to(self.device, self.dtype))

    def block(self, i: int, image, text, temb, rope) -> tuple:
        """A joint block (positions are added in embed_image: no RoPE)."""
        text, image = self.model.transformer_blocks[i](hidden_states=image, encoder_hidden_states=text, temb=temb)
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        """Velocity in float32, re-ordered from the model's (ph, pw, c) patch layout to pack's (c, ph, pw)."""
        return channels_first(self.model.proj_out(self.model.norm_out(image, temb)).float(), self.patch,
                              self.latent_channels)


SD3 = DiTFamily(
    name="sd3", title="SD3 / SD3.5 (Medium, Large)", match=match_layout, infer_config=infer_config,
    meta_model=_diffusers_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=SD3Adapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="original", block_inputs=block_inputs)
