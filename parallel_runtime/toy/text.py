"""The toy model's text "encoder": a fixed embedding per vocabulary word, no network.

A prompt becomes its content words (stopwords dropped) in order, each a `context_dim` vector, padded with
zero vectors to a fixed length so that any two prompts share a batch (cfg > 1 runs cond and uncond
together); the pooled vector is the mean of the words' pooled embeddings. The empty prompt (all padding)
is what training substituted for dropped prompts, so it is the negative prompt for cfg > 1.

The pooled vector also carries the image size, as SDXL's size conditioning does: Flux's RoPE tells a token
where it is relative to the text (which sits at the origin, the top-left corner) but not how large the
canvas is, so without it "bottom right" or "center" would have to be inferred from attention alone, which a
model trained in minutes does not learn (it tiles the picture at sizes it was not trained on).
"""
from __future__ import annotations

import math
import re

import torch

from ..errors import ConfigError
from ..spec import Conditioning
from . import scenes

VOCABULARY = (tuple(scenes.SIZES) + tuple(scenes.COLOURS) + scenes.SHAPES + scenes.POSITION_WORDS
              + tuple(scenes.BACKGROUNDS))
TEXT_TOKENS = 8  # longest prompt: size, colour, shape, two position words, background
EMBEDDING_SEED = 20240601


def make_embeddings(context_dim: int, pooled_dim: int) -> dict[str, torch.Tensor]:
    """Random vectors of norm sqrt(width) per word and per size axis (nearly orthogonal at these widths),
    from a fixed seed."""
    g = torch.Generator().manual_seed(EMBEDDING_SEED)

    def rows(n: int, dim: int) -> torch.Tensor:
        t = torch.randn(n, dim, generator=g)
        return t / t.norm(dim=1, keepdim=True) * dim ** 0.5

    return {"text.cond": rows(len(VOCABULARY), context_dim), "text.pooled": rows(len(VOCABULARY), pooled_dim),
            "text.size": rows(2, pooled_dim)}


def size_feature(pixels: int) -> float:
    """log2 of the side in tokens (16 px), centred on 256 px: -1 at 128 px, +1 at 512 px."""
    return math.log2(pixels / 16) - 4


def words_of(prompt: str) -> list[str]:
    """Content words of a prompt; raises ConfigError naming the vocabulary for a word the model never saw."""
    words = [w for w in re.findall(r"[a-z]+", prompt.lower()) if w not in scenes.STOPWORDS]
    unknown = [w for w in words if w not in VOCABULARY]
    if unknown:
        raise ConfigError(f"the toy model does not know {', '.join(repr(w) for w in unknown)}; use words from: "
                          f"{' '.join(VOCABULARY)}.")
    if len(words) > TEXT_TOKENS:
        raise ConfigError(f"the prompt has {len(words)} content words; the toy model reads at most {TEXT_TOKENS}.")
    return words


class ToyTextEncoder:
    def __init__(self, embeddings: dict[str, torch.Tensor]):
        self.cond_table = embeddings["text.cond"].float()
        self.pooled_table = embeddings["text.pooled"].float()
        self.size_table = embeddings["text.size"].float()  # [2, pooled_dim]: height, width directions
        self.index = {w: i for i, w in enumerate(VOCABULARY)}

    def encode_words(self, batch: list[list[str]], height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cond [B, TEXT_TOKENS, context_dim] and pooled [B, pooled_dim] for lists of content words and an
        image of height x width pixels."""
        cond = torch.zeros(len(batch), TEXT_TOKENS, self.cond_table.shape[1])
        size = size_feature(height) * self.size_table[0] + size_feature(width) * self.size_table[1]
        pooled = size.repeat(len(batch), 1)
        for b, words in enumerate(batch):
            if words:
                ids = torch.tensor([self.index[w] for w in words])
                cond[b, : len(words)] = self.cond_table[ids]
                pooled[b] += self.pooled_table[ids].mean(dim=0)
        return cond, pooled

    def encode(self, prompt: str, height: int, width: int, guidance: float = 3.5) -> Conditioning:
        """`prompt` for an image of height x width pixels."""
        cond, pooled = self.encode_words([words_of(prompt)], height, width)
        return Conditioning(cond, pooled, guidance)
