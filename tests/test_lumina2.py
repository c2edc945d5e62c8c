"""Lumina Image 2.0 (NextDiT) on the workers: detection, the serial model against a reference written here from
ComfyUI's NextDiT (comfy/ldm/lumina/model.py) on the file's raw tensors, and the strategies.

The reference takes nothing from the family module: patchify_and_embed's position ids (prompt token i at
(i, 0, 0), image tokens at (prompt length, row, col)) through ComfyUI's rope formula, the context refiner over
the prompt alone, the noise refiner over the image alone, the joint layers, the final layer and unpatchify, with
GQA's repeated key/value heads, tanh gates and t = 1 - sigma. A wrong patch order, RoPE axis or gate is an O(1)
error.
"""
from __future__ import annotations

import dataclasses


import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import apply_comfy_rope, check_denoise_loop, comfy_rope, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.lumina2 import Lumina2Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

# 4 heads of 24 (RoPE axes 8, 8, 8) over 2 key/value heads (GQA, as the released 24 / 8), 2 refiner blocks per
# stream and 2 layers; the prompt 32 wide (Gemma 2 2B's 2304 in real files).
TINY = Lumina2Config(hidden_size=96, num_heads=4, num_kv_heads=2, num_layers=2, num_refiner_layers=2, ffn_dim=256,
                     cap_feat_dim=32)
H, W = 8, 12  # latent height x width: 4 x 6 = 24 image tokens
# One fp32 forward in another op order than the reference: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
# Exact strategies against serial ParaDiT (the same kernels, K/V unrepeated on both sides): the ring's log-sum-exp
# merge and matmuls over fewer rows reorder fp32 sums, ~1e-7 per op over 4 blocks; a kv head paired with the wrong q
# heads shows at 1e-1.
SPLIT_RTOL = 1e-5


@pytest.fixture(scope="module")
def lumina_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("lumina2") / "lumina2_tiny.safetensors"), TINY, seed=1,
                            prefix="model.diffusion_model.")


def conditioning(seed: int, tokens: int = 9) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, tokens, TINY.cap_feat_dim, generator=g), torch.zeros(1, 0))


def call_job(path: str, strategy: S, negative: bool = True) -> Job:
    g = torch.Generator().manual_seed(3)
    rows = 2 if negative else 1
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(rows, 16, H, W, generator=g),
               conditioning(1), conditioning(2, tokens=11) if negative else None, timestep=torch.full((rows,), 0.87))


# -- the reference ---------------------------------------------------------------------------------------


def _block(sd: dict, b: str, x: torch.Tensor, freqs: torch.Tensor, adaln: torch.Tensor | None,
           c: Lumina2Config) -> torch.Tensor:
    """JointTransformerBlock.forward (modulated where adaln is given)."""
    def rms(h, name, eps=1e-5):
        return F.rms_norm(h, (h.shape[-1],), sd[f"{b}.{name}.weight"], eps)

    def mm(h, name):
        return F.linear(h, sd[f"{b}.{name}.weight"])

    def attention(h):
        hd, kv = c.head_dim, c.num_kv_heads
        q, k, v = mm(h, "attention.qkv").split([c.num_heads * hd, kv * hd, kv * hd], dim=-1)
        q, k, v = (t.view(1, h.shape[1], -1, hd) for t in (q, k, v))
        q = apply_comfy_rope(rms(q, "attention.q_norm", None), freqs)  # RMSNorm(head_dim) without eps: torch's default
        k = apply_comfy_rope(rms(k, "attention.k_norm", None), freqs)
        rep = c.num_heads // kv
        k, v = (t.unsqueeze(3).repeat(1, 1, 1, rep, 1).flatten(2, 3) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return mm(out.transpose(1, 2).flatten(2), "attention.out")

    def ffn(h):
        return mm(F.silu(mm(h, "feed_forward.w1")) * mm(h, "feed_forward.w3"), "feed_forward.w2")

    if adaln is None:
        x = x + rms(attention(rms(x, "attention_norm1")), "attention_norm2")
        return x + rms(ffn(rms(x, "ffn_norm1")), "ffn_norm2")
    m = F.linear(F.silu(adaln), sd[f"{b}.adaLN_modulation.1.weight"], sd[f"{b}.adaLN_modulation.1.bias"])
    scale_msa, gate_msa, scale_mlp, gate_mlp = (t.unsqueeze(1) for t in m.chunk(4, dim=1))
    x = x + gate_msa.tanh() * rms(attention(rms(x, "attention_norm1") * (1 + scale_msa)), "attention_norm2")
    return x + gate_mlp.tanh() * rms(ffn(rms(x, "ffn_norm1") * (1 + scale_mlp)), "ffn_norm2")


@torch.no_grad()
def reference_call(path: str, job: Job, c: Lumina2Config = TINY) -> torch.Tensor:
    """ComfyUI's NextDiT._forward on each branch's row (batch one, no caption mask)."""
    sd = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(path).items()}

    def lin(x, name):
        return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])

    out = []
    for row, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        t = 1.0 - job.timestep[row:row + 1]
        half = 128
        freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        adaln = lin(F.silu(lin(torch.cat([torch.cos(args), torch.sin(args)], -1), "t_embedder.mlp.0")),
                    "t_embedder.mlp.2")
        cap = lin(F.rms_norm(branch.cond, (c.cap_feat_dim,), sd["cap_embedder.0.weight"], 1e-5), "cap_embedder.1")
        cap_len, rows, cols = cap.shape[1], H // 2, W // 2
        ids = torch.zeros(cap_len + rows * cols, 3, dtype=torch.int32)
        ids[:cap_len, 0] = torch.arange(cap_len, dtype=torch.int32)
        ids[cap_len:, 0] = cap_len
        ids[cap_len:, 1] = torch.arange(rows, dtype=torch.int32).view(-1, 1).repeat(1, cols).flatten()
        ids[cap_len:, 2] = torch.arange(cols, dtype=torch.int32).view(1, -1).repeat(rows, 1).flatten()
        rope = comfy_rope(ids, c.rope_axes)
        for i in range(c.num_refiner_layers):
            cap = _block(sd, f"context_refiner.{i}", cap, rope[:cap_len], None, c)
        img = job.latent[row]
        img = img.view(16, rows, 2, cols, 2).permute(1, 3, 2, 4, 0).flatten(2).flatten(0, 1)[None]
        img = lin(img, "x_embedder")
        for i in range(c.num_refiner_layers):
            img = _block(sd, f"noise_refiner.{i}", img, rope[cap_len:], adaln, c)
        x = torch.cat([cap, img], dim=1)
        for i in range(c.num_layers):
            x = _block(sd, f"layers.{i}", x, rope, adaln, c)
        scale = lin(F.silu(adaln), "final_layer.adaLN_modulation.1").unsqueeze(1)
        x = lin(F.layer_norm(x, (c.hidden_size,), eps=1e-6) * (1 + scale), "final_layer.linear")
        x = x[0, cap_len:].view(rows, cols, 2, 2, 16).permute(4, 0, 2, 1, 3).flatten(3, 4).flatten(1, 2)
        out.append(-x[None])
    return torch.cat(out)


# -- tests -----------------------------------------------------------------------------------------------


def test_lumina2_files_are_detected_and_z_image_keys_left_to_z_image(lumina_path, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(lumina_path) as reader:
        family, match = detect_family(reader.keys())
    assert (family.name, match.prefix) == ("lumina2", "model.diffusion_model.")
    config = model_config(lumina_path)
    assert config == TINY
    assert (config.head_dim, config.rope_axes, config.num_blocks, config.latent_channels) == (24, (8, 8, 8), 4, 16)
    assert [k.name for k in config.block_kinds] == ["noise_refiner"] * 2 + ["joint"] * 2
    # A pad token is Z-Image's key: z_image.py claims the file (and refuses this one, which lacks the rest).
    z_image = str(tmp_path / "z_image_tiny.safetensors")
    save_file({**load_file(lumina_path), "model.diffusion_model.cap_pad_token": torch.zeros(1, 96)}, z_image)
    with open_checkpoint(z_image) as reader:
        assert detect_family(reader.keys())[0].name == "z_image"
    with pytest.raises(ModelFileError, match="has Z-Image's layers but not its learned pad tokens"):
        model_config(z_image)


def test_lumina2_one_worker_equals_the_reference(lumina_path, client1):
    job = call_job(lumina_path, S())
    out = client1.run(job).latent
    assert out.shape == (2, 16, H, W)
    err = rel_err(out, reference_call(lumina_path, job))
    print(f"\nLumina 2 serial rel. error {err:.2e}")
    assert err < SERIAL_RTOL


@pytest.fixture(scope="module")
def serial_call(lumina_path, client1) -> torch.Tensor:
    return client1.run(call_job(lumina_path, S())).latent


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "pp2_warmup"])
def test_lumina2_exact_strategies_equal_the_reference(lumina_path, client2, serial_call, strategy):
    """Prompts of different lengths (9 and 11 tokens): separate forward passes, as ComfyUI runs them. PipeFusion's
    call without a schedule step is its warm-up (exact). GQA's 2 kv heads travel unrepeated (Ulysses: one per member,
    Ring: 2-head blocks) and tensor parallelism keeps each with its q heads: serial's numbers to fp32 round-off."""
    job = call_job(lumina_path, strategy)
    out = client2.run(job).latent
    err, split_err = rel_err(out, reference_call(lumina_path, job)), rel_err(out, serial_call)
    print(f"\nLumina 2 {strategy.label()} rel. error {err:.2e}, vs serial {split_err:.2e}")
    assert err < EXACT_RTOL
    assert split_err < SPLIT_RTOL


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2)], ids=lambda s: s.label())
def test_lumina2_measured_bytes_are_the_unrepeated_kv_figure(lumina_path, client2, strategy):
    """The runtime's byte counters against traffic.py per op and exactly, K/V counted with their 2 heads; the repeated
    figure (4 heads) is larger: Ring's hops carry half of its bytes."""
    from parallel_runtime.planning.traffic import job_traffic, shapes_of

    job = Job(ModelSpec(lumina_path), strategy, SamplingSpec(steps=2, cfg=4.0, seed=1), torch.zeros(1, 16, H, W),
              conditioning(1), conditioning(2))  # one prompt length: both branches in one forward
    measured = [st["traffic"]["by_op"] for st in client2.run(job).stats]
    shapes = shapes_of(TINY, image_tokens=(H // 2) * (W // 2), text_tokens=9)
    assert shapes.kv_heads == 2
    want = job_traffic(strategy, shapes, steps=2, cfg=4.0)
    repeated = job_traffic(strategy, dataclasses.replace(shapes, kv_heads=0), steps=2, cfg=4.0)
    for got, w, rep in zip(measured, want, repeated):
        assert {op: tuple(v) for op, v in got.items()} == {op: tuple(v) for op, v in w.by_op().items()}
        op = strategy.label().rstrip("2")
        assert got[op][0] < rep.ops[op][0]
        if op == "ring":
            assert 2 * got[op][0] == rep.ops[op][0]


def test_lumina2_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(lumina_path, client1, client2):
    """A whole 6-step run at cfg 4 (Parallel Sampler's path): exact strategies equal serial; PipeFusion after one
    warm-up step reads stale K/V (the refined prompt is embedded once per job) and lands nearer
    serial than naive patch parallelism, which never sees the other half of the image."""
    job = Job(ModelSpec(lumina_path), S(), SamplingSpec(steps=6, cfg=4.0, seed=1), torch.zeros(1, 16, H, W),
              conditioning(1), conditioning(2))  # one length: the denoise loop's PipeFusion pipelines both prompts
    check_denoise_loop(job, client1, client2, "Lumina 2", EXACT_RTOL)


def test_lumina2_ulysses_times_ring_on_four(lumina_path, client4, serial_call):
    """Ulysses 2 x Ring 2: the 9- and 11-token prompts in four shards of unequal prompt rows, so
    the context refiner's prompt-only attention crosses both kinds of group; the ring passes the kv head each Ulysses
    member received."""
    job = call_job(lumina_path, S(ulysses_degree=2, ring_degree=2))
    out = client4.run(job).latent
    err, split_err = rel_err(out, reference_call(lumina_path, job)), rel_err(out, serial_call)
    print(f"\nLumina 2 Ulysses 2 x Ring 2 rel. error {err:.2e}, vs serial {split_err:.2e}")
    assert err < EXACT_RTOL
    assert split_err < SPLIT_RTOL
