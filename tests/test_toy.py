"""The demo model's parts: scenes, the word encoder, the colour-grid codec, and deterministic training."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from parallel_runtime.errors import ConfigError
from parallel_runtime.sampling import process_latent_out
from parallel_runtime.toy import TOY_FLUX, scenes
from parallel_runtime.toy import train as toy_train
from parallel_runtime.toy.codec import ColourGrid, position_channels
from parallel_runtime.toy.text import TEXT_TOKENS, ToyTextEncoder, make_embeddings


def test_scenes_follow_their_words():
    rng = np.random.default_rng(0)
    scene = scenes.scene_from_words("large red circle top left sky".split(), rng)
    image = scenes.render(scene, 256, 256)
    top_left, bottom_right = image[:128, :128].mean(axis=(0, 1)), image[128:, 128:].mean(axis=(0, 1))
    assert top_left[0] > top_left[2] and bottom_right[2] > bottom_right[0]  # red disc there, blue sky here
    assert scene.prompt() == "large red circle top left sky"


def test_codec_keeps_flat_colours_exactly_and_shapes_to_a_few_percent():
    codec = ColourGrid()
    flat = torch.full((1, 3, 64, 64), 0.25)
    assert torch.allclose(codec.decode(codec.encode(flat)), flat, atol=1e-6)
    rng = np.random.default_rng(1)
    images = torch.stack([torch.from_numpy(scenes.render(scenes.random_scene(rng), 256, 256)).permute(2, 0, 1)
                          for _ in range(8)])
    latent = codec.encode(images)
    # The last 4 channels say where each latent pixel is, the same in every image and canvas-relative.
    assert latent.shape == (8, 16, 32, 32) and torch.equal(latent[:, 12:], position_channels(32, 32).expand(8, -1, -1, -1))
    assert torch.allclose(position_channels(64, 64)[0, 0, 0, [0, -1]], torch.tensor([-1.5, 1.5]), atol=0.05)
    # Only shape edges are lost (averaged over 4x4 cells, then interpolated): ~1% of pixels, by ~0.3 each.
    assert (codec.decode(latent) - images).abs().mean() < 0.01
    # Decoding a LATENT as the runtime returns it (ComfyUI's Flux space) undoes process_latent_out.
    assert torch.allclose(codec.decode_comfy_latent(process_latent_out(latent)), codec.decode(latent), atol=1e-5)


def test_text_encoder_names_the_vocabulary_for_an_unknown_word():
    text = ToyTextEncoder(make_embeddings(TOY_FLUX.context_dim, TOY_FLUX.pooled_dim))
    cond = text.encode("a large red circle at the top left on sky", 512, 512)
    assert cond.cond.shape == (1, TEXT_TOKENS, TOY_FLUX.context_dim) and cond.pooled.shape == (1, TOY_FLUX.pooled_dim)
    # The size is part of the pooled vector: the same words at another size differ only there.
    assert not torch.equal(text.encode("red", 256, 256).pooled, text.encode("red", 512, 512).pooled)
    with pytest.raises(ConfigError, match=r"does not know 'dragon'; use words from: .*circle"):
        text.encode("a red dragon", 512, 512)


def test_training_is_deterministic():
    """Same seed, same thread count: the same weights, bit for bit (the shipped file's promise). On the demo model's
    layout at a quarter of its width and two of its four blocks: the same loop, batches and steps (a small and a
    large micro-batch) at a tenth of the CPU time; nothing in it depends on the width."""
    config = dataclasses.replace(TOY_FLUX, hidden_size=64, num_heads=1, num_single_layers=1)
    text = ToyTextEncoder(make_embeddings(config.context_dim, config.pooled_dim))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [toy_train.train(config, 2, 1e-3, 0, ColourGrid(), text, log=lambda s: None).state_dict()
                for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not torch.equal(v, toy_train.init_model(config, 0).state_dict()[k]) for k, v in runs[0].items())
