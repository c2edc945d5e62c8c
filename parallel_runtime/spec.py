"""Plain job descriptions that cross the process boundary as JSON.

Tensors never live here; they travel beside the JSON header (see protocol.py).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class StrategySpec:
    """How one job is split. world = batch * cfg * pipefusion * naive_patch * patch * ring * ulysses * tensor."""

    cfg_degree: int = 1
    pipefusion_degree: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    # Baseline only: each rank denoises one patch that attends to itself alone.
    naive_patch_degree: int = 1
    # PipeFusion patches; 0 lets the runtime choose (= pipefusion_degree).
    num_pipeline_patch: int = 0
    # Steps run synchronously on the whole latent before stale-KV patching starts.
    warmup_steps: int = 1
    # Tensor parallel: every block's attention heads and MLP hidden units split over this many ranks.
    tensor_degree: int = 1
    # Displaced patch parallel (DistriFusion): each rank computes its patch of every layer against the other
    # patches' K/V from the previous step, exchanged while it computes.
    patch_degree: int = 1
    # Relative speed of each rank (world order), e.g. (3, 2) for a fast card beside a slower one: sequence shards,
    # PipeFusion stages and tensor-parallel heads split in proportion. Empty: equal shares.
    device_weights: tuple[float, ...] = ()
    # Sharded block weights (FSDP-style, for models bigger than one device): the ranks that would each hold the same
    # blocks (across CFG, Ulysses, Ring, patch) keep 1/N of every block's bytes and gather a block just before it
    # runs. "auto": the client turns it on for a job whose plan does not fit a rank without it (and fits with it).
    shard_weights: bool | str = False
    # Batch parallel (data parallel over the latent batch): each group of world / batch_degree ranks denoises its
    # share of the images, the shares in proportion to the groups' device_weights. No per-step traffic between
    # groups; outermost, so every other degree splits one group's images.
    batch_degree: int = 1
    # A step cache in the workers' own step loop (strategies/step_cache.py): "off", or "first_block" (First-Block
    # Cache: a step whose first block's residual changed by less than `cache_threshold`, relative L1 over the whole
    # sequence, both CFG branches and the batch, reuses the rest of the blocks' output delta of the last computed
    # step). It may skip only at steps i with cache_start <= i / steps < cache_end; every rank takes the same
    # decisions.
    cache: str = "off"
    cache_threshold: float = 0.1
    cache_start: float = 0.0
    cache_end: float = 1.0

    def __post_init__(self):
        # JSON gives a list; a frozen spec is hashed (a Topology key, a cache key), so it must be a tuple.
        object.__setattr__(self, "device_weights", tuple(float(w) for w in (self.device_weights or ())))
        if self.shard_weights not in (True, False, "auto"):
            from .errors import ConfigError

            raise ConfigError(f"shard_weights={self.shard_weights!r}; use on, off or auto.")
        _check_cache(self)

    @property
    def world_size(self) -> int:
        return (self.batch_degree * self.cfg_degree * self.pipefusion_degree * self.naive_patch_degree * self.patch_degree
                * self.ring_degree * self.ulysses_degree * self.tensor_degree)

    @property
    def patches(self) -> int:
        return self.num_pipeline_patch or self.pipefusion_degree

    def label(self) -> str:
        parts = [f"{name}{deg}" for name, deg in (
            ("batch", self.batch_degree), ("cfg", self.cfg_degree), ("pp", self.pipefusion_degree), ("ulysses", self.ulysses_degree),
            ("ring", self.ring_degree), ("naive", self.naive_patch_degree), ("patch", self.patch_degree),
            ("tp", self.tensor_degree)) if deg > 1]
        if self.pipefusion_degree > 1:
            parts.append(f"M{self.patches}w{self.warmup_steps}")
        elif self.patch_degree > 1:
            parts.append(f"w{self.warmup_steps}")
        label = "x".join(parts) or "serial"
        if self.sharded:
            label += "+shard"
        if self.balanced:
            label += "[" + ":".join(f"{w:g}" for w in self.device_weights) + "]"
        if self.cache != "off":
            label += f"+fbcache{self.cache_threshold:g}"
        return label

    @property
    def exact(self) -> bool:
        """Whether the strategy equals serial to round-off: everything but PipeFusion and displaced patch after their
        warm-up, and naive patch."""
        return self.pipefusion_degree == 1 and self.patch_degree == 1 and self.naive_patch_degree == 1

    @property
    def stale_steps(self) -> bool:
        """Whether steps after warm-up read stale K/V (PipeFusion, displaced patch)."""
        return self.pipefusion_degree > 1 or self.patch_degree > 1

    @property
    def sharded(self) -> bool:
        """Whether block weights are sharded (shard_weights on; "auto" is settled by the client before a job)."""
        return self.shard_weights is True

    @property
    def shard_group(self) -> int:
        """How many ranks hold the same blocks (everything but PipeFusion stages and tensor ranks): the group that
        shards them under shard_weights."""
        return self.world_size // (self.pipefusion_degree * self.tensor_degree)

    @property
    def balanced(self) -> bool:
        """Whether the ranks get unequal shares (device_weights that are not all the same)."""
        return len(set(self.device_weights)) > 1

    def to_json(self) -> dict:
        return asdict(self)


CACHE_MODES = ("off", "first_block")
CACHE_FIELDS = ("cache", "cache_threshold", "cache_start", "cache_end")  # StrategySpec's step-cache settings


def _check_cache(s: StrategySpec) -> None:
    """One sentence for cache settings the step cache cannot follow (before any work: the spec is built)."""
    from .errors import ConfigError

    if s.cache not in CACHE_MODES:
        raise ConfigError(f"cache={s.cache!r}; use one of {', '.join(CACHE_MODES)}.")
    threshold = s.cache_threshold
    if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold < 0:
        raise ConfigError(f"cache_threshold={threshold!r}; use a number of 0 or more (0 never skips a step).")
    for name in ("cache_start", "cache_end"):
        value = getattr(s, name)
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name}={value!r}; use a fraction of the schedule from 0 to 1.")
    if s.cache_start > s.cache_end:
        raise ConfigError(f"cache_start={s.cache_start} is after cache_end={s.cache_end}; set start at or before end.")


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint on local disk. `path` is resolved by the host from its model folders."""

    path: str
    weight_dtype: str = "default"  # default | bf16 | fp16 | fp32
    # ComfyUI-quantized layers: "auto" (comfy-kitchen's kernels where ComfyUI uses them), "dequantize", "kernel"
    quantized_matmul: str = "auto"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingSpec:
    """KSampler's inputs."""

    seed: int = 0
    steps: int = 20
    cfg: float = 1.0
    sampler_name: str = "euler"
    scheduler: str = "simple"
    denoise: float = 1.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ControlInput:
    """One ControlNet of a branch's chain, active for this call: ComfyUI's ControlNet after ControlNetApply.

    `path`: the ControlNet's weights as a safetensors file the workers load (the host exports the one
    ControlNetLoader built); `hint`: its cond_hint as ComfyUI's ControlNet.get_control prepares it for the
    latent's size (an image in [0, 1], or a latent already encoded), carried only when new to the workers
    and otherwise named by `hint_key`; `strength`: ControlNetApply's strength; `types`: a union ControlNet's
    control types (SetUnionControlNetType), each one token the ControlNet reads before the prompt."""

    path: str
    hint_key: str
    strength: float = 1.0
    hint: torch.Tensor | None = field(default=None, compare=False, repr=False)
    types: tuple[int, ...] = ()

    def signature(self) -> tuple:
        return (self.path, self.hint_key, self.strength, self.types)


def kept_key(kind: str, tensor: torch.Tensor) -> str:
    """The key a large per-run input (an attention mask, a camera embedding, Llama layers, a face video) is kept
    under on the workers: a hash of its bytes, shape and dtype. The client sends a kept input only when its key is
    new to the workers, so one key must always mean one tensor."""
    tensor = tensor.detach().cpu().contiguous()
    digest = hashlib.blake2b(tensor.view(torch.uint8).numpy(), digest_size=16)
    digest.update(repr((tuple(tensor.shape), str(tensor.dtype))).encode())
    return f"{kind}-{digest.hexdigest()}"


REFERENCE_METHODS = ("offset", "index", "uxo")  # ComfyUI's FluxKontextMultiReferenceLatentMethod choices
# Wan Bernini's in-context streams (BerniniConditioning's context_latents): clean latents [1, C, T, H, W] of their own
# sizes, embedded like the video and run through every block behind it, each on its own 3-D RoPE grid; a family
# that reads them says so in its reference_problem.
IN_CONTEXT_METHOD = "in_context"


@dataclass
class Conditioning:
    """One branch of ComfyUI conditioning: text tokens, pooled vector, distilled guidance, reference latents."""

    cond: torch.Tensor  # [B, T, context_dim]
    pooled: torch.Tensor  # [B, pooled_dim] ([B, 0] for T5-only encoders)
    guidance: float | None = None
    # ReferenceLatent (Flux Kontext, Qwen-Image Edit): raw VAE latents [1 or B, C, h, w], in chain order; video
    # latents [1, C, T, h, w] where the method says so (MiniMax-H3's layouts, IN_CONTEXT_METHOD).
    references: tuple[torch.Tensor, ...] = ()
    reference_method: str | None = None  # None: the family's default placement
    # (height, width, aspect ratio) in pixels that a text encode node attached (PixArt-α's size conditioning);
    # None: the latent's own size.
    image_size: tuple[float, float, float] | None = None
    # ComfyUI's c_concat [1 or B, Cc, H, W]: channels the model reads beside the latent, at its size and in the
    # model's latent space (Flux Fill's masked image and packed mask, Canny/Depth's control image; later Wan's
    # image-to-video frames). Packed and split with the latent's own tokens.
    concat: torch.Tensor | None = None
    # The ControlNets whose residuals this branch's DiT blocks add, in ComfyUI's chain order (first applied
    # first); a model call carries only the ones active at its timestep.
    control: tuple[ControlInput, ...] = ()
    # ComfyUI's attention_mask [1 or B, L, L]: an additive bias over the joint [text, image] sequence of this
    # call (L = prompt tokens + image tokens), in the model's dtype, as the host's extra_conds made it. Like a
    # ControlNet hint it crosses the channel once, named by `attention_mask_key` (a hash of its bytes).
    attention_mask: torch.Tensor | None = field(default=None, repr=False)
    attention_mask_key: str | None = None
    # ComfyUI's clip_fea [1 or B, N, 1280]: CLIP-vision penultimate hidden states of the start image
    # (CLIPVisionEncode -> WanImageToVideo), which Wan 2.1 image-to-video cross-attends beside the prompt.
    clip_vision: torch.Tensor | None = None
    # ComfyUI's txt_byt5 [1 or B, N, 1472]: ByT5 glyph tokens of the prompt's quoted text (HunyuanVideo 1.5's text
    # encoder makes them), which the model joins to its prompt stream.
    glyph: torch.Tensor | None = None
    # ComfyUI's camera_conditions [1 or B, 24, T, 8H, 8W]: WanCameraEmbedding's Plücker embedding at pixel size,
    # which a Wan Fun camera model's control adapter adds to its video tokens (split with them, frame by frame).
    # A model call's crosses the channel once per sampling run, kept on the workers under `camera_key` (a hash of
    # its bytes), like an attention mask: it is 8 x 8 x 24 / 16 = 96 times the size of the call's latent.
    camera: torch.Tensor | None = field(default=None, repr=False)
    camera_key: str | None = None
    # ComfyUI's vace_context [1 or B, n, C, T, H, W]: WanVaceToVideo's n control inputs (each its inactive and
    # reactive latents through process_in, then the 8x8-unshuffled mask: C = 96), as WAN21_Vace.extra_conds builds
    # them, and vace_strength, one per input. A VACE model's context blocks read them split with the video's tokens.
    vace: torch.Tensor | None = field(default=None, repr=False)
    vace_strength: tuple[float, ...] = ()
    # ComfyUI's conditioning_llama3 (the model call's encoder_hidden_states_llama3) [1 or B, 32, N, 4096]: every hidden
    # layer of Llama 3.1 8B over the prompt, as CLIPTextEncodeHiDream makes them; HiDream's blocks each read one. A
    # model call's crosses the channel once per sampling run, kept on the workers under `llama_key` (a hash of its
    # bytes), like the camera embedding: 32 layers x 128 tokens x 4096 is 64 MB per prompt in float32.
    llama: torch.Tensor | None = field(default=None, repr=False)
    llama_key: str | None = None
    # HiDream O1's reference images on their vision-tower path (HiDreamO1ReferenceImages; `references` holds their
    # 32-px stream): ComfyUI's ref_pixel_values [N, 3 x 2 x 16 x 16] and ref_image_grid_thw [K, 3] (int64), one
    # (t, h, w) patch grid per reference. The same for every row: the tower runs once per job.
    vision: torch.Tensor | None = field(default=None, repr=False)
    vision_grid: torch.Tensor | None = None
    # Wan 2.2 Animate (WanAnimateToVideo, WAN22_Animate.extra_conds): pose_latents [1 or B, 16, P, H, W], the pose
    # video's latent after process_latent_in, whose frame j joins the video's frame j + 1 (split with its tokens); and
    # face_pixel_values [1 or B, 3, F, 512, 512], the face crop of every pixel frame, which crosses the channel once
    # per sampling run under `face_key` (a hash of its bytes): 81 frames are 255 MB in float32.
    pose: torch.Tensor | None = field(default=None, repr=False)
    face: torch.Tensor | None = field(default=None, repr=False)
    face_key: str | None = None
    # Where the prompt holds each reference (Qwen-Image 2.1's image_slots, as TextEncodeQwenImage21 marks them): the
    # prompt row before which reference i sits, ascending; references past the list sit after the prompt. Empty:
    # every reference after the prompt.
    reference_slots: tuple[int, ...] = ()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        refs = {f"{prefix}.reference.{i}": r for i, r in enumerate(self.references)}
        extras = {f"{prefix}.{name}": t for name, t in (("concat", self.concat), ("clip_vision", self.clip_vision),
                                                        ("glyph", self.glyph),
                                                        ("llama", None if self.llama_key else self.llama),
                                                        ("camera", None if self.camera_key else self.camera),
                                                        ("vace", self.vace), ("vision", self.vision),
                                                        ("pose", self.pose),
                                                        ("face", None if self.face_key else self.face),
                                                        ("vision_grid", self.vision_grid))
                  if t is not None}
        return {f"{prefix}.cond": self.cond, f"{prefix}.pooled": self.pooled, **refs, **extras}

    def kept_keys(self) -> list[str]:
        """The keys of the large inputs the workers keep between calls: ControlNet hints, the attention mask."""
        return ([c.hint_key for c in self.control] + ([self.attention_mask_key] if self.attention_mask_key else [])
                + ([self.camera_key] if self.camera_key else []) + ([self.llama_key] if self.llama_key else [])
                + ([self.face_key] if self.face_key else []))

    def kept_inputs(self) -> dict[str, torch.Tensor]:
        """The kept inputs this branch carries, by key (the client sends each to the workers once)."""
        out = {c.hint_key: c.hint for c in self.control if c.hint is not None}
        if self.attention_mask_key and self.attention_mask is not None:
            out[self.attention_mask_key] = self.attention_mask
        if self.camera_key and self.camera is not None:
            out[self.camera_key] = self.camera
        if self.llama_key and self.llama is not None:
            out[self.llama_key] = self.llama
        if self.face_key and self.face is not None:
            out[self.face_key] = self.face
        return out

    def meta(self, prefix: str) -> dict:
        return {f"{prefix}_guidance": self.guidance, f"{prefix}_reference_method": self.reference_method,
                f"{prefix}_image_size": list(self.image_size) if self.image_size else None,
                f"{prefix}_control": [[c.path, c.hint_key, c.strength, list(c.types)] for c in self.control],
                f"{prefix}_attention_mask": self.attention_mask_key, f"{prefix}_camera": self.camera_key,
                f"{prefix}_vace_strength": list(self.vace_strength), f"{prefix}_llama": self.llama_key,
                f"{prefix}_reference_slots": list(self.reference_slots), f"{prefix}_face": self.face_key}

    @classmethod
    def from_message(cls, prefix: str, meta: dict, tensors: dict[str, torch.Tensor]) -> "Conditioning":
        count = sum(name.startswith(f"{prefix}.reference.") for name in tensors)
        refs = tuple(tensors[f"{prefix}.reference.{i}"] for i in range(count))
        size = meta.get(f"{prefix}_image_size")
        control = tuple(ControlInput(str(path), str(key), float(strength), types=tuple(int(t) for t in types))
                        for path, key, strength, types in meta.get(f"{prefix}_control") or ())
        return cls(tensors[f"{prefix}.cond"], tensors[f"{prefix}.pooled"], meta.get(f"{prefix}_guidance"),
                   refs, meta.get(f"{prefix}_reference_method"), tuple(size) if size else None,
                   tensors.get(f"{prefix}.concat"), control, attention_mask_key=meta.get(f"{prefix}_attention_mask"),
                   clip_vision=tensors.get(f"{prefix}.clip_vision"), glyph=tensors.get(f"{prefix}.glyph"),
                   camera=tensors.get(f"{prefix}.camera"), camera_key=meta.get(f"{prefix}_camera"),
                   vace=tensors.get(f"{prefix}.vace"),
                   vace_strength=tuple(float(v) for v in meta.get(f"{prefix}_vace_strength") or ()),
                   llama=tensors.get(f"{prefix}.llama"), llama_key=meta.get(f"{prefix}_llama"),
                   vision=tensors.get(f"{prefix}.vision"), vision_grid=tensors.get(f"{prefix}.vision_grid"),
                   pose=tensors.get(f"{prefix}.pose"), face=tensors.get(f"{prefix}.face"),
                   face_key=meta.get(f"{prefix}_face"),
                   reference_slots=tuple(int(v) for v in meta.get(f"{prefix}_reference_slots") or ()))

    def signature(self, prompt_tokens: int = 0) -> tuple:
        """What must be equal for two branches to share one forward pass (ComfyUI batches them then, and only
        with the same ControlNet chain). `prompt_tokens`: the length the family pads shorter prompts to (FLUX.2:
        512), so two prompts that pad to one length share a layout."""
        concat = None if self.concat is None else self.concat.shape[1]
        # ComfyUI batches two masked branches (their masks concatenate), never a masked with an unmasked one.
        masked = self.attention_mask is not None or self.attention_mask_key is not None
        clip = None if self.clip_vision is None else tuple(self.clip_vision.shape[1:])
        glyph = None if self.glyph is None else tuple(self.glyph.shape[1:])
        camera = None if self.camera is None else tuple(self.camera.shape[1:])
        vace = None if self.vace is None else (tuple(self.vace.shape[1:]), self.vace_strength)
        llama = None if self.llama is None else tuple(self.llama.shape[1:])
        vision = None if self.vision is None else (tuple(self.vision.shape), tuple(self.vision_grid.flatten().tolist()))
        # Wan Animate: the pose's frames and the face video's (ComfyUI batches branches whose shapes agree)
        animate = tuple(None if t is None else tuple(t.shape[1:]) for t in (self.pose, self.face))
        return (max(self.cond.shape[1], prompt_tokens), tuple(tuple(r.shape[2:]) for r in self.references),
                self.reference_method, self.reference_slots,
                concat, tuple(c.signature() for c in self.control), masked, clip, glyph, camera, vace, llama, vision,
                animate)


@dataclass
class VideoGuides:
    """LTX-2's guide frames in a model call (models/families/ltx2_guides.py reads and makes them): the grid indices
    of the video tokens the model runs (`kept`, ascending; the rest return zeros), the pixel-space positions of the
    guide tokens, which are the last kept ones (`coords` [3, guide tokens, 2]: start and end on the time, height and
    width axes, time in pixel frames), and each guide token's attention weight to the video (`weights` [guide
    tokens], None: all 1)."""

    kept: torch.Tensor
    coords: torch.Tensor
    weights: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"guides.kept": self.kept, "guides.coords": self.coords}
        if self.weights is not None:
            out["guides.weights"] = self.weights
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "VideoGuides | None":
        if "guides.kept" not in tensors:
            return None
        return cls(tensors["guides.kept"], tensors["guides.coords"], tensors.get("guides.weights"))


@dataclass
class Job:
    """Everything a worker needs for one denoise."""

    model: ModelSpec
    strategy: StrategySpec
    sampling: SamplingSpec
    latent: torch.Tensor  # [B, 16, H, W], ComfyUI LATENT space (raw VAE latent)
    positive: Conditioning
    negative: Conditioning | None = None
    extra: dict = field(default_factory=dict)
    # Set for one model call of a stock ComfyUI sampler (strategies/model_call.py): the model's timestep per
    # row of `latent` (a video family's per row and frame; LTX-2's also per row and token), which then holds the
    # input-scaled x of the call's chunks (positive = the first chunk, negative = the second); the result is the
    # model output, not a denoised latent.
    timestep: torch.Tensor | None = None
    # A model call's place in the host sampler's run: its step in the schedule (None: unknown; PipeFusion warms
    # up on the first steps), its slot (which of the call's jobs this is, a call of more than two chunks being
    # several jobs, and whether it starts with the uncond: the key of the stale K/V kept for the next call),
    # and whether the run's last step (the workers then drop what they kept for the next call).
    call_step: int | None = None
    call_slot: int = 0
    call_last: bool = False
    # LoRA-style patches each rank applies to the weights it holds (None: the file's own weights).
    weight_patches: "WeightPatches | None" = None
    # ComfyUI's patches_replace "dit" keys ((kind, index), e.g. ("double_block", 7)) whose patch skips its block
    # for this job (SkipLayerGuidanceDiT / SD3's guidance pass): the block's output is its input.
    skip_blocks: tuple[tuple[str, int], ...] = ()
    # The audio latent beside `latent` of an audio-video family (MiniMax-H3: ComfyUI's [B, 32, 2, frames], the second
    # tensor of its NestedTensor latent); under a model call its x, as `latent` is the video's. The result has both.
    audio: torch.Tensor | None = None
    # A model call's audio timesteps where they differ from the video's `timestep` (LTX-2: [rows] or [rows, audio
    # frames], ComfyUI's a_timestep from an audio noise mask); None: the audio runs at the video's per-row timestep.
    audio_timestep: torch.Tensor | None = None
    # A model call's guide frames (LTX-2's LTXVAddGuide): the video tokens that run, the guides' positions and
    # attention weights; None: every token runs at its grid position.
    video_guides: VideoGuides | None = None
    # A model call's reference audio tokens (LTX-2's LTXVReferenceAudio, ID-LoRA) [1 or rows, tokens, channels x bins]:
    # audio rows before the call's own, at timestep 0 and at times before 0, whose outputs are dropped.
    audio_reference: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        """Latent rows per conditioning: the latent batch, or one chunk's rows of a model call."""
        chunks = 2 if self.timestep is not None and self.negative is not None else 1
        return self.latent.shape[0] // chunks

    @property
    def batch_rows(self) -> slice | None:
        """Batch parallel: this job's images as rows of the whole batch (`extra["batch_rows"]`, which
        strategies/batch.cut_job writes: start, stop, whole batch); None where the job holds the whole batch."""
        rows = self.extra.get("batch_rows")
        return None if rows is None else slice(rows[0], rows[1])

    @property
    def images(self) -> int:
        """The whole batch's images (one chunk's rows of a model call), of which a batch group's job holds
        `batch_rows`."""
        rows = self.extra.get("batch_rows")
        return self.batch if rows is None else rows[2]


# What a LoRA-style weight patch may hold, per kind (ComfyUI's weight adapters and plain patch tuples).
PATCH_SLOTS = {
    "lora": ("up", "down", "mid", "dora_scale"),
    "loha": ("w1a", "w1b", "w2a", "w2b", "t1", "t2", "dora_scale"),
    "lokr": ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b", "t2", "dora_scale"),
    "diff": ("diff",),
    "set": ("value",),
}
PATCH_FUNCTIONS = (None, "swap_halves")  # what may act on a patch's delta (diffusers LoRA keys of a final norm)


@dataclass
class WeightPatch:
    """One entry of ComfyUI's patch list for one weight (the tuple comfy/lora.py's calculate_weight reads)."""

    kind: str  # a PATCH_SLOTS key
    tensors: dict[str, torch.Tensor]  # by slot name; absent slots are None in ComfyUI
    strength: float = 1.0
    strength_model: float = 1.0
    alpha: float | None = None
    offset: tuple[int, int, int] | None = None  # (dim, start, length): the patch covers that part of the weight
    function: str | None = None  # a PATCH_FUNCTIONS name


@dataclass
class WeightPatches:
    """Every weight patch on a MODEL (a LoRA stack), by ComfyUI's parameter name without "diffusion_model.".

    `id` changes whenever the patches do (ComfyUI's patches_uuid): workers keep the last sets they were sent (one per
    resident model, runtime.protocol.PATCH_SETS_KEPT), so its tensors cross the control channel once, and a job
    naming a kept id carries only the id."""

    id: str
    weights: dict[str, list[WeightPatch]]

    def meta(self) -> dict:
        return {"id": self.id, "weights": [[key, [{"kind": p.kind, "slots": sorted(p.tensors), "strength": p.strength,
                                                   "strength_model": p.strength_model, "alpha": p.alpha,
                                                   "offset": list(p.offset) if p.offset else None,
                                                   "function": p.function} for p in patches]]
                                           for key, patches in self.weights.items()]}

    def tensors(self) -> dict[str, torch.Tensor]:
        # Indices, not the keys themselves, name the tensors: ComfyUI's keys hold dots.
        return {f"patch/{n}/{i}/{slot}": t for n, patches in enumerate(self.weights.values())
                for i, p in enumerate(patches) for slot, t in p.tensors.items()}

    @classmethod
    def from_message(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> "WeightPatches":
        weights = {}
        for n, (key, patches) in enumerate(meta["weights"]):
            weights[key] = [WeightPatch(p["kind"], {s: tensors[f"patch/{n}/{i}/{s}"] for s in p["slots"]},
                                        p["strength"], p["strength_model"], p["alpha"],
                                        tuple(p["offset"]) if p["offset"] else None, p["function"])
                            for i, p in enumerate(patches)]
        return cls(meta["id"], weights)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
