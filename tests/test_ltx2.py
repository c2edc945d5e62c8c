"""LTX-2 / LTX-2.3 (audio-video) on the workers: detection in both layouts, config from shapes, the serial model
against diffusers' LTX2VideoTransformer3DModel on the same file, and the two streams split over real gloo ranks
(Ulysses, Ring and both) against the serial call.

The reference is diffusers' own model, loaded through diffusers' own single-file converter
(convert_ltx2_transformer_to_diffusers: Lightricks' names -> diffusers'), plus the one rename it leaves out
(LTX-2.3's prompt_adaln_single), so it shares nothing with the family module but the file. Timesteps are per token:
the first latent frame's video tokens are a conditioning frame (timestep 0), as image-to-video gives them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.ltx2 import LTX2Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(300)

# 32 heads as every released file (ComfyUI's detection fixes them): video 32 x 4 wide, audio 32 x 2; 2 blocks.
# LTX-2.0 projects a 32-wide caption itself; LTX-2.3 gates its heads, modulates the prompt cross-attention, reads
# the connectors' rows as they are and rotates with split RoPE.
LTX20 = LTX2Config(hidden_size=128, audio_hidden_size=64, num_layers=2, in_channels=16, audio_in_channels=16,
                   cross_attention_dim=128, audio_cross_attention_dim=64, caption_channels=32)
LTX23 = LTX2Config(hidden_size=128, audio_hidden_size=64, num_layers=2, in_channels=16, audio_in_channels=16,
                   cross_attention_dim=128, audio_cross_attention_dim=64, gated_attn=True, cross_attn_mod=True,
                   prompt_adaln=True, rope_type="split", cross_timestep=True)
CONFIGS = {"ltx2.0": LTX20, "ltx2.3": LTX23}
T, H, W = 3, 4, 6  # latent frames x height x width: 72 video tokens
AUDIO_FRAMES = 13  # audio latent frames: 13 tokens (not a multiple of 2 or 4: uneven shards)
AUDIO_CHANNELS = 2  # x 8 mel bins = 16 channels per token in the tiny files
PROMPT = 7
# One fp32 forward in another op order than the reference: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx2")
    return {name: write_checkpoint(str(folder / f"{name}.safetensors"), config, seed=3,
                                   prefix="model.diffusion_model.") for name, config in CONFIGS.items()}


def inputs(config: LTX2Config, batch: int = 2, seed: int = 5) -> dict:
    """One model call's inputs: packed video and audio tokens, both prompts, per-token timesteps (the first frame a
    conditioning frame at 0; audio at the step's timestep), sigmas."""
    g = torch.Generator().manual_seed(seed)
    ctx_width = config.caption_channels or None
    video_t = torch.full((batch, T * H * W), 800.0)
    video_t[:, :H * W] = 0.0
    return dict(video=torch.randn(batch, T * H * W, config.in_channels, generator=g),
                audio=torch.randn(batch, AUDIO_FRAMES, config.audio_in_channels, generator=g),
                video_context=torch.randn(batch, PROMPT, ctx_width or config.cross_attention_dim, generator=g),
                audio_context=torch.randn(batch, PROMPT, ctx_width or config.audio_cross_attention_dim, generator=g),
                video_t=video_t, audio_t=torch.full((batch, AUDIO_FRAMES), 800.0),
                sigma=torch.full((batch,), 800.0), audio_sigma=torch.full((batch,), 760.0))


@torch.no_grad()
def diffusers_call(path: str, config: LTX2Config, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    sd = convert_ltx2_transformer_to_diffusers(load_file(path))
    sd = {k.replace("prompt_adaln_single.", "prompt_adaln."): v for k, v in sd.items()}
    model = LTX2VideoTransformer3DModel(**config.diffusers_kwargs()).eval()
    model.load_state_dict(sd, strict=True)
    out = model(hidden_states=x["video"], audio_hidden_states=x["audio"], encoder_hidden_states=x["video_context"],
                audio_encoder_hidden_states=x["audio_context"], timestep=x["video_t"], audio_timestep=x["audio_t"],
                sigma=x["sigma"], audio_sigma=x["audio_sigma"], num_frames=T, height=H, width=W, fps=24.0,
                audio_num_frames=AUDIO_FRAMES, use_cross_timestep=config.cross_timestep, return_dict=False)
    return out[0], out[1]


def serial_call(path: str, x: dict, video_rows=None, audio_rows=None, context=None):
    """ParaDiT's family on one rank: the file read through its key map, every row (or the rows given)."""
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
        config = family.infer_config(reader, match, os.path.basename(path))
        model = family.build(config, reader, match, lambda n: True, torch.float32, torch.device("cpu")).eval()
    adapter = family.adapter(config, model, [range(config.num_blocks)], context or AttentionContext())
    v = torch.arange(T * H * W) if video_rows is None else video_rows
    a = torch.arange(AUDIO_FRAMES) if audio_rows is None else audio_rows
    rope = adapter.rope((T, H, W), v, AUDIO_FRAMES, a, fps=24.0, batch=x["video"].shape[0])
    with torch.no_grad():
        return adapter.forward_rows(x["video"][:, v], x["audio"][:, a], x["video_context"], x["audio_context"],
                                    x["video_t"][:, v], x["audio_t"][:, a], x["sigma"], x["audio_sigma"], rope)


# -- detection --------------------------------------------------------------------------------------------------

def _diffusers_twin(path: str, folder) -> str:
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    sd = convert_ltx2_transformer_to_diffusers(load_file(path))
    sd = {"transformer." + k.replace("prompt_adaln_single.", "prompt_adaln."): v.contiguous() for k, v in sd.items()}
    out = str(folder / ("diffusers-" + os.path.basename(path)))
    save_file(sd, out)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_files_are_detected_in_both_layouts(paths, name, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    twin = _diffusers_twin(paths[name], tmp_path)
    for path, layout, prefix in ((paths[name], "original", "model.diffusion_model."), (twin, "diffusers", "transformer.")):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("ltx2", layout, prefix)
        assert model_config(path) == CONFIGS[name], layout


def test_ltx_video_09_is_still_refused(tmp_path):
    """LTX-Video 0.9's keys (no audio stream) stay refused in one sentence; LTX-2's are no longer."""
    sd = {k: torch.zeros(1) for k in ("adaln_single.emb.timestep_embedder.linear_1.bias",
                                      "transformer_blocks.0.attn2.to_k.weight", "patchify_proj.weight")}
    with pytest.raises(ModelFileError, match=r"LTX-Video \(LTXV 0\.9\.x\).*does not run yet"):
        detect_family(sd.keys(), "ltxv.safetensors")


# -- parity with diffusers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_serial_matches_diffusers(paths, name, layout, tmp_path):
    config, x = CONFIGS[name], inputs(CONFIGS[name])
    path = paths[name] if layout == "original" else _diffusers_twin(paths[name], tmp_path)
    want_v, want_a = diffusers_call(paths[name], config, x)
    got_v, got_a = serial_call(path, x)
    assert want_v.abs().mean() > 0.1 and want_a.abs().mean() > 0.1  # outputs of O(1): a real comparison
    assert rel_err(got_v, want_v) < SERIAL_RTOL and rel_err(got_a, want_a) < SERIAL_RTOL, (
        rel_err(got_v, want_v), rel_err(got_a, want_a))
