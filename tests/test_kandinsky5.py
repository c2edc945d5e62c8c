"""Kandinsky 5 (text-to-video and text-to-image) on the workers: detection and config from shapes, the serial
model against diffusers' Kandinsky5Transformer3DModel and against a model call written from ComfyUI 2026's
comfy/ldm/kandinsky5/model.py (Kandinsky5.forward_orig over the file's own tensors, with test_kandinsky6's
re-typed K5 pieces: attention, modulation, EmbedND RoPE), the runtime's model call at one worker and on every
strategy at two, and a whole Parallel Sampler run where PipeFusion's error sits beside naive patch's.

The tiny video file has 4 heads of 16 (RoPE axes 4, 6, 6), two different prompt lengths (separate passes, as
ComfyUI runs them) and 3 x 2 x 3 = 18 video tokens; the tiny image file reads the latent alone (no condition
channels) at full-rate RoPE.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.kandinsky5 import Kandinsky5Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config
from test_kandinsky6 import _attention, _embed_nd, _ff, _linear, _modulation, _norm, _ssg

pytestmark = pytest.mark.timeout(300)

TINY = Kandinsky5Config(hidden_size=64, num_layers=2, head_dim=16, ff_dim=96, time_dim=32, text_blocks=2,
                        latent_dim=4, context_dim=24, pooled_dim=12)
TINY_IMAGE = dataclasses.replace(TINY, visual_cond=False)
T, H, W = 3, 4, 6  # latent frames x height x width: 3 x 2 x 3 = 18 tokens of 2x2 patches per sample
PREFIX = "model.diffusion_model."
SIGMA = 0.7
# One fp32 forward in another op order than the reference (~1e-7 measured); exact strategies reorder sums likewise.
RTOL = 1e-5


@pytest.fixture(scope="module")
def k5_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("k5") / "kandinsky5lite_t2v.safetensors"), TINY, seed=3,
                            prefix=PREFIX)


@pytest.fixture(scope="module")
def k5_image_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("k5") / "kandinsky5lite_t2i.safetensors"), TINY_IMAGE,
                            seed=4, prefix=PREFIX)


def conditioning(seed: int, tokens: int) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, tokens, TINY.context_dim, generator=g), torch.randn(1, TINY.pooled_dim,
                                                                                           generator=g))


def call_job(path: str, strategy, image: bool = False) -> Job:
    """cond and uncond chunks of one call as Kandinsky5 receives them: x [2, 4, T, H, W] (an image's [2, 4, H, W]),
    t = sigma x 1000 (ModelSamplingDiscreteFlow), prompts of 5 and 7 Qwen rows with their pooled CLIP-L vectors."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, TINY.latent_dim, *((H, W) if image else (T, H, W)), generator=g)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x, conditioning(1, 5), conditioning(2, 7),
               timestep=torch.full((2,), SIGMA * 1000.0))


# -- the references -----------------------------------------------------------------------------------------

class _TorchWithoutBf16:
    """diffusers' Kandinsky5AttnProcessor casts rotated q/k to torch.bfloat16 whatever the model's dtype (a ~1e-3
    rounding neither ComfyUI nor ParaDiT makes): its module sees this torch, whose bfloat16 is float32."""

    def __getattr__(self, name):
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


@torch.no_grad()
def diffusers_call(path: str, config: Kandinsky5Config, job: Job, monkeypatch) -> torch.Tensor:
    """diffusers' own model on the file, one chunk at a time (its forward takes one prompt length), in ComfyUI's
    [B, C, T, H, W] convention; the video's condition channels and mask are zeros, as its pipeline sets them."""
    from diffusers.models.transformers import transformer_kandinsky
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Transformer3DModel

    monkeypatch.setattr(transformer_kandinsky, "torch", _TorchWithoutBf16())
    model = Kandinsky5Transformer3DModel(**config.diffusers_kwargs()).eval()
    model.load_state_dict({k[len(PREFIX):]: v for k, v in load_file(path).items()}, strict=True)
    x = job.latent if config.visual_cond else job.latent.unsqueeze(2)
    if config.visual_cond:
        x = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[:, :1])], dim=1)
    t, h, w = x.shape[2:]
    outs = []
    for row, chunk in enumerate((job.positive, job.negative)):
        out = model(x[row:row + 1].permute(0, 2, 3, 4, 1), chunk.cond, job.timestep[row:row + 1], chunk.pooled,
                    [torch.arange(t), torch.arange(h // 2), torch.arange(w // 2)], torch.arange(chunk.cond.shape[1]),
                    scale_factor=(1.0, 2.0, 2.0) if config.visual_cond else (1.0, 1.0, 1.0), return_dict=False)
        outs.append(out.permute(0, 4, 1, 2, 3))
    out = torch.cat(outs)
    return out if config.visual_cond else out.squeeze(2)


@torch.no_grad()
def comfyui_call(path: str, config: Kandinsky5Config, job: Job, concat: torch.Tensor | None = None):
    """Kandinsky5._forward then forward_orig (ComfyUI 2026) on the file's tensors, in fp32, one chunk at a time
    (ComfyUI batches chunks only where their prompts are one length)."""
    sd = {k[len(PREFIX):]: v.float() for k, v in load_file(path).items()}
    hd = config.head_dim

    def text_embed(name, x):
        return F.layer_norm(_linear(sd, name + ".in_layer", x), (sd[name + ".norm.weight"].shape[0],),
                            sd[name + ".norm.weight"], sd[name + ".norm.bias"])

    x = job.latent if config.visual_cond else job.latent.unsqueeze(2)
    if config.visual_cond:  # x as the model receives it: the latent, then c_concat (zeros in text-to-video)
        zeros = x.new_zeros(x.shape[0], config.latent_dim + 1, *x.shape[2:])
        x = torch.cat([x, zeros if concat is None else concat], dim=1)
    b, ch, t, h, w = x.shape
    scale = (1.0, 2.0, 2.0) if config.visual_cond else (1.0, 1.0, 1.0)  # rope_scale_factor
    steps = (t, h // 2, w // 2)  # rope_encode_3d: linspace(0, (n - 1) / scale, n) per axis
    grid = torch.meshgrid(*[torch.linspace(0, (n - 1) / s, n) for n, s in zip(steps, scale)], indexing="ij")
    rope = _embed_nd(torch.stack([g.flatten() for g in grid], dim=-1), list(config.axes_dims))
    outs = []
    for row, chunk in enumerate((job.positive, job.negative)):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(config.hidden_size // 2) / (config.hidden_size // 2))
        args = torch.outer(job.timestep[row:row + 1].float(), freqs)  # TimeEmbeddings
        temb = _linear(sd, "time_embeddings.out_layer", F.silu(_linear(sd, "time_embeddings.in_layer",
                                                                        torch.cat([args.cos(), args.sin()], -1))))
        temb = temb + text_embed("pooled_text_embeddings", chunk.pooled)
        ctx = text_embed("text_embeddings", chunk.cond)
        rope_text = _embed_nd(torch.arange(ctx.shape[1], dtype=torch.float32)[:, None], [hd])
        for i in range(config.text_blocks):  # TransformerEncoderBlock
            n = f"text_transformer_blocks.{i}."
            sa, ff = _modulation(sd, n + "text_modulation", temb).chunk(2, dim=-1)
            shift, scale_, gate = _ssg(sa)
            y = _norm(ctx) * (scale_ + 1) + shift
            ctx = ctx + gate * _attention(sd, n + "self_attention", y, y, hd, rope_text, rope_text)
            shift, scale_, gate = _ssg(ff)
            ctx = ctx + gate * _ff(sd, n + "feed_forward", _norm(ctx) * (scale_ + 1) + shift)
        patches = x[row:row + 1].movedim(1, -1).view(1, t, h // 2, 2, w // 2, 2, ch).permute(0, 1, 2, 4, 3, 5, 6)
        vis = _linear(sd, "visual_embeddings.in_layer", patches.flatten(4, 6)).flatten(1, 3)
        for i in range(config.num_layers):  # TransformerDecoderBlock
            n = f"visual_transformer_blocks.{i}."
            sa, ca, ff = _modulation(sd, n + "visual_modulation", temb).chunk(3, dim=-1)
            shift, scale_, gate = _ssg(sa)
            y = _norm(vis) * (scale_ + 1) + shift
            vis = vis + gate * _attention(sd, n + "self_attention", y, y, hd, rope, rope)
            shift, scale_, gate = _ssg(ca)
            vis = vis + gate * _attention(sd, n + "cross_attention", _norm(vis) * (scale_ + 1) + shift, ctx, hd)
            shift, scale_, gate = _ssg(ff)
            vis = vis + gate * _ff(sd, n + "feed_forward", _norm(vis) * (scale_ + 1) + shift)
        shift, scale_ = _modulation(sd, "out_layer.modulation", temb).chunk(2, dim=-1)  # OutLayer
        out = _linear(sd, "out_layer.out_layer", _norm(vis) * (scale_[:, None] + 1) + shift[:, None])
        out = out.view(1, t, h // 2, w // 2, -1, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7)
        outs.append(out.flatten(2, 3).flatten(3, 4).flatten(4, 5))
    out = torch.cat(outs)
    return out if config.visual_cond else out.squeeze(2)


# -- detection and parity -----------------------------------------------------------------------------------------

def test_files_are_detected_with_their_config_and_odd_inputs_refused(k5_path, k5_image_path, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    sd = load_file(k5_path)
    twin = str(tmp_path / "diffusers-kandinsky5.safetensors")  # diffusers' layout: the same names under transformer.
    save_file({"transformer." + k[len(PREFIX):]: v for k, v in sd.items()}, twin)
    for path, config, prefix in ((k5_path, TINY, PREFIX), (twin, TINY, "transformer."),
                                 (k5_image_path, TINY_IMAGE, PREFIX)):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.prefix) == ("kandinsky5", prefix)
        assert model_config(path) == config
    assert (TINY.title, TINY_IMAGE.title, TINY.axes_dims) == ("Kandinsky 5 Lite 64-wide x 2",
                                                              "Kandinsky 5 Image 64-wide x 2", (4, 6, 6))
    key = PREFIX + "visual_embeddings.in_layer.weight"
    sd[key] = sd[key][:, :20].contiguous()
    odd = str(tmp_path / "odd.safetensors")
    save_file(sd, odd)
    with pytest.raises(ModelFileError, match=r"reads 20 features per patch.*UNETLoader\.$"):
        model_config(odd)


def test_the_cost_probe_times_one_visual_block_alone():
    """The cost model's probe runs one visual block on its own random weights (the text blocks stay on the meta
    device: its prompt comes refined), on the CPU and as a FLOP count on the meta device."""
    from parallel_runtime.models.families.kandinsky5 import KANDINSKY5
    from parallel_runtime.strategies.attention.processor import AttentionContext

    for config in (TINY, TINY_IMAGE):
        image, _ = KANDINSKY5.probe_block(config, 1, AttentionContext(), 5, 18, torch.float32, "cpu")()
        assert image.shape == (1, 18, TINY.hidden_size) and torch.isfinite(image).all() and image.abs().mean() > 0.1
        assert KANDINSKY5.probe_block(config, 1, AttentionContext(), 5, 18, torch.float32, "meta")()[0].is_meta


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "t2i"])
def test_one_worker_matches_diffusers_and_comfyuis_model_call(k5_path, k5_image_path, client1, monkeypatch, image):
    """The runtime's model call at one worker equals diffusers' Kandinsky5Transformer3DModel (its RoPE's bfloat16
    cast lifted) and ComfyUI 2026's model call (written here from its source) on the same file."""
    path, config = (k5_image_path, TINY_IMAGE) if image else (k5_path, TINY)
    job = call_job(path, S(), image)
    got = client1.run(job).latent
    assert got.shape == job.latent.shape
    for name, want in (("diffusers", diffusers_call(path, config, job, monkeypatch)),
                       ("comfyui", comfyui_call(path, config, job))):
        assert want.abs().mean() > 0.1  # outputs of O(1): a real comparison
        error = rel_err(got, want)
        print(f"\n{config.variant} 1 worker vs {name}: {error:.1e}")
        assert error < RTOL, (name, error)


def test_the_calls_concat_channels_are_embedded_as_comfyui_embeds_them(k5_path, client1, client2):
    """A call whose x carries c_concat beside the latent (condition channels and mask, as ComfyUI's model_base
    concatenates them): the runtime embeds those channels at 1 worker and split by Ulysses-2 as ComfyUI does."""
    g = torch.Generator().manual_seed(5)
    concat = torch.randn(2, TINY.latent_dim + 1, T, H, W, generator=g)
    job = call_job(k5_path, S())
    job = dataclasses.replace(job, positive=dataclasses.replace(job.positive, concat=concat[:1]),
                              negative=dataclasses.replace(job.negative, concat=concat[1:]))
    want = comfyui_call(k5_path, TINY, job, concat)
    assert rel_err(want, comfyui_call(k5_path, TINY, job)) > 0.01  # the channels matter
    errors = [rel_err(client.run(dataclasses.replace(job, strategy=s)).latent, want)
              for client, s in ((client1, S()), (client2, S(ulysses_degree=2)))]
    print(f"\nconcat channels: 1 worker {errors[0]:.1e}, ulysses2 {errors[1]:.1e}")
    assert max(errors) < RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=3)],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "pipefusion2_warmup"])
def test_exact_strategies_equal_the_serial_model(k5_path, client1, client2, strategy):
    """18 video rows split 9 + 9 (the prompt cross-attended whole on each rank, refined by every rank), the two
    chunks over the CFG pair, both attentions' heads and the MLP's units over the tensor pair, and PipeFusion's
    stages of one block each on a call of its warm-up (whole frames as patches: exact)."""
    job = call_job(k5_path, strategy)
    result, serial = client2.run(job), client1.run(dataclasses.replace(job, strategy=S()))
    error = rel_err(result.latent, serial.latent)
    held = max(st["param_bytes"] for st in result.stats) / serial.stats[0]["param_bytes"]
    print(f"\n{strategy.label()}: {error:.1e}, {held:.2f} of the weights per rank")
    assert error < RTOL  # exact strategies reorder sums: fp32 round-off
    if strategy.tensor_degree == 2:
        # The text blocks and every modulation split too (they were 0.78 of the weights per rank, replicated):
        # only the embedders, norms and head stay whole.
        assert held <= 0.6


def test_parallel_sampler_run_strategies_and_pipefusion_beside_naive_patch(k5_path, client1, client2):
    """A whole 6-step run at cfg 5 (Parallel Sampler's path): Ulysses, Ring, CFG and all-warm-up PipeFusion equal
    serial; PipeFusion after one warm-up step (stale K/V of the other patch) lands nearer serial than naive patch,
    which never sees the other half of the video."""
    job = Job(ModelSpec(k5_path), S(), SamplingSpec(steps=6, cfg=5.0, seed=1),
              torch.zeros(1, TINY.latent_dim, T, H, W), conditioning(1, 5), conditioning(2, 7))
    check_denoise_loop(job, client1, client2, "Kandinsky 5 video", RTOL, warm_patches=3, stale_patches=3)

