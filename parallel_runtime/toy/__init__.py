"""The demo model: a small Flux-architecture DiT that this project trains itself on procedurally drawn scenes.

`scenes` draws one coloured shape on a background from a few words, `text` turns the words into Flux-shaped
conditioning, `codec` maps pixels to 16-channel latents at 1/8 size and back, `train` fits the DiT with
rectified flow exactly as the runtime samples it, and `export` writes it in BFL keys, so the runtime loads
`weights/toy-flux.safetensors` like any flux1-dev file.
"""
from __future__ import annotations

import os

from ..models.families.flux import FluxConfig

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
MODEL_FILE = "toy-flux.safetensors"
CODEC_FILE = "toy-text.safetensors"  # the word embeddings
MODEL_PATH = os.path.join(WEIGHTS_DIR, MODEL_FILE)
CODEC_PATH = os.path.join(WEIGHTS_DIR, CODEC_FILE)
DEFAULT_PROMPT = "a large yellow circle at the top right on sky"  # what the demo and `bench --model toy` draw

# Width 256 (4 heads of 64) is what makes 2 CPU workers pay at 512x512 (1024 image tokens): narrower
# models spend their step in per-op and per-message overhead, which does not split. Four blocks (one double,
# three single) keep training within minutes on 2 cores and split evenly into 2 or 4 PipeFusion stages;
# guidance_embeds makes it the "dev" variant (the shifted sigma schedule Flux.1-dev samples with).
TOY_FLUX = FluxConfig(hidden_size=256, num_heads=4, head_dim=64, num_layers=1, num_single_layers=3,
                      in_channels=64, context_dim=64, pooled_dim=64, guidance_embeds=True, mlp_ratio=4.0)


def load_companions(path: str = CODEC_PATH):
    """(ColourGrid codec, ToyTextEncoder); the companion file the training wrote beside the model holds the
    word embeddings."""
    from safetensors.torch import load_file

    from .codec import ColourGrid
    from .text import ToyTextEncoder

    tensors = load_file(path)
    return ColourGrid(), ToyTextEncoder(tensors)
