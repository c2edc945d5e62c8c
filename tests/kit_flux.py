"""A Flux.1-like family written from the family kit alone (docs/adding-a-family.md): what a newcomer of that shape
costs. It reads diffusers-layout Flux.1 files into diffusers' FluxTransformer2DModel and hands each block's
attention to the job's strategy; tests/test_family_kit.py checks it against diffusers' own forward and against the
runtime's Flux family (the same file, run serially in-process).

Nothing here comes from families/flux*.py: detection, key map, fixture shapes, token layout, positions, the block
loop, stage ownership, tensor plan (diffusers' names) and the cost probe are the kit's and the seam's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from parallel_runtime.models.blocks import BlockLoop
from parallel_runtime.models.detection import DIFFUSERS_PREFIXES, Signature, signature_match
from parallel_runtime.models.family import BlockKind, DiTFamily, JointAttentionConfig, Match, diffusers_meta_model
from parallel_runtime.models.patchify import PatchTokens
from parallel_runtime.models.rope import grid_ids, probe_ids, rope_table
from parallel_runtime.models.shapes import CheckpointShapes
from parallel_runtime.sampling import FLUX_LATENT, model_sampling_for
from parallel_runtime.strategies.attention.processor import ParallelFluxAttnProcessor
from parallel_runtime.weights.keymap import block_count, same_names, tensor_shapes
from parallel_runtime.weights.storage import compute_placement

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
DOUBLE, SINGLE = BlockKind("double", ("joint",)), BlockKind("single", ("joint",), fused=True)
TIME_FEATURES = 256  # width of the timestep / guidance sinusoids


@dataclass(frozen=True)
class KitFluxConfig(JointAttentionConfig):
    hidden_size: int
    num_heads: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    context_dim: int
    pooled_dim: int
    in_channels: int = 64  # 16 latent channels x a 2x2 patch
    guidance_embeds: bool = True

    family = "kit_flux"
    title = "Flux.1 (family kit)"
    variant = "dev"
    text_encoders = "CLIP-L and T5-XXL"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def axes_dims_rope(self) -> tuple[int, int, int]:
        return self.head_dim // 8, 7 * self.head_dim // 16, 7 * self.head_dim // 16  # Flux.1's (16, 56, 56) of 128

    @property
    def num_blocks(self) -> int:
        return self.num_layers + self.num_single_layers

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        return (DOUBLE,) * self.num_layers + (SINGLE,) * self.num_single_layers

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.hidden_size

    @property
    def latent_channels(self) -> int:
        return self.in_channels // 4

    def diffusers_kwargs(self) -> dict:
        return dict(patch_size=1, in_channels=self.in_channels, num_layers=self.num_layers,
                    num_single_layers=self.num_single_layers, attention_head_dim=self.head_dim,
                    num_attention_heads=self.num_heads, joint_attention_dim=self.context_dim,
                    pooled_projection_dim=self.pooled_dim, guidance_embeds=self.guidance_embeds,
                    axes_dims_rope=self.axes_dims_rope)


# -- the file: detection, config from shapes, key map, fixture shapes ------------------------------------

match_layout = signature_match(Signature("diffusers", ("x_embedder.weight", "time_text_embed.timestep_embedder"
                                                       ".linear_1.weight"), BLOCK_LISTS, DIFFUSERS_PREFIXES))


def infer_config(reader, match: Match, name: str) -> KitFluxConfig:
    p, keys = match.prefix, reader.keys()
    shape = tensor_shapes(reader, p, name, "a complete Flux.1 DiT")
    hidden, in_channels = shape("x_embedder.weight")
    return KitFluxConfig(hidden_size=hidden, num_heads=hidden // shape("transformer_blocks.0.attn.norm_q.weight")[0],
                         num_layers=block_count(keys, p, "transformer_blocks", name),
                         num_single_layers=block_count(keys, p, "single_transformer_blocks", name),
                         context_dim=shape("context_embedder.weight")[1],
                         pooled_dim=shape("time_text_embed.text_embedder.linear_1.weight")[1],
                         in_channels=in_channels,
                         guidance_embeds=p + "time_text_embed.guidance_embedder.linear_1.weight" in reader)


meta_model = diffusers_meta_model("FluxTransformer2DModel")


def source_map(config: KitFluxConfig, layout: str, prefix: str = "") -> dict:
    return same_names(meta_model(config).state_dict(), prefix)  # a diffusers file names every parameter itself


def checkpoint_shapes(config: KitFluxConfig) -> dict:
    """Every parameter in the model's own order, at the scale of its kind (modulations at half a weight's)."""
    out = CheckpointShapes()
    for name, p in meta_model(config).state_dict().items():
        layer, leaf = name.rsplit(".", 1)
        if leaf == "bias":
            out[name] = (tuple(p.shape), "bias")
        elif p.dim() == 1:
            out.norm(layer, p.shape[0])
        else:
            out[name] = (tuple(p.shape), "mod" if layer.endswith(("norm1.linear", "norm1_context.linear",
                                                                    "norm.linear", "norm_out.linear")) else "weight")
    return out


# -- the strategies' view ----------------------------------------------------------------------------------

def block_inputs(config: KitFluxConfig, text: int, image: int, generator: torch.Generator) -> tuple:
    """Random (image, text, temb, RoPE) of one block call: what the cost probe runs."""
    h = config.hidden_size
    return (torch.randn(1, image, h, generator=generator), torch.randn(1, text, h, generator=generator),
            torch.randn(1, h, generator=generator), rope_table(probe_ids(text, image), config.axes_dims_rope))


class KitFluxAdapter(PatchTokens, BlockLoop):
    patch = 2  # 2x2 patches, channel-major inside each
    latent_format = FLUX_LATENT
    latent_channels = 16
    default_guidance = 3.5

    def __init__(self, config: KitFluxConfig, model, chunks: list[range], context):
        self.config, self.model, self.chunks = config, model, chunks
        self._blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        for i in (i for chunk in chunks for i in chunk):
            self._blocks[i].attn.set_processor(ParallelFluxAttnProcessor(i, context))
        self.dtype, self.device = compute_placement(model.time_text_embed)

    @functools.cached_property
    def model_sampling(self):
        return model_sampling_for(self.config.variant)

    def rope(self, text_len: int, h: int, w: int, references=(), method=None):
        """Prompt tokens at 0, the image's 2x2 patches at [0, row, col] (no reference latents)."""
        ids = torch.cat([torch.zeros(text_len, 3), grid_ids(h // 2, w // 2)])
        return rope_table(ids.to(self.device), self.config.axes_dims_rope)

    def embed_image(self, tokens: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        return self.model.x_embedder(tokens.to(self.device, self.dtype))

    def embed_text(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.context_embedder(cond.to(self.device, self.dtype))

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance, hw=None):
        """t x 1000 in float32 as model_base passes it; guidance rounded through the compute dtype first."""
        t, pooled = t.to(self.device, torch.float32) * 1000, pooled.to(self.device, self.dtype)
        if self.config.guidance_embeds:
            return self.model.time_text_embed(t, guidance.to(self.device, self.dtype) * 1000, pooled)
        return self.model.time_text_embed(t, pooled)

    def block(self, i: int, image, text, temb, rope) -> tuple:
        text, image = self._blocks[i](hidden_states=image, encoder_hidden_states=text, temb=temb,
                                      image_rotary_emb=rope)
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        return self.model.proj_out(self.model.norm_out(image, temb)).float()


KIT_FLUX = DiTFamily(
    name="kit_flux", title="Flux.1 (family kit)", match=match_layout, infer_config=infer_config,
    meta_model=meta_model, source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=KitFluxAdapter,
    block_lists=BLOCK_LISTS, always_owned=("time_text_embed.",), first_stage=("x_embedder.", "context_embedder."),
    last_stage=("norm_out.", "proj_out."), comfy_layout="diffusers", block_inputs=block_inputs)
