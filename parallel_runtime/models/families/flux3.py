"""FLUX.3 image klein (Black Forest Labs): the base model of ComfyUI's FLUX.3 templates (int8 ConvRot and bf16 files).

FLUX.3 keeps FLUX.2's latent (128 channels at 1/16, a token per latent pixel), its SwiGLU and 4-axis RoPE, and
swaps the double-stream blocks for per-mode blocks: each token mode (the image, the reference images, the prompt)
first runs `depth` blocks of its own, attending only within itself, then the prompt and the image join for the
single blocks (diffusers' Flux3ModeTransformerBlock / Flux3SingleTransformerBlock: parallel attention and MLP off
one modulated input). Modulation is per mode: the image's from the timestep, the prompt's from timestep 0.

How it splits: the image's mode blocks lead the block list and attend image over image through the context's
`image_attention`, so Ulysses, Ring and PipeFusion split them as they split the image; the single blocks attend
over this rank's [prompt, image] rows through the joint `attention`. The prompt's mode blocks read no timestep
(timestep 0 is a constant), so they run in embed_text, once per job, on the whole prompt with local attention, and
each rank takes its rows (`embeds_whole_prompt`, as Lumina 2's context refiner). Tensor parallelism splits every
q/k/v and SwiGLU input column-wise and both output projections row-wise.

Positions follow BFL's recipe (diffusers' Flux3 pipeline): prompt token i at (0, 0, 0, i), image pixel (r, c) at
(0, r / 2, c / 2, 0) (the image RoPE scale 0.5); theta 10000; sampling a constant flow shift 6.93. Refused in one
sentence: the step-distilled (flow-map) files, whose `ref_time_in` reads the timestep each step jumps to, and
reference images (ReferenceMultiLatent), whose own mode blocks and per-token modulation are not split yet.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ModelFileError
from ...sampling import FLUX2_LATENT
from ...sampling.flow import FluxModelSampling
from ...strategies.attention import LocalAttention
from ...weights.keymap import Source, block_count, tensor_shapes
from ...weights.storage import compute_placement
from ..family import BlockKind, DiTFamily, Match, TwoBlockListConfig
from .flux import BFL_PREFIXES, TIME_FEATURES
from .flux2 import Flux2Adapter, _weight, sequence_ids

MODE_BLOCK = BlockKind("mode", ("image",))  # the image's own blocks: image over image
SINGLE_BLOCK = BlockKind("single", ("joint",))  # [prompt, image]; attention and MLP have their own projections
ALWAYS_OWNED = ("timestep_embedder.", "early_stream_modulations.", "single_stream_modulations.")
FIRST_STAGE = ("x_embedder.", "context_embedder.", "txt_mode_blocks.")
LAST_STAGE = ("norm_out.", "proj_out.")
BLOCK_LISTS = ("mode_blocks", "single_transformer_blocks")
ROPE_THETA = 10000
IMAGE_ROPE_SCALE = 0.5  # the image's row and column ids are halved (diffusers' Flux3 pipeline, image_rope_scale)
SAMPLING_SHIFT = 6.93  # the recipe's constant flow shift (diffusers' Flux3 pipeline)
MODES = ("image", "txt")  # the modulation heads this module reads (image_cond's belong to references)
_BASE_FILE = "flux3-image-klein-base-int8-convrot.safetensors (or flux3-image-klein-base-bf16.safetensors)"


@dataclass(frozen=True)
class Flux3Config(TwoBlockListConfig):
    # the pipeline's one list: the image's mode blocks, then single blocks (the prompt's mode blocks run once per
    # job, in embed_text, outside it)
    first_kind, second_kind = MODE_BLOCK, SINGLE_BLOCK
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int  # mode blocks per mode
    num_single_layers: int
    mlp_hidden: int  # SwiGLU width (3 x hidden as released)
    context_dim: int = 20480  # eight stacked Qwen3-VL hidden states
    in_channels: int = 128

    family = "flux3"
    title = "FLUX.3 image klein"
    variant = "base"
    pooled_dim = 0
    patch_size = 1
    latent_downscale = 16
    text_encoders = "Qwen3-VL 4B (CLIPLoader type flux3)"
    reference_refusal = ("FLUX.3's reference images (ReferenceMultiLatent) do not run on ParaDiT yet; remove them "
                         "for text-to-image, or load the file with UNETLoader for the edit")

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.hidden_size or self.head_dim % 8:
            raise ModelFileError(f"FLUX.3 config is inconsistent: {self.num_heads} heads x {self.head_dim} != hidden "
                                 f"size {self.hidden_size} (or a head not in four even RoPE axes); the file is "
                                 f"damaged, so re-download it.")

    @property
    def axes_dims_rope(self) -> tuple[int, int, int, int]:
        return (self.head_dim // 4,) * 4

    @property
    def latent_channels(self) -> int:
        return self.in_channels



    def diffusers_kwargs(self) -> dict:
        return dict(in_channels=self.in_channels, cond_in_channels=self.in_channels, num_layers=self.num_layers,
                    num_single_layers=self.num_single_layers, attention_head_dim=self.head_dim,
                    num_attention_heads=self.num_heads, joint_attention_dim=self.context_dim,
                    timestep_channels=TIME_FEATURES, mlp_ratio=self.mlp_hidden / self.hidden_size,
                    axes_dims_rope=self.axes_dims_rope, rope_theta=ROPE_THETA)


# -- checkpoint layout (BFL's names, which ComfyUI's files keep) ---------------------------------------------

_MODULATION = "early_stream_modulations.image.lin.weight"
# Keys of BFL's JointSingleSeq options no released FLUX.3 image file has, with what they are.
_LOOK_ALIKES = {"vector_in.in_layer.weight": "a pooled-vector input", "late_txt_mode_blocks.0.q_proj.weight":
                "late mode blocks", "single_blocks.0.gate_proj.weight": "gated outputs",
                "txt_mode_blocks.0.q_proj.bias": "attention biases", "emb_in.video.weight": "a video stream",
                "emb_in.audio.weight": "an audio stream"}


def match_layout(keys: list[str]) -> Match | None:
    """The image mode's modulation beside its input projection (what diffusers' single-file loader keys FLUX.3 on)."""
    key_set = set(keys)
    for prefix in BFL_PREFIXES:
        if {prefix + _MODULATION, prefix + "emb_in.image.weight", prefix + "txt_in.weight"} <= key_set:
            return Match("bfl", prefix)
    return None


def infer_config(reader, match: Match, name: str) -> Flux3Config:
    """Width and channels from the image input, head size from a q norm, the SwiGLU width from an MLP input (two
    halves), depths from the block lists."""
    p, keys = match.prefix, reader.keys()
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete FLUX.3 DiT")
    if p + "ref_time_in.in_layer.weight" in reader:
        raise ModelFileError(f"{name} is FLUX.3's step-distilled (flow-map) model, whose ref_time_in reads the "
                             f"timestep each step jumps to, which ParaDiT does not run yet; load {_BASE_FILE}, or this "
                             f"file with UNETLoader.")
    extra = next((what for key, what in _LOOK_ALIKES.items() if p + key in reader), None)
    if extra:
        raise ModelFileError(f"{name} has FLUX.3's mode blocks but also {extra}, which FLUX.3 image klein does not "
                             f"have: another model built on its blocks, which ParaDiT does not run; load {_BASE_FILE}.")
    hidden, in_channels = shape("emb_in.image.weight")
    head_dim, depth = shape("txt_mode_blocks.0.norm.query_norm.scale")[0], block_count(keys, p, "txt_mode_blocks", name)
    if head_dim <= 0 or hidden % head_dim:
        raise ModelFileError(f"{name}: width {hidden} is not a multiple of the head size {head_dim}; the file is "
                             f"damaged, so re-download it.")
    if block_count(keys, p, "content_mode_blocks.image", name) != depth:
        raise ModelFileError(f"{name} has {depth} prompt mode blocks but not as many image mode blocks; the file is "
                             f"incomplete, so re-download it.")
    return Flux3Config(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim, num_layers=depth,
                       num_single_layers=block_count(keys, p, "single_blocks", name),
                       mlp_hidden=shape("txt_mode_blocks.0.mlp_in.weight")[0] // 2,
                       context_dim=shape("txt_in.weight")[1], in_channels=in_channels)


_BLOCK_KEYS = (("attn.to_q", "q_proj"), ("attn.to_k", "k_proj"), ("attn.to_v", "v_proj"), ("attn.to_out.0", "attn_out"),
               ("ff.linear_in", "mlp_in"), ("ff.linear_out", "mlp_out"))


def source_map(config: Flux3Config, layout: str, prefix: str = "") -> dict[str, Source]:
    """Every parameter of Flux3DiT -> its Source in a BFL (ComfyUI) file: diffusers' single-file renames, the final
    modulation's [shift, scale] halves swapped to diffusers' [scale, shift]."""
    p, out = prefix, {}
    _weight(out, "x_embedder", p + "emb_in.image")
    _weight(out, "context_embedder", p + "txt_in")
    _weight(out, "timestep_embedder.linear_1", p + "time_in.in_layer")
    _weight(out, "timestep_embedder.linear_2", p + "time_in.out_layer")
    for kind in ("early_stream_modulations", "single_stream_modulations"):
        for mode in MODES:
            _weight(out, f"{kind}.{mode}.linear", f"{p}{kind}.{mode}.lin")
    lists = (("mode_blocks", "content_mode_blocks.image", config.num_layers),
             ("txt_mode_blocks", "txt_mode_blocks", config.num_layers),
             ("single_transformer_blocks", "single_blocks", config.num_single_layers))
    for dst, src, n in lists:
        for i in range(n):
            d, b = f"{dst}.{i}", f"{p}{src}.{i}"
            for ours, theirs in _BLOCK_KEYS:
                _weight(out, f"{d}.{ours}", f"{b}.{theirs}")
            out[f"{d}.attn.norm_q.weight"] = Source(f"{b}.norm.query_norm.scale")
            out[f"{d}.attn.norm_k.weight"] = Source(f"{b}.norm.key_norm.scale")
    _weight(out, "norm_out.linear", p + "final_layer.image.adaLN_modulation.1", transform="swap_halves")
    _weight(out, "proj_out", p + "final_layer.image.linear")
    return out


def checkpoint_shapes(config: Flux3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{BFL key: (shape, kind)} of a complete FLUX.3 image file, the reference stream's layers included."""
    H, M, D, C = config.hidden_size, config.mlp_hidden, config.head_dim, config.in_channels
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def weight(name, n_out, n_in, kind="weight"):
        out[f"{name}.weight"] = ((n_out, n_in), kind)

    for mode in ("image", "image_cond"):
        weight(f"emb_in.{mode}", H, C)
        weight(f"final_layer.{mode}.adaLN_modulation.1", 2 * H, H, "mod")
        weight(f"final_layer.{mode}.linear", C, H)
    weight("txt_in", H, config.context_dim)
    weight("time_in.in_layer", H, TIME_FEATURES)
    weight("time_in.out_layer", H, H)
    for kind in ("early_stream_modulations", "single_stream_modulations"):
        for mode in ("image", "image_cond", "txt"):
            weight(f"{kind}.{mode}.lin", 3 * H, H, "mod")
    blocks = [f"content_mode_blocks.{m}.{i}" for m in ("image", "image_cond") for i in range(config.num_layers)]
    blocks += [f"txt_mode_blocks.{i}" for i in range(config.num_layers)]
    blocks += [f"single_blocks.{i}" for i in range(config.num_single_layers)]
    for b in blocks:
        for proj in ("q_proj", "k_proj", "v_proj", "attn_out"):
            weight(f"{b}.{proj}", H, H)
        weight(f"{b}.mlp_in", 2 * M, H)
        weight(f"{b}.mlp_out", H, M)
        out[f"{b}.norm.query_norm.scale"] = ((D,), "norm")
        out[f"{b}.norm.key_norm.scale"] = ((D,), "norm")
    return out


class Flux3DiT(nn.Module):
    """diffusers' Flux3Transformer2DModel pieces for the image and the prompt, under names whose block lists
    PipeFusion can reach (diffusers keeps the image's mode blocks in a ModuleDict beside the references')."""

    def __init__(self, config: Flux3Config):
        super().__init__()
        from diffusers.models.embeddings import TimestepEmbedding, Timesteps
        from diffusers.models.transformers import transformer_flux3 as f3

        H, kw = config.hidden_size, dict(num_attention_heads=config.num_heads, attention_head_dim=config.head_dim,
                                         mlp_ratio=config.mlp_hidden / config.hidden_size)
        self.pos_embed = f3.Flux3PosEmbed(theta=ROPE_THETA, axes_dim=list(config.axes_dims_rope))
        self.time_proj = Timesteps(num_channels=TIME_FEATURES, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.timestep_embedder = TimestepEmbedding(TIME_FEATURES, H, sample_proj_bias=False)
        self.early_stream_modulations = nn.ModuleDict({m: f3.Flux3Modulation(H) for m in MODES})
        self.single_stream_modulations = nn.ModuleDict({m: f3.Flux3Modulation(H) for m in MODES})
        self.x_embedder = nn.Linear(config.in_channels, H, bias=False)
        self.context_embedder = nn.Linear(config.context_dim, H, bias=False)
        self.mode_blocks = nn.ModuleList(f3.Flux3ModeTransformerBlock(H, **kw) for _ in range(config.num_layers))
        self.txt_mode_blocks = nn.ModuleList(f3.Flux3ModeTransformerBlock(H, **kw) for _ in range(config.num_layers))
        self.single_transformer_blocks = nn.ModuleList(f3.Flux3SingleTransformerBlock(H, **kw)
                                                       for _ in range(config.num_single_layers))
        self.norm_out = f3.Flux3AdaLayerNorm(H)
        self.proj_out = nn.Linear(H, config.in_channels, bias=False)


def _meta_model(config: Flux3Config) -> Flux3DiT:
    with torch.device("meta"):
        return Flux3DiT(config)


def tensor_plan(config: Flux3Config) -> dict:
    """q/k/v and the SwiGLU input (its gate and value halves) column-wise, both output projections row-wise, in the
    image's mode blocks and the single blocks (the prompt's mode blocks, run once per job, stay whole)."""
    plan = {}
    for blocks in BLOCK_LISTS:
        plan.update({f"{blocks}.*.attn.to_q": "colwise", f"{blocks}.*.attn.to_k": "colwise",
                     f"{blocks}.*.attn.to_v": "colwise", f"{blocks}.*.attn.to_out.0": "rowwise",
                     f"{blocks}.*.ff.linear_in": ("colwise", (1, 1)), f"{blocks}.*.ff.linear_out": "rowwise"})
    return plan


# -- the strategies' view -----------------------------------------------------------------------------------

class ParallelFlux3AttnProcessor:
    """Flux3AttnProcessor's math (q/k RMS norms and RoPE in float32, one cast back) with the attention handed to
    the job's strategy, looked up per call (the runner swaps it per job): the context's `image_attention` for the
    image's mode blocks, its joint `attention` for the single blocks, or a fixed one (the prompt's mode blocks)."""

    def __init__(self, layer: int, context=None, image_only: bool = False, attend=None):
        self.layer, self.context, self.image_only, self.fixed = layer, context, image_only, attend

    def attend(self, q, k, v, layer):
        if self.fixed is not None:
            return self.fixed(q, k, v, layer)
        return (self.context.image_attention if self.image_only else self.context.attention)(q, k, v, layer)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        q, k, v = (proj(hidden_states).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q = apply_rotary_emb(attn.norm_q(q.float()), image_rotary_emb, sequence_dim=1).to(v.dtype)
        k = apply_rotary_emb(attn.norm_k(k.float()), image_rotary_emb, sequence_dim=1).to(v.dtype)
        out = self.attend(q, k, v, self.layer).flatten(2, 3).to(v.dtype)
        return attn.to_out[0](out)


def sequence_ids_flux3(text_len: int, h: int, w: int) -> torch.Tensor:
    """[prompt, image] position ids: FLUX.2's layout with the image's rows and columns halved."""
    ids = sequence_ids(text_len, [(h, w, 0, 0, 0)])
    ids[text_len:, 1:3] *= IMAGE_ROPE_SCALE
    return ids


def block_inputs(config: Flux3Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, text, (temb, image mode, image single and prompt single modulations), RoPE) of a block call."""
    from diffusers.models.transformers.transformer_flux3 import Flux3PosEmbed

    h, cols = config.hidden_size, max(1, math.isqrt(image))
    ids = sequence_ids_flux3(text, -(-image // cols), cols)[:text + image]
    rope = Flux3PosEmbed(ROPE_THETA, list(config.axes_dims_rope))(ids)
    temb = (torch.randn(1, 1, h, generator=generator),) + tuple(
        torch.randn(1, 1, 3 * h, generator=generator) * 0.3 for _ in range(3))
    return torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator), temb, rope


class Flux3Adapter:
    patch = 1
    latent_format = FLUX2_LATENT  # FLUX.2's VAE and 128-channel latent (EmptyFlux2LatentImage)
    default_guidance = 0.0  # no guidance input
    joint_text = True  # the single blocks attend over [prompt, image]
    embeds_whole_prompt = True  # embed_text runs the prompt's mode blocks over the whole prompt; a rank takes its rows
    skip: frozenset = frozenset()  # blocks whose output is their input this job (SkipLayerGuidance), set per job
    pack, unpack = staticmethod(Flux2Adapter.pack), staticmethod(Flux2Adapter.unpack)

    def __init__(self, config: Flux3Config, model: Flux3DiT, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.latent_channels, self.variant = config.latent_channels, config.variant
        self._blocks = list(model.mode_blocks) + list(model.single_transformer_blocks)
        for i in (i for chunk in chunks for i in chunk):
            self._blocks[i].attn.set_processor(ParallelFlux3AttnProcessor(i, context, i < config.num_layers))
        local = LocalAttention()  # the prompt's mode blocks attend over the whole prompt, where it is embedded
        for j, block in enumerate(model.txt_mode_blocks):
            block.attn.set_processor(ParallelFlux3AttnProcessor(config.num_blocks + j, attend=local))
        self.dtype, self.device = compute_placement(model.timestep_embedder)

    @functools.cached_property
    def model_sampling(self):
        return FluxModelSampling(SAMPLING_SHIFT, 1.0, kind="discrete_flow")  # sigma in [0, 1]; x1000 in the embedder

    def rope(self, text_len: int, h: int, w: int, references=(), method=None):
        return self.model.pos_embed(sequence_ids_flux3(text_len, h, w).to(self.device))

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        return self.model.x_embedder(tokens.to(self.device, self.dtype))

    def _embed_time(self, t: torch.Tensor) -> torch.Tensor:
        """[B, 1, width]: the timestep MLP of t x 1000, its sinusoid cast to the compute dtype."""
        return self.model.timestep_embedder(self.model.time_proj(t * 1000).to(self.dtype))[:, None]

    def _prompt_temb(self) -> torch.Tensor:
        """The prompt's embedding, silu-activated: the timestep MLP at t = 0 (recomputed, not cached: a LoRA may patch
        the MLP between jobs)."""
        return nn.functional.silu(self._embed_time(torch.zeros(1, device=self.device)))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        """context_embedder, then the prompt's mode blocks: the whole prompt over itself (ids (0, 0, 0, i)), with
        plain local attention, once per job."""
        text = self.model.context_embedder(cond.to(self.device, self.dtype))
        rope = self.model.pos_embed(sequence_ids(text.shape[1], []).to(self.device))
        mod = self.model.early_stream_modulations["txt"](self._prompt_temb())
        for block in self.model.txt_mode_blocks:
            text = block(text, mod, rope)
        return text

    def timestep_embedding(self, t: torch.Tensor, pooled, guidance, hw=None) -> tuple:
        """(image temb, its mode-block and single-block modulations, the prompt's single-block modulation)."""
        temb = self._embed_time(t.to(self.device, torch.float32).flatten())
        act = nn.functional.silu(temb)
        return (temb, self.model.early_stream_modulations["image"](act),
                self.model.single_stream_modulations["image"](act),
                self.model.single_stream_modulations["txt"](self._prompt_temb()))

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb: tuple, rope, chunk: int = 0) -> tuple:
        """The image's mode blocks over this rank's image rows (their RoPE rows after the prompt's), then the single
        blocks over its [prompt, image] rows."""
        _, image_mod, single_mod, text_mod = temb
        n_text = text.shape[1]
        for i in (i for i in self.chunks[chunk] if i not in self.skip):
            if i < self.config.num_layers:
                image = self._blocks[i](image, image_mod, tuple(table[n_text:] for table in rope))
            else:
                text, image = self._blocks[i](hidden_states=image, encoder_hidden_states=text, temb_mod=single_mod,
                                              temb_mod_context=text_mod, image_rotary_emb=rope)
        return image, text

    head = Flux2Adapter.head  # norm_out on the image's temb, proj_out: FLUX.2's


FLUX3 = DiTFamily(
    name="flux3", title="FLUX.3 image klein", match=match_layout, infer_config=infer_config, meta_model=_meta_model,
    source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=Flux3Adapter, block_lists=BLOCK_LISTS,
    always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE, comfy_layout="bfl",
    block_inputs=block_inputs, replace_keys=(), tensor_plan=tensor_plan)
