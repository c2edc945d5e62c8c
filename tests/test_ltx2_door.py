"""LTX-2 / 2.3 through the stock MODEL door: Load Parallel DiT's MODEL called as ComfyUI 2026 calls LTXAVModel.

The fake host is tests/test_model_path_2026.py's (ComfyUI 2026's detection, patcher and wrappers), with the LTXAV
class added as comfy/model_detection.py, comfy/supported_models.py and comfy/model_base.py define it: the "ltxav"
branch (the LTXV keys and an audio AdaLN), ModelSamplingFlux (timestep = sigma), LTXAV.extra_conds (the prompt
through the diffusion model's preprocess_text_embeds, frame_rate, the unpacked noise masks and whatever guide nodes
add) and LTXAV.process_timestep (mask x sigma patchified per video token and per audio frame, with ComfyUI's own
patchifier arithmetic). The call is BaseModel._apply_model's: x = [video, audio] (flow: calculate_input is x).

The reference shares only the file with the door: ComfyUI's prompt connectors written out below from
comfy/ldm/lightricks/embeddings_connector.py and model.py's CrossAttention (registers appended up to 1024 rows, 1-D
RoPE over positions / 4096, q/k RMS norms of eps 1e-5, per-head gates), then test_ltx2_comfyui.comfyui_call, which
is LTXAVModel's forward over diffusers' modules of the same DiT weights (a twin file without the connectors, which
diffusers' converter does not know).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import test_model_path_2026 as host
from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.sampling.flow import FluxModelSampling
from test_ltx2 import AUDIO_FRAMES, CONFIGS, PROMPT, H, T, W
from test_ltx2_comfyui import comfyui_call

pytestmark = pytest.mark.timeout(600)

SIGMA, FPS = 0.7, 24.0
# fp32 throughout; the door and the reference run the same math in another op order (~1e-7 measured), and exact
# strategies reorder sums likewise.
RTOL = 1e-5
# Tiny connectors, given as released files give them: heads and head size in the file's `config` metadata.
CONNECTORS = {
    "ltx2.0": dict(video=(2, 16), audio=(2, 16), layers=1, gated=False,  # both read the 32-wide caption features
                   meta={"rope_type": "interleaved", "connector_num_attention_heads": 2,
                         "connector_attention_head_dim": 16}),
    "ltx2.3": dict(video=(4, 32), audio=(2, 32), layers=2, gated=True,  # the video and the audio features
                   meta={"rope_type": "split", "connector_num_attention_heads": 4, "connector_attention_head_dim": 32,
                         "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 32}),
}
REGISTERS = 128  # Embeddings1DConnector's learnable registers


def _connector_tensors(prefix: str, heads: int, head_dim: int, layers: int, gated: bool, g) -> dict:
    """One connector's weights in ComfyUI's names, at scales that keep every activation of O(1)."""
    width = heads * head_dim

    def lin(out, inp, key):
        return {key + ".weight": torch.randn(out, inp, generator=g) / math.sqrt(inp),
                key + ".bias": 0.1 * torch.randn(out, generator=g)}

    sd = {prefix + "learnable_registers": torch.randn(REGISTERS, width, generator=g)}
    for i in range(layers):
        b = f"{prefix}transformer_1d_blocks.{i}."
        for name in ("to_q", "to_k", "to_v", "to_out.0"):
            sd.update(lin(width, width, b + "attn1." + name))
        sd[b + "attn1.q_norm.weight"] = 1 + 0.1 * torch.randn(width, generator=g)
        sd[b + "attn1.k_norm.weight"] = 1 + 0.1 * torch.randn(width, generator=g)
        if gated:
            sd.update(lin(heads, width, b + "attn1.to_gate_logits"))
        sd.update(lin(4 * width, width, b + "ff.net.0.proj"))
        sd.update(lin(width, 4 * width, b + "ff.net.2"))
    return sd


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: (released file with connectors and `config` metadata, its DiT-only twin)}."""
    folder = tmp_path_factory.mktemp("ltx2_door")
    out = {}
    for name, config in CONFIGS.items():
        twin = write_checkpoint(str(folder / f"{name}-dit.safetensors"), config, seed=3,
                                prefix="model.diffusion_model.")
        c, g = CONNECTORS[name], torch.Generator().manual_seed(9)
        sd = load_file(twin)
        for stream in ("video", "audio"):
            sd.update(_connector_tensors(f"model.diffusion_model.{stream}_embeddings_connector.", *c[stream],
                                         c["layers"], c["gated"], g))
        path = str(folder / f"{name}.safetensors")
        save_file(sd, path, metadata={"config": json.dumps({"transformer": c["meta"]})})
        out[name] = (path, twin)
    return out


# -- ComfyUI's prompt connectors, written from comfy/ldm/lightricks/embeddings_connector.py --------------------------

def _rms(x, eps=1e-6):
    return F.rms_norm(x, (x.shape[-1],), eps=eps)  # comfy.ldm.common_dit.rms_norm


def _rope(x, freqs, heads: int, split: bool):
    """apply_rotary_emb: per head, (first half, second half) pairs (split) or adjacent pairs (interleaved), each
    rotated by its frequency (pair k of the D // 2 uses freqs[..., k])."""
    b, t, d = x.shape
    xh, f = x.view(b, t, heads, -1), freqs.view(1, t, heads, -1)
    a, c = xh.chunk(2, -1) if split else (xh[..., 0::2], xh[..., 1::2])
    ra, rc = a * f.cos() - c * f.sin(), a * f.sin() + c * f.cos()
    return (torch.cat([ra, rc], -1) if split else torch.stack([ra, rc], -1).flatten(-2)).reshape(b, t, d)


def comfyui_connector(sd: dict, prefix: str, x: torch.Tensor, heads: int, split: bool) -> torch.Tensor:
    """Embeddings1DConnector.forward: registers after the prompt up to max(1024, L), blocks, final RMS norm."""
    w = lambda key: sd[prefix + key]  # noqa: E731
    registers = w("learnable_registers")
    length, width = x.shape[1], registers.shape[1]
    tiled = torch.tile(registers, (math.ceil(max(1024, length) / registers.shape[0]), 1))
    h = torch.cat([x, tiled[length:].unsqueeze(0).repeat(x.shape[0], 1, 1)], dim=1)
    # precompute_freqs_cis: generate_freq_grid_np(theta, 1, width) times positions / 4096 scaled to [-1, 1]
    indices = (10000.0 ** torch.linspace(0, 1, width // 2, dtype=torch.float64) * math.pi / 2).float()
    positions = torch.arange(h.shape[1], dtype=torch.float32) / 4096
    freqs = indices * (positions[:, None] * 2 - 1)
    i = 0
    while prefix + f"transformer_1d_blocks.{i}.attn1.to_q.weight" in sd:
        b = f"transformer_1d_blocks.{i}."
        lin = lambda y, key: F.linear(y, w(b + key + ".weight"), w(b + key + ".bias"))  # noqa: E731
        n = _rms(h)
        q = F.rms_norm(lin(n, "attn1.to_q"), (width,), w(b + "attn1.q_norm.weight"), eps=1e-5)
        k = F.rms_norm(lin(n, "attn1.to_k"), (width,), w(b + "attn1.k_norm.weight"), eps=1e-5)
        q, k, v = (_rope(q, freqs, heads, split), _rope(k, freqs, heads, split), lin(n, "attn1.to_v"))
        out = F.scaled_dot_product_attention(*(y.unflatten(2, (heads, -1)).transpose(1, 2) for y in (q, k, v)))
        out = out.transpose(1, 2)
        if prefix + b + "attn1.to_gate_logits.weight" in sd:
            out = out * (2.0 * torch.sigmoid(lin(n, "attn1.to_gate_logits"))).unsqueeze(-1)
        h = h + lin(out.flatten(2), "attn1.to_out.0")
        h = h + lin(F.gelu(lin(_rms(h), "ff.net.0.proj"), approximate="tanh"), "ff.net.2")
        i += 1
    return _rms(h)


def comfyui_prompt(path: str, name: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LTXAVModel.preprocess_text_embeds (unprocessed), as the (video, audio) rows _prepare_context splits."""
    sd, c, config = load_file(path), CONNECTORS[name], CONFIGS[name]
    split = c["meta"]["rope_type"] == "split"
    video_in, audio_in = ((raw, raw) if config.caption_channels else
                          (raw[..., :config.cross_attention_dim], raw[..., config.cross_attention_dim:]))
    p = "model.diffusion_model."
    with torch.no_grad():
        return (comfyui_connector(sd, p + "video_embeddings_connector.", video_in, c["video"][0], split),
                comfyui_connector(sd, p + "audio_embeddings_connector.", audio_in, c["audio"][0], split))


# -- the fake host's LTXAV ----------------------------------------------------------------------------------------

def ltxav_conds(base, cross_attn, unprocessed_ltxav_embeds=False, frame_rate=25, denoise_mask=None,
                attention_mask=None, **rest):
    """model_base.LTXAV.extra_conds; `denoise_mask`: the unpacked (video, audio) masks (utils.unpack_latents of the
    sampler's packed mask, as extra_conds makes them from latent_shapes)."""
    out = {"c_crossattn": base.diffusion_model.preprocess_text_embeds(cross_attn, unprocessed=unprocessed_ltxav_embeds),
           "frame_rate": frame_rate}
    if attention_mask is not None:
        out["attention_mask"] = attention_mask
    if denoise_mask is not None:
        out["denoise_mask"], out["audio_denoise_mask"] = denoise_mask
    for key in ("keyframe_idxs", "guide_attention_entries", "ref_audio", "generated_keyframes"):
        if rest.get(key) is not None:
            out[key] = rest[key]
    return out


class LTXAVBase(host.FakeBaseModel):
    """model_base.LTXAV: ModelType.FLUX sampling (shift 2.37), LTXAV's 128-channel latent format."""

    def __init__(self, config, sd):
        s = config.supported
        self.model_config, self.current_patcher, self.in_channels, self.diffusion_model = config, None, None, None
        self.latent_format = types.SimpleNamespace(latent_channels=128)
        self.model_sampling = FluxModelSampling(s.shift, s.multiplier, kind=s.sampling)

    def process_timestep(self, timestep, x, denoise_mask=None, audio_denoise_mask=None, **kwargs):
        v_timestep = a_timestep = timestep
        if denoise_mask is not None:
            v_timestep = self.diffusion_model.patchifier.patchify(
                (denoise_mask * timestep.view([timestep.shape[0]] + [1] * (denoise_mask.ndim - 1)))[:, :1])[0]
        if audio_denoise_mask is not None:
            a_timestep = self.diffusion_model.a_patchifier.patchify(
                (audio_denoise_mask * timestep.view([timestep.shape[0]] + [1] * (audio_denoise_mask.ndim - 1)))
                [:, :1, :, :1])[0]
        return v_timestep, a_timestep


def _patchifier_module():
    """comfy.ldm.lightricks.symmetric_patchifier as far as process_timestep reads it: the patchified tensor
    (SymmetricPatchifier(1): "b c f h w -> b (f h w) c"; AudioPatchifier: "b c t f -> b t (c f)"); the positions it
    also returns are not read there."""
    module = types.ModuleType("comfy.ldm.lightricks.symmetric_patchifier")

    class SymmetricPatchifier:
        def __init__(self, patch_size, start_end=False):
            assert patch_size == 1

        def patchify(self, latents):
            return latents.flatten(2).transpose(1, 2), None

    class AudioPatchifier(SymmetricPatchifier):
        def patchify(self, latents):
            return latents.permute(0, 2, 1, 3).flatten(2), None

    module.SymmetricPatchifier, module.AudioPatchifier = SymmetricPatchifier, AudioPatchifier
    return module


comfy = host.comfy  # the fake ComfyUI modules


@pytest.fixture
def ltx_host(comfy, monkeypatch):
    ltxav = host.Branch("ltxav", ("adaln_single.emb.timestep_embedder.linear_1.bias",
                                  "audio_adaln_single.linear.weight"))
    monkeypatch.setattr(host, "BRANCHES", (ltxav,) + host.BRANCHES)
    monkeypatch.setattr(host, "SUPPORTED", host.SUPPORTED + (
        host.Supported("LTXAV", {"image_model": "ltxav"}, "flux", 2.37, 1.0, 128, ltxav_conds),))
    monkeypatch.setattr(host, "FakeBaseModel", LTXAVBase)
    for name, module in (("comfy.ldm", types.ModuleType("comfy.ldm")),
                         ("comfy.ldm.lightricks", types.ModuleType("comfy.ldm.lightricks")),
                         ("comfy.ldm.lightricks.symmetric_patchifier", _patchifier_module())):
        monkeypatch.setitem(sys.modules, name, module)
    return comfy


# -- one call ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Call:
    video: torch.Tensor  # [2, C, T, H, W]: cond and uncond rows
    audio: torch.Tensor  # [2, channels, frames, 16]
    prompts: tuple  # the text encoder's features of each chunk [1, PROMPT, width]
    masks: tuple | None  # the sampler's (video, audio) noise masks, or None


def make_call(name: str, image_to_video: bool, seed: int = 11) -> Call:
    config, g = CONFIGS[name], torch.Generator().manual_seed(seed)
    raw_width = config.caption_channels or config.cross_attention_dim + config.audio_cross_attention_dim
    video = torch.randn(2, config.in_channels, T, H, W, generator=g)
    audio = torch.randn(2, config.audio_in_channels // 16, AUDIO_FRAMES, 16, generator=g)
    prompts = tuple(torch.randn(1, PROMPT, raw_width, generator=g) for _ in "pn")
    masks = None
    if image_to_video:  # LTXVImgToVideo (strength 1): the first latent frame's mask is 0; the audio's stays 1
        video_mask = torch.ones_like(video)
        video_mask[:, :, 0] = 0.0
        masks = (video_mask, torch.ones_like(audio))
    return Call(video, audio, prompts, masks)


def door_call(patcher, call: Call, chunks=(0, 1), extra=None, options=None):
    """BaseModel._apply_model's call of LTXAVModel for `chunks` (0 cond, 1 uncond) batched: each chunk's extra_conds
    (masks per row), timestep = sigma, process_timestep's (video, audio) pair, x = [video, audio]."""
    base, rows = patcher.model, list(chunks)
    conds = [base.extra_conds(cross_attn=call.prompts[k], unprocessed_ltxav_embeds=True, frame_rate=FPS,
                              denoise_mask=None if call.masks is None else tuple(m[k:k + 1] for m in call.masks),
                              **(extra or {})) for k in rows]
    kwargs = {key: (torch.cat([c[key] for c in conds]) if isinstance(v, torch.Tensor) else v)
              for key, v in conds[0].items()}
    sigmas = torch.full((len(rows),), SIGMA)
    t = base.process_timestep(base.model_sampling.timestep(sigmas).float(), x=None, **kwargs)
    options = {"cond_or_uncond": rows, "sigmas": sigmas, **(options or {})}
    return base.diffusion_model([call.video[rows].clone(), call.audio[rows].clone()], t,
                                context=kwargs.pop("c_crossattn"), control=None, transformer_options=options, **kwargs)


def reference(name: str, files, call: Call, chunks=(0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's connectors on the file, then LTXAVModel's forward (comfyui_call) on its DiT, in the call's shapes."""
    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    path, twin = files[name]
    rows = list(chunks)
    prompts = [comfyui_prompt(path, name, call.prompts[k]) for k in rows]
    video_t = torch.full((len(rows), T, H * W), SIGMA * 1000)
    if call.masks is not None:
        video_t = video_t * call.masks[0][rows, 0].reshape(len(rows), T, H * W)
    video_t = video_t.flatten(1)
    audio_t = torch.full((len(rows), AUDIO_FRAMES), SIGMA * 1000)
    x = dict(video=LTX2Adapter.pack(call.video[rows]), audio=LTX2Adapter.pack_audio(call.audio[rows]),
             video_context=torch.cat([p[0] for p in prompts]), audio_context=torch.cat([p[1] for p in prompts]),
             video_t=video_t, audio_t=audio_t)
    v, a = comfyui_call(twin, name, x, fps=FPS)
    return LTX2Adapter.unpack(v, T, H, W), LTX2Adapter.unpack_audio(a, call.audio.shape[1])


def _door(path, devices, clients, monkeypatch, **degrees):
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda d, *a, **k: clients[d])
    return host._model(path, devices, **degrees)


# -- the tests -----------------------------------------------------------------------------------------------------

def test_load_parallel_dit_takes_the_file_as_comfyuis_ltxav(files, ltx_host):
    """The loader's refusal is lifted: ComfyUI's detection picks LTXAV for the file, whose diffusion model is the
    remote one with the patchifiers LTXAV.process_timestep calls; a Parallel Sampler job without the audio latent is
    refused, naming the node that makes the whole latent."""
    from nodes.remote_model import RemoteDiT
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
    from parallel_runtime.validate import validate_job

    model = host._model(files["ltx2.3"][0])
    assert model.model.model_config.supported.name == "LTXAV"
    dit = model.model.diffusion_model
    assert isinstance(dit, RemoteDiT) and hasattr(dit, "patchifier") and hasattr(dit, "a_patchifier")
    job = Job(ModelSpec(files["ltx2.3"][0]), StrategySpec(), SamplingSpec(steps=1), torch.zeros(1, 16, T, H, W),
              Conditioning(torch.zeros(1, PROMPT, 192), torch.zeros(1, 0)), None)
    with pytest.raises(ConfigError, match=r"^LTX-2\.3 128-wide x 2 denoises its video and its sound together, but "
                                          r"this job carries no audio latent; .*LTXVConcatAVLatent"):
        validate_job(job, 1)


def test_a_file_without_prompt_connectors_takes_processed_prompts_only(files, ltx_host):
    """A DiT-only file (no video/audio_embeddings_connector: a text encoder that runs them hands over processed
    rows) loads, passes a processed prompt on, and refuses an unprocessed one in one sentence."""
    from parallel_runtime.errors import ModelFileError

    dit = host._model(files["ltx2.3"][1]).model.diffusion_model
    processed = torch.randn(1, 5, CONFIGS["ltx2.3"].context_dim)
    assert dit.preprocess_text_embeds(processed) is processed
    with pytest.raises(ModelFileError, match=r"^.*ltx2\.3-dit\.safetensors has no video_embeddings_connector \(the "
                                             r"LTX-2 prompt connectors ComfyUI stores beside the DiT\) but the prompt "
                                             r"still needs them; load the full LTX-2 checkpoint, which holds them, or "
                                             r"a text encoder that runs them\.$"):
        dit.preprocess_text_embeds(processed, unprocessed=True)


@pytest.mark.parametrize("name", CONFIGS)
def test_prompt_connectors_equal_comfyuis(files, ltx_host, name):
    """RemoteDiT.preprocess_text_embeds (the file's connectors, run on the host) equals ComfyUI's connectors: 1024
    rows of both streams side by side; a context of the processed width that the encoder did not mark unprocessed
    passes unchanged, as in LTXAVModel."""
    path = files[name][0]
    dit = host._model(path).model.diffusion_model
    raw = make_call(name, False).prompts[0]
    got = dit.preprocess_text_embeds(raw, unprocessed=True)
    video, audio = comfyui_prompt(path, name, raw)
    assert got.shape == (1, 1024, video.shape[-1] + audio.shape[-1])
    assert video.abs().mean() > 0.3 and audio.abs().mean() > 0.3  # RMS-normed rows: a real comparison
    error = rel_err(got, torch.cat([video, audio], dim=-1))
    print(f"\n{name} connectors vs ComfyUI's: {error:.1e}")
    assert error < RTOL  # fp32, another op order
    processed = torch.randn(1, 5, CONFIGS[name].context_dim)
    assert dit.preprocess_text_embeds(processed) is processed


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_model_call_equals_comfyuis_and_cfg2_ulysses2_ring2_equal_it(files, ltx_host, client1, client2, monkeypatch,
                                                                   i2v):
    """LTX-2.3's [video, audio] output through the door equals ComfyUI's (connectors + LTXAVModel) at 1 worker, and
    CFG-2 (cond and uncond on two ranks), Ulysses-2 and Ring-2 (both streams split) equal it; i2v: LTXVImgToVideo's
    first frame at timestep 0 (per-token timesteps from the noise mask)."""
    name, clients = "ltx2.3", {"cpu:1": client1, "cpu:2": client2}
    call = make_call(name, i2v)
    video, audio = reference(name, files, call)
    assert video.abs().mean() > 0.1 and audio.abs().mean() > 0.1  # outputs of O(1): a real comparison
    if i2v:  # the same inputs without the mask give another output: the per-token timesteps are really compared
        assert rel_err(reference(name, files, make_call(name, False))[0], video) > 1e-2
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("cfg2", "cpu:2", {"cfg_degree": 2}),
                                    ("ulysses2", "cpu:2", {"ulysses_degree": 2}),
                                    ("ring2", "cpu:2", {"ring_degree": 2})):
        out = door_call(_door(files[name][0], devices, clients, monkeypatch, **degrees), call)
        assert isinstance(out, list) and out[0].shape == call.video.shape and out[1].shape == call.audio.shape
        errors[label] = rel_err(out[0], video), rel_err(out[1], audio)
    print("\n" + ", ".join(f"{k}: video {v:.1e} audio {a:.1e}" for k, (v, a) in errors.items()))
    assert max(max(e) for e in errors.values()) < RTOL


def test_ltx20_one_prompt_per_call_equals_comfyuis(files, ltx_host, client1, monkeypatch):
    """LTX-2.0 (both connectors read the caption features, the DiT projects them) image-to-video, cond and uncond as
    two calls of one row, as ComfyUI runs them where their shapes differ."""
    name = "ltx2.0"
    call = make_call(name, True)
    model = _door(files[name][0], "cpu:1", {"cpu:1": client1}, monkeypatch)
    for k in (0, 1):
        video, audio = reference(name, files, call, chunks=(k,))
        out = door_call(model, call, chunks=(k,))
        errors = rel_err(out[0], video), rel_err(out[1], audio)
        print(f"\n{name} chunk {k} alone: video {errors[0]:.1e} audio {errors[1]:.1e}")
        assert max(errors) < RTOL


_NO_WORK = {"cpu:1": None}  # a refusal comes before the runtime client is even asked for


@pytest.mark.parametrize("extra, options, pattern", [
    ({"keyframe_idxs": torch.zeros(1, 3, H * W - 1, 2)}, None,
     r"the LTX-2 call's guides hold 23 tokens, which is not a whole number of 24-token latent frames of this latent: "
     r"they were recorded at another resolution; crop the guides \(LTXVCropGuides\) before upscaling the latent and "
     r"add them again after\."),
    ({"ref_audio": {"latent": torch.zeros(1, 4, 16)}}, None,
     r"the LTX-2 call's reference audio carries no tokens \(LTXVReferenceAudio makes a dict with its audio latent's "
     r"tokens\); connect LTXVReferenceAudio's conditioning outputs as they are\."),
    ({"generated_keyframes": [0]}, None, r".*\(generated_keyframes: LTX-2\.5's generated keyframes\); .*"),
    ({}, {"stg_self_attn_blocks": frozenset({1})},
     r".*\(stg_self_attn_blocks: LTXVSpatioTemporalGuidance's perturbed blocks\); .*"),
    ({}, {"a2v_cross_attn": False, "v2a_cross_attn": False},
     r".*\(a2v_cross_attn: LTXVModalityGuidance's severed audio-video attention, v2a_cross_attn: .*\); .*"),
    ({"attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0, 0]])}, None,
     r"the LTX-2 prompt carries an attention mask that hides tokens, which ParaDiT does not apply for this model "
     r"yet; encode the prompt with LTXAVTextEncoderLoader's text encoder or load the model with UNETLoader\."),
], ids=["damaged_guides", "damaged_ref_audio", "generated_keyframes", "stg", "modality_guidance", "prompt_mask"])
def test_what_the_door_cannot_carry_is_refused_in_one_sentence(files, ltx_host, monkeypatch, extra, options,
                                                               pattern):
    model = _door(files["ltx2.0"][0], "cpu:1", _NO_WORK, monkeypatch)  # the smaller connectors: the same door
    with pytest.raises(ConfigError, match=f"^{pattern}$") as refusal:
        door_call(model, make_call("ltx2.0", False), extra=extra, options=options)
    assert ". " not in str(refusal.value).rstrip(".")


def test_a_spatial_noise_mask_runs_and_a_lone_video_stream_is_refused(files, ltx_host, client1, monkeypatch):
    """A mask that varies within a frame (SetLatentNoiseMask, inpainting) gives per-token timesteps, which the
    workers take as they are (ComfyUI's per-token path): equal to ComfyUI's call; a call without the audio stream is
    not LTXAV's and is refused in one sentence."""
    name = "ltx2.0"
    model = _door(files[name][0], "cpu:1", {"cpu:1": client1}, monkeypatch)
    call = make_call(name, True)
    call.masks[0][:, :, 1, 0, 0] = 0.5
    video, audio = reference(name, files, call)
    out = door_call(model, call)
    errors = rel_err(out[0], video), rel_err(out[1], audio)
    print(f"\nspatial noise mask through the door: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < RTOL
    assert rel_err(reference(name, files, make_call(name, True))[0], video) > 1e-4  # the one masked token counts
    dit = model.model.diffusion_model
    with pytest.raises(ConfigError, match=r"^the model call's latent has 1 stream\(s\) but LTX-2 needs \(video, "
                                          r"audio\); join them with LTXVConcatAVLatent .*\.$"):
        dit(call.video, torch.full((2,), SIGMA), context=torch.zeros(2, 1024, 64), control=None,
            transformer_options={"cond_or_uncond": [0, 1]})


@pytest.mark.parametrize("kind", ["flf", "iclora"])
def test_guide_frames_through_the_door_equal_comfyuis(files, ltx_host, client1, client2, monkeypatch, kind):
    """LTXVAddGuide's first and last frame at strength 0.7 (the first-last-frame templates) and a dilated IC-LoRA
    reference with a pixel attention mask, as ComfyUI 2026's sampler calls the model with them (keyframe_idxs and
    guide_attention_entries in the conditioning, the noise mask over the guided latent): 1 worker, CFG-2,
    Ulysses-2 and Ring-2 equal ComfyUI's call (test_ltx2_guides.comfyui_guided_call on the connectors' rows)."""
    from test_ltx2_guides import comfyui_guided_call, make_call as guide_call

    name, clients = "ltx2.3", {"cpu:1": client1, "cpu:2": client2}
    config, g = CONFIGS[name], torch.Generator().manual_seed(5)
    guided = guide_call(kind, config)
    thw = tuple(guided["latent"].shape[2:])
    video = torch.cat([guided["latent"], torch.randn(guided["latent"].shape, generator=g)])
    audio = torch.randn(2, config.audio_in_channels // 16, AUDIO_FRAMES, 16, generator=g)
    prompts = tuple(torch.randn(1, PROMPT, config.cross_attention_dim + config.audio_cross_attention_dim, generator=g)
                    for _ in "pn")
    masks = (guided["noise_mask"].expand(2, config.in_channels, *thw), torch.ones_like(audio))  # prepare_mask's shape
    call = Call(video, audio, prompts, masks)
    extra = {"keyframe_idxs": guided["keyframe_idxs"], "guide_attention_entries": guided["entries"]}

    from parallel_runtime.models.families.ltx2 import LTX2Adapter

    rows = [comfyui_prompt(files[name][0], name, p) for p in prompts]
    x = dict(video=LTX2Adapter.pack(video), audio=LTX2Adapter.pack_audio(audio),
             video_context=torch.cat([r[0] for r in rows]), audio_context=torch.cat([r[1] for r in rows]),
             video_t=(masks[0][:, 0] * SIGMA * 1000).flatten(1), audio_t=torch.full((2, AUDIO_FRAMES), SIGMA * 1000))
    want_v, want_a = comfyui_guided_call(files[name][1], config, guided, x, fps=FPS)
    want_v, want_a = LTX2Adapter.unpack(want_v, *thw), LTX2Adapter.unpack_audio(want_a, audio.shape[1])
    assert want_v.abs().mean() > 0.1
    errors = {}
    for label, devices, degrees in (("1 worker", "cpu:1", {}), ("cfg2", "cpu:2", {"cfg_degree": 2}),
                                    ("ulysses2", "cpu:2", {"ulysses_degree": 2}),
                                    ("ring2", "cpu:2", {"ring_degree": 2})):
        out = door_call(_door(files[name][0], devices, clients, monkeypatch, **degrees), call, extra=extra)
        errors[label] = rel_err(out[0], want_v), rel_err(out[1], want_a)
    print(f"\n{kind} guides through the door: " + ", ".join(f"{k}: video {v:.1e} audio {a:.1e}"
                                                           for k, (v, a) in errors.items()))
    assert max(max(e) for e in errors.values()) < RTOL
    plain = door_call(_door(files[name][0], "cpu:1", clients, monkeypatch), call)  # the same call without its guides
    assert rel_err(plain[0], want_v) > 1e-3


def test_parallel_sampler_on_load_parallel_dits_model(files, ltx_host, client1, client2, monkeypatch):
    """Parallel Sampler on the MODEL of an LTX-2.3 file with its connectors, as ComfyUI 2026 builds it: the text
    encoder's features (marked unprocessed, as LTXAVTextEncoderLoader's encoder marks them) go through RemoteDiT's
    connectors, the NestedTensor through the workers' own loop on Ulysses-2; equal to the 1-worker job given
    ComfyUI's connector rows (written out above), which equals KSampler's loop (test_av_sampler)."""
    from test_av_sampler import CFG, SEED, STEPS, NestedTensor, ltx_job
    from test_nodes import FakeHost  # first: it stands in comfy_api.latest, which the node modules import

    from nodes import sampler as sampler_node
    from parallel_runtime.spec import Conditioning

    class Host(FakeHost):
        def fixed_latent(self, model, latent):  # comfy.sample.fix_empty_latent_channels: a nested latent as it is
            return latent

    path = files["ltx2.3"][0]
    monkeypatch.setattr("parallel_runtime.runtime.client.get_client", lambda devices, *a, **k: client2)
    model = host._model(path, "cpu:2", ulysses_degree=2)
    model.wrappers = {kind: {key: [fn]} for (kind, key), fn in model.wrappers.items()}
    raw = make_call("ltx2.3", False).prompts
    job = ltx_job(path, batch=1)
    marked = {"unprocessed_ltxav_embeds": True, "frame_rate": 25.0}
    out, summary = sampler_node.sample(model, SEED, STEPS, CFG, "euler_ancestral", "simple", [[raw[0], marked]],
                                       [[raw[1], dict(marked)]], {"samples": NestedTensor([job.latent, job.audio])},
                                       host=Host())
    processed = [Conditioning(torch.cat(comfyui_prompt(path, "ltx2.3", r), dim=-1), torch.zeros(1, 0)) for r in raw]
    want = client1.run(dataclasses.replace(job, positive=processed[0], negative=processed[1]))
    (video, audio) = out["samples"].unbind()
    errors = rel_err(video, want.latent), rel_err(audio, want.audio)
    print(f"\nParallel Sampler on Load Parallel DiT's MODEL (ComfyUI 2026's LTXAV), ulysses2 vs the 1-worker job on "
          f"ComfyUI's connector rows: video {errors[0]:.1e}, audio {errors[1]:.1e} ({summary})")
    assert "one runtime job per model call" not in summary  # the workers' own loop, not ComfyUI's sampler
    assert max(errors) <= RTOL
