"""Chroma (lodestones' Flux.1-schnell derivative): Flux's blocks without Flux's modulation layers.

Chroma prunes every per-block modulation Linear, `time_in`, `vector_in` and `guidance_in` from Flux, and
computes all modulations at once: a small MLP (the "distilled guidance layer", or approximator) maps
(timestep, guidance, modulation index) to one [344, hidden] table whose rows are the shift/scale/gate
vectors of every block. Token layout, RoPE ids, attention and sampling are Flux's (ModelSamplingFlux,
shift 1.15, the Flux latent format), so ChromaAdapter is a FluxAdapter with another modulation path.

Blocks are diffusers' `ChromaTransformer2DModel` blocks (`FluxAttention`, so the parallel processor is
Flux's). The time/guidance/index embedding is our own, after ComfyUI's `comfy/ldm/chroma/model.py`,
because diffusers' differs from it in three ways that change numbers:
  * ComfyUI always builds 344 index rows and reads the final layer's (shift, scale) from rows 342/343;
    diffusers builds 3S + 12D + 2 rows, which differs for any block count but Chroma's 19/38.
  * ComfyUI feeds the guidance cond (0 unless a FluxGuidance node sets one); diffusers hard-wires 0.
  * diffusers rounds t to the compute dtype before the x1000; ComfyUI keeps it in float32.
The approximator's RMSNorms get ComfyUI's eps 1e-6 (diffusers' default is the dtype's machine epsilon).

Key layouts: ComfyUI/original (`distilled_guidance_layer.layers.N.in_layer`, `double_blocks.N...`,
optionally under `model.diffusion_model.`) and diffusers (`transformer.` prefix optional).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

from ...errors import ModelFileError
from ...sampling import model_sampling_for
from ...weights.keymap import Source, block_count, linear, same_names, tensor_shapes
from ..detection import DIFFUSERS_PREFIXES, Signature, signature_match
from ..family import DiTFamily, Match, TwoBlockListConfig
from ..shapes import CheckpointShapes
from .flux import DOUBLE_BLOCK, SINGLE_BLOCK, default_axes_dims_rope, map_double_block, map_single_block
from .flux_adapter import FluxAdapter, block_inputs as flux_block_inputs

MOD_INDEX_ROWS = 344  # comfy/ldm/chroma/model.py: mod_index_length, fixed whatever the block counts
APPROXIMATOR_IN = 64  # 16 (timestep) + 16 (guidance) + 32 (modulation index) sinusoid features

ALWAYS_OWNED = ("distilled_guidance_layer.",)
FIRST_STAGE = ("x_embedder.", "context_embedder.")
LAST_STAGE = ("norm_out.", "proj_out.")
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


@dataclass(frozen=True)
class ChromaConfig(TwoBlockListConfig):
    first_kind, second_kind = DOUBLE_BLOCK, SINGLE_BLOCK  # the pipeline's one list: these, then single blocks
    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    in_channels: int = 64
    context_dim: int = 4096
    approximator_hidden: int = 5120
    approximator_layers: int = 5
    out_channels: int | None = None

    family = "chroma"
    variant = "chroma"
    guidance_embeds = False  # no guidance network: guidance enters through the approximator's input
    pooled_dim = 0  # no pooled text vector
    text_encoders = "T5-XXL (CLIPLoader type chroma)"

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ModelFileError(f"Chroma config is inconsistent: {self.num_heads} heads x {self.head_dim} != "
                                 f"hidden size {self.hidden_size}; the file is damaged, so re-download it.")
        if self.modulation_rows > MOD_INDEX_ROWS:
            raise ModelFileError(f"Chroma with {self.num_layers} double and {self.num_single_layers} single blocks "
                                 f"needs {self.modulation_rows} modulation rows but Chroma has {MOD_INDEX_ROWS}; "
                                 f"the file is not a Chroma model.")
        if self.out_channels is None:
            object.__setattr__(self, "out_channels", self.in_channels)



    @property
    def mlp_hidden(self) -> int:
        return 4 * self.hidden_size

    @property
    def latent_channels(self) -> int:
        return self.out_channels // 4

    @property
    def modulation_rows(self) -> int:
        return 3 * self.num_single_layers + 12 * self.num_layers + 2

    @property
    def axes_dims_rope(self) -> tuple[int, int, int]:
        return default_axes_dims_rope(self.head_dim)

    def diffusers_kwargs(self) -> dict:
        return dict(patch_size=1, in_channels=self.in_channels, out_channels=self.out_channels,
                    num_layers=self.num_layers, num_single_layers=self.num_single_layers,
                    attention_head_dim=self.head_dim, num_attention_heads=self.num_heads,
                    joint_attention_dim=self.context_dim, axes_dims_rope=self.axes_dims_rope,
                    approximator_num_channels=APPROXIMATOR_IN, approximator_hidden_dim=self.approximator_hidden,
                    approximator_layers=self.approximator_layers)


# -- checkpoint layout --------------------------------------------------------------------------------

_APPROXIMATOR = "distilled_guidance_layer.in_proj.weight"  # what ComfyUI's detection keys Chroma on
match_layout = signature_match(
    Signature("bfl", (_APPROXIMATOR, "img_in.weight"), ("double_blocks",)),
    Signature("diffusers", (_APPROXIMATOR, "x_embedder.weight"), ("transformer_blocks",), DIFFUSERS_PREFIXES))


_SHAPE_KEYS = {
    "bfl": dict(img_in="img_in.weight", txt_in="txt_in.weight", q_norm="double_blocks.0.img_attn.norm.query_norm.scale",
                single_q_norm="single_blocks.0.norm.query_norm.scale", final="final_layer.linear.weight",
                double="double_blocks", single="single_blocks"),
    "diffusers": dict(img_in="x_embedder.weight", txt_in="context_embedder.weight",
                      q_norm="transformer_blocks.0.attn.norm_q.weight",
                      single_q_norm="single_transformer_blocks.0.attn.norm_q.weight", final="proj_out.weight",
                      double="transformer_blocks", single="single_transformer_blocks"),
}


def infer_config(reader, match: Match, name: str) -> ChromaConfig:
    keys, p, k = reader.keys(), match.prefix, _SHAPE_KEYS[match.layout]

    shape = tensor_shapes(reader, p, name, "a complete Chroma DiT")

    n_double = block_count(keys, p, k["double"], name)
    n_single = block_count(keys, p, k["single"], name)
    hidden, in_ch = shape(k["img_in"])
    head_dim = shape(k["q_norm"] if n_double else k["single_q_norm"])[0]
    approx_hidden, approx_in = shape("distilled_guidance_layer.in_proj.weight")
    if approx_in != APPROXIMATOR_IN:
        raise ModelFileError(f"{name}: the distilled guidance layer takes {approx_in} features, Chroma's takes "
                             f"{APPROXIMATOR_IN}; the file is not a Chroma model this version runs.")
    return ChromaConfig(hidden_size=hidden, num_heads=hidden // head_dim, head_dim=head_dim, num_layers=n_double,
                        num_single_layers=n_single, in_channels=in_ch, context_dim=shape(k["txt_in"])[1],
                        approximator_hidden=approx_hidden,
                        approximator_layers=block_count(keys, p, "distilled_guidance_layer.layers", name),
                        out_channels=shape(k["final"])[0])


def _diffusers_model(config: ChromaConfig):
    from diffusers import ChromaTransformer2DModel

    # diffusers' Chroma still builds the deprecated FluxPosEmbed alias (a FutureWarning on every build).
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ChromaTransformer2DModel(**config.diffusers_kwargs())


def source_map(config: ChromaConfig, layout: str, prefix: str = "") -> dict[str, Source]:
    if layout == "diffusers":
        return same_names(_diffusers_model(config).state_dict(), prefix)
    p, H = prefix, config.hidden_size
    M = 4 * H
    out: dict[str, Source] = {}
    linear(out, "x_embedder", p + "img_in")
    linear(out, "context_embedder", p + "txt_in")
    g = "distilled_guidance_layer"
    linear(out, f"{g}.in_proj", f"{p}{g}.in_proj")
    for i in range(config.approximator_layers):
        linear(out, f"{g}.layers.{i}.linear_1", f"{p}{g}.layers.{i}.in_layer")
        linear(out, f"{g}.layers.{i}.linear_2", f"{p}{g}.layers.{i}.out_layer")
        out[f"{g}.norms.{i}.weight"] = Source(f"{p}{g}.norms.{i}.scale")
    linear(out, f"{g}.out_proj", f"{p}{g}.out_proj")
    for i in range(config.num_layers):
        map_double_block(out, f"transformer_blocks.{i}", f"{p}double_blocks.{i}", H, M, modulation=False)
    for i in range(config.num_single_layers):
        map_single_block(out, f"single_transformer_blocks.{i}", f"{p}single_blocks.{i}", H, M, modulation=False)
    linear(out, "proj_out", p + "final_layer.linear")
    return out


def checkpoint_shapes(config: ChromaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{original key: (shape, kind)} of a Chroma file, for writing random test checkpoints."""
    H, M, A, hd = config.hidden_size, 4 * config.hidden_size, config.approximator_hidden, config.head_dim
    out = CheckpointShapes()
    lin = out.linear
    lin("img_in", H, config.in_channels)
    lin("txt_in", H, config.context_dim)
    lin("distilled_guidance_layer.in_proj", A, APPROXIMATOR_IN)
    for i in range(config.approximator_layers):
        lin(f"distilled_guidance_layer.layers.{i}.in_layer", A, A)
        lin(f"distilled_guidance_layer.layers.{i}.out_layer", A, A)
        out[f"distilled_guidance_layer.norms.{i}.scale"] = ((A,), "norm")
    lin("distilled_guidance_layer.out_proj", H, A, "mod")
    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            lin(f"{b}_attn.qkv", 3 * H, H)
            out[f"{b}_attn.norm.query_norm.scale"] = out[f"{b}_attn.norm.key_norm.scale"] = ((hd,), "norm")
            lin(f"{b}_attn.proj", H, H)
            lin(f"{b}_mlp.0", M, H)
            lin(f"{b}_mlp.2", H, M)
    for i in range(config.num_single_layers):
        b = f"single_blocks.{i}"
        lin(f"{b}.linear1", 3 * H + M, H)
        lin(f"{b}.linear2", H, H + M)
        out[f"{b}.norm.query_norm.scale"] = out[f"{b}.norm.key_norm.scale"] = ((hd,), "norm")
    lin("final_layer.linear", config.out_channels, H)
    return out


def _comfy_norm_eps(model) -> None:
    for norm in model.distilled_guidance_layer.norms:
        norm.eps = 1e-6  # ComfyUI's rms_norm eps (diffusers leaves nn.RMSNorm's at finfo(dtype).eps)


# -- the strategies' view -----------------------------------------------------------------------------

def sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """comfy.ldm.flux.layers.timestep_embedding: [cos, sin] of 1000*t (scaled in t's dtype), in t's dtype
    (float32 for integer t)."""
    t = 1000.0 * t if t.is_floating_point() else 1000 * t
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return embedding.to(t) if t.is_floating_point() else embedding


def block_inputs(config: ChromaConfig, text: int, image: int, generator: torch.Generator) -> tuple:
    """Flux's random block inputs with Chroma's temb: the whole modulation table, which run_blocks slices."""
    image_rows, text_rows, _, rope = flux_block_inputs(config, text, image, generator)
    return image_rows, text_rows, torch.randn(1, MOD_INDEX_ROWS, config.hidden_size, generator=generator), rope


class ChromaAdapter(FluxAdapter):
    embedding_module = "distilled_guidance_layer"
    default_guidance = 0.0  # model_base.Chroma.extra_conds: guidance 0 unless a FluxGuidance node sets it

    @functools.cached_property
    def model_sampling(self):
        return model_sampling_for("dev")  # supported_models.Chroma: ModelSamplingFlux, default shift 1.15

    @functools.cached_property
    def _index_features(self) -> torch.Tensor:
        return sinusoid(torch.arange(MOD_INDEX_ROWS, device=self.device), 32).to(self.dtype)

    def timestep_embedding(self, t: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None,
                           hw: tuple[int, int] | None = None):
        """The [B, 344, hidden] modulation table (pooled is unused: Chroma has no pooled-text path).
        t stays float32 as model_base passes it; guidance is in the compute dtype as ComfyUI's extra conds are."""
        t16 = sinusoid(t.to(self.device, torch.float32), 16).to(self.dtype)
        g16 = sinusoid(guidance.to(self.device, self.dtype), 16)
        n = t16.shape[0]
        time_guidance = torch.cat([t16, g16], dim=1)[:, None].expand(n, MOD_INDEX_ROWS, 32)
        features = torch.cat([time_guidance, self._index_features[None].expand(n, -1, -1)], dim=-1)
        return self.model.distilled_guidance_layer(features)

    def run_blocks(self, image, text, temb, rope, chunk: int = 0) -> tuple:
        c = self.config
        for i in self.active_blocks(chunk):
            block = self._blocks[i]
            if i < c.num_layers:  # rows (get_modulations): singles, then double img, then double txt
                img_row, txt_row = 3 * c.num_single_layers + 6 * i, 3 * c.num_single_layers + 6 * c.num_layers + 6 * i
                mod = torch.cat([temb[:, img_row:img_row + 6], temb[:, txt_row:txt_row + 6]], dim=1)
                text, image = block(hidden_states=image, encoder_hidden_states=text, temb=mod, image_rotary_emb=rope)
            else:
                j = i - c.num_layers
                n_text = text.shape[1]
                joint = block(hidden_states=torch.cat([text, image], dim=1), temb=temb[:, 3 * j:3 * j + 3],
                              image_rotary_emb=rope)
                text, image = joint[:, :n_text], joint[:, n_text:]
        return image, text

    def head(self, image: torch.Tensor, temb: torch.Tensor, rope=None) -> torch.Tensor:
        final = temb[:, MOD_INDEX_ROWS - 2:]  # (shift, scale) in the last two of the 344 rows
        return self.model.proj_out(self.model.norm_out(image, final)).float()


def tensor_plan(config: ChromaConfig) -> dict:
    """Flux's tensor-parallel plan (Chroma's blocks carry Flux's names), its single blocks' proj_out reading the
    [attention, MLP] columns; no modulation to gather (Chroma's comes from the shared approximator)."""
    from diffusers import FluxTransformer2DModel

    return {**FluxTransformer2DModel._tp_plan,
            "single_transformer_blocks.*.proj_out": ("rowwise", (config.hidden_size, config.mlp_hidden))}


CHROMA = DiTFamily(
    name="chroma", title="Chroma", match=match_layout, infer_config=infer_config, meta_model=_diffusers_model,
    source_map=source_map, checkpoint_shapes=checkpoint_shapes, adapter_class=ChromaAdapter, block_lists=BLOCK_LISTS,
    always_owned=ALWAYS_OWNED, first_stage=FIRST_STAGE, last_stage=LAST_STAGE, comfy_layout="bfl",
    block_inputs=block_inputs, after_build=_comfy_norm_eps, attention_mask=True, tensor_plan=tensor_plan)
