"""LTX-2 on a released-layout file equals ComfyUI 2026's model call on it (one worker).

This host's ComfyUI (late 2025) has no LTXAVModel, so `comfyui_call` below is written from ComfyUI 2026's
comfy/ldm/lightricks/av_model.py (LTXAVModel._prepare_timestep, BasicAVTransformerBlock.forward) and
comfy/ldm/lightricks/model.py (compute_prompt_timestep, apply_cross_attention_adaln), in ComfyUI's own names, over
the modules of diffusers' class loaded with the same file (the parameters map one to one). The steps that differ
from diffusers' forward are the ones written out: the timestep rows (a2v / v2a scale-shift from each stream's own
per-token timesteps; the a2v gate from the largest audio timestep, the v2a gate from the largest video one, times
av_ca_timestep_scale_multiplier / 1000 with LTXAVModel's default multiplier of 1 for a file without `config`
metadata; the prompt rows from each sample's largest timestep) and the block's order (video-to-audio normalizes the
video after the audio-to-video update). Steps ComfyUI computes as diffusers does (RoPE, the attention layers, the
caption projection, the output head, per-frame timestep compression, which only shares equal rows) run through
diffusers' modules.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import rel_err
from test_ltx2 import AUDIO_FRAMES, CONFIGS, SERIAL_RTOL, H, T, W, inputs, paths, serial_call  # noqa: F401

pytestmark = pytest.mark.timeout(120)

AV_CA_MULTIPLIER = 1.0  # LTXAVModel.__init__'s av_ca_timestep_scale_multiplier (the tiny files carry no metadata)
TIMESTEP_SCALE = 1000.0  # LTXAVModel's timestep_scale_multiplier


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=1e-6)  # comfy.ldm.common_dit.rms_norm


def get_ada_values(table: torch.Tensor, b: int, timestep: torch.Tensor, indices=slice(None)) -> tuple:
    n = table.shape[0]
    return (table[indices][None, None] + timestep.reshape(b, timestep.shape[1], n, -1)[:, :, indices]).unbind(2)


def adaln(module, t: torch.Tensor, b: int) -> tuple:
    out, embedded = module(t.flatten(), batch_size=b, hidden_dtype=torch.float32)
    return out.view(b, -1, out.shape[-1]), embedded.view(b, -1, embedded.shape[-1])


def prepare_timestep(m, v_sigma: torch.Tensor, a_sigma: torch.Tensor, b: int) -> dict:
    """LTXAVModel._prepare_timestep for per-token sigmas [B, tokens] of each stream."""
    timestep_scaled, a_timestep_scaled = v_sigma * TIMESTEP_SCALE, a_sigma * TIMESTEP_SCALE
    av_ca_factor = AV_CA_MULTIPLIER / TIMESTEP_SCALE
    v_timestep, v_embedded = adaln(m.time_embed, timestep_scaled, b)
    a_timestep, a_embedded = adaln(m.audio_time_embed, a_timestep_scaled, b)
    flat, a_flat = timestep_scaled.flatten(), a_timestep_scaled.flatten()
    rows = dict(v_timestep=v_timestep, a_timestep=a_timestep, v_embedded=v_embedded, a_embedded=a_embedded,
                a_cross_ss=adaln(m.av_cross_attn_audio_scale_shift, a_flat, b)[0],
                v_cross_ss=adaln(m.av_cross_attn_video_scale_shift, flat, b)[0],
                v_cross_gate=adaln(m.av_cross_attn_video_a2v_gate,
                                   a_timestep_scaled.max().expand_as(flat) * av_ca_factor, b)[0],
                a_cross_gate=adaln(m.av_cross_attn_audio_v2a_gate,
                                   timestep_scaled.max().expand_as(a_flat) * av_ca_factor, b)[0],
                v_prompt=None, a_prompt=None)
    if getattr(m, "prompt_adaln", None) is not None and m.config.use_prompt_adaln_single:  # compute_prompt_timestep
        rows["v_prompt"] = adaln(m.prompt_adaln, timestep_scaled.max(dim=1).values, b)[0]
        rows["a_prompt"] = adaln(m.audio_prompt_adaln, a_timestep_scaled.max(dim=1).values, b)[0]
    return rows


def text_cross_attention(block, x, context, attn, table, prompt_table, timestep, prompt_timestep):
    """BasicAVTransformerBlock._apply_text_cross_attention (apply_cross_attention_adaln where the file has it)."""
    b = x.shape[0]
    if block.cross_attn_adaln:
        shift_q, scale_q, gate = get_ada_values(table, b, timestep, slice(6, 9))
        if prompt_timestep is not None:
            shift_kv, scale_kv = get_ada_values(prompt_table, b, prompt_timestep)
        else:
            shift_kv, scale_kv = prompt_table[None, None].unbind(2)
        return attn(rms_norm(x) * (1 + scale_q) + shift_q,
                    encoder_hidden_states=context * (1 + scale_kv) + shift_kv) * gate
    return attn(rms_norm(x), encoder_hidden_states=context)


def av_block(block, vx, ax, v_context, a_context, ts: dict, pe: dict, self_mask=None):
    """BasicAVTransformerBlock.forward (inference: rms_adaln = rms_norm * (1 + scale) + shift); `self_mask`: the
    video self-attention's additive mask [B, tokens, tokens] (LTXVModel's guide attention), or None."""
    b = vx.shape[0]
    vshift, vscale = get_ada_values(block.scale_shift_table, b, ts["v_timestep"], slice(0, 2))
    attn1_out = block.attn1(rms_norm(vx) * (1 + vscale) + vshift, attention_mask=self_mask, query_rotary_emb=pe["v"])
    vx = vx + attn1_out * get_ada_values(block.scale_shift_table, b, ts["v_timestep"], slice(2, 3))[0]
    vx = vx + text_cross_attention(block, vx, v_context, block.attn2, block.scale_shift_table,
                                   getattr(block, "prompt_scale_shift_table", None), ts["v_timestep"], ts["v_prompt"])
    ashift, ascale = get_ada_values(block.audio_scale_shift_table, b, ts["a_timestep"], slice(0, 2))
    attn1_out = block.audio_attn1(rms_norm(ax) * (1 + ascale) + ashift, query_rotary_emb=pe["a"])
    ax = ax + attn1_out * get_ada_values(block.audio_scale_shift_table, b, ts["a_timestep"], slice(2, 3))[0]
    ax = ax + text_cross_attention(block, ax, a_context, block.audio_attn2, block.audio_scale_shift_table,
                                   getattr(block, "audio_prompt_scale_shift_table", None), ts["a_timestep"],
                                   ts["a_prompt"])
    ax_norm3 = rms_norm(ax)
    video_table = block.video_a2v_cross_attn_scale_shift_table  # ComfyUI's scale_shift_table_a2v_ca_video
    audio_table = block.audio_a2v_cross_attn_scale_shift_table
    # audio to video
    scale_a, shift_a = get_ada_values(audio_table[:4], b, ts["a_cross_ss"])[:2]
    scale_v, shift_v = get_ada_values(video_table[:4], b, ts["v_cross_ss"])[:2]
    a2v_out = block.audio_to_video_attn(rms_norm(vx) * (1 + scale_v) + shift_v,
                                        encoder_hidden_states=ax_norm3 * (1 + scale_a) + shift_a,
                                        query_rotary_emb=pe["v_cross"], key_rotary_emb=pe["a_cross"])
    vx = vx + a2v_out * get_ada_values(video_table[4:], b, ts["v_cross_gate"])[0]
    # video to audio: the video as the a2v update left it
    scale_a, shift_a = get_ada_values(audio_table[:4], b, ts["a_cross_ss"])[2:4]
    scale_v, shift_v = get_ada_values(video_table[:4], b, ts["v_cross_ss"])[2:4]
    v2a_out = block.video_to_audio_attn(ax_norm3 * (1 + scale_a) + shift_a,
                                        encoder_hidden_states=rms_norm(vx) * (1 + scale_v) + shift_v,
                                        query_rotary_emb=pe["a_cross"], key_rotary_emb=pe["v_cross"])
    ax = ax + v2a_out * get_ada_values(audio_table[4:], b, ts["a_cross_gate"])[0]
    vshift, vscale = get_ada_values(block.scale_shift_table, b, ts["v_timestep"], slice(3, 5))
    vx = vx + block.ff(rms_norm(vx) * (1 + vscale) + vshift) * get_ada_values(
        block.scale_shift_table, b, ts["v_timestep"], slice(5, 6))[0]
    ashift, ascale = get_ada_values(block.audio_scale_shift_table, b, ts["a_timestep"], slice(3, 5))
    ax = ax + block.audio_ff(rms_norm(ax) * (1 + ascale) + ashift) * get_ada_values(
        block.audio_scale_shift_table, b, ts["a_timestep"], slice(5, 6))[0]
    return vx, ax


@torch.no_grad()
def comfyui_call(path: str, name: str, x: dict, fps: float = 24.0, config=None, coords=None, self_mask=None,
                 guide_tokens: int = 0, audio_coords=None) -> tuple[torch.Tensor, torch.Tensor]:
    """LTXAVModel's forward on the file: ComfyUI hands it sigmas (the timesteps here / 1000). `coords`: the video
    tokens' pixel coordinates [B, 3, tokens, 2] (time in seconds) where they are not the T x H x W grid's (guide
    frames; `guide_tokens` of them at the end), `self_mask` the video self-attention's additive mask, `audio_coords`
    the audio rows' times [B, 1, rows, 2] where they are not the audio grid's (reference audio); `config` where the
    file is not one of CONFIGS. A file with LTX-2.5's keyframe row gets it on the tokens whose time starts at 0,
    never a guide's (LTXVModel.apply_keyframes_abs_pos_embedding, on every call)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    config = config or CONFIGS[name]
    sd = convert_ltx2_transformer_to_diffusers(load_file(path))
    sd = {k.replace("prompt_adaln_single.", "prompt_adaln."): v for k, v in sd.items()}
    m = LTX2VideoTransformer3DModel(**config.diffusers_kwargs()).eval()
    m.load_state_dict(sd, strict=True)
    b = x["video"].shape[0]
    ts = prepare_timestep(m, x["video_t"] / TIMESTEP_SCALE, x["audio_t"] / TIMESTEP_SCALE, b)
    video = m.rope.prepare_video_coords(b, T, H, W, "cpu", fps=fps) if coords is None else coords
    audio = m.audio_rope.prepare_audio_coords(b, AUDIO_FRAMES, "cpu") if audio_coords is None else audio_coords
    pe = dict(v=m.rope(video, device="cpu"), a=m.audio_rope(audio, device="cpu"),
              v_cross=m.cross_attn_rope(video[:, 0:1], device="cpu"),
              a_cross=m.cross_attn_audio_rope(audio[:, 0:1], device="cpu"))
    v_context, a_context = x["video_context"], x["audio_context"]
    if config.caption_channels:  # _prepare_context: LTX-2.0 projects the connectors' rows
        v_context, a_context = m.caption_projection(v_context), m.audio_caption_projection(a_context)
    vx, ax = m.proj_in(x["video"]), m.audio_proj_in(x["audio"])
    if getattr(m, "keyframes_abs_pos_embedding", None) is not None:
        marker = video[:, 0, :, 0] == 0
        marker[:, marker.shape[1] - guide_tokens:] = False
        vx = vx + marker[..., None].float() * m.keyframes_abs_pos_embedding
    for block in m.transformer_blocks:
        vx, ax = av_block(block, vx, ax, v_context, a_context, ts, pe, self_mask)

    def out(h, table, embedded, norm, proj):
        shift, scale = (table[None, None] + embedded[:, :, None]).unbind(2)
        return proj(norm(h) * (1 + scale) + shift)

    return (out(vx, m.scale_shift_table, ts["v_embedded"], m.norm_out, m.proj_out),
            out(ax, m.audio_scale_shift_table, ts["a_embedded"], m.audio_norm_out, m.audio_proj_out))


def comfyui_inputs(name: str) -> dict:
    """inputs() with the audio at another timestep than the video (the gates then read different peaks) and the
    prompt rows at each sample's largest timestep, as compute_prompt_timestep reads them."""
    x = inputs(CONFIGS[name])
    x["audio_t"] = torch.full_like(x["audio_t"], 600.0)
    x["sigma"], x["audio_sigma"] = x["video_t"].amax(dim=1), x["audio_t"].amax(dim=1)
    return x


@pytest.mark.parametrize("name", CONFIGS)
def test_released_layout_equals_comfyui_model_call(paths, name):
    """One worker on a Lightricks-layout file (the one ComfyUI loads) equals LTXAVModel's call on it; the same file
    read as diffusers reads it does not (so the comparison tells the readings apart)."""
    x = comfyui_inputs(name)
    want_v, want_a = comfyui_call(paths[name], name, x)
    got_v, got_a = serial_call(paths[name], x)
    assert want_v.abs().mean() > 0.1 and want_a.abs().mean() > 0.1  # outputs of O(1): a real comparison
    errs = rel_err(got_v, want_v), rel_err(got_a, want_a)
    assert max(errs) < SERIAL_RTOL, errs  # fp32, another op order: ~1e-6
    other_v, other_a = serial_call(paths[name], x, reading="diffusers", av_timestep_multiplier=1000.0)
    assert max(rel_err(other_v, want_v), rel_err(other_a, want_a)) > 1e-3
