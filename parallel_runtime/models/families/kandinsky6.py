"""Kandinsky 6 (Kandinsky Lab): a video-and-audio DiT (Pro 4096-wide x 60, Lite 1792-wide x 32).

Two token streams run through every fused block side by side. Video tokens (2x2 patches of the 16-channel
HunyuanVideo latent, with 16 condition channels and a mask beside them: zeros in text-to-video-and-audio; 3-D RoPE
over frame, row, column, the rows and columns at half rate) and audio tokens (one per frame of the 40-channel audio
latent; 1-D RoPE at 0.144 rate) each get self-attention and cross-attention to their own refinement of the prompt;
then video attends the audio (va: queries video, keys the audio's pre-cross-attention rows) and audio the video
(av), both with their streams' RoPE on each side, then an MLP each. Modulation is per sample: the timestep embedding
plus the CLIP-L pooled vector's projection, one per stream. The prompt is refined per stream by a few text blocks
(self-attention modulated by that embedding), so it depends on the timestep and is recomputed every call.

Under sequence parallelism both streams are split (strategies/two_stream_call.py): each stream's self-attention is
Ulysses / Ring over its own shard lengths, va / av take local queries and the other stream's keys through the same
strategies (attention/streams.py; slots "video", "audio", "a2v" = va, "v2a" = av); the text blocks and prompt
cross-attention are local (every rank holds the prompt). Tensor parallelism splits the heads of all six attentions
and both MLPs (`tensor_plan`); PipeFusion's patches are runs of video tokens, the audio riding with the first
(strategies/two_stream_pipefusion.py), every stage holding the small time, pooled and text modules.

The module tree is diffusers' Kandinsky6Transformer3DModel; ComfyUI's layout (comfy/ldm/kandinsky6, the released
files) maps onto it by the renames of ComfyUI's own detection (`original_name`). Both programs compute the same
function: they differ in where fp32 casts fall (ComfyUI also computes time embeddings and modulation in fp32 from
bf16 weights) and in ComfyUI's float64 RoPE frequencies, ~3e-7 apart in fp32. ComfyUI's call is
Kandinsky6NativeAVDiT's: x = [video [B, 16, T, H, W], audio [B, frames, 40]], timestep = sigma x 1000, context the
Qwen2.5-VL rows (both streams' prompt), y the pooled CLIP-L vector. Its image-to-video-and-audio reference tail
(Kandinsky6ImageToVideoAudio's image), MagCache and the distilled PiFlow files are refused in one sentence.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ...errors import ModelFileError
from ...sampling.flow import FluxModelSampling, VideoLatentFormat
from ...strategies.attention import LocalAttention
from ...strategies.tensor_calls import answered_by, gathered_ahead
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..family import DiTFamily, JointAttentionConfig, Match
from ..shapes import plain_kind, shapes_of_model
from .flux import BFL_PREFIXES, DIFFUSERS_PREFIXES
from .ltx2 import AV_BLOCK, LTX2Config

BLOCK_LISTS = ("visual_transformer_blocks",)
_STREAM_MODULES = ("time_embeddings.", "pooled_text_embeddings.", "text_embeddings.", "text_transformer_blocks.")
# Every stage modulates its blocks and cross-attends the refined prompt (RoPE is computed, not stored).
ALWAYS_OWNED = tuple(s + m for s in ("video_", "audio_") for m in _STREAM_MODULES)
FIRST_STAGE = ("visual_embeddings.", "visual_token_type_embeddings.", "audio_embeddings.")
LAST_STAGE = ("out_layer.", "audio_out_layer.")
PATCH = (1, 2, 2)  # every released file (ComfyUI's contract fixes it)
AUDIO_FREQS_SCALING = 0.144  # the audio RoPE's rate (ComfyUI's contract; diffusers' config of the releases)
ROPE_SCALE = (1.0, 2.0, 2.0)  # frame, row, column positions divided by these
AUDIO_PER_VIDEO_TOKEN = 1 / 231  # 121 frames at 24 fps: 217 audio frames beside 31 x 30 x 54 video tokens


@dataclass(frozen=True)
class Kandinsky6Config(JointAttentionConfig):
    hidden_size: int  # video width (model_dim)
    audio_hidden_size: int  # model_dim_a
    num_layers: int  # fused blocks
    head_dim: int = 128  # both streams' (sum of the RoPE axes)
    ff_dim: int = 16384
    audio_ff_dim: int = 7168
    time_dim: int = 1024
    audio_time_dim: int = 1024
    text_blocks: int = 4  # per stream
    latent_dim: int = 16  # the video latent's channels (in_visual_dim); the model reads 2 x 16 + 1
    audio_dim: int = 40
    context_dim: int = 3584  # Qwen2.5-VL rows
    pooled_dim: int = 768  # CLIP-L
    token_types: int = 0  # image-to-video files: 2 (generated frames, reference tail)
    cross_gates: bool = True

    family = "kandinsky6"
    video = True
    patch_size = 2
    latent_downscale = 8

    def __post_init__(self):
        if self.hidden_size % self.head_dim or self.audio_hidden_size % self.head_dim or self.head_dim % 8:
            raise ModelFileError(f"Kandinsky 6 config is inconsistent ({self.hidden_size} / {self.audio_hidden_size} "
                                 f"wide over heads of {self.head_dim}); the file is damaged, so re-download it.")

    num_blocks = property(lambda self: self.num_layers)
    num_heads = property(lambda self: self.hidden_size // self.head_dim)
    audio_heads = property(lambda self: self.audio_hidden_size // self.head_dim)
    mlp_hidden = property(lambda self: self.ff_dim)
    latent_channels = property(lambda self: self.latent_dim)
    # A token's output width (the video head's packed 2x2 patch; the audio's frame): what PipeFusion gathers.
    in_channels = property(lambda self: self.latent_dim * math.prod(PATCH))
    audio_in_channels = property(lambda self: self.audio_dim)
    variant = property(lambda self: "kandinsky6-i2va" if self.token_types else "kandinsky6")
    block_kinds = property(lambda self: (AV_BLOCK,) * self.num_layers)
    attention_layers = property(lambda self: ((False, False),) * self.num_layers)  # video self, va + av (LTX-2's)

    @property
    def axes_dims(self) -> tuple[int, int, int]:
        """RoPE widths of frame, row, column: (32, 48, 48) of 128 (Pro), (16, 24, 24) of 64 (Lite)."""
        return self.head_dim // 4, 3 * self.head_dim // 8, 3 * self.head_dim // 8

    @property
    def title(self) -> str:
        return f"Kandinsky 6 {self.hidden_size}-wide x {self.num_layers}"

    def audio_rows(self, video_tokens: int) -> int:
        return max(1, round(video_tokens * AUDIO_PER_VIDEO_TOKEN))

    @property
    def not_sampled_yet(self) -> str:
        return (f"{self.title} denoises its video and its sound together, but this job carries no audio latent; "
                f"give Parallel Sampler Kandinsky6EmptyLatent's joint latent.")

    def model_call_problem(self, job) -> str | None:
        """What in a model call the runtime cannot run, in one sentence without its full stop, or None."""
        rows, audio = job.latent.shape[0], job.audio
        if audio.ndim != 3 or (audio.shape[0], audio.shape[2]) != (rows, self.audio_dim):
            return (f"the audio latent has shape {tuple(audio.shape)} but {self.title} needs [{rows}, frames, "
                    f"{self.audio_dim}] beside its video latent; use Kandinsky6EmptyLatent's joint latent")
        at, t = job.audio_timestep, job.timestep
        if at is not None and (t is None or not torch.equal(at.flatten(), t.flatten())):
            return (f"{self.title} reads one timestep for both streams, but this call gives the audio its own; "
                    f"remove the node that shifts the audio's sigmas")
        return self.strategy_problem(job.strategy, "the parallel model call")

    def strategy_problem(self, s, runner: str) -> str | None:
        """LTX-2's limits of the two-stream call (displaced patch; PipeFusion beside Ulysses, Ring or tensor
        parallelism), and Ulysses and tensor degrees that divide the audio's heads too (half the video's)."""
        for degree, name in ((s.ulysses_degree, "ulysses_degree"), (s.tensor_degree, "tensor_degree")):
            if self.audio_heads % degree:
                return (f"{runner} splits {self.title}'s {self.audio_heads} audio heads by {name}, which must divide "
                        f"them; set {name} to a divisor of {self.audio_heads}")
        return LTX2Config.strategy_problem(self, s, runner)

    def diffusers_kwargs(self) -> dict:
        return dict(in_visual_dim=self.latent_dim, out_visual_dim=self.latent_dim, in_text_dim=self.context_dim,
                    in_text_dim2=self.pooled_dim, time_dim=self.time_dim, patch_size=PATCH,
                    model_dim=self.hidden_size, ff_dim=self.ff_dim, num_text_blocks=self.text_blocks,
                    num_visual_blocks=self.num_layers, axes_dims=self.axes_dims, visual_cond=True,
                    in_audio_dim=self.audio_dim, out_audio_dim=self.audio_dim, model_dim_a=self.audio_hidden_size,
                    time_dim_a=self.audio_time_dim, ff_dim_a=self.audio_ff_dim, axes_dims_a=self.axes_dims,
                    audio_freqs_scaling=AUDIO_FREQS_SCALING, scale_factor=ROPE_SCALE, text_token_padding=True,
                    ca_rope=True, cross_gates=self.cross_gates, fix_modulation=True,
                    visual_token_type_num_embeddings=self.token_types)


# -- checkpoint layout --------------------------------------------------------------------------------

# diffusers' names -> ComfyUI's (the inverse of ComfyUI's kandinsky6/detection.py normalization).
_TOP_LEVEL = (("visual_transformer_blocks.", "visual_blocks."), ("audio_out_layer.", "audio_outLayer."))
_INNER = ((".timestep_embedder.linear_1.", ".in_layer."), (".timestep_embedder.linear_2.", ".out_layer."),
          (".video_dec_block.", ".videoT."), (".audio_dec_block.", ".audioT."),
          (".feed_forward.net.0.proj.", ".feed_forward.in_layer."), (".feed_forward.net.2.", ".feed_forward.out_layer."),
          (".attn.", ".self_attention."))
_ORIGINAL_KEYS = ("audio_embeddings.in_layer.weight", "visual_blocks.0.videoT.self_attention.to_query.weight",
                  "visual_blocks.0.va_modulation.out_layer.weight")
_DIFFUSERS_KEYS = ("audio_embeddings.in_layer.weight",
                   "visual_transformer_blocks.0.video_dec_block.self_attention.to_query.weight")


def original_name(name: str) -> str:
    """A diffusers parameter's name in ComfyUI's (the released files') layout."""
    for ours, theirs in _TOP_LEVEL:
        if name.startswith(ours):
            name = theirs + name[len(ours):]
    for ours, theirs in _INNER:
        name = name.replace(ours, theirs)
    return name


def match_layout(keys: list[str]) -> Match | None:
    key_set = set(keys)
    for layout, prefixes, wanted in (("original", BFL_PREFIXES, _ORIGINAL_KEYS),
                                     ("diffusers", DIFFUSERS_PREFIXES, _DIFFUSERS_KEYS)):
        for prefix in prefixes:
            if all(prefix + k in key_set for k in wanted):
                return Match(layout, prefix)
    return None


def infer_config(reader, match: Match, name: str) -> Kandinsky6Config:
    p, original = match.prefix, match.layout != "diffusers"
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete Kandinsky 6 DiT")

    def key(diffusers_name: str) -> str:
        return original_name(diffusers_name) if original else diffusers_name

    block = "visual_transformer_blocks.0."
    visual_in, visual_out = shape(key("visual_embeddings.in_layer.weight")), shape(key("out_layer.out_layer.weight"))
    audio_in, volume = shape(key("audio_embeddings.in_layer.weight")), math.prod(PATCH)
    latent = (visual_in[1] // volume - 1) // 2
    if visual_out[0] != latent * volume:
        raise ModelFileError(f"{name} is a distilled Kandinsky 6 file (PiFlow, {visual_out[0] // (latent * volume)} "
                             f"DX grids), which only Kandinsky6PiFlowGuider's sampler integrates and ParaDiT does not "
                             f"run; load it with UNETLoader, or choose an undistilled file.")
    va = shape(key(block + "va_modulation.out_layer.weight"))[0]
    types = key("visual_token_type_embeddings.weight")
    return Kandinsky6Config(
        hidden_size=visual_in[0], audio_hidden_size=audio_in[0],
        num_layers=block_count(reader.keys(), p, key("visual_transformer_blocks.").rstrip("."), name),
        head_dim=shape(key(block + "video_dec_block.self_attention.query_norm.weight"))[0],
        ff_dim=shape(key(block + "video_dec_block.feed_forward.net.0.proj.weight"))[0],
        audio_ff_dim=shape(key(block + "audio_dec_block.feed_forward.net.0.proj.weight"))[0],
        time_dim=shape(key("video_time_embeddings.timestep_embedder.linear_2.weight"))[0],
        audio_time_dim=shape(key("audio_time_embeddings.timestep_embedder.linear_2.weight"))[0],
        text_blocks=block_count(reader.keys(), p, key("video_text_transformer_blocks"), name),
        latent_dim=latent, audio_dim=audio_in[1], context_dim=shape(key("video_text_embeddings.in_layer.weight"))[1],
        pooled_dim=shape(key("video_pooled_text_embeddings.in_layer.weight"))[1],
        token_types=reader.shape(p + types)[0] if p + types in reader else 0,
        cross_gates=va == 2 * visual_in[0] + audio_in[0])


def _meta_model(config: Kandinsky6Config):
    from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6Transformer3DModel

    with torch.device("meta"):
        return Kandinsky6Transformer3DModel(**config.diffusers_kwargs())


def source_map(config: Kandinsky6Config, layout: str, prefix: str = "") -> dict:
    names = _meta_model(config).state_dict()
    if layout == "diffusers":
        return same_names(names, prefix)
    return {n: Source(prefix + original_name(n)) for n in names}


def checkpoint_shapes(config: Kandinsky6Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of a complete Kandinsky 6 DiT, for random test files: Kandinsky 5's kinds, and
    the token-type embedding a table."""
    return shapes_of_model(_meta_model(config).state_dict(),
                           lambda name, t: "table" if "token_type" in name else parameter_kind(name, t),
                           key=original_name)


def parameter_kind(name: str, tensor: torch.Tensor) -> str:
    """Kandinsky's modulation projections at half a weight's scale (tiny's "mod"), the rest as most parameters."""
    return "mod" if "modulation.out_layer.weight" in name else plain_kind(name, tensor)


# -- the strategies' view -----------------------------------------------------------------------------

def _rope(angles: torch.Tensor) -> torch.Tensor:
    """[rows, d/2] angles -> diffusers' rotation matrices [rows, 1, d/2, 2, 2]."""
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2)).unsqueeze(-4)


def _freqs(dim: int) -> torch.Tensor:
    return torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))


class Rope(NamedTuple):
    video: torch.Tensor  # [rows, 1, d/2, 2, 2] of the video rows held
    audio: torch.Tensor


@dataclass
class Conditioning:
    """A pass's per-sample embeddings (timestep + pooled prompt, per stream) and each stream's refined prompt."""

    video_time: torch.Tensor
    audio_time: torch.Tensor
    video_prompt: torch.Tensor
    audio_prompt: torch.Tensor

    def to(self, device, dtype=None) -> "Conditioning":
        return Conditioning(*(t.to(device, dtype) for t in (self.video_time, self.audio_time, self.video_prompt,
                                                             self.audio_prompt)))


@dataclass
class Pass:
    """One pass's timesteps [B] (model units); its Conditioning, made once by the pass's first `run_blocks` (the
    prompt's text blocks read the timestep) and read by the rest of the pass and its head."""

    video_t: torch.Tensor
    audio_t: torch.Tensor
    conditioning: Conditioning | None = field(default=None)

    def to(self, device, dtype=None) -> "Pass":  # the cost model's probe moves its random pass onto its device
        made = self.conditioning and self.conditioning.to(device, dtype)
        return Pass(self.video_t.to(device), self.audio_t.to(device), made)


# Which strategy slot each attention of a fused block uses (AttentionContext.streams; "video" is the joint slot).
_LAYERS = (("video_dec_block.self_attention", "video"), ("audio_dec_block.self_attention", "audio"),
           ("video_dec_block.cross_attention", "prompt"), ("audio_dec_block.cross_attention", "prompt"),
           ("va_cross_attention", "a2v"), ("av_cross_attention", "v2a"))


class StreamAttnProcessor:
    """diffusers' Kandinsky6AttnProcessor with the kernel replaced by the job's strategy for the layer's streams
    (queries' rows local, keys' rows as the strategy gathers them); heads counted from the projection, so a tensor
    rank's share of them works unchanged."""

    def __init__(self, layer: int, context, stream: str):
        self.layer, self.context, self.stream = layer, context, stream

    def attend(self):
        if self.stream == "video":
            return self.context.attention
        return LocalAttention() if self.stream == "prompt" else self.context.streams.get(self.stream, LocalAttention())

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, rotary_emb_kv=None,
                 attn_mask=None):
        from diffusers.models.transformers.transformer_kandinsky6 import apply_rotary

        if attn_mask is not None:
            raise ValueError("Kandinsky 6's prompt masks are not carried by ParaDiT's strategies")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        head_dim = attn.query_norm.weight.shape[0]
        q, k, v = (proj(x).unflatten(-1, (-1, head_dim)) for proj, x in
                   ((attn.to_query, hidden_states), (attn.to_key, context), (attn.to_value, context)))
        q, k = attn.query_norm(q), attn.key_norm(k)
        if rotary_emb is not None and q.shape[1]:  # nothing to rotate in a stream this pass does not carry
            q = apply_rotary(q, rotary_emb)
        if rotary_emb_kv is not None and k.shape[1]:
            k = apply_rotary(k, rotary_emb_kv)
        return attn.out_layer(self.attend()(q, k, v, self.layer).to(q.dtype).flatten(-2))


class Kandinsky6Adapter:
    patch = 2
    joint_text = False
    two_streams = True  # video and audio tokens, each split over the sequence-parallel ranks
    default_guidance = 0.0
    # ComfyUI's supported_models.Kandinsky6: ModelSamplingDiscreteFlow (shift 5, timestep = sigma x 1000) with
    # CONST; latent_formats.HunyuanVideo for the video (scale 0.476986).
    model_sampling = FluxModelSampling(5.0, 1000.0, kind="discrete_flow")
    latent_format = VideoLatentFormat("hunyuan_video", 0.476986, 0.0)
    skip: frozenset = frozenset()

    def __init__(self, config: Kandinsky6Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.dtype, self.device = compute_placement(model.video_time_embeddings)
        for i in (i for chunk in chunks for i in chunk):  # a stage's own blocks (the others are Identity there)
            for path, stream in _LAYERS:
                model.visual_transformer_blocks[i].get_submodule(path).set_processor(
                    StreamAttnProcessor(i, context, stream))
        for stream in ("video", "audio"):
            for block in getattr(model, f"{stream}_text_transformer_blocks"):
                block.attn.set_processor(StreamAttnProcessor(0, context, "prompt"))

    variant = property(lambda self: self.config.variant)

    # -- token layout ----------------------------------------------------------------------------------

    @staticmethod
    def pack(latent: torch.Tensor) -> torch.Tensor:
        """Video [B, C, T, H, W] -> [B, T H/2 W/2, 4 C]: 2x2 patches, features (row, column, channel) as the
        visual embedding reads them."""
        b, c, t, h, w = latent.shape
        x = latent.reshape(b, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 4, 6, 1)
        return x.reshape(b, t * (h // 2) * (w // 2), 4 * c)

    @staticmethod
    def unpack(tokens: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        """The head's tokens (features (channel, row, column), as its out layer un-patchifies) -> [B, C, T, H, W]."""
        b = tokens.shape[0]
        x = tokens.reshape(b, t, h // 2, w // 2, -1, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(b, -1, t, h, w)

    @staticmethod
    def pack_audio(latent: torch.Tensor) -> torch.Tensor:
        return latent  # [B, frames, 40]: one token per frame already

    @staticmethod
    def unpack_audio(tokens: torch.Tensor, frames: int) -> torch.Tensor:
        return tokens

    def rope(self, thw: tuple[int, int, int], video_rows: torch.Tensor, audio_frames: int, audio_rows: torch.Tensor,
             fps: float = 24.0, batch: int = 1) -> Rope:
        """RoPE of the video rows (indices into the T x H/2 x W/2 token grid) and the audio rows (frames): per
        token, so any shard's rows are computed alone, as diffusers' Kandinsky6RoPE3D / RoPE1D compute them."""
        t, h, w = thw[0], thw[1] // 2, thw[2] // 2
        rows = video_rows.long()
        position = (rows // (h * w), rows // w % h, rows % w)
        angles = torch.cat([torch.outer(p.float(), _freqs(d)) / s
                            for p, d, s in zip(position, self.config.axes_dims, ROPE_SCALE)], dim=-1)
        audio = torch.outer(audio_rows.float(), _freqs(self.config.head_dim) * AUDIO_FREQS_SCALING)
        return Rope(_rope(angles).to(self.device), _rope(audio).to(self.device))

    # -- a stock sampler's model call (strategies/two_stream_call.py) ----------------------------------

    def call_timesteps(self, timestep: torch.Tensor, audio_timestep: torch.Tensor | None, thw: tuple,
                       audio_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token timesteps [rows, video tokens], [rows, audio frames]: the call's one per row (already
        sigma x 1000, as model_sampling.timestep makes it) on every token of both streams."""
        t = timestep.float().reshape(timestep.shape[0], -1)[:, :1]
        return t.expand(-1, thw[0] * (thw[1] // 2) * (thw[2] // 2)).contiguous(), t.expand(-1, audio_frames).contiguous()

    def split_prompt(self, context: torch.Tensor, pooled: torch.Tensor | None = None) -> tuple:
        """Both streams refine the same Qwen2.5-VL rows; the pooled CLIP-L vector rides as the second part."""
        return context, pooled

    # -- embeddings and modulation ---------------------------------------------------------------------

    def embed_video(self, tokens: torch.Tensor) -> torch.Tensor:
        """The visual embedding of the rows: each patch's noisy channels beside zero condition channels and a zero
        mask (text-to-video-and-audio; Kandinsky6NativeAVDiT's visual_cond)."""
        x = tokens.to(self.device, self.dtype).unflatten(-1, (math.prod(PATCH), -1))
        x = torch.cat([x, torch.zeros_like(x), x.new_zeros(*x.shape[:-1], 1)], dim=-1).flatten(-2)
        return self.model.visual_embeddings.in_layer(x)

    def embed_audio(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.audio_embeddings(tokens.to(self.device, self.dtype))

    def embed_prompt(self, context: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return context.to(self.device, self.dtype), pooled.to(self.device, self.dtype)

    def modulation(self, video_t: torch.Tensor, audio_t: torch.Tensor, sigma: torch.Tensor, audio_sigma: torch.Tensor,
                   peaks: tuple | None = None) -> Pass:
        """A pass over some rows: the model reads one timestep per sample and stream (`sigma`, `audio_sigma`)."""
        return Pass(sigma.to(self.device), audio_sigma.to(self.device))

    def conditioning(self, prompt: tuple, mod: Pass) -> Conditioning:
        """diffusers' forward steps 1-2: per-stream time embedding + pooled projection, and the text blocks."""
        if mod.conditioning is None:
            m, (context, pooled) = self.model, prompt
            streams = {stream: (getattr(m, f"{stream}_time_embeddings")(t.flatten())
                                + getattr(m, f"{stream}_pooled_text_embeddings")(pooled))
                       for stream, t in (("video", mod.video_t), ("audio", mod.audio_t))}
            blocks = {stream: list(getattr(m, f"{stream}_text_transformer_blocks")) for stream in streams}
            ahead = gathered_ahead(m, [_modulation_call(b.text_modulation, streams[stream])
                                       for stream in streams for b in blocks[stream]])
            pos = torch.arange(context.shape[1], dtype=torch.float32)
            rope = _rope(torch.outer(pos, _freqs(self.config.head_dim))).to(self.device)
            made = []
            with answered_by(ahead):
                for stream, temb in streams.items():
                    text = getattr(m, f"{stream}_text_embeddings")(context)
                    for block in blocks[stream]:
                        text = block(text, temb, rope)
                    made.append((temb, text))
            mod.conditioning = Conditioning(made[0][0], made[1][0], made[0][1], made[1][1])
        return mod.conditioning

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, video: torch.Tensor, audio: torch.Tensor, prompt: tuple, mod: Pass, rope: Rope,
                   chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' fused blocks over this rank's rows of both streams; attention through the strategies."""
        c = self.conditioning(prompt, mod)
        blocks = [self.model.visual_transformer_blocks[i] for i in self.chunks[chunk] if i not in self.skip]
        # Under tensor parallelism each modulation's share is gathered: all of these blocks' at once, ahead.
        ahead = gathered_ahead(self.model, [call for b in blocks for call in _block_modulations(b, c)])
        with answered_by(ahead):
            for block in blocks:
                video, audio = block(video, audio, c.video_prompt, c.audio_prompt, (c.video_time, c.audio_time),
                                     rope.video, rope.audio)
        return video, audio

    def head(self, video: torch.Tensor, audio: torch.Tensor, mod: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """Both output layers over the rows held: float32 velocities (video as packed patches)."""
        from diffusers.models.transformers.transformer_kandinsky6 import apply_scale_shift

        m, c = self.model, mod.conditioning
        shift, scale = m.out_layer.modulation(c.video_time).chunk(2, dim=-1)
        x = apply_scale_shift(m.out_layer.norm(video.float()), video, scale, shift)
        return m.out_layer.out_layer(x).float(), m.audio_out_layer(audio, c.audio_time).float()

    def forward_rows(self, video_tokens, audio_tokens, context, pooled, video_t, audio_t, sigma, audio_sigma,
                     rope: Rope, peaks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One model call over the rows a rank holds: what a sequence-parallel rank runs, at one rank the model."""
        mod = self.modulation(video_t, audio_t, sigma, audio_sigma, peaks)
        video, audio = self.run_blocks(self.embed_video(video_tokens), self.embed_audio(audio_tokens),
                                       self.embed_prompt(context, pooled), mod, rope)
        return self.head(video, audio, mod)


def _modulation_call(modulation: torch.nn.Module, t: torch.Tensor) -> tuple:
    """(a Kandinsky6Modulation, its gathered out_layer, the layer's input) as the module's forward makes it."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    return modulation, modulation.out_layer, modulation.activation(t.to(get_parameter_dtype(modulation.out_layer)))


def _block_modulations(block: torch.nn.Module, c: Conditioning) -> list[tuple]:
    """A fused block's four modulations with the times its forward hands them (fix_modulation swaps the cross
    ones')."""
    va, av = (c.video_time, c.audio_time) if block.fix_modulation else (c.audio_time, c.video_time)
    return [_modulation_call(block.video_dec_block.visual_modulation, c.video_time),
            _modulation_call(block.audio_dec_block.visual_modulation, c.audio_time),
            _modulation_call(block.va_modulation, va), _modulation_call(block.av_modulation, av)]


def tensor_plan(config: Kandinsky6Config) -> dict:
    """Every fused block's six attentions split by heads (q/k/v column-wise, out-projection row-wise; the q/k norms
    are per head) and both MLPs by units; both streams' text blocks alike (a few all-reduces of the prompt's rows
    per call); every modulation keeps 1/N of its outputs and all-gathers them (a few KB each). The embedders and
    heads stay whole on every rank."""
    plan = {}
    for i in range(config.num_layers):
        b = f"visual_transformer_blocks.{i}."
        for path, _ in _LAYERS:
            plan.update({f"{b}{path}.{p}": "colwise" for p in ("to_query", "to_key", "to_value")})
            plan[f"{b}{path}.out_layer"] = "rowwise"
        for stream in ("video", "audio"):
            plan.update({f"{b}{stream}_dec_block.feed_forward.net.0.proj": "colwise",
                         f"{b}{stream}_dec_block.feed_forward.net.2": "rowwise",
                         f"{b}{stream}_dec_block.visual_modulation.out_layer": "gather"})
        plan.update({f"{b}va_modulation.out_layer": "gather", f"{b}av_modulation.out_layer": "gather"})
    for stream in ("video", "audio"):
        t = f"{stream}_text_transformer_blocks.*."
        plan.update({f"{t}attn.{p}": "colwise" for p in ("to_query", "to_key", "to_value")})
        plan.update({f"{t}attn.out_layer": "rowwise", f"{t}feed_forward.net.0.proj": "colwise",
                     f"{t}feed_forward.net.2": "rowwise", f"{t}text_modulation.out_layer": "gather"})
    return plan


def block_inputs(config: Kandinsky6Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random run_blocks arguments of one block call: `image` video rows, their share of audio rows, a made
    Conditioning (its `text` prompt rows refined), and the rows' RoPE."""
    c, audio = config, config.audio_rows(image)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    mod = Pass(torch.full((1,), 500.0), torch.full((1,), 500.0),
               Conditioning(rand(1, c.time_dim), rand(1, c.audio_time_dim), rand(1, text, c.hidden_size),
                            rand(1, text, c.audio_hidden_size)))
    pos = torch.arange(image, dtype=torch.float32)
    angles = torch.outer(pos, _freqs(c.head_dim))
    return (rand(1, image, c.hidden_size), rand(1, audio, c.audio_hidden_size), None, mod,
            Rope(_rope(angles), _rope(angles[:audio])))


KANDINSKY6 = DiTFamily(
    name="kandinsky6", title="Kandinsky 6 (video-audio)", match=match_layout, infer_config=infer_config,
    meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=Kandinsky6Adapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="original", replace_keys=("double_block",), block_inputs=block_inputs,
    tensor_plan=tensor_plan)
