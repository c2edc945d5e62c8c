"""Wan 2.2 Animate on the workers (WanAnimateToVideo's pose latent and face video), against a model call written here
from ComfyUI's AnimateWanModel (comfy/ldm/wan/model_animate.py) on the file's raw tensors, and under every strategy.

The reference takes nothing from the family module: the motion encoder as ComfyUI's EncoderApp runs it (equalized
convs with the weight scaled at run time, upfirdn2d's single-channel blur, fused leaky ReLU, the QR of the
direction weights), FaceEncoder's causal convolutions and its einops layouts, FaceBlock's per-frame attention over
(batch x frames) and the pose patch conv added to frames 1.. of the patch embedding, on tests/test_wan.py's
WanModel reference. A wrong frame for a token, a pose one frame off or a face block after the wrong main block is
an O(1) error; the real-host comparison is tests/test_comfyui_wan_animate.py.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import checkpoint_without, rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.spec import kept_key
from parallel_runtime.validate import model_config
from test_wan import EXACT_RTOL, SERIAL_RTOL, TINY_WAN, H, T, W, call_job, reference_call_on

pytestmark = pytest.mark.timeout(900)

# The Wan 2.1 I2V shape (36 channels in, CLIP vision) with Animate's parts; 10 blocks put face blocks after 0 and 5.
TINY_ANIMATE = dataclasses.replace(TINY_WAN, num_layers=10, in_channels=36, image_to_video=True, animate=True)
# Face frames: 5 pixel frames -> 3 -> 2 motion frames (stride 2, twice) + the zero reference frame = 3 of the
# video's T = 5 latent frames (the last 2 padded with zeros, as after_patch_embedding pads them).
FACE_FRAMES = 5


@pytest.fixture(scope="module")
def animate_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("wan-animate") / "wan2.2_animate_tiny.safetensors"),
                            TINY_ANIMATE, seed=41, prefix="model.diffusion_model.")


def animate_job(path: str, strategy: S, face: bool = True, pose: bool = True, frames: int = FACE_FRAMES,
                negative: bool = True):
    """Both branches as WanAnimateToVideo makes them: the reference image's latent and the motion frames as concat
    (mask 0 over frame 0), CLIP vision, the pose latent (T - 1 frames) on both, the face video on the positive and
    its -1 twin (face * 0 - 1) on the negative, each kept under its key like a model call's."""
    job = call_job(path, strategy, negative=negative)
    g = torch.Generator().manual_seed(43)
    concat = torch.cat([torch.ones(1, 4, T, H, W).index_fill_(2, torch.tensor([0]), 0.0),
                        torch.randn(1, 16, T, H, W, generator=g)], dim=1)
    clip = torch.randn(1, 257, 1280, generator=g)
    latent = torch.randn(1, 16, T - 1, H, W, generator=g) if pose else None
    faces = face_video(frames=frames)
    extra = [dict(face=f, face_key=kept_key("face", f)) for f in (faces, faces * 0.0 - 1.0)]
    pos, neg = (b and dataclasses.replace(b, concat=concat, clip_vision=clip, pose=latent, **(e if face else {}))
                for b, e in zip((job.positive, job.negative), extra))
    return dataclasses.replace(job, positive=pos, negative=neg)


def face_video(reverse: bool = False, frames: int = FACE_FRAMES) -> torch.Tensor:
    """[1, 3, frames, 512, 512] in [-1, 1], each frame another mix of a horizontal and a vertical ramp: the
    random motion encoder tells such frames apart (noise frames all encode alike, which would hide a token read
    against another frame's motion)."""
    s = torch.linspace(-1.0, 1.0, frames)
    if reverse:
        s = s.flip(0)
    ramp = torch.linspace(-1.0, 1.0, 512)
    frames = ramp[None, None, :] * s[:, None, None] + ramp[None, :, None] * (1 - s.abs())[:, None, None]
    return frames[None, None].expand(1, 3, -1, -1, -1).contiguous()


# -- the reference: comfy/ldm/wan/model_animate.py on raw tensors ---------------------------------------------

def _equal_conv(sd, name, x, stride=1, padding=0):
    w = sd[f"{name}.weight"]
    bias = sd.get(f"{name}.bias")
    return F.conv2d(x, w * (1 / math.sqrt(w.shape[1] * w.shape[2] ** 2)), bias, stride=stride, padding=padding)


def _blur(sd, name, x, pad):
    """upfirdn2d_native at up = down = 1: every channel alone through the flipped kernel after padding."""
    b, c, h, w = x.shape
    out = F.pad(x.reshape(-1, 1, h, w), [pad[0], pad[1], pad[0], pad[1]])
    kernel = torch.flip(sd[f"{name}.kernel"], [0, 1]).view(1, 1, 4, 4)
    out = F.conv2d(out, kernel)
    return out.reshape(b, c, out.shape[-2], out.shape[-1])


def _conv_layer(sd, name, x, kernel, downsample=False, activate=True):
    i = 0
    if downsample:
        p = 4 - 2 + kernel - 1
        x, i = _blur(sd, f"{name}.0", x, ((p + 1) // 2, p // 2)), 1
    x = _equal_conv(sd, f"{name}.{i}", x, stride=2 if downsample else 1, padding=0 if downsample else kernel // 2)
    if activate:
        x = F.leaky_relu(x + sd[f"{name}.{i + 1}.bias"], 0.2) * 2 ** 0.5
    return x


def reference_motion(sd, faces: torch.Tensor) -> torch.Tensor:
    """Generator.get_motion on [N, 3, 512, 512] -> [N, 512]."""
    p = "motion_encoder.enc"
    h = _conv_layer(sd, f"{p}.net_app.convs.0", faces, 1)
    for i in range(1, 8):
        r = f"{p}.net_app.convs.{i}"
        out = _conv_layer(sd, f"{r}.conv2", _conv_layer(sd, f"{r}.conv1", h, 3), 3, downsample=True)
        h = (out + _conv_layer(sd, f"{r}.skip", h, 1, downsample=True, activate=False)) / math.sqrt(2)
    h = _equal_conv(sd, f"{p}.net_app.convs.8", h).squeeze(-1).squeeze(-1)
    for k in range(5):
        w = sd[f"{p}.fc.{k}.weight"]
        h = F.linear(h, w * (1 / math.sqrt(w.shape[1])), sd[f"{p}.fc.{k}.bias"])
    weight = sd["motion_encoder.dec.direction.weight"]
    q, _ = torch.linalg.qr(weight + 1e-8 * torch.eye(512, 20))
    return torch.sum(h.unsqueeze(-1) * q.T, dim=1)


def reference_face_encoder(sd, x: torch.Tensor) -> torch.Tensor:
    """FaceEncoder.forward: [B, F, 512] -> [B, ~F/4, 5, dim] with its einops layouts."""
    def causal(name, t, stride):
        return F.conv1d(F.pad(t, (2, 0), mode="replicate"), sd[f"{name}.conv.weight"], sd[f"{name}.conv.bias"],
                        stride=stride)
    b = x.shape[0]
    x = causal("face_encoder.conv1_local", x.transpose(1, 2), 1)  # b (n c) t
    t = x.shape[-1]
    x = x.view(b, 4, 1024, t).permute(0, 1, 3, 2).reshape(b * 4, t, 1024)  # (b n) t c
    x = F.silu(F.layer_norm(x, (1024,), eps=1e-6))
    for name in ("face_encoder.conv2", "face_encoder.conv3"):
        x = F.silu(F.layer_norm(causal(name, x.transpose(1, 2), 2).transpose(1, 2), (1024,), eps=1e-6))
    x = F.linear(x, sd["face_encoder.out_proj.weight"], sd["face_encoder.out_proj.bias"])
    x = x.view(b, 4, x.shape[1], -1).permute(0, 2, 1, 3)  # b t n c
    return torch.cat([x, sd["face_encoder.padding_tokens"].repeat(b, x.shape[1], 1, 1)], dim=-2)


_MOTION: dict = {}


def reference_face_tokens(sd, face: torch.Tensor, frames: int) -> torch.Tensor:
    """after_patch_embedding's face half (the motion encoder 8 frames at a time), memoized per face video: every
    call of a test reads the same faces, and the encoder is the slow part of a 1-thread reference."""
    key = (kept_key("face", face), frames)
    if key not in _MOTION:
        b, _, f = face.shape[:3]
        flat = face.permute(0, 2, 1, 3, 4).reshape(b * f, 3, 512, 512)
        codes = torch.cat([reference_motion(sd, flat[i:i + 8]) for i in range(0, flat.shape[0], 8)])
        tokens = reference_face_encoder(sd, codes.view(b, f, 512))
        tokens = torch.cat([torch.zeros(b, 1, *tokens.shape[2:]), tokens], dim=1)
        if tokens.shape[1] < frames:
            tokens = torch.cat([tokens, torch.zeros(b, frames - tokens.shape[1], *tokens.shape[2:])], dim=1)
        _MOTION[key] = tokens[:, :frames]
    return _MOTION[key]


def reference_face_block(sd, n: int, x: torch.Tensor, motion: torch.Tensor, heads: int) -> torch.Tensor:
    """FaceBlock.forward: (B L) batches of one frame's S tokens against its 5 motion tokens."""
    p = f"face_adapter.fuser_blocks.{n}"
    b, frames, tokens, c = motion.shape
    kv = F.linear(F.layer_norm(motion, (c,), eps=1e-6), sd[f"{p}.linear1_kv.weight"], sd[f"{p}.linear1_kv.bias"])
    q = F.linear(F.layer_norm(x, (c,), eps=1e-6), sd[f"{p}.linear1_q.weight"], sd[f"{p}.linear1_q.bias"])
    k, v = kv.view(b, frames, tokens, 2, heads, c // heads).permute(3, 0, 1, 2, 4, 5)
    q = F.rms_norm(q.view(b, -1, heads, c // heads), (c // heads,), sd[f"{p}.q_norm.weight"], 1e-6)
    k = F.rms_norm(k, (c // heads,), sd[f"{p}.k_norm.weight"], 1e-6)
    k, v = k.reshape(b * frames, tokens, heads, -1), v.reshape(b * frames, tokens, heads, -1)
    q = q.reshape(b * frames, -1, heads, c // heads)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = out.transpose(1, 2).reshape(b, -1, c)
    return F.linear(out, sd[f"{p}.linear2.weight"], sd[f"{p}.linear2.bias"])


def reference_animate(path: str, job, c=TINY_ANIMATE) -> torch.Tensor:
    """AnimateWanModel.forward_orig on the job's rows: the pose patch conv added to frames 1..P, a face block after
    every 5th block (from block 0) on the branch's motion tokens."""
    def after_embed(sd, x, branch):
        if branch.pose is None:
            return x
        pose = F.conv3d(branch.pose, sd["pose_patch_embedding.weight"], sd["pose_patch_embedding.bias"],
                        stride=(1, 2, 2))
        x = x.clone()
        x[:, :, 1:pose.shape[2] + 1] += pose[:, :, :x.shape[2] - 1]
        return x

    def after_block(sd, i, x, branch):
        if branch.face is None or i % 5:
            return x
        motion = reference_face_tokens(sd, branch.face, T)
        return x + reference_face_block(sd, i // 5, x, motion, c.num_heads)

    return reference_call_on(load_file(path), job, c, after_embed=after_embed, after_block=after_block)


# -- tests ---------------------------------------------------------------------------------------------------

def test_wan_animate_files_are_detected(animate_path, tmp_path):
    config = model_config(animate_path)
    assert (config.animate, config.title, config.face_after, config.concat_channels) == (
        True, "Wan 2.2 Animate 256-wide", {0: 0, 5: 1}, 20)
    assert config.riders == {0: ("face_adapter.fuser_blocks.0.",), 5: ("face_adapter.fuser_blocks.1.",)}
    damaged = checkpoint_without(animate_path, tmp_path, ".fuser_blocks.1.")
    with pytest.raises(ModelFileError, match="has Wan Animate's face blocks but not one per 5 of its 10 blocks"):
        model_config(damaged)


def test_wan_animate_one_worker_equals_the_reference(animate_path, client1):
    job = animate_job(animate_path, S())
    out = client1.run(job).latent
    ref = reference_animate(animate_path, job)
    assert rel_err(out, ref) < SERIAL_RTOL
    # The pose and the face each move the result (so the parity above tests them): without a face, or without a
    # pose, the reference is another latent; so is it with the face frames in reverse order (the motion tokens are
    # read per frame).
    reversed_face = face_video(reverse=True)
    reverse = dataclasses.replace(job.positive, face=reversed_face, face_key=kept_key("face", reversed_face))
    assert rel_err(reference_animate(animate_path, dataclasses.replace(job, positive=reverse)), ref) > 1e-3
    for changed in (dict(face=False), dict(pose=False)):
        other = animate_job(animate_path, S(), **changed)
        assert rel_err(reference_animate(animate_path, other), ref) > 1e-2, changed
        assert rel_err(client1.run(other).latent, reference_animate(animate_path, other)) < SERIAL_RTOL, changed


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2, device_weights=(3, 1)),
                                      S(tensor_degree=2), S(pipefusion_degree=2, num_pipeline_patch=5),
                                      S(patch_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2_uneven", "tp2", "pp2_warmup", "displaced2"])
def test_wan_animate_exact_strategies_equal_the_reference(animate_path, client2, strategy):
    """The pose rows and face blocks split with the video's 60 tokens (Ulysses' ranks hold frames 0-2 and 2-4, Ring's
    3:1 split cuts another frame: the face attention runs by runs of one frame); tensor parallelism splits
    the face blocks by heads; PipeFusion's stages each own the face block of their main blocks (after 0 on the
    first, after 5 on the second); displaced patch's warm-up call gathers K/V like the main blocks'. Under Ulysses,
    Ring and displaced patch the two ranks split the motion encoder's 5 face frames (3 + 2) and gather the codes; run
    after CFG-2, where each rank kept only its own branch's tokens, they must agree to encode both anew (else one
    waits in the gather while the other attends: the hang this order caught)."""
    job = animate_job(animate_path, strategy)
    assert rel_err(client2.run(job).latent, reference_animate(animate_path, job)) < EXACT_RTOL


def test_wan_animate_refusals(animate_path, client1, tmp_path):
    from test_wan import TINY_WAN_I2V

    plain = write_checkpoint(str(tmp_path / "wan_i2v.safetensors"), TINY_WAN_I2V, seed=4)
    job = animate_job(plain, S())
    with pytest.raises(ConfigError, match="carries Wan Animate's pose or face video .* which this Wan 2.1 I2V "
                                          "256-wide model does not read; load a Wan 2.2 Animate model"):
        client1.run(job)
    job = animate_job(animate_path, S())
    bad = dataclasses.replace(job.positive, pose=torch.zeros(1, 16, 2, H, W + 2))
    with pytest.raises(ConfigError, match=r"pose latent has shape \(1, 16, 2, 6, 10\), not \[batch, 16, frames, 6, 8\]"):
        client1.run(dataclasses.replace(job, positive=bad))
    bad = dataclasses.replace(job.positive, face=torch.zeros(1, 3, 5, 256, 256), face_key=None)
    with pytest.raises(ConfigError, match=r"face video has shape \(1, 3, 5, 256, 256\), not \[batch, 3, frames, 512, "):
        client1.run(dataclasses.replace(job, positive=bad))
    bad = dataclasses.replace(job.positive, pose=torch.full((1, 16, T - 1, H, W), float("nan")))
    with pytest.raises(ConfigError, match=r"pose latent holds 3072 NaN/Inf value\(s\) of 3072; re-encode the pose video"):
        client1.run(dataclasses.replace(job, positive=bad))


def test_wan_animate_face_tokens_are_made_once_per_face_input(animate_path, monkeypatch):
    """The motion encoder (~45 GFLOP a 512 x 512 frame) runs once per face input and weights, not once per model
    call as in ComfyUI: a second call of the run with the same key reads the kept tokens; another key, another
    video length or other weights (a LoRA) make them anew."""
    from parallel_runtime.models.families import wan, wan_animate
    from parallel_runtime.strategies.attention.processor import AttentionContext

    config = model_config(animate_path)
    model = wan.WanTransformer(config)
    calls = []
    monkeypatch.setattr(wan_animate, "face_motion",
                        lambda m, face, frames, dtype, share=None: calls.append(frames) or torch.zeros(1, frames, 5, 256))
    adapter = wan.WanAdapter(config, model, [range(10)], AttentionContext())
    face = torch.zeros(1, 3, FACE_FRAMES, 512, 512)
    for key, frames, weights in (("a", 5, None), ("a", 5, None), ("b", 5, None), ("a", 7, None), ("a", 5, "lora")):
        adapter.weights_id = weights
        adapter.face_rows(face, key, (frames, H, W))
    assert calls == [5, 5, 7, 5]
    adapter.face_rows(face, None, (5, H, W))  # no key (a job that is not a model call's): made each time
    adapter.face_rows(face, None, (5, H, W))
    assert len(calls) == 6


def test_wan_animate_inputs_through_the_model_call_door():
    """WAN22_Animate.extra_conds' pose_latents (in the model's space) and face_pixel_values, chunk by chunk: the pose
    rides with the call, the face video is kept on the workers by the hash of its bytes (one key for the run)."""
    from nodes import remote_model

    context = torch.randn(4, 9, 64)
    pose = torch.randn(1, 16, T - 1, H, W).repeat(4, 1, 1, 1, 1)
    face = (torch.rand(1, 3, FACE_FRAMES, 512, 512) * 2 - 1).to(torch.bfloat16)
    face = torch.cat([face, face, face * 0 - 1, face * 0 - 1])
    kwargs = {"pose_latents": pose, "face_pixel_values": face}
    remote_model._refuse_what_the_workers_cannot_do(None, {}, kwargs)
    pos, neg = (remote_model._chunk_conditioning(k, 2, context, None, None, kwargs) for k in (0, 1))
    assert pos.pose.shape == (1, 16, T - 1, H, W) and torch.equal(pos.pose[0], pose[0])
    assert pos.face.shape == (1, 3, FACE_FRAMES, 512, 512) and pos.face.dtype == torch.bfloat16
    assert bool((neg.face == -1).all()) and pos.face_key != neg.face_key and pos.face_key.startswith("face-")
    assert "positive.face" not in pos.tensors("positive") and "positive.pose" in pos.tensors("positive")
    assert pos.kept_inputs() == {pos.face_key: pos.face}
    again = remote_model._chunk_conditioning(0, 2, context, None, None, kwargs)
    assert again.face_key == pos.face_key


def test_wan_animate_weights_per_rank_at_the_released_size():
    """Wan 2.2 Animate 14B (17.27 B parameters: the 2.1 I2V 14B's 16.39 B, 8 face blocks of 105 M, 41 M in the motion
    and face encoders): tensor-2 and PipeFusion-2 hold about half of it per rank, counted from the module tree. The
    encoders do not split (every rank or stage makes the motion tokens), which at the bench's width 256 is most of
    the model (its params/rank rows read 0.94 and 1.89 x total / N there: docs/bench.md)."""
    from parallel_runtime.models.families.wan import WanConfig, _meta_model
    from parallel_runtime.planning.costmodel import rank_memory

    config = WanConfig(hidden_size=5120, num_layers=40, ffn_dim=13824, in_channels=36, image_to_video=True,
                       animate=True)
    named = dict(_meta_model(config).named_parameters())
    total = sum(p.numel() for p in named.values())
    face = sum(p.numel() for n, p in named.items() if n.startswith("face_adapter."))
    encoders = sum(p.numel() for n, p in named.items() if n.startswith(("motion_encoder.", "face_encoder.")))
    assert (round(total / 1e9, 2), round(face / 1e6), round(encoders / 1e6)) == (17.27, 839, 41)

    def share(strategy):
        return rank_memory(strategy, config, text_tokens=512, image_tokens=32760, batch=1, cfg=1.0, weight_bytes=2,
                           act_bytes=2)["params"] / (2 * total)

    assert share(S(ulysses_degree=2)) == pytest.approx(1.0, abs=1e-6)
    assert share(S(tensor_degree=2)) < 0.52 and share(S(pipefusion_degree=2)) < 0.52


def test_wan_animate_one_worker_equals_diffusers(animate_path, client1):
    """The same file through diffusers' converter into WanAnimateTransformer3DModel (its own motion encoder, face
    encoder and face blocks; the pose latent and the face video as its forward takes them): the runtime at 1 worker
    equals it (fp32; diffusers orders its ops otherwise)."""
    from diffusers import WanAnimateTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    c = TINY_ANIMATE
    sd = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(animate_path).items()}
    model = WanAnimateTransformer3DModel(
        num_attention_heads=c.num_heads, attention_head_dim=128, in_channels=36, latent_channels=16, out_channels=16,
        text_dim=c.text_dim, freq_dim=c.freq_dim, ffn_dim=c.ffn_dim, num_layers=c.num_layers, image_dim=1280,
        added_kv_proj_dim=c.hidden_size)
    # diffusers builds the blur kernels ComfyUI's files store (the file's are the same [1, 3, 3, 1] filter)
    converted = {k: v for k, v in convert_wan_transformer_to_diffusers(sd).items() if not k.endswith(".kernel")}
    model.load_state_dict(converted, strict=True)
    # diffusers' face blocks group the video's tokens by the motion frames, so it runs only lengths that match: the
    # video cut to 3 latent frames, whose 5 face frames make 2 motion frames + the zero one (4 x 3 - 7 frames, as
    # WanAnimatePipeline cuts them); and its attention takes the CLIP-vision tokens as all but the last 512 of the
    # context: a 512-token prompt.
    job = animate_job(animate_path, S(), negative=False)
    prompt = torch.randn(1, 512, c.text_dim, generator=torch.Generator().manual_seed(47))
    first = dataclasses.replace(job.positive, cond=prompt, concat=job.positive.concat[:, :, :3],
                                pose=job.positive.pose[:, :, :2])
    job = dataclasses.replace(job, latent=job.latent[:, :, :3].contiguous(), positive=first)
    with torch.no_grad():
        theirs = torch.cat([model(hidden_states=torch.cat([job.latent[row:row + 1], b.concat], dim=1),
                                  timestep=job.timestep[row:row + 1], encoder_hidden_states=b.cond,
                                  encoder_hidden_states_image=b.clip_vision, pose_hidden_states=b.pose,
                                  face_pixel_values=b.face, return_dict=False)[0]
                            for row, b in enumerate((job.positive,))])
    assert rel_err(client1.run(job).latent, theirs) < SERIAL_RTOL


def test_wan_animate_face_blocks_read_the_frames_back_once_per_rows(animate_path, monkeypatch):
    """The face blocks group a rank's rows by frame, which reads the frame table back to the host (a device sync on
    a GPU): once per table the step loop holds (per job, or per patch set under PipeFusion), not once per face block
    and step; a table of other rows gets its own runs. The runs split the rows at the frame boundaries."""
    from parallel_runtime.models.families import wan, wan_animate
    from parallel_runtime.strategies.attention.processor import AttentionContext

    config = model_config(animate_path)
    torch.manual_seed(0)
    model = wan.WanTransformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    adapter = wan.WanAdapter(config, model, [range(config.num_layers)], AttentionContext())
    reads = []
    real = wan_animate.frame_runs
    monkeypatch.setattr(wan_animate, "frame_runs", lambda frames: reads.append(len(frames)) or real(frames))
    cos, sin, frames = adapter.rope(0, T, H, W)
    image, text = torch.randn(1, len(frames), 256), adapter.embed_text(torch.randn(1, 9, config.text_dim))
    temb = adapter.timestep_embedding(torch.full((1,), 500.0), torch.zeros(1, 0), None, (T, H, W),
                                      torch.randn(1, 257, 1280), face=torch.randn(1, T, 5, 256))
    with torch.no_grad():
        for _ in range(3):  # three steps of one job: 2 face blocks each
            adapter.run_blocks(image, text, temb, (cos, sin, frames))
        assert reads == [60]
        rows = slice(10, 40)  # another rank's rows: frames 0 (2 rows), 1, 2 and 3 (4 rows)
        adapter.run_blocks(image[:, rows], text, temb, (cos[rows], sin[rows], frames[rows]))
    assert reads == [60, 30]
    assert real(frames[rows]) == [(0, 0, 2), (1, 2, 12), (2, 14, 12), (3, 26, 4)]
