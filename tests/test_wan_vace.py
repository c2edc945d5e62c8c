"""Wan VACE on the workers, as ComfyUI loads and calls it (comfy/model_base.py WAN21_Vace, comfy/ldm/wan/model.py
VaceWanModel): WanVaceToVideo's context (its inactive and reactive latents and 8x8-unshuffled mask, 96 channels, one
set per input) through vace_patch_embedding and the VACE blocks, whose hints, times each input's strength, are added
after every (layers / vace_layers)-th main block.

The reference is a model call written from VaceWanModel.forward_orig on the file's raw tensors; the real-host
comparison is tests/test_comfyui_wan_vace.py. A reference image (WanVaceToVideo's reference_image) is one more latent
frame in front of the video, and its context frame, which the model reads like any other frame (TrimVideoLatent cuts
it after sampling): the 5-frame latent here stands for 4 frames and a reference.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import apply_comfy_rope, check_denoise_loop, comfy_rope, rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.sampling import WAN21_LATENT
from parallel_runtime.spec import Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config
from test_wan import EXACT_RTOL, SERIAL_RTOL, TINY_WAN, H, T, W, call_job, comfy_wan_ops, conditioning

pytestmark = pytest.mark.timeout(600)

# 4 blocks and 2 VACE blocks (after blocks 0 and 2), 96 context channels: Wan 2.1 VACE's shape, 256 wide.
VACE = dataclasses.replace(TINY_WAN, num_layers=4, vace_layers=2, vace_channels=96)


@pytest.fixture(scope="module")
def vace_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan-vace") / "wan2.1_vace_tiny.safetensors"), VACE, seed=40,
                            prefix="model.diffusion_model.")


def vace_context(seed: int, inputs: int = 1, reference: bool = True) -> torch.Tensor:
    """[1, inputs, 96, T, H, W] as WAN21_Vace.extra_conds builds it from WanVaceToVideo's vace_frames / vace_mask:
    each input's two latents through process_in, then its mask; a reference image's frame first (its latent beside
    process_out(0), mask 0), as the node prepends it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(inputs):
        frames = torch.randn(1, 32, T, H, W, generator=g)
        mask = (torch.rand(1, 64, T, H, W, generator=g) > 0.5).float()
        if reference:
            frames[:, 16:, 0] = WAN21_LATENT.process_out(torch.zeros(1, 16, 1, H, W))[:, :, 0]
            mask[:, :, 0] = 0.0
        processed = torch.cat([WAN21_LATENT.process_in(frames[:, :16]), WAN21_LATENT.process_in(frames[:, 16:])], 1)
        out.append(torch.cat([processed, mask], dim=1))
    return torch.stack(out, dim=1)


def vace_job(path: str, strategy: S, inputs: int = 1, strengths: tuple[float, ...] = (1.0,)) -> Job:
    """call_job (a model call at t = 870 on [2, 16, T, H, W]) with the same VACE context on both branches, as
    WanVaceToVideo sets it on positive and negative."""
    job = call_job(path, strategy)
    vace = vace_context(50, inputs)
    pos, neg = (dataclasses.replace(b, vace=vace, vace_strength=strengths) for b in (job.positive, job.negative))
    return dataclasses.replace(job, positive=pos, negative=neg)


@torch.no_grad()
def reference_call(path: str, job: Job, c=VACE) -> torch.Tensor:
    """VaceWanModel.forward_orig on each branch's row: the video's and the context's patch embeddings, the main
    blocks, and after block i the VACE block vace_layers_mapping[i] on each input's context, its after_proj times the
    input's strength added to the video's tokens (the first VACE block adds before_proj(c) to the embedded video)."""
    sd = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(path).items()}
    heads, dim = c.num_heads, c.hidden_size
    lin, rms, attention = comfy_wan_ops(sd, heads, dim)

    def block(b, x, e0, freqs, context):  # WanAttentionBlock.forward (t2v cross-attention)
        m = (sd[f"{b}.modulation"].unsqueeze(0) + e0).unbind(2)
        h = F.layer_norm(x, (dim,), eps=1e-6) * (1 + m[1]) + m[0]
        q, k = (apply_comfy_rope(rms(lin(h, f"{b}.self_attn.{n}"), f"{b}.self_attn.norm_{n}")
                                 .unflatten(-1, (heads, -1)), freqs) for n in ("q", "k"))
        x = x + lin(attention(q.flatten(2), k.flatten(2), lin(h, f"{b}.self_attn.v")), f"{b}.self_attn.o") * m[2]
        h = F.layer_norm(x, (dim,), sd[f"{b}.norm3.weight"], sd[f"{b}.norm3.bias"], 1e-6)
        q = rms(lin(h, f"{b}.cross_attn.q"), f"{b}.cross_attn.norm_q")
        y = attention(q, rms(lin(context, f"{b}.cross_attn.k"), f"{b}.cross_attn.norm_k"),
                      lin(context, f"{b}.cross_attn.v"))
        x = x + lin(y, f"{b}.cross_attn.o")
        h = F.layer_norm(x, (dim,), eps=1e-6) * (1 + m[4]) + m[3]
        return x + lin(F.gelu(lin(h, f"{b}.ffn.0"), approximate="tanh"), f"{b}.ffn.2") * m[5]

    mapping = {i: n for n, i in enumerate(range(0, c.num_layers, c.num_layers // c.vace_layers))}
    out = []
    for row, branch in enumerate((job.positive, job.negative)):
        x = F.conv3d(job.latent[row:row + 1], sd["patch_embedding.weight"], sd["patch_embedding.bias"],
                     stride=(1, 2, 2))
        grid = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        vace = branch.vace[0]  # [inputs, 96, T, H, W]: orig_shape[0] is the batch, one row here
        hints = F.conv3d(vace, sd["vace_patch_embedding.weight"], sd["vace_patch_embedding.bias"], stride=(1, 2, 2))
        hints = list(hints.flatten(2).transpose(1, 2).split(1, dim=0))
        ids = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
        freqs = comfy_rope(ids, (128 - 4 * 21, 2 * 21, 2 * 21))
        half = c.freq_dim // 2
        sinusoid = torch.outer(job.timestep[row:row + 1].float(), torch.pow(10000, -torch.arange(half).float() / half))
        e = lin(F.silu(lin(torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], 1), "time_embedding.0")),
                "time_embedding.2").reshape(1, 1, dim)
        e0 = lin(F.silu(e), "time_projection.1").unflatten(2, (6, dim))
        context = lin(F.gelu(lin(branch.cond, "text_embedding.0"), approximate="tanh"), "text_embedding.2")
        x_orig = x
        for i in range(c.num_layers):
            x = block(f"blocks.{i}", x, e0, freqs, context)
            n = mapping.get(i)
            if n is not None:
                for k, strength in enumerate(branch.vace_strength):
                    if n == 0:
                        hints[k] = lin(hints[k], "vace_blocks.0.before_proj") + x_orig
                    hints[k] = block(f"vace_blocks.{n}", hints[k], e0, freqs, context)
                    x = x + lin(hints[k], f"vace_blocks.{n}.after_proj") * strength
        shift, scale = (sd["head.modulation"].unsqueeze(0) + e.unsqueeze(2)).unbind(2)
        x = lin(F.layer_norm(x, (dim,), eps=1e-6) * (1 + scale) + shift, "head.head")
        u = x.view(1, *grid, 1, 2, 2, c.out_channels)
        out.append(torch.einsum("bfhwpqrc->bcfphqwr", u).reshape(1, c.out_channels, T, H, W))
    return torch.cat(out)


def test_wan_vace_files_are_detected(vace_path):
    """The VACE shape, its title, where its hints land, and a pipeline stage owning the VACE blocks of its main
    blocks (2 stages of 2 blocks: VACE block 0 after block 0 on the first, VACE block 1 after block 2 on the
    second) and, first, the context's patch embedding; stage planning counts each VACE block with its block."""
    from parallel_runtime.models.families.wan import WAN as family

    config = model_config(vace_path)
    assert (config.title, config.vace_layers, config.vace_channels, config.vace_after) == (
        "Wan 2.1 / 2.2 VACE 256-wide", 2, 96, {0: 0, 2: 1})
    assert dataclasses.replace(VACE, hidden_size=1536).title == "Wan 2.1 VACE 1.3B"
    first = family.stage_ownership(config, [range(0, 2)], first=True, last=False)
    second = family.stage_ownership(config, [range(2, 4)], first=False, last=True)
    names = ("vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.weight", "vace_patch_embedding.weight")
    assert [first(n) for n in names] == [True, False, True]
    assert [second(n) for n in names] == [False, True, False]
    counts = family.parameter_counts(config)[0]  # a VACE block's weights count with the block that adds its hint
    assert counts[0] > counts[2] > counts[1] == counts[3]  # VACE block 0 also holds before_proj
    plan = family.tensor_plan_for(config)
    assert plan["vace_blocks.*.self_attn.q"] == "colwise" and plan["vace_blocks.*.ffn.2"] == "rowwise"


def test_wan_vace_one_worker_equals_comfyui_model_call(vace_path, client1):
    """One VACE input, and two with their own strengths (ComfyUI's lists of vace_frames / vace_strength), at 1
    worker against the model call written from ComfyUI's source; the context and its strength matter."""
    for inputs, strengths in ((1, (1.0,)), (2, (0.7, 1.3))):
        job = vace_job(vace_path, S(), inputs, strengths)
        out = client1.run(job).latent
        assert out.shape == (2, 16, T, H, W)
        assert rel_err(out, reference_call(vace_path, job)) < SERIAL_RTOL, inputs
    full, off = (client1.run(vace_job(vace_path, S(), 1, (s,))).latent for s in (1.0, 0.0))
    assert rel_err(full, off) > 1e-2


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2, device_weights=(3, 1)),
                                      S(pipefusion_degree=2, num_pipeline_patch=5), S(tensor_degree=2),
                                      S(patch_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2_uneven", "pp2_warmup", "tp2", "displaced2"])
def test_wan_vace_exact_strategies(vace_path, client2, strategy):
    """Two VACE inputs split with the video's tokens: each rank runs the VACE blocks on its own rows with the
    strategy's attention (Ulysses' all-to-all, Ring's passes over a 3:1 split), PipeFusion's second stage runs VACE
    block 1 on the context rows that came with the video's from the first, tensor parallel splits the VACE blocks'
    heads like the main ones', displaced patch (one warm-up call) gathers their K/V like the main blocks'."""
    job = vace_job(vace_path, strategy, 2, (0.7, 1.3))
    assert rel_err(client2.run(job).latent, reference_call(vace_path, job)) < EXACT_RTOL


def test_wan_vace_denoise_loop_and_pipefusion_beats_naive_patch(vace_path, client1, client2):
    """A whole 6-step run at cfg 5 (Parallel Sampler's path) with a VACE context on both branches: exact strategies
    equal serial; PipeFusion after one warm-up step (stale K/V of the VACE blocks too) lands nearer serial than naive
    patch parallelism."""
    vace = vace_context(51)
    pos, neg = (dataclasses.replace(conditioning(seed), vace=vace, vace_strength=(1.0,)) for seed in (1, 2))
    job = Job(ModelSpec(vace_path), S(), SamplingSpec(steps=6, cfg=5.0, seed=1), torch.zeros(1, 16, T, H, W), pos, neg)
    check_denoise_loop(job, client1, client2, "Wan VACE", EXACT_RTOL, warm_patches=5, stale_patches=3)


def test_wan_vace_refusals(vace_path, client1):
    job = vace_job(vace_path, S())
    bare = dataclasses.replace(job.positive, vace=None, vace_strength=())
    with pytest.raises(ConfigError, match="reads a VACE context; feed the positive conditioning through "
                                          "WanVaceToVideo"):
        client1.run(dataclasses.replace(job, positive=bare))
    small = dataclasses.replace(job.positive, vace=job.positive.vace[..., :W - 2])
    with pytest.raises(ConfigError, match=r"VACE context has shape \(1, 1, 96, 5, 6, 6\) .* give WanVaceToVideo the "
                                          r"width, height and length"):
        client1.run(dataclasses.replace(job, positive=small))
    two = dataclasses.replace(job.positive, vace_strength=(1.0, 1.0))
    with pytest.raises(ConfigError, match="has 1 VACE inputs but strengths"):
        client1.run(dataclasses.replace(job, positive=two))


def test_wan_vace_context_through_the_model_call_door():
    """Load Parallel DiT's MODEL: a call's vace_context (WAN21_Vace.extra_conds, repeated over the batch) becomes
    each chunk's one row, in the call's dtype, with vace_strength; both cross the channel and come back equal."""
    from nodes import remote_model
    from parallel_runtime.spec import Conditioning

    context = torch.randn(4, 9, 64)
    vace = vace_context(52, 2).to(torch.bfloat16).repeat(4, 1, 1, 1, 1, 1)
    kwargs = {"vace_context": vace, "vace_strength": [0.5, 2.0]}
    remote_model._refuse_what_the_workers_cannot_do(None, {}, kwargs)
    chunk = remote_model._chunk_conditioning(1, 2, context, None, None, kwargs)
    assert chunk.vace.shape == (1, 2, 96, T, H, W) and chunk.vace.dtype == torch.bfloat16
    assert torch.equal(chunk.vace[0], vace[2]) and chunk.vace_strength == (0.5, 2.0)
    back = Conditioning.from_message("positive", chunk.meta("positive"), chunk.tensors("positive"))
    assert torch.equal(back.vace, chunk.vace) and back.vace_strength == (0.5, 2.0)


def test_wan_vace_one_worker_equals_diffusers(vace_path, client1):
    """The same file through diffusers' converter into WanVACETransformer3DModel (one VACE input, its scale per VACE
    layer): the runtime at 1 worker and the ComfyUI-source call both equal it (fp32; diffusers orders its ops
    otherwise: ~4e-6)."""
    from diffusers import WanVACETransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sd = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(vace_path).items()}
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=VACE.num_heads, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=VACE.text_dim, freq_dim=VACE.freq_dim, ffn_dim=VACE.ffn_dim,
        num_layers=VACE.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        vace_layers=[0, 2], vace_in_channels=96)
    model.load_state_dict(convert_wan_transformer_to_diffusers(sd), strict=True)
    job = vace_job(vace_path, S(), 1, (0.7,))
    with torch.no_grad():
        ours = torch.cat([model(hidden_states=job.latent[row:row + 1], timestep=job.timestep[row:row + 1],
                                encoder_hidden_states=b.cond, control_hidden_states=b.vace[:, 0],
                                control_hidden_states_scale=torch.full((2,), 0.7), return_dict=False)[0]
                          for row, b in enumerate((job.positive, job.negative))])
    assert rel_err(client1.run(job).latent, ours) < SERIAL_RTOL
    assert rel_err(reference_call(vace_path, job), ours) < SERIAL_RTOL


def test_wan_variants_not_run_yet_are_refused_naming_their_node(tmp_path):
    """S2V and HuMo files (told by the keys comfy/model_detection.py tells them by) are refused when loaded, in one
    sentence naming what they add and the node UNETLoader's model serves them for (Animate files run:
    tests/test_wan_animate.py)."""
    from safetensors.torch import save_file

    from parallel_runtime.errors import ModelFileError

    base = load_file(write_checkpoint(str(tmp_path / "wan.safetensors"), TINY_WAN))
    for key, node in (("casual_audio_encoder.encoder.final_linear.weight", "WanSoundImageToVideo"),
                      ("audio_proj.audio_proj_glob_1.layer.bias", "WanHuMoImageToVideo")):
        path = str(tmp_path / f"{node}.safetensors")
        save_file({**base, key: torch.zeros(4)}, path)
        with pytest.raises(ModelFileError, match=rf"^{node}.safetensors is a Wan .* model, which ParaDiT does not "
                                                 rf"run yet \(its .*\); load it with UNETLoader for {node}, or choose"):
            model_config(path)
