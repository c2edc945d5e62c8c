"""A real ComfyUI host for the integration tests: one server per test module (`serve`), on a free loopback port,
with --cpu, its own model, output, input, temp and user folders, ParaDiT and a test-only node module installed;
its whole process group (ParaDiT's workers included) is killed at the end.

COMFYUI_DIR names the ComfyUI checkout (modules that need one skip without it), COMFYUI_PYTHON the interpreter
that runs it (default: this one); on a CPU-only machine COMFYUI_CPU_SHIM (or ../shared/comfyui-cpu) goes on the
server's PYTHONPATH: it lets a CUDA-built torchvision import on CPU torch. There are no text encoder or VAE
weights: the test-only nodes make deterministic CONDITIONING from a seed and turn a latent into a small image.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
from typing import Callable, Iterator

import pytest
import torch
from safetensors.torch import load as load_safetensors

from conftest import load_queue_script
from parallel_runtime.models.families.flux import FluxConfig
from parallel_runtime.models.tiny import write_checkpoint, write_controlnet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
COMFYUI_PYTHON = os.environ.get("COMFYUI_PYTHON") or sys.executable
CPU_SHIM = os.environ.get("COMFYUI_CPU_SHIM") or os.path.join(os.path.dirname(REPO), "shared", "comfyui-cpu")
STARTUP_TIMEOUT_S = 240
PROMPT_TIMEOUT_S = 300
MODEL_FOLDERS = ("diffusion_models", "loras", "vae", "controlnet")

HELPER_NODES = '''"""Test-only nodes for ParaDiT's ComfyUI integration tests (written by the test; never shipped)."""
import torch


class ParaDiTTestConditioning:
    """Deterministic Flux-shaped CONDITIONING from a seed, in place of DualCLIPLoader + CLIPTextEncode."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "guidance": ("FLOAT", {"default": 3.5, "min": -1.0, "max": 100.0, "step": 0.1})},
                "optional": {"width": ("INT", {"default": 4096, "min": 1, "max": 8192}),
                             "pooled": ("INT", {"default": 768, "min": 0, "max": 8192}),
                             "image_width": ("INT", {"default": 0, "min": 0, "max": 8192}),
                             "image_height": ("INT", {"default": 0, "min": 0, "max": 8192}),
                             "mask_padding": ("INT", {"default": -1, "min": -1, "max": 512})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, tokens, guidance, width=4096, pooled=768, image_width=0, image_height=0, mask_padding=-1):
        """guidance < 0 sets none (the family's default applies); pooled 0 gives none (T5-only encoders);
        image_width/height > 0 attach the size as CLIPTextEncodePixArtAlpha does (its add_dict); mask_padding >= 0
        attaches the encoder's attention mask with that many padded (0) tokens at the end, as Gemma's encode does
        for Lumina 2 (ComfyUI then passes num_tokens)."""
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, tokens, width, generator=g)
        extra = {"pooled_output": torch.randn(1, pooled, generator=g) if pooled else None}
        if guidance >= 0:
            extra["guidance"] = guidance
        if image_width and image_height:
            extra.update(width=image_width, height=image_height)
        if mask_padding >= 0:
            mask = torch.ones(1, tokens, dtype=torch.long)
            mask[:, tokens - mask_padding:] = 0
            extra["attention_mask"] = mask
        return ([[cond, extra]],)


class ParaDiTTestLatentToImage:
    """A fixed 16 -> 3 channel projection, upscaled 8x: an IMAGE for Save Image without VAE weights."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "convert"
    CATEGORY = "testing"

    def convert(self, samples):
        x = samples["samples"].float()
        proj = torch.randn(3, x.shape[1], generator=torch.Generator().manual_seed(0)) / x.shape[1] ** 0.5
        rgb = torch.einsum("cl,blhw->bhwc", proj, x)
        rgb = rgb.repeat_interleave(8, dim=1).repeat_interleave(8, dim=2)
        return ((torch.tanh(rgb) * 0.5 + 0.5).clamp(0, 1),)


class ParaDiTTestLatent:
    """A seeded random LATENT (in place of VAE Encode of a reference image: no VAE weights needed)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1}),
                             "width": ("INT", {"default": 64, "min": 8, "max": 4096}),
                             "height": ("INT", {"default": 64, "min": 8, "max": 4096})},
                "optional": {"video": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, width, height, video=False):
        """video: a one-frame [1, 16, 1, h, w] latent, as a Wan VAE (Qwen-Image's) encodes an image."""
        g = torch.Generator().manual_seed(seed)
        samples = torch.randn(1, 16, height // 8, width // 8, generator=g)
        return ({"samples": samples.unsqueeze(2) if video else samples},)


class ParaDiTTestConcat:
    """What InpaintModelConditioning / InstructPixToPixConditioning put on a conditioning (concat_latent_image,
    and concat_mask for inpainting), from a seeded latent and mask instead of VAE-encoded pixels (no VAE weights
    here); ComfyUI's own model code builds c_concat from them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",), "seed": ("INT", {"default": 0, "min": 0}),
                             "width": ("INT", {"default": 128, "min": 8}), "height": ("INT", {"default": 128, "min": 8}),
                             "mask": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, conditioning, seed, width, height, mask):
        g = torch.Generator().manual_seed(seed)
        values = {"concat_latent_image": torch.randn(1, 16, height // 8, width // 8, generator=g)}
        if mask:
            # [B, 1, H, W], as InpaintModelConditioning gives it
            values["concat_mask"] = (torch.rand(1, 1, height, width, generator=g) > 0.5).float()
        return ([[c, dict(extra, **values)] for c, extra in conditioning],)


class ParaDiTTestDeepClone:
    """The copy ComfyUI's MultiGPU CFG Split (MultiGPU_WorkUnits, 2026; newer than this host) makes per extra GPU:
    ModelPatcher.deepclone_multigpu deep-copies the BaseModel."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "clone"
    CATEGORY = "testing"

    def clone(self, model):
        import copy

        copy.deepcopy(model.model)
        return (model,)


class ParaDiTTestCodePatch:
    """A block replacement that is code (it scales the block's image output), as PuLID-style nodes install."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    def patch(self, model):
        def scaled(args, extra):
            out = extra["original_block"](args)
            return {"img": out["img"] * 0.5, "txt": out["txt"]}

        m = model.clone()
        m.set_model_patch_replace(scaled, "dit", "double_block", 0)
        return (m,)


class ParaDiTTestStyleModel:
    """A STYLE_MODEL and CLIP_VISION_OUTPUT from a seed, for ComfyUI's own StyleModelApply (Redux): a seeded
    linear map from `tokens` vision tokens to the prompt's width, in place of the Redux and SigCLIP weights this
    host has none of. StyleModelApply then appends its tokens to the prompt and, with strength_type attn_bias,
    sets the conditioning's attention_mask as it does for Redux."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0}), "tokens": ("INT", {"default": 4, "min": 1}),
                             "width": ("INT", {"default": 4096, "min": 1})}}

    RETURN_TYPES = ("STYLE_MODEL", "CLIP_VISION_OUTPUT")
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, tokens, width):
        import comfy.clip_vision
        import comfy.sd

        g = torch.Generator().manual_seed(seed)
        proj = torch.nn.Linear(16, width)
        with torch.no_grad():
            proj.weight.copy_(torch.randn(width, 16, generator=g) * 0.25)
            proj.bias.zero_()
        output = comfy.clip_vision.Output()
        output["last_hidden_state"] = torch.randn(1, tokens, 16, generator=g)
        return (comfy.sd.StyleModel(proj), output)


class ParaDiTTestNaivePatch:
    """Load Parallel DiT's MODEL again, its file on the same devices split by naive patch parallelism (the
    baseline every approximate strategy is measured against, which the Strategy Selector does not offer):
    `degree` patches that attend only to themselves."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "degree": ("INT", {"default": 2, "min": 2, "max": 8})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, model, degree):
        import dataclasses
        import sys

        remote = model.model.diffusion_model
        handle = remote.handle
        naive = type(handle.strategy.spec)(naive_patch_degree=degree)
        strategy = dataclasses.replace(handle.strategy, mode="manual", spec=naive)
        return (sys.modules[type(remote).__module__].parallel_model(dataclasses.replace(handle, strategy=strategy)),)


class _SeededVideoEncoder:
    """encode(pixels [F, H, W, 3]) -> a seeded [1, C, (F - 1) // 4 + 1, H / s, W / s] latent: the Wan 2.1 VAE's shapes
    (C 16, s 8) or Wan 2.2's (C 48, s 16)."""

    def __init__(self, seed, channels):
        self.seed, self.channels = seed, channels
        self.latent_channels = channels  # Wan22FunControlToVideo reads the VAE's channels and compression

    def spacial_compression_encode(self):
        return 8 if self.channels == 16 else 16

    def encode(self, pixels):
        g = torch.Generator().manual_seed(self.seed)
        frames, height, width = pixels.shape[0], pixels.shape[1], pixels.shape[2]
        s = 8 if self.channels == 16 else 16
        return torch.randn(1, self.channels, (frames - 1) // 4 + 1, height // s, width // s, generator=g)


class _SeededImageEncoder:
    """A Flux VAE's shapes for a ControlNet that encodes its hint (InstantX): pixels [B, H, W, 3] -> a latent
    [B, 16, H / 8, W / 8], seeded by the pixels so two hints give two latents; `video`: a Wan VAE's one-frame
    [B, 16, 1, H / 8, W / 8] (Qwen-Image's)."""

    def __init__(self, video=False):
        self.video = video

    def spacial_compression_encode(self):
        return 8

    def encode(self, pixels):
        g = torch.Generator().manual_seed(int(pixels.double().sum().item() * 1000) % (2 ** 31))
        latent = torch.randn(pixels.shape[0], 16, pixels.shape[1] // 8, pixels.shape[2] // 8, generator=g)
        return latent.unsqueeze(2) if self.video else latent


class ParaDiTTestImageVAE:
    """A VAE stand-in for ControlNetApplyAdvanced's vae input (no Flux or Wan VAE weights here)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "optional": {"video": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, video=False):
        return (_SeededImageEncoder(video),)


class ParaDiTTestImageToVideoInputs:
    """A VAE whose encode gives a seeded Wan-shaped latent and a CLIP_VISION_OUTPUT of seeded CLIP ViT-H tokens
    (penultimate_hidden_states [1, 257, 1280]), for ComfyUI's own WanImageToVideo: no Wan VAE or clip_vision_h
    weights here, and the node's mask and concat logic is what the test exercises."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0})},
                "optional": {"channels": ("INT", {"default": 16, "min": 16, "max": 48, "step": 32})}}

    RETURN_TYPES = ("VAE", "CLIP_VISION_OUTPUT")
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, channels=16):
        import comfy.clip_vision

        output = comfy.clip_vision.Output()
        output["penultimate_hidden_states"] = torch.randn(1, 257, 1280, generator=torch.Generator().manual_seed(seed))
        return (_SeededVideoEncoder(seed + 1, channels), output)


class ParaDiTTestRampVideo:
    """IMAGE frames [frames, height, width, 3] in [0, 1], each another mix of a horizontal and a vertical ramp (Wan
    Animate's face video: a motion encoder tells such frames apart, where EmptyImage's frames are all alike)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"frames": ("INT", {"default": 5, "min": 1}), "width": ("INT", {"default": 64, "min": 1}),
                             "height": ("INT", {"default": 48, "min": 1})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, frames, width, height):
        s = torch.linspace(-1.0, 1.0, frames)
        x, y = torch.linspace(-1.0, 1.0, width), torch.linspace(-1.0, 1.0, height)
        mix = x[None, None, :] * s[:, None, None] + y[None, :, None] * (1 - s.abs())[:, None, None]
        return ((mix.unsqueeze(-1).expand(-1, -1, -1, 3) + 1) / 2,)


NODE_CLASS_MAPPINGS = {"ParaDiTTestRampVideo": ParaDiTTestRampVideo, "ParaDiTTestImageVAE": ParaDiTTestImageVAE, "ParaDiTTestConcat": ParaDiTTestConcat, "ParaDiTTestImageToVideoInputs": ParaDiTTestImageToVideoInputs, "ParaDiTTestStyleModel": ParaDiTTestStyleModel,
                       "ParaDiTTestDeepClone": ParaDiTTestDeepClone, "ParaDiTTestNaivePatch": ParaDiTTestNaivePatch,
                       "ParaDiTTestCodePatch": ParaDiTTestCodePatch,
                       "ParaDiTTestConditioning": ParaDiTTestConditioning,
                       "ParaDiTTestLatentToImage": ParaDiTTestLatentToImage,
                       "ParaDiTTestLatent": ParaDiTTestLatent}
'''


qw = load_queue_script()


# -- the smallest Flux files ComfyUI's detection takes ----------------------------------------------------

# 3072 wide (ComfyUI reads Flux's head count off the width), one double and one single block.
FLUX_MINI = FluxConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=1, num_single_layers=1,
                       context_dim=4096, pooled_dim=768, guidance_embeds=True)
FLUX_MINI_FILE, FLUX_CONTROLNET_FILE = "flux-mini.safetensors", "flux-controlnet-xlabs-mini.safetensors"
FLUX_UNION_CONTROLNET_FILE = "flux-controlnet-instantx-union-mini.safetensors"


def write_instantx_union_controlnet(path: str, config: FluxConfig, union_modes: int = 4, seed: int = 3) -> str:
    """An InstantX Union ControlNet as it is downloaded (diffusers' Flux names, which ComfyUI converts on load): one
    double and one single block, `controlnet_x_embedder` for the latent hint, per-block projections and the mode
    embedder. The projections get a sizeable scale, so the residuals (and the type token) show."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    channels = 4 * config.latent_channels
    net = dataclasses.replace(config, num_layers=1, num_single_layers=1, in_channels=channels, out_channels=channels)
    tensors = {k: v for k, v in load_file(write_checkpoint(path, net, seed=seed, layout="diffusers")).items()
               if not k.startswith(("norm_out.", "proj_out."))}
    g = torch.Generator().manual_seed(seed + 1)
    h = config.hidden_size
    for name, n_out, n_in, gain in (("controlnet_blocks.0", h, h, 0.5), ("controlnet_single_blocks.0", h, h, 0.5),
                                    ("controlnet_x_embedder", h, channels, 1.0)):
        tensors[f"{name}.weight"] = torch.randn(n_out, n_in, generator=g) * gain / n_in ** 0.5
        tensors[f"{name}.bias"] = torch.randn(n_out, generator=g) * 0.02
    tensors["controlnet_mode_embedder.weight"] = torch.randn(union_modes, h, generator=g)
    save_file(tensors, path)
    return path


def write_flux_mini_and_controlnet(root: str) -> None:
    """The random Flux DiT (fp32) and an XLabs-layout ControlNet of one double block for it, in the server's
    model folders (a `serve` prepare function)."""
    write_checkpoint(os.path.join(root, "models", "diffusion_models", FLUX_MINI_FILE), FLUX_MINI, seed=1,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    write_controlnet(os.path.join(root, "models", "controlnet", FLUX_CONTROLNET_FILE), FLUX_MINI, "xlabs",
                     double=1, seed=2)
    write_instantx_union_controlnet(os.path.join(root, "models", "controlnet", FLUX_UNION_CONTROLNET_FILE), FLUX_MINI)


# ---------------------------------------------------------------------------------------------------
# The server.

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    return _signal_reaches(os.killpg, pgid)


def _signal_reaches(kill, target: int) -> bool:
    """Whether `kill(target, 0)` finds a process (one owned by another user counts)."""
    try:
        kill(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Server:
    def __init__(self, root: str, port: int, proc: subprocess.Popen, log: str):
        self.root, self.port, self.proc, self.log = root, port, proc, log
        self.address = f"127.0.0.1:{port}"
        self.url = f"http://{self.address}"

    def get(self, path: str):
        return qw.http_json(self.url + path)

    def get_bytes(self, path: str) -> bytes:
        return qw.http_bytes(self.url + path)

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def run(self, graph: dict, **kw) -> dict:
        """Queue a graph over the websocket and wait for its end (see scripts/queue_workflow.py)."""
        kw.setdefault("timeout", PROMPT_TIMEOUT_S)
        result = qw.run(self.address, graph, verbose=False, **kw)
        assert result["status"] != "timeout", f"prompt did not finish in {kw['timeout']} s\n{self.log_tail()}"
        return result

    def latent(self, result: dict, node: str) -> torch.Tensor:
        assert result["status"] == "success", explain(result)
        entry = result["outputs"][node]["latents"][0]
        query = urllib.parse.urlencode({k: entry[k] for k in ("filename", "subfolder", "type")})
        return load_safetensors(self.get_bytes(f"/view?{query}"))["latent_tensor"]


def explain(result: dict) -> str:
    err = result.get("error") or {}
    return f"{result['status']}: {err.get('exception_message') or qw.format_rejection(err) if err else ''}"


def strategy(mode="manual", cfg=1, pp=1, ulysses=1, ring=1, patches=0, warmup=1, tensor=None, patch=None,
             weights=None, batch=None) -> dict:
    """A Strategy Selector node (API format); its optional inputs only where given, as a graph saved before them."""
    optional = {name: value for name, value in (("tensor_degree", tensor), ("patch_degree", patch),
                                                ("device_weights", weights), ("batch_degree", batch))
                if value is not None}
    return {"class_type": "ParaDiTStrategy",
            "inputs": {"mode": mode, "cfg_degree": cfg, "pipefusion_degree": pp, "ulysses_degree": ulysses,
                       "ring_degree": ring, "num_pipeline_patch": patches, "warmup_steps": warmup, **optional}}


def latent_parity(server: "Server", g: dict, what: str, parallel: str = "13", reference: str = "22"):
    """Run `g` and compare the latents its SaveLatent nodes `parallel` (Load Parallel DiT's chain) and `reference`
    (UNETLoader's) wrote: (rel. L2, parallel latent, reference latent), the figure printed."""
    from conftest import rel_err

    result = server.run(g)
    assert result["status"] == "success", explain(result)
    par, ref = server.latent(result, parallel), server.latent(result, reference)
    assert par.shape == ref.shape
    err = rel_err(par, ref)
    print(f"\n{what}: rel. L2 {err:.2e} vs UNETLoader")
    return err, par, ref


def with_parallel_sampler(g: dict, ksampler: str = "12", node: str = "98", save: str = "99") -> dict:
    """`g` plus Parallel Sampler (`node` -> SaveLatent `save`) with the inputs of KSampler `ksampler` (on Load
    Parallel DiT's MODEL): the two entrances on one MODEL, seed and settings."""
    assert node not in g and save not in g, f"the graph already has nodes {node} / {save}"
    g[node] = {"class_type": "ParaDiTSampler", "inputs": dict(g[ksampler]["inputs"])}
    g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [node, 0], "filename_prefix": f"ps/{save}"}}
    return g


def entrance_parity(server: "Server", g: dict, what: str, twin: str = "99", ksampler: str = "13",
                    reference: str = "22", node: str = "98") -> tuple[float, float, str]:
    """Run `g` (with_parallel_sampler applied) once: (rel. L2 of Parallel Sampler's latent against KSampler's on
    the same parallel MODEL, rel. L2 of Parallel Sampler's against UNETLoader + KSampler's, Parallel Sampler's
    summary line), the figures printed with the summary."""
    from conftest import rel_err

    result = server.run(g)
    assert result["status"] == "success", explain(result)
    par, ks, ref = (server.latent(result, n) for n in (twin, ksampler, reference))
    assert par.shape == ks.shape == ref.shape
    same_model, unet = rel_err(par, ks), rel_err(par, ref)
    summary = " ".join(result["outputs"].get(node, {}).get("text", []))
    print(f"\n{what}: Parallel Sampler vs KSampler on the same MODEL {same_model:.2e}, vs UNETLoader {unet:.2e}"
          f" [{summary}]")
    return same_model, unet, summary


def stop_group(proc: subprocess.Popen) -> None:
    """Ctrl-C the server (so its atexit hooks shut the ParaDiT workers down cleanly), then SIGTERM and
    SIGKILL its whole process group (server + workers) for whatever is left."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            if sig == signal.SIGINT:
                proc.send_signal(sig)
            else:
                os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            continue
        break
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    assert not _group_alive(pgid), f"processes of group {pgid} survived SIGKILL"


ROOT_PREFIX = "paradit-host-"  # every server root: tens of GB of model files on the machine's disk
OWNER_FILE = "owner.pid"


def _sweep_dead_roots() -> None:
    """Remove the server roots of test runs that were killed before their cleanup ran (a timeout's SIGKILL skips
    `finally`): three of them once filled the disk the CI's venv is built on. A root is dead when the pytest
    process that made it is gone; a root without an owner file is mid-setup and kept."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if not name.startswith(ROOT_PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if owner != os.getpid() and not _pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    return _signal_reaches(os.kill, pid)


def serve(prefix: str, prepare: Callable[[str], None] | None = None) -> Iterator[Server]:
    """A ComfyUI server for one test module: a temporary root with its own models (`prepare(root)` writes them
    before the start: ComfyUI lists model folders once), custom_nodes (ParaDiT and the test-only nodes), output,
    input, temp and user folders; yields when it answers, stops its whole process group after."""
    _sweep_dead_roots()
    root = tempfile.mkdtemp(prefix=ROOT_PREFIX + prefix)
    proc = None
    try:
        for d in (*(os.path.join("models", m) for m in MODEL_FOLDERS), "custom_nodes", "output", "input", "temp",
                  "user"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        if prepare is not None:
            prepare(root)
        custom = os.path.join(root, "custom_nodes")
        os.symlink(REPO, os.path.join(custom, "ParaDiT"))
        os.makedirs(os.path.join(custom, "paradit_test_helper"))
        with open(os.path.join(custom, "paradit_test_helper", "__init__.py"), "w") as f:
            f.write(HELPER_NODES)
        yaml = os.path.join(root, "extra_model_paths.yaml")
        with open(yaml, "w") as f:
            f.write(f"paradit_test:\n    base_path: {root}\n    custom_nodes: custom_nodes\n"
                    + "".join(f"    {m}: models/{m}\n" for m in MODEL_FOLDERS))
        with open(os.path.join(root, OWNER_FILE), "w") as f:  # whose root this is, for _sweep_dead_roots
            f.write(str(os.getpid()))
        proc, srv = _start(root, yaml)
        yield srv
        assert proc.poll() is None, f"ComfyUI died during the tests:\n{srv.log_tail()}"
    finally:
        if proc is not None:
            stop_group(proc)
        shutil.rmtree(root, ignore_errors=True)


def _start(root: str, yaml: str) -> tuple[subprocess.Popen, Server]:
    """ComfyUI with --cpu on a free loopback port, its folders under `root`; returns once it answers."""
    port = _free_port()
    cmd = [COMFYUI_PYTHON, os.path.join(COMFYUI_DIR, "main.py"), "--cpu", "--listen", "127.0.0.1",
           "--port", str(port), "--extra-model-paths-config", yaml,
           "--output-directory", os.path.join(root, "output"), "--input-directory", os.path.join(root, "input"),
           "--temp-directory", os.path.join(root, "temp"), "--user-directory", os.path.join(root, "user"),
           "--preview-method", "none"]
    with open(os.path.join(COMFYUI_DIR, "comfy", "cli_args.py")) as f:
        if "--database-url" in f.read():  # keep ComfyUI's own tree untouched
            cmd += ["--database-url", f"sqlite:///{os.path.join(root, 'user', 'comfyui.db')}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_SHIM, env.get("PYTHONPATH")) if p)
    env.pop("COMFYUI_DIR", None)
    log = os.path.join(root, "server.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    srv = Server(root, port, proc, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            stop_group(proc)
            pytest.fail(f"ComfyUI exited with code {proc.returncode} while starting:\n{srv.log_tail()}")
        try:
            srv.get("/system_stats")
            return proc, srv
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                stop_group(proc)
                pytest.fail(f"ComfyUI did not answer within {STARTUP_TIMEOUT_S} s:\n{srv.log_tail()}")
            time.sleep(0.5)
