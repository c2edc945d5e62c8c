"""FluxAdapter: what the parallel strategies need to know about Flux, and nothing more.

Token layout (2x2 patches of the 16-channel latent, row-major), RoPE ids, the ordered block list
(double-stream blocks, then single-stream ones), conditioning embeddings, and which parameters a
pipeline stage owns. Strategies only ever call these methods; the checkpoint mapping lives in flux.py.
"""
from __future__ import annotations

import collections
import functools
import os
from typing import Callable

import torch

from ...sampling import FLUX_LATENT, model_sampling_for
from ...strategies.attention.processor import AttentionContext, ParallelFluxAttnProcessor
from ...weights.checkpoint import open_checkpoint
from ...weights.storage import compute_placement
from ..blocks import BlockLoop
from ..family import ControlNetBlocks, DiTFamily
from ..patchify import PatchTokens
from ..rope import grid_ids, probe_ids, rope_table
from . import flux, flux_controlnet
from .flux import FluxConfig

ALWAYS_OWNED = ("time_text_embed.",)  # every stage modulates its blocks with the timestep embedding
FIRST_STAGE = ("x_embedder.", "context_embedder.")
LAST_STAGE = ("norm_out.", "proj_out.")


def block_names(config: FluxConfig) -> list[str]:
    return ([f"transformer_blocks.{i}" for i in range(config.num_layers)]
            + [f"single_transformer_blocks.{i}" for i in range(config.num_single_layers)])


def parameter_counts(config: FluxConfig) -> tuple[tuple[int, ...], int, int, int]:
    """(per-block counts, every stage's, the first stage's, the last stage's) parameter counts."""
    return FLUX.parameter_counts(config)


def block_costs(config: FluxConfig) -> list[int]:
    """Parameter count per block."""
    return list(parameter_counts(config)[0])


def pipeline_stages(config: FluxConfig, stages: int) -> list[list[range]]:
    return FLUX.pipeline_stages(config, stages)


def stage_ownership(config: FluxConfig, chunks: list[range], first: bool, last: bool) -> Callable[[str], bool]:
    """Predicate over diffusers parameter names: True for what a rank running `chunks` needs."""
    return FLUX.stage_ownership(config, chunks, first, last)


def patch_conv(tokens: torch.Tensor, proj: torch.nn.Conv2d) -> torch.Tensor:
    """A stride-p patch conv applied to packed (c, ph, pw) tokens, as one matmul: a rank embeds only its rows."""
    return torch.nn.functional.linear(tokens, proj.weight.flatten(1), proj.bias)


def channels_first(out: torch.Tensor, patch: int, channels: int, keep: int | None = None) -> torch.Tensor:
    """Output tokens in the (ph, pw, c) layout of SD3's and PixArt's heads -> pack's (c, ph, pw), keeping the
    first `keep` channels (PixArt drops its learned variance)."""
    b, n, _ = out.shape
    keep = channels if keep is None else keep
    out = out.reshape(b, n, patch, patch, channels)[..., :keep]
    return out.permute(0, 1, 4, 2, 3).reshape(b, n, keep * patch * patch)


def reference_placements(hw: tuple[int, int], references: tuple[tuple[int, int], ...],
                         method: str | None, patch: int = 2,
                         index_step: int = 1) -> list[tuple[int, int, int, int, int]]:
    """(rows, cols, index, row offset, col offset) of each reference latent's token grid, as
    comfy/ldm/flux/model.py places Kontext references. Sizes and offsets are in latent pixels, turned into
    tokens of `patch` pixels by rounding; "offset" (the default) tiles the references beside each other at
    index 1, "index" stacks them at index_step, 2 x index_step, ... (ComfyUI's ref_index_scale: 1 for Kontext,
    10 for FLUX.2), "uxo" puts them below-right of the image at index 0."""
    def tokens(n: int) -> int:
        return (n + patch // 2) // patch

    placed, h, w, index = [], 0, 0, 0
    for ref_h, ref_w in references:
        if method == "index":
            index, off_h, off_w = index + index_step, 0, 0
        elif method == "uxo":
            index, off_h, off_w = 0, tokens(hw[0]) * patch + h, tokens(hw[1]) * patch + w
            h, w = h + ref_h, w + ref_w
        else:
            index, off_h, off_w = 1, 0, 0
            if ref_h + h > ref_w + w:
                off_w = w
            else:
                off_h = h
            h, w = max(h, ref_h + off_h), max(w, ref_w + off_w)
        placed.append((tokens(ref_h), tokens(ref_w), index, tokens(off_h), tokens(off_w)))
    return placed


def block_inputs(config, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, text, temb, RoPE) of one block call (what `DiTFamily.probe_block` runs): RoPE of a
    near-square image grid after the prompt, as `FluxAdapter.rope` builds it."""
    h, rope = config.hidden_size, rope_table(probe_ids(text, image), config.axes_dims_rope)
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator),
            torch.randn(1, h, generator=generator), rope)


class FluxAdapter(PatchTokens, BlockLoop):
    latent_channels = 16
    patch = 2  # [B, C, H, W] -> [B, (H/2)(W/2), 4C]: channel-major in each 2x2 patch, as Flux reads them
    embedding_module = "time_text_embed"  # a module every stage owns: its parameters give dtype and device
    masked = True  # a call's attention_mask applies to these blocks' joint attention (ComfyUI's Flux adds it)

    def __init__(self, config: FluxConfig, model, chunks: list[range], context: AttentionContext):
        """`chunks`: the block ranges this rank runs (all blocks in one range when not pipelined)."""
        self.config = config
        self.model = model
        self.chunks = chunks
        self.context = context  # the worker's attention strategy slots, which its blocks' processors read
        all_blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
        for layer in (i for chunk in chunks for i in chunk):
            all_blocks[layer].attn.set_processor(ParallelFluxAttnProcessor(layer, context, self.masked))
        self._blocks = all_blocks
        self.dtype, self.device = compute_placement(getattr(model, self.embedding_module))

    @property
    def variant(self) -> str:
        return self.config.variant

    # -- sampling ------------------------------------------------------------------------------------

    latent_format = FLUX_LATENT
    default_guidance = 3.5  # model_base.Flux.extra_conds: guidance when no FluxGuidance node set one

    @functools.cached_property
    def model_sampling(self):
        """dev: ModelSamplingFlux (shift 1.15); schnell: ModelSamplingDiscreteFlow (shift 1)."""
        return model_sampling_for(self.config.variant)

    # -- token layout --------------------------------------------------------------------------------

    def rope(self, text_len: int, h: int, w: int, references: tuple[tuple[int, int], ...] = (),
             method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the canonical full sequence [text, image, references]; strategies index rows by position.
        Text ids are 0; image ids [0, row, col]; each reference's ids are placed as ComfyUI's Flux places them."""
        ids = [torch.zeros(text_len, 3), grid_ids(h // 2, w // 2)]
        ids += [grid_ids(*placed) for placed in reference_placements((h, w), references, method)]
        return self.model.pos_embed(torch.cat(ids).to(self.device))

    # -- embeddings ----------------------------------------------------------------------------------

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """`index`, `hw`: where these tokens sit (unused: Flux's positions are RoPE, applied in attention)."""
        return self.model.x_embedder(tokens.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.context_embedder(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """ComfyUI's Flux time inputs for timestep t (= sigma, ModelSamplingFlux's units), rounded exactly as it
        rounds them (time_text_embed computes the sinusoid
        in float32 from whatever t it gets, then casts it to the compute dtype, as ComfyUI's Flux does).

        - t = 1000 * sigma stays float32: ComfyUI's model_base passes `timestep(sigma).float()`. In bf16,
          1000 * sigma would be rounded to a multiple of up to 4, shifting the sinusoid's fast frequencies by
          whole radians.
        - guidance is cast to the compute dtype *before* the x1000: ComfyUI converts every extra cond
          (guidance, pooled) to the model's dtype, and its timestep_embedding multiplies in that dtype
          (bf16: 3.5 * 1000 -> 3504).
        """
        t = t.to(self.device, torch.float32) * 1000
        pooled = pooled.to(self.device, self.dtype)
        if self.config.guidance_embeds:
            g = guidance.to(self.device, self.dtype) * 1000
            return self.model.time_text_embed(t, g, pooled)
        return self.model.time_text_embed(t, pooled)

    # -- blocks and head -----------------------------------------------------------------------------

    def block(self, i: int, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rope) -> tuple:
        """Double and single blocks alike (diffusers' single blocks take and give both streams)."""
        text, image = self._blocks[i](hidden_states=image, encoder_hidden_states=text, temb=temb,
                                      image_rotary_emb=rope)
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        """Velocity prediction in float32."""
        return self.model.proj_out(self.model.norm_out(image, temb)).float()


class FluxControlNetAdapter(ControlNetBlocks, FluxAdapter):
    """What the strategies call on a loaded ControlNet: the hint's tokens (once per hint), its image, text and
    time embeddings, and one pass over its blocks that returns a residual per block for this rank's image rows."""

    masked = False  # ComfyUI's ControlNetFlux takes no attention_mask: the DiT's mask never reaches its blocks

    def __init__(self, net: flux_controlnet.FluxControlNet, context):
        self.net, self.control = net, net.config
        blocks = range(net.config.flux.num_blocks)
        # One chunk per block, so `residuals` can project each block's output.
        super().__init__(net.config.flux, net.transformer, [range(i, i + 1) for i in blocks], context)
        self.projections = [*net.double_projections, *net.single_projections]  # one per block, in block order
        self.hint_cache: collections.OrderedDict = collections.OrderedDict()  # hint key -> hint_tokens, kept by strategies

    def use_layers(self, position: int) -> None:
        """Attention layer ids for the ControlNet at `position` of a chain: past the DiT's, and apart for each
        use, so PipeFusion's stale K/V of one use (the same file may be chained twice) is never another's."""
        base = flux_controlnet.LAYER_BASE * (position + 1)
        for i, block in enumerate(self._blocks):
            block.attn.processor.layer = base + i

    def hint_tokens(self, hint: torch.Tensor) -> torch.Tensor:
        """The hint as packed, embedded tokens [B, N, hidden] of the latent's grid (ComfyUI's ControlNetFlux:
        an image in [0, 1] goes through the conv stack at 2x-1; a latent is padded to whole 2x2 patches)."""
        hint = hint.to(self.device, self.dtype)
        if self.net.hint_encoder is not None:
            hint = self.net.hint_encoder(hint * 2.0 - 1.0)
        else:
            hint = torch.nn.functional.pad(hint, (0, (-hint.shape[-1]) % 2, 0, (-hint.shape[-2]) % 2),
                                           mode="circular")
        return self.net.hint_embedder(self.pack(hint))

    @property
    def reads_types(self) -> bool:
        """Whether SetUnionControlNetType's types reach this ControlNet (a union model; others ignore them)."""
        return self.net.mode_embedder is not None

    def embed_prompt_with_types(self, cond: torch.Tensor, types: tuple[int, ...]) -> torch.Tensor:
        """A union ControlNet's prompt: one embedded token per control type, then the embedded prompt (ComfyUI's
        ControlNetFlux; the type tokens take the first prompt token's position ids, which are zero in Flux)."""
        text = self.embed_text(cond)
        modes = self.net.mode_embedder(torch.tensor(types, device=self.device)).to(text.dtype)
        return torch.cat([modes.unsqueeze(0).expand(text.shape[0], -1, -1), text], dim=1)

    def embed_control_image(self, x_tokens: torch.Tensor, hint_rows: torch.Tensor, index: torch.Tensor,
                            hw: tuple[int, int]) -> torch.Tensor:
        """img_in(x) + the hint's rows (`index`, `hw`: where the rows sit; Flux's positions are RoPE)."""
        return self.model.x_embedder(x_tokens.to(self.device, self.dtype)) + hint_rows


def load_controlnet(reader, dtype: torch.dtype, device, context, tensor=None, dit=None) -> FluxControlNetAdapter:
    """A Flux ControlNet file (ComfyUI's layout) built on `device`, its attention on the worker's `context`;
    `tensor`: a tensor-parallel rank's split (strategies.tensor.TensorSplit), cutting its blocks as the DiT's;
    `dit`: the DiT's adapter (a Flux ControlNet shares none of its layers)."""
    config = flux_controlnet.read_config(reader)
    plan = FLUX.tensor_plan_for(config.flux) if tensor is not None else None
    net = flux_controlnet.FluxControlNet(config, reader, dtype, device, tensor=tensor, tensor_plan=plan)
    return FluxControlNetAdapter(net, context)


FLUX = DiTFamily(
    name="flux", title="Flux.1 (dev/schnell)", match=flux.match,
    infer_config=lambda reader, match, name: flux.infer_config(reader, match.layout, match.prefix),
    meta_model=flux.meta_model, source_map=flux.source_map, checkpoint_shapes=flux.bfl_tensor_shapes,
    adapter_class=FluxAdapter, block_lists=("transformer_blocks", "single_transformer_blocks"),
    always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE, comfy_layout="bfl",
    block_inputs=block_inputs, controlnet_config=flux_controlnet.read_config,
    load_controlnet=load_controlnet, attention_mask=True)


def load_flux(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    owned: Callable[[str], bool] = lambda name: True,
    device: str | torch.device = "cpu",
):
    """Open ``path``, detect its layout, infer its config and build the owned part of the model."""
    with open_checkpoint(path) as reader:
        found = flux.match(reader.keys())
        if found is None:
            flux.detect_layout(reader.keys(), os.path.basename(reader.path))  # raises the one-sentence error
        config = flux.infer_config(reader, found.layout, found.prefix)
        model = FLUX.build(config, reader, found, owned=owned, dtype=dtype, device=device)
    return config, model
