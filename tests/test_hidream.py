"""HiDream I1 / E1 on the workers: detection, the serial model against diffusers' HiDreamImageTransformer2DModel and
against a model call written from ComfyUI's source (comfy/ldm/hidream/model.py, on the file's raw tensors), every
exact strategy, the denoise loop, E1's width-concatenated image, the fp8-scaled file and both doors' conditioning.

The tiny model: 2 heads of 128 (ComfyUI fixes the head size; axes 64/32/32), 2 double and 2 single blocks, 4 experts
top-2, T5 32 wide, Llama 24 wide over 32 layers (each block reads layer min(k, 31)), pooled 16. The prompts are 7 T5 +
2 x 5 Llama rows and 9 + 2 x 4: under a 2-way split one rank holds the current block's Llama rows and the other
none, so a rank that replaced the wrong rows (or none) is an O(1) error, as is a router that picked other experts.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import apply_comfy_rope, check_denoise_loop, checkpoint_without, comfy_rope, rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.models.families.hidream import HiDreamConfig
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

PREFIX = "model.diffusion_model."
TINY = HiDreamConfig(hidden_size=256, num_layers=2, num_single_layers=2, t5_dim=32, llama_dim=24, pooled_dim=16)
H, W = 8, 8  # square: diffusers pads a non-square latent to its max_seq and masks it, ComfyUI does neither
SIGMA = 0.87
# One fp32 forward in another op order than the reference (~1e-7 per op); exact strategies reorder sums too.
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
# The fp8 file against its fp32 twin holding the values it means: only the blocking of equal operands differs.
STORAGE_RTOL = 1e-5


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("hidream") / "hidream_tiny.safetensors"), TINY, seed=1,
                            prefix=PREFIX)


def conditioning(seed: int, t5: int = 7, llama: int = 5) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, t5, TINY.t5_dim, generator=g), torch.randn(1, TINY.pooled_dim, generator=g),
                        llama=torch.randn(1, 32, llama, TINY.llama_dim, generator=g))


def call_job(path: str, strategy: S, e1: bool = False) -> Job:
    """A model call of both branches at sigma 0.87 (t = 870); `e1`: with an edit image (raw latent) in each."""
    g = torch.Generator().manual_seed(3)
    pos, neg = conditioning(1), conditioning(2, t5=9, llama=4)
    if e1:
        image = torch.randn(1, 16, H, W, generator=g)
        pos, neg = (dataclasses.replace(c, references=(image,), reference_method="hidream_e1") for c in (pos, neg))
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(2, 16, H, W, generator=g), pos, neg,
               timestep=torch.full((2,), 1000 * SIGMA))


# -- the references ----------------------------------------------------------------------------------------


@torch.no_grad()
def diffusers_call(path: str, job: Job) -> torch.Tensor:
    """Each branch through diffusers' forward (negated, as ComfyUI's model returns it)."""
    from diffusers import HiDreamImageTransformer2DModel

    c = TINY
    model = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=16, num_layers=c.num_layers, num_single_layers=c.num_single_layers,
        attention_head_dim=128, num_attention_heads=c.num_heads, caption_channels=[c.t5_dim, c.llama_dim],
        text_emb_dim=c.pooled_dim, axes_dims_rope=(64, 32, 32), llama_layers=list(c.llama_layers))
    model.load_state_dict({k[len(PREFIX):]: v for k, v in load_file(path).items()}, strict=True)
    model.eval()
    out = []
    for row, b in enumerate((job.positive, job.negative)):
        sample = model(job.latent[row:row + 1], job.timestep[row:row + 1], b.cond, b.llama.permute(1, 0, 2, 3),
                       b.pooled).sample
        out.append(-sample)
    return torch.cat(out)


def _swiglu(sd, key, x):
    return F.linear(F.silu(F.linear(x, sd[key + ".w1.weight"])) * F.linear(x, sd[key + ".w3.weight"]),
                    sd[key + ".w2.weight"])


def _moe(sd, key, x, experts=4, top_k=2):
    """ComfyUI's MOEFeedForwardSwiGLU.forward (its always-taken branch) and MoEGate."""
    flat = x.view(-1, x.shape[-1])
    weight, idx = torch.topk(F.linear(flat, sd[key + ".gate.weight"]).softmax(dim=-1), k=top_k, dim=-1, sorted=False)
    rows, idx = flat.repeat_interleave(top_k, dim=0), idx.view(-1)
    y = torch.empty_like(rows)
    for e in range(experts):
        y[idx == e] = _swiglu(sd, f"{key}.experts.{e}", rows[idx == e])
    y = (y.view(*weight.shape, -1) * weight.unsqueeze(-1)).sum(dim=1).view(x.shape)
    return y + _swiglu(sd, key + ".shared_experts", x)


def _attention(sd, key, x, t, rope, heads):
    """HiDreamAttnProcessor_flashattn: [image, text] rows, q/k RMS norms over the whole width, RoPE, SDPA."""
    def proj(x, s):
        lin = (lambda n: F.linear(x, sd[f"{key}.{n}{s}.weight"], sd[f"{key}.{n}{s}.bias"]))
        norm = (lambda y, n: F.rms_norm(y, (y.shape[-1],), sd[f"{key}.{n}{s}.weight"], 1e-5))
        return norm(lin("to_q"), "q_rms_norm"), norm(lin("to_k"), "k_rms_norm"), lin("to_v")

    parts = proj(x, "") if t is None else [torch.cat(p, 1) for p in zip(proj(x, ""), proj(t, "_t"))]
    q, k, v = (p.unflatten(-1, (heads, -1)) for p in parts)
    q, k = apply_comfy_rope(q, rope), apply_comfy_rope(k, rope)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = out.transpose(1, 2).flatten(2)
    if t is None:
        return F.linear(out, sd[key + ".to_out.weight"], sd[key + ".to_out.bias"])
    n = x.shape[1]
    return (F.linear(out[:, :n], sd[key + ".to_out.weight"], sd[key + ".to_out.bias"]),
            F.linear(out[:, n:], sd[key + ".to_out_t.weight"], sd[key + ".to_out_t.bias"]))


def _modulation(sd, key, adaln, n):
    return F.linear(F.silu(adaln), sd[key + ".adaLN_modulation.1.weight"],
                    sd[key + ".adaLN_modulation.1.bias"])[:, None].chunk(n, dim=-1)


def _norm(x):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


@torch.no_grad()
def comfy_forward(sd, x, t, y, context, llama, image_cond=None, config=TINY):
    """ComfyUI's HiDreamImageTransformer2DModel._forward (comfy/ldm/hidream/model.py) on raw tensors."""
    sd = {k[len(PREFIX):]: v.float() for k, v in sd.items() if k.startswith(PREFIX)}

    def lin(x, key, bias=True):
        return F.linear(x, sd[key + ".weight"], sd[key + ".bias"] if bias else None)

    def mlp(x, key):
        return lin(F.silu(lin(x, key + ".linear_1")), key + ".linear_2")

    bs, c, h, w = x.shape
    if image_cond is not None:
        x = torch.cat([x, image_cond], dim=-1)
    ph, pw = x.shape[-2] // 2, x.shape[-1] // 2
    tokens = x.reshape(bs, c, ph, 2, pw, 2).permute(0, 2, 4, 3, 5, 1).reshape(bs, ph * pw, 4 * c)
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    angle = t[:, None].float() * freqs[None]
    adaln = (mlp(torch.cat([torch.cos(angle), torch.sin(angle)], -1), "t_embedder.timestep_embedder")
             + mlp(y, "p_embedder.pooled_embedder"))
    image = lin(tokens, "x_embedder.proj")
    enc = [lin(llama[:, k], f"caption_projection.{i}.linear", False) for i, k in enumerate(config.llama_layers)]
    enc.append(lin(context, f"caption_projection.{config.num_blocks}.linear", False))
    img_ids = torch.zeros(ph, pw, 3)
    img_ids[..., 1] += torch.arange(ph)[:, None]
    img_ids[..., 2] += torch.arange(pw)[None, :]
    ids = torch.cat([img_ids.reshape(-1, 3), torch.zeros(enc[-1].shape[1] + enc[-2].shape[1] + enc[0].shape[1], 3)])
    rope = comfy_rope(ids, config.rope_axes)
    initial = torch.cat([enc[-1], enc[-2]], dim=1)
    n0, heads = initial.shape[1], config.num_heads
    for i in range(config.num_layers):
        key = f"double_stream_blocks.{i}.block"
        text = torch.cat([initial, enc[i]], dim=1)
        sh, sc, g, shm, scm, gm, sht, sct, gt, shmt, scmt, gmt = _modulation(sd, key, adaln, 12)
        a_i, a_t = _attention(sd, key + ".attn1", _norm(image) * (1 + sc) + sh, _norm(text) * (1 + sct) + sht,
                              rope, heads)
        image, text = g * a_i + image, gt * a_t + text
        image = gm * _moe(sd, key + ".ff_i", _norm(image) * (1 + scm) + shm) + image
        text = gmt * _swiglu(sd, key + ".ff_t", _norm(text) * (1 + scmt) + shmt) + text
        initial = text[:, :n0]
    n_image = image.shape[1]
    hidden = torch.cat([image, initial], dim=1)
    for j in range(config.num_single_layers):
        key, hs = f"single_stream_blocks.{j}.block", torch.cat([hidden, enc[config.num_layers + j]], dim=1)
        sh, sc, g, shm, scm, gm = _modulation(sd, key, adaln, 6)
        hs = g * _attention(sd, key + ".attn1", _norm(hs) * (1 + sc) + sh, None, rope, heads) + hs
        hs = gm * _moe(sd, key + ".ff_i", _norm(hs) * (1 + scm) + shm) + hs
        hidden = hs[:, :hidden.shape[1]]
    shift, scale = lin(F.silu(adaln), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    out = lin((1 + scale[:, None]) * _norm(hidden[:, :n_image]) + shift[:, None], "final_layer.linear")
    out = out.reshape(bs, ph, pw, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(bs, c, 2 * ph, 2 * pw)
    return -out[:, :, :h, :w]


def comfy_call(path: str, job: Job) -> torch.Tensor:
    """The model call as ComfyUI's HiDream makes it: each branch (its image_cond: process_latent_in of E1's image)."""
    from parallel_runtime.sampling import FLUX_LATENT

    sd = load_file(path)
    out = []
    for row, b in enumerate((job.positive, job.negative)):
        cond = FLUX_LATENT.process_in(b.references[0]) if b.references else None
        out.append(comfy_forward(sd, job.latent[row:row + 1], job.timestep[row:row + 1], b.pooled, b.cond, b.llama,
                                 cond))
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference(path):
    job = call_job(path, S())
    return job, comfy_call(path, job)


# -- detection and validation ------------------------------------------------------------------------------


def test_hidream_files_are_detected_and_incomplete_ones_refused(path, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
    assert (family.name, match.layout, match.prefix) == ("hidream", "comfy", PREFIX)
    assert model_config(path) == TINY
    assert (TINY.num_heads, TINY.rope_axes, TINY.llama_layers, TINY.mlp_hidden) == (2, (64, 32, 32), (0, 1, 2, 3), 256)
    full = HiDreamConfig(hidden_size=2560, num_layers=16, num_single_layers=32)
    assert full.num_heads == 20 and full.llama_layers == tuple(range(32)) + (31,) * 16  # ComfyUI's list
    with pytest.raises(ModelFileError, match="without mixture-of-experts blocks"):
        model_config(checkpoint_without(path, tmp_path, ".gate.", "no_router.safetensors"))


def test_hidream_conditioning_is_checked_before_work(path, client1):
    job = call_job(path, S())
    with pytest.raises(ConfigError, match="carries no Llama 3.1 layers, which every HiDream I1 / E1 block reads"):
        client1.run(dataclasses.replace(job, positive=dataclasses.replace(job.positive, llama=None)))
    short = dataclasses.replace(job.positive, llama=job.positive.llama[:, :3])
    with pytest.raises(ConfigError, match=r"reads \[batch, 4 layers, tokens, 24\]"):
        client1.run(dataclasses.replace(job, positive=short))
    kontext = dataclasses.replace(job.positive, references=(torch.randn(1, 16, H, W),))
    with pytest.raises(ConfigError, match="ReferenceLatent, which ComfyUI's HiDream never reads"):
        client1.run(dataclasses.replace(job, positive=kontext))


# -- one worker against both references -----------------------------------------------------------------------


def test_hidream_one_worker_equals_comfyui_model_call_and_diffusers(path, reference, client1):
    job, ref = reference
    out = client1.run(job).latent
    assert out.shape == (2, 16, H, W)
    against_diffusers = diffusers_call(path, job)
    errs = rel_err(out, ref), rel_err(out, against_diffusers), rel_err(ref, against_diffusers)
    print(f"\nHiDream serial rel. error {errs[0]:.2e} vs ComfyUI's model call, {errs[1]:.2e} vs diffusers "
          f"(the two references: {errs[2]:.2e})")
    assert max(errs) < SERIAL_RTOL


def test_hidream_e1_image_equals_comfyui_width_concat(path, client1, client2):
    """E1: the image concatenated right of the latent, cut off the output; at 1 worker and under Ulysses-2."""
    job = call_job(path, S(), e1=True)
    ref = comfy_call(path, job)
    out = client1.run(job).latent
    assert rel_err(out, client1.run(call_job(path, S())).latent) > 1e-2  # the image matters
    assert rel_err(out, ref) < SERIAL_RTOL
    for strategy in (S(ulysses_degree=2), S(pipefusion_degree=2, num_pipeline_patch=2)):
        err = rel_err(client2.run(dataclasses.replace(job, strategy=strategy)).latent, ref)
        print(f"\nHiDream E1 {strategy.label()} rel. error {err:.2e}")
        assert err < EXACT_RTOL


# -- strategies ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(ring_degree=2, device_weights=(3, 1)),
                                      S(pipefusion_degree=2, num_pipeline_patch=2), S(tensor_degree=2),
                                      S(ulysses_degree=2, shard_weights=True)],
                         ids=["cfg2", "ulysses2", "ring2", "ring2_uneven", "pp2_warmup", "tp2", "ulysses2_sharded"])
def test_hidream_exact_strategies_equal_comfyui_model_call(reference, client2, strategy):
    """The 17-row prompts split over the shards (the current block's Llama rows on one rank); tensor parallel
    splits every expert and reduces each MoE once; PipeFusion's stages each project their own blocks' Llama rows;
    sharded weights gather each block (its router and experts too) before it runs."""
    job, ref = reference
    err = rel_err(client2.run(dataclasses.replace(job, strategy=strategy)).latent, ref)
    print(f"\nHiDream {strategy.label()} rel. error {err:.2e}")
    assert err < EXACT_RTOL


def test_hidream_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(path, client1, client2):
    """A 4-step run at cfg 5 (Parallel Sampler's path, the full model's way)."""
    job = Job(ModelSpec(path), S(), SamplingSpec(steps=4, cfg=5.0, seed=1), torch.zeros(1, 16, H, W),
              conditioning(1), conditioning(2))
    check_denoise_loop(job, client1, client2, "HiDream", EXACT_RTOL)


def test_hidream_fp8_scaled_file_equals_its_fp32_twin(tmp_path, client1, client2):
    """ComfyUI's scaled-fp8 layout (the templates' hidream_i1_*_fp8 files): every matrix fp8 with its scale."""
    from test_fp8 import fp8_twins

    quant, meant = fp8_twins(tmp_path, "hidream", torch.float8_e4m3fn, True, config=TINY)
    assert model_config(quant) == TINY
    got, want = client1.run(call_job(quant, S())), client1.run(call_job(meant, S()))
    err = rel_err(got.latent, want.latent)
    print(f"\nHiDream fp8 scaled: {err:.2e} vs its fp32 twin, {got.stats[0]['param_bytes']} vs "
          f"{want.stats[0]['param_bytes']} bytes")
    assert err <= STORAGE_RTOL
    assert got.stats[0]["param_bytes"] < 0.6 * want.stats[0]["param_bytes"]
    assert rel_err(client2.run(call_job(quant, S(tensor_degree=2))).latent, got.latent) <= EXACT_RTOL


# -- the doors ---------------------------------------------------------------------------------------------


def test_hidream_conditioning_through_both_doors():
    """Load Parallel DiT's model call: encoder_hidden_states_llama3 becomes each chunk's Llama layers and E1's
    image_cond its reference (raw again); Parallel Sampler: CLIPTextEncodeHiDream's conditioning_llama3."""
    from nodes import convert, remote_model
    from parallel_runtime.sampling import FLUX_LATENT

    context, llama = torch.randn(4, 7, 32), torch.randn(4, 32, 5, 24)
    image = torch.randn(1, 16, H, W)
    kwargs = {"encoder_hidden_states_llama3": llama, "image_cond": FLUX_LATENT.process_in(image).repeat(4, 1, 1, 1)}
    remote_model._refuse_what_the_workers_cannot_do(None, {}, kwargs)
    chunk = remote_model._chunk_conditioning(1, 2, context, torch.randn(4, 16), None, kwargs, latent_format=FLUX_LATENT)
    assert torch.equal(chunk.llama, llama[2:4]) and chunk.reference_method == "hidream_e1"
    # Kept on the workers under the hash of its bytes (64 MB a prompt at full size): sent once per sampling run.
    assert chunk.llama_key.startswith("llama-") and "positive.llama" not in chunk.tensors("positive")
    assert chunk.kept_inputs()[chunk.llama_key] is chunk.llama
    repeated = {"encoder_hidden_states_llama3": llama[:1].repeat(4, 1, 1, 1).bfloat16()}
    one = remote_model._chunk_conditioning(0, 2, context, torch.randn(4, 16), None, repeated)
    assert one.llama.shape == (1, 32, 5, 24) and one.llama.dtype == torch.bfloat16  # one row, the call's dtype
    assert rel_err(chunk.references[0], image) < 1e-6  # one fp32 round trip
    assert chunk.signature() != dataclasses.replace(chunk, llama=llama[2:4, :, :4]).signature()
    c = convert.conditioning([[context[:1], {"pooled_output": torch.randn(1, 16), "conditioning_llama3": llama[:1]}]])
    assert torch.equal(c.llama, llama[:1])
    message = Conditioning.from_message("positive", c.meta("positive"), c.tensors("positive"))
    assert torch.equal(message.llama, llama[:1])


def test_hidream_o1_files_are_their_own_family():
    """HiDream O1's files (ComfyUI 2026 tells them by t_embedder1 and x_embedder.proj1) are the hidream_o1 family's,
    never read as HiDream I1/E1 (tests/test_hidream_o1.py runs them)."""
    from parallel_runtime.models.families.hidream_o1 import HiDreamO1Config, checkpoint_shapes

    o1 = HiDreamO1Config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=64,
                         vocab_size=151936)
    keys = [PREFIX + k for k in checkpoint_shapes(o1)]
    assert detect_family(keys, "hidream_o1_image_dev_bf16.safetensors")[0].name == "hidream_o1"
