"""MiniMax-H3 (and FastH3): text-to-video-and-audio with one packed single-stream sequence.

The DiT is one list of identical blocks over one packed sequence [text | conditioning or reference rows | audio |
video]: full self-attention over all of it (no cross-attention, no per-modality weights), 3-axis RoPE on explicit
(t, h, w) coordinates of every row, and AdaLN modulation chosen per row from a table of (timestep, modality) rows
(modality 0 video, 1 text, 2 audio). The video is the 24-channel latent in 1x2x2 patches; the audio the 32-channel
stereo latent, one row per (channel, latent frame), channel-major. The prompt (Qwen3-VL hidden states) goes through
`condition_proj` and a two-block token refiner, then sits in front. The audio runs on its own shifted schedule
(sigma shift 3 against the video's 12), so audio rows carry another timestep than video rows in the same call, and
conditioning rows (fl2va's keyframes, ref2va's references) a third, pinned near t = 1.

Why this carries to every strategy without the seam learning about audio: attention sees each row through its own
coordinates and its own modulation row, so the sequence may be cut anywhere. `PackedSequence` says, for every row,
where it comes from (which prompt, video or audio row), its RoPE coordinates and its modulation row; any shard (a
range or an index set of rows) is embedded, run and read out from those tables alone, so the audio and video rows
split together under Ulysses and Ring as one sequence and neither stream is held whole anywhere.

The module tree is diffusers' MiniMaxH3Transformer3DModel: diffusers-layout files map one to one; the released
single files (MiniMaxAI's names, which ComfyUI's model keeps as its own parameter names: what a LoRA names) map
through `source_map`, the fused q/k/v ([q; k; v], as every published single file stores it) cut into rows and the
SwiGLU input's [gate; value] halves swapped to diffusers' [value; gate]. Timesteps are t = 1 - sigma, unscaled, as
the model reads them; ComfyUI's model returns the negated prediction (`comfy_output`).

What ComfyUI 2026's stock MODEL path hands this model (comfy/ldm/minimax/model.py, model_base.MiniMaxH3), and where
it stands here: x is a NestedTensor (video [B, 24, T, H/16, W/16], audio [B, 32, 2, T40]) from
EmptyMiniMaxH3LatentAV / MiniMaxH3ImageToVideo, the audio carried on the video's schedule (minimax_payload's
audio_scale); timestep = the video sigma x 1000; context = Qwen3-VL states, which extra_conds may already have run
through the token refiner (preprocess_text_embeds; embed_text takes both); minimax_payload's text_token_tags (prompt
images' rows tagged video), keyframes (MiniMaxH3ImageToVideo's first/last frame, MiniMaxH3AddGuide's frames and
audio), refs (MiniMaxH3ReferenceToVideo), their latents and noise augmentation; denoise_mask / audio_denoise_mask;
the sigma shifts in transformer_options. The runtime reads a model call of x, audio and timestep (Job.audio), with
keyframes and reference images as the conditioning's reference latents placed by their `CallLayout` (the reference
method, which also carries mixed prompt tags); the family packs them (pack_sequence). Load Parallel DiT's MODEL
converts that call (nodes/av_call.py: t2va, fl2va's image keyframes, ref2va's reference images, image-token prompt
rows), and Parallel Sampler's loop steps both latents as KSampler does, the audio carried on the video's schedule
(strategies/av_sampling.py, `audio_shifts`: t2va).

Curve-form (pruned) files, whose `adaln_t_table` (the time embedding's curve, interpolated) replaces the time MLP
and whose modulation projections read it without SiLU, run as ComfyUI runs them. Refused in one sentence: files with
a PDD head bank (several output heads stacked in `final_layer.video_out`), which read the sampler's sigma schedule.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...sampling.flow import FluxModelSampling, VideoLatentFormat
from ...weights.keymap import Source, block_count, same_names, tensor_shapes
from ...weights.storage import compute_placement
from ..family import DiTFamily, Match, OneBlockListConfig, derived_tensor_plan
from .flux import BFL_PREFIXES, DIFFUSERS_PREFIXES

VIDEO, TEXT, AUDIO = 0, 1, 2  # modality tags: the row of the (timestep, modality) modulation table
MODALITIES = 3
PATCH = (1, 2, 2)  # (t, h, w) latent pixels per video row
LATENT_CHANNELS, AUDIO_CHANNELS = 24, 32
AUDIO_STEREO = 2  # audio latent channels of sound (left, right): one row each per latent frame
SIGMA_SHIFT_VIDEO, SIGMA_SHIFT_AUDIO = 12.0, 3.0  # ComfyUI's MiniMaxH3Model defaults
# Time-axis span of each video latent frame: the causal VAE's first latent frame holds 1 pixel frame, the others 4,
# rescaled by 5/3 (ComfyUI's FRAME_PER_TOKEN, FRAME_RESCALE).
FRAME_SPANS = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0
VISUAL_COND_T, AUDIO_COND_T = 0.999, 1.0  # the timestep conditioning rows run at (no noise augmentation)
GRID_SCALE = 32.0  # area-normalised (h, w) coordinates span 32 units of the square root of the frame's area
EPS = 1e-5
BLOCK_LISTS = ("transformer_blocks",)
ALWAYS_OWNED = ("time_embedder.", "time_proj.", "rope.")  # every stage modulates its rows from the timesteps
FIRST_STAGE = ("proj_in.", "audio_proj_in.", "context_embedder.", "token_refiner.")
LAST_STAGE = ("norm_out.", "proj_out.", "audio_proj_out.")
# The video latent as the model reads it (ComfyUI's MiniMax-H3 latent format; the audio's is the audio VAE's own).
H3_LATENT = VideoLatentFormat("minimax_h3", 1.0, 0.0)


@dataclass(frozen=True)
class MiniMaxH3Config(OneBlockListConfig):
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    text_dim: int
    num_refiner_layers: int = 2
    freq_dim: int = 256
    time_embed_hidden: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    in_channels: int = LATENT_CHANNELS
    audio_channels: int = AUDIO_CHANNELS
    # Curve-form (pruned) files: rows of `adaln_t_table`, the time embedding's curve sampled over t in [0, 1], which
    # replaces the time MLP (time_embed_dim is then the table's width); 0: the time MLP.
    curve_grid: int = 0

    family = "minimax_h3"
    pooled_dim = 0
    text_encoders = "Qwen3-VL (its layer-50 hidden states)"
    video = True  # latents are [B, C, T, H, W]
    patch_size = PATCH
    latent_downscale = 16
    latent_channels = LATENT_CHANNELS
    latent_format = H3_LATENT
    # A job without the audio half of the latent (validate_job refuses it): Parallel Sampler's loop and the stock
    # MODEL door (nodes/av_call.py) both carry ComfyUI's (video, audio) latent.
    jobs_refused = ("a MiniMax-H3 audio-video model, whose (video, audio) latent from EmptyMiniMaxH3LatentAV or "
                    "MiniMaxH3ImageToVideo this job lacks the audio half of; connect that latent whole to Parallel "
                    "Sampler or KSampler, or load it with UNETLoader")
    single_video = True  # ComfyUI's MiniMaxH3Model runs batch 1 (one video per prompt)
    # A model call's keyframe and reference-image latents ride as the conditioning's reference latents, placed by
    # their CallLayout (the reference method): `reference_problem` checks them.
    reads_references = True

    @staticmethod
    def reference_problem(name: str, references, method) -> str | None:
        """The one-sentence refusal of the `name` conditioning's reference latents, or None where they fit."""
        if method is None:
            return (f"the {name} conditioning carries reference latents (ReferenceLatent), which MiniMax-H3 does not "
                    f"read; remove the ReferenceLatent node and give reference images through "
                    f"MiniMaxH3ReferenceToVideo.")
        try:
            problem = CallLayout.read(method).problem(tuple(tuple(r.shape) for r in references))
        except ValueError as error:
            return str(error)
        return None if problem is None else (f"the {name} conditioning's MiniMax-H3 conditioning rows do not fit "
                                             f"their layout ({problem}); this is a ParaDiT bug, please report it.")

    def __post_init__(self):
        if 6 * self.rope_freq_dim > self.head_dim or self.head_dim % 2:
            raise ModelFileError(f"MiniMax-H3 config is inconsistent (head size {self.head_dim}, {self.rope_freq_dim} "
                                 f"rotary frequencies per axis); the file is damaged, so re-download it.")

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_dim

    @property
    def context_dim(self) -> int:
        return self.text_dim

    @property
    def video_patch_dim(self) -> int:
        return self.in_channels * PATCH[0] * PATCH[1] * PATCH[2]

    @property
    def variant(self) -> str:
        return "minimax_h3"

    @property
    def title(self) -> str:
        return "MiniMax-H3" if (self.hidden_size, self.num_layers) == (5376, 50) else f"MiniMax-H3 {self.hidden_size}-wide"

    def diffusers_kwargs(self) -> dict:
        return dict(num_attention_heads=self.num_heads, attention_head_dim=self.head_dim, hidden_size=self.hidden_size,
                    num_layers=self.num_layers, num_refiner_layers=self.num_refiner_layers, ffn_dim=self.ffn_dim,
                    in_channels=self.in_channels, audio_in_channels=self.audio_channels, patch_size=PATCH,
                    # A curve-form file has no time MLP (_meta_model replaces it): any sizes build diffusers' one.
                    text_dim=self.text_dim, freq_dim=self.freq_dim or 256,
                    time_embed_hidden_dim=self.time_embed_hidden or 256,
                    time_embed_dim=self.time_embed_dim, rope_freq_dim=self.rope_freq_dim)


# -- checkpoint layout --------------------------------------------------------------------------------

# The released names (MiniMaxAI's single files, ComfyUI's parameter names): only H3 patchifies a video and an audio
# latent, so these two keys identify it (as ComfyUI's and other loaders detect it).
_ORIGINAL_KEYS = ("video_patch_proj.weight", "audio_patch_proj.weight")
# diffusers' names: LTX-2's diffusers files have audio_proj_in too, never a token refiner's refiner_blocks.
_DIFFUSERS_KEYS = ("audio_proj_in.weight", "context_embedder.weight", "token_refiner.refiner_blocks.0.norm1.weight")


def match_layout(keys: list[str]) -> Match | None:
    key_set = set(keys)
    for prefix in BFL_PREFIXES:
        if all(prefix + k in key_set for k in _ORIGINAL_KEYS):
            return Match("minimax", prefix)
    for prefix in DIFFUSERS_PREFIXES:
        if all(prefix + k in key_set for k in _DIFFUSERS_KEYS):
            return Match("diffusers", prefix)
    return None


def _refuse_variants(reader, p: str, name: str, layout: str, shape) -> None:
    video_out = "final_layer.video_out.weight" if layout != "diffusers" else "proj_out.weight"
    patch_dim = shape("video_patch_proj.weight" if layout != "diffusers" else "proj_in.weight")[1]
    if shape(video_out)[0] != patch_dim:
        raise ModelFileError(f"{name} is a MiniMax-H3 file with a PDD head bank ({shape(video_out)[0] // patch_dim} "
                             f"stacked output heads, read along the sampler's sigma schedule), which ParaDiT does not "
                             f"run yet; load it with UNETLoader or choose a file with one output head.")


def infer_config(reader, match: Match, name: str) -> MiniMaxH3Config:
    p, layout = match.prefix, match.layout
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete MiniMax-H3 DiT")
    _refuse_variants(reader, p, name, layout, shape)
    original = layout != "diffusers"
    if original:
        width, patch_dim = shape("video_patch_proj.weight")
        head_dim = shape("blocks.0.attn.q_norm.weight")[0]
        inner = shape("blocks.0.attn.qkv_proj.weight")[0] // 3
        ffn = shape("blocks.0.mlp.fc1.weight")[0] // 2
        text_dim = shape("condition_proj.weight")[1]
        if p + "adaln_t_table" in reader:  # curve form: the table's rows and width replace the time MLP
            curve, t_dim = shape("adaln_t_table")
            hidden_t, freq = 0, 0
        else:
            curve = 0
            hidden_t, freq = shape("time_embedder.proj_in.weight")
            t_dim = shape("time_embedder.proj_out.weight")[0]
        audio = shape("audio_patch_proj.weight")[1]
        layers = block_count(reader.keys(), p, "blocks", name)
        refiner = block_count(reader.keys(), p, "token_refiner.blocks", name)
    else:
        width, patch_dim = shape("proj_in.weight")
        head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
        inner = shape("transformer_blocks.0.attn.to_q.weight")[0]
        ffn = shape("transformer_blocks.0.ff.net.2.weight")[1]
        text_dim = shape("context_embedder.weight")[1]
        curve = 0  # diffusers has no curve-form model
        hidden_t, freq = shape("time_embedder.linear_1.weight")
        t_dim = shape("time_embedder.linear_2.weight")[0]
        audio = shape("audio_proj_in.weight")[1]
        layers = block_count(reader.keys(), p, "transformer_blocks", name)
        refiner = block_count(reader.keys(), p, "token_refiner.refiner_blocks", name)
    if inner % head_dim or patch_dim % (PATCH[1] * PATCH[2]):
        raise ModelFileError(f"{name} has MiniMax-H3 tensors of inconsistent shapes; the file is damaged, so "
                             f"re-download it.")
    # The released files store the rotary frequencies (ComfyUI reads them); diffusers' files do not, and every
    # released H3 has 16 per axis.
    rope = reader.shape(p + "rope.inv_freq")[0] if p + "rope.inv_freq" in reader else 16
    return MiniMaxH3Config(hidden_size=width, num_layers=layers, num_heads=inner // head_dim, head_dim=head_dim,
                           ffn_dim=ffn, text_dim=text_dim, num_refiner_layers=refiner, freq_dim=freq,
                           time_embed_hidden=hidden_t, time_embed_dim=t_dim, rope_freq_dim=rope,
                           in_channels=patch_dim // (PATCH[1] * PATCH[2]), audio_channels=audio, curve_grid=curve)


class CurveTimeTable(torch.nn.Module):
    """A curve-form file's time embedding: `table` [grid, width], the embedding's curve at t = 0, 1/(grid-1), ..., 1,
    read by linear interpolation (ComfyUI's MiniMaxH3Model with adaln_curve_grid)."""

    def __init__(self, grid: int, width: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.empty(grid, width), requires_grad=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        table = self.table
        pos = t.to(table.device, torch.float32).clamp(0.0, 1.0) * (table.shape[0] - 1)
        low = pos.floor().long().clamp(max=table.shape[0] - 2)  # t = 1 stays on the last interval
        return torch.lerp(table[low].float(), table[low + 1].float(), (pos - low).unsqueeze(1)).to(table.dtype)


def _meta_model(config: MiniMaxH3Config):
    """diffusers' model; a curve-form file's has the time table in place of the time MLP."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config.diffusers_kwargs())
        if config.curve_grid:
            model.time_embedder = CurveTimeTable(config.curve_grid, config.time_embed_dim)
    return model


def original_names(config: MiniMaxH3Config) -> dict[str, Source]:
    """diffusers parameter -> its Source in the released names (= ComfyUI's comfy/ldm/minimax/model.py names)."""
    out: dict[str, Source] = {}
    inner = config.num_heads * config.head_dim

    def attention(dst: str, src: str) -> None:
        for k, proj in enumerate(("to_q", "to_k", "to_v")):
            out[f"{dst}.attn.{proj}.weight"] = Source(f"{src}.attn.qkv_proj.weight", slice(k * inner, (k + 1) * inner))
        out[f"{dst}.attn.norm_q.weight"] = Source(f"{src}.attn.q_norm.weight")
        out[f"{dst}.attn.norm_k.weight"] = Source(f"{src}.attn.k_norm.weight")
        out[f"{dst}.attn.to_out.0.weight"] = Source(f"{src}.attn.out_proj.weight")
        # The released fc1 is [gate; value], diffusers' SwiGLU reads [value; gate].
        out[f"{dst}.ff.net.0.proj.weight"] = Source(f"{src}.mlp.fc1.weight", transform="swap_halves")
        out[f"{dst}.ff.net.2.weight"] = Source(f"{src}.mlp.fc2.weight")
        for norm in ("norm1", "norm2"):
            out[f"{dst}.{norm}.weight"] = Source(f"{src}.{norm}.weight")

    def linear(dst: str, src: str) -> None:
        for part in ("weight", "bias"):
            out[f"{dst}.{part}"] = Source(f"{src}.{part}")

    for i in range(config.num_layers):
        attention(f"transformer_blocks.{i}", f"blocks.{i}")
        linear(f"transformer_blocks.{i}.adaln_proj.linear", f"blocks.{i}.adaln_proj.linear")
    for j in range(config.num_refiner_layers):
        attention(f"token_refiner.refiner_blocks.{j}", f"token_refiner.blocks.{j}")
    for ours, theirs in (("proj_in", "video_patch_proj"), ("audio_proj_in", "audio_patch_proj"),
                         ("context_embedder", "condition_proj"),
                         *((() if config.curve_grid else (("time_embedder.linear_1", "time_embedder.proj_in"),
                                                          ("time_embedder.linear_2", "time_embedder.proj_out")))),
                         ("norm_out.linear", "final_layer.adaln_proj.linear"), ("proj_out", "final_layer.video_out"),
                         ("audio_proj_out", "final_layer.audio_out")):
        linear(ours, theirs)
    out["token_refiner.final_norm.weight"] = Source("token_refiner.final_norm.weight")
    if config.curve_grid:
        out["time_embedder.table"] = Source("adaln_t_table")
    out["norm_out.norm.weight"] = Source("final_layer.norm.weight")
    return out


def source_map(config: MiniMaxH3Config, layout: str, prefix: str = "") -> dict:
    """Every diffusers parameter -> its Source in a file of `layout`: "diffusers", or the released names (any other
    layout name: "minimax", or "bfl" as tiny.write_checkpoint calls every family's original layout)."""
    if layout == "diffusers":
        return same_names(_meta_model(config).state_dict(), prefix)
    return {name: Source(prefix + src.key, src.rows, src.transform) for name, src in original_names(config).items()}


def checkpoint_shapes(config: MiniMaxH3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{released key: (shape, kind)} of a complete file, for writing random test checkpoints."""
    params = _meta_model(config).state_dict()
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, src in original_names(config).items():
        shape = list(params[name].shape)
        if src.rows is not None:  # a fused q/k/v: three of diffusers' row blocks
            shape[0] = 3 * shape[0]
        key = src.key
        if key == "adaln_t_table":
            kind = "table"
        elif "adaln_proj" in key:
            kind = "mod" if key.endswith("weight") else "bias"
        elif key.endswith("bias"):
            kind = "bias"
        elif "norm" in key:
            kind = "norm"
        else:
            kind = "weight"
        shapes[key] = (tuple(shape), kind)
    shapes["rope.inv_freq"] = ((config.rope_freq_dim,), "rope_frequencies")  # a buffer the released files carry
    return shapes


# -- the packed sequence ----------------------------------------------------------------------------------

def _area_axis(dim: int, area_root: float) -> torch.Tensor:
    """Area-normalised coordinates of the 2-pixel patches along one latent axis of `dim` pixels (ComfyUI's
    _axis_from_sqrt_area): centred, spanning GRID_SCALE x dim / sqrt(h w)."""
    ratio, n = dim / area_root, dim // 2
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * GRID_SCALE


def frame_grid(h: int, w: int) -> tuple[torch.Tensor, tuple[float, float]]:
    """(h, w) coordinates of one latent frame's patch rows [h/2 * w/2, 2], row after row, and the w extremes
    (where the audio's left and right channels sit)."""
    root = math.sqrt(h * w)
    hh, ww = _area_axis(h, root), _area_axis(w, root)
    grid = torch.stack(torch.meshgrid(hh, ww, indexing="ij"), dim=-1).reshape(-1, 2)
    return grid, (float(ww[0]), float(ww[-1]))


def video_frame_times(frames: int, origin: float) -> torch.Tensor:
    """Time coordinate of each video latent frame: origin + the spans of the frames before it."""
    spans = torch.tensor([FRAME_RESCALE * FRAME_SPANS[k % 5] for k in range(frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def video_span(frames: int) -> float:
    return sum(FRAME_RESCALE * FRAME_SPANS[k % 5] for k in range(frames))


@dataclass(frozen=True)
class Keyframe:
    """fl2va's conditioning frames: a video latent [1, C, t, H, W] (the target's size) placed at pixel frame
    `frame` of the target timeline."""

    latent: torch.Tensor
    frame: int


@dataclass(frozen=True)
class ReferenceImage:
    """ref2va's reference image: a video latent [1, C, 1, h, w] (any size), one time unit ahead of the targets."""

    latent: torch.Tensor


@dataclass
class PackedSequence:
    """One call's packed rows [text | conditioning rows | audio | video] and, per row, where it comes from (its
    input stream, and its row there: the prompt's, the video rows' [conditioning, target] or the audio rows'), its
    modulation tag, its RoPE coordinates, and which timestep class it runs at (0: the video's t, 1: the audio's, 2:
    visual conditioning, 3: audio conditioning). Every table is per row, so any shard reads its own rows."""

    text_len: int
    video_thw: tuple[int, int, int]  # the target's latent frames, and patch rows and columns
    audio_frames: int
    positions: torch.Tensor  # [S, 3] float64 (t, h, w)
    modality: torch.Tensor  # [S] long: the modulation's tag, VIDEO, TEXT or AUDIO
    stream: torch.Tensor  # [S] long: which input the row comes from (TEXT: the prompt, even a video-tagged row)
    source_row: torch.Tensor  # [S] long: the row's index in its modality's input rows
    time_class: torch.Tensor  # [S] long
    cond_video: tuple[torch.Tensor, ...] = ()  # conditioning latents whose rows come before the target video's
    target: dict = field(default_factory=dict)  # "video" / "audio" -> the target rows' sequence positions

    @property
    def seq_len(self) -> int:
        return self.positions.shape[0]

    @property
    def video_rows(self) -> int:
        t, h, w = self.video_thw
        return t * h * w


def pack_sequence(text_len: int, latent_thw: tuple[int, int, int], audio_frames: int,
                  keyframes: tuple[Keyframe, ...] = (), references: tuple[ReferenceImage, ...] = (),
                  text_tags: torch.Tensor | None = None) -> PackedSequence:
    """ComfyUI's PackedLayout for t2va (neither), fl2va (`keyframes`) and ref2va with reference images: text rows at
    t = 0.. along the time axis, the references one time unit each after them, then the target timeline (keyframe
    rows at their anchors on it, the audio's two channels at the frame's w extremes, the video frames).
    `text_tags`: the prompt rows' modality tags where they are mixed (a keyframe's vision tokens in the Qwen3-VL
    prompt carry the video's, ComfyUI's text_token_tags); None: all text."""
    t, h, w = latent_thw
    frame, (w_low, w_high) = frame_grid(h, w)
    pos, mod, src, cls, streams = [], [], [], [], []
    counts = {VIDEO: 0, AUDIO: 0}

    def add(coords: torch.Tensor, modality: int, time_class: int) -> None:
        n = coords.shape[0]
        pos.append(coords)
        streams.append(torch.full((n,), modality))
        mod.append(torch.full((n,), modality))
        cls.append(torch.full((n,), time_class))
        if modality == TEXT:
            src.append(torch.arange(n))
        else:
            src.append(torch.arange(counts[modality], counts[modality] + n))
            counts[modality] += n

    def video(frames: int, grid: torch.Tensor, origin: float) -> torch.Tensor:
        g = torch.empty(frames, grid.shape[0], 3, dtype=torch.float64)
        g[:, :, 0] = video_frame_times(frames, origin)[:, None]
        g[:, :, 1:] = grid[None]
        return g.reshape(-1, 3)

    text = torch.zeros(text_len, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(text_len, dtype=torch.float64)
    add(text, TEXT, 0)
    if text_tags is not None:
        mod[0] = text_tags.to(torch.long).flatten()
    cursor = float(text_len) + len(references)  # an image reference spans one time unit
    for kf in keyframes:
        add(video(kf.latent.shape[2], frame, cursor + FRAME_RESCALE * kf.frame), VIDEO, 2)
    ref_cursor = float(text_len)
    for ref in references:
        grid, _ = frame_grid(ref.latent.shape[-2], ref.latent.shape[-1])
        add(video(1, grid, ref_cursor), VIDEO, 2)
        ref_cursor += 1.0
    audio_start = sum(p.shape[0] for p in pos)
    g = torch.zeros(AUDIO_STEREO * audio_frames, 3, dtype=torch.float64)
    g[:, 0] = (cursor + torch.arange(audio_frames, dtype=torch.float64)).repeat(AUDIO_STEREO)
    g[:audio_frames, 2], g[audio_frames:, 2] = w_low, w_high
    add(g, AUDIO, 1)
    video_start = audio_start + g.shape[0]
    add(video(t, frame, cursor), VIDEO, 0)
    seq = PackedSequence(text_len, (t, h // 2, w // 2), audio_frames, torch.cat(pos), torch.cat(mod),
                         torch.cat(streams), torch.cat(src), torch.cat(cls),
                         tuple(kf.latent for kf in keyframes) + tuple(r.latent for r in references))
    seq.target = {"audio": torch.arange(audio_start, video_start),
                  "video": torch.arange(video_start, video_start + t * (h // 2) * (w // 2))}
    return seq


@dataclass(frozen=True)
class CallLayout:
    """Where a model call's conditioning rows sit (ComfyUI's PackedLayout inputs beyond the latents' shapes): each
    keyframe's (pixel frame, latent frames), the number of reference images after them, and the prompt rows'
    modality tags where they are mixed. A model call's conditioning carries the keyframes' and the references'
    latents as its reference latents, in that order, and this layout as their method (`method`), which every
    runtime message, batch signature and RoPE table already carry."""

    keyframes: tuple[tuple[int, int], ...] = ()
    references: int = 0
    text_tags: tuple[int, ...] | None = None

    PREFIX = "minimax_h3:"

    @property
    def method(self) -> str:
        tags = None if self.text_tags is None else list(self.text_tags)
        return self.PREFIX + json.dumps({"keyframes": [list(k) for k in self.keyframes], "references": self.references,
                                         "text_tags": tags}, separators=(",", ":"))

    @classmethod
    def read(cls, method: str | None) -> "CallLayout":
        if method is None:
            return cls()
        if not method.startswith(cls.PREFIX):
            raise ValueError(f"MiniMax-H3 reads no reference method {method!r}; this is a ParaDiT bug, please "
                             f"report it.")
        fields = json.loads(method[len(cls.PREFIX):])
        tags = fields.get("text_tags")
        return cls(tuple((int(f), int(t)) for f, t in fields.get("keyframes", ())), int(fields.get("references", 0)),
                   None if tags is None else tuple(int(x) for x in tags))

    def problem(self, shapes: tuple[tuple[int, ...], ...], video_hw: tuple[int, int] | None = None) -> str | None:
        """Why reference latents of these shapes ([1, C, t, h, w]) do not fit this layout, or None."""
        if len(shapes) != len(self.keyframes) + self.references:
            return (f"{len(shapes)} conditioning latents for {len(self.keyframes)} keyframe(s) and {self.references} "
                    f"reference(s)")
        for (_, frames), shape in zip(self.keyframes, shapes):
            if len(shape) != 5 or shape[2] != frames or (video_hw is not None and tuple(shape[-2:]) != video_hw):
                return f"a keyframe latent of shape {tuple(shape)}, not [1, C, {frames}, H, W] of the video"
        for shape in shapes[len(self.keyframes):]:
            if len(shape) != 5 or shape[2] != 1:
                return f"a reference latent of shape {tuple(shape)}, not one frame [1, C, 1, h, w]"
        return None

    def rows(self, reference_hw: tuple[tuple[int, int], ...], video_hw: tuple[int, int]) -> tuple:
        """pack_sequence's keyframes, references and text tags (the latents shaped only: meta tensors)."""
        k = len(self.keyframes)
        keyframes = tuple(Keyframe(torch.empty(1, 0, frames, *video_hw, device="meta"), frame)
                          for frame, frames in self.keyframes)
        refs = tuple(ReferenceImage(torch.empty(1, 0, 1, *hw, device="meta")) for hw in reference_hw[k:])
        tags = None if self.text_tags is None else torch.tensor(self.text_tags, dtype=torch.long)
        return keyframes, refs, tags


def time_shift(sigma, from_shift: float, to_shift: float):
    """A sigma on the `from_shift` schedule moved to the `to_shift` one (the same point of the base grid)."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def call_timesteps(sigma: float, shifts: tuple[float, float] = (SIGMA_SHIFT_VIDEO, SIGMA_SHIFT_AUDIO)) -> torch.Tensor:
    """The timestep of each time class at the video's `sigma`: t = 1 - sigma for video and text rows, the audio's
    own shifted sigma, and the conditioning rows pinned near 1 (as ComfyUI's _forward derives them)."""
    t_v = 1.0 - sigma
    t_a = 1.0 - float(time_shift(torch.tensor(sigma, dtype=torch.float64), *shifts))
    return torch.tensor([t_v, t_a, max(t_v, VISUAL_COND_T), max(t_a, AUDIO_COND_T)], dtype=torch.float64)


def modulation_rows(seq: PackedSequence, class_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the distinct timesteps, sorted; per row its row in the (timestep, modality) modulation table; per row its
    timestep's index): what the blocks and the final norm read, per row."""
    used = class_t[seq.time_class.unique()]
    distinct = torch.unique(used)  # sorted, as ComfyUI's unique_t
    t_index = torch.searchsorted(distinct, class_t[seq.time_class])
    return distinct, t_index * MODALITIES + seq.modality, t_index


def patchify_video(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, T h w, C*2*2] rows (frame, patch row, patch column), features (c, ph, pw)."""
    b, c, t, h, w = latent.shape
    x = latent.reshape(b, c, t, h // 2, 2, w // 2, 2)
    return x.permute(0, 2, 3, 5, 1, 4, 6).reshape(b, t * (h // 2) * (w // 2), c * 4)


def unpatchify_video(rows: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
    """patchify_video's inverse, to [B, C, T, 2h, 2w]."""
    b = rows.shape[0]
    x = rows.reshape(b, t, h, w, -1, 2, 2)
    return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, -1, t, 2 * h, 2 * w)


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, 2, T] -> [B, 2 T, C]: channel-major stereo rows (left t0..T-1, then right)."""
    b, c, ch, t = latent.shape
    return latent.permute(0, 2, 3, 1).reshape(b, ch * t, c)


def unpack_audio(rows: torch.Tensor) -> torch.Tensor:
    b, n, c = rows.shape
    return rows.reshape(b, AUDIO_STEREO, n // AUDIO_STEREO, c).permute(0, 3, 1, 2)


# -- the strategies' view -----------------------------------------------------------------------------

def rope_tables(positions: torch.Tensor, rope_freq_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rows, 2 * 3 * rope_freq_dim] of (t, h, w) coordinates: one frequency set shared by the three axes,
    the three axes' angles side by side and the whole repeated (the split-half rotation), in float32 from float32
    coordinates as both references compute them."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32) / (2 * rope_freq_dim)))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv.view(1, 1, -1)
    angles = angles.flatten(1)
    angles = torch.cat([angles, angles], dim=-1).to(device)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The split-half rotation of the first cos.shape[-1] channels of every head; the rest pass through."""
    n = cos.shape[-1]
    rot, rest = x[..., :n], x[..., n:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype)[None, :, None], sin.to(x.dtype)[None, :, None]
    return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)


@dataclass
class ShardInputs:
    """What one forward pass over some rows of a PackedSequence reads: the rows' sequence positions, RoPE tables and
    modulation rows, the call's time embedding (one row per distinct timestep) and each row's timestep index."""

    index: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    mod_rows: torch.Tensor
    t_index: torch.Tensor
    temb: torch.Tensor

    def to(self, device, dtype=None) -> "ShardInputs":
        """On `device`, the time embedding in `dtype` (the tables stay integer, RoPE float32)."""
        return ShardInputs(self.index.to(device), tuple(t.to(device) for t in self.rope), self.mod_rows.to(device),
                           self.t_index.to(device), self.temb.to(device, dtype) if dtype else self.temb.to(device))


class MiniMaxH3Adapter:
    patch = 2
    latent_channels = LATENT_CHANNELS
    joint_text = True
    embeds_whole_prompt = True  # the token refiner attends over the whole prompt: every rank refines it whole
    skip: frozenset = frozenset()

    def __init__(self, config: MiniMaxH3Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.dtype, self.device = compute_placement(model.time_embedder)

    # -- the runtime's view: the sampler's rows are [audio | video], the prompt rows joint in front ----------
    # A model call's x is the video latent and the audio latent (job.audio); their rows form one token tensor
    # [audio rows | video rows] of the video rows' width (the audio's 32 features zero-padded), which every strategy
    # cuts like any image stream. `hw` is (T, H, W, audio frames). The per-row tables the blocks read (RoPE, the
    # modulation row, which head reads the row) ride in `rope`, which the strategies index per rank like RoPE.

    latent_format = H3_LATENT
    model_sampling = FluxModelSampling(SIGMA_SHIFT_VIDEO, 1000.0, kind="discrete_flow")
    # ComfyUI's ModelSamplingAV (supported_models.MiniMaxH3: shift 12, audio_shift 3): Parallel Sampler carries the
    # audio on the video's schedule at audio_scale = 12 / 3, as KSampler does (sampling/audio_video.py).
    audio_shifts = (SIGMA_SHIFT_VIDEO, SIGMA_SHIFT_AUDIO)
    default_guidance = 0.0

    @staticmethod
    def pack(latent: torch.Tensor) -> torch.Tensor:
        return patchify_video(latent)

    @staticmethod
    def unpack(tokens: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        return unpatchify_video(tokens, t, h // 2, w // 2)

    def pack_av(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """[B, 2 Ta + T h w, C*4]: the audio rows (zero-padded to the video rows' width), then the video rows."""
        rows = patchify_video(video)
        audio_rows = F.pad(pack_audio(audio), (0, rows.shape[-1] - audio.shape[1]))
        return torch.cat([audio_rows, rows], dim=1)

    def unpack_av(self, tokens: torch.Tensor, t: int, h: int, w: int, audio_frames: int) -> tuple:
        n = AUDIO_STEREO * audio_frames
        audio = unpack_audio(tokens[:, :n, :self.config.audio_channels])
        return unpatchify_video(tokens[:, n:], t, h // 2, w // 2), audio

    def rope(self, text_len: int, t: int, h: int, w: int, audio_frames: int, references=(), method=None):
        """Per row of the canonical sequence [prompt, audio, video, conditioning rows]: RoPE's cos and sin, its
        modulation row (time class x 3 + modality; classes as call_timesteps orders them) and which head reads it
        (0 none, 1 the audio's, 2 the video's). `references` and `method`: the conditioning's reference latents'
        (h, w) and their layout (CallLayout), where a call carries keyframes, references or prompt tags."""
        keyframes, refs, tags = CallLayout.read(method).rows(references, (h, w))
        seq = pack_sequence(text_len, (t, h, w), audio_frames, keyframes, refs, tags)
        cond = (seq.time_class >= 2).nonzero().flatten()  # keyframes', then references' rows, as Branches packs them
        order = torch.cat([torch.arange(text_len), seq.target["audio"], seq.target["video"], cond])
        cos, sin = rope_tables(seq.positions[order], self.config.rope_freq_dim, self.device)
        mod = (seq.time_class * MODALITIES + seq.modality)[order]
        reader = torch.zeros_like(mod)
        audio_end = text_len + len(seq.target["audio"])
        reader[text_len:audio_end] = 1
        reader[audio_end:audio_end + len(seq.target["video"])] = 2  # the conditioning rows after them: no head
        return cos, sin, mod.to(self.device), reader.to(self.device)

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        """Rows `index` of [audio | video]: the audio rows through audio_proj_in (their first 32 features), the
        video rows through proj_in."""
        tokens = tokens.to(self.device, self.dtype)
        audio = (index < AUDIO_STEREO * hw[3]).to(tokens.device)
        out = self.model.proj_in(tokens)
        if audio.any():
            out[:, audio] = self.model.audio_proj_in(tokens[:, audio, :self.config.audio_channels])
        return out

    def timestep_embedding(self, t: torch.Tensor, pooled, guidance, hw=None) -> torch.Tensor:
        """[B, 4, D]: per batch row, the time MLP of its four time classes at its video sigma (t: sigma x 1000, as
        ComfyUI passes it)."""
        classes = torch.stack([call_timesteps(float(s) / 1000.0) for s in t.flatten().cpu()])
        return self.timestep_embedding_of(classes.flatten()).unflatten(0, classes.shape)

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope) -> torch.Tensor:
        """The model output of the rank's [audio | video] rows, as ComfyUI's MiniMaxH3Model returns it (negated),
        the audio rows' 32 features zero-padded to the video rows' width; float32."""
        cos, sin, mod, reader = rope
        rows = reader > 0
        t_class, reader = mod[rows] // MODALITIES, reader[rows]
        shift, scale = self.model.norm_out.linear(self._modulating(temb)).chunk(2, dim=-1)  # [B, 4, D] each
        x = self.model.norm_out.norm(image)
        x = torch.addcmul(shift[:, t_class], x, 1 + scale[:, t_class])
        out = x.new_zeros(*x.shape[:2], self.config.video_patch_dim, dtype=torch.float32)
        video, audio = reader == 2, reader == 1
        out[:, video] = self.model.proj_out(x[:, video]).float()
        out[:, audio, :self.config.audio_channels] = self.model.audio_proj_out(x[:, audio]).float()
        return -out

    # -- inputs ----------------------------------------------------------------------------------------

    def shard_inputs(self, seq: PackedSequence, index: torch.Tensor, class_t: torch.Tensor) -> ShardInputs:
        """The per-row tables of rows `index` (any rows: a Ulysses or Ring shard, a patch) and the time embedding."""
        distinct, mod_rows, t_index = modulation_rows(seq, class_t)
        rope = rope_tables(seq.positions[index], self.config.rope_freq_dim, self.device)
        return ShardInputs(index.to(self.device), rope, mod_rows[index].to(self.device),
                           t_index[index].to(self.device), self.timestep_embedding_of(distinct))

    def timestep_embedding_of(self, t: torch.Tensor) -> torch.Tensor:
        """The time MLP of each distinct timestep (t in [0, 1], unscaled): cos before sin, float32 sinusoid."""
        half = self.config.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half).to(self.device)
        args = t.to(self.device, torch.float32)[:, None] * freqs[None]
        sinusoid = torch.cat([args.cos(), args.sin()], dim=-1)
        embedder = self.model.time_embedder
        if self.config.curve_grid:
            return embedder(t.to(self.device))
        return embedder.linear_2(F.silu(embedder.linear_1(sinusoid.to(self.dtype))))

    def _modulating(self, temb: torch.Tensor) -> torch.Tensor:
        """What the modulation projections read: SiLU of the time embedding, or a curve-form file's interpolated
        table as it is (its projections were fitted to it)."""
        return temb if self.config.curve_grid else F.silu(temb)

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        """condition_proj, then the token refiner's plain pre-norm blocks over the whole prompt (local attention).
        A prompt already as wide as the residual was refined on the host (ComfyUI 2026's MiniMaxH3.extra_conds calls
        preprocess_text_embeds) and is used as it is, as ComfyUI's model does."""
        if cond.shape[-1] == self.config.hidden_size != self.config.text_dim:
            return cond.to(self.device, self.dtype)
        x = self.model.context_embedder(cond.to(self.device, self.dtype))
        refiner = self.model.token_refiner
        for block in refiner.refiner_blocks:
            x = x + self._attention(block.attn, block.norm1(x), None, layer=None)
            x = x + block.ff(block.norm2(x))
        return refiner.final_norm(x)

    def embed_rows(self, seq: PackedSequence, index: torch.Tensor, text: torch.Tensor, video_rows: torch.Tensor,
                   audio_rows: torch.Tensor) -> torch.Tensor:
        """The embedded rows `index` of the packed sequence: each from its modality's input rows (the embedded
        prompt, the video rows [conditioning, target] in patch features, the audio rows), by the row tables."""
        stream, source = seq.stream[index], seq.source_row[index]
        out = text.new_empty(text.shape[0], len(index), self.config.hidden_size)
        for kind, rows, embed in ((TEXT, text, None), (VIDEO, video_rows, self.model.proj_in),
                                  (AUDIO, audio_rows, self.model.audio_proj_in)):
            mine = (stream == kind).nonzero().flatten()
            if len(mine):
                picked = rows[:, source[mine].to(rows.device)]
                out[:, mine.to(out.device)] = picked if embed is None else embed(picked.to(self.device, self.dtype))
        return out

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, hidden: torch.Tensor, text, shard: ShardInputs, rope=None, chunk: int = 0) -> tuple:
        """The seam's block call on a single-stream sequence: `hidden` holds every kind of row (so `text` is None,
        and comes back None), `shard` the rows' per-row conditioning (modulation rows, RoPE, time embedding)."""
        if not isinstance(shard, ShardInputs):  # the runtime's view: the prompt rows joint in front of the image's
            shard = ShardInputs(None, rope[:2], rope[2], rope[2] // MODALITIES, shard)
            hidden = torch.cat([text, hidden], dim=1)
            for i in self.chunks[chunk]:
                if i not in self.skip:
                    hidden = self._block(i, hidden, shard)
            return hidden[:, text.shape[1]:], hidden[:, :text.shape[1]]
        for i in self.chunks[chunk]:
            if i not in self.skip:
                hidden = self._block(i, hidden, shard)
        return hidden, text

    def _block(self, i: int, x: torch.Tensor, shard: ShardInputs) -> torch.Tensor:
        """Pre-norm attention and SwiGLU MLP, each modulated (shift, scale, gate) by the row's own table row."""
        block = self.model.transformer_blocks[i]
        table = block.adaln_proj.linear(self._modulating(shard.temb))  # [M, 3 x 6D], or per batch row [B, M, 3 x 6D]
        table = table.unflatten(-1, (MODALITIES, 6 * self.config.hidden_size)).flatten(-3, -2)
        rows = table.index_select(-2, shard.mod_rows)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = rows.chunk(6, dim=-1)
        h = torch.addcmul(shift_a, block.norm1(x), 1 + scale_a)
        x = torch.addcmul(x, self._attention(block.attn, h, shard.rope, layer=i), gate_a)
        h = torch.addcmul(shift_m, block.norm2(x), 1 + scale_m)
        return torch.addcmul(x, block.ff(h), gate_m)

    def _attention(self, attn, x: torch.Tensor, rope, layer: int | None) -> torch.Tensor:
        """q/k/v of this rank's rows, per-head RMSNorm of q and k, RoPE, then the strategy's attention over the
        whole sequence (`layer` None: the token refiner, local to the prompt every rank holds)."""
        head_dim = self.config.head_dim
        q, k, v = (proj(x).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if layer is None:
            from ...strategies.attention import LocalAttention

            out = LocalAttention()(q, k, v, self.config.num_layers, masked=False)
        else:
            out = self.context.attention(q, k, v, layer, masked=False)
        return attn.to_out[0](out.flatten(2, 3).to(x.dtype))

    def stream_heads(self, hidden: torch.Tensor, shard: ShardInputs, modality: torch.Tensor) -> dict[str, torch.Tensor]:
        """The final RMSNorm modulated per row's timestep (shift, scale), then each target stream's own output
        head on its rows: {"video": [B, n, C*4], "audio": [B, m, C]} in float32, with `modality` the rows'."""
        shift, scale = self.model.norm_out.linear(self._modulating(shard.temb)).chunk(2, dim=-1)
        x = torch.addcmul(shift[shard.t_index], self.model.norm_out.norm(hidden), 1 + scale[shard.t_index])
        out = {}
        for name, kind, proj in (("video", VIDEO, self.model.proj_out), ("audio", AUDIO, self.model.audio_proj_out)):
            rows = (modality == kind).nonzero().flatten().to(x.device)
            out[name] = proj(x[:, rows]).float()
        return out

    # -- one forward over some rows ----------------------------------------------------------------------

    def forward_rows(self, seq: PackedSequence, index: torch.Tensor, cond: torch.Tensor, video: torch.Tensor,
                     audio: torch.Tensor, class_t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's velocity of the target rows among `index` (a contiguous shard, or any index set the
        strategy's attention covers the rest of): `video` [B, C, T, H, W] and `audio` [B, C, 2, T] the target
        latents (all rows; only this shard's are embedded), `class_t` call_timesteps' four timesteps. Returns
        {"video": rows, "audio": rows, "video_index"/"audio_index": their places among the target rows}."""
        video_rows = patchify_video(video.float())
        if seq.cond_video:
            cond_rows = [patchify_video(c.float()).expand(video_rows.shape[0], -1, -1) for c in seq.cond_video]
            video_rows = torch.cat([*cond_rows, video_rows], dim=1)
        shard = self.shard_inputs(seq, index, class_t)
        hidden = self.embed_rows(seq, index, self.embed_text(cond), video_rows, pack_audio(audio.float()))
        hidden, _ = self.run_blocks(hidden, None, shard)
        targets = seq.stream[index].clone()
        targets[seq.time_class[index] >= 2] = TEXT  # conditioning rows are read by no head
        out = self.stream_heads(hidden, shard, targets)
        for name, kind in (("video", VIDEO), ("audio", AUDIO)):
            rows = index[targets == kind]
            out[f"{name}_index"] = rows - seq.target[name][0]
        return out


def block_inputs(config: MiniMaxH3Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (rows, None, ShardInputs, None) of one block call over [text, image] rows of one t2va sequence."""
    cols = max(1, math.isqrt(image))
    seq = pack_sequence(text, (1, 2 * -(-image // cols), 2 * cols), 1)
    index = torch.arange(min(seq.seq_len, text + image))
    class_t = call_timesteps(0.5)
    distinct, mod_rows, t_index = modulation_rows(seq, class_t)
    temb = torch.randn(len(distinct), config.time_embed_dim, generator=generator)
    shard = ShardInputs(index, rope_tables(seq.positions[index], config.rope_freq_dim, "cpu"), mod_rows[index],
                        t_index[index], temb)
    return torch.randn(1, len(index), config.hidden_size, generator=generator), None, shard, None


def tensor_plan(config: MiniMaxH3Config) -> dict:
    """diffusers' attention and SwiGLU split (derived from the model), and each block's modulation projection
    gathered: it is ~40% of a block's weights (2688 x 18 x 5376 in the released model), so a tensor rank keeps 1/N of
    its outputs and all-gathers the (timestep, modality) rows it computes (12 rows of 6 x 5376 per call)."""
    plan = derived_tensor_plan(_meta_model(config), BLOCK_LISTS)
    plan.update({f"transformer_blocks.{i}.adaln_proj.linear": "gather" for i in range(config.num_layers)})
    return plan


def comfy_output(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's MiniMaxH3Model returns the negated prediction (its samplers' velocity convention)."""
    return {k: -v if not k.endswith("_index") else v for k, v in out.items()}


MINIMAX_H3 = DiTFamily(
    name="minimax_h3", title="MiniMax-H3 (text/first-last-frame/reference to video with audio)", match=match_layout,
    infer_config=infer_config, meta_model=_meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes,
    adapter_class=MiniMaxH3Adapter, block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE,
    last_stage=LAST_STAGE, comfy_layout="minimax", replace_keys=("double_block",), block_inputs=block_inputs,
    tensor_plan=tensor_plan)
