"""Files of families ParaDiT knows but does not run (models.family.KNOWN_UNSUPPORTED) are refused before any work,
in one sentence naming the family and what to do, from their keys alone: header-only files (every tensor empty)
carrying each family's signature keys under the prefixes its files use."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.registry import detect_family
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

# The keys ComfyUI's detection reads (comfy/model_detection.py), plus a block's cross-attention and projections.
LTXV = ["adaln_single.emb.timestep_embedder.linear_1.bias", "adaln_single.linear.weight",
        "caption_projection.linear_1.weight", "patchify_proj.weight", "scale_shift_table",
        "transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.0.attn2.to_k.weight", "proj_out.weight"]
LTX2 = LTXV + ["audio_adaln_single.linear.weight", "audio_patchify_proj.weight", "audio_scale_shift_table",
               "transformer_blocks.0.audio_attn1.to_q.weight", "transformer_blocks.0.audio_to_video_attn.to_k.weight"]
# diffusers' LTX2VideoTransformer3DModel / LTXVideoTransformer3DModel names.
LTXV_DIFFUSERS = ["time_embed.emb.timestep_embedder.linear_1.bias", "time_embed.linear.weight", "scale_shift_table",
                  "proj_in.weight", "caption_projection.linear_1.weight", "transformer_blocks.0.attn2.to_k.weight",
                  "proj_out.weight"]
LTX2_DIFFUSERS = LTXV_DIFFUSERS + ["audio_time_embed.linear.weight", "audio_proj_in.weight", "audio_proj_out.weight",
                                  "av_cross_attn_video_scale_shift.linear.weight"]

CASES = [(LTXV, "model.diffusion_model.", "ltxv-2b-0.9.8-distilled.safetensors", "an LTX-Video \\(LTXV 0.9.x\\)"),
         (LTXV_DIFFUSERS, "", "ltxv_diffusers.safetensors", "an LTX-Video \\(LTXV 0.9.x\\)")]


def header_only(path, keys: list[str], prefix: str) -> str:
    save_file({prefix + k: torch.empty(0) for k in keys}, str(path))
    return str(path)


@pytest.mark.parametrize("keys, prefix, name, what", CASES, ids=[c[2] for c in CASES])
def test_known_unsupported_files_are_refused_in_one_sentence(tmp_path, keys, prefix, name, what):
    path = header_only(tmp_path / name, keys, prefix)
    sentence = f"^{name} is {what}.*, which ParaDiT does not run yet; load it with UNETLoader.*multi-GPU CFG split"
    with pytest.raises(ModelFileError, match=sentence) as refused:
        model_config(path)
    assert str(refused.value).count(". ") == 0 and str(refused.value).endswith(".")  # one sentence


@pytest.mark.parametrize("keys, prefix, layout", [(LTX2, "model.diffusion_model.", "original"), (LTX2, "", "original"),
                                                  (LTX2_DIFFUSERS, "transformer.", "diffusers")])
def test_ltx2_files_go_to_their_family(keys, prefix, layout):
    """LTX-2 / 2.3 (audio-video) files, which carry LTX-Video's keys too, are the ltx2 family's, not refused."""
    family, match = detect_family([prefix + k for k in keys], "ltx-2.safetensors")
    assert (family.name, match.layout, match.prefix) == ("ltx2", layout, prefix)


def test_pixart_diffusers_files_are_not_taken_for_ltx_video():
    """PixArt's diffusers layout shares adaln_single, caption_projection and attn2 with LTX-Video; its patch
    embedding (pos_embed.proj) keeps it PixArt."""
    from test_fp8 import FAMILIES
    from parallel_runtime.models.registry import family_of

    config = FAMILIES["pixart"]
    names = list(family_of(config).source_map(config, "diffusers", "transformer."))
    assert any(n.endswith("pos_embed.proj.bias") for n in names)
    assert detect_family(names)[0].name == "pixart"
