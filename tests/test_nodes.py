"""Unit tests of the ComfyUI nodes, run without ComfyUI.

A small stand-in for `comfy_api.latest` records what the nodes declare; the runtime (client, auto,
devices) and ComfyUI's services (progress bar, interrupt, PromptServer) are fakes.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---------------------------------------------------------------------------------------------
# A recording stand-in for comfy_api.latest (only what the nodes use).

def _make_fake_comfy_api():
    io = types.ModuleType("comfy_api.latest.io")

    class _In:
        io_type = None

        def __init__(self, id, **kw):
            self.id, self.kw = id, kw
            self.optional = kw.get("optional", False)

    class _Out:
        io_type = None

        def __init__(self, id=None, **kw):
            self.id, self.kw = id, kw

    def _type(name):
        t = type(name, (), {})
        t.io_type = name
        t.Input = type("Input", (_In,), {"io_type": name})
        t.Output = type("Output", (_Out,), {"io_type": name})
        return t

    for cls, name in [("Int", "INT"), ("Float", "FLOAT"), ("String", "STRING"), ("Combo", "COMBO"),
                      ("Conditioning", "CONDITIONING"), ("Latent", "LATENT"), ("Model", "MODEL"), ("Vae", "VAE"),
                      ("Image", "IMAGE")]:
        setattr(io, cls, _type(name))
    io.Custom = _type

    class Hidden:
        unique_id = "UNIQUE_ID"

    @dataclass
    class Schema:
        node_id: str
        display_name: str = None
        category: str = "sd"
        inputs: list = None
        outputs: list = None
        hidden: list = None
        description: str = ""

    class ComfyNode:
        hidden = None

    class NodeOutput:
        def __init__(self, *args, ui=None):
            self.args, self.ui = args, ui

    io.Hidden, io.Schema, io.ComfyNode, io.NodeOutput = Hidden, Schema, ComfyNode, NodeOutput

    ui = types.ModuleType("comfy_api.latest.ui")

    class PreviewText:
        def __init__(self, value):
            self.value = value

    ui.PreviewText = PreviewText

    latest = types.ModuleType("comfy_api.latest")

    class ComfyExtension:
        pass

    latest.io, latest.ui, latest.ComfyExtension = io, ui, ComfyExtension
    pkg = types.ModuleType("comfy_api")
    pkg.latest = latest
    return pkg, latest


if "comfy_api" not in sys.modules:
    sys.modules["comfy_api"], sys.modules["comfy_api.latest"] = _make_fake_comfy_api()

from nodes import convert  # noqa: E402
from nodes.loader import ParaDiTLoader  # noqa: E402
from nodes.sampler import ParaDiTSampler  # noqa: E402
from nodes import host as host_mod  # noqa: E402
from nodes import sampler as sampler_mod  # noqa: E402
from nodes.strategy import ParaDiTStrategy  # noqa: E402
from parallel_runtime.errors import Cancelled, ConfigError, OutOfMemory  # noqa: E402
from parallel_runtime.spec import StrategySpec  # noqa: E402

KSAMPLER_INPUTS = ["model", "seed", "steps", "cfg", "sampler_name", "scheduler", "positive", "negative",
                   "latent_image", "denoise"]


def schema_inputs(node):
    schema = node.define_schema()
    return {i.id: (i.io_type, i.kw) for i in schema.inputs}, schema


# ---------------------------------------------------------------------------------------------
# Fakes for ComfyUI services and the runtime.

@pytest.fixture
def folder_paths(monkeypatch, tmp_path):
    """ComfyUI's folder_paths over one models folder holding a GGUF file in a subfolder (which ComfyUI's own
    diffusion_models list leaves out: its extensions are the PyTorch ones)."""
    mod = types.ModuleType("folder_paths")
    mod.asked = []
    (tmp_path / "Q8").mkdir()
    (tmp_path / "Q8" / "flux1-dev-Q8_0.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")

    def get_folder_paths(folder):
        assert folder == "diffusion_models"
        return [str(tmp_path), str(tmp_path / "missing")]

    def recursive_search(folder, excluded_dir_names=None):  # as ComfyUI's: files and {directory: mtime}
        mod.walks.append(folder)
        walked = list(os.walk(folder))
        files = [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in walked for f in fs]
        return files, {d: os.path.getmtime(d) for d, _, _ in walked}

    def filter_files_extensions(files, extensions):
        return sorted(f for f in files if os.path.splitext(f)[1].lower() in extensions)

    mod.get_folder_paths, mod.recursive_search, mod.walks = get_folder_paths, recursive_search, []
    mod.filter_files_extensions = filter_files_extensions

    def get_filename_list(folder):
        assert folder == "diffusion_models"
        return ["flux1-dev.safetensors", "tiny.safetensors"]

    def get_full_path_or_raise(folder, name):
        mod.asked.append((folder, name))
        if name not in get_filename_list(folder):
            raise FileNotFoundError(f"Model in folder '{folder}' with filename '{name}' not found.")
        return f"/models/{folder}/{name}"

    mod.get_filename_list, mod.get_full_path_or_raise = get_filename_list, get_full_path_or_raise
    monkeypatch.setitem(sys.modules, "folder_paths", mod)
    return mod


class FakeClient:
    def __init__(self, devices, behaviour=None):
        self.devices, self.behaviour, self.jobs, self.status_calls = devices, behaviour, [], 0
        self.notice = None

    def memory_budget(self):
        return 8 * 2**30

    def status(self):
        self.status_calls += 1
        return {"devices": ["cpu", "cpu"], "strategy": "ulysses2", "sec_per_step": 0.5,
                "workers": [{"rank": r, "device": "cpu", "alive": True, "rss_bytes": 2 ** 30, "device_bytes": 0}
                            for r in range(2)]}

    def sample(self, job, progress=None, interrupted=None):
        self.jobs.append(job)
        steps = job.sampling.steps
        for s in range(1, steps + 1):
            if self.behaviour == "cancel" and interrupted():
                raise Cancelled("Cancelled by the user.")
            if self.behaviour == "oom" and s == 2:
                raise OutOfMemory("Worker 1 ran out of memory; use more devices or a smaller image.")
            progress(s, steps, {"phase": "sampling"})
        return job.latent * 0.5


class FakeRuntime:
    def __init__(self, behaviour=None):
        self.behaviour = behaviour
        self.clients = {}
        self.chosen = []

    def get_client(self, devices, p2p="auto"):
        self.p2p = getattr(self, "p2p", []) + [p2p]
        return self.clients.setdefault(devices, FakeClient(devices, self.behaviour))

    def choose_strategy(self, model_path, latent_shape, cfg, devices, memory_budget_bytes=None):
        self.chosen.append((model_path, latent_shape, cfg, devices))
        self.budgets = getattr(self, "budgets", []) + [memory_budget_bytes]
        return StrategySpec(ulysses_degree=2), "2 workers; 24 heads split evenly, so Ulysses"

    @staticmethod
    def parse_devices(devices):
        if devices.startswith("cpu:"):
            return ["cpu"] * int(devices[4:])
        if devices == "auto":
            return ["cuda:0", "cuda:1"]
        if devices == "bad":
            raise ConfigError("devices 'bad' is not auto, a list like 0,1 or cpu:N; fix the devices field.")
        return [f"cuda:{i}" for i in devices.split(",")]

    @staticmethod
    def runtime_devices(devices):
        return FakeRuntime.parse_devices(devices), None


@pytest.fixture
def runtime(monkeypatch):
    rt = FakeRuntime()
    for name, attrs in {"parallel_runtime.runtime.client": {"get_client": rt.get_client},
                        "parallel_runtime.planning.auto": {"choose_strategy": rt.choose_strategy},
                        "parallel_runtime.distributed.devices": {"parse_devices": rt.parse_devices,
                                                                 "runtime_devices": rt.runtime_devices}}.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    return rt


class Interrupt(Exception):
    pass


class FakeBar:
    raise_at = None  # ComfyUI's bar raises its interrupt from update_absolute when the user cancels

    def __init__(self, total, node_id):
        self.total, self.node_id, self.updates = total, node_id, []

    def update_absolute(self, value, total=None):
        if value == self.raise_at:
            raise Interrupt()
        self.updates.append((value, total))


@dataclass
class FakeHost:
    cancel: bool = False
    events: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    freed: list = field(default_factory=list)
    bars: list = field(default_factory=list)

    def free_memory_for(self, devices):
        self.freed.append(devices)

    def progress_bar(self, total, node_id):
        self.bars.append(FakeBar(total, node_id))
        return self.bars[-1]

    def interrupted(self):
        return self.cancel

    def interrupt(self):
        return Interrupt()

    def is_interrupt(self, exc):
        return isinstance(exc, Interrupt)

    def send(self, payload):
        json.dumps(payload)  # what PromptServer will do with it
        self.events.append(payload)

    def send_text(self, text, node_id):
        self.texts.append((node_id, text))


def cond(pooled=True, **extra):
    d = dict(extra)
    if pooled:
        d["pooled_output"] = torch.randn(1, 768)
    return [[torch.randn(1, 8, 4096), d]]


def latent(channels=16, **extra):
    return {"samples": torch.randn(1, channels, 16, 16), **extra}


def handle(strategy=None, devices="cpu:2"):
    return convert.model_handle("/models/diffusion_models/tiny.safetensors", "bf16", devices, strategy, name="tiny")


# ---------------------------------------------------------------------------------------------
# Schemas: the public contract.

def test_strategy_schema():
    inputs, schema = schema_inputs(ParaDiTStrategy)
    assert (schema.node_id, schema.display_name) == ("ParaDiTStrategy", "Strategy Selector")
    assert list(inputs) == ["mode", "cfg_degree", "pipefusion_degree", "ulysses_degree", "ring_degree",
                            "num_pipeline_patch", "warmup_steps", "tensor_degree", "patch_degree", "device_weights",
                            "shard_weights", "p2p", "batch_degree", "cache", "cache_threshold", "cache_start",
                            "cache_end"]
    # The newer inputs are optional, and come last: graphs saved before them still queue with their values in place.
    assert all(inputs[name][1]["optional"] is True for name in ("tensor_degree", "patch_degree", "device_weights",
                                                                "shard_weights", "p2p", "batch_degree", "cache",
                                                                "cache_threshold", "cache_start", "cache_end"))
    assert (inputs["batch_degree"][1]["min"], inputs["batch_degree"][1]["max"], inputs["batch_degree"][1]["default"]) \
        == (1, 8, 1)
    assert inputs["cache"][1]["options"] == ["off", "first_block"] and inputs["cache"][1]["default"] == "off"
    assert inputs["shard_weights"][1]["options"] == ["auto", "on", "off"]
    assert inputs["shard_weights"][1]["default"] == "auto"
    assert inputs["p2p"][1]["options"] == ["auto", "off"] and inputs["p2p"][1]["default"] == "auto"
    assert inputs["mode"] == ("COMBO", {**inputs["mode"][1], "options": ["auto", "manual"]})
    assert (inputs["cfg_degree"][1]["min"], inputs["cfg_degree"][1]["max"]) == (1, 2)
    for name in ("pipefusion_degree", "ulysses_degree", "ring_degree"):
        assert inputs[name][0] == "INT" and (inputs[name][1]["min"], inputs[name][1]["max"]) == (1, 8)
    assert inputs["num_pipeline_patch"][1]["default"] == 0 and inputs["num_pipeline_patch"][1]["min"] == 0
    assert inputs["warmup_steps"][1]["default"] == 1
    assert [o.io_type for o in schema.outputs] == ["PARADIT_STRATEGY"]
    assert "UNIQUE_ID" in schema.hidden


def test_loader_schema(folder_paths):
    inputs, schema = schema_inputs(ParaDiTLoader)
    assert (schema.node_id, schema.display_name) == ("ParaDiTLoader", "Load Parallel DiT")
    # quantized_matmul comes last: saved workflows' widget values keep their positions and it takes its default
    assert list(inputs) == ["unet_name", "weight_dtype", "devices", "strategy", "quantized_matmul"]
    assert inputs["unet_name"][1]["options"] == ["Q8/flux1-dev-Q8_0.gguf", "flux1-dev.safetensors", "tiny.safetensors"]
    assert inputs["weight_dtype"][1]["options"] == ["default", "bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2"]
    assert inputs["devices"] == ("STRING", {**inputs["devices"][1], "default": "auto"})
    assert inputs["strategy"][0] == "PARADIT_STRATEGY" and inputs["strategy"][1]["optional"] is True
    assert inputs["quantized_matmul"][1]["options"] == ["auto", "dequantize", "kernel"]
    assert inputs["quantized_matmul"][1]["default"] == "auto" and inputs["quantized_matmul"][1]["optional"] is True
    assert all(not inputs[k][1].get("optional") for k in ("unet_name", "weight_dtype", "devices"))
    assert [o.io_type for o in schema.outputs] == ["MODEL"]  # ComfyUI's own: KSampler takes it


def test_loader_lists_gguf_files_walking_a_folder_only_when_it_changed(folder_paths, tmp_path):
    from nodes.loader import model_files

    first = model_files()
    walks = len(folder_paths.walks)
    assert model_files() == first and len(folder_paths.walks) == walks  # nothing changed: no walk
    (tmp_path / "Q8" / "flux1-dev-Q4_K_S.gguf").write_bytes(b"")
    os.utime(tmp_path / "Q8", (1, 1))  # a new file moves its directory's mtime (set apart from the first walk's)
    assert "Q8/flux1-dev-Q4_K_S.gguf" in model_files() and len(folder_paths.walks) == walks + 1


def test_loader_hands_quantized_matmul_to_the_workers_and_refuses_an_unknown_one():
    path = "/models/diffusion_models/tiny.safetensors"
    assert convert.model_handle(path, "default", "cpu:2", None).model.quantized_matmul == "auto"
    chosen = convert.model_handle(path, "default", "cpu:2", None, quantized_matmul="dequantize")
    assert chosen.model.quantized_matmul == "dequantize"
    with pytest.raises(ConfigError, match="Unknown quantized_matmul 'fast'; choose one of auto, dequantize, kernel"):
        convert.model_handle(path, "default", "cpu:2", None, quantized_matmul="fast")


def test_sampler_schema_matches_ksampler():
    inputs, schema = schema_inputs(ParaDiTSampler)
    assert (schema.node_id, schema.display_name) == ("ParaDiTSampler", "Parallel Sampler")
    assert list(inputs) == KSAMPLER_INPUTS
    assert inputs["model"][0] == "MODEL"
    assert inputs["positive"][0] == inputs["negative"][0] == "CONDITIONING"
    assert inputs["latent_image"][0] == "LATENT"
    assert inputs["seed"][1]["max"] == 0xFFFFFFFFFFFFFFFF and inputs["seed"][1]["control_after_generate"]
    assert set(convert.DEFAULT_SAMPLERS) <= set(inputs["sampler_name"][1]["options"])
    assert inputs["sampler_name"][1]["options"] == list(convert.sampler_names())
    assert inputs["scheduler"][1]["options"] == list(convert.scheduler_names())
    assert inputs["denoise"][1]["default"] == 1.0
    assert [o.io_type for o in schema.outputs] == ["LATENT"]


def test_sampler_names_fall_back_without_runtime_samplers(monkeypatch):
    monkeypatch.setitem(sys.modules, "parallel_runtime.sampling", types.ModuleType("parallel_runtime.sampling"))
    assert convert.sampler_names() == ("euler", "euler_ancestral", "dpmpp_2m")
    assert convert.scheduler_names() == ("simple", "normal", "beta", "sgm_uniform")
    fake = types.ModuleType("parallel_runtime.sampling")
    fake.SAMPLERS = ["euler", "heun"]
    monkeypatch.setitem(sys.modules, "parallel_runtime.sampling", fake)
    assert convert.sampler_names() == ("euler", "heun")


# ---------------------------------------------------------------------------------------------
# Strategy.

def test_strategy_node_manual_and_auto(monkeypatch):
    host = FakeHost()
    monkeypatch.setattr(host_mod, "HOST", host)
    node = type("Clone", (ParaDiTStrategy,), {"hidden": types.SimpleNamespace(unique_id="7")})
    out = node.execute("manual", 2, 1, 2, 1, 0, 1)
    choice = out.args[0]
    assert choice.mode == "manual" and choice.node_id == "7"
    # shard_weights 'auto' (the Selector's default): the client shards only a plan that does not fit unsharded
    assert choice.spec == StrategySpec(cfg_degree=2, ulysses_degree=2, shard_weights="auto")
    assert "cfg2xulysses2" in out.ui.value and host.texts == [("7", out.ui.value)]
    auto = node.execute("auto", 2, 2, 2, 2, 4, 3).args[0]
    assert auto.mode == "auto" and auto.spec == StrategySpec(num_pipeline_patch=4, warmup_steps=3, shard_weights="auto")


def test_strategy_choice_rejects_out_of_range():
    with pytest.raises(ConfigError, match="cfg_degree must be an integer from 1 to 2"):
        convert.strategy_choice("manual", cfg_degree=3)
    with pytest.raises(ConfigError, match="Unknown strategy mode"):
        convert.strategy_choice("fast")


def test_device_weights_on_the_strategy_selector():
    # Relative speeds split in proportion (manual and auto), 'measured' times the devices at sample time, and a
    # typo is one sentence before anything runs.
    manual = convert.strategy_choice("manual", ring_degree=2, device_weights="3, 2")
    assert manual.spec == StrategySpec(ring_degree=2, device_weights=(3.0, 2.0), shard_weights="auto") and not manual.measured
    measured = convert.strategy_choice("manual", ulysses_degree=2, device_weights="measured")
    assert measured.measured and measured.spec.device_weights == ()  # timed at sample time (test_entrance)
    assert "shares 60%, 40%" in convert.strategy_text(manual.spec, "manual", "manual")
    tp = convert.strategy_choice("manual", tensor_degree=2, patch_degree=1)
    assert tp.spec == StrategySpec(tensor_degree=2, shard_weights="auto")
    with pytest.raises(ConfigError, match="device_weights '3;2' is not understood"):
        convert.strategy_choice("manual", device_weights="3;2")
    with pytest.raises(ConfigError, match="device_weights '1,-2' is not understood"):
        convert.strategy_choice("manual", device_weights="1,-2")


# ---------------------------------------------------------------------------------------------
# Loader.

def test_loader_resolves_only_through_folder_paths(folder_paths, runtime, monkeypatch):
    from nodes import remote_model

    # The MODEL itself needs ComfyUI (tests/test_comfyui_integration.py builds real ones); here it wraps the handle.
    monkeypatch.setattr(remote_model, "parallel_model", lambda h: types.SimpleNamespace(handle=h))
    strat = convert.strategy_choice("manual", ulysses_degree=2)
    out = ParaDiTLoader.execute("tiny.safetensors", "fp16", " cpu:2 ", strat)
    h = out.args[0].handle
    assert folder_paths.asked == [("diffusion_models", "tiny.safetensors")]
    assert h.model.path == "/models/diffusion_models/tiny.safetensors" and h.model.weight_dtype == "fp16"
    assert h.devices == "cpu:2" and h.strategy is strat
    assert runtime.clients == {}  # no workers at load time
    assert ParaDiTLoader.execute("tiny.safetensors", "default", "auto").args[0].handle.strategy.mode == "auto"
    with pytest.raises(FileNotFoundError):
        ParaDiTLoader.execute("../../etc/passwd", "default", "auto")
    with pytest.raises(ConfigError, match="fix the devices field"):
        ParaDiTLoader.execute("tiny.safetensors", "default", "bad")



def test_loader_refuses_several_gpus_without_nccl_before_a_prompt_starts(folder_paths, monkeypatch):
    """Two visible GPUs and a torch without NCCL, as Windows' builds (only the probes are faked): '0,1' is refused
    by the loader in the runtime's sentence; 'auto' shows the one GPU the runtime will take, and why."""
    import torch
    import torch.distributed as dist

    from nodes import remote_model
    from parallel_runtime.distributed.devices import NO_NCCL

    monkeypatch.setattr(remote_model, "parallel_model", lambda h: types.SimpleNamespace(handle=h))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        ParaDiTLoader.execute("tiny.safetensors", "default", "0,1")
    assert str(info.value) == f"devices '0,1' names 2 GPUs, but {NO_NCCL}."
    shown = ParaDiTLoader.execute("tiny.safetensors", "default", "auto").ui.value
    assert shown == f"tiny.safetensors (default) on cuda:0; auto: degrees are chosen at sample time\n" \
                    f"devices=auto runs on cuda:0 alone: {NO_NCCL}."
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # with NCCL, both GPUs and no notice
    assert ParaDiTLoader.execute("tiny.safetensors", "default", "0,1").ui.value.startswith(
        "tiny.safetensors (default) on cuda:0, cuda:1; auto")


# ---------------------------------------------------------------------------------------------
# Conversions.

def test_conditioning_conversion():
    c = convert.conditioning(cond(guidance=3.5))
    assert c.cond.shape == (1, 8, 4096) and c.pooled.shape == (1, 768) and c.guidance == 3.5
    assert convert.conditioning(cond(guidance=torch.tensor([2.0]))).guidance == 2.0
    assert convert.conditioning(cond()).guidance is None
    # T5-only encoders (Chroma) give no pooled vector: an empty one travels, the runtime checks the family.
    assert convert.conditioning(cond(pooled=False)).pooled.shape == (1, 0)
    # CLIPTextEncodePixArtAlpha's width/height: (height, width, aspect) with ComfyUI's default aspect h / w.
    [[t, extra]] = cond()
    assert convert.conditioning(cond()).image_size is None
    assert convert.conditioning([[t, dict(extra, width=1024, height=768)]]).image_size == (768.0, 1024.0, 0.75)
    assert convert.conditioning([[t, dict(extra, width=512, height=512, aspect_ratio=2.0)]]).image_size == \
        (512.0, 512.0, 2.0)
    with pytest.raises(ConfigError, match="image size is 0x768.*set a positive width and height"):
        convert.conditioning([[t, dict(extra, width=0, height=768)]])


@pytest.mark.parametrize("value,match", [
    ([], "not a CONDITIONING"),
    (None, "not a CONDITIONING"),
])
def test_conditioning_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        convert.conditioning(value, "positive")


def test_latent_conversion_and_output():
    lat = latent(batch_index=[3])
    samples, extra = convert.latent_samples(lat)
    assert samples.shape == (1, 16, 16, 16) and extra == {"batch_index": [3]}
    out = convert.latent_output(lat, samples.to(torch.bfloat16))
    assert out["batch_index"] == [3] and out["samples"].dtype == torch.float32 and out is not lat
    with pytest.raises(ConfigError, match="bug"):
        convert.latent_output(lat, torch.zeros(1, 16, 8, 8))


def test_video_vae_image_latents_lose_and_regain_their_frame_axis():
    """Qwen-Image's Wan latent is [B, C, 1, H, W] in ComfyUI: the runtime gets [B, C, H, W] and returns the
    frame axis (also for a 4D EmptySD3LatentImage input, as KSampler's fix_empty_latent_channels makes it 5D)."""
    five = {"samples": torch.randn(2, 16, 1, 8, 12)}
    samples, _ = convert.latent_samples(five)
    assert samples.shape == (2, 16, 8, 12) and torch.equal(samples, five["samples"][:, :, 0])
    assert convert.latent_output(five, samples.unsqueeze(2))["samples"].shape == (2, 16, 1, 8, 12)
    four = latent()
    assert convert.latent_output(four, four["samples"].unsqueeze(2))["samples"].shape == (1, 16, 1, 16, 16)
    assert convert.latent_output(four, four["samples"])["samples"].shape == (1, 16, 16, 16)
    with pytest.raises(ConfigError, match="bug"):
        convert.latent_output(five, samples[:, :, :4])


def test_reference_latents_travel_with_their_method():
    refs = [torch.randn(1, 16, 6, 4), torch.randn(1, 16, 1, 5, 7)]  # a Flux VAE's and a Wan VAE's encode
    value = [[torch.randn(1, 3, 8), {"pooled_output": torch.randn(1, 4), "reference_latents": refs,
                                     "reference_latents_method": "index"}]]
    c = convert.conditioning(value)
    assert [tuple(r.shape) for r in c.references] == [(1, 16, 6, 4), (1, 16, 5, 7)]
    assert c.reference_method == "index" and torch.equal(c.references[1], refs[1][:, :, 0])
    assert convert.conditioning([[value[0][0], {}]]).references == ()


@pytest.mark.parametrize("value,match", [
    ({"samples": torch.zeros(1, 16, 2, 8, 8)}, r"^The latent has 2 frames, but the latent's model is an image model"),
    ({"samples": torch.zeros(16, 8)}, r"not \[batch, channels, height, width\] \(an image\) or \[batch, channels, "
                                      r"frames, height, width\] \(a video\)"),
    ({}, "not a LATENT"),
])
def test_latent_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        convert.latent_samples(value)


def test_a_one_frame_video_latent_for_an_image_model_comes_back_with_its_frame_axis():
    """EmptyHunyuanLatentVideo at length 1 on Flux: sampled as [B, C, H, W], returned [B, C, 1, H, W] as KSampler
    returns it (RemoteDiT squeezes and unsqueezes the frame axis per call)."""
    one = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    samples, _ = convert.latent_samples(one)
    assert samples.shape == (1, 16, 8, 8)
    assert convert.latent_output(one, torch.ones(1, 16, 8, 8))["samples"].shape == (1, 16, 1, 8, 8)


def test_a_video_latent_keeps_its_frames_for_a_video_model():
    video = {"samples": torch.randn(1, 16, 3, 10, 16), "batch_index": [2]}
    samples, extra = convert.latent_samples(video, video_model=True)
    assert torch.equal(samples, video["samples"]) and extra == {"batch_index": [2]}
    one_frame, _ = convert.latent_samples({"samples": torch.randn(1, 16, 1, 8, 8)}, video_model=False)
    assert one_frame.shape == (1, 16, 8, 8)  # Qwen-Image's Wan-VAE latent: an image in a video latent format


def test_devices_overlap_host():
    assert convert.devices_overlap_host(["cuda:0", "cuda:1"], torch.device("cuda", 0))
    assert convert.devices_overlap_host(["cuda:0"], "cuda")
    assert not convert.devices_overlap_host(["cuda:1", "cuda:2"], torch.device("cuda", 0))
    assert not convert.devices_overlap_host(["cpu", "cpu"], torch.device("cpu"))


def test_status_payload_is_json():
    p = convert.status_payload(node_id="3", state="running", strategy=StrategySpec(cfg_degree=2), step=1,
                               total=4, status={"sec_per_step": 0.5, "odd": torch.device("cpu")})
    assert p["strategy"] == "cfg2" and p["world_size"] == 2 and p["status"]["odd"] == "cpu"
    json.dumps(p)


# ---------------------------------------------------------------------------------------------
# Sampler.

def test_sampler_runs_job_and_reports(runtime):
    host = FakeHost()
    strat = convert.strategy_choice("auto", node_id="2")
    lat = latent(batch_index=[0])
    out, summary = sampler_mod.sample(handle(strat), 42, 4, 1.0, "euler", "simple", cond(guidance=3.5),
                                      cond(pooled=False), lat, 1.0, node_id="9", host=host)
    client = runtime.clients["cpu:2"]
    job = client.jobs[0]
    assert job.negative is None  # cfg 1.0: the negative is neither needed nor validated
    assert job.strategy == StrategySpec(ulysses_degree=2, shard_weights="auto")
    assert job.sampling.seed == 42 and job.sampling.steps == 4 and job.model.weight_dtype == "bf16"
    assert job.extra == {"batch_index": [0]} and job.positive.guidance == 3.5
    assert runtime.chosen == [(job.model.path, (1, 16, 16, 16), 1.0, "cpu:2")]
    assert runtime.budgets == [8 * 2**30]  # auto's budget is the workers' own report, not the host's view
    assert torch.equal(out["samples"], lat["samples"] * 0.5) and out["batch_index"] == [0]
    assert host.freed == [["cpu", "cpu"]]
    assert host.bars[0].node_id == "9" and host.bars[0].updates[-1] == (4, 4)
    states = [e["state"] for e in host.events]
    assert states[0] == "starting" and states[-1] == "done" and "running" in states
    assert all(e["node"] == "9" and e["strategy_node"] == "2" and e["strategy"] == "ulysses2" for e in host.events)
    assert host.events[-1]["status"]["workers"][0]["rss_bytes"] == 2 ** 30
    assert host.texts[0][0] == "2" and "Ulysses" in host.texts[0][1]
    assert "ulysses2" in summary


def test_selector_p2p_off_reaches_the_runtime(runtime):
    """The Selector's p2p picks the runtime the sampler runs on (its workers start with NCCL_P2P_DISABLE=1)."""
    assert convert.strategy_choice("auto").p2p == "auto"
    sampler_mod.sample(handle(convert.strategy_choice("manual", cfg_degree=2, p2p="off")), 0, 2, 3.0, "euler",
                       "simple", cond(), cond(), latent(), 1.0, host=FakeHost())
    assert runtime.p2p == ["off"]
    with pytest.raises(ConfigError, match=r"^p2p must be one of auto, off, got 'on'\.$"):
        convert.strategy_choice("auto", p2p="on")


def test_sampler_uses_negative_with_cfg(runtime):
    host = FakeHost()
    sampler_mod.sample(handle(convert.strategy_choice("manual", cfg_degree=2)), 0, 2, 3.0, "euler", "simple",
                       cond(), cond(), latent(), 1.0, host=host)
    job = runtime.clients["cpu:2"].jobs[0]
    assert job.negative is not None and job.strategy == StrategySpec(cfg_degree=2, shard_weights="auto")
    # A bare handle (no BaseModel, so no ComfyUI sampler to route to) gets the route's sentence.
    with pytest.raises(ConfigError, match=r"^This graph has area conditioning \(ConditioningSetArea\) in the "
                                          r"negative conditioning, which Parallel Sampler runs through ComfyUI's "
                                          r"sampler on the MODEL output of Load Parallel DiT"):
        sampler_mod.sample(handle(), 0, 2, 3.0, "euler", "simple", cond(), cond(area=(1, 1, 0, 0)), latent(),
                           1.0, host=host)


def test_sampler_cancel_becomes_comfy_interrupt(runtime):
    runtime.behaviour = "cancel"
    host = FakeHost(cancel=True)
    with pytest.raises(Interrupt):
        sampler_mod.sample(handle(), 0, 3, 1.0, "euler", "simple", cond(), cond(), latent(), 1.0, host=host)
    assert host.events[-1]["state"] == "cancelled"


def test_interrupt_raised_by_the_progress_bar_reaches_comfy_as_cancelled(runtime, monkeypatch):
    """The runtime client holds a progress-hook exception until the workers stopped, then re-raises it; the
    node reports the prompt as cancelled and lets ComfyUI's own exception through."""
    monkeypatch.setattr(FakeBar, "raise_at", 2)
    host = FakeHost()
    with pytest.raises(Interrupt):
        sampler_mod.sample(handle(), 0, 3, 1.0, "euler", "simple", cond(), cond(), latent(), 1.0, host=host)
    assert host.events[-1]["state"] == "cancelled"


def test_sampler_runtime_error_reaches_ui_unchanged(runtime):
    runtime.behaviour = "oom"
    host = FakeHost()
    with pytest.raises(OutOfMemory) as e:
        sampler_mod.sample(handle(), 0, 3, 1.0, "euler", "simple", cond(), cond(), latent(), 1.0, host=host)
    assert str(e.value) == "Worker 1 ran out of memory; use more devices or a smaller image."
    assert host.events[-1]["state"] == "error" and host.events[-1]["message"] == str(e.value)


def test_sampler_rejects_bad_inputs_before_starting_workers(runtime):
    host = FakeHost()
    with pytest.raises(ConfigError, match="connect an empty latent node or VAE Encode to it"):
        sampler_mod.sample(handle(), 0, 3, 1.0, "euler", "simple", cond(), cond(),
                           {"samples": torch.zeros(16, 8, 8)}, 1.0, host=host)  # no batch axis
    with pytest.raises(ConfigError, match="Load Parallel DiT"):
        sampler_mod.sample(object(), 0, 3, 1.0, "euler", "simple", cond(), cond(), latent(), 1.0, host=host)
    assert runtime.clients == {} and host.events == []


def test_sampler_node_execute(runtime, monkeypatch):
    host = FakeHost()
    monkeypatch.setattr(sampler_mod, "HOST", host)
    node = type("Clone", (ParaDiTSampler,), {"hidden": types.SimpleNamespace(unique_id="5")})
    out = node.execute(handle(), 1, 2, 1.0, "euler", "simple", cond(), cond(), latent(), 1.0)
    assert out.args[0]["samples"].shape == (1, 16, 16, 16) and "2 steps" in out.ui.value
    assert host.bars[0].node_id == "5"


# ---------------------------------------------------------------------------------------------
# The plugin's entry point.

def _load_plugin():
    spec = importlib.util.spec_from_file_location("paradit_plugin_under_test", os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_entrypoint_lists_the_nodes(folder_paths):
    plugin = _load_plugin()
    assert plugin.WEB_DIRECTORY == "./web" and os.path.isfile(os.path.join(ROOT, "web", "paradit.js"))
    ext = asyncio.run(plugin.comfy_entrypoint())
    names = [n.define_schema().node_id for n in asyncio.run(ext.get_node_list())]
    assert names == ["ParaDiTStrategy", "ParaDiTLoader", "ParaDiTSampler", "ParaDiTVAEDecode"]


def test_import_is_light():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('p', {os.path.join(ROOT, '__init__.py')!r}, "
        f"submodule_search_locations=[{ROOT!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['p'] = m; spec.loader.exec_module(m)\n"
        "import p.nodes\n"
        "heavy = [n for n in ('torch', 'torch.distributed', 'comfy_api', 'parallel_runtime') if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_sampler_refuses_nan_settings_before_freeing_starting_or_planning(runtime):
    host = FakeHost()
    with pytest.raises(ConfigError, match=r"^cfg=nan is not a finite number"):
        sampler_mod.sample(handle(convert.strategy_choice("auto")), 0, 2, float("nan"), "euler", "simple",
                           cond(), cond(), latent(), 1.0, host=host)
    assert host.freed == [] and "cpu:2" not in runtime.clients and getattr(runtime, "budgets", []) == []


# ---------------------------------------------------------------------------------------------
# ComfyUI's weight patches as the runtime's (nodes/weight_patches.py), with stand-ins for ComfyUI's adapters.

class FakeAdapter:
    def __init__(self, name, weights):
        self.name, self.weights = name, weights


class FakePatcher:
    def __init__(self, patches, uuid="u1"):
        self.patches, self.patches_uuid = patches, uuid


def test_weight_patches_keep_what_comfyui_would_merge_and_skip_what_it_would_not():
    from nodes.weight_patches import weight_patches_of

    up, down = torch.ones(6, 2), torch.ones(2, 4)
    shapes = {"a.weight": (6, 4), "b.weight": (6, 4), "c.bias": (6,)}
    patcher = FakePatcher({
        "diffusion_model.a.weight": [(0.8, FakeAdapter("lora", (up, down, 2.0, None, None, None)), 1.0, None, None)],
        # a rank-2 LoRA of another model's width: ComfyUI logs and skips it, and so does ParaDiT
        "diffusion_model.b.weight": [(1.0, FakeAdapter("lora", (torch.ones(5, 2), down, None, None, None, None)),
                                      1.0, None, None)],
        "diffusion_model.c.bias": [(0.5, (torch.ones(6),), 1.0, None, None)],
    })
    out = weight_patches_of(patcher, shapes)
    assert out.id == "u1" and sorted(out.weights) == ["a.weight", "c.bias"]
    lora = out.weights["a.weight"][0]
    assert (lora.kind, lora.strength, lora.alpha, sorted(lora.tensors)) == ("lora", 0.8, 2.0, ["down", "up"])
    assert out.weights["c.bias"][0].kind == "diff"
    nothing = FakePatcher({"diffusion_model.b.weight": patcher.patches["diffusion_model.b.weight"]})
    assert weight_patches_of(nothing, shapes) is None  # every patch skipped: the file's weights, no empty stack


def test_lokr_and_tucker_loha_sizes_are_checked_on_the_host():
    from nodes.weight_patches import weight_patches_of

    lokr = FakeAdapter("lokr", (torch.ones(2, 2), None, 4.0, None, None, torch.ones(3, 1), torch.ones(1, 2), None,
                                None))  # kron((2, 2), (3, 2)) = (6, 4)
    loha = FakeAdapter("loha", (torch.ones(2, 6), torch.ones(2, 4), None, torch.ones(2, 6), torch.ones(2, 4),
                                torch.ones(2, 2, 1, 1), torch.ones(2, 2, 1, 1), None))  # Tucker: (6, 4, 1, 1)
    for adapter in (lokr, loha):
        patcher = FakePatcher({"diffusion_model.a.weight": [(1.0, adapter, 1.0, None, None)]})
        assert weight_patches_of(patcher, {"a.weight": (6, 4)}) is not None
        assert weight_patches_of(patcher, {"a.weight": (6, 5)}) is None


@pytest.mark.parametrize("value,what", [([("x",)], "model-merge"), (("diff", (torch.ones(6, 4), {"pad_weight": True})),
                                                                      "padded diff"),
                                        (FakeAdapter("oft", (torch.ones(1),)), "oft")])
def test_patches_the_workers_cannot_apply_are_refused_by_name(value, what):
    from nodes.weight_patches import weight_patches_of

    patcher = FakePatcher({"diffusion_model.a.weight": [(1.0, value, 1.0, None, None)]})
    with pytest.raises(ConfigError, match=f"is a {what} patch, which the ParaDiT workers do not apply"):
        weight_patches_of(patcher, {"a.weight": (6, 4)})


def test_host_dtypes_of_a_comfyui_quantized_file_ignore_its_stored_dtypes(tmp_path, monkeypatch):
    """As ComfyUI's loader: a file with quantized layers passes no weight dtype to unet_dtype and casts from none
    (its stored dtypes are int8/fp8/packed data, not the compute dtype); a plain file passes its own."""
    ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
    from safetensors.torch import save_file

    from nodes import remote_model

    plain = {"a.weight": torch.randn(32, 32, dtype=torch.bfloat16)}
    quant = dict(ck_tensor.QuantizedTensor.from_float(torch.randn(32, 32), "TensorWiseINT8Layout").state_dict("a.weight"))
    quant["a.comfy_quant"] = torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)
    calls = []
    utils = types.ModuleType("comfy.utils")
    utils.calculate_parameters = lambda sd: 1024
    utils.weight_dtype = lambda sd: torch.bfloat16
    comfy = types.ModuleType("comfy")
    comfy.utils = utils
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.utils", utils)
    mm = types.SimpleNamespace(
        unet_dtype=lambda model_params, supported_dtypes, weight_dtype: calls.append(("unet", weight_dtype)) or torch.float16,
        unet_manual_cast=lambda dtype, device, supported: calls.append(("cast", dtype)) or None,
        get_torch_device=lambda: "cpu")
    config = types.SimpleNamespace(supported_inference_dtypes=[torch.bfloat16, torch.float32])
    for name, sd, want in (("plain", plain, torch.bfloat16), ("quant", quant, None)):
        path = str(tmp_path / f"{name}.safetensors")
        save_file(sd, path)
        calls.clear()
        handle = convert.model_handle(path, "default", "cpu:2", None)
        quantized = remote_model._meta_state_dict(path)[1]
        assert quantized == (name == "quant")
        assert remote_model._host_dtypes(handle, {}, quantized, config, mm) == (torch.float16, None)
        assert calls == [("unet", want), ("cast", torch.float16 if want is not None else None)]


# ---------------------------------------------------------------------------------------------
# Block patches under a stock sampler: SkipLayerGuidance's skips are data, other patches code.

def _comfy_skip(args, extra_args):  # what SkipLayerGuidanceDiT / SkipLayerGuidanceSD3 install per block
    return args


def test_skip_layer_patches_become_block_keys_and_passthroughs_are_dropped():
    from nodes import remote_model

    def passthrough(args, extra):
        return extra["original_block"](args)

    replace = {"dit": {("single_block", 2): _comfy_skip, ("double_block", 7): _comfy_skip,
                       ("double_block", 1): passthrough}}
    assert remote_model.skipped_blocks(replace) == (("double_block", 7), ("single_block", 2))
    assert remote_model.skipped_blocks(None) == () and remote_model.skipped_blocks({"dit": {}}) == ()


@pytest.mark.parametrize("replace", [
    {"dit": {("double_block", 0): lambda args, extra: {"img": args["img"] * 2, "txt": args["txt"]}}},  # needs tensors
    {"dit": {("double_block", 0): lambda args, extra: dict(extra["original_block"](args))}},  # alters the output
    {"attn1": {("input", 1): _comfy_skip}},  # a UNet-style attention replacement
    {"dit": {"double_block": _comfy_skip}},  # not a (kind, index) key
])
def test_code_block_patches_are_refused_in_one_sentence(replace):
    from nodes import remote_model

    with pytest.raises(ConfigError, match=r"^a model patch \(patches_replace\['\w+'\]: .+\) runs its own code inside "
                                          r"the diffusion model's blocks, which the ParaDiT workers cannot run: no "
                                          r"ParaDiT strategy supports it .*load the model with UNETLoader\.$"):
        remote_model.skipped_blocks(replace)


def test_comfyuis_multigpu_cfg_split_is_refused_in_one_sentence():
    """ComfyUI's MultiGPU_WorkUnits (2026; this host snapshot predates it) deep-copies the BaseModel per extra GPU
    (ModelPatcher.deepclone_multigpu); a fake of that copy must meet the sentence, not clone a remote model whose
    devices the workers own."""
    import copy

    from nodes import remote_model

    class Base:  # ComfyUI's BaseModel, as far as RemoteDiT reads it
        latent_format = types.SimpleNamespace(latent_channels=16)

    base = Base()
    dit = remote_model.RemoteDiT(handle(convert.strategy_choice("auto")), torch.float32, base, {})
    patcher_model = types.SimpleNamespace(diffusion_model=dit)
    with pytest.raises(ConfigError, match=r"^MultiGPU CFG Split \(MultiGPU_WorkUnits\) copies the model onto other "
                                          r"GPUs, .* set cfg_degree 2 in the Strategy Selector"):
        copy.deepcopy(patcher_model)


def test_a_padded_lumina_prompt_is_refused_and_an_unpadded_one_passes():
    """Lumina 2's extra_conds: a [B, L] prompt mask only when the text encoder padded (then refused in one
    sentence), else num_tokens alone, the prompt's length (a known input, not an unknown one)."""
    from nodes import remote_model

    with pytest.raises(ConfigError, match=r"attention mask hides 2 padding token\(s\)"):
        remote_model._refuse_what_the_workers_cannot_do(None, {}, {"attention_mask": torch.tensor([[1, 1, 0, 0]]),
                                                                   "num_tokens": 2})
    remote_model._refuse_what_the_workers_cannot_do(None, {}, {"num_tokens": 4})


def test_parallel_sampler_takes_clip_vision_and_wan_animate_inputs_from_the_models_extra_conds():
    """The worker loop's CLIP-vision tokens, Wan Animate pose latent and face video are what the MODEL's own
    extra_conds makes of the conditioning's keys (the family picks the hidden states, the latent format processes
    the pose), the face kept by the hash of its bytes; a branch without them keeps none."""
    from nodes import sampler
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec

    class Cond:
        def __init__(self, t):
            self.cond = t

    class Base:  # WAN22_Animate.extra_conds' shape: clip_fea, process_latent_in'd pose, face pixels as given
        def extra_conds(self, noise, device, clip_vision_output=None, pose_video_latent=None, face_video_pixels=None):
            out = {}
            if clip_vision_output is not None:
                out["clip_fea"] = Cond(clip_vision_output.penultimate_hidden_states)
            if pose_video_latent is not None:
                out["pose_latents"] = Cond(pose_video_latent * 2.0)
            if face_video_pixels is not None:
                out["face_pixel_values"] = Cond(face_video_pixels)
            return out

    clip = types.SimpleNamespace(penultimate_hidden_states=torch.randn(1, 257, 1280))
    pose, face = torch.randn(1, 16, 4, 6, 8), torch.rand(1, 3, 5, 512, 512).to(torch.bfloat16)
    positive = [[torch.zeros(1, 9, 64), {"clip_vision_output": clip, "pose_video_latent": pose,
                                         "face_video_pixels": face}]]
    negative = [[torch.zeros(1, 9, 64), {}]]
    job = Job(ModelSpec("unused"), StrategySpec(), SamplingSpec(), torch.zeros(1, 16, 5, 6, 8),
              Conditioning(torch.zeros(1, 9, 64), torch.zeros(1, 0)), Conditioning(torch.zeros(1, 9, 64), torch.zeros(1, 0)))
    out = sampler._with_image_inputs(Base(), job, positive, negative)
    pos, neg = out.positive, out.negative
    assert torch.equal(pos.clip_vision, clip.penultimate_hidden_states) and torch.equal(pos.pose, pose * 2.0)
    assert pos.face.dtype == torch.bfloat16 and torch.equal(pos.face, face) and pos.face_key.startswith("face-")
    assert pos.kept_inputs() == {pos.face_key: pos.face}
    assert (neg.clip_vision, neg.pose, neg.face, neg.face_key) == (None, None, None, None)
    assert sampler._with_image_inputs(None, job, positive, negative) is job  # a bare handle: no MODEL to ask
