"""The model-family seam: everything the runtime needs from one DiT family, behind one small interface.

A family reads a checkpoint's keys (does this file belong to me, in which key layout?), infers its config
from tensor shapes alone, builds the blocks one rank owns, and wraps the built model in an adapter: the
object strategies call (token layout, positions, embeddings, the ordered block list, the head). Planning
(PipeFusion stages, the cost model, memory) asks the family for block costs and parameter counts.
Strategies never import a family module; the families (`families/`) import this seam, and `registry` lists
them, so adding a family is a module there plus one line in `registry`.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch

from ..errors import ModelFileError


@dataclass(frozen=True)
class Match:
    """How a family reads one file: its key layout (e.g. "bfl", "diffusers") and the prefix before the keys."""

    layout: str
    prefix: str


class DiTAdapter(Protocol):
    """What strategies call on a built model (see FluxAdapter for the reference implementation)."""

    config: object
    dtype: torch.dtype
    device: torch.device
    patch: int  # latent pixels per token side (2: Flux's 2x2 patches; 1: FLUX.2, Qwen-Image 2.1)

    @staticmethod
    def pack(latent: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor: ...


class ControlNetBlocks:
    """What a ControlNet adapter built on its family's DiT adapter adds (Flux's, SD3's, Qwen-Image's): one chunk per
    ControlNet block (the adapter is built with chunks [i, i + 1)) and `projections`, one per block, so a pass over
    the blocks yields one residual per block."""

    projections: list  # one output projection per ControlNet block, in block order

    def embed_control_image(self, x_tokens: torch.Tensor, hint_rows: torch.Tensor, index: torch.Tensor,
                            hw: tuple[int, int]) -> torch.Tensor:
        """The latent's embedded rows (`index`, `hw`: where they sit, for position tables) + the hint's rows."""
        return self.embed_image(x_tokens, index, hw) + hint_rows

    def residuals(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope) -> list[torch.Tensor]:
        """One residual per ControlNet block, for the image rows of `image`."""
        out = []
        for k, projection in enumerate(self.projections):
            image, text = self.run_blocks(image, text, temb, rope, chunk=k)
            out.append(projection(image))
        return out


class ModelFamily(Protocol):
    name: str  # short id used in logs, bench rows and test names: "flux"
    title: str  # what users call it: "Flux.1 (dev/schnell)"

    def match(self, keys: list[str]) -> Match | None:
        """This family's layout and prefix for these checkpoint keys, or None if they are not this family's."""

    def infer_config(self, reader, match: Match, name: str):
        """The family's config from tensor names and shapes (no tensor data is read)."""

    def build(self, config, reader, match: Match, owned: Callable[[str], bool], dtype: torch.dtype,
              device: torch.device, smap: dict | None = None, tensor=None,
              shard: tuple[int, int] | None = None) -> torch.nn.Module:
        """The module tree with only the parameters `owned` selects (others stay on the meta device); `smap`: the
        file's source map when the caller already has it; `tensor`: a tensor-parallel rank's split
        (strategies.tensor.TensorSplit), which reads only that rank's part of each planned layer; `shard`: (index,
        degree) of shard_weights, which keeps that slice of each block's bytes."""

    def tensor_plan_for(self, config) -> dict:
        """Which layers tensor parallelism splits: module-name patterns -> "colwise" / "rowwise" / "norm" (see
        strategies/tensor.py); empty where the family's layers do not split."""

    def pipeline_stages(self, config, stages: int, speeds: tuple[float, ...] = ()) -> list[list[range]]:
        """Per PipeFusion stage, the block ranges it runs (balanced by block cost, and by stage speed)."""

    def stage_ownership(self, config, chunks: list[range], first: bool, last: bool) -> Callable[[str], bool]:
        """Which parameter names a stage running `chunks` must load."""

    def adapter(self, config, model: torch.nn.Module, chunks: list[range], context) -> DiTAdapter:
        """The strategies' view of a built model."""

    def parameter_counts(self, config) -> tuple[tuple[int, ...], int, int, int]:
        """(per block, always owned, first stage only, last stage only) parameter counts."""

    def source_map(self, config, layout: str, prefix: str = "") -> dict:
        """Every diffusers parameter name -> its `keymap.Source` in a checkpoint of `layout`."""

    def checkpoint_shapes(self, config) -> dict[str, tuple[tuple[int, ...], str]]:
        """{original-layout key: (shape, kind)} of a complete file, for writing random test checkpoints."""

    def probe_block(self, config, index: int, context, text_tokens: int, image_tokens: int, dtype: torch.dtype,
                    device: str | torch.device) -> Callable[[], object]:
        """Block `index` alone with random weights, run as the runtime runs it, on random inputs of one job's
        shapes (what the cost model times and counts FLOPs of)."""


@dataclass(frozen=True)
class BlockKind:
    """One kind of block a family has, as the cost model times it: a name, and per attention layer whose rows
    attend to whose: "joint" ([prompt, image] over [prompt, image]), "image" (image over image), "prompt"
    (image rows over the whole prompt: cross-attention, which every rank holds); a two-stream family's audio rows
    (LTX-2, `config.audio_rows`): "audio" (audio over audio), "audio_prompt" (audio over the prompt), "a2v" (image
    over audio), "v2a" (audio over image)."""

    name: str
    attention: tuple[str, ...]
    fused: bool = False  # attention and MLP share one output projection (Flux's single blocks)

    @property
    def prompt_rows(self) -> bool:
        """Whether the prompt's rows run through the block's linear layers (they do where it attends jointly)."""
        return "joint" in self.attention

    @property
    def tensor_reductions(self) -> tuple[str, ...]:
        """Under tensor parallelism, whose rows each of the block's all-reduces sums ("joint": prompt and image,
        "image"): one per attention layer's out-projection (cross-attention's over the image rows) and one for the
        MLP, or one in all where a fused projection ends the block."""
        mlp = "joint" if self.prompt_rows else "image"
        image = tuple("joint" if a == "joint" else "image" for a in self.attention if a not in AUDIO_QUERY_LAYERS)
        return (mlp,) if self.fused else image + (mlp,)


# Attention layers whose outputs are audio rows (their all-reduces sum ~1-2% of the video's rows: left out).
AUDIO_QUERY_LAYERS = ("audio", "audio_prompt", "v2a")


JOINT_BLOCK = BlockKind("joint", ("joint",))


class JointAttentionConfig:
    """Configs of families whose blocks each run one joint [prompt, image] self-attention (all but PixArt;
    SD3.5 Medium adds image-only layers); a family with other blocks says so in `block_kinds`."""

    concat_channels = 0  # channels read beside the latent (ComfyUI's c_concat); Flux Fill/Canny/Depth have some
    video = False  # True where latents are [B, C, T, H, W] (Wan)
    clip_vision_width = None  # width of the CLIP-vision tokens (ComfyUI's clip_fea) a model reads; None: reads none
    concat_nodes = "InpaintModelConditioning (Fill) or InstructPixToPixConditioning (Canny/Depth)"  # c_concat's makers
    # Latent pixels per token side (FLUX.2's 128-channel latent: 1). Wan, SD3 and PixArt configs have their own
    # patch_size fields (Wan's a 3-D tuple): count tokens with `registry.token_patch(config)`, which reads the adapter.
    patch_size = 2
    latent_downscale = 8  # image pixels per latent pixel side (ComfyUI's spacial_downscale_ratio; FLUX.2: 16)

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        """Per block, in pipeline order, its kind (the cost model times one block of each)."""
        return (JOINT_BLOCK,) * self.num_blocks

    @property
    def attention_layers(self) -> tuple[tuple[bool, ...], ...]:
        """Per block, its self-attention layers: True where the prompt rows join (see traffic.Shapes);
        cross-attention moves nothing, so it is not listed."""
        return tuple(tuple(layer == "joint" for layer in kind.attention if layer != "prompt")
                     for kind in self.block_kinds)


class TwoBlockListConfig(JointAttentionConfig):
    """Configs of families with two block lists run one after the other, which strategies, PipeFusion and the cost
    model see as one: `num_layers` blocks of `first_kind` (double-stream in Flux, Chroma, FLUX.2 and HiDream; FLUX.3's
    image mode blocks), then `num_single_layers` of `second_kind` (single-stream; each family's own kind, since
    Flux's fuses its attention and MLP projections and the others do not)."""

    first_kind: ClassVar[BlockKind]
    second_kind: ClassVar[BlockKind]

    @property
    def num_blocks(self) -> int:
        return self.num_layers + self.num_single_layers

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        return (self.first_kind,) * self.num_layers + (self.second_kind,) * self.num_single_layers


class FixedHeadSizeConfig:
    """Configs whose family fixes the head size (SD3 64, PixArt 72): the width sets the head count, and the
    latent has the model's input channels."""

    head_dim: int  # set by the family's config class

    def check_width(self, what: str) -> None:
        if self.hidden_size % self.head_dim:
            raise ModelFileError(f"{what} {self.hidden_size} is not a multiple of its head size {self.head_dim}; "
                                 f"the file is damaged, so re-download it.")

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim

    @property
    def latent_channels(self) -> int:
        return self.in_channels


class OneBlockListConfig(JointAttentionConfig):
    """What configs of families with one block list and a 4x MLP share (SD3, Qwen-Image, PixArt)."""

    num_single_layers = 0  # planning sees `num_layers` blocks and no single-stream ones

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.hidden_size


@dataclass(frozen=True, eq=False)
class DiTFamily:
    """A ModelFamily assembled from one family module's pieces: the module says how to read its files (match,
    infer_config, source_map, checkpoint_shapes), which diffusers model holds the weights, which block lists
    PipeFusion splits and which other modules every, the first or the last stage owns; building, stage
    planning and parameter counting are the same for every family and live here."""

    name: str
    title: str
    match: Callable[[list[str]], Match | None]
    infer_config: Callable  # (reader, match, name) -> config
    meta_model: Callable[[object], torch.nn.Module]  # config -> the diffusers model on the meta device
    source_map: Callable  # (config, layout, prefix) -> {parameter: keymap.Source}
    checkpoint_shapes: Callable  # config -> {original key: (shape, kind)}
    adapter_class: type
    block_lists: tuple[str, ...]  # the model's ModuleLists of blocks, in pipeline order
    always_owned: tuple[str, ...]
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    comfy_layout: str  # the key layout whose names are ComfyUI's parameter names (what LoRA patches name)
    # (config, text rows, image rows, generator) -> random (image, text, temb, rope) of one run_blocks call, on
    # the CPU: hidden states and temb in float32, rope as the adapter makes it (None where positions are added);
    # a two-stream family returns its own run_blocks arguments, RoPE last
    block_inputs: Callable
    after_build: Callable[[torch.nn.Module], None] | None = None  # settings the key map cannot carry (eps, ...)
    # Per block list, the key ComfyUI's model of this family gives its blocks in patches_replace["dit"]
    # (SkipLayerGuidance); () where ComfyUI's model reads no block replacements (PixArt).
    replace_keys: tuple[str, ...] = ("double_block", "single_block")
    # The family's ControlNets, None where they do not run on the workers: reader -> its config (how many
    # residuals, `residual_index` over the DiT's blocks); (reader, dtype, device, attention context, tensor=None: a
    # tensor rank's split, cutting its blocks as the DiT's, dit=None: the DiT's adapter, for a ControlNet that reads
    # some of the DiT's layers, as SD3.5's do) -> the adapter strategies run (hint_tokens, hint_cache,
    # embed_text, timestep_embedding, embed_control_image(x rows, hint rows, their index, latent size), residuals,
    # use_layers, reads_types; `net`: its module, `model`: the part tensor parallelism binds).
    controlnet_config: Callable | None = None
    load_controlnet: Callable | None = None
    # Whether ComfyUI's model of this family reads the `attention_mask` extra cond (an additive bias over the
    # joint [text, image] sequence, e.g. StyleModelApply's attn_bias): Flux's and Chroma's do.
    attention_mask: bool = False
    # Tensor parallelism's plan, config -> {module-name pattern: style} (strategies/tensor.py): None derives it
    # from the diffusers model (its class's `_tp_plan` where diffusers declares one, else from diffusers' Attention
    # and FeedForward names: `derived_tensor_plan`); a family whose layers cannot split returns {}.
    tensor_plan: Callable | None = None

    def build(self, config, reader, match: Match, owned, dtype, device, smap: dict | None = None,
              tensor=None, shard: tuple[int, int] | None = None) -> torch.nn.Module:
        """`tensor`: a tensor rank's TensorSplit; `shard` (index, degree): keep that slice of every block's bytes
        (shard_weights; the blocks in `model.sharded_blocks`, gathered by strategies.sharded_weights)."""
        from ..weights.mapping import build_from_map

        smap = smap if smap is not None else self.source_map(config, match.layout, match.prefix)
        what = f"{getattr(config, 'title', self.title)} DiT"
        model = self.meta_model(config)
        if tensor is not None:
            smap = tensor.shard(model, self.tensor_plan_for(config), smap, what)
        model = build_from_map(model, smap, reader, self.block_lists, what, owned=owned, dtype=dtype, device=device,
                               shard=shard)
        if self.after_build is not None:
            self.after_build(model)
        return model

    def parameter_counts(self, config) -> tuple[tuple[int, ...], int, int, int]:
        return _parameter_counts(self, config)

    def tensor_plan_for(self, config) -> dict:
        return dict(_tensor_plan(self, config))  # a copy: the cached plan is shared

    def pipeline_stages(self, config, stages: int, speeds: tuple[float, ...] = ()) -> list[list[range]]:
        from ..distributed.stages import balanced_stages

        return balanced_stages(self.parameter_counts(config), stages, speeds)

    def stage_ownership(self, config, chunks: list[range], first: bool, last: bool) -> Callable[[str], bool]:
        from ..distributed.stages import prefix_ownership

        return prefix_ownership(self.block_lists, _block_list_sizes(self, config), chunks, self.always_owned,
                                self.first_stage if first else (), self.last_stage if last else ())

    def adapter(self, config, model: torch.nn.Module, chunks: list[range], context) -> DiTAdapter:
        return self.adapter_class(config, model, chunks, context)

    def probe_block(self, config, index: int, context, text_tokens: int, image_tokens: int, dtype: torch.dtype,
                    device: str | torch.device) -> Callable[[], object]:
        """Block `index` alone with random weights, its processors set and called by the family's own adapter
        (`run_blocks` over that one block) on random inputs of one job's shapes; the rest of the model stays
        on the meta device. On device "meta" it runs nothing, which is how the cost model counts FLOPs."""
        model = self.meta_model(config)
        block = [b for attr in self.block_lists for b in getattr(model, attr)][index]
        generator = torch.Generator().manual_seed(index)
        if torch.device(device).type != "meta":
            block.to_empty(device="cpu")  # drawn on the CPU, so the same weights on every device
            _randomize(block, generator)
        block.to(device, dtype).eval()
        adapter = self.adapter(config, model, [range(index, index + 1)], context)
        # run_blocks' arguments, RoPE last: (image, text, temb, rope), or a two-stream family's own (LTX-2's video,
        # audio, prompts, modulation, rope)
        *inputs, rope = self.block_inputs(config, text_tokens, image_tokens, generator)
        inputs = [_to(x, device, dtype) for x in inputs]
        rope = _to(rope, device, None)  # the adapters keep RoPE tables in float32
        return lambda: adapter.run_blocks(*inputs, rope)

    def replaced_blocks(self, config, keys) -> frozenset[int]:
        """Indices into the ordered block list of ComfyUI's patches_replace "dit" keys ((kind, i)); a key this
        family's ComfyUI model never looks up (a kind it lacks, an index past its list) changes nothing there,
        so nothing here either."""
        offsets, start = {}, 0
        for kind, size in zip(self.replace_keys, _block_list_sizes(self, config)):
            offsets[kind] = (start, size)
            start += size
        return frozenset(offsets[kind][0] + i for kind, i in keys if kind in offsets and 0 <= i < offsets[kind][1])

    def weight_patch_targets(self, config) -> dict:
        """ComfyUI parameter name -> [(diffusers parameter, Source)]: where a LoRA patch of that name lands."""
        return _weight_patch_targets(self, config)


def diffusers_meta_model(class_name: str) -> Callable[[object], torch.nn.Module]:
    """A family's `meta_model` where its module tree is diffusers' class `class_name` built from the config's
    `diffusers_kwargs()`: config -> that model on the meta device (no memory; diffusers imported on first use)."""
    def meta_model(config) -> torch.nn.Module:
        import diffusers

        with torch.device("meta"):
            return getattr(diffusers, class_name)(**config.diffusers_kwargs())

    meta_model.__qualname__ = meta_model.__name__ = f"meta_{class_name}"
    return meta_model


def derived_tensor_plan(model: torch.nn.Module, block_lists: tuple[str, ...]) -> dict[str, str]:
    """A tensor-parallel plan from diffusers' names, for models whose class declares none: in every block, each
    Attention's q/k/v (and added-stream) projections column-wise and its out-projections row-wise, a q/k norm over
    the whole width of its heads as "norm" (a per-head one needs nothing), and each FeedForward's input projection
    column-wise (in halves where a GLU gates it) and its output row-wise, or, where it is a LLaMA-style SwiGLU
    (w1 gate, w3 up, w2 down: Z-Image's), w1 and w3 column-wise and w2 row-wise. An attention without an
    out-projection (a fused single-stream block) cannot be derived: then the plan is empty and the family must
    write its own."""
    plan: dict[str, str] = {}
    for attr in block_lists:
        for i, block in enumerate(getattr(model, attr)):
            for name, module in block.named_modules():
                where = f"{attr}.{i}.{name}" if name else f"{attr}.{i}"
                attention = isinstance(getattr(module, "to_q", None), torch.nn.Linear)
                if attention and isinstance(getattr(module, "heads", None), int):
                    if not _attention_plan(module, where, plan):
                        return {}
                elif isinstance(getattr(module, "net", None), torch.nn.ModuleList) and hasattr(module.net[0], "proj"):
                    glu = "GLU" in type(module.net[0]).__name__  # GEGLU / SwiGLU: value and gate halves
                    plan[f"{where}.net.0.proj"] = ("colwise", (1, 1)) if glu else "colwise"
                    plan[f"{where}.net.2"] = "rowwise"
                elif all(isinstance(getattr(module, w, None), torch.nn.Linear) for w in ("w1", "w2", "w3")):
                    plan.update({f"{where}.w1": "colwise", f"{where}.w3": "colwise", f"{where}.w2": "rowwise"})
    return plan


def modulation_plan(model: torch.nn.Module, block_lists: tuple[str, ...]) -> dict[str, str]:
    """The blocks' modulation layers gathered: each rank computes 1/N of the per-sample shifts, scales and gates and
    all-gathers them (see strategies/tensor.py). Found by diffusers' and DiT's names: an AdaLayerNormZero*'s
    `.linear`, an `adaLN_modulation` Sequential's Linear. A pre-only block's AdaLayerNormContinuous stays whole:
    its rows are stored swapped (keymap's swap_halves)."""
    plan = {}
    for attr in block_lists:
        for i, block in enumerate(getattr(model, attr)):
            for name, module in block.named_modules():
                where = f"{attr}.{i}.{name}"
                linear = isinstance(getattr(module, "linear", None), torch.nn.Linear)
                if "AdaLayerNormZero" in type(module).__name__ and linear:
                    plan[f"{where}.linear"] = "gather"
                elif name.rpartition(".")[2] == "adaLN_modulation" and isinstance(module, torch.nn.Sequential):
                    plan.update({f"{where}.{j}": "gather" for j, layer in enumerate(module)
                                 if isinstance(layer, torch.nn.Linear)})
    return plan


def _attention_plan(attn: torch.nn.Module, where: str, plan: dict) -> bool:
    """Add one diffusers Attention's entries to `plan`; False where it has no out-projection to reduce in."""
    if getattr(attn, "to_out", None) is None:
        return False
    head_dim = attn.to_q.out_features // attn.heads
    for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        if isinstance(getattr(attn, proj, None), torch.nn.Linear):
            plan[f"{where}.{proj}"] = "colwise"
    plan[f"{where}.to_out.0"] = "rowwise"
    if isinstance(getattr(attn, "to_add_out", None), torch.nn.Linear):
        plan[f"{where}.to_add_out"] = "rowwise"
    for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        weight = getattr(getattr(attn, norm, None), "weight", None)
        if weight is not None and weight.shape[0] != head_dim:
            plan[f"{where}.{norm}"] = "norm"
    return True


@torch.no_grad()
def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights of a trained model's scale (outputs O(1) for O(1) inputs): matrices ~ 1/sqrt(fan-in), norm
    scales ~ 1, small biases; a block of these runs at the speed of the real one (no NaNs or denormals)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        else:
            p.fill_(1.0)


def _to(x, device, dtype):
    """A tensor, or a tuple of them (PixArt's temb, RoPE's cos/sin), moved to `device` (and `dtype` if given)."""
    if isinstance(x, (tuple, list)):
        items = [_to(t, device, dtype) for t in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # a NamedTuple takes fields one by one
    return x if x is None else x.to(device, dtype) if dtype is not None else x.to(device)


@functools.lru_cache(maxsize=32)
def _parameter_counts(family: DiTFamily, config) -> tuple[tuple[int, ...], int, int, int]:
    from ..weights.mapping import parameter_counts

    model = family.meta_model(config)
    blocks = [block for attr in family.block_lists for block in getattr(model, attr)]
    return parameter_counts(model, blocks, family.always_owned, family.first_stage, family.last_stage)


@functools.lru_cache(maxsize=32)
def _tensor_plan(family: DiTFamily, config) -> dict:
    """The family's tensor plan for `config` (module patterns -> how each splits), read off its meta model once:
    auto asks it of every candidate plan."""
    model = family.meta_model(config)
    if family.tensor_plan is not None:
        plan = family.tensor_plan(config)
    else:
        plan = getattr(type(model), "_tp_plan", None) or derived_tensor_plan(model, family.block_lists)
    return {**modulation_plan(model, family.block_lists), **plan} if plan else {}


@functools.lru_cache(maxsize=8)
def _weight_patch_targets(family: DiTFamily, config) -> dict:
    from ..weights.patches import patch_targets

    return patch_targets(family.source_map(config, family.comfy_layout))


@functools.lru_cache(maxsize=32)
def _block_list_sizes(family: DiTFamily, config) -> tuple[int, ...]:
    model = family.meta_model(config)
    return tuple(len(getattr(model, attr)) for attr in family.block_lists)


@dataclass(frozen=True)
class KnownUnsupported:
    """A model family ParaDiT knows but does not run: found by its signature keys (all under one prefix, none of
    `absent` there), refused before any work in one sentence naming it (`what`) and what the user can do (`fix`)."""

    what: str
    keys: tuple[str, ...]
    fix: str
    absent: tuple[str, ...] = ()

    def found_in(self, key_set: set[str]) -> bool:
        return any(all(p + k in key_set for k in self.keys) and not any(p + k in key_set for k in self.absent)
                   for p in ("", "model.diffusion_model.", "diffusion_model.", "transformer."))


_LTX_FIX = ("load it with UNETLoader{} (ComfyUI's own multi-GPU CFG split works for it) and choose a family ParaDiT "
            "runs for Load Parallel DiT")
# LTX-Video's diffusers-layout keys (adaln_single, caption_projection, transformer_blocks) also fit PixArt's, so
# these are checked before any family. LTX-2 / 2.3 (audio-video) files are the ltx2 family's: a file with LTX-2's
# audio keys is never refused here.
_LTX2_AUDIO = ("audio_adaln_single.linear.weight", "audio_time_embed.linear.weight")
KNOWN_UNSUPPORTED = (
    KnownUnsupported("an LTX-Video (LTXV 0.9.x) model (Lightricks)",
                     ("adaln_single.emb.timestep_embedder.linear_1.bias", "transformer_blocks.0.attn2.to_k.weight"),
                     _LTX_FIX.format(""), absent=("pos_embed.proj.bias",) + _LTX2_AUDIO),  # PixArt-diffusers: pos_embed
    KnownUnsupported("an LTX-Video (LTXV 0.9.x) model (Lightricks, diffusers layout)",
                     ("time_embed.emb.timestep_embedder.linear_1.bias", "scale_shift_table", "proj_in.weight",
                      "caption_projection.linear_1.weight"), _LTX_FIX.format(""), absent=_LTX2_AUDIO),
)


def refuse_known_unsupported(keys: list[str], name: str) -> None:
    """One sentence for a file of a family ParaDiT knows but does not run (KNOWN_UNSUPPORTED), else nothing."""
    key_set = set(keys)
    for known in KNOWN_UNSUPPORTED:
        if known.found_in(key_set):
            raise ModelFileError(f"{name} is {known.what}, which ParaDiT does not run yet; {known.fix}.")


def describe_keys(keys: list[str]) -> str:
    """A short guess at what a checkpoint no family claims is, for the error message."""
    joined = "\n".join(keys[:5000])

    def has(pattern: str) -> bool:
        return re.search(pattern, joined, re.M) is not None

    if has(r"lora_[AB]\b|lora_(up|down)\b|\.lora\."):
        return "it looks like a LoRA"
    if has(r"^(model\.diffusion_model\.)?input_blocks\.") or has(r"^(unet\.)?down_blocks\.\d+\.resnets\."):
        return "its keys look like a UNet (SD1.x/SDXL)"
    if has(r"(^|\.)(encoder|decoder)\.(down|up|mid)") or has(r"^(first_stage_model\.)?(encoder|decoder)\.conv_in"):
        return "it looks like a VAE"
    if has(r"(^|\.)text_model\.|(^|\.)encoder\.block\.\d+\.layer|^shared\.weight|(^|\.)embed_tokens\."):
        return "it looks like a text encoder"
    if has(r"^(model\.diffusion_model\.)?joint_blocks\."):
        return "its keys look like an SD3 MMDiT"
    if has(r"distilled_guidance_layer"):
        return "its keys look like Chroma"
    if has(r"double_stream_modulation"):
        return "its keys look like Flux.2"
    if has(r"^(model\.diffusion_model\.)?transformer_blocks\.\d+\.img_mod\."):
        return "its keys look like Qwen-Image"
    if has(r"(^|\.)blocks\.\d+\.cross_attn\.") and has(r"(^|\.)y_embedder\."):
        return "its keys look like PixArt"
    if not keys:
        return "it holds no tensors"
    return f"found keys such as {', '.join(repr(k) for k in keys[:3])}"
