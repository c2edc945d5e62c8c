"""LTX-2 / LTX-2.3 / LTX-2.5 (Lightricks, 19-22B): audio-video DiTs that denoise a video and its sound together.

Every block runs two streams side by side. Video tokens (one per latent pixel of the 128-channel, 32x spatial /
8x temporal latent; 3-D RoPE over pixel-space patch midpoints, time in seconds) and audio tokens (one per latent
frame of the 8 x 16 audio latent, flattened to 128 channels; 1-D RoPE over seconds) each get self-attention,
cross-attention to their own projection of the prompt, then the audio-to-video (queries video, keys audio) and
video-to-audio (queries audio, keys video) cross-attentions with 1-D temporal RoPE on both sides, then an MLP.
Modulation is per token: the timestep may differ per video token (conditioning frames, keyframes: their
timestep is 0) and per audio token, so every modulation row is computed for the rows a rank holds.

Under sequence parallelism both streams are split: a rank holds a shard of the video tokens and a shard of the
audio tokens. Each stream's self-attention is the ordinary Ulysses / Ring over its own shard lengths; the two
cross-stream attentions take local queries and the other stream's keys/values through the same strategies
(strategies/attention/streams.py); prompt cross-attention is local (every rank holds the prompt). The runtime
points the layers at those strategies through `AttentionContext.streams`: "video" (the joint attention slot,
`context.attention`), "audio", "a2v", "v2a".

The module tree is diffusers' LTX2VideoTransformer3DModel, so diffusers-layout files map one to one; Lightricks'
released files (the names ComfyUI's LTXAVModel uses) map through `source_map`, as diffusers' single-file converter
renames them. The text connectors stored in released files (video/audio_embeddings_connector) are not part of
this model: it reads their output (video rows, audio rows). ComfyUI's model_base.LTXAV runs them on the host in
extra_conds (diffusion_model.preprocess_text_embeds), which under ParaDiT's MODEL is the remote DiT: it runs them
there too, from the file's weights (ltx2_connectors.py).

ComfyUI 2026's model call for LTXAV carries, beyond x / timestep / context: x as a NestedTensor [video, audio]
(latent_shapes; LTXVConcatAVLatent), per-token video and audio timesteps made by process_timestep from
denoise_mask / audio_denoise_mask (LTXVImgToVideo, LTXVAddGuide), frame_rate (LTXVConditioning), keyframe_idxs
and guide_attention_entries (LTXVAddGuide), ref_audio (ID-LoRA reference audio), generated_keyframes (LTX-2.5).
The runtime runs such a call (strategies/two_stream_call.py): the audio x in Job.audio, per-row, per-frame or
per-token video sigmas in Job.timestep, the audio's in Job.audio_timestep, fps in Job.extra["frame_rate"], the prompt as
both connectors' rows side by side (`split_prompt`; the connectors themselves run on the host: ltx2_connectors.py),
the guide frames in Job.video_guides (which tokens run, the guides' positions and attention weights:
ltx2_guides.py) and LTXVReferenceAudio's tokens in Job.audio_reference. Load Parallel DiT's MODEL makes such calls of
ComfyUI's (nodes/ltx2_call.py); Parallel Sampler's loop steps both latents and makes one such call per step
(strategies/av_sampling.py); a job without its audio latent is refused before any work (`not_sampled_yet`).
Generated keyframes (LTX-2.5) are not carried yet (refused in one sentence naming the node). A file with LTX-2.5's
keyframe row gets it on the first latent frame's tokens, as ComfyUI's model adds it on every call
(`keyframe_marker`).

Tensor parallelism splits the heads and MLP units of all six attentions and both MLPs (`tensor_plan`); a rank takes
its heads' RoPE columns. PipeFusion's patches are runs of video tokens; the audio rows ride with one patch (audio is
~2% of the tokens) and the others read the audio K/V their buffers hold; a pass without audio rows works (empty
streams get a placeholder modulation row and no RoPE). The runtime runs it per model call over whole stages, beside
CFG (strategies/two_stream_pipefusion.py); displaced patch parallelism, and PipeFusion inside Ulysses, Ring or
tensor parallelism, are refused in one sentence (`strategy_problem`).

ComfyUI 2026's LTXAVModel reads the same weights another way than diffusers (and Lightricks' ltx-core), and a
file follows the reading of the program that loads its layout (`LTX2Config.reading`): a file in Lightricks' layout
(the one ComfyUI loads) is read as ComfyUI reads it, so that one worker equals the stock model call it replaces; a
diffusers-layout file as diffusers reads it. ComfyUI's reading (comfy/ldm/lightricks/av_model.py): video-to-audio
normalizes the video *after* the audio-to-video update (diffusers normalizes it once, before both); the a2v / v2a
scale-shift rows read each stream's own per-token timesteps (diffusers' LTX-2.3 reads the other stream's sigma); the
a2v gate reads the largest audio timestep of the call and the v2a gate the largest video timestep (diffusers: the
stream's own, or with cross timesteps the other's sigma); the prompt modulation reads each sample's largest
timestep of its stream; and a file without `config` metadata has a gate timestep scale of 1 (LTXAVModel's default)
where diffusers' default is 1000.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...errors import ModelFileError
from ...sampling.flow import FluxModelSampling, VideoLatentFormat
from ...spec import VideoGuides
from ...strategies.attention import LocalAttention
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..family import BlockKind, DiTFamily, JointAttentionConfig, Match
from ..patchify import PatchTokens
from ..shapes import plain_kind, shapes_of_model
from .flux import BFL_PREFIXES, DIFFUSERS_PREFIXES
from .ltx2_guides import GuideBias, first_frame_marker, token_coords

BLOCK_LISTS = ("transformer_blocks",)
DEFAULT_HEADS = 32  # ComfyUI's detection: attention_head_dim = attn2.to_k rows // 32 (audio: 32 heads as well)
_TIME = ("time_embed.", "audio_time_embed.", "prompt_adaln.", "audio_prompt_adaln.", "av_cross_attn_")
# Every stage modulates its blocks and cross-attends the projected prompt (RoPE modules hold no parameters).
ALWAYS_OWNED = _TIME + ("caption_projection.", "audio_caption_projection.")
FIRST_STAGE = ("proj_in.", "audio_proj_in.", "keyframes_abs_pos_embedding")
LAST_STAGE = ("scale_shift_table", "audio_scale_shift_table", "norm_out.", "proj_out.", "audio_norm_out.",
              "audio_proj_out.")
# Per block: video self-attention, video -> prompt, audio self, audio -> prompt, a2v, v2a (the cost model's view:
# costmodel.attention_shapes, with the audio rows from LTX2Config.audio_rows).
AV_BLOCK = BlockKind("audio-video", ("image", "prompt", "audio", "audio_prompt", "a2v", "v2a"))


READINGS = ("diffusers", "comfyui")


@dataclass(frozen=True)
class LTX2Config(JointAttentionConfig):
    hidden_size: int  # video width (heads x head size)
    audio_hidden_size: int
    num_layers: int
    in_channels: int = 128
    audio_in_channels: int = 128
    cross_attention_dim: int = 4096  # the video prompt rows' width as attn2 reads them
    audio_cross_attention_dim: int = 2048
    caption_channels: int = 0  # the text encoder's width where the file projects the prompt itself (LTX-2.0); 0: not
    num_heads: int = DEFAULT_HEADS
    audio_heads: int = DEFAULT_HEADS
    gated_attn: bool = False  # LTX-2.3: per-head output gates
    cross_attn_mod: bool = False  # LTX-2.3: modulated prompt cross-attention (9 rows per block)
    prompt_adaln: bool = False  # LTX-2.3: the prompt's modulation reads sigma (2.5 drops it: a fixed table)
    ff_bias: bool = True  # LTX-2.5: False
    audio_ff_bias: bool = True
    keyframes: bool = False  # LTX-2.5: a learned row added to single-pixel-frame tokens
    rope_type: str = "interleaved"  # "split" from LTX-2.3 (file metadata says; else by generation)
    cross_timestep: bool = False  # a2v/v2a modulation reads the other stream's sigma (LTX-2.3 on; diffusers' reading)
    av_timestep_multiplier: float = 1000.0  # diffusers' cross_attn_timestep_scale_multiplier (ComfyUI's av_ca_...)
    # Whose forward the weights are read with: "diffusers" (diffusers, ltx-core) or "comfyui" (ComfyUI 2026's
    # LTXAVModel); infer_config picks it from the file's layout (see the module's docstring).
    reading: str = "diffusers"
    rope_theta: float = 10000.0
    rope_double_precision: bool = True  # RoPE frequencies in float64 (ComfyUI's frequencies_precision)
    max_positions: tuple[int, int, int] = (20, 2048, 2048)  # frames (seconds x fps scale), height, width in pixels
    audio_max_position: int = 20

    family = "ltx2"
    video = True
    token_timesteps = True  # a model call may carry one video timestep per token (ComfyUI's per-token noise mask)
    patch_size = 1
    latent_downscale = 32
    pooled_dim = 0

    def __post_init__(self):
        if self.reading not in READINGS:
            raise ValueError(f"LTX-2 reading {self.reading!r} is not one of {READINGS}")
        if self.hidden_size % self.num_heads or self.audio_hidden_size % self.audio_heads:
            raise ModelFileError(f"LTX-2 config is inconsistent ({self.hidden_size} / {self.audio_hidden_size} wide "
                                 f"over {self.num_heads} / {self.audio_heads} heads); the file is damaged, so "
                                 f"re-download it.")

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        return (AV_BLOCK,) * self.num_layers

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.hidden_size

    @property
    def attention_layers(self) -> tuple[tuple[bool, ...], ...]:
        """traffic.Shapes' view (image-only layers of N rows x width): the video self-attention, and a2v with v2a as
        one more. Those two move the video rows' q and output (a2v) and k and v (v2a) at the audio width, half the
        video's: 2 N H together against an image layer's 4 N H, so this counts 8 N H per block where 6 N H (plus the
        audio's own ~1%) move: 33% over, on the safe side."""
        return ((False, False),) * self.num_layers

    def audio_rows(self, video_tokens: int) -> int:
        """Audio tokens beside `video_tokens` as the cost model counts them (AUDIO_PER_VIDEO_TOKEN)."""
        return max(1, round(video_tokens * AUDIO_PER_VIDEO_TOKEN))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def context_dim(self) -> int:
        """A call's prompt row width: the video and the audio connector's rows side by side (LTXAV's context)."""
        return 2 * self.caption_channels if self.caption_channels else (
            self.cross_attention_dim + self.audio_cross_attention_dim)

    @property
    def latent_channels(self) -> int:
        return self.in_channels

    @property
    def variant(self) -> str:
        return "ltx2.3" if self.cross_attn_mod else "ltx2"

    @property
    def title(self) -> str:
        return f"LTX-{'2.3' if self.cross_attn_mod else '2'} {self.hidden_size}-wide x {self.num_layers}"

    @property
    def not_sampled_yet(self) -> str:
        """Why a Parallel Sampler job cannot run (validate_job refuses it before any work when the job carries no
        audio latent): the loop steps the video and the audio latent together (strategies/av_sampling.py)."""
        return (f"{self.title} denoises its video and its sound together, but this job carries no audio latent; "
                f"give Parallel Sampler LTXVConcatAVLatent's latent (EmptyLTXVLatentVideo and "
                f"LTXVEmptyLatentAudio joined).")

    def model_call_problem(self, job) -> str | None:
        """What in a model call (Job.timestep set, the audio latent in Job.audio) the runtime cannot run, in one
        sentence, or None: its audio latent is [rows, audio_in_channels / 16, frames, 16] (LTXVConcatAVLatent's
        audio half), the audio timesteps one per row or per row and audio frame, and the strategies the ones
        that split both streams (`strategy_problem`)."""
        rows, audio = job.latent.shape[0], job.audio
        channels = self.audio_in_channels // AUDIO_BINS
        if audio.ndim != 4 or (audio.shape[0], audio.shape[1], audio.shape[3]) != (rows, channels, AUDIO_BINS):
            return (f"the audio latent has shape {tuple(audio.shape)} but {self.title} needs [{rows}, {channels}, "
                    f"frames, {AUDIO_BINS}] beside its video latent; use the audio half of LTXVConcatAVLatent's latent")
        at = job.audio_timestep
        if at is not None and tuple(at.shape) not in ((rows,), (rows, audio.shape[2])):
            return (f"the model call's audio timestep has shape {tuple(at.shape)}, not ({rows},) or ({rows}, "
                    f"{audio.shape[2]}); a node patches the audio timesteps in a way ParaDiT does not split: remove it")
        ref = job.audio_reference
        if ref is not None and (ref.ndim != 3 or ref.shape[0] not in (1, rows) or ref.shape[1] < 1
                                or ref.shape[2] != self.audio_in_channels or not bool(torch.isfinite(ref).all())):
            return (f"the model call's reference audio has shape {tuple(ref.shape)}, not [1 or {rows}, frames, "
                    f"{self.audio_in_channels}] of finite values; encode it with LTXVReferenceAudio and the model's "
                    f"audio VAE")
        guides = job.video_guides
        if guides is not None:
            problem = self.guides_problem(guides, math.prod(job.latent.shape[2:]))
            if problem:
                return problem
        return self.strategy_problem(job.strategy, "the parallel model call")

    @staticmethod
    def guides_problem(guides: VideoGuides, tokens: int) -> str | None:
        """What makes a call's guides (spec.VideoGuides) unreadable for a latent of `tokens` video tokens, or None:
        the door builds them from ComfyUI's keyframe_idxs, so this only catches a damaged message."""
        kept, coords, weights = guides.kept, guides.coords, guides.weights
        g = coords.shape[1] if coords.ndim == 3 else -1
        ok = (kept.ndim == 1 and kept.dtype == torch.int64 and 0 < kept.numel() <= tokens
              and int(kept.min()) >= 0 and int(kept.max()) < tokens and bool((kept[1:] > kept[:-1]).all())
              and coords.ndim == 3 and coords.shape[0] == 3 and coords.shape[2] == 2 and 0 <= g <= kept.numel()
              and bool(torch.isfinite(coords).all()))
        if ok and weights is not None:
            ok = tuple(weights.shape) == (g,) and bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())
        return None if ok else ("the model call's guide frames do not fit its video latent (kept tokens, positions "
                                "or weights out of range); add the guides again with LTXVAddGuide")

    def strategy_problem(self, s, runner: str) -> str | None:
        """What of strategy `s` the two-stream call (strategies/two_stream_call.py) cannot run, one sentence without
        its full stop, or None; `runner` names what runs it (the model call, Parallel Sampler)."""
        if s.patch_degree > 1:
            return (f"{runner} runs {self.title} on CFG, Ulysses, Ring, tensor parallelism, PipeFusion and naive "
                    f"patch (and sharded weights), not on displaced patch parallelism yet; set patch_degree to 1")
        if s.pipefusion_degree > 1 and max(s.ulysses_degree, s.ring_degree, s.tensor_degree) > 1:
            return (f"{runner} runs {self.title}'s PipeFusion on whole stages (beside CFG), not inside Ulysses, Ring "
                    f"or tensor parallelism yet; set ulysses_degree, ring_degree and tensor_degree to 1, or "
                    f"pipefusion_degree to 1")
        return None

    def diffusers_kwargs(self) -> dict:
        return dict(in_channels=self.in_channels, out_channels=self.in_channels, num_attention_heads=self.num_heads,
                    attention_head_dim=self.head_dim, cross_attention_dim=self.cross_attention_dim,
                    gated_attn=self.gated_attn, cross_attn_mod=self.cross_attn_mod,
                    audio_in_channels=self.audio_in_channels, audio_out_channels=self.audio_in_channels,
                    audio_num_attention_heads=self.audio_heads,
                    audio_attention_head_dim=self.audio_hidden_size // self.audio_heads,
                    audio_cross_attention_dim=self.audio_cross_attention_dim, audio_gated_attn=self.gated_attn,
                    audio_cross_attn_mod=self.cross_attn_mod, num_layers=self.num_layers,
                    caption_channels=self.caption_channels or 3840, use_prompt_embeddings=self.caption_channels > 0,
                    rope_type=self.rope_type, ff_bias=self.ff_bias, audio_ff_bias=self.audio_ff_bias,
                    use_prompt_adaln_single=self.prompt_adaln,
                    use_keyframes_abs_pos_embedding=self.keyframes,
                    cross_attn_timestep_scale_multiplier=self.av_timestep_multiplier, rope_theta=self.rope_theta,
                    rope_double_precision=self.rope_double_precision, pos_embed_max_pos=self.max_positions[0],
                    base_height=self.max_positions[1], base_width=self.max_positions[2],
                    audio_pos_embed_max_pos=self.audio_max_position)


# -- checkpoint layout --------------------------------------------------------------------------------

_ORIGINAL_KEYS = ("adaln_single.emb.timestep_embedder.linear_1.bias", "audio_adaln_single.linear.weight")
_DIFFUSERS_KEYS = ("audio_time_embed.linear.weight", "audio_proj_in.weight", "proj_in.weight")


def match_layout(keys: list[str]) -> Match | None:
    """ComfyUI's LTXAV detection keys (Lightricks' released names, which ComfyUI's model keeps: "original"), or
    diffusers' audio time embedding beside both input projections ("diffusers")."""
    key_set = set(keys)
    for prefix in BFL_PREFIXES:
        if all(prefix + k in key_set for k in _ORIGINAL_KEYS):
            return Match("original", prefix)
    for prefix in DIFFUSERS_PREFIXES:
        if all(prefix + k in key_set for k in _DIFFUSERS_KEYS):
            return Match("diffusers", prefix)
    return None


# diffusers' names -> the released ones: the inverse of diffusers' convert_ltx2_transformer_to_diffusers (and of the
# LTX-2.3 prompt modulation it leaves alone). Whole top-level module names first, then substrings inside blocks.
_TOP_LEVEL = {"proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj", "time_embed": "adaln_single",
              "audio_time_embed": "audio_adaln_single", "prompt_adaln": "prompt_adaln_single",
              "audio_prompt_adaln": "audio_prompt_adaln_single",
              "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
              "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
              "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
              "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single"}
_IN_BLOCK = (("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
             ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
             (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm."))


def original_name(name: str) -> str:
    """A diffusers parameter's name in Lightricks' (= ComfyUI's) layout."""
    head, dot, rest = name.partition(".")
    if head in _TOP_LEVEL:
        return _TOP_LEVEL[head] + dot + rest
    for ours, theirs in _IN_BLOCK:
        name = name.replace(ours, theirs)
    return name


def _metadata_config(reader) -> dict:
    """The "transformer" part of a released file's `config` metadata, in ComfyUI's LTXAVModel argument names (what
    ComfyUI reads for the settings shapes cannot show: RoPE type, precision and extent, the a2v/v2a gate's
    timestep scale, head counts). Without it: diffusers' defaults, LTX-2.3 (modulated prompt) with split RoPE."""
    try:
        return json.loads((getattr(reader, "metadata", lambda: {})() or {}).get("config", "{}")).get("transformer", {})
    except (ValueError, AttributeError):
        return {}


def infer_config(reader, match: Match, name: str) -> LTX2Config:
    p, original = match.prefix, match.layout != "diffusers"
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete LTX-2 DiT")
    keys = reader.keys()
    video_in = shape("patchify_proj.weight" if original else "proj_in.weight")
    audio_in = shape("audio_patchify_proj.weight" if original else "audio_proj_in.weight")
    block = "transformer_blocks.0."
    to_k = shape(block + "attn2.to_k.weight")
    audio_to_k = shape(block + "audio_attn2.to_k.weight")
    caption = p + "caption_projection.linear_2.weight"  # LTX-2.3 projects before the connectors: linear_1 alone
    gate = p + block + "attn1.to_gate_logits.weight"
    audio_gate = p + block + "audio_attn1.to_gate_logits.weight"
    meta = _metadata_config(reader)
    # ComfyUI loads the released layout, so a worker reads such a file as ComfyUI's model call does (its gate scale
    # defaults to LTXAVModel's 1 where the file's metadata does not say); diffusers-layout files as diffusers does.
    reading = "comfyui" if original else "diffusers"
    prompt_adaln = (p + ("prompt_adaln_single" if original else "prompt_adaln") + ".linear.weight") in reader
    cross_attn_mod = p + block + "prompt_scale_shift_table" in reader
    return LTX2Config(
        hidden_size=video_in[0], audio_hidden_size=audio_in[0],
        num_layers=block_count(keys, p, "transformer_blocks", name),
        in_channels=video_in[1], audio_in_channels=audio_in[1], cross_attention_dim=to_k[1],
        audio_cross_attention_dim=audio_to_k[1],
        caption_channels=reader.shape(p + "caption_projection.linear_1.weight")[1] if caption in reader else 0,
        num_heads=reader.shape(gate)[0] if gate in reader else meta.get("num_attention_heads", DEFAULT_HEADS),
        audio_heads=(reader.shape(audio_gate)[0] if audio_gate in reader
                     else meta.get("audio_num_attention_heads", DEFAULT_HEADS)),
        gated_attn=gate in reader, cross_attn_mod=cross_attn_mod, prompt_adaln=prompt_adaln,
        ff_bias=p + block + "ff.net.0.proj.bias" in reader, audio_ff_bias=p + block + "audio_ff.net.0.proj.bias" in reader,
        keyframes=p + "keyframes_abs_pos_embedding" in reader,
        rope_type=meta.get("rope_type", "split" if cross_attn_mod else "interleaved"),
        cross_timestep=cross_attn_mod,
        av_timestep_multiplier=float(meta.get("av_ca_timestep_scale_multiplier",
                                              1.0 if reading == "comfyui" else 1000.0)),
        reading=reading,
        rope_theta=float(meta.get("positional_embedding_theta", 10000.0)),
        rope_double_precision=meta.get("frequencies_precision", "float64") == "float64",
        max_positions=tuple(int(v) for v in meta.get("positional_embedding_max_pos", (20, 2048, 2048))),
        audio_max_position=int(meta.get("audio_positional_embedding_max_pos", [20])[0]))


def _meta_model(config: LTX2Config):
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        return LTX2VideoTransformer3DModel(**config.diffusers_kwargs())


def source_map(config: LTX2Config, layout: str, prefix: str = "") -> dict:
    """Every diffusers parameter -> its Source in a file of `layout`: "diffusers", or the released names (ComfyUI's
    parameter names too, so every other layout name, "original" or "bfl", means them)."""
    names = _meta_model(config).state_dict()
    if layout == "diffusers":
        return same_names(names, prefix)
    return {n: Source(prefix + original_name(n)) for n in names}


def checkpoint_shapes(config: LTX2Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{released key: (shape, kind)} of a complete LTX-2 DiT (without the text connectors), for random test files."""
    return shapes_of_model(_meta_model(config).state_dict(), lambda name, t: _parameter_kind(original_name(name), t),
                           key=original_name)


def _parameter_kind(key: str, tensor: torch.Tensor) -> str:
    """Modulation tables O(1) and the timestep's adaLN projection at half a weight's scale (by the file's key)."""
    if "scale_shift_table" in key or key == "keyframes_abs_pos_embedding":
        return "table"
    if "adaln_single.linear." in key:
        return "mod" if key.endswith("weight") else "bias"
    return plain_kind(key, tensor)


# -- the strategies' view -----------------------------------------------------------------------------

class Modulation(NamedTuple):
    """One step's modulation rows for the tokens a rank holds ([B, rows or 1, k x width] each, as diffusers' blocks
    read them), and the head's embedded timesteps."""

    video: torch.Tensor
    audio: torch.Tensor
    video_cross: torch.Tensor
    audio_cross: torch.Tensor
    video_cross_gate: torch.Tensor
    audio_cross_gate: torch.Tensor
    prompt: torch.Tensor | None
    audio_prompt: torch.Tensor | None
    video_head: torch.Tensor
    audio_head: torch.Tensor


class Rope(NamedTuple):
    """RoPE tables of the rows a rank holds: each stream's own, and the 1-D temporal ones of a2v / v2a."""

    video: tuple
    audio: tuple
    video_cross: tuple
    audio_cross: tuple


# Which strategy slot each of a block's attention layers uses (AttentionContext.streams; "video" is the joint slot).
_LAYERS = (("attn1", "video"), ("audio_attn1", "audio"), ("attn2", "prompt"), ("audio_attn2", "prompt"),
           ("audio_to_video_attn", "a2v"), ("video_to_audio_attn", "v2a"))


class StreamAttnProcessor:
    """diffusers' LTX2AudioVideoAttnProcessor with the attention kernel replaced by the job's strategy for this
    layer's pair of streams (queries' rows local, keys' rows as the strategy gathers them)."""

    def __init__(self, layer: int, context, stream: str, tensor_rank: int = 0):
        """`tensor_rank`: this rank's index in a tensor-parallel group, whose heads' RoPE columns it takes."""
        self.layer, self.context, self.stream, self.tensor_rank = layer, context, stream, tensor_rank

    def attend(self):
        if self.stream == "prompt":
            return LocalAttention()  # the prompt is whole on every rank
        if self.stream == "video":
            return self.context.attention
        return self.context.streams.get(self.stream, LocalAttention())

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        from diffusers.models.transformers.transformer_ltx2 import (apply_interleaved_rotary_emb,
                                                                    apply_split_rotary_emb)

        if attention_mask is not None:
            raise ValueError("LTX-2's attention masks are not carried by ParaDiT's strategies")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(context))
        value = attn.to_v(context)
        if query_rotary_emb is not None:
            split = apply_split_rotary_emb

            def rotate(x, rope):  # nothing to rotate in a stream this pass does not carry (diffusers' split fails)
                kernel = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else split
                return kernel(x, self._heads_of(rope, attn, x)) if x.shape[1] else x

            query = rotate(query, query_rotary_emb)
            key = rotate(key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        out = self.attend()(q, k, v, self.layer).to(query.dtype)
        if gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)  # zero logits: gates of 1
        return attn.to_out[0](out.flatten(2, 3))

    def _heads_of(self, rope: tuple, attn, x: torch.Tensor) -> tuple:
        """The RoPE tables of the heads this rank projects: all of them, or under tensor parallelism its slice
        (interleaved tables [B, S, width]: its columns; split ones [B, heads, S, r]: its heads)."""
        cos, sin = rope
        if cos.dim() == 4:
            if cos.shape[1] == attn.heads:
                return rope
            cut = slice(self.tensor_rank * attn.heads, (self.tensor_rank + 1) * attn.heads)
            return cos[:, cut], sin[:, cut]
        if cos.shape[-1] == x.shape[-1]:
            return rope
        width = x.shape[-1]
        cut = slice(self.tensor_rank * width, (self.tensor_rank + 1) * width)
        return cos[..., cut], sin[..., cut]


def comfyui_block(block, video: torch.Tensor, audio: torch.Tensor, prompt: tuple, mod: Modulation,
                  rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' LTX2VideoTransformerBlock (its modules and modulation rows) in the order of ComfyUI's
    BasicAVTransformerBlock: the one difference in the block is that video-to-audio reads the video as the
    audio-to-video update left it, normalized again (diffusers normalizes it once, before both)."""
    b, mods = video.shape[0], block.get_mod_params
    v, a = mods(block.scale_shift_table, mod.video, b), mods(block.audio_scale_shift_table, mod.audio, b)
    video = video + block.attn1(block.norm1(video) * (1 + v[1]) + v[0], query_rotary_emb=rope.video) * v[2]
    audio = audio + block.audio_attn1(block.audio_norm1(audio) * (1 + a[1]) + a[0],
                                      query_rotary_emb=rope.audio) * a[2]
    video = video + _prompt_attention(block, "", video, prompt[0], v, mod.prompt)
    audio = audio + _prompt_attention(block, "audio_", audio, prompt[1], a, mod.audio_prompt)
    # a2v / v2a: (scale, shift) x 2 then the gate, per stream (diffusers' and ComfyUI's tables alike)
    vs, as_ = (mods(block.video_a2v_cross_attn_scale_shift_table[:4], mod.video_cross, b),
               mods(block.audio_a2v_cross_attn_scale_shift_table[:4], mod.audio_cross, b))
    video_gate = mods(block.video_a2v_cross_attn_scale_shift_table[4:], mod.video_cross_gate, b)[0]
    audio_gate = mods(block.audio_a2v_cross_attn_scale_shift_table[4:], mod.audio_cross_gate, b)[0]
    audio_norm = block.video_to_audio_norm(audio)
    a2v = block.audio_to_video_attn(block.audio_to_video_norm(video) * (1 + vs[0]) + vs[1],
                                    encoder_hidden_states=audio_norm * (1 + as_[0]) + as_[1],
                                    query_rotary_emb=rope.video_cross, key_rotary_emb=rope.audio_cross)
    video = video + video_gate * a2v
    v2a = block.video_to_audio_attn(audio_norm * (1 + as_[2]) + as_[3],
                                    encoder_hidden_states=block.audio_to_video_norm(video) * (1 + vs[2]) + vs[3],
                                    query_rotary_emb=rope.audio_cross, key_rotary_emb=rope.video_cross)
    audio = audio + audio_gate * v2a
    video = video + block.ff(block.norm3(video) * (1 + v[4]) + v[3]) * v[5]
    audio = audio + block.audio_ff(block.audio_norm3(audio) * (1 + a[4]) + a[3]) * a[5]
    return video, audio


def _prompt_attention(block, stream: str, x: torch.Tensor, context: torch.Tensor, ada: tuple, prompt_mod):
    """A stream's prompt cross-attention as diffusers' block runs it: LTX-2.3 modulates the query (rows 6-8 of
    its table) and the prompt (the prompt table, plus `prompt_mod` rows where the file reads sigma)."""
    attn, norm = getattr(block, stream + "attn2"), getattr(block, stream + "norm2")
    modulated = block.audio_cross_attn_adaln if stream else block.video_cross_attn_adaln
    q = norm(x)
    if modulated:
        q = q * (1 + ada[7]) + ada[6]
    if block.cross_attn_adaln:
        table = getattr(block, stream + "prompt_scale_shift_table")
        shift, scale = (block.get_mod_params(table, prompt_mod, x.shape[0]) if prompt_mod is not None
                        else table[None, None].to(x.device, x.dtype).unbind(dim=2))
        context = context * (1 + scale) + shift
    out = attn(q, encoder_hidden_states=context, query_rotary_emb=None)
    return out * ada[8] if modulated else out


class LTX2Adapter(PatchTokens):
    patch = 1  # video: the kit's one token per latent pixel, frame after frame
    joint_text = False
    two_streams = True  # video and audio tokens, each split over the sequence-parallel ranks
    default_guidance = 0.0
    # ComfyUI's supported_models.LTXAV: ModelSamplingFlux (shift 2.37, timestep = sigma: the model scales it by
    # 1000) with CONST; one sigma steps both streams. latent_formats.LTXAV maps nothing (scale 1, no shift).
    model_sampling = FluxModelSampling(2.37, 1.0, kind="flux")
    latent_format = VideoLatentFormat("ltx2", 1.0, 0.0)
    skip: frozenset = frozenset()

    def __init__(self, config: LTX2Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.dtype, self.device = compute_placement(model.time_embed if hasattr(model, "time_embed") else model)
        split = getattr(model, "tensor_split", None)
        for i, block in enumerate(model.transformer_blocks):
            for attr, stream in _LAYERS:
                layer = getattr(block, attr, None)
                if layer is not None:
                    layer.set_processor(StreamAttnProcessor(i, context, stream, split.index if split else 0))

    variant = property(lambda self: self.config.variant)

    # -- token layout ----------------------------------------------------------------------------------

    @staticmethod
    def pack_audio(latent: torch.Tensor) -> torch.Tensor:
        """Audio [B, C, T, F] -> [B, T, C F]: one token per latent frame (ComfyUI's AudioPatchifier)."""
        return latent.permute(0, 2, 1, 3).flatten(2)

    @staticmethod
    def unpack_audio(tokens: torch.Tensor, channels: int) -> torch.Tensor:
        return tokens.unflatten(2, (channels, -1)).permute(0, 2, 1, 3)

    def rope(self, thw: tuple[int, int, int], video_rows: torch.Tensor, audio_frames: int, audio_rows: torch.Tensor,
             fps: float = 24.0, batch: int = 1, guides: VideoGuides | None = None, audio_prefix: int = 0) -> Rope:
        """RoPE of the video rows `video_rows` (token indices into the T x H x W grid, or with `guides` into its kept
        tokens, the guides' at their own positions) and the audio rows `audio_rows` (latent frame indices; the first
        `audio_prefix` of the `audio_frames` are reference audio, placed to end just before time 0): every table is
        per token, so any shard's rows are computed alone."""
        m, device = self.model, self.device
        video = m.rope.prepare_video_coords(batch, *thw, device, fps=fps)
        if guides is not None:
            video = token_coords(video, guides, fps)
        audio = m.audio_rope.prepare_audio_coords(batch, audio_frames - audio_prefix, device)
        if audio_prefix:
            audio = torch.cat([self._reference_audio_coords(batch, audio_prefix), audio], dim=2)

        def tables(layer, coords, rows):
            # diffusers' split tables cannot be shaped for zero rows (a stream a pass does not carry): one row, cut
            picked = coords[:, :, rows.to(device) if len(rows) else torch.zeros(1, dtype=torch.long, device=device)]
            cos, sin = layer(picked, device=device)
            if len(rows):
                return cos, sin
            return (cos[:, :, :0], sin[:, :, :0]) if cos.dim() == 4 else (cos[:, :0], sin[:, :0])

        return Rope(tables(m.rope, video, video_rows), tables(m.audio_rope, audio, audio_rows),
                    tables(m.cross_attn_rope, video[:, 0:1], video_rows),
                    tables(m.cross_attn_audio_rope, audio[:, 0:1], audio_rows))

    def _reference_audio_coords(self, batch: int, frames: int) -> torch.Tensor:
        """[B, 1, frames, 2] times of ID-LoRA reference audio rows as LTXAVModel._process_input places them: the
        audio grid's own times moved back by the last row's end plus one latent frame, so the reference ends just
        before time 0."""
        rope = self.model.audio_rope
        coords = rope.prepare_audio_coords(batch, frames, self.device)
        latent_seconds = rope.hop_length * rope.scale_factors[0] / rope.sampling_rate
        return coords - (coords[0, 0, -1, 1] + latent_seconds)

    # -- a stock sampler's model call (strategies/model_call.py) ----------------------------------------

    def call_timesteps(self, timestep: torch.Tensor, audio_timestep: torch.Tensor | None, thw: tuple,
                       audio_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token timesteps [rows, video tokens] and [rows, audio frames] in the model's units, from a call's
        sigmas as ComfyUI hands them to LTXAVModel (x timestep_scale_multiplier, 1000): the video's per row, per
        row and latent frame (a conditioning frame at 0) or per row and token (a mask that varies within a frame:
        a dilated guide's, an inpainting mask's), the audio's per row or per row and frame, or the video's per-row
        sigma where the call has no audio mask."""
        t, h, w = thw
        video = timestep.float() * CALL_TIMESTEP_SCALE
        if video.ndim == 1:
            video = video[:, None].expand(-1, t * h * w)
        elif video.shape[1] == t:
            video = video[:, :, None].expand(-1, t, h * w).flatten(1)
        audio = (timestep if audio_timestep is None else audio_timestep).float() * CALL_TIMESTEP_SCALE
        if audio.ndim == 1:
            audio = audio[:, None].expand(-1, audio_frames)
        return video.contiguous(), audio.contiguous()

    def split_prompt(self, context: torch.Tensor, pooled=None) -> tuple[torch.Tensor, torch.Tensor]:
        """ComfyUI's LTX-2 prompt rows are the video connector's and the audio connector's side by side (LTXAV's
        _prepare_context): LTX-2.0's two caption-wide halves, LTX-2.3's video-wide then audio-wide rows."""
        c = self.config
        cut = c.caption_channels or c.cross_attention_dim
        return context[..., :cut], context[..., cut:]

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_video(self, tokens: torch.Tensor, keyframes: torch.Tensor | None = None) -> torch.Tensor:
        """proj_in of the video rows; `keyframes` [B, rows, 1]: non-zero on tokens of single-pixel-frame latents,
        which get LTX-2.5's keyframe row."""
        x = self.model.proj_in(tokens.to(self.device, self.dtype))
        if self.config.keyframes and keyframes is not None:
            x = x + (keyframes > 0).to(x.dtype) * self.model.keyframes_abs_pos_embedding.to(x.dtype)
        return x

    def video_bias(self, guides: VideoGuides, tokens: int) -> GuideBias | None:
        """The video self-attention's bias over a call's `tokens` kept tokens: the guides' attention weights
        (ltx2_guides.GuideBias), or None where they have none."""
        if guides.weights is None:
            return None
        return GuideBias(guides.weights, tokens, self.dtype, self.device)

    def keyframe_marker(self, thw: tuple[int, int, int], guides: VideoGuides | None, batch: int) -> torch.Tensor | None:
        """[B, tokens, 1] of a call's video tokens (kept ones, with `guides`): 1 where LTX-2.5's keyframe row is added,
        or None where nothing is. ComfyUI's LTXVModel adds it on every call of a file that has it, to the causal
        first frame's tokens (and never a guide's); diffusers' forward only where a pipeline passes a mask, which
        its plain text- and image-to-video pipelines do not (so the diffusers reading adds none)."""
        if not self.config.keyframes or self.config.reading != "comfyui":
            return None
        grid = self.model.rope.prepare_video_coords(batch, *thw, self.device)
        return first_frame_marker(grid, guides).unsqueeze(-1).float()

    def embed_audio(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.audio_proj_in(tokens.to(self.device, self.dtype))

    def embed_prompt(self, video_context: torch.Tensor, audio_context: torch.Tensor) -> tuple:
        """Each stream's prompt rows: the caption projections where the file has them (LTX-2.0), else as given."""
        v, a = video_context.to(self.device, self.dtype), audio_context.to(self.device, self.dtype)
        if self.config.caption_channels:
            v, a = self.model.caption_projection(v), self.model.audio_caption_projection(a)
        return v, a

    def modulation(self, video_t: torch.Tensor, audio_t: torch.Tensor, sigma: torch.Tensor,
                   audio_sigma: torch.Tensor, peaks: tuple | None = None) -> Modulation:
        """Modulation rows of diffusers' forward (step 3) for per-token timesteps `video_t` [B, rows] / `audio_t`
        [B, rows] (or [B]: one per sample) of the rows this rank holds; `sigma`, `audio_sigma` [B] (the model's
        units) for the prompt modulation and, with `cross_timestep`, the other stream's cross modulation. In
        ComfyUI's reading `sigma` / `audio_sigma` are each sample's largest timestep of its stream (over all its
        rows, not this rank's), and the a2v / v2a gates read `peaks` (the call's largest video and audio timestep
        over every sample; by default the largest of `sigma` / `audio_sigma`)."""
        if self.config.reading == "comfyui":
            return self._comfyui_modulation(video_t, audio_t, sigma, audio_sigma, peaks)
        m, c, dt, b = self.model, self.config, self.dtype, sigma.shape[0]
        # A stream with no rows in this pass (a PipeFusion patch that carries no audio) gets one per-sample row,
        # which nothing reads: diffusers' blocks cannot reshape zero modulation rows.
        video_t, audio_t = (t if t.numel() else t.new_zeros(b) for t in (video_t, audio_t))
        video_t, audio_t, sigma, audio_sigma = (t.to(self.device) for t in (video_t, audio_t, sigma, audio_sigma))

        def rows(layer, t):
            out, embedded = layer(t.flatten(), batch_size=b, hidden_dtype=dt)
            return out.view(b, -1, out.shape[-1]), embedded.view(b, -1, embedded.shape[-1])

        video, video_head = rows(m.time_embed, video_t)
        audio, audio_head = rows(m.audio_time_embed, audio_t)
        prompt = audio_prompt = None
        if c.cross_attn_mod and c.prompt_adaln:
            prompt, audio_prompt = rows(m.prompt_adaln, sigma)[0], rows(m.audio_prompt_adaln, audio_sigma)[0]
        factor = c.av_timestep_multiplier / 1000.0
        video_ca_t = audio_sigma.flatten() if c.cross_timestep else video_t.flatten()
        audio_ca_t = sigma.flatten() if c.cross_timestep else audio_t.flatten()
        return Modulation(video, audio, rows(m.av_cross_attn_video_scale_shift, video_ca_t)[0],
                          rows(m.av_cross_attn_audio_scale_shift, audio_ca_t)[0],
                          rows(m.av_cross_attn_video_a2v_gate, video_ca_t * factor)[0],
                          rows(m.av_cross_attn_audio_v2a_gate, audio_ca_t * factor)[0],
                          prompt, audio_prompt, video_head, audio_head)

    def _comfyui_modulation(self, video_t, audio_t, sigma, audio_sigma, peaks) -> Modulation:
        """LTXAVModel._prepare_timestep's rows: each stream's a2v / v2a scale-shift from its own per-token
        timesteps, the a2v gate from the largest audio timestep, the v2a gate from the largest video one."""
        m, c, dt, b = self.model, self.config, self.dtype, sigma.shape[0]
        video_t, audio_t = (t if t.numel() else t.new_zeros(b) for t in (video_t, audio_t))
        video_t, audio_t, sigma, audio_sigma = (t.to(self.device) for t in (video_t, audio_t, sigma, audio_sigma))
        video_peak, audio_peak = (sigma.max(), audio_sigma.max()) if peaks is None else peaks
        factor = c.av_timestep_multiplier / 1000.0

        def rows(layer, t):
            out, embedded = layer(t.flatten(), batch_size=b, hidden_dtype=dt)
            return out.view(b, -1, out.shape[-1]), embedded.view(b, -1, embedded.shape[-1])

        def gate(layer, peak):  # one row per sample: the same value on every token of the stream
            return rows(layer, torch.as_tensor(peak, device=self.device, dtype=sigma.dtype).expand(b) * factor)[0]

        video, video_head = rows(m.time_embed, video_t)
        audio, audio_head = rows(m.audio_time_embed, audio_t)
        prompt = audio_prompt = None
        if c.cross_attn_mod and c.prompt_adaln:
            prompt, audio_prompt = rows(m.prompt_adaln, sigma)[0], rows(m.audio_prompt_adaln, audio_sigma)[0]
        return Modulation(video, audio, rows(m.av_cross_attn_video_scale_shift, video_t)[0],
                          rows(m.av_cross_attn_audio_scale_shift, audio_t)[0],
                          gate(m.av_cross_attn_video_a2v_gate, audio_peak),
                          gate(m.av_cross_attn_audio_v2a_gate, video_peak), prompt, audio_prompt, video_head,
                          audio_head)

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, video: torch.Tensor, audio: torch.Tensor, prompt: tuple, mod: Modulation, rope: Rope,
                   chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' blocks over this rank's rows of both streams; attention through the context's strategies."""
        for i in self.chunks[chunk]:
            if i in self.skip:
                continue
            if self.config.reading == "comfyui":
                video, audio = comfyui_block(self.model.transformer_blocks[i], video, audio, prompt, mod, rope)
                continue
            video, audio = self.model.transformer_blocks[i](
                hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=prompt[0],
                audio_encoder_hidden_states=prompt[1], temb=mod.video, temb_audio=mod.audio,
                temb_ca_scale_shift=mod.video_cross, temb_ca_audio_scale_shift=mod.audio_cross,
                temb_ca_gate=mod.video_cross_gate, temb_ca_audio_gate=mod.audio_cross_gate,
                temb_prompt=mod.prompt, temb_prompt_audio=mod.audio_prompt, video_rotary_emb=rope.video,
                audio_rotary_emb=rope.audio, ca_video_rotary_emb=rope.video_cross,
                ca_audio_rotary_emb=rope.audio_cross)
        return video, audio

    def head(self, video: torch.Tensor, audio: torch.Tensor, mod: Modulation) -> tuple[torch.Tensor, torch.Tensor]:
        """Both output layers (diffusers' step 6): float32 velocities of the rows held."""
        m = self.model

        def out(x, table, embedded, norm, proj):
            shift, scale = (table[None, None] + embedded[:, :, None]).unbind(2)
            return proj(norm(x) * (1 + scale) + shift).float()

        return (out(video, m.scale_shift_table, mod.video_head, m.norm_out, m.proj_out),
                out(audio, m.audio_scale_shift_table, mod.audio_head, m.audio_norm_out, m.audio_proj_out))

    def forward_rows(self, video_tokens, audio_tokens, video_context, audio_context, video_t, audio_t, sigma,
                     audio_sigma, rope: Rope, keyframes=None, peaks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One model call over the rows a rank holds (video rows, audio rows, their timesteps and RoPE rows), all
        blocks of chunk 0: what a sequence-parallel rank runs, and at one rank the whole model."""
        mod = self.modulation(video_t, audio_t, sigma, audio_sigma, peaks)
        video, audio = self.run_blocks(self.embed_video(video_tokens, keyframes), self.embed_audio(audio_tokens),
                                       self.embed_prompt(video_context, audio_context), mod, rope)
        return self.head(video, audio, mod)


def tensor_plan(config: LTX2Config) -> dict:
    """diffusers' Attention / FeedForward split (q/k/v and the MLP's input column-wise, out-projections row-wise,
    q/k norms over all heads as "norm") in all six attentions of a block, and LTX-2.3's per-head gate logits
    column-wise with their heads."""
    from ..family import derived_tensor_plan

    model = _meta_model(config)
    plan = derived_tensor_plan(model, BLOCK_LISTS)
    if config.gated_attn:
        for i in range(config.num_layers):
            plan.update({f"transformer_blocks.{i}.{attr}.to_gate_logits": "colwise" for attr, _ in _LAYERS})
    return plan


CALL_TIMESTEP_SCALE = 1000.0  # LTXAVModel's timestep_scale_multiplier: ComfyUI's call carries sigmas
AUDIO_BINS = 16  # the audio latent's mel bins (ComfyUI's [B, channels, frames, 16]; channels x 16 per token)

# Audio rows per video row as the cost model counts them: ComfyUI's default LTX-2 size (768x512 x 97 frames at 25 fps:
# 97 audio tokens beside 13 x 16 x 24 = 4,992 video tokens, ~1/51); the template's 720p x 121 frames has ~1/116.
AUDIO_PER_VIDEO_TOKEN = 1 / 48


def block_inputs(config: LTX2Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random run_blocks arguments of one block call: `image` video rows on a one-frame grid, their share of audio
    rows, both prompts of `text` rows, per-sample modulation rows, and the rows' RoPE."""
    c, b = config, 1
    audio = config.audio_rows(image)
    k = 9 if c.cross_attn_mod else 6

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    prompt_mod = c.cross_attn_mod and c.prompt_adaln
    mod = Modulation(rand(b, 1, k * c.hidden_size), rand(b, 1, k * c.audio_hidden_size),
                     rand(b, 1, 4 * c.hidden_size), rand(b, 1, 4 * c.audio_hidden_size), rand(b, 1, c.hidden_size),
                     rand(b, 1, c.audio_hidden_size), rand(b, 1, 2 * c.hidden_size) if prompt_mod else None,
                     rand(b, 1, 2 * c.audio_hidden_size) if prompt_mod else None, rand(b, 1, c.hidden_size),
                     rand(b, 1, c.audio_hidden_size))
    m, cols = _meta_model(c), max(1, math.isqrt(image))  # RoPE modules hold no parameters: they run off meta
    video = m.rope.prepare_video_coords(b, 1, -(-image // cols), cols, "cpu")[:, :, :image]
    audio_coords = m.audio_rope.prepare_audio_coords(b, audio, "cpu")
    rope = Rope(m.rope(video, device="cpu"), m.audio_rope(audio_coords, device="cpu"),
                m.cross_attn_rope(video[:, 0:1], device="cpu"), m.cross_attn_audio_rope(audio_coords[:, 0:1], device="cpu"))
    return (rand(b, image, c.hidden_size), rand(b, audio, c.audio_hidden_size),
            (rand(b, text, c.cross_attention_dim), rand(b, text, c.audio_cross_attention_dim)), mod, rope)


LTX2 = DiTFamily(
    name="ltx2", title="LTX-2 / 2.3 / 2.5 (audio-video)", match=match_layout, infer_config=infer_config,
    meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=LTX2Adapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="original", replace_keys=("double_block",), block_inputs=block_inputs, tensor_plan=tensor_plan)
