"""Qwen-Image 2.1: a single-stream DiT over [prompt, reference images, image] with block-causal attention.

What changed from Qwen-Image (qwen_image.py), as ComfyUI's comfy/ldm/qwen_image21/model.py runs it:
- one token stream: the prompt (txt_in: zero-centred RMSNorm, a tanh-GELU MLP), each ReferenceLatent's tokens
  and the image's tokens run through the same bias-free blocks (LayerNorm without shift, q/k RMS norms, a SwiGLU
  MLP 3x wide, fused as `gate_up` = [gate; up] in ComfyUI's files, split as `gate_layer` / `proj` in diffusers');
- block-causal attention: prompt tokens attend causally, a reference image to everything before it and to
  itself, the image to everything. Prompt and references never see the image, so they are step-independent:
- one `modulation` shared by every block, read at the sampled t by the image's tokens and at t = 0 by the
  prompt's and the references' (scale and tanh gate per sub-layer, no shift); the head scales only;
- RoPE over (frame, row, column): prompt token i at (i, i, i), each image grid centred on zero at the frame
  reached after what precedes it (a reference of the other parity half a token off, so it centres on the image);
- no patchify: a 64-channel latent at 1/16 of the pixels (latent_formats.QwenImage21, per-channel mean/std,
  4-D), one token per latent pixel; sampling is ModelSamplingFlux at shift 0.69 (supported_models.QwenImage21).

Here the canonical sequence is [prompt, image, references] like every family's; the adapter gives the mask that
makes attention block-causal in that order (`sequence_bias`, added by the strategies wherever a mask applies)
and each token's stream (image or prefix) as a third per-token table beside RoPE's cos and sin, so any shard
picks its modulation rows. ComfyUI caches the prefix's K/V across steps; here it is recomputed (same numbers).

Parity reference is diffusers' QwenImage21Transformer2DModel (same parameter names); where it and ComfyUI
differ this module follows ComfyUI: RoPE tables in float64 (diffusers: float32 polar), a reference of the other
parity half a token off (diffusers: integer offsets), and t rounded through the compute dtype as t x 1000
(diffusers rounds t itself). In fp32 with references of the image's parity the two agree to round-off.
ReferenceLatent tokens sit where the prompt's image slots put them (TextEncodeQwenImage21's images: the prompt row
before which each sits, `Conditioning.reference_slots`), else after the prompt; the ids and the mask follow that
order, while the canonical sequence keeps the prompt whole.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...sampling.flow import ChannelLatentFormat, FluxModelSampling
from ...weights.keymap import Source, block_count, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..conditioning import timestep_sinusoid
from ..family import DiTFamily, Match, diffusers_meta_model
from ..patchify import PatchTokens
from ..rope import rope_table
from .qwen_image import PREFIXES, QwenImageConfig

ALWAYS_OWNED = ("time_text_embed.", "modulation.")  # every stage embeds t and modulates its blocks
FIRST_STAGE = ("img_in.", "txt_in.")
LAST_STAGE = ("norm_out.", "proj_out.")
BLOCK_LISTS = ("transformer_blocks",)
# What ComfyUI's detection keys 2.1 on (comfy/model_detection.py), beside an MLP of either layout.
SIGNATURE = ("txt_in.text_norm.weight", "modulation.1.weight", "transformer_blocks.0.attn.norm_q.weight",
             "img_in.weight", "proj_out.weight")


@dataclass(frozen=True)
class _ImageChannelLatentFormat(ChannelLatentFormat):
    dimensions = 2  # an image VAE: latents are [B, C, H, W], not a video VAE's 5-D ones


# comfy.latent_formats.QwenImage21: the 64-channel latent of the 2.1 VAE (16x downscale).
QWEN_IMAGE21_LATENT = _ImageChannelLatentFormat(
    "qwen_image21",
    mean=(0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.6510, 0.2732,
          0.7562, -0.6163, -1.0277, 3.8363, 2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464,
          -0.5236, 1.2826, 3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555,
          0.0746, -3.0751, -0.1076, 1.7376, -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433, 0.3764, 0.5729,
          -2.0595, 1.0960, -1.3260, -2.0211, -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632,
          0.5547, -1.7121, -0.1562, 0.0304),
    std=(3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910, 3.0785, 3.6500, 3.9308, 3.0904, 2.8778,
         3.7675, 3.7320, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513,
         3.9323, 3.4719, 3.7498, 4.2830, 3.5694, 4.2467, 3.9037, 3.2947, 5.0770, 3.5075, 3.2700, 3.4767, 2.8063,
         5.1125, 3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.0550,
         5.5614, 4.2963, 4.4080, 3.4959, 3.8747, 3.7608, 3.5735, 3.1490, 3.7662, 3.6746, 3.4563, 3.8161))


@dataclass(frozen=True)
class QwenImage21Config(QwenImageConfig):
    """Qwen-Image's config (width, heads, blocks, RoPE axes) with 2.1's channels, prompt width and MLP ratio."""

    in_channels: int = 64
    out_channels: int = 64
    context_dim: int = 4096
    mlp_ratio: int = 3

    family = "qwen_image21"
    title = "Qwen-Image 2.1"
    variant = "qwen_image21"
    text_encoders = "the Qwen-Image 2.1 text encoder (Qwen3-VL 8B, TextEncodeQwenImage21)"
    latent_dimensions = 2
    latent_downscale = 16  # pixels per latent pixel (the 2.1 VAE's), one token each
    latent_format = QWEN_IMAGE21_LATENT
    reads_reference_slots = True  # TextEncodeQwenImage21's image slots place references inside the prompt

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.hidden_size

    def diffusers_kwargs(self) -> dict:
        return dict(patch_size=1, in_channels=self.in_channels, out_channels=self.out_channels,
                    num_layers=self.num_layers, attention_head_dim=self.head_dim, num_attention_heads=self.num_heads,
                    context_in_dim=self.context_dim, mlp_ratio=self.mlp_ratio, axes_dims_rope=self.axes_dims_rope)


# -- checkpoint layout --------------------------------------------------------------------------------

def match_layout(keys: list[str]) -> Match | None:
    """ComfyUI's signature keys; "comfy" where the MLP is fused (`gate_up`, as ComfyUI saves it), "diffusers"
    where it is split (`gate_layer` / `proj`)."""
    key_set = set(keys)
    for prefix in PREFIXES:
        if all(prefix + k in key_set for k in SIGNATURE):
            mlp = prefix + "transformer_blocks.0.img_mlp."
            if mlp + "gate_up.weight" in key_set:
                return Match("comfy", prefix)
            if mlp + "proj.weight" in key_set:
                return Match("diffusers", prefix)
    return None


def infer_config(reader, match: Match, name: str) -> QwenImage21Config:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete Qwen-Image 2.1 DiT")
    hidden, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    mlp = (shape("transformer_blocks.0.img_mlp.gate_up.weight")[0] // 2 if match.layout == "comfy"
           else shape("transformer_blocks.0.img_mlp.proj.weight")[0])
    if hidden % head_dim or mlp % hidden:
        raise ModelFileError(f"{name}: a {hidden}-wide model with {head_dim}-wide heads and a {mlp}-wide MLP is no "
                             f"Qwen-Image 2.1 shape; the file is damaged, so re-download it.")
    return QwenImage21Config(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim,
                             num_layers=block_count(reader.keys(), p, "transformer_blocks", name),
                             in_channels=in_channels, out_channels=shape("proj_out.weight")[0],
                             context_dim=shape("txt_in.text_norm.weight")[0], mlp_ratio=mlp // hidden)


_diffusers_model = diffusers_meta_model("QwenImage21Transformer2DModel")


def source_map(config: QwenImage21Config, layout: str, prefix: str = "") -> dict[str, Source]:
    """diffusers' names are the file's in both layouts, except that ComfyUI's fused `gate_up` holds the gate's
    rows, then the up projection's."""
    out = {}
    for name, _ in _diffusers_model(config).named_parameters():
        block, _, leaf = name.rpartition(".img_mlp.")
        if layout != "diffusers" and leaf in ("gate_layer.weight", "proj.weight"):
            m = config.mlp_hidden
            out[name] = Source(f"{prefix}{block}.img_mlp.gate_up.weight",
                               slice(0, m) if leaf.startswith("gate") else slice(m, 2 * m))
        else:
            out[name] = Source(prefix + name)
    return out


def checkpoint_shapes(config: QwenImage21Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a fused Qwen-Image 2.1 file, for writing random test checkpoints."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, p in _diffusers_model(config).named_parameters():
        if name.endswith("img_mlp.proj.weight"):
            continue  # written with the gate, as ComfyUI's fused gate_up
        if name.endswith("img_mlp.gate_layer.weight"):
            out[name.replace("gate_layer", "gate_up")] = ((2 * p.shape[0], p.shape[1]), "weight")
        elif name == "txt_in.text_norm.weight":
            out[name] = (tuple(p.shape), "bias")  # stored as scale - 1: small
        elif "norm" in name and p.dim() == 1:
            out[name] = (tuple(p.shape), "norm")
        else:
            out[name] = (tuple(p.shape), "mod" if name.startswith(("modulation.", "norm_out.")) else "weight")
    return out


# -- the strategies' view -----------------------------------------------------------------------------

def placed_slots(text_len: int, count: int, slots: tuple[int, ...] = ()) -> list[int]:
    """The prompt row before which each of `count` references sits (build_sequence's `slots`): the prompt's image
    slots where given, the end of the prompt for the rest."""
    return (list(slots) + [text_len] * count)[:count]


def sequence_ids(text_len: int, h: int, w: int, references: tuple[tuple[int, int], ...] = (),
                 slots: tuple[int, ...] = ()) -> torch.Tensor:
    """RoPE ids of build_sequence in the canonical order [prompt, image, references]. ComfyUI's order is the prompt
    with each reference spliced in before its slot's row, then the image; a running frame counts every prompt row
    and every grid's longer side in that order: prompt row i at (f, f, f), each grid at the frame reached so far,
    rows and columns centred on zero (a reference of the other parity than the image half a token off)."""
    def grid(frame: float, rows: int, cols: int) -> torch.Tensor:
        r = torch.arange(rows, dtype=torch.float64) - (rows - rows // 2) + 0.5 * (rows % 2 - h % 2)
        c = torch.arange(cols, dtype=torch.float64) - (cols - cols // 2) + 0.5 * (cols % 2 - w % 2)
        return torch.stack([torch.full((rows, cols), frame, dtype=torch.float64), r[:, None].expand(rows, cols),
                            c[None, :].expand(rows, cols)], dim=-1).flatten(0, 1)

    at = placed_slots(text_len, len(references), slots)
    prompt_frame = torch.arange(text_len, dtype=torch.float64)
    refs, skipped = [], 0.0  # `skipped`: the frames the references before this one took
    for slot, (rows, cols) in zip(at, references):
        refs.append(grid(slot + skipped, rows, cols))
        prompt_frame[slot:] += max(rows, cols)
        skipped += max(rows, cols)
    prompt = prompt_frame[:, None].expand(text_len, 3)
    return torch.cat([prompt, grid(text_len + skipped, h, w), *refs])


def sequence_mask(text_len: int, image_len: int, reference_lens: tuple[int, ...] = (),
                  slots: tuple[int, ...] = ()) -> torch.Tensor:
    """[L, L] True where a query (row) may attend a key (column), over [prompt, image, references]: ComfyUI's
    block-causal rule in its order (the prompt with each reference before its slot's row, then the image): earlier
    tokens, and the query's own image."""
    at = placed_slots(text_len, len(reference_lens), slots)
    text_order = torch.arange(text_len)
    ref_order, before = [], 0  # `before`: reference tokens placed ahead of this one
    for slot, n in zip(at, reference_lens):
        ref_order.append(torch.arange(slot + before, slot + before + n))
        text_order[slot:] += n
        before += n
    order = torch.cat([text_order, torch.arange(text_len + before, text_len + before + image_len), *ref_order])
    block = torch.cat([torch.full((text_len,), -1), torch.full((image_len,), len(reference_lens))]
                      + [torch.full((n,), j) for j, n in enumerate(reference_lens)])  # -1: a prompt row (causal)
    return (order[:, None] >= order[None, :]) | ((block[:, None] == block[None, :]) & (block[:, None] >= 0))


def block_inputs(config: QwenImage21Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image rows, prompt rows, (temb, image and prefix modulation rows), (cos, sin, stream) of a
    near-square grid after the prompt) of one block call."""
    h = config.hidden_size
    cols = max(1, int(image ** 0.5))
    ids = sequence_ids(text, -(-image // cols), cols)[:text + image]
    cos, sin = rope_table(ids, config.axes_dims_rope)
    target = torch.arange(text + image) >= text
    temb = (torch.randn(1, h, generator=generator), torch.randn(1, 4 * h, generator=generator),
            torch.randn(1, 4 * h, generator=generator))
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator), temb,
            (cos, sin, target))


class QwenImage21Adapter(PatchTokens, BlockLoop):
    patch = 1  # one token per latent pixel, row-major (ComfyUI's build_sequence): the 2.1 VAE compresses 16x
    latent_format = QWEN_IMAGE21_LATENT
    default_guidance = 0.0  # no guidance input
    variant = "qwen_image21"

    def __init__(self, config: QwenImage21Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.latent_channels = config.out_channels
        # The bias-free linears every stage owns may be fp8 or GGUF blocks; a block's q-norm scale never is.
        self.dtype, self.device = compute_placement(model.transformer_blocks[chunks[0][0]].attn.norm_q)

    @functools.cached_property
    def model_sampling(self):
        return FluxModelSampling(0.69, 1.0, kind="flux")  # supported_models.QwenImage21: ModelSamplingFlux, 0.69

    def rope(self, text_len: int, h: int, w: int, references: tuple[tuple[int, int], ...] = (),
             method: str | None = None, slots: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin (float64 angles, pairs interleaved as ComfyUI's EmbedND) and each token's stream (True: the
        image, modulated at t; False: prompt and references, at t = 0) over [prompt, image, references].
        `method` changes nothing: ComfyUI's 2.1 model places references by the prompt's image `slots` only."""
        ids = sequence_ids(text_len, h, w, references, slots)
        cos, sin = rope_table(ids.to(self.device), self.config.axes_dims_rope)
        target = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        target[text_len:text_len + h * w] = True
        return cos, sin, target

    def sequence_bias(self, text_len: int, hw: tuple[int, int], references: tuple[tuple[int, int], ...] = (),
                      slots: tuple[int, ...] = ()) -> torch.Tensor:
        """The additive mask [1, L, L] (0 or -inf, compute dtype) that makes attention block-causal over the
        canonical [prompt, image, references]; the strategies cut each call's block of it."""
        key = (text_len, tuple(hw), tuple(references), tuple(slots))
        cached = getattr(self, "_last_bias", None)
        if cached is not None and cached[0] == key:  # a stock sampler's calls repeat one layout: build it once
            return cached[1]
        lens = tuple(r * c for r, c in references)
        allowed = sequence_mask(text_len, hw[0] * hw[1], lens, slots).to(self.device)
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias = bias.masked_fill_(~allowed, float("-inf"))[None]
        self._last_bias = (key, bias)  # only the last layout: at 2048 px one mask is ~0.5 GB in bf16
        return bias

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        return self.model.img_in(tokens.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        """TextProjection: zero-centred RMSNorm in float32, in_layer, tanh-GELU, out_layer (token by token)."""
        return self.model.txt_in(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, hw=None) -> tuple:
        """(temb [N, dim] at t, the shared modulation [N, 4 dim] at t, and [1, 4 dim] at t = 0). t (= sigma) is
        rounded as ComfyUI's _forward rounds it: t x 1000 in the compute dtype, / 1000. pooled and guidance are
        unused: 2.1 has neither."""
        t = t.to(self.device, torch.float32).flatten()
        t = ((t * 1000).to(self.dtype) / 1000).to(self.dtype)
        t = torch.cat([t, t.new_zeros(1)])
        temb = self.model.time_text_embed.timestep_embedder(timestep_sinusoid(t.float() * 1000).to(self.dtype))
        modulation = self.model.modulation(temb)
        return temb[:-1], modulation[:-1], modulation[-1:]

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb, rope, chunk: int = 0) -> tuple:
        """This rank's [prompt, image-stream] rows through its blocks. The modulation is shared by every block, so
        each token's rows (its stream's: the image's at t, the prefix's at t = 0) are picked once here."""
        _, at_t, at_zero = temb
        stream = rope[2][None, :, None]  # [1, S, 1]: True on image rows
        scale1, gate1, scale2, gate2 = (torch.where(stream, a[:, None], z[:, None]) for a, z in
                                        zip(at_t.chunk(4, dim=-1), at_zero.chunk(4, dim=-1)))
        mod = (scale1, gate1.tanh(), scale2, gate2.tanh())
        n_text = text.shape[1]
        x = torch.cat([text, image], dim=1)
        for i in self.active_blocks(chunk):
            x = self._block(i, x, mod, rope)
        return x[:, n_text:], x[:, :n_text]

    def _block(self, i: int, x: torch.Tensor, mod: tuple, rope) -> torch.Tensor:
        """QwenImage21TransformerBlock: LayerNorm x (1 + scale) into attention and the SwiGLU MLP, tanh-gated."""
        block = self.model.transformer_blocks[i]
        scale1, gate1, scale2, gate2 = mod
        x = x + gate1 * self._attention(i, block.attn, block.img_norm1(x) * (1 + scale1), rope)
        mlp = block.img_mlp
        h = block.img_norm2(x) * (1 + scale2)
        x = x + gate2 * mlp.out(F.silu(mlp.gate_layer(h)) * mlp.proj(h))
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x

    def _attention(self, i: int, attn, x: torch.Tensor, rope) -> torch.Tensor:
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))  # a tensor-parallel rank's share of the heads

        q = apply_rotary_emb(attn.norm_q(heads(attn.to_q(x))).to(x.dtype), rope[:2], sequence_dim=1)
        k = apply_rotary_emb(attn.norm_k(heads(attn.to_k(x))).to(x.dtype), rope[:2], sequence_dim=1)
        out = self.context.attention(q, k, heads(attn.to_v(x)), i).flatten(2, 3).to(x.dtype)
        return attn.to_out[0](out)

    def head(self, image: torch.Tensor, temb, rope=None) -> torch.Tensor:
        """Velocity in float32, one latent pixel's channels per token: the scale-only final norm at t, proj_out."""
        norm = self.model.norm_out
        scale = norm.linear(F.silu(temb[0]).to(image.dtype)).unsqueeze(1)
        return self.model.proj_out(norm.norm(image) * (1 + scale)).float()


@dataclass(frozen=True, eq=False)
class _QwenImage21Family(DiTFamily):
    def weight_patch_targets(self, config) -> dict:
        """ComfyUI names its model's MLP weights after the file: a fused file's gate_up, a split file's gate_layer
        and proj; a LoRA patch of either lands."""
        from ...weights.patches import patch_targets

        return {**patch_targets(source_map(config, "diffusers")), **super().weight_patch_targets(config)}


QWEN_IMAGE21 = _QwenImage21Family(
    name="qwen_image21", title="Qwen-Image 2.1", match=match_layout, infer_config=infer_config,
    meta_model=_diffusers_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=QwenImage21Adapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="comfy", replace_keys=("single_block",), block_inputs=block_inputs)
