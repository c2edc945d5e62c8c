"""Wan's VideoX-Fun variants on the workers, as ComfyUI loads and calls them: Fun control (WanFunControlToVideo's
32 concat channels; Wan22FunControlToVideo's 36 with the mask between the control and start latents, and its
ref_conv), Fun inpaint (WanFunInpaintToVideo: the image-to-video shape with start and end frames) and Fun camera
(WanCameraImageToVideo's concat plus WanCameraEmbedding's Plücker embedding through the control adapter).

The reference is tests/test_wan.py's model call written from ComfyUI's WanModel / CameraWanModel (its WanCamAdapter
included), on the file's raw tensors; the real-host comparison is tests/test_comfyui_wan_fun.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.sampling import WAN21_LATENT
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config
from test_wan import EXACT_RTOL, SERIAL_RTOL, TINY_WAN, H, T, W, call_job, reference_call

pytestmark = pytest.mark.timeout(600)

# 2.1 Fun control: latent 16 + control latent 16 + start latent 16, CLIP vision (WAN21_FunControl2V, in_dim 48).
FUN_CONTROL_21 = dataclasses.replace(TINY_WAN, in_channels=48, image_to_video=True)
# 2.2 Fun control: latent 16 + [control 16, mask 4, start 16] (concat_mask_index 16), and a reference-image conv.
FUN_CONTROL_22 = dataclasses.replace(TINY_WAN, in_channels=52, reference_channels=16)
# 2.2 Fun inpaint: the 2.2 image-to-video shape (in_dim 36, no CLIP vision).
FUN_INP_22 = dataclasses.replace(TINY_WAN, in_channels=36)
# Fun camera: 2.1 (in_dim 32: the start latent alone, CLIP vision; WAN21_Camera) and 2.2 (in_dim 36; WAN22_Camera),
# each with WanCamAdapter over 24 Plücker channels.
CAMERA_21 = dataclasses.replace(TINY_WAN, in_channels=32, image_to_video=True, camera_channels=24)
CAMERA_22 = dataclasses.replace(TINY_WAN, in_channels=36, camera_channels=24)
# 2.2 5B Fun files on the 48-channel latent: inpaint 48 + [mask 4, start + end 48]; control 48 + [control 48, mask 4,
# start 48] and a 48-channel ref_conv (Wan22FunControlToVideo on the Wan 2.2 VAE).
FUN_INP_5B = dataclasses.replace(TINY_WAN, in_channels=100, out_channels=48)
FUN_CONTROL_5B = dataclasses.replace(TINY_WAN, in_channels=148, out_channels=48, reference_channels=48)
FILES = {"control21": FUN_CONTROL_21, "control22": FUN_CONTROL_22, "inp22": FUN_INP_22, "camera21": CAMERA_21,
         "camera22": CAMERA_22, "inp5b": FUN_INP_5B, "control5b": FUN_CONTROL_5B}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-fun")
    return {name: write_checkpoint(str(root / f"wan_fun_{name}_tiny.safetensors"), config, seed=20 + k,
                                   prefix="model.diffusion_model.")
            for k, (name, config) in enumerate(FILES.items())}


def fun_job(path: str, name: str, strategy: S, camera: bool = True, reference: bool = False):
    """Both branches with the concat their node builds (ComfyUI's concat_cond on it) and, for a camera file, one
    WanCameraEmbedding [1, 24, T, 8H, 8W]; 2.1 files also CLIP-vision tokens; `reference`: Wan22FunControlToVideo's
    ref_image latent [1, 16, H, W] (raw, as ReferenceLatent carries it)."""
    job = call_job(path, strategy)
    g = torch.Generator().manual_seed(30)
    c = FILES[name].out_channels
    latent = [torch.randn(1, c, T, H, W, generator=g) for _ in range(2)]
    ends = torch.zeros(1, 4, T, H, W).index_fill_(2, torch.tensor([0, T - 1]), 1.0)  # start and end frames known
    concat = {"control21": lambda: torch.cat(latent, 1),  # control latent, start latent; no mask
              "control22": lambda: torch.cat([latent[0], ends[:, :, :], latent[1]], 1),  # mask at index 16
              "inp22": lambda: torch.cat([ends, latent[0]], 1),  # WanFunInpaintToVideo: mask, start + end frames
              "camera21": lambda: latent[0],
              "camera22": lambda: torch.cat([ends, latent[0]], 1),
              "inp5b": lambda: torch.cat([ends, latent[0]], 1),
              "control5b": lambda: torch.cat([latent[0], ends, latent[1]], 1)}[name]()
    clip = torch.randn(1, 257, 1280, generator=g) if FILES[name].image_to_video else None
    cam = torch.randn(1, 24, T, 8 * H, 8 * W, generator=g) if camera and FILES[name].camera_channels else None
    refs = (torch.randn(1, c, H, W, generator=g),) if reference else ()
    pos, neg = (dataclasses.replace(b, concat=concat, clip_vision=clip, camera=cam, references=refs)
                for b in (job.positive, job.negative))
    x = job.latent if c == 16 else torch.randn(2, c, T, H, W, generator=g)
    return dataclasses.replace(job, positive=pos, negative=neg, latent=x)


def test_wan_fun_files_are_detected(paths):
    """Each variant's shape, title, the node that makes its concat and its adapters; the 5B (48-channel) Fun shapes
    by config (their concat: 48 + 4 for inpaint, 2 x 48 + 4 for control)."""
    got = {name: model_config(path) for name, path in paths.items()}
    assert {n: (c.title, c.concat_channels, c.camera_channels, c.reference_channels) for n, c in got.items()} == {
        "control21": ("Wan 2.1 Fun Control 256-wide", 32, 0, 0),
        "control22": ("Wan 2.2 Fun Control 256-wide", 36, 0, 16),
        "inp22": ("Wan 2.2 I2V 256-wide", 20, 0, 0),
        "camera21": ("Wan 2.1 Fun Camera 256-wide", 16, 24, 0),
        "camera22": ("Wan 2.2 Fun Camera 256-wide", 20, 24, 0),
        "inp5b": ("Wan 2.2 Fun InP 256-wide", 52, 0, 0),
        "control5b": ("Wan 2.2 Fun Control 256-wide", 100, 0, 48)}
    assert [got[n].concat_nodes for n in ("control21", "control22", "camera22")] == [
        "WanFunControlToVideo", "Wan22FunControlToVideo", "WanCameraImageToVideo"]
    five = dataclasses.replace(TINY_WAN, hidden_size=3072, out_channels=48)
    assert dataclasses.replace(five, in_channels=100).title == "Wan 2.2 Fun InP 5B"
    assert dataclasses.replace(five, in_channels=148).title == "Wan 2.2 Fun Control 5B"


def test_wan_fun_one_worker_equals_comfyui_model_call(paths, client1):
    """Every variant at 1 worker against the model call written from ComfyUI's source; a camera file without a camera
    embedding runs without its adapter, as CameraWanModel does."""
    cases = [(name, True, False) for name in FILES] + [("camera22", False, False), ("control22", False, True),
                                                        ("control5b", True, True)]
    for name, camera, reference in cases:
        job = fun_job(paths[name], name, S(), camera, reference)
        out = client1.run(job).latent
        assert out.shape == (2, FILES[name].out_channels, T, H, W)
        assert rel_err(out, reference_call(paths[name], job, FILES[name])) < SERIAL_RTOL, (name, camera, reference)
    # The camera embedding and the reference image matter (so the parity above tests the adapter and ref_conv).
    for name, on, off in (("camera22", dict(camera=True), dict(camera=False)),
                          ("control22", dict(reference=True), dict(reference=False))):
        with_it, without = (client1.run(fun_job(paths[name], name, S(), **kw)).latent for kw in (on, off))
        assert rel_err(with_it, without) > 1e-2, name


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2, device_weights=(3, 1)),
                                      S(pipefusion_degree=2, num_pipeline_patch=5), S(tensor_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2_uneven", "pp2_warmup", "tp2"])
def test_wan_fun_camera_and_control_exact_strategies(paths, client2, strategy):
    """The camera embedding splits with the tokens: 60 tokens in 2 shards cut frame 2 (12 tokens a frame), so both
    ranks run the adapter on that frame and each keeps its rows (a 3:1 Ring split cuts frame 3); PipeFusion's patches
    are whole frames; tensor parallel holds the adapter and ref_conv whole on each rank. The 2.1
    camera file adds CLIP vision, the 2.2 control file the 36 channels with the mask inside and its reference image
    (12 ref_conv tokens after the 60 video tokens, split among the ranks like them)."""
    for name, reference in (("camera21", False), ("camera22", False), ("control22", True), ("control5b", True)):
        job = fun_job(paths[name], name, strategy, reference=reference)
        assert rel_err(client2.run(job).latent, reference_call(paths[name], job, FILES[name])) < EXACT_RTOL, name


def test_wan_camera_embedding_crosses_the_channel_once_per_run(paths, client2):
    """A model call's camera embedding under its key: the next call names the key only (no tensor) and the workers
    use the embedding they kept, bit for bit (Ulysses-2: each rank its frames of it)."""
    job = fun_job(paths["camera22"], "camera22", S(ulysses_degree=2))
    camera = job.positive.camera
    keyed = dataclasses.replace(job, **{b: dataclasses.replace(getattr(job, b), camera_key="camera-test-1")
                                        for b in ("positive", "negative")})
    first = client2.run(keyed).latent
    bare = dataclasses.replace(keyed, **{b: dataclasses.replace(getattr(keyed, b), camera=None)
                                         for b in ("positive", "negative")})
    assert torch.equal(client2.run(bare).latent, first)
    assert rel_err(first, reference_call(paths["camera22"], job, CAMERA_22)) < EXACT_RTOL
    assert camera is not None


def test_wan_camera_adapter_runs_on_the_frames_of_the_rank_tokens():
    """embed_camera for tokens 30..59 of a 5 x 3 x 4 grid (frames 2, 3, 4) runs the adapter on those three frames
    only and gives the rows the whole adapter gives them."""
    from parallel_runtime.models.families.wan import WanAdapter, WanTransformer

    torch.manual_seed(0)
    model = WanTransformer(CAMERA_22)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    adapter = WanAdapter(CAMERA_22, model, [range(2)], None)
    camera = torch.randn(1, 24, T, 8 * H, 8 * W)
    seen = []
    model.control_adapter.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[2]))
    index = torch.arange(30, 60)
    with torch.no_grad():
        part = adapter.embed_camera(camera, index, (T, H, W))
        whole = adapter.embed_camera(camera, torch.arange(60), (T, H, W))
    assert seen == [3, T]
    assert rel_err(part, whole[:, 30:]) < 1e-6  # the same convolutions on fewer frames (fp32 round-off)


def test_wan_fun_refusals(paths, client1):
    control = fun_job(paths["control21"], "control21", S())
    bare = dataclasses.replace(control.positive, concat=None)
    with pytest.raises(ConfigError, match="reads 32 image channels .* feed it through WanFunControlToVideo"):
        client1.run(dataclasses.replace(control, positive=bare))
    camera = fun_job(paths["camera22"], "camera22", S())
    wrong = dataclasses.replace(camera.positive, camera=camera.positive.camera[:, :, :, :, :8 * W - 8])
    with pytest.raises(ConfigError, match=r"camera embedding has shape \(1, 24, 5, 48, 56\) .* set "
                                          r"WanCameraEmbedding's width, height and length to those of "
                                          r"WanCameraImageToVideo"):
        client1.run(dataclasses.replace(camera, positive=wrong))
    elsewhere = dataclasses.replace(control.positive, camera=camera.positive.camera)
    with pytest.raises(ConfigError, match="camera embedding .* which this Wan 2.1 Fun Control 256-wide model does not "
                                          "read; load a Wan Fun camera model"):
        client1.run(dataclasses.replace(control, positive=elsewhere))
    with_ref = dataclasses.replace(control.positive, references=(torch.randn(1, 16, H, W),))
    with pytest.raises(ConfigError, match=r"Wan 2.1 Fun Control 256-wide model has no ref_conv to read it "
                                          r"\(Wan22FunControlToVideo's ref_image\); disconnect ref_image"):
        client1.run(dataclasses.replace(control, positive=with_ref))
    ref = fun_job(paths["control22"], "control22", S(), reference=True)
    two = dataclasses.replace(ref.positive, references=ref.positive.references * 2)
    with pytest.raises(ConfigError, match="reads one reference image .* not 2; remove the extra ReferenceLatent"):
        client1.run(dataclasses.replace(ref, positive=two))
    small = dataclasses.replace(ref.positive, references=(torch.randn(1, 16, H, W - 2),))
    with pytest.raises(ConfigError, match=r"reference latent is \(6, 6\) but the video's latent \(6, 8\)"):
        client1.run(dataclasses.replace(ref, positive=small))


def test_wan_camera_conditions_through_the_model_call_door():
    """Load Parallel DiT's MODEL: a call's camera_conditions become each chunk's camera (one row where the node's
    single embedding was repeated over the batch), in the call's dtype; Wan22FunControlToVideo's reference latent is
    read as the chunk's reference (raw again: process_out of ComfyUI's process_in)."""
    from nodes import remote_model

    context = torch.randn(4, 9, 64)
    camera = torch.randn(1, 24, T, 8 * H, 8 * W, dtype=torch.bfloat16).repeat(4, 1, 1, 1, 1)
    chunk = remote_model._chunk_conditioning(1, 2, context, None, None, {"camera_conditions": camera})
    assert chunk.camera.shape == (1, 24, T, 8 * H, 8 * W) and chunk.camera.dtype == torch.bfloat16
    assert torch.equal(chunk.camera[0], camera[2])
    # Kept on the workers by the hash of its bytes: both chunks of the call (and every call of the run) name one key.
    first = remote_model._chunk_conditioning(0, 2, context, None, None, {"camera_conditions": camera})
    assert first.camera_key == chunk.camera_key and chunk.camera_key.startswith("camera-")
    assert "positive.camera" not in chunk.tensors("positive")
    assert chunk.kept_inputs() == {chunk.camera_key: chunk.camera}
    ref = torch.randn(1, 16, H, W)
    processed = WAN21_LATENT.process_in(ref).repeat(4, 1, 1, 1)
    remote_model._refuse_what_the_workers_cannot_do(None, {}, {"camera_conditions": camera,
                                                               "reference_latent": processed})
    chunk = remote_model._chunk_conditioning(1, 2, context, None, None, {"reference_latent": processed},
                                             latent_format=FakeWan21())
    assert len(chunk.references) == 1 and rel_err(chunk.references[0], ref) < 1e-6  # one fp32 round trip


class FakeWan21:
    """ComfyUI's latent_formats.Wan21.process_out, whose statistics are shaped [1, 16, 1, 1, 1] for a video latent
    (a frameless [B, 16, H, W] would broadcast into a wrong 5-D tensor)."""

    def process_out(self, latent):
        mean, std = (torch.tensor(v).view(1, 16, 1, 1, 1) for v in (WAN21_LATENT.mean, WAN21_LATENT.std))
        return latent * std + mean
