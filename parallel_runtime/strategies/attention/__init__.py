"""Attention strategies: each sees q/k/v for the tokens this rank holds and returns the exact result."""
from .bias import AttentionBias
from .local import LocalAttention, attention, attention_with_lse, merge_partials
from .ring import RingAttention
from .ulysses import UlyssesAttention

__all__ = ["AttentionBias", "LocalAttention", "RingAttention", "UlyssesAttention", "attention", "attention_with_lse",
           "merge_partials"]
