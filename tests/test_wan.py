"""Wan 2.1 text-to-video on the workers: detection, the serial model against a reference written here from
ComfyUI's WanModel (comfy/ldm/wan/model.py) on the file's raw tensors, and every strategy over video tokens.

The reference takes nothing from the family module: Conv3d patch embedding, [cos, sin] sinusoid, 3-D RoPE ids
through ComfyUI's rope formula (pairs rotated as apply_rope1 rotates them), the block's modulation, RMS-normed
q/k, cross-attention, the head and ComfyUI's unpatchify einsum. A wrong token order, RoPE axis, patch order or
modulation row is an O(1) error; the real-host test (tests/test_comfyui_wan.py) compares with ComfyUI itself.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import apply_comfy_rope, check_denoise_loop, comfy_rope, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.wan import WanConfig
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.sampling import WAN21_LATENT, WAN22_LATENT
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

# 2 heads of 128 (every Wan's head size), 2 blocks; the prompt 64 wide (umT5's 4096 in real files).
TINY_WAN = WanConfig(hidden_size=256, num_layers=2, ffn_dim=512, text_dim=64)
T, H, W = 5, 6, 8  # latent frames x height x width: 5 x 3 x 4 = 60 video tokens, 15 token rows
# One fp32 forward in another op order than the reference: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4


# Image-to-video: 16 latent + 4 mask + 16 start-frame channels in; 2.1 also cross-attends 257 CLIP-vision tokens.
TINY_WAN_I2V = dataclasses.replace(TINY_WAN, in_channels=36, image_to_video=True)
TINY_WAN22_I2V = dataclasses.replace(TINY_WAN, in_channels=36)
# 2.1 FLF2V: the I2V shape plus img_emb.emb_pos, a position for each of the start and end images' 257 tokens.
TINY_WAN_FLF2V = dataclasses.replace(TINY_WAN_I2V, clip_positions=514)


@pytest.fixture(scope="module")
def wan21_i2v_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan") / "wan2.1_i2v_tiny.safetensors"), TINY_WAN_I2V, seed=4)


@pytest.fixture(scope="module")
def wan22_i2v_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan") / "wan2.2_i2v_tiny.safetensors"), TINY_WAN22_I2V,
                            seed=5)


def i2v_job(path: str, strategy: S, clip: bool = True, images: int = 1) -> Job:
    """A call of both branches with WanImageToVideo's inputs: each branch the same concat (mask over the first
    frame, start-frame latent) and CLIP-vision tokens, as that node sets them on positive and negative. `images`=2:
    WanFirstLastFrameToVideo's, the mask over the first and last frames and both images' CLIP tokens one after the
    other."""
    job = call_job(path, strategy)
    g = torch.Generator().manual_seed(7)
    frames = torch.tensor([0, T - 1][:images])
    concat = torch.cat([torch.zeros(1, 4, T, H, W).index_fill_(2, frames, 1.0),
                        torch.randn(1, 16, T, H, W, generator=g)], dim=1)
    tokens = torch.randn(1, 257 * images, 1280, generator=g) if clip else None
    pos, neg = (dataclasses.replace(b, concat=concat, clip_vision=tokens) for b in (job.positive, job.negative))
    return dataclasses.replace(job, positive=pos, negative=neg)


@pytest.fixture(scope="module")
def wan_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan") / "wan2.1_t2v_tiny.safetensors"), TINY_WAN, seed=1,
                            prefix="model.diffusion_model.")


def conditioning(seed: int, tokens: int = 9) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, tokens, TINY_WAN.text_dim, generator=g), torch.zeros(1, 0))


def call_job(path: str, strategy: S, negative: bool = True, call_step: int | None = None) -> Job:
    g = torch.Generator().manual_seed(3)
    rows = 2 if negative else 1
    x = torch.randn(rows, 16, T, H, W, generator=g)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), x, conditioning(1),
               conditioning(2, tokens=11) if negative else None, timestep=torch.full((rows,), 870.0),
               call_step=call_step)


# -- the reference ---------------------------------------------------------------------------------------


def camera_adapter(sd: dict, camera: torch.Tensor) -> torch.Tensor:
    """ComfyUI's WanCamAdapter on WanCameraEmbedding's [B, 24, F, 8H, 8W]: frames into the batch, PixelUnshuffle(8),
    the 2x2 stride-2 conv, one residual block (3x3 conv, ReLU, 3x3 conv, + input), frames back: [B, dim, F, H/2, W/2]."""
    b, c, f, h, w = camera.shape
    x = F.pixel_unshuffle(camera.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w), 8)
    x = F.conv2d(x, sd["control_adapter.conv.weight"], sd["control_adapter.conv.bias"], stride=2)
    r = F.relu(F.conv2d(x, sd["control_adapter.residual_blocks.0.conv1.weight"],
                        sd["control_adapter.residual_blocks.0.conv1.bias"], padding=1))
    x = x + F.conv2d(r, sd["control_adapter.residual_blocks.0.conv2.weight"],
                     sd["control_adapter.residual_blocks.0.conv2.bias"], padding=1)
    return x.view(b, f, *x.shape[1:]).permute(0, 2, 1, 3, 4)


def comfy_wan_ops(sd: dict, heads: int, dim: int):
    """(linear by name, RMSNorm by name, attention over heads) as comfy/ldm/wan/model.py applies them to a state dict:
    the pieces every Wan reference call here (plain, Fun, VACE) is written from."""

    def lin(x, name):
        return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])

    def rms(x, name):
        return F.rms_norm(x, (dim,), sd[f"{name}.weight"], 1e-6)

    def attention(q, k, v):
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    return lin, rms, attention


@torch.no_grad()
def reference_call(path: str, job: Job, c: WanConfig = TINY_WAN) -> torch.Tensor:
    """ComfyUI's WanModel on the job's rows; an image-to-video file reads its branch's concat channels beside the
    latent and (2.1) its CLIP-vision tokens through img_emb and the cross-attention's k_img / v_img."""
    return reference_call_on(load_file(path), job, c)


def reference_call_on(tensors: dict, job: Job, c: WanConfig, source_rotation: bool = True, after_embed=None,
                      after_block=None) -> torch.Tensor:
    """reference_call on a file's tensors. A branch's in-context streams (reference_method "in_context": Bernini's
    context_latents) are read as ComfyUI 2026's WanModel reads them: each padded to the patch, through
    patch_embedding, after the video's tokens, on its own rope_encode grid from 0 composed with the rotation of its
    source_id (`source_rotation` False leaves that out: the defect the tests must catch), cut before unpatchify.
    A variant's additions come as hooks: `after_embed(sd, x, branch)` on the patch embedding [1, dim, T, H/2, W/2],
    `after_block(sd, i, x, branch)` on the tokens after block i (Wan Animate's: tests/test_wan_animate.py)."""
    sd = {k.removeprefix("model.diffusion_model."): v for k, v in tensors.items()}
    heads, dim = c.num_heads, c.hidden_size
    lin, rms, attention = comfy_wan_ops(sd, heads, dim)

    out = []
    for row, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        x = job.latent[row:row + 1]
        if branch.concat is not None:  # WanImageToVideo's mask and start-frame latent, after the latent's channels
            x = torch.cat([x, branch.concat], dim=1)
        x = F.conv3d(x, sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=(1, 2, 2))
        if getattr(branch, "camera", None) is not None and "control_adapter.conv.weight" in sd:
            x = x + camera_adapter(sd, branch.camera)  # CameraWanModel: the adapter's rows on the patch embedding
        if after_embed is not None:
            x = after_embed(sd, x, branch)
        grid = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        streams = branch.references if branch.reference_method == "in_context" else ()
        ref = None
        if "ref_conv.weight" in sd and branch.references and not streams:  # WanModel: ref_conv's tokens first
            r = (WAN22_LATENT if c.out_channels == 48 else WAN21_LATENT).process_in(branch.references[-1])
            ref = F.conv2d(r, sd["ref_conv.weight"], sd["ref_conv.bias"], stride=2).flatten(2).transpose(1, 2)
            x = torch.cat([ref, x], dim=1)
        main_len = x.shape[1]
        # rope_encode: each axis linspace(shift, shift + (n - 1) * scale, n); ScaleROPE sets scale and shift
        scale_shift = job.extra.get("rope_options") or [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]

        def rope_encode(rope_grid):
            axes = (torch.linspace(shift, shift + (n - 1) * scale, n)
                    for n, scale, shift in zip(rope_grid, scale_shift[:3], scale_shift[3:]))
            ids = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
            return comfy_rope(ids, (128 - 4 * 21, 2 * 21, 2 * 21))  # WanModel: d - 4 (d // 6), 2 (d // 6), 2 (d // 6)

        freqs = rope_encode((grid[0] + (ref is not None), *grid[1:]))  # _forward: t_len + 1 with a reference latent
        for source_id, lat in enumerate(streams, start=1):
            lat = (WAN22_LATENT if c.out_channels == 48 else WAN21_LATENT).process_in(lat)  # WAN21.extra_conds
            lat = F.pad(lat, (0, lat.shape[-1] % 2, 0, lat.shape[-2] % 2, 0, 0), mode="circular")  # pad_to_patch_size
            tokens = F.conv3d(lat, sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=(1, 2, 2))
            x = torch.cat([x, tokens.flatten(2).transpose(1, 2)], dim=1)
            stream_freqs = rope_encode(tokens.shape[2:])
            if source_rotation:  # rope(pos=source_id, d=128, theta): one 2x2 rotation per pair of the whole head
                stream_freqs = stream_freqs @ comfy_rope(torch.tensor([[float(source_id)]]), (128,))
            freqs = torch.cat([freqs, stream_freqs])
        t = job.timestep[row:row + 1]  # [1] or, per frame (Wan 2.2's noise-masked image-to-video), [1, T]
        half = c.freq_dim // 2
        sinusoid = torch.outer(t.flatten(), torch.pow(10000, -torch.arange(half).float().div(half)))
        e = lin(F.silu(lin(torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], 1), "time_embedding.0")),
                "time_embedding.2").reshape(1, -1, dim)
        e0 = lin(F.silu(e), "time_projection.1").unflatten(2, (6, dim))
        # ComfyUI's repeat_e: a per-frame row repeated over that frame's tokens
        e, e0 = (torch.repeat_interleave(v, x.shape[1] // v.shape[1], dim=1) for v in (e, e0))
        context = lin(F.gelu(lin(branch.cond, "text_embedding.0"), approximate="tanh"), "text_embedding.2")
        image_context = context  # WanI2VCrossAttention without clip_fea: context[:, :None] is the whole prompt
        if c.image_to_video and branch.clip_vision is not None:  # MLPProj: LN, Linear, exact GELU, Linear, LN
            h = branch.clip_vision
            if "img_emb.emb_pos" in sd:  # FLF2V's MLPProj: the first emb_pos rows, each plus its position
                pos = sd["img_emb.emb_pos"]
                h = h[:, :pos.shape[1]] + pos[:, :h.shape[1]]
            h = F.layer_norm(h, (1280,), sd["img_emb.proj.0.weight"], sd["img_emb.proj.0.bias"])
            h = lin(F.gelu(lin(h, "img_emb.proj.1")), "img_emb.proj.3")
            image_context = F.layer_norm(h, (dim,), sd["img_emb.proj.4.weight"], sd["img_emb.proj.4.bias"])
        for i in range(c.num_layers):
            b = f"blocks.{i}"
            m = (sd[f"{b}.modulation"].unsqueeze(0) + e0).unbind(2)
            h = F.layer_norm(x, (dim,), eps=1e-6) * (1 + m[1]) + m[0]
            q, k = (apply_comfy_rope(rms(lin(h, f"{b}.self_attn.{n}"), f"{b}.self_attn.norm_{n}")
                                     .unflatten(-1, (heads, -1)), freqs) for n in ("q", "k"))
            y = lin(attention(q.flatten(2), k.flatten(2), lin(h, f"{b}.self_attn.v")), f"{b}.self_attn.o")
            x = x + y * m[2]
            h = F.layer_norm(x, (dim,), sd[f"{b}.norm3.weight"], sd[f"{b}.norm3.bias"], 1e-6)
            q = rms(lin(h, f"{b}.cross_attn.q"), f"{b}.cross_attn.norm_q")
            y = attention(q, rms(lin(context, f"{b}.cross_attn.k"), f"{b}.cross_attn.norm_k"),
                          lin(context, f"{b}.cross_attn.v"))
            if c.image_to_video:
                y = y + attention(q, rms(lin(image_context, f"{b}.cross_attn.k_img"), f"{b}.cross_attn.norm_k_img"),
                                  lin(image_context, f"{b}.cross_attn.v_img"))
            x = x + lin(y, f"{b}.cross_attn.o")
            h = F.layer_norm(x, (dim,), eps=1e-6) * (1 + m[4]) + m[3]
            x = x + lin(F.gelu(lin(h, f"{b}.ffn.0"), approximate="tanh"), f"{b}.ffn.2") * m[5]
            if after_block is not None:
                x = after_block(sd, i, x, branch)
        shift, scale = (sd["head.modulation"].unsqueeze(0) + e.unsqueeze(2)).unbind(2)
        x = lin(F.layer_norm(x, (dim,), eps=1e-6) * (1 + scale) + shift, "head.head")
        x = x[:, :main_len]  # forward_orig: the head's output cut back to the video's (and a reference's) tokens
        if ref is not None:
            x = x[:, ref.shape[1]:]
        u = x.view(1, *grid, 1, 2, 2, c.out_channels)
        out.append(torch.einsum("bfhwpqrc->bcfphqwr", u).reshape(1, c.out_channels, T, H, W))
    return torch.cat(out)


# -- tests -----------------------------------------------------------------------------------------------


def test_wan_files_are_detected_and_variants_refused(wan_path, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(wan_path) as reader:
        family, match = detect_family(reader.keys())
    assert (family.name, match.prefix) == ("wan", "model.diffusion_model.")
    config = model_config(wan_path)
    assert (config.num_heads, config.num_layers, config.ffn_dim, config.latent_channels) == (2, 2, 512, 16)
    assert config.rope_axes == (44, 42, 42)  # ComfyUI's split of the 128-wide head
    assert config.title == "Wan 2.1 / 2.2 T2V 256-wide"  # 2.2 14B experts share 2.1 14B T2V's shape
    from safetensors.torch import save_file

    flf = model_config(write_checkpoint(str(tmp_path / "wan_flf2v.safetensors"), TINY_WAN_FLF2V))
    assert (flf.clip_positions, flf.clip_vision_width, flf.title) == (514, 1280, "Wan 2.1 FLF2V 256-wide")
    # The Wan variants comfy/model_detection.py tells by a key of their own, refused rather than run as plain Wan
    # without the inputs that drive them (pose, masks, a global dancer stream).
    plain = load_file(write_checkpoint(str(tmp_path / "wan_plain.safetensors"), TINY_WAN_I2V))
    for key, what in (("patch_embedding_mask.weight", "Wan SCAIL 2"), ("patch_embedding_pose.weight", "Wan SCAIL"),
                      ("patch_embedding_global.weight", "Wan Dancer")):
        path = str(tmp_path / f"{key.split('.')[0]}.safetensors")
        save_file({**plain, key: torch.zeros(2, 2)}, path)
        with pytest.raises(ModelFileError, match=f"is a {what} model, which ParaDiT does not run yet"):
            model_config(path)
    # Wan Animate 2: I2V-shaped keys; only the file's metadata (ComfyUI's config -> transformer -> model_type) says so.
    animate2 = str(tmp_path / "wan_animate_2_int8_convrot.safetensors")
    save_file(plain, animate2, metadata={"config": '{"transformer": {"model_type": "animate2"}}'})
    with pytest.raises(ModelFileError, match=r"wan_animate_2_int8_convrot.safetensors is a Wan Animate 2 model, which "
                                             r"ParaDiT does not run yet \(its pose branch beside the video\); load it "
                                             r"with UNETLoader for WanAnimate2ToVideo"):
        model_config(animate2)
    save_file(plain, animate2, metadata={"config": '{"transformer": {"model_type": "i2v"}}'})
    assert model_config(animate2).family == "wan"  # a config naming a model type Wan runs changes nothing


def test_wan_image_to_video_files_are_detected(wan21_i2v_path, wan22_i2v_path):
    """2.1 I2V (36 input channels, img_emb and k_img / v_img for CLIP vision) and 2.2 I2V (36 channels, no CLIP)."""
    c21, c22 = model_config(wan21_i2v_path), model_config(wan22_i2v_path)
    assert (c21.concat_channels, c21.clip_vision_width, c21.variant, c21.title) == (20, 1280, "i2v", "Wan 2.1 I2V 256-wide")
    assert (c22.concat_channels, c22.clip_vision_width, c22.title) == (20, None, "Wan 2.2 I2V 256-wide")


def test_wan_one_worker_equals_the_reference(wan_path, client1):
    job = call_job(wan_path, S())
    out = client1.run(job).latent
    assert out.shape == (2, 16, T, H, W)
    assert rel_err(out, reference_call(wan_path, job)) < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=5)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_wan_exact_strategies_equal_the_reference(wan_path, client2, strategy):
    """Prompts of different lengths (9 and 11 tokens): separate forward passes, as ComfyUI runs them. PipeFusion's
    patches are whole frames (15 token rows / 5); its call without a schedule step is its warm-up (exact)."""
    job = call_job(wan_path, strategy)
    assert rel_err(client2.run(job).latent, reference_call(wan_path, job)) < EXACT_RTOL


def test_wan_ulysses_times_ring_on_four(wan_path, client4):
    """Ulysses 2 x Ring 2: the 60 video tokens in four shards, each Ring block a Ulysses group's two."""
    job = call_job(wan_path, S(ulysses_degree=2, ring_degree=2))
    assert rel_err(client4.run(job).latent, reference_call(wan_path, job)) < EXACT_RTOL


def test_wan_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(wan_path, client1, client2):
    """A whole 6-step run at cfg 5 (Parallel Sampler's path): exact strategies equal serial; PipeFusion after one
    warm-up step reads stale K/V and lands nearer serial than naive patch parallelism, which never sees the other
    half of the video."""
    job = Job(ModelSpec(wan_path), S(), SamplingSpec(steps=6, cfg=5.0, seed=1),
              torch.zeros(1, 16, T, H, W), conditioning(1), conditioning(2))
    check_denoise_loop(job, client1, client2, "Wan video", EXACT_RTOL, warm_patches=5, stale_patches=3)


def test_wan_refusals(wan_path, client1):
    from parallel_runtime.errors import ConfigError

    image = dataclasses.replace(call_job(wan_path, S()), latent=torch.randn(2, 16, H, W))
    with pytest.raises(ConfigError, match="needs a video latent .* use EmptyHunyuanLatentVideo"):
        client1.run(image)
    odd = dataclasses.replace(call_job(wan_path, S()), latent=torch.randn(2, 16, T, H, W + 1))
    with pytest.raises(ConfigError, match="not a multiple of the model's 2x2 patch"):
        client1.run(odd)


def test_wan_image_to_video_one_worker_equals_the_reference(wan21_i2v_path, wan22_i2v_path, client1):
    """2.1 I2V with CLIP vision, 2.1 I2V without (its image keys read the prompt, as ComfyUI's), 2.2 I2V."""
    for path, config, clip in ((wan21_i2v_path, TINY_WAN_I2V, True), (wan21_i2v_path, TINY_WAN_I2V, False),
                               (wan22_i2v_path, TINY_WAN22_I2V, False)):
        job = i2v_job(path, S(), clip=clip)
        assert rel_err(client1.run(job).latent, reference_call(path, job, config)) < SERIAL_RTOL, (path, clip)


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=5)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_wan_image_to_video_exact_strategies(wan21_i2v_path, client2, strategy):
    """The concat channels split with the video tokens; the CLIP-vision tokens reach every rank and stage (PipeFusion's
    second stage embeds them itself: img_emb is held on every stage)."""
    job = i2v_job(wan21_i2v_path, strategy)
    assert rel_err(client2.run(job).latent, reference_call(wan21_i2v_path, job, TINY_WAN_I2V)) < EXACT_RTOL


@pytest.fixture(scope="module")
def wan21_flf2v_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan") / "wan2.1_flf2v_tiny.safetensors"), TINY_WAN_FLF2V,
                            seed=6)


def test_wan_first_last_frame_equals_the_reference_on_one_worker_and_split(wan21_flf2v_path, client1, client2):
    """FLF2V: both images' 514 CLIP tokens each plus its learned position, and one image's 257 (emb_pos' first rows,
    as ComfyUI's MLPProj adds them), on one worker; then split by Ulysses and over PipeFusion's stages (the second
    stage embeds the CLIP tokens itself: emb_pos is img_emb's, which every stage holds)."""
    for images in (2, 1):
        job = i2v_job(wan21_flf2v_path, S(), images=images)
        ref = reference_call(wan21_flf2v_path, job, TINY_WAN_FLF2V)
        assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL, images
    # The positions matter: the same job without them is 3e-3 away here (small random positions, then LayerNorm),
    # 300x the tolerance above: a model that dropped them would fail.
    sd = {k: v for k, v in load_file(wan21_flf2v_path).items() if k != "img_emb.emb_pos"}
    assert rel_err(ref, reference_call_on(sd, job, TINY_WAN_I2V)) > 100 * SERIAL_RTOL
    for strategy in (S(ulysses_degree=2), S(pipefusion_degree=2, num_pipeline_patch=3)):
        job = i2v_job(wan21_flf2v_path, strategy, images=2)
        ref = reference_call(wan21_flf2v_path, job, TINY_WAN_FLF2V)
        assert rel_err(client2.run(job).latent, ref) < EXACT_RTOL, strategy


def test_wan_move_branches_with_their_own_concat_equal_the_reference(wan21_i2v_path, client1, client2):
    """WanMove's WanMoveTrackToVideo (ComfyUI 2026) gives the positive the start latent with track features written
    in and the negative the plain one (same mask): each branch's concat rides with its own chunk, on one worker and
    when CFG-2 / Ulysses-2 / Ring-2 split the call."""
    job = i2v_job(wan21_i2v_path, S())
    g = torch.Generator().manual_seed(12)
    tracked = job.positive.concat.clone()
    tracked[:, 4:, 1:] += torch.randn(1, 16, T - 1, H, W, generator=g)  # track features past the start frame
    job = dataclasses.replace(job, positive=dataclasses.replace(job.positive, concat=tracked))
    ref = reference_call(wan21_i2v_path, job, TINY_WAN_I2V)
    # The branches' concats matter: with the negative's concat on both, the positive's output moves (measured 0.43).
    same = dataclasses.replace(job, positive=dataclasses.replace(job.positive, concat=job.negative.concat))
    assert rel_err(ref[:1], reference_call(wan21_i2v_path, same, TINY_WAN_I2V)[:1]) > 1e-2
    assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL
    for strategy in (S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2)):
        assert rel_err(client2.run(dataclasses.replace(job, strategy=strategy)).latent, ref) < EXACT_RTOL, strategy


# ScaleROPE's (scale t, y, x, shift t, y, x): ChronoEdit's template (scale_t 7), and every axis moved.
CHRONO_EDIT_ROPE, MOVED_ROPE = [7.0, 1.0, 1.0, 0.0, 0.0, 0.0], [7.0, 1.5, 0.5, 1.0, -2.0, 3.0]


def test_wan_scale_rope_equals_the_reference_on_one_worker_and_split(wan21_i2v_path, client1, client2):
    """ScaleROPE's grid (rope_encode's rope_options) on the image-to-video model ChronoEdit is: one worker against
    the reference for ChronoEdit's options and for every axis scaled and shifted, then each exact strategy and
    PipeFusion's warm-up (every rank and stage builds the same scaled table)."""
    for options in (CHRONO_EDIT_ROPE, MOVED_ROPE):
        job = dataclasses.replace(i2v_job(wan21_i2v_path, S()), extra={"rope_options": options})
        ref = reference_call(wan21_i2v_path, job, TINY_WAN_I2V)
        assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL, options
    # The options matter: the plain grid is 2.8e-2 from the scaled one here (2800x the tolerance): ignoring them fails.
    assert rel_err(ref, reference_call(wan21_i2v_path, dataclasses.replace(job, extra={}), TINY_WAN_I2V)) > 1e-2
    for strategy in (S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2),
                     S(pipefusion_degree=2, num_pipeline_patch=3)):
        job = dataclasses.replace(i2v_job(wan21_i2v_path, strategy), extra={"rope_options": MOVED_ROPE})
        assert rel_err(client2.run(job).latent, reference_call(wan21_i2v_path, job, TINY_WAN_I2V)) < EXACT_RTOL


def test_wan_scale_rope_is_chronoedits_rope_in_diffusers():
    """ChronoEdit in diffusers (ChronoEditRotaryPosEmbed) places a 2-frame edit at times 0 and temporal_skip_len - 1
    = 7: the table ScaleROPE's scale_t 7 gives the Wan family, to fp32 round-off of the angles (positions < 8)."""
    import types

    from diffusers.models.transformers.transformer_chronoedit import ChronoEditRotaryPosEmbed

    from parallel_runtime.models.families.wan import WanAdapter

    rows, cols = 3, 4
    theirs = ChronoEditRotaryPosEmbed(128, (1, 2, 2), 1024, temporal_skip_len=8)(torch.zeros(1, 16, 2, 2 * rows,
                                                                                            2 * cols))
    fake = types.SimpleNamespace(device=torch.device("cpu"), config=TINY_WAN)
    cos, sin, _ = WanAdapter.rope(fake, 0, 2, 2 * rows, 2 * cols, rope_options=CHRONO_EDIT_ROPE)
    assert rel_err(cos, theirs[0].reshape(cos.shape)) < 1e-6 and rel_err(sin, theirs[1].reshape(sin.shape)) < 1e-6
    plain_cos, _, _ = WanAdapter.rope(fake, 0, 2, 2 * rows, 2 * cols)
    assert rel_err(plain_cos, theirs[0].reshape(cos.shape)) > 1e-2  # without the options: frame 1 at time 1


def test_wan_scale_rope_refusals(wan21_i2v_path, wan_path, client1):
    """A NaN in ScaleROPE, and ScaleROPE on a family whose RoPE the workers do not scale: one sentence each,
    before any work."""
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.models.tiny import TINY

    job = dataclasses.replace(i2v_job(wan21_i2v_path, S()), extra={"rope_options": [float("nan"), 1, 1, 0, 0, 0]})
    with pytest.raises(ConfigError, match="ScaleROPE's scale_t=nan is not a finite number; set it to a number"):
        client1.run(job)
    flux = write_checkpoint(os.path.join(os.path.dirname(wan_path), "flux_tiny.safetensors"), TINY, seed=2)
    job = Job(ModelSpec(flux), S(), SamplingSpec(steps=2), torch.zeros(1, 16, 8, 8),
              Conditioning(torch.randn(1, 4, TINY.context_dim), torch.randn(1, TINY.pooled_dim)),
              extra={"rope_options": CHRONO_EDIT_ROPE})
    with pytest.raises(ConfigError, match="ScaleROPE's RoPE scale and shift are not run by ParaDiT for .*; remove "
                                          "the ScaleROPE node or load the model with UNETLoader"):
        client1.run(job)


def test_wan_image_to_video_refusals(wan21_i2v_path, wan_path, client1):
    from parallel_runtime.errors import ConfigError

    job = i2v_job(wan21_i2v_path, S())
    wide = dataclasses.replace(job.positive, clip_vision=torch.randn(1, 257, 1024))
    with pytest.raises(ConfigError, match=r"CLIP vision output has shape \(1, 257, 1024\) .* load clip_vision_h"):
        client1.run(dataclasses.replace(job, positive=wide))
    bare = dataclasses.replace(job.positive, concat=None)
    with pytest.raises(ConfigError, match="reads 20 image channels .* feed it through WanImageToVideo"):
        client1.run(dataclasses.replace(job, positive=bare))
    # A text-to-video file ignores CLIP-vision tokens, as ComfyUI's WanModel does (no img_emb, no image keys).
    t2v = call_job(wan_path, S())
    with_clip = dataclasses.replace(t2v, positive=dataclasses.replace(t2v.positive, clip_vision=job.positive.clip_vision))
    assert rel_err(client1.run(with_clip).latent, client1.run(t2v).latent) == 0.0


# Wan 2.2 TI2V 5B's shape: its own 48-channel latent in and out (the start frame is part of the latent, not a concat).
TINY_WAN22_TI2V = dataclasses.replace(TINY_WAN, in_channels=48, out_channels=48)


@pytest.fixture(scope="module")
def wan22_ti2v_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan") / "wan2.2_ti2v_tiny.safetensors"), TINY_WAN22_TI2V,
                            seed=6)


def ti2v_job(path: str, strategy: S, per_frame: bool = True) -> Job:
    """A call as KSampler makes it on Wan22ImageToVideoLatent's latent: WAN22.process_timestep scales the timestep by
    each frame's mean noise mask, so the start frame (mask 0) runs at t = 0 and the rest at 870."""
    job = call_job(path, strategy)
    g = torch.Generator().manual_seed(8)
    t = torch.full((2, T), 870.0).index_fill_(1, torch.tensor([0]), 0.0) if per_frame else torch.full((2,), 870.0)
    return dataclasses.replace(job, latent=torch.randn(2, 48, T, H, W, generator=g), timestep=t)


def test_wan22_ti2v_is_detected_with_its_own_latent(wan22_ti2v_path):
    from parallel_runtime.sampling import WAN22_LATENT

    config = model_config(wan22_ti2v_path)
    assert (config.latent_channels, config.concat_channels, config.title) == (48, 0, "Wan 2.2 TI2V 256-wide")
    assert config.latent_format is WAN22_LATENT and len(WAN22_LATENT.mean) == 48


def test_wan22_ti2v_per_frame_timesteps_one_worker(wan22_ti2v_path, client1):
    """Per-frame timesteps: each token's modulation rows are its frame's (ComfyUI's repeat_e); a scalar one too."""
    for per_frame in (True, False):
        job = ti2v_job(wan22_ti2v_path, S(), per_frame)
        out = client1.run(job).latent
        assert out.shape == (2, 48, T, H, W)
        assert rel_err(out, reference_call(wan22_ti2v_path, job, TINY_WAN22_TI2V)) < SERIAL_RTOL, per_frame


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=5)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_wan22_ti2v_per_frame_timesteps_under_exact_strategies(wan22_ti2v_path, client2, strategy):
    """A shard (or PipeFusion patch) that starts mid-frame still gives each token its own frame's modulation: the
    frame of each token rides with its RoPE rows. 60 tokens / 2 shards: the cut is inside frame 2 (12 tokens each)."""
    job = ti2v_job(wan22_ti2v_path, strategy)
    assert rel_err(client2.run(job).latent, reference_call(wan22_ti2v_path, job, TINY_WAN22_TI2V)) < EXACT_RTOL


def test_wan22_ti2v_refuses_a_timestep_it_cannot_split(wan22_ti2v_path, client1):
    from parallel_runtime.errors import ConfigError

    job = dataclasses.replace(ti2v_job(wan22_ti2v_path, S()), timestep=torch.full((2, T + 1), 500.0))
    with pytest.raises(ConfigError, match=r"timestep has shape \(2, 6\), not \(2,\) or \(2, 5\)"):
        client1.run(job)


# -- the two experts of a Wan 2.2 14B graph ------------------------------------------------------------------


@pytest.fixture(scope="module")
def expert_paths(tmp_path_factory):
    """Two files of one shape, as Wan 2.2 14B's high-noise and low-noise experts are."""
    root = tmp_path_factory.mktemp("experts")
    return tuple(write_checkpoint(str(root / f"wan2.2_t2v_{name}_noise_tiny.safetensors"), TINY_WAN, seed=seed,
                                  prefix="model.diffusion_model.") for name, seed in (("high", 11), ("low", 12)))


def test_wan22_two_experts_stay_resident_when_memory_allows(expert_paths, client2):
    """High noise, low noise, high noise again (the next prompt), under Ulysses-2: each file is read once and both
    stay on the workers; a resident expert gives bit-identical results to its first run."""
    high, low = expert_paths
    loads = client2.model_loads
    first = client2.run(call_job(high, S(ulysses_degree=2)))
    second = client2.run(call_job(low, S(ulysses_degree=2)))
    again = client2.run(call_job(high, S(ulysses_degree=2)))
    assert [any(s["loaded"] for s in r.stats) for r in (first, second, again)] == [True, True, False]
    assert client2.model_loads == loads + 2
    assert client2.status()["resident_models"] == [os.path.basename(low), os.path.basename(high)]  # current last
    assert torch.equal(again.latent, first.latent)
    # Each rank holds both: its weights are the two models' bytes (fp32 tiny Wan, equal shapes).
    one = first.stats[0]["param_bytes"]
    assert again.stats[0]["resident_bytes"] == 2 * one and again.stats[0]["param_bytes"] == one
    client2.release()


def test_wan22_second_expert_replaces_the_first_when_both_do_not_fit(expert_paths, client2, monkeypatch):
    """Memory for one model only (the plan says so): the first expert is released before the second loads, the
    status says which one is resident and why; the next prompt reads the first again."""
    import parallel_runtime.runtime.client as client_module

    high, low = expert_paths
    monkeypatch.setattr(client_module, "keeps_other_models", lambda *args: False)
    client2.run(call_job(high, S(ring_degree=2)))
    swap = client2.run(call_job(low, S(ring_degree=2)))
    assert all(s["released"] == [os.path.basename(high)] and s["loaded"] for s in swap.stats)
    status = client2.status()
    assert status["resident_models"] == [os.path.basename(low)]
    assert status["residency_note"].startswith(f"released {os.path.basename(high)} to load {os.path.basename(low)}")
    back = client2.run(call_job(high, S(ring_degree=2)))
    assert all(s["loaded"] and s["released"] == [os.path.basename(low)] for s in back.stats)
    client2.release()


def test_wan_another_slicing_of_the_same_file_is_never_kept_beside_it(expert_paths, client2):
    """Switching from Ulysses to PipeFusion re-reads the file as two stages and drops the whole-model copy."""
    high, _ = expert_paths
    client2.run(call_job(high, S(ulysses_degree=2)))
    pp = client2.run(call_job(high, S(pipefusion_degree=2, num_pipeline_patch=5)))
    assert all(s["released"] == [os.path.basename(high)] for s in pp.stats)
    assert client2.status()["resident_models"] == [os.path.basename(high)]
    client2.release()


def test_wan22_experts_kept_only_where_every_rank_has_room(expert_paths):
    """keeps_other_models on reported memory: 2 GB free + a 1 GB other expert per rank against a job's estimate."""
    from parallel_runtime.planning.memory import job_rank_memory, keeps_other_models

    high, low = expert_paths
    job = call_job(low, S(ulysses_degree=2))
    need = job_rank_memory(job, "cuda:0")["total"]
    other = {"path": os.path.abspath(high), "weight_dtype": "default", "quantized_matmul": "auto", "bytes": 2**30}

    def report(free):
        return {"held_bytes": 2**30, "models": [other], "host_available": 0, "device_free": free}

    roomy = int((need + 2**20) / 0.9) + 1  # CUDA_USABLE: 90% of free memory counts
    assert keeps_other_models(job, ["cuda:0", "cuda:1"], [report(roomy)] * 2)
    assert not keeps_other_models(job, ["cuda:0", "cuda:1"], [report(roomy), report(int(need * 0.5))])
    # The job's own model already resident is reused, never counted as "other".
    same = dict(other, path=os.path.abspath(low))
    assert keeps_other_models(job, ["cuda:0"], [{"held_bytes": 2**30, "models": [same], "host_available": 0,
                                                 "device_free": int(need / 0.9) + 1}])


def test_wan_memory_per_rank_for_the_released_sizes():
    """The plan's memory per rank for the released shapes (bf16, 480p x 81 frames = 32,760 tokens, cfg 5): weights
    are the whole model under Ulysses / Ring / CFG and about half of it per PipeFusion-2 stage, counted from the
    module tree itself; the figures below go in docs/families.md's video section."""
    from parallel_runtime.models.families.wan import _meta_model
    from parallel_runtime.planning.costmodel import rank_memory

    sizes = {"1.3B": (WanConfig(hidden_size=1536, num_layers=30, ffn_dim=8960), 1.42e9),
             "14B": (WanConfig(hidden_size=5120, num_layers=40, ffn_dim=13824), 14.29e9)}
    for name, (config, released_params) in sizes.items():
        params = sum(p.numel() for p in _meta_model(config).parameters())
        # Parameters of the released files: wan2.1_t2v_1.3B_fp16 is 2.84 GB, wan2.1_t2v_14B_bf16 28.6 GB (2 bytes each).
        assert abs(params / released_params - 1) < 0.01, (name, params)

        def plan(strategy):
            return rank_memory(strategy, config, text_tokens=512, image_tokens=32760, batch=1, cfg=5.0,
                               weight_bytes=2, act_bytes=2)

        whole = plan(S(ulysses_degree=2))
        assert whole["params"] == 2 * params and plan(S(ring_degree=2))["params"] == 2 * params
        half = plan(S(pipefusion_degree=2))["params"]
        assert 0.45 < half / whole["params"] < 0.55  # each stage its blocks, the embeddings and head once


# -- the file kinds users download: fp8 / fp8_scaled, ComfyUI-quantized, GGUF ----------------------------------

# The quantized file and its fp32 twin hold the same numbers (the twin the values the file means): equal up to BLAS
# blocking of equal operands (GGUF dequantizes per layer in fp32), as in tests/test_fp8.py and tests/test_gguf.py.
STORAGE_RTOL = 1e-5


@pytest.fixture(scope="module")
def wan_storage_twins(tmp_path_factory):
    """(kind, quantized file, fp32 twin) of the tiny 2.1 I2V model (its img_emb and image keys included)."""
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins
    from test_gguf import gguf_twins

    folder = tmp_path_factory.mktemp("wan-storage")
    return [("fp8_scaled", *fp8_twins(folder, "wan", torch.float8_e4m3fn, True, config=TINY_WAN_I2V)),
            ("comfy_quant_int8", *comfy_quant_twins(folder, "wan", "int8_tensorwise", config=TINY_WAN_I2V)),
            ("gguf", *gguf_twins(folder, "wan", config=TINY_WAN_I2V, arch="wan"))]


def test_wan_quantized_files_equal_their_fp32_twins_and_stay_compact(wan_storage_twins, client1, client2):
    """Each kind at 1 worker equals the twin; under Ulysses-2 too; each rank holds the compact weights."""
    for kind, quant, meant in wan_storage_twins:
        assert model_config(quant).image_to_video, kind
        got, ref = client1.run(i2v_job(quant, S())), client1.run(i2v_job(meant, S()))
        assert rel_err(got.latent, ref.latent) <= STORAGE_RTOL, kind
        assert got.stats[0]["param_bytes"] < 0.6 * ref.stats[0]["param_bytes"], kind  # 1-byte (or less) matrices
        split = client2.run(i2v_job(quant, S(ulysses_degree=2)))
        assert rel_err(split.latent, got.latent) <= EXACT_RTOL, kind
    client1.release()
    client2.release()


def test_wan22_experts_with_their_own_loras_take_turns_without_resending_them(expert_paths, client2):
    """Each expert with its own LoRA stack, high, low, high: the third job names the first stack by id only, and the
    workers use the stack they kept (here proven by sending zeros under its id, which would undo the LoRA)."""
    from parallel_runtime.spec import WeightPatch, WeightPatches

    high, low = expert_paths
    g = torch.Generator().manual_seed(21)

    def stack(tag):
        up, down = torch.randn(256, 4, generator=g) * 0.1, torch.randn(4, 256, generator=g) * 0.1
        return WeightPatches(f"lightx2v-{tag}", {"blocks.0.self_attn.q.weight": [
            WeightPatch("lora", {"up": up, "down": down}, alpha=4.0)]})

    on_high, on_low = stack("high"), stack("low")
    first = client2.run(dataclasses.replace(call_job(high, S(ring_degree=2)), weight_patches=on_high)).latent
    client2.run(dataclasses.replace(call_job(low, S(ring_degree=2)), weight_patches=on_low))
    assert client2.status()["weight_patches"] == ["lightx2v-high", "lightx2v-low"]
    zeros = WeightPatches(on_high.id, {k: [dataclasses.replace(p, tensors={s: torch.zeros_like(t) for s, t in
                                                                           p.tensors.items()}) for p in ps]
                                       for k, ps in on_high.weights.items()})
    again = client2.run(dataclasses.replace(call_job(high, S(ring_degree=2)), weight_patches=zeros)).latent
    assert torch.equal(again, first)
    plain = client2.run(call_job(high, S(ring_degree=2))).latent
    assert rel_err(plain, first) > 1e-3  # the LoRA mattered
    client2.release()


# -- Wan 2.2 Bernini: BerniniConditioning's in-context latents ------------------------------------------------
# Two streams of their own sizes, as the node makes them: a 2-frame source video (the video's height, another width)
# and a 1-frame reference image of another aspect, 7 latent rows high (odd: padded to the patch as ComfyUI pads it).
BERNINI_STREAMS = ((1, 16, 2, H, W - 2), (1, 16, 1, 7, 4))


def bernini_job(path: str, strategy: S, rope_options: list[float] | None = None) -> Job:
    """call_job with BerniniConditioning's context_latents on both branches (the node sets the same list on each)."""
    g = torch.Generator().manual_seed(14)
    streams = tuple(torch.randn(*shape, generator=g) for shape in BERNINI_STREAMS)
    job = call_job(path, strategy)
    pos, neg = (dataclasses.replace(b, references=streams, reference_method="in_context")
                for b in (job.positive, job.negative))
    return dataclasses.replace(job, positive=pos, negative=neg,
                               extra={} if rope_options is None else {"rope_options": rope_options})


def test_wan_bernini_in_context_latents_one_worker_equals_the_reference(wan_path, client1):
    """1 worker against ComfyUI 2026's WanModel with two in-context streams (and under ScaleROPE, whose grid moves
    the streams' as the video's); the source rotation and the streams themselves each matter far beyond the
    tolerance, so a model that dropped either would fail."""
    sd = load_file(wan_path)
    errors = {}
    for options in (None, MOVED_ROPE):
        job = bernini_job(wan_path, S(), options)
        ref = reference_call_on(sd, job, TINY_WAN)
        errors[f"rope {options}"] = rel_err(client1.run(job).latent, ref)
    job = bernini_job(wan_path, S())
    ref = reference_call_on(sd, job, TINY_WAN)
    unturned = rel_err(ref, reference_call_on(sd, job, TINY_WAN, source_rotation=False))
    plain = call_job(wan_path, S())
    without = rel_err(ref, reference_call_on(sd, plain, TINY_WAN))
    print(f"\nBernini 1 worker: {errors}; without the source rotation {unturned:.1e}, without the streams {without:.1e}")
    assert max(errors.values()) < SERIAL_RTOL
    assert unturned > 1e-3 and without > 1e-3


def test_wan_bernini_rope_is_the_source_rotation_composed_with_each_streams_grid():
    """The family's table for the streams: each stream's grid from 0, turned by rope(source_id) over the whole head
    (ComfyUI's product of 2x2 rotations), against comfy_rope's matrices; the video's rows are the plain grid's."""
    import types

    from parallel_runtime.models.families.wan import WanAdapter

    fake = types.SimpleNamespace(device=torch.device("cpu"), config=TINY_WAN)
    shapes = tuple(shape[2:] for shape in BERNINI_STREAMS)
    cos, sin, frames = WanAdapter.rope(fake, 0, T, H, W, shapes, "in_context")
    video = T * (H // 2) * (W // 2)
    start = video
    for source_id, (f, h, w) in enumerate(shapes, start=1):
        ids = torch.stack(torch.meshgrid(torch.arange(f), torch.arange((h + 1) // 2), torch.arange((w + 1) // 2),
                                         indexing="ij"), -1).reshape(-1, 3).float()
        want = comfy_rope(ids, (44, 42, 42)) @ comfy_rope(torch.tensor([[float(source_id)]]), (128,))
        rows = slice(start, start + len(ids))
        assert rel_err(cos[rows, 0::2], want[..., 0, 0]) < 1e-6 and rel_err(sin[rows, 0::2], want[..., 1, 0]) < 1e-6
        start += len(ids)
    assert start == len(cos) and int(frames[video:].abs().sum()) == 0  # stream rows: the scalar timestep's rows
    plain_cos, _, _ = WanAdapter.rope(fake, 0, T, H, W)
    assert torch.equal(cos[:video], plain_cos)


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=5)],
                         ids=["cfg2", "ulysses2", "ring2", "tp2", "pp2_warmup"])
def test_wan_bernini_in_context_latents_under_every_strategy(wan_path, client2, strategy):
    """The 32 stream tokens split like the video's 60 (Ulysses' and Ring's shards, PipeFusion's patches: each rank and
    patch its run of them, with its rows of the rotated table), the branches to CFG's ranks, the heads to TP's."""
    job = bernini_job(wan_path, strategy)
    err = rel_err(client2.run(job).latent, reference_call(wan_path, job))
    print(f"\nBernini {strategy}: {err:.1e}")
    assert err < EXACT_RTOL


def test_wan_bernini_refusals(wan_path, wan21_i2v_path, wan22_ti2v_path, client1):
    """One sentence each, before any work: streams on a file whose patch embedding reads more than the latent, a
    stream that is not a [1, C, T, H, W] latent, and in-context latents with per-frame timesteps (Wan 2.2 5B's noise
    mask), whose result ComfyUI's WanModel does not define."""
    from parallel_runtime.errors import ConfigError

    job = bernini_job(wan21_i2v_path, S())
    i2v = dataclasses.replace(i2v_job(wan21_i2v_path, S()), positive=dataclasses.replace(
        i2v_job(wan21_i2v_path, S()).positive, references=job.positive.references, reference_method="in_context"))
    with pytest.raises(ConfigError, match=r"carries Bernini's in-context latents \(BerniniConditioning\), which "
                                          r"ComfyUI's WanModel reads on a Wan text-to-video file .* not on this Wan 2.1 "
                                          r"I2V 256-wide model; load the Bernini file or remove BerniniConditioning"):
        client1.run(i2v)
    job = bernini_job(wan_path, S())
    flat = dataclasses.replace(job.positive, references=(torch.randn(1, 16, H, W),), reference_method="in_context")
    with pytest.raises(ConfigError, match=r"in-context latent 1 of the positive conditioning has shape \(1, 16, 6, 8\), "
                                          r"not \[1, 16, frames, height/8, width/8\]"):
        client1.run(dataclasses.replace(job, positive=flat))
    ti2v = ti2v_job(wan22_ti2v_path, S())
    streams = tuple(torch.randn(1, 48, *shape[2:]) for shape in BERNINI_STREAMS)
    ti2v = dataclasses.replace(ti2v, **{b: dataclasses.replace(getattr(ti2v, b), references=streams,
                                                               reference_method="in_context")
                                        for b in ("positive", "negative")})
    with pytest.raises(ConfigError, match=r"in-context latents \(BerniniConditioning\) with per-frame timesteps .* "
                                          r"remove the noise mask or BerniniConditioning"):
        client1.run(ti2v)
