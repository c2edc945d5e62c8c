"""Lumina Image 2.0: NextDiT, a single-stream DiT over [prompt, image] (ComfyUI's comfy/ldm/lumina/model.py).

Before the main layers, NextDiT refines each stream alone: two unmodulated `context_refiner` blocks over the
prompt and two timestep-modulated `noise_refiner` blocks over the image, each with its own rows of the joint
RoPE table. The noise refiner blocks lead the pipeline's block list and attend image over image through the
context's `image_attention`, so Ulysses, Ring and PipeFusion split them as they split the image (image tokens all
share RoPE axis 0, the prompt length, a rotation that cancels in image-only attention, so the joint table's image
rows serve as they are). The context refiner reads no timestep: it runs in embed_text, once per job, on the whole
prompt with local attention wherever the prompt is embedded, and each rank takes its prompt rows of the result
(`embeds_whole_prompt`). The main `layers` attend jointly.

The module tree keeps ComfyUI's parameter names, so ComfyUI-layout files map one to one and LoRA keys land
without translation. Sampling is ModelSamplingDiscreteFlow (shift 6, multiplier 1) on Flux's latent format
(supported_models.Lumina2); ComfyUI's NextDiT reads t = 1 - sigma and returns the negated head output.
Z-Image files (NextDiT with learned pad tokens and another modulation, `z_image_keys`) are z_image.py's, which
reuses this module's adapter through its small hooks (`_qkv`, `_out`, `_x_embedder`, `_final_layer`,
`_embed_prompt`, `_sequence_ids`).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelFileError
from ...sampling import FLUX_LATENT
from ...sampling.flow import FluxModelSampling
from ...strategies.attention import LocalAttention
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..conditioning import timestep_sinusoid
from ..detection import Signature, match_signatures
from ..family import JOINT_BLOCK, BlockKind, DiTFamily, JointAttentionConfig, Match
from ..patchify import PatchTokens
from ..rope import rope_table
from ..shapes import shapes_of_model
from .flux_adapter import channels_first

ALWAYS_OWNED = ("t_embedder.",)
FIRST_STAGE = ("x_embedder.", "cap_embedder.", "context_refiner.")
LAST_STAGE = ("final_layer.", "norm_final.")  # norm_final: unused by ComfyUI's forward, kept for the key map
BLOCK_LISTS = ("noise_refiner", "layers")
NOISE_REFINER = BlockKind("noise_refiner", ("image",))
NORM_EPS = 1e-5  # NextDiT's default; ComfyUI's detection does not change it
_Z_IMAGE_MODULATION = re.compile(r"(noise_refiner|layers)\.\d+\.adaLN_modulation\.0\.weight$")


def z_image_keys(keys: list[str], prefix: str) -> bool:
    """Whether a NextDiT file is Z-Image's: its learned pad tokens, or its modulation (one Linear without SiLU,
    so `adaLN_modulation.0`) where Lumina 2 has `adaLN_modulation.1` (ComfyUI's z_image_modulation)."""
    key_set = set(keys)
    if prefix + "cap_pad_token" in key_set or prefix + "x_pad_token" in key_set:
        return True
    return any(_Z_IMAGE_MODULATION.match(k[len(prefix):]) for k in keys if k.startswith(prefix))


@dataclass(frozen=True)
class Lumina2Config(JointAttentionConfig):
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    num_refiner_layers: int
    ffn_dim: int
    cap_feat_dim: int
    in_channels: int = 16

    family = "lumina2"
    title = "Lumina Image 2.0"
    variant = "lumina2"
    pooled_dim = 0
    text_encoders = "Gemma 2 2B (CLIPLoader type lumina2)"
    num_single_layers = 0
    rope_theta = 10000.0
    time_scale = 1.0  # NextDiT's t_embedder reads (1 - sigma) x time_scale
    sampling_shift = 6.0  # ModelSamplingDiscreteFlow's shift (supported_models)

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads or self.head_dim % 6:
            raise ModelFileError(f"Lumina 2 config is inconsistent ({self.hidden_size} wide, {self.num_heads} heads, "
                                 f"{self.num_kv_heads} key/value heads); the file is damaged, so re-download it.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """ComfyUI's axes_dims: thirds of the head, (32, 32, 32) for the released 96-wide heads."""
        return (self.head_dim // 3,) * 3

    @property
    def adaln_dim(self) -> int:
        return min(self.hidden_size, 1024)

    @property
    def num_blocks(self) -> int:
        return self.num_refiner_layers + self.num_layers

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_dim

    @property
    def context_dim(self) -> int:
        return self.cap_feat_dim

    @property
    def latent_channels(self) -> int:
        return self.in_channels

    @property
    def latent_format(self):
        return FLUX_LATENT

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        """The noise refiner (image over image), then the joint layers."""
        return (NOISE_REFINER,) * self.num_refiner_layers + (JOINT_BLOCK,) * self.num_layers


# -- checkpoint layout --------------------------------------------------------------------------------

def match_layout(keys: list[str]) -> Match | None:
    """`cap_embedder.1.weight` (what ComfyUI's detection keys Lumina 2 on) beside NextDiT's block lists, in a file
    without Z-Image's keys."""
    return match_signatures(keys, Signature("comfy", ("cap_embedder.1.weight",), ("layers", "noise_refiner"),
                                            also=lambda keys, prefix: not z_image_keys(keys, prefix)))


def infer_config(reader, match: Match, name: str) -> Lumina2Config:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete Lumina 2 DiT")
    dim, patch_in = shape("x_embedder.weight")
    head_dim = shape("layers.0.attention.q_norm.weight")[0]
    if patch_in % 4 or dim % head_dim:
        raise ModelFileError(f"{name}: a {patch_in}-wide patch input or {head_dim}-wide heads in a {dim}-wide model "
                             f"are no Lumina 2 shape; the file is damaged, so re-download it.")
    heads = dim // head_dim
    kv_heads = (shape("layers.0.attention.qkv.weight")[0] // head_dim - heads) // 2
    keys = reader.keys()
    return Lumina2Config(hidden_size=dim, num_heads=heads, num_kv_heads=kv_heads,
                         num_layers=block_count(keys, p, "layers", name),
                         num_refiner_layers=block_count(keys, p, "noise_refiner", name),
                         ffn_dim=shape("layers.0.feed_forward.w1.weight")[0],
                         cap_feat_dim=shape("cap_embedder.1.weight")[1], in_channels=patch_in // 4)


class _Attention(nn.Module):
    def __init__(self, c: Lumina2Config):
        super().__init__()
        self.heads, self.kv_heads = c.num_heads, c.num_kv_heads  # a tensor-parallel rank's share: each / N
        self.qkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.out = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(c.head_dim), nn.RMSNorm(c.head_dim)  # eps None, as ComfyUI's


class _FeedForward(nn.Module):
    def __init__(self, c: Lumina2Config):
        super().__init__()
        self.w1 = nn.Linear(c.hidden_size, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.hidden_size, bias=False)
        self.w3 = nn.Linear(c.hidden_size, c.ffn_dim, bias=False)


class _Block(nn.Module):
    """JointTransformerBlock's parameters; `modulation=False` for the context refiner."""

    def __init__(self, c: Lumina2Config, modulation: bool = True):
        super().__init__()
        self.attention, self.feed_forward = _Attention(c), _FeedForward(c)
        for norm in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"):
            setattr(self, norm, nn.RMSNorm(c.hidden_size, eps=NORM_EPS))
        if modulation:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c.adaln_dim, 4 * c.hidden_size))


class Lumina2Transformer(nn.Module):
    """ComfyUI's NextDiT parameters under its names; the forward lives in Lumina2Adapter."""

    def __init__(self, c: Lumina2Config):
        super().__init__()
        dim = c.hidden_size
        self.x_embedder = nn.Linear(4 * c.in_channels, dim)
        self.noise_refiner = nn.ModuleList(_Block(c) for _ in range(c.num_refiner_layers))
        self.context_refiner = nn.ModuleList(_Block(c, modulation=False) for _ in range(c.num_refiner_layers))
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = nn.Sequential(nn.Linear(256, c.adaln_dim), nn.SiLU(), nn.Linear(c.adaln_dim, c.adaln_dim))
        self.cap_embedder = nn.Sequential(nn.RMSNorm(c.cap_feat_dim, eps=NORM_EPS), nn.Linear(c.cap_feat_dim, dim))
        self.layers = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.norm_final = nn.RMSNorm(dim, eps=NORM_EPS)
        self.final_layer = nn.Module()
        self.final_layer.linear = nn.Linear(dim, 4 * c.in_channels)
        self.final_layer.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c.adaln_dim, dim))


def _meta_model(config: Lumina2Config) -> Lumina2Transformer:
    with torch.device("meta"):
        return Lumina2Transformer(config)


def source_map(config: Lumina2Config, layout: str, prefix: str = "") -> dict[str, Source]:
    """ComfyUI's names are ours: every parameter under its own name after the file's prefix."""
    return same_names(_meta_model(config).state_dict(), prefix)


def checkpoint_shapes(config: Lumina2Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a Lumina 2 file, for writing random test checkpoints."""
    return shapes_of_model(_meta_model(config).state_dict(), parameter_kind)


def parameter_kind(name: str) -> str:
    """How tiny.write_checkpoint initialises a NextDiT parameter (Lumina 2's and Z-Image's names)."""
    if "norm" in name or name.startswith("cap_embedder.0."):
        return "norm"
    if name.endswith("bias"):
        return "bias"
    return "mod" if "adaLN_modulation" in name else "weight"


# -- the strategies' view -----------------------------------------------------------------------------

def sequence_ids(text_len: int, rows: int, cols: int) -> torch.Tensor:
    """RoPE ids of patchify_and_embed: prompt token i at (i, 0, 0), image tokens at (text_len, row, col)."""
    ids = torch.zeros(text_len + rows * cols, 3)
    ids[:text_len, 0] = torch.arange(text_len)
    ids[text_len:, 0] = text_len
    ids[text_len:, 1] = torch.arange(rows).repeat_interleave(cols)
    ids[text_len:, 2] = torch.arange(cols).repeat(rows)
    return ids


def block_inputs(config: Lumina2Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image rows, prompt rows, adaLN input, RoPE of a square-ish grid after the prompt) of a block call."""
    cols = max(1, int(image ** 0.5))
    ids = sequence_ids(text, -(-image // cols), cols)[:text + image]
    rope = rope_table(ids, config.rope_axes, config.rope_theta)
    h = config.hidden_size
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator),
            torch.randn(1, config.adaln_dim, generator=generator), rope)


class Lumina2Adapter(PatchTokens, BlockLoop):
    patch = 2  # (c, ph, pw) per token; embed_image and head re-order to NextDiT's
    latent_channels = 16
    latent_format = FLUX_LATENT
    default_guidance = 0.0  # no guidance input
    variant = "lumina2"
    joint_text = True  # the main layers attend over [prompt, image]
    embeds_whole_prompt = True  # embed_text refines the whole prompt; a rank then takes its rows

    def __init__(self, config: Lumina2Config, model: Lumina2Transformer, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.latent_channels = config.in_channels
        self.dtype, self.device = compute_placement(model.t_embedder)

    @functools.cached_property
    def model_sampling(self):
        # supported_models.Lumina2: shift 6, multiplier 1 (ZImage: shift 3)
        return FluxModelSampling(self.config.sampling_shift, 1.0, kind="discrete_flow")

    def rope(self, text_len: int, h: int, w: int, references=(), method=None):
        """cos/sin of patchify_and_embed's ids over [prompt, image] (Flux's EmbedND formula, pairs interleaved)."""
        return self._rope_table(self._sequence_ids(text_len, (h + 1) // 2, (w + 1) // 2))

    def _rope_table(self, ids: torch.Tensor):
        return rope_table(ids.to(self.device), self.config.rope_axes, self.config.rope_theta)

    # Hooks a NextDiT relative (Z-Image) replaces: its position ids, module names and prompt embedding.
    _sequence_ids = staticmethod(sequence_ids)

    @property
    def _x_embedder(self) -> nn.Module:
        return self.model.x_embedder

    @property
    def _final_layer(self) -> nn.Module:
        return self.model.final_layer

    def _embed_prompt(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.cap_embedder(cond.to(self.device, self.dtype))

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        """x_embedder on NextDiT's (ph, pw, c) patch order."""
        b, n, _ = tokens.shape
        c = self.config.in_channels
        tokens = tokens.reshape(b, n, c, 2, 2).permute(0, 1, 3, 4, 2).reshape(b, n, 4 * c)
        return self._x_embedder(tokens.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        """cap_embedder, then the unmodulated context refiner: the whole prompt over itself with its RoPE rows
        (ids (i, 0, 0)). It reads no timestep, so it runs once per job, on every rank that embeds the prompt, with
        plain local attention; strategies then take their rows of it (embeds_whole_prompt)."""
        text = self._embed_prompt(cond)
        rope = self._rope_table(self._sequence_ids(text.shape[1], 0, 0))
        attend = LocalAttention()
        for j, block in enumerate(self.model.context_refiner):
            text = self._block(block, text, None, rope, functools.partial(attend, layer=self.config.num_blocks + j))
        return text

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, hw=None):
        """NextDiT's adaLN input: t_embedder of (1 - t) x time_scale (t = sigma x multiplier 1), the sinusoid in
        float32."""
        t = (1.0 - t.to(self.device).flatten()) * self.config.time_scale
        return self.model.t_embedder.mlp(timestep_sinusoid(t).to(self.dtype))

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb, rope, chunk: int = 0) -> tuple:
        """Blocks 0..R-1 are the noise refiner (image rows over the image, through image_attention), the rest the
        main layers (this rank's [prompt, image] rows, through the joint attention); the prompt arrives refined
        (embed_text)."""
        refiners, n_text = self.config.num_refiner_layers, text.shape[1]
        for i in self.active_blocks(chunk):
            if i < refiners:
                image_rope = tuple(table[n_text:] for table in rope)
                image = self._block(self.model.noise_refiner[i], image, temb, image_rope,
                                    functools.partial(self.context.image_attention, layer=i))
            else:
                x = self._block(self.model.layers[i - refiners], torch.cat([text, image], dim=1), temb, rope,
                                functools.partial(self.context.attention, layer=i))
                text, image = x[:, :n_text], x[:, n_text:]
        return image, text

    def _block(self, block: _Block, x: torch.Tensor, temb, rope, attend) -> torch.Tensor:
        """JointTransformerBlock.forward: tanh-gated, sandwich-normed attention and SwiGLU MLP; the context refiner
        (temb None) has no modulation."""
        if temb is None:
            scale_msa = gate_msa = scale_mlp = gate_mlp = None
        else:
            scale_msa, gate_msa, scale_mlp, gate_mlp = (m.unsqueeze(1) for m in
                                                        block.adaLN_modulation(temb).chunk(4, dim=1))

        def modulate(h, scale):
            return h if scale is None else h * (1 + scale)

        def gated(y, gate):
            return y if gate is None else gate.tanh() * y

        y = self._attention(block.attention, modulate(block.attention_norm1(x), scale_msa), rope, attend)
        x = x + gated(block.attention_norm2(y), gate_msa)
        ff = block.feed_forward
        h = modulate(block.ffn_norm1(x), scale_mlp)
        return x + gated(block.ffn_norm2(ff.w2(F.silu(ff.w1(h)) * ff.w3(h))), gate_mlp)

    def _attention(self, attn: _Attention, x: torch.Tensor, rope, attend) -> torch.Tensor:
        """JointAttention: per-head q/k RMS norms (`_qkv`), RoPE; the fewer key/value heads of GQA go to the attention
        strategy as they are (it moves them unrepeated, and the kernel expands them: strategies/attention/gqa.py)."""
        from diffusers.models.embeddings import apply_rotary_emb

        q, k, v = self._qkv(attn, x)
        q = apply_rotary_emb(q, rope, sequence_dim=1)
        k = apply_rotary_emb(k, rope, sequence_dim=1)
        return self._out(attn, attend(q, k, v).flatten(2, 3).to(x.dtype))

    def _qkv(self, attn: _Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, L, heads, head_dim] queries, keys and values from the fused qkv, queries and keys RMS-normed."""
        c = self.config
        q, k, v = attn.qkv(x).split([attn.heads * c.head_dim, attn.kv_heads * c.head_dim,
                                     attn.kv_heads * c.head_dim], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, c.head_dim)) for t in (q, k, v))
        return attn.q_norm(q), attn.k_norm(k), v

    def _out(self, attn: _Attention, y: torch.Tensor) -> torch.Tensor:
        return attn.out(y)

    def head(self, image: torch.Tensor, temb, rope=None) -> torch.Tensor:
        """FinalLayer (affine-free LayerNorm, scale only), negated as NextDiT returns it, in pack's (c, ph, pw)."""
        final = self._final_layer
        scale = final.adaLN_modulation(temb).unsqueeze(1)
        out = final.linear(F.layer_norm(image, (image.shape[-1],), eps=1e-6) * (1 + scale))
        return channels_first(-out.float(), self.patch, self.config.in_channels)


def tensor_plan(config: Lumina2Config) -> dict:
    """Tensor parallelism over the noise refiner's and the joint blocks: the fused qkv column-wise in its three
    parts (queries, and the fewer key/value heads of GQA), the out-projection row-wise, the SwiGLU's w1/w3
    column-wise and w2 row-wise (their adaLN modulations are gathered by the seam's modulation_plan). The context
    refiner, which embeds the prompt once, stays whole."""
    heads = (config.num_heads, config.num_kv_heads, config.num_kv_heads)  # q, k, v rows in head units
    plan = {}
    for blocks in BLOCK_LISTS:
        plan.update({f"{blocks}.*.attention.qkv": ("colwise", heads), f"{blocks}.*.attention.out": "rowwise",
                     f"{blocks}.*.feed_forward.w1": "colwise", f"{blocks}.*.feed_forward.w3": "colwise",
                     f"{blocks}.*.feed_forward.w2": "rowwise"})
    return plan


LUMINA2 = DiTFamily(
    name="lumina2", title="Lumina Image 2.0", match=match_layout, infer_config=infer_config,
    meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=Lumina2Adapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="comfy", replace_keys=(), block_inputs=block_inputs, tensor_plan=tensor_plan)
