"""LTX-2's prompt connectors: the two small 1-D transformers (video, audio) stored beside the DiT in a released file,
which turn the text encoder's features into the rows the DiT cross-attends to.

ComfyUI 2026 runs them once per prompt, outside the DiT's call, in LTXAVModel.preprocess_text_embeds (which
model_base.LTXAV.extra_conds calls on the host): a context already of the processed width passes unchanged unless the
text encoder marked it `unprocessed_ltxav_embeds` (LTX-2.3's encoder does: its raw and processed widths are equal);
otherwise the video connector reads the video features and the audio connector the audio features (LTX-2.3: the
context's first cross_attention_dim columns and the rest; LTX-2.0: both read the whole context), and the two outputs
are joined side by side. Each connector (comfy/ldm/lightricks/embeddings_connector.py) appends its learnable
registers after the prompt up to max(1024, L) rows (a multiple of the register count), rotates with 1-D RoPE over
positions / 4096, runs pre-norm self-attention + GELU MLP blocks and a final RMS norm.

The module is diffusers' LTX2ConnectorTransformer1d (the same weights, blocks and RoPE); the registers are appended
here as ComfyUI appends them (diffusers instead replaces masked padding), and its q/k norms take ComfyUI's epsilon
(1e-5; diffusers' default is 1e-6).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigError, ModelFileError

CONNECTORS = ("video_embeddings_connector", "audio_embeddings_connector")
MIN_ROWS = 1024  # Embeddings1DConnector pads every prompt with registers to at least this many rows
ROPE_POSITIONS = 4096  # its positional_embedding_max_pos
QK_NORM_EPS = 1e-5  # ComfyUI's CrossAttention q_norm / k_norm
DEFAULT_HEADS, DEFAULT_HEAD_DIM, DEFAULT_LAYERS = 30, 128, 2  # LTXAVModel's connector_* defaults


@dataclass(frozen=True)
class ConnectorConfig:
    width: int
    heads: int
    layers: int
    registers: int
    gated: bool
    rope_type: str


def _count(keys, prefix: str) -> int:
    n = 0
    while f"{prefix}transformer_1d_blocks.{n}.attn1.to_q.weight" in keys:
        n += 1
    return n


def connector_configs(reader, prefix: str, meta: dict) -> tuple[ConnectorConfig, ConnectorConfig]:
    """Both connectors' settings from the file: widths, layers and registers from the shapes; heads from the file's
    `config` metadata (LTXAVModel's connector_num_attention_heads / connector_attention_head_dim, the audio
    connector's audio_connector_*; ComfyUI's defaults 30 x 128 where it is silent); gates where the weights have
    them; the DiT's RoPE type (ComfyUI's default "split")."""
    keys = set(reader.keys())
    out = []
    for name in CONNECTORS:
        p = f"{prefix}{name}."
        if p + "learnable_registers" not in keys:
            raise ModelFileError(f"{getattr(reader, 'path', 'the file')} has no {name} (the LTX-2 prompt connectors "
                                 f"ComfyUI stores beside the DiT) but the prompt still needs them; load the full "
                                 f"LTX-2 checkpoint, which holds them, or a text encoder that runs them.")
        registers, width = reader.shape(p + "learnable_registers")
        # LTXAVModel's reading: the connector_* settings, the audio connector's audio_connector_* over them
        heads = int(meta.get("connector_num_attention_heads", DEFAULT_HEADS))
        head_dim = int(meta.get("connector_attention_head_dim", DEFAULT_HEAD_DIM))
        if name.startswith("audio"):
            heads = int(meta.get("audio_connector_num_attention_heads", heads))
            head_dim = int(meta.get("audio_connector_attention_head_dim", head_dim))
        if heads * head_dim != width:
            raise ModelFileError(f"the file's {name} is {width} wide but its metadata says {heads} heads of "
                                 f"{head_dim}; the file is damaged, so re-download it.")
        out.append(ConnectorConfig(width=width, heads=heads, layers=_count(keys, p), registers=registers,
                                   gated=p + "transformer_1d_blocks.0.attn1.to_gate_logits.weight" in keys,
                                   rope_type=meta.get("rope_type", "split")))
    return out[0], out[1]


def _diffusers_name(name: str) -> str:
    return (name.replace("transformer_1d_blocks.", "transformer_blocks.").replace(".q_norm.", ".norm_q.")
            .replace(".k_norm.", ".norm_k."))


def build_connector(reader, prefix: str, name: str, config: ConnectorConfig, dtype, device):
    """One connector as diffusers' LTX2ConnectorTransformer1d with the file's weights (ComfyUI's names mapped)."""
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d

    with torch.device("meta"):
        module = LTX2ConnectorTransformer1d(
            num_attention_heads=config.heads, attention_head_dim=config.width // config.heads,
            num_layers=config.layers, num_learnable_registers=config.registers, rope_base_seq_len=ROPE_POSITIONS,
            rope_double_precision=True, rope_type=config.rope_type, gated_attention=config.gated)
    p = f"{prefix}{name}."
    state = {_diffusers_name(k[len(p):]): reader.read(k, dtype=dtype, device=device)
             for k in reader.keys() if k.startswith(p)}
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelFileError(f"the file's {name} does not have LTX-2's connector layout (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}); re-download the file.")
    for block in module.transformer_blocks:
        block.attn1.norm_q.eps = block.attn1.norm_k.eps = QK_NORM_EPS
    return module.eval()


def run_connector(module, rows: torch.Tensor) -> torch.Tensor:
    """Embeddings1DConnector's forward: the prompt followed by the registers of the rows after it, up to
    max(1024, L) rounded up to a multiple of the register count, through diffusers' RoPE, blocks and final norm
    (no mask: every row is attended, as in ComfyUI)."""
    batch, length, _ = rows.shape
    registers = module.learnable_registers
    repeats = math.ceil(max(MIN_ROWS, length) / registers.shape[0])
    tail = registers.to(rows).repeat(repeats, 1)[length:]
    hidden = torch.cat([rows, tail.expand(batch, -1, -1)], dim=1)
    rope = module.rope(batch, hidden.shape[1], device=hidden.device)
    for block in module.transformer_blocks:
        hidden = block(hidden, attention_mask=None, rotary_emb=rope)
    return module.norm_out(hidden)


def processed_widths(config) -> tuple[int, ...]:
    """Widths of a context that needs no connectors (LTXAVModel.preprocess_text_embeds' check)."""
    return (config.cross_attention_dim + config.audio_cross_attention_dim, 2 * config.caption_channels)


@torch.no_grad()
def preprocess_text_embeds(path: str, config, context: torch.Tensor, unprocessed: bool = False) -> torch.Tensor:
    """LTXAVModel.preprocess_text_embeds on `context` [B, L, width] with the file's connectors, computed where the
    context is and in its dtype (as ComfyUI runs them)."""
    from ...weights.checkpoint import open_checkpoint
    from ..registry import detect_family
    from .ltx2 import _metadata_config

    if not unprocessed and context.shape[-1] in processed_widths(config):
        return context
    with open_checkpoint(path) as reader:
        _, match = detect_family(reader.keys())
        video_cfg, audio_cfg = connector_configs(reader, match.prefix, _metadata_config(reader))
        split = config.cross_attention_dim + config.audio_cross_attention_dim
        if context.shape[-1] == split:
            video_in, audio_in = context[..., :config.cross_attention_dim], context[..., config.cross_attention_dim:]
        else:
            video_in = audio_in = context
        for rows, cfg, name in ((video_in, video_cfg, CONNECTORS[0]), (audio_in, audio_cfg, CONNECTORS[1])):
            if rows.shape[-1] != cfg.width:
                raise ConfigError(f"the prompt is {context.shape[-1]} wide but {config.title}'s {name} reads "
                                  f"{cfg.width}-wide features; encode the prompt with LTXAVTextEncoderLoader's text "
                                  f"encoder for this model.")
        if config.caption_channels == 0 and f"{match.prefix}caption_projection.linear_1.weight" in reader:
            raise ConfigError(f"{config.title} projects the prompt before its connectors (caption_projection), which "
                              f"ParaDiT does not run yet; load the model with UNETLoader.")
        outputs = []
        for rows, cfg, name in ((video_in, video_cfg, CONNECTORS[0]), (audio_in, audio_cfg, CONNECTORS[1])):
            module = build_connector(reader, match.prefix, name, cfg, context.dtype, context.device)
            outputs.append(run_connector(module, rows))
            del module
    return torch.cat(outputs, dim=-1)
