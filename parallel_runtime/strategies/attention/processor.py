"""The one place ParaDiT intercepts a diffusers model: its attention processor.

`ParallelFluxAttnProcessor` computes Flux's projections, q/k norms and RoPE exactly as diffusers'
FluxAttnProcessor does, then hands q/k/v of the tokens this rank holds to the job's attention strategy
(local, Ulysses, Ring, stale-KV PipeFusion or a composition). Blocks, MLPs and modulation stay untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers.models.embeddings import apply_rotary_emb

from ...weights.input_amax import InputAmax
from .local import LocalAttention


@dataclass
class AttentionContext:
    """Per-rank state the processors read; the runner swaps both when the strategy changes.

    `attention` runs over the joint [text, image] rows; `image_attention` over image rows only (an
    image-only self-attention, as SD3.5 Medium's second attention and PixArt's self-attention are)."""

    attention: Callable = LocalAttention()
    image_attention: Callable = LocalAttention()
    # A two-stream model's other attentions (LTX-2: "audio" self-attention, "a2v" / "v2a" across the streams), each
    # over its own pair of shard splits (streams.stream_attention); `attention` is the first stream's ("video").
    streams: dict = field(default_factory=dict)
    # PipeFusion's stale K/V under a stock sampler, kept from one model call to the next (model_call.py).
    stale_kv: dict = field(default_factory=dict)
    # The model's quantized layers' input amax (weights/input_amax.py): the runner points its `reduce` at the
    # ranks of each job's forward pass (strategies/forward_amax.py), as it points the attention at the strategy.
    input_amax: InputAmax = field(default_factory=InputAmax)


class ParallelFluxAttnProcessor:
    def __init__(self, layer: int, context: AttentionContext, masked: bool = True):
        """`masked`: whether the call's attention mask applies (False for a ControlNet's layers: ComfyUI runs its
        ControlNets without the DiT's attention_mask)."""
        self.layer = layer
        self.context = context
        self.masked = masked

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 encoder_hidden_states_mask=None):
        # encoder_hidden_states_mask: Qwen-Image's blocks pass one; ComfyUI's conds are unpadded, so it is None.
        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        text_len = 0
        if encoder_hidden_states is not None:
            # Double-stream block: text tokens first, as in Flux.
            text_len = encoder_hidden_states.shape[1]
            query = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))), query], dim=1)
            key = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))), key], dim=1)
            value = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = self.context.attention(query, key, value, self.layer, masked=self.masked).flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return out
        text_out, image_out = out[:, :text_len], out[:, text_len:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())
