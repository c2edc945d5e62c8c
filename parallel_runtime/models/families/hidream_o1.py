"""HiDream O1 (`hidream_o1_image_*.safetensors`, the `image_hidream_o1*` templates): a pixel-space DiT that is the
Qwen3-VL-8B decoder itself, over one sequence [prompt tokens, the image's 32x32 RGB patches, reference patches].

Read from ComfyUI 2026's comfy/ldm/hidream_o1/{model,attention,conditioning,utils}.py, comfy/text_encoders/
{llama,hidream_o1,qwen35}.py (qwen35: the vision tower), model_base.HiDreamO1, supported_models.HiDreamO1 and
comfy_extras' HiDreamO1ReferenceImages (the module tree here is our own, with
ComfyUI's parameter names; the code is not theirs):

- Prompt. The "text encoder" only tokenizes: the CONDITIONING's cross_attn is the token ids as float32 [1, L, 1]
  (exact: ids < 2^24) beside `text_input_ids`; here `Conditioning.cond` is that tensor (context_dim 1). The ids run
  through the decoder's own `embed_tokens` on the workers, and every row whose id is <|tms_token|> (151673, the last
  one of the chat template) is replaced by the timestep embedding t_embedder1((1 - t / 1000) x 1000) (t = sigma x
  1000, as model_base passes it): the prompt's rows depend on t, so the prompt is embedded again every step
  (`prompt_reads_timestep`).
- Image. The [B, 3, H, W] pixels (latent_formats.HiDreamO1Pixel: no VAE, identity in/out) as 32x32 patches,
  channel-major (c, p1, p2) as ComfyUI's einops pattern, through the bottleneck x_embedder (3072 -> hidden/4 ->
  hidden); H and W must be multiples of 32.
- Blocks: 36 Llama layers (pre-RMSNorm, eps 1e-6; GQA 32 q / 8 kv heads of 128, per-head q/k RMS norms ("gemma3"
  style: over the head's 128 channels, scale w, no +1); SwiGLU 12288 wide; no biases). k and v reach the attention
  strategy with their 8 heads (GQA's pairing: kv head j serves q heads [j g, (j + 1) g)): Ulysses sends each member
  the kv heads its q heads read, Ring passes the 8-head blocks, the kernel alone expands them
  (strategies/attention/gqa.py); tensor parallelism splits q heads with their kv heads.
- Positions: interleaved MRoPE (theta 5e6, sections [24, 20, 20] of the 64 frequencies: frequency i reads the H id
  where i % 3 == 1 and i < 60, the W id where i % 3 == 2 and i < 60, else the T id), rotate-half layout, angles in
  float32 (llama.py's precompute_freqs_cis). The position ids are model_base's get_rope_index_fix_point for a
  text-to-image call: prompt token i at (i, i, i), image patch (r, c) at (4096, 4096 + r, 4096 + c); rebuilt here
  from the prompt length and the grid (the conditioning's position_ids equal these, checked where they arrive).
- Attention is two-pass (attention.py's make_two_pass_attention(ar_len)): rows [0, ar_len) attend causally among
  themselves only, rows [ar_len, L) attend to every row. conditioning.build_extra_conds sets ar_len = prompt length - 1
  (token_types 0 on the prompt before <|tms_token|>, 1 from it on). Confirmed against vLLM-Omni's
  vllm_omni/diffusion/models/hidream_o1_image/utils_hidream_o1.py build_packed_attention_metadata: token_types == 0
  rows get a causal lower-triangular mask, token_types > 0 rows attend everything. Here it is `sequence_bias`: an
  additive -inf above the diagonal of the prefix rows, which every strategy cuts per query/key block at global
  positions (Ring per key chunk, exactly). ComfyUI also caches the prefix's K/V across steps: a pure speed-up (the
  prefix never reads a row that changes with t), recomputed here.
- Head: the decoder's final RMSNorm, final_layer2 (hidden -> 3072) gives x_pred per patch; the model output is the
  velocity (x - x_pred) / max(sigma, 1e-3) in float32, x read in the compute dtype (`head` takes the input rows:
  `head_reads_input`).
- Sampling (supported_models.HiDreamO1): ModelSamplingDiscreteFlow (CONST) at shift 3, multiplier 1000, and
  noise_scale 8: the starting x is sigma (8 noise) + (1 - sigma) latent.

- Reference images (HiDreamO1ReferenceImages; conditioning.build_extra_conds' edit branch, model._forward). Each
  reference takes two paths. (1) The Qwen3-VL vision tower (`visual.*`, Qwen35VisionModel: a Conv3d patch embedding
  of 2x16x16 patches, a bilinearly interpolated 48x48 position table, LayerNorm blocks with 2-D rotary attention per
  image, a 2x2 patch merger into the decoder's width) turns its 384 px copy into tokens that replace the prompt's
  <|image_pad|> rows (build_ref_input_ids splices [vision_start, pad x N, vision_end] per reference after the
  prompt's first 3 tokens, so they lie in the causal prefix). ComfyUI's tower never runs the Qwen3-VL deepstack
  mergers (Qwen35VisionModel sets deepstack_merger_list = None and model.py drops their weights), so nothing is added
  to early decoder layers and their keys are not loaded here either. The tower's output does not change during a
  run: a job runs it once (Branches.vision_rows), and the adapter keeps the last result for the next call of a
  stock sampler's run. (2) Its 32x32 patches (the image in [-1, 1]) ride behind the target's patches through
  x_embedder as image-stream rows (Conditioning.references: every rank splits them with the image, as any
  reference latent; their output rows are dropped). Positions: the prompt's text runs and each vision block follow
  get_rope_index_fix_point (a block at (s + n, s + n + r, s + n + c) after its n text tokens), the target stays at
  4096, each reference's patches start one past the previous block's largest id; ar_len is still the prompt length
  - 1. The tower loads on first use, from the same file, only on the ranks that embed the prompt (not PipeFusion's
  later stages), unsplit under tensor parallelism (~0.4B parameters at release: replicated, like the prompt).

Detection: `t_embedder1.mlp.0.weight` and `x_embedder.proj1.weight` (model_detection's keys) with the decoder's
per-head q norm, under ComfyUI's prefixes; the vision tower's shapes are read where the file has one.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ModelFileError
from ...sampling.flow import FluxModelSampling, LatentFormat
from ...weights.keymap import Source, block_count, tensor_shapes
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..conditioning import timestep_sinusoid
from ..detection import Signature, signature_match
from ..family import BlockKind, DiTFamily, JointAttentionConfig
from ..patchify import PatchTokens
from ..shapes import plain_kind, shapes_of_model

PATCH = 32  # pixels per token side (ComfyUI's PATCH_SIZE)
TMS_TOKEN_ID = 151673  # <|tms_token|>: its prompt row becomes the timestep embedding
IMAGE_ROPE_OFFSET = 4096  # get_rope_index_fix_point's fix_point: the image grid's ids start here
NOISE_SCALE = 8.0  # supported_models.HiDreamO1's sampling_settings
SHIFT = 3.0
LM = "language_model."  # ComfyUI's prefix of the decoder's tensors
BLOCK_LISTS = ("layers",)
ALWAYS_OWNED = ("t_embedder1.",)  # every stage embeds t (the prompt's tms row on the first, sigma for the head)
FIRST_STAGE = ("embed_tokens.", "x_embedder.")
LAST_STAGE = ("norm.", "final_layer2.")
DECODER_BLOCK = BlockKind("decoder", ("joint",))
HIDREAM_O1_PIXELS = LatentFormat("hidream_o1_pixel", 1.0, 0.0)  # latent_formats.HiDreamO1Pixel: identity
IMAGE_PAD_ID = 151655  # Qwen3-VL <|image_pad|>: a prompt row the vision tower's token replaces
VISION_SPLICE_AT = 3  # build_ref_input_ids puts the vision blocks after [<|im_start|>, user, \n]
VISION_HEADS = 16  # Qwen35VisionModel's heads (QWEN3VL_VISION_DEFAULTS; a file's shapes do not say it)
VISION_PREFIX = "visual."


def mrope_sections(head_dim: int) -> tuple[int, int, int]:
    """(T, H, W) frequencies of the head's head_dim / 2: Qwen3-VL's [24, 20, 20] at 128, the same 5/32 of the head
    for H and W at any other width (a small test model's)."""
    hw = head_dim * 5 // 32
    return head_dim // 2 - 2 * hw, hw, hw


@dataclass(frozen=True)
class HiDreamO1Config(JointAttentionConfig):
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 5_000_000.0
    norm_eps: float = 1e-6
    # The Qwen3-VL vision tower in the same file (0: none), read from its shapes: width, blocks, MLP width, position
    # table rows (48 x 48 at release), the Conv3d's patch (16) and frames (2), the merger's 2x2 spatial merge.
    vision_hidden: int = 0
    vision_depth: int = 0
    vision_intermediate: int = 0
    vision_positions: int = 0
    vision_patch: int = 16
    vision_temporal: int = 2
    vision_merge: int = 2

    family = "hidream_o1"
    title = "HiDream O1"
    text_encoders = "CheckpointLoaderSimple's CLIP of the HiDream O1 file (its tokenizer) and CLIPTextEncode"
    latent_downscale = 1  # pixel space
    patch_size = PATCH
    context_dim = 1  # the prompt arrives as token ids, one number per row
    pooled_dim = 0
    reads_references = True  # HiDreamO1ReferenceImages' 32-px patches (reference_problem) and vision tokens
    # supported_models.HiDreamO1 runs bf16 and fp32 only: the MLPs' down_proj activations overflow fp16 (NaNs).
    refused_weight_dtypes = {"fp16": "HiDream O1 overflows in fp16 (its MLP activations exceed fp16's range, as "
                                     "ComfyUI notes); choose weight_dtype bf16 or fp32"}

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ModelFileError(f"a HiDream O1 with {self.num_heads} query heads over {self.num_kv_heads} key/value "
                                 f"heads of {self.head_dim} is no Qwen3-VL shape; the file is damaged, so "
                                 f"re-download it.")

    @staticmethod
    def latent_problem(shape: tuple[int, ...]) -> str | None:
        h, w = shape[-2:]
        if h % PATCH or w % PATCH:
            return (f"the HiDream O1 image is {w}x{h} px, not a multiple of its 32 px patches; use "
                    f"EmptyHiDreamO1LatentImage's sizes (multiples of 32)")
        return None

    def prompt_problem(self, name: str, cond: torch.Tensor) -> str | None:
        """The prompt must be token ids of this vocabulary (whole numbers, as HiDreamO1TE's cross_attn holds them)."""
        ids = cond[..., 0]
        if cond.numel() and (not torch.equal(ids, ids.round()) or ids.min() < 0 or ids.max() >= self.vocab_size):
            return (f"the {name} conditioning is not HiDream O1 token ids (whole numbers below {self.vocab_size}); "
                    f"encode the prompt with {self.text_encoders}")
        return None

    @property
    def vision_pixels(self) -> int:
        """Values per vision-tower patch (ref_pixel_values' width: 3 x 2 x 16 x 16 = 1536 at release)."""
        return 3 * self.vision_temporal * self.vision_patch ** 2

    def reference_problem(self, name: str, refs, method) -> str | None:
        """HiDreamO1ReferenceImages' 32-px stream: RGB images [1 or B, 3, h, w] in [-1, 1] on the 32 px grid
        (conditioning.prepare_ref_images' ref_patches, unpatchified by the door)."""
        for k, ref in enumerate(refs):
            if ref.ndim != 4 or ref.shape[1] != 3 or ref.shape[-2] % PATCH or ref.shape[-1] % PATCH or \
                    min(ref.shape[-2:]) < PATCH:
                return (f"reference image {k + 1} of the {name} conditioning has shape {tuple(ref.shape)}, not a "
                        f"[batch, 3, h, w] image on HiDream O1's 32 px grid; attach the images with "
                        f"HiDreamO1ReferenceImages")
        if method is not None:
            return (f"HiDream O1 places its reference images itself, not by the {method!r} method; remove "
                    f"FluxKontextMultiReferenceLatentMethod")
        return None

    def vision_problem(self, name: str, c) -> str | None:
        """The vision tower's inputs of a conditioning with reference images: ref_pixel_values [N, 1536] and one
        (t, h, w) grid per reference, as many merged tokens as the prompt has <|image_pad|> rows."""
        if c.vision is None:
            return (None if not c.references else
                    f"the {name} conditioning carries HiDream O1 reference patches without their vision-tower "
                    f"inputs; attach the images with HiDreamO1ReferenceImages")
        if not self.vision_hidden:
            return (f"the {name} conditioning carries HiDream O1 reference images but this file has no vision tower "
                    f"(visual.*); load the complete hidream_o1_image checkpoint")
        grid = c.vision_grid
        merge = self.vision_merge ** 2
        if grid is None or grid.ndim != 2 or grid.shape[1] != 3 or len(c.references) != grid.shape[0] or \
                c.vision.ndim != 2 or c.vision.shape[-1] != self.vision_pixels or \
                int(grid.prod(-1).sum()) != c.vision.shape[0] or bool((grid[:, 1:] % self.vision_merge).any()):
            return (f"the {name} conditioning's vision-tower inputs do not describe its {len(c.references)} "
                    f"reference images; attach the images with HiDreamO1ReferenceImages")
        if not bool(torch.isfinite(c.vision).all()):
            return (f"the {name} conditioning's reference images hold NaN or infinite values; check the images "
                    f"given to HiDreamO1ReferenceImages")
        pads = int((c.cond[0, :, 0].round() == IMAGE_PAD_ID).sum())
        if pads != int(grid.prod(-1).sum()) // merge:
            return (f"the {name} prompt has {pads} <|image_pad|> tokens for {int(grid.prod(-1).sum()) // merge} "
                    f"vision tokens; attach the images with HiDreamO1ReferenceImages after CLIPTextEncode")
        return None

    def tensor_problem(self, degree: int) -> str | None:
        """Tensor parallelism splits the kv heads with their q heads: the degree must divide the kv heads too."""
        if self.num_kv_heads % degree:
            return (f"tensor_degree={degree} does not divide HiDream O1's {self.num_kv_heads} key/value heads; use a "
                    f"tensor degree that divides {self.num_kv_heads}, or split with ulysses_degree or ring_degree")
        return None

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        return (DECODER_BLOCK,) * self.num_layers

    @property
    def mlp_hidden(self) -> int:
        return self.intermediate_size

    @property
    def latent_channels(self) -> int:
        return 3  # RGB

    @property
    def sections(self) -> tuple[int, int, int]:
        return mrope_sections(self.head_dim)

    def random_prompt(self, tokens: int, generator: torch.Generator) -> torch.Tensor:
        """A bench's prompt as HiDreamO1TE's cross_attn holds one: random ids of this vocabulary as float32 [1, L, 1],
        ending in <|tms_token|> as every tokenized prompt does (its row carries the timestep)."""
        ids = torch.randint(0, TMS_TOKEN_ID, (1, tokens), generator=generator)
        ids[0, -1] = TMS_TOKEN_ID
        return ids.unsqueeze(-1).float()


# -- checkpoint layout --------------------------------------------------------------------------------

SIGNATURE = ("t_embedder1.mlp.0.weight", "x_embedder.proj1.weight", "final_layer2.linear.weight",
             LM + "embed_tokens.weight", LM + "layers.0.self_attn.q_norm.weight")
match_layout = signature_match(Signature("comfy", SIGNATURE))


def infer_config(reader, match, name: str) -> HiDreamO1Config:
    p = match.prefix
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    shape = tensor_shapes(reader, p, name, "a complete HiDream O1 DiT")
    layer = LM + "layers.0."
    vocab, hidden = shape(LM + "embed_tokens.weight")
    head_dim = shape(layer + "self_attn.q_norm.weight")[0]
    q, kv = shape(layer + "self_attn.q_proj.weight")[0], shape(layer + "self_attn.k_proj.weight")[0]
    patch_in = shape("x_embedder.proj1.weight")[1]
    if q % head_dim or kv % head_dim or patch_in != 3 * PATCH * PATCH or vocab <= TMS_TOKEN_ID:
        raise ModelFileError(f"{name}: {q} query and {kv} key/value channels of {head_dim}-wide heads, {patch_in} "
                             f"pixels per patch and a {vocab}-token vocabulary are no HiDream O1 shape; the file is "
                             f"damaged, so re-download it.")
    return HiDreamO1Config(hidden_size=hidden, num_layers=block_count(reader.keys(), p, LM + "layers", name),
                           num_heads=q // head_dim, num_kv_heads=kv // head_dim, head_dim=head_dim,
                           intermediate_size=shape(layer + "mlp.gate_proj.weight")[0], vocab_size=vocab,
                           **_vision_config(reader, p, name, hidden, shape))


def _vision_config(reader, p: str, name: str, hidden: int, shape) -> dict:
    """The vision tower's dims from its shapes ({} where the file has none: reference images are then refused).
    Its 16 heads are ComfyUI's constant: the width must split into 16 heads of a multiple of 4 channels (the
    rotary table's two axes of half the head each)."""
    v = VISION_PREFIX
    if p + v + "patch_embed.proj.weight" not in reader:
        return {}
    width, channels, frames, patch, _ = shape(v + "patch_embed.proj.weight")
    merged = shape(v + "merger.linear_fc1.weight")[1]
    merge = math.isqrt(merged // width) if width else 0
    out = shape(v + "merger.linear_fc2.weight")[0]
    if channels != 3 or width % (4 * VISION_HEADS) or merge * merge * width != merged or out != hidden:
        raise ModelFileError(f"{name}: a vision tower {width} wide over {channels} channels, merging {merged} into "
                             f"{out} for a {hidden}-wide decoder, is no HiDream O1 shape; the file is damaged, so "
                             f"re-download it.")
    return dict(vision_hidden=width, vision_depth=block_count(reader.keys(), p, v + "blocks", name),
                vision_intermediate=shape(v + "blocks.0.mlp.linear_fc1.weight")[0],
                vision_positions=shape(v + "pos_embed.weight")[0], vision_patch=patch, vision_temporal=frames,
                vision_merge=merge)


class _Attention(torch.nn.Module):
    def __init__(self, c: HiDreamO1Config):
        super().__init__()
        inner, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = torch.nn.Linear(c.hidden_size, inner, bias=False)
        self.k_proj = torch.nn.Linear(c.hidden_size, kv, bias=False)
        self.v_proj = torch.nn.Linear(c.hidden_size, kv, bias=False)
        self.o_proj = torch.nn.Linear(inner, c.hidden_size, bias=False)
        self.q_norm = torch.nn.RMSNorm(c.head_dim, eps=c.norm_eps)
        self.k_norm = torch.nn.RMSNorm(c.head_dim, eps=c.norm_eps)


class _MLP(torch.nn.Module):
    def __init__(self, c: HiDreamO1Config):
        super().__init__()
        self.gate_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _Layer(torch.nn.Module):
    def __init__(self, c: HiDreamO1Config):
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), _MLP(c)
        self.input_layernorm = torch.nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.post_attention_layernorm = torch.nn.RMSNorm(c.hidden_size, eps=c.norm_eps)


class _PatchEmbed(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj1 = torch.nn.Linear(3 * PATCH * PATCH, hidden // 4, bias=False)
        self.proj2 = torch.nn.Linear(hidden // 4, hidden)


class _Linear(torch.nn.Module):
    """A holder of one Linear named `linear` (ComfyUI's FinalLayer)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = torch.nn.Linear(n_in, n_out)


class _TimestepEmbedder(torch.nn.Module):
    """mmdit's TimestepEmbedder: a 256-wide sinusoid through Linear, SiLU, Linear (`mlp.0`, `mlp.2`)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden))


class HiDreamO1Model(torch.nn.Module):
    """The DiT's parameters under ComfyUI's names, the decoder's without `language_model.` (see source_map)."""

    def __init__(self, c: HiDreamO1Config):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = torch.nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = torch.nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.t_embedder1 = _TimestepEmbedder(c.hidden_size)
        self.x_embedder = _PatchEmbed(c.hidden_size)
        self.final_layer2 = _Linear(c.hidden_size, 3 * PATCH * PATCH)


class _VisionBlock(torch.nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width, eps=1e-6)
        self.norm2 = torch.nn.LayerNorm(width, eps=1e-6)
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(width, 3 * width)
        self.attn.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = torch.nn.Linear(width, inner)
        self.mlp.linear_fc2 = torch.nn.Linear(inner, width)


class VisionTower(torch.nn.Module):
    """Qwen35VisionModel's parameters under ComfyUI's names (the file's `visual.*`), without the deepstack mergers
    ComfyUI never runs."""

    def __init__(self, c: HiDreamO1Config):
        super().__init__()
        w, merged = c.vision_hidden, c.vision_hidden * c.vision_merge ** 2
        self.patch_embed = torch.nn.Module()
        kernel = (c.vision_temporal, c.vision_patch, c.vision_patch)
        self.patch_embed.proj = torch.nn.Conv3d(3, w, kernel_size=kernel, stride=kernel)
        self.pos_embed = torch.nn.Embedding(c.vision_positions, w)
        self.blocks = torch.nn.ModuleList(_VisionBlock(w, c.vision_intermediate) for _ in range(c.vision_depth))
        self.merger = torch.nn.Module()
        self.merger.norm = torch.nn.LayerNorm(w, eps=1e-6)
        self.merger.linear_fc1 = torch.nn.Linear(merged, merged)
        self.merger.linear_fc2 = torch.nn.Linear(merged, c.hidden_size)


@functools.lru_cache(maxsize=8)
def _meta(config: HiDreamO1Config) -> HiDreamO1Model:
    with torch.device("meta"):
        return HiDreamO1Model(config)


def meta_model(config: HiDreamO1Config) -> HiDreamO1Model:
    import copy

    return copy.deepcopy(_meta(config))


def _file_name(name: str) -> str:
    """The file's key of one of our parameters: the decoder's sit under `language_model.`."""
    return LM + name if name.startswith(("layers.", "embed_tokens.", "norm.")) else name


def source_map(config: HiDreamO1Config, layout: str, prefix: str = "") -> dict[str, Source]:
    return {n: Source(prefix + _file_name(n)) for n, _ in _meta(config).named_parameters()}


def vision_source_map(config: HiDreamO1Config, prefix: str = "") -> dict[str, Source]:
    with torch.device("meta"):
        tower = VisionTower(config)
    return {n: Source(prefix + VISION_PREFIX + n) for n, _ in tower.named_parameters()}


def checkpoint_shapes(config: HiDreamO1Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """{ComfyUI key: (shape, kind)} of the DiT's tensors, then the vision tower's where the config has one, in the
    modules' order."""
    def kind(name: str, p) -> str:
        return "table" if name.startswith(("embed_tokens", "pos_embed")) else plain_kind(name, p)

    shapes = shapes_of_model(_meta(config).named_parameters(), kind, _file_name)
    if config.vision_hidden:
        with torch.device("meta"):
            tower = VisionTower(config)
        shapes.update(shapes_of_model(tower.named_parameters(), kind, lambda name: VISION_PREFIX + name))
    return shapes


def tensor_plan(config: HiDreamO1Config) -> dict:
    """Each layer's q/k/v projections column-wise (contiguous q heads with their kv heads: every degree that
    divides the kv heads keeps GQA's groups whole), o_proj row-wise; the SwiGLU's gate/up column-wise, down row-wise.
    The per-head q/k norms need nothing. The token embedding (7% of a release's weights) keeps 1/N of the vocabulary:
    each step's prompt lookups are all-reduced (the prompt's rows: a few hundred KB)."""
    plan = {"embed_tokens": "vocab"}
    for i in range(config.num_layers):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        plan.update({f"{a}.q_proj": "colwise", f"{a}.k_proj": "colwise", f"{a}.v_proj": "colwise",
                     f"{a}.o_proj": "rowwise", f"{m}.gate_proj": "colwise", f"{m}.up_proj": "colwise",
                     f"{m}.down_proj": "rowwise"})
    return plan


# -- positions and the two-pass mask ------------------------------------------------------------------

def _grid_ids(rows: int, cols: int, frames: int = 1) -> torch.Tensor:
    """[frames x rows x cols, 3] (t, r, c) of a grid, row-major."""
    t, r, c = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([t.reshape(-1), r.reshape(-1), c.reshape(-1)], dim=-1)


def _text_ids(n: int, start: int) -> torch.Tensor:
    return (torch.arange(n) + start)[:, None].expand(n, 3)


def position_ids(text_len: int, rows: int, cols: int, vision: tuple = (), references: tuple = ()) -> torch.Tensor:
    """[L, 3] (T, H, W) ids of get_rope_index_fix_point over [prompt, target, reference patches].

    Text-to-image: prompt token i at (i, i, i), patch (r, c) at (4096, 4096 + r, 4096 + c). With references
    (`vision`: each one's merged (t, h, w) vision grid, spliced into the prompt after its first 3 tokens;
    `references`: each one's 32-px grid (rows, cols)): every run of n text tokens takes ids s.. s + n - 1 and the
    vision block after it (t, r, c) + s + n, s being one past the largest id so far; the target stays at 4096; each
    reference's patches take (0, r, c) + one past the largest id before them."""
    parts, start, placed = [], 0, 0
    for k, (t, h, w) in enumerate(vision):
        n = VISION_SPLICE_AT + 1 if k == 0 else 2  # [3 tokens, vision_start] or [vision_end, vision_start]
        parts += [_text_ids(n, start), _grid_ids(h, w, t) + start + n]
        start, placed = int(parts[-1].max()) + 1, placed + n + t * h * w
    parts.append(_text_ids(text_len - placed, start))
    parts.append(_grid_ids(rows, cols) + IMAGE_ROPE_OFFSET)
    for ref_rows, ref_cols in references:
        parts.append(_grid_ids(ref_rows, ref_cols) + int(parts[-1].max()) + 1)
    return torch.cat(parts).long()


def mrope_table(ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, head_dim] (rotate-half layout) of ids [L, 3]: precompute_freqs_cis with interleaved MRoPE, in
    float32 (a product of one id and one frequency: the same number as its matmul over one term)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=ids.device).float() / head_dim))
    freqs = ids.float().T[:, :, None] * inv_freq[None, None, :]  # [3, L, head_dim / 2]
    _, h, w = mrope_sections(head_dim)
    out = freqs[0].clone()
    out[..., 1:3 * h:3] = freqs[1, :, 1:3 * h:3]
    out[..., 2:3 * w:3] = freqs[2, :, 2:3 * w:3]
    emb = torch.cat([out, out], dim=-1)
    return emb.cos(), emb.sin()


def apply_mrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D] rotated by rows of cos/sin [S, D] (x1 cos - x2 sin, x2 cos + x1 sin over the halves), in
    float32, back in x's dtype (comfy_kitchen's kernel may round a bf16 product otherwise: within an ulp)."""
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()  # ComfyUI rounds the tables to x's dtype first
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[None, :, None] + rotated * sin[None, :, None]).to(x.dtype)


# -- the vision tower ---------------------------------------------------------------------------------

def _vision_position_table(table: torch.Tensor, grid: list, merge: int) -> torch.Tensor:
    """fast_pos_embed_interpolate: each image's (h, w) grid reads the square position table bilinearly at
    linspace(0, side - 1, h) x linspace(0, side - 1, w) (weights in float32, then the table's dtype, summed corner by
    corner in ComfyUI's order), repeated over its frames and put in the merger's 2x2-block order."""
    side = math.isqrt(table.shape[0])
    out = []
    for t, h, w in grid:
        hi = torch.linspace(0, side - 1, h, device=table.device)
        wi = torch.linspace(0, side - 1, w, device=table.device)
        hf, wf = hi.int(), wi.int()
        hc, wc = (hf + 1).clip(max=side - 1), (wf + 1).clip(max=side - 1)
        dh, dw = (hi - hf)[:, None], (wi - wf)[None, :]
        corners = ((hf, wf, (1 - dh) * (1 - dw)), (hf, wc, (1 - dh) * dw), (hc, wf, dh * (1 - dw)), (hc, wc, dh * dw))
        rows = None
        for r, c, weight in corners:
            term = table[(r[:, None] * side + c[None, :]).reshape(-1)] * weight.reshape(-1, 1).to(table.dtype)
            rows = term if rows is None else rows + term
        rows = rows.repeat(t, 1).view(t, h // merge, merge, w // merge, merge, -1)
        out.append(rows.permute(0, 1, 3, 2, 4, 5).flatten(0, 4))
    return torch.cat(out)


def _vision_rotary(grid: list, head_dim: int, merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, head_dim] of the tower's 2-D rotary embedding (theta 1e4 over head_dim / 2 channels per
    axis): each patch's (row, col) in the merger's 2x2-block order, in float32 (rot_pos_emb)."""
    dim = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    table = torch.outer(torch.arange(max(max(h, w) for _, h, w in grid), device=device, dtype=torch.float), inv_freq)
    coords = []
    for t, h, w in grid:
        br, bc, ir, ic = torch.meshgrid(torch.arange(h // merge), torch.arange(w // merge), torch.arange(merge),
                                        torch.arange(merge), indexing="ij")
        rc = torch.stack([(br * merge + ir).reshape(-1), (bc * merge + ic).reshape(-1)], dim=-1)
        coords.append(rc.repeat(t, 1))
    angles = table[torch.cat(coords).to(device)].flatten(1)
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.apply_rope on the tower's [N, heads, D]: x cos + rotate_half(x) sin with float32 tables (the product
    promotes to float32 in ComfyUI too), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


@torch.no_grad()
def run_vision_tower(tower: VisionTower, config: HiDreamO1Config, pixels: torch.Tensor, grid: list) -> torch.Tensor:
    """Qwen35VisionModel.forward: ref_pixel_values [N, 3 x 2 x 16 x 16] of images with (t, h, w) patch grids ->
    [N / 4, decoder width] tokens, in the tower's dtype. Attention runs per image (cu_seqlens), unmasked."""
    dtype, device = tower.pos_embed.weight.dtype, tower.pos_embed.weight.device
    c, merge = config, config.vision_merge
    x = tower.patch_embed.proj(pixels.to(device, dtype).view(-1, 3, c.vision_temporal, c.vision_patch,
                                                             c.vision_patch)).view(-1, c.vision_hidden)
    x = x + _vision_position_table(tower.pos_embed.weight, grid, merge).to(x.device)
    cos, sin = _vision_rotary(grid, c.vision_hidden // VISION_HEADS, merge, device)
    lengths = [t * h * w for t, h, w in grid]
    for block in tower.blocks:
        q, k, v = block.attn.qkv(block.norm1(x)).view(x.shape[0], 3, VISION_HEADS, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = [F.scaled_dot_product_attention(*(z.transpose(0, 1)[None] for z in parts))[0].transpose(0, 1)
               for parts in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        x = x + block.attn.proj(torch.cat(out).flatten(1))
        x = x + block.mlp.linear_fc2(F.gelu(block.mlp.linear_fc1(block.norm2(x)), approximate="tanh"))
    m = tower.merger
    merged = m.norm(x).view(-1, c.vision_hidden * merge * merge)
    return m.linear_fc2(F.gelu(m.linear_fc1(merged)))


def load_vision_tower(path: str, config: HiDreamO1Config, storage, device) -> VisionTower:
    """The tower's tensors from the file, on `device`, stored as the DiT's are (`storage`: a `weights.storage.Storage`
    or a compute dtype): ComfyUI builds the tower with the model's operations, so a scaled-fp8 file's tower layers
    hold fp8 weights and fp8-rounded biases there too. Its fp8 layers dequantize per call here, never through the
    strategies' input-scale hook (the tower runs on one rank, where a collective would wait for the others)."""
    import dataclasses

    from ...weights.checkpoint import open_checkpoint
    from ...weights.input_amax import InputAmax
    from ...weights.mapping import build_from_map
    from ...weights.storage import Storage

    storage = storage if isinstance(storage, Storage) else Storage(storage)
    storage = dataclasses.replace(storage, kernel_formats=frozenset(), input_amax=InputAmax())
    with torch.device("meta"):
        tower = VisionTower(config)
    with open_checkpoint(path) as reader:
        match = HIDREAM_O1.match(list(reader.keys()))  # this file's key prefix (the family's own detection)
        return build_from_map(tower, vision_source_map(config, match.prefix), reader, ("blocks",),
                              "HiDream O1 vision tower", dtype=storage, device=device)


def two_pass_allowed(text_len: int, length: int) -> torch.Tensor:
    """[L, L] True where a query (row) may read a key (column): the ar_len = text_len - 1 prefix rows causally among
    themselves, every later row everything (make_two_pass_attention)."""
    ar_len = max(text_len - 1, 0)
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    return (q >= ar_len) | (k <= q)


class _PixelFlowSampling(FluxModelSampling):
    """ModelSamplingDiscreteFlow + CONST with supported_models.HiDreamO1's noise_scale: the first x is
    sigma (8 noise) + (1 - sigma) latent, ComfyUI's operand order."""

    def noise_scaling(self, sigma, noise: torch.Tensor, latent: torch.Tensor, max_denoise: bool = False):
        sigma = torch.as_tensor(sigma, dtype=noise.dtype, device=noise.device)
        sigma = sigma.view(()) if sigma.numel() == 1 else sigma.view(-1, *([1] * (noise.ndim - 1)))
        return sigma * (NOISE_SCALE * noise) + (1.0 - sigma) * latent


# -- the strategies' view -----------------------------------------------------------------------------

class HiDreamO1Adapter(PatchTokens, BlockLoop):
    patch = PATCH
    latent_format = HIDREAM_O1_PIXELS
    default_guidance = 0.0  # no guidance input
    prompt_reads_timestep = True  # the <|tms_token|> row is the timestep's embedding: embedded again every step
    head_reads_input = True  # velocity = (x - x_pred) / sigma needs the input rows

    def __init__(self, config: HiDreamO1Config, model, chunks: list[range], context):
        self.config, self.model, self.chunks, self.context = config, model, chunks, context
        self.latent_channels = 3
        self.dtype, self.device = compute_placement(model.layers[chunks[0][0]].input_layernorm)

    @functools.cached_property
    def model_sampling(self):
        return _PixelFlowSampling(SHIFT, 1000.0, kind="discrete_flow")

    def _merged(self, vision: tuple) -> tuple:
        """(t, h, w) patch grids of the tower -> the merged grids of its tokens in the prompt."""
        m = self.config.vision_merge
        return tuple((t, h // m, w // m) for t, h, w in vision)

    def rope(self, text_len: int, h: int, w: int, references=(), method=None,
             vision=()) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the canonical [prompt, image, reference patches] sequence; `references`: the reference
        images' (height, width), `vision`: their tower grids (the prompt's vision blocks)."""
        refs = tuple((rh // PATCH, rw // PATCH) for rh, rw in references)
        ids = position_ids(text_len, h // PATCH, w // PATCH, self._merged(vision), refs).to(self.device)
        return mrope_table(ids, self.config.head_dim, self.config.rope_theta)

    def sequence_bias(self, text_len: int, hw: tuple[int, int], references=()) -> torch.Tensor:
        """The two-pass mask as an additive bias [1, L, L] (0 or -inf, compute dtype) over [prompt (its vision
        tokens inside the causal prefix), image, reference patches]: the strategies cut each call's block of it.
        Kept for the last layout only (a stock sampler repeats one)."""
        length = text_len + sum((a // PATCH) * (b // PATCH) for a, b in (tuple(hw), *references))
        key = (text_len, length)
        cached = getattr(self, "_last_bias", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        allowed = two_pass_allowed(text_len, length).to(self.device)
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        self._last_bias = (key, bias[None])
        return bias[None]

    # -- embeddings ------------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        e = self.model.x_embedder
        return e.proj2(e.proj1(tokens.to(self.device, self.dtype)))

    def _time_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[N, hidden]: t_embedder1 at t_pixeldit x 1000, t_pixeldit = 1 - t / 1000, as ComfyUI's _forward rounds."""
        sigma = t.to(self.device).float() / 1000.0
        sinusoid = timestep_sinusoid((1.0 - sigma) * 1000).to(self.dtype)
        return self.model.t_embedder1.mlp(sinusoid)

    def embed_vision(self, pixels: torch.Tensor, grid: tuple) -> torch.Tensor:
        """The reference images' vision tokens [N, hidden] in the compute dtype: the tower (loaded from the model's
        file on first use) over ref_pixel_values. A stock sampler's run repeats the same inputs every call, so the
        last result is kept beside them (ComfyUI keeps it likewise, by the tensor's identity)."""
        last = getattr(self, "_last_vision", None)
        if last is not None and last[1] == grid and last[0].shape == pixels.shape and torch.equal(last[0], pixels):
            return last[2]
        if getattr(self, "vision_tower", None) is None:
            path = getattr(self, "source_file", None)
            if path is None:
                raise ValueError("this HiDream O1 adapter has no file to load its vision tower from (a ParaDiT bug)")
            storage = getattr(self, "source_storage", None) or self.dtype  # the DiT's, where the worker built it
            self.vision_tower = load_vision_tower(path, self.config, storage, self.device)
        rows = run_vision_tower(self.vision_tower, self.config, pixels, list(grid)).to(self.dtype)
        self._last_vision = (pixels, grid, rows)
        return rows

    def embed_text(self, cond: torch.Tensor, t: torch.Tensor | None = None, clip_vision=None, glyph=None,
                   vision: torch.Tensor | None = None):
        """The whole prompt's rows: embed_tokens of the ids (cond [N, L, 1]); with reference images, the first
        row's <|image_pad|> rows replaced by the vision tokens `vision` in every row (as ComfyUI: the pads lie where
        build_ref_input_ids put them, the same in each chunk); then the <|tms_token|> rows replaced by the timestep
        embedding at `t` (one per row of cond)."""
        if t is None:
            raise ValueError("HiDream O1's prompt embedding needs the step's timestep (prompt_reads_timestep)")
        ids = cond[..., 0].to(self.device).round().long()
        rows = self.model.embed_tokens(ids).to(self.dtype)
        if vision is not None:
            # the pads' rows, found once per prompt tensor (a job's steps hand the same one; on a GPU each search
            # would be a sync)
            last = getattr(self, "_last_pads", None)
            if last is None or last[0] is not cond:
                last = self._last_pads = (cond, (ids[0] == IMAGE_PAD_ID).nonzero()[:, 0])
            rows[:, last[1]] = vision.to(rows.dtype)[None].expand(rows.shape[0], -1, -1)
        tms = (ids == TMS_TOKEN_ID)[..., None]
        return torch.where(tms, self._time_rows(t)[:, None].to(rows.dtype), rows)

    def timestep_embedding(self, t: torch.Tensor, pooled, guidance, hw=None) -> torch.Tensor:
        """The blocks read no conditioning vector; the head reads the timesteps (sigma x 1000) per row."""
        return t.to(self.device, torch.float32).flatten()

    # -- blocks and head -------------------------------------------------------------------------------

    def run_blocks(self, image: torch.Tensor, text: torch.Tensor, temb, rope, chunk: int = 0) -> tuple:
        """This rank's [prompt, image] rows through its decoder layers (one stream, one set of weights)."""
        n_text = text.shape[1]
        x = torch.cat([text, image.to(text.dtype)], dim=1)
        for i in self.active_blocks(chunk):
            x = self._layer(i, x, rope)
        return x[:, n_text:], x[:, :n_text]

    def _layer(self, i: int, x: torch.Tensor, rope) -> torch.Tensor:
        layer = self.model.layers[i]
        x = x + self._attention(i, layer.self_attn, layer.input_layernorm(x), rope)
        mlp = layer.mlp
        h = layer.post_attention_layernorm(x)
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

    def _attention(self, i: int, attn, x: torch.Tensor, rope) -> torch.Tensor:
        d = self.config.head_dim
        q = attn.q_norm(attn.q_proj(x).unflatten(-1, (-1, d)))  # a tensor-parallel rank's share of the heads
        k = attn.k_norm(attn.k_proj(x).unflatten(-1, (-1, d)))
        v = attn.v_proj(x).unflatten(-1, (-1, d))
        q, k = apply_mrope(q, *rope), apply_mrope(k, *rope)
        # GQA: k and v keep their own heads (kv head j serves q heads [j g, (j + 1) g)); the strategy moves them so
        # and only the kernel expands them (strategies/attention/gqa.py).
        out = self.context.attention(q, k, v, i).flatten(2, 3).to(x.dtype)
        return attn.o_proj(out)

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None, x: torch.Tensor | None = None):
        """Velocity in float32 per patch, in pack's order: (x - x_pred) / max(sigma, 1e-3), x as the model read it
        (the compute dtype), x_pred = final_layer2(norm(rows)); temb: the timesteps, sigma = t / 1000."""
        if x is None:
            raise ValueError("HiDream O1's head needs the input rows (head_reads_input)")
        x_pred = self.model.final_layer2.linear(self.model.norm(image))
        sigma = (temb.float() / 1000.0).clamp_min(1e-3)
        return (x.to(self.device, self.dtype).float() - x_pred.float()) / sigma.view(-1, 1, 1)


def block_inputs(config: HiDreamO1Config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image rows, prompt rows, timesteps, RoPE) of one layer call over a near-square grid."""
    h, cols = config.hidden_size, max(1, math.isqrt(image))
    ids = position_ids(text, -(-image // cols), cols)[:text + image]
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator),
            torch.full((1,), 500.0), mrope_table(ids, config.head_dim, config.rope_theta))


HIDREAM_O1 = DiTFamily(
    name="hidream_o1", title="HiDream O1", match=match_layout, infer_config=infer_config, meta_model=meta_model,
    source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=HiDreamO1Adapter,
    block_lists=BLOCK_LISTS, always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE,
    comfy_layout="comfy", replace_keys=("double_block",), block_inputs=block_inputs, tensor_plan=tensor_plan)
