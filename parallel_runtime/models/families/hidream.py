"""HiDream I1 (full, dev, fast) and E1 (editing): a Flux-like DiT with a mixture-of-experts MLP and four prompt streams
(ComfyUI's comfy/ldm/hidream/model.py; diffusers' HiDreamImageTransformer2DModel, whose module tree this builds).

- Prompt. ComfyUI's CLIPTextEncodeHiDream hands the model T5-XXL's tokens (`context`), the pooled CLIP-L + CLIP-G
  vector (`y`) and all 32 hidden layers of Llama 3.1 8B (`encoder_hidden_states_llama3`, from the conditioning's
  `conditioning_llama3`; here `Conditioning.llama`). Each of the 16 double and 32 single blocks reads its own Llama
  layer (ComfyUI's llama_layers: block k reads layer min(k, 31)) through its own `caption_projection[k]`. The prompt
  rows of every block are [T5 (Lt), the last block's Llama layer (Ll), this block's Llama layer (Ll)]: the first
  Lt + Ll rows are carried from block to block, the last Ll are replaced at each block's entry (and dropped after
  it). Here they ride as ordinary joint prompt rows, split over shards like any prompt: each rank replaces the
  Llama rows it holds, which it finds by a second RoPE table (a text row's distance from the prompt's end), with
  the Llama layers carried beside the timestep embedding (`HiDreamTime`), so every PipeFusion stage has them.
- Blocks. Double blocks keep image and prompt weights apart and attend jointly; single blocks run [prompt, image]
  through one set of weights. q/k RMS norms over the whole width, RoPE (theta 1e4, axes (64, 32, 32) of the 128-wide
  head: here a half and two quarters of any head) with every prompt row at position 0, image rows at (0, row, col).
  The head's output is negated, as ComfyUI's model returns it.
- Mixture of experts. The image MLP (ff_i) of every block is DeepSeek-style: a softmax router over 4 experts, the
  top 2 of each token (unsorted, weights not renormalised), each a SwiGLU, plus a shared SwiGLU expert; ComfyUI's
  order of operations is kept (router logits in the compute dtype, softmax, topk, weighted sum over the two picks).
  The router and experts run on the rank's own tokens: routing is per token, so every sequence split is exact.
  Tensor parallelism splits *inside* every expert (each expert's w1/w3 output rows and w2 input columns, the shared
  expert's alike) and keeps the router whole: every rank routes the same replicated tokens to the same experts,
  computes 1/N of each picked expert's hidden units, and one all-reduce completes the whole MoE (experts and shared
  expert summed before it). Expert parallelism (whole experts per rank) was not chosen: top-2 of 4 routes ~half the
  tokens to each expert, so ranks would idle unevenly with the routing of each step, and its all-to-alls move more
  bytes than one all-reduce of the MLP's output.
- E1. InstructPixToPixConditioning's image is `image_cond`, which ComfyUI concatenates to the latent along the width:
  its tokens sit right of the image's ((0, row, W/2 + col)) and are cut off the output. Here it rides as a reference
  latent placed there (reference_method "hidream_e1"), split over shards like Kontext's references.
- Sampling: ModelSamplingDiscreteFlow, shift 1 unless ModelSamplingSD3 sets one (the templates: 3 for full and fast,
  6 for dev), multiplier 1000; Flux's latent format. Full, dev and fast have the same shapes and run alike.

ComfyUI's and diffusers' files name every tensor alike, so one key map reads both (and the fp8-scaled files the
templates load). Refused in one sentence: HiDream O1 (a Qwen3-VL model, no such blocks), a file whose blocks have no
router (an MoE-less HiDream variant ComfyUI does not build either).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...sampling import FLUX_LATENT, FluxModelSampling
from ...strategies.tensor_calls import gathered_outputs, rms_norms, row_projections, summed_partials
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..family import BlockKind, DiTFamily, Match, TwoBlockListConfig
from ..shapes import shapes_of_model

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "")
HEAD_DIM = 128  # ComfyUI builds every HiDream with 128-wide heads (nothing in the file says so)
LLAMA_LAYERS = 32  # Llama 3.1 8B's hidden layers: CLIPTextEncodeHiDream hands over all of them
TOP_K = 2  # ComfyUI's num_activated_experts (nothing in the file says so)
E1_METHOD = "hidream_e1"  # the reference method of E1's image_cond: concatenated along the width
BLOCK_LISTS = ("double_stream_blocks", "single_stream_blocks")
DOUBLE_BLOCK = BlockKind("double", ("joint",))
SINGLE_BLOCK = BlockKind("single", ("joint",))
# Every stage projects its own blocks' Llama rows (and stage 0 the T5 rows), so all projections are every stage's.
ALWAYS_OWNED = ("t_embedder.", "p_embedder.", "caption_projection.")
FIRST_STAGE = ("x_embedder.",)
LAST_STAGE = ("final_layer.",)


def swiglu_width(hidden: int) -> int:
    """ComfyUI's FeedForwardSwiGLU width for a nominal `hidden`: two thirds of it, up to a multiple of 256."""
    return 256 * -(-int(2 * hidden / 3) // 256)


@dataclass(frozen=True)
class HiDreamConfig(TwoBlockListConfig):
    first_kind, second_kind = DOUBLE_BLOCK, SINGLE_BLOCK  # the pipeline's one list: these, then single blocks
    hidden_size: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    in_channels: int = 16
    t5_dim: int = 4096
    llama_dim: int = 4096
    pooled_dim: int = 2048
    num_experts: int = 4
    head_dim: int = HEAD_DIM

    family = "hidream"
    title = "HiDream I1 / E1"
    variant = "hidream"
    text_encoders = "QuadrupleCLIPLoader (CLIP-L, CLIP-G, T5-XXL, Llama 3.1 8B) and CLIPTextEncodeHiDream"
    reads_references = True  # only E1's image_cond, which rides as a reference (reference_problem)

    def __post_init__(self):
        if self.hidden_size % self.head_dim or self.head_dim % 4:
            raise ModelFileError(f"a HiDream {self.hidden_size} wide is no whole number of {self.head_dim}-wide "
                                 f"heads; the file is damaged, so re-download it.")

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim



    @property
    def context_dim(self) -> int:
        return self.t5_dim

    @property
    def latent_channels(self) -> int:
        return self.in_channels

    @property
    def mlp_hidden(self) -> int:
        """The width every tensor-parallel degree must divide: the experts' and the shared expert's."""
        return math.gcd(swiglu_width(4 * self.hidden_size), swiglu_width(2 * self.hidden_size))

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        return self.head_dim // 2, self.head_dim // 4, self.head_dim // 4

    @property
    def llama_layers(self) -> tuple[int, ...]:
        """The Llama layer each block reads (ComfyUI's list: 0..31, then 31 for the last 16 blocks)."""
        return tuple(min(k, LLAMA_LAYERS - 1) for k in range(self.num_blocks))

    @staticmethod
    def reference_latent_problem(references, latent_shape: tuple, timestep, method=None) -> str | None:
        if any(tuple(r.shape[-2:]) != tuple(latent_shape[-2:]) for r in references):
            return ("HiDream E1's image (InstructPixToPixConditioning) must have the latent's size; scale the image "
                    "to the output size before VAE Encode")
        return None

    @staticmethod
    def reference_problem(name: str, references, method) -> str | None:
        if method != E1_METHOD:
            return (f"the {name} conditioning carries a ReferenceLatent, which ComfyUI's HiDream never reads; remove "
                    f"the ReferenceLatent node (HiDream E1 edits an image given by InstructPixToPixConditioning)")
        if len(references) != 1:
            return f"the {name} conditioning carries {len(references)} E1 images where HiDream E1 reads one"
        return None


# -- checkpoint layout --------------------------------------------------------------------------------

def match_layout(keys: list[str]) -> Match | None:
    """ComfyUI's and diffusers' files share their names: the first caption projection beside a double block."""
    key_set = set(keys)
    for prefix in PREFIXES:
        if {prefix + "caption_projection.0.linear.weight", prefix + "x_embedder.proj.weight"} <= key_set:
            return Match("comfy", prefix)
    return None


def infer_config(reader, match: Match, name: str) -> HiDreamConfig:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete HiDream I1/E1 DiT")
    keys = reader.keys()
    double = block_count(keys, p, "double_stream_blocks", name)
    single = block_count(keys, p, "single_stream_blocks", name)
    projections = block_count(keys, p, "caption_projection", name)
    if projections != double + single + 1:
        raise ModelFileError(f"{name} has {projections} caption projections for {double + single} blocks (HiDream "
                             f"has one per block and one for T5); the file is damaged, so re-download it.")
    if p + "double_stream_blocks.0.block.ff_i.gate.weight" not in reader:
        raise ModelFileError(f"{name} is a HiDream without mixture-of-experts blocks, which neither ComfyUI nor "
                             f"ParaDiT builds; choose HiDream I1 full, dev, fast or E1.")
    dim, patch_in = shape("x_embedder.proj.weight")
    return HiDreamConfig(hidden_size=dim, num_layers=double, num_single_layers=single, in_channels=patch_in // 4,
                         t5_dim=shape(f"caption_projection.{double + single}.linear.weight")[1],
                         llama_dim=shape("caption_projection.0.linear.weight")[1],
                         pooled_dim=shape("p_embedder.pooled_embedder.linear_1.weight")[1],
                         num_experts=shape("double_stream_blocks.0.block.ff_i.gate.weight")[0])


@functools.lru_cache(maxsize=8)
def _meta_model(config: HiDreamConfig) -> torch.nn.Module:
    from diffusers import HiDreamImageTransformer2DModel

    with torch.device("meta"):
        return HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=config.in_channels, num_layers=config.num_layers,
            num_single_layers=config.num_single_layers, attention_head_dim=config.head_dim,
            num_attention_heads=config.num_heads, caption_channels=[config.t5_dim, config.llama_dim],
            text_emb_dim=config.pooled_dim, num_routed_experts=config.num_experts, num_activated_experts=TOP_K,
            axes_dims_rope=config.rope_axes, llama_layers=list(config.llama_layers))


def meta_model(config: HiDreamConfig) -> torch.nn.Module:
    import copy

    return copy.deepcopy(_meta_model(config))


def source_map(config: HiDreamConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    return same_names(_meta_model(config).state_dict(), prefix)


def parameter_kind(name: str) -> str:
    if name.endswith("bias"):
        return "bias"
    if "adaLN_modulation" in name:
        return "mod"
    return "norm" if "rms_norm" in name else "weight"


def checkpoint_shapes(config: HiDreamConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    return shapes_of_model(_meta_model(config).state_dict(), parameter_kind)


def tensor_plan(config: HiDreamConfig) -> dict:
    """Heads and every MLP's hidden units split; the experts' down projections are summed by the MoE's one
    all-reduce (HiDreamAdapter._moe reads them unreduced), the router stays whole. Each block's modulation keeps 1/N
    of its outputs (family.modulation_plan; 15% of a release's weights): run_blocks gathers them all at once."""
    plan = {}
    for attr, count in zip(BLOCK_LISTS, (config.num_layers, config.num_single_layers)):
        streams = ("", "_t") if attr == BLOCK_LISTS[0] else ("",)
        for i in range(count):
            b = f"{attr}.{i}.block"
            for s in streams:
                plan.update({f"{b}.attn1.to_q{s}": "colwise", f"{b}.attn1.to_k{s}": "colwise",
                             f"{b}.attn1.to_v{s}": "colwise", f"{b}.attn1.to_out{s}": "rowwise",
                             f"{b}.attn1.q_rms_norm{s}": "norm", f"{b}.attn1.k_rms_norm{s}": "norm"})
            mlps = [f"{b}.ff_i.shared_experts"] + [f"{b}.ff_i.experts.{e}" for e in range(config.num_experts)]
            for mlp in mlps + ([f"{b}.ff_t"] if len(streams) == 2 else []):
                plan.update({f"{mlp}.w1": "colwise", f"{mlp}.w3": "colwise", f"{mlp}.w2": "rowwise"})
    return plan


# -- the strategies' view -----------------------------------------------------------------------------

def rope_table(ids: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """ComfyUI's EmbedND (flux/math.py's rope per axis, in float64, then float32): [L, D/2, 2, 2]."""
    parts = []
    for i, dim in enumerate(axes):
        scale = torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim
        angle = ids[:, i].double()[:, None] / (10000 ** scale)
        cos, sin = torch.cos(angle), torch.sin(angle)
        parts.append(torch.stack([cos, -sin, sin, cos], -1).reshape(len(ids), -1, 2, 2))
    return torch.cat(parts, dim=1).float()


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ComfyUI's apply_rope1 on [B, L, heads, D] with a [L, D/2, 2, 2] table, in float32."""
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    f = freqs[None, :, None]
    return (f[..., 0] * x_[..., 0] + f[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def grid_ids(rows: int, cols: int, col0: int = 0) -> torch.Tensor:
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = col0 + torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


class HiDreamTime(NamedTuple):
    """What every block reads besides its rows: the adaLN input (timestep + pooled embedding) and the prompt's Llama
    layers [B, 32, Ll, llama_dim], which each block projects into its own prompt rows."""

    adaln: torch.Tensor
    llama: torch.Tensor


class HiDreamAdapter:
    latent_channels = 16
    patch = 2
    embedding_module = "t_embedder"
    skip: frozenset = frozenset()
    latent_format = FLUX_LATENT
    default_guidance = 0.0  # no guidance input
    reads_llama = True  # the strategies hand embed_text and timestep_embedding the prompt's Llama layers

    def __init__(self, config: HiDreamConfig, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        # Blocks another PipeFusion stage runs are Identity here.
        self._blocks = [getattr(b, "block", b) for attr in BLOCK_LISTS for b in getattr(model, attr)]
        self.dtype, self.device = compute_placement(model.t_embedder)

    @functools.cached_property
    def model_sampling(self):
        return FluxModelSampling(1.0, 1000.0, kind="discrete_flow")

    # -- token layout ------------------------------------------------------------------------------

    @staticmethod
    def pack(latent: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H/2)(W/2), 4C], channels last inside each 2x2 patch (ComfyUI's patchify)."""
        b, c, h, w = latent.shape
        x = latent.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (h // 2) * (w // 2), 4 * c)

    @staticmethod
    def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, _, d = tokens.shape
        x = tokens.reshape(b, h // 2, w // 2, 2, 2, d // 4).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, d // 4, h, w)

    @staticmethod
    def joined_rows(branches) -> int:
        """Prompt rows besides T5's: the last block's Llama layer and the current block's."""
        return 2 * branches.llama.shape[2] if branches.llama is not None else 0

    @staticmethod
    def sequence_rows(tokens: int) -> int:
        """Rows a prompt of `tokens` tokens takes in the attention sequence, as the cost model, auto and the bench
        count them (registry.prompt_rows): T5's and two Llama layers' (joined_rows), each taken as long as the
        prompt: exact up to 128 tokens (CLIPTextEncodeHiDream pads T5 to 128 and Llama to at least 128); a longer
        Llama prompt has more rows, which the workers count themselves (joined_rows)."""
        return 3 * tokens

    def rope(self, text_len: int, h: int, w: int, references=(), method=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RoPE over [prompt, image, E1 image], each prompt row's distance from the prompt's end (0: image rows))."""
        ids = [torch.zeros(text_len, 3), grid_ids(h // 2, w // 2)]
        ids += [grid_ids(rh // 2, rw // 2, col0=w // 2) for rh, rw in references]  # E1: right of the image
        ids = torch.cat(ids)
        from_end = torch.zeros(len(ids), dtype=torch.long)
        from_end[:text_len] = torch.arange(text_len, 0, -1)
        return rope_table(ids, self.config.rope_axes).to(self.device), from_end.to(self.device)

    # -- embeddings ----------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        return self.model.x_embedder(tokens.to(self.device, self.dtype))

    def _llama_rows(self, block: int, llama: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        layer = llama[:, self.config.llama_layers[block], rows]
        return self.model.caption_projection[block](layer.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor, llama: torch.Tensor) -> torch.Tensor:
        """The first block's prompt rows: [T5, the last block's Llama layer, the first block's]."""
        t5 = self.model.caption_projection[-1](cond.to(self.device, self.dtype))
        last = self.config.num_blocks - 1
        return torch.cat([t5, self._llama_rows(last, llama), self._llama_rows(0, llama)], dim=1)

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, hw=None,
                           llama: torch.Tensor | None = None) -> HiDreamTime:
        """t = 1000 sigma in float32 (model_base passes it so); the sinusoid cast to the compute dtype, as ComfyUI's
        TimestepEmbed does."""
        m = self.model
        t_emb = m.t_embedder.timestep_embedder(m.t_embedder.time_proj(t.to(self.device, torch.float32)).to(self.dtype))
        adaln = t_emb + m.p_embedder(pooled.to(self.device, self.dtype))
        return HiDreamTime(adaln, llama)

    # -- blocks and head -----------------------------------------------------------------------------

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb: HiDreamTime, rope, chunk: int = 0) -> tuple:
        freqs, from_end = rope
        n = text.shape[1]
        ll = temb.llama.shape[2]
        # This rank's rows of the current block's Llama layer: the prompt's last Ll rows.
        rows = (from_end[:n] >= 1) & (from_end[:n] <= ll)
        mine = rows if rows.is_meta else torch.nonzero(rows).flatten()
        slots = None if rows.is_meta else ll - from_end[:n][mine]
        # Every block's modulation reads only the step's time embedding: computed before the blocks, so that
        # tensor parallelism's share of them is gathered once per step.
        blocks = [self._blocks[i] for i in self.chunks[chunk]]
        modulations = gathered_outputs(self.model, [(b.adaLN_modulation[1], F.silu(temb.adaln)) for b in blocks])
        for i, modulation in zip(self.chunks[chunk], modulations):
            if mine.is_meta:  # the cost model's FLOP count (no values): this block's Llama projection, as serial's
                self._llama_rows(i, temb.llama)
            elif len(mine):
                text = text.clone()
                text[:, mine] = self._llama_rows(i, temb.llama, slots.to(temb.llama.device)).to(text.dtype)
            run = self._double if i < self.config.num_layers else self._single
            image, text = run(i, image, text, modulation[:, None], freqs)
        return image, text

    def _attend(self, i: int, attn, x: torch.Tensor, t: torch.Tensor | None, freqs: torch.Tensor) -> torch.Tensor:
        """Joint attention over [prompt, image] rows (t: the prompt's own projections, None in a single block).
        The q/k norms run over all heads' width: under tensor parallelism their statistics (both streams') are
        summed over the group in one all-reduce."""
        streams = [(t, "_t"), (x, "")] if t is not None else [(x, "")]
        raw = [(getattr(attn, f"{p}{s}")(rows), getattr(attn, f"{n}{s}"))
               for rows, s in streams for p, n in (("to_q", "q_rms_norm"), ("to_k", "k_rms_norm"))]
        normed = iter(rms_norms(self.model, [(norm, rows) for rows, norm in raw]))
        qk = [(next(normed), next(normed), getattr(attn, f"to_v{s}")(rows)) for rows, s in streams]
        parts = qk[0] if t is None else [torch.cat(p, dim=1) for p in zip(*qk)]
        q, k, v = (p.unflatten(-1, (-1, self.config.head_dim)) for p in parts)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        return self.context.attention(q, k, v, i).flatten(2, 3).to(x.dtype)

    def _double(self, i: int, image, text, modulation, freqs):
        """One dual-stream block; each stream's out-projection and MLP reduced together with the other's under
        tensor parallelism (one all-reduce for both, where each needs only its own)."""
        blk = self._blocks[i]
        (sh_i, sc_i, g_i, shm_i, scm_i, gm_i,
         sh_t, sc_t, g_t, shm_t, scm_t, gm_t) = modulation.chunk(12, dim=-1)
        norm_i = blk.norm1_i(image) * (1 + sc_i) + sh_i
        norm_t = blk.norm1_t(text) * (1 + sc_t) + sh_t
        out = self._attend(i, blk.attn1, norm_i, norm_t, freqs)
        n = text.shape[1]
        attn_i, attn_t = row_projections(self.model, [(blk.attn1.to_out, out[:, n:].contiguous()),
                                                      (blk.attn1.to_out_t, out[:, :n].contiguous())])
        image, text = g_i * attn_i + image, g_t * attn_t + text
        ff_i, ff_t = summed_partials(self.model, [
            self._moe(blk.ff_i, blk.norm3_i(image) * (1 + scm_i) + shm_i),
            _swiglu_partial(blk.ff_t, blk.norm3_t(text) * (1 + scm_t) + shm_t)])
        return gm_i * ff_i + image, gm_t * ff_t + text

    def _single(self, i: int, image, text, modulation, freqs):
        blk = self._blocks[i]
        sh, sc, g, shm, scm, gm = modulation.chunk(6, dim=-1)
        x = torch.cat([text, image], dim=1)
        x = g * blk.attn1.to_out(self._attend(i, blk.attn1, blk.norm1_i(x) * (1 + sc) + sh, None, freqs)) + x
        x = gm * summed_partials(self.model, [self._moe(blk.ff_i, blk.norm3_i(x) * (1 + scm) + shm)])[0] + x
        return x[:, text.shape[1]:], x[:, :text.shape[1]]

    def _moe(self, moe, x: torch.Tensor) -> torch.Tensor:
        """ComfyUI's MOEFeedForwardSwiGLU on these rows: router softmax, unsorted top-k, each picked expert on its
        rows, weighted sum, plus the shared expert; under tensor parallelism this rank's partial sum (the caller
        reduces it, `summed_partials`).

        Each expert gets the rows ComfyUI's boolean masks give it, in the same order (a stable sort by expert), so
        its products are ComfyUI's bit for bit; but the rows per expert are read back once per call (one device
        sync), where a mask per expert reads back twice per expert (8 syncs per block on a GPU)."""
        flat = x.reshape(-1, x.shape[-1])
        scores = F.linear(flat, moe.gate.weight.to(x.dtype)).softmax(dim=-1)
        weights, picked = torch.topk(scores, k=TOP_K, dim=-1, sorted=False)
        picked = picked.reshape(-1)
        order = torch.sort(picked, stable=True).indices  # (row, pick) slots, expert after expert
        if picked.is_meta:  # the cost model's FLOP count: any routing runs TOP_K experts per row, so split evenly
            counts = [len(t) for t in torch.arange(picked.shape[0]).tensor_split(len(moe.experts))]
        else:
            counts = torch.bincount(picked, minlength=len(moe.experts)).tolist()  # the one read back
        routed = flat[order // TOP_K].split(counts)
        out = torch.cat([_swiglu_partial(expert, rows) for expert, rows in zip(moe.experts, routed) if len(rows)])
        y = torch.empty(picked.shape[0], out.shape[-1], dtype=x.dtype, device=x.device)
        y[order] = out.to(y.dtype)
        y = (y.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1).view(x.shape)
        return y + _swiglu_partial(moe.shared_experts, x)

    def head(self, image: torch.Tensor, temb: HiDreamTime, rope=None) -> torch.Tensor:
        """ComfyUI's final layer, negated (its model returns -output), in float32."""
        return -self.model.final_layer(image, temb.adaln).float()


def _swiglu_partial(mlp, x: torch.Tensor) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x) with w2's own forward: under tensor parallelism its rank's partial product (the MoE
    sums them all and reduces once), else the whole product."""
    return type(mlp.w2).forward(mlp.w2, F.silu(mlp.w1(x)) * mlp.w3(x))


def block_inputs(config: HiDreamConfig, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, prompt, HiDreamTime, RoPE) of one block call: a near-square image after the prompt, whose
    last 128 rows (or a third) are the block's Llama rows."""
    h, cols = config.hidden_size, max(1, math.isqrt(image))
    ll = min(128, max(1, text // 3))
    ids = torch.cat([torch.zeros(text, 3), grid_ids(-(-image // cols), cols)[:image]])
    from_end = torch.cat([torch.arange(text, 0, -1), torch.zeros(image, dtype=torch.long)])
    temb = HiDreamTime(torch.randn(1, h, generator=generator),
                       torch.randn(1, LLAMA_LAYERS, ll, config.llama_dim, generator=generator))
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator), temb,
            (rope_table(ids, config.rope_axes), from_end))


HIDREAM = DiTFamily(
    name="hidream", title="HiDream I1 / E1 (full, dev, fast)", match=match_layout, infer_config=infer_config,
    meta_model=meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=HiDreamAdapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="comfy", replace_keys=(), block_inputs=block_inputs, tensor_plan=tensor_plan)
