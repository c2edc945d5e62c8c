"""What the ComfyUI nodes hand to the runtime and back, as plain Python.

Nothing here imports ComfyUI, so all of it is unit-tested without a host:
- the nodes' inputs as plain data (`*_INPUTS`), from which `nodes/*.py` build the V3 io schema;
- the values that travel on the custom sockets (`StrategyChoice`, `ParaDiTModel`);
- CONDITIONING -> `Conditioning`, LATENT -> tensor and back;
- the payload of the "paradit.status" event that `web/paradit.js` draws.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from parallel_runtime.errors import ConfigError
from parallel_runtime.weights.comfy_quant import QUANTIZED_MATMUL
from parallel_runtime.distributed.devices import WEIGHT_DTYPES  # one list for the node and the workers
from parallel_runtime.runtime.links import P2P_SETTINGS
from parallel_runtime.spec import CACHE_MODES, Conditioning, ModelSpec, StrategySpec

STRATEGY_TYPE = "PARADIT_STRATEGY"
MODEL_TYPE = "MODEL"  # ComfyUI's own: KSampler and every model node take Load Parallel DiT's output
STATUS_EVENT = "paradit.status"
CATEGORY = "ParaDiT"

MODES = ("auto", "manual")
DEFAULT_SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m")
DEFAULT_SCHEDULERS = ("simple", "normal", "beta", "sgm_uniform")
SEED_MAX = 0xFFFFFFFFFFFFFFFF


def sampler_names() -> tuple[str, ...]:
    """The runtime's samplers, or the three every runtime version has."""
    try:
        from parallel_runtime.sampling import SAMPLERS
    except ImportError:
        return DEFAULT_SAMPLERS
    return tuple(SAMPLERS) or DEFAULT_SAMPLERS


def scheduler_names() -> tuple[str, ...]:
    try:
        from parallel_runtime.sampling import SCHEDULERS
    except ImportError:
        return DEFAULT_SCHEDULERS
    return tuple(SCHEDULERS) or DEFAULT_SCHEDULERS


# ---------------------------------------------------------------------------------------------
# The nodes' inputs as plain data: (id, kind, options). kind is one of int, float, string,
# combo, or a socket type name. nodes/*.py turn each row into an io.*.Input; tests read them.

@dataclass(frozen=True)
class InputSpec:
    id: str
    kind: str  # int | float | string | combo | <socket type>
    options: dict = field(default_factory=dict)
    optional: bool = False


SHARD_WEIGHTS = {"auto": "auto", "on": True, "off": False}  # Strategy Selector's shard_weights -> StrategySpec's

STRATEGY_INPUTS = (
    InputSpec("mode", "combo", {"options": list(MODES), "default": "auto",
                                "tooltip": "auto: the runtime picks the degrees for the devices, image size and cfg "
                                           "at sample time (shown on this node); manual: use the degrees below."}),
    InputSpec("cfg_degree", "int", {"default": 1, "min": 1, "max": 2,
                                    "tooltip": "2 runs the positive and negative branch on different devices (needs cfg > 1)."}),
    InputSpec("pipefusion_degree", "int", {"default": 1, "min": 1, "max": 8,
                                           "tooltip": "Pipeline stages: the transformer blocks split over this many devices."}),
    InputSpec("ulysses_degree", "int", {"default": 1, "min": 1, "max": 8,
                                        "tooltip": "Sequence parallel over attention heads (all-to-all)."}),
    InputSpec("ring_degree", "int", {"default": 1, "min": 1, "max": 8,
                                     "tooltip": "Sequence parallel by passing key/value blocks around a ring."}),
    InputSpec("num_pipeline_patch", "int", {"default": 0, "min": 0, "max": 64,
                                            "tooltip": "PipeFusion patches; 0 lets the runtime choose. Applies in auto mode too."}),
    InputSpec("warmup_steps", "int", {"default": 1, "min": 0, "max": 100,
                                      "tooltip": "Steps run on the whole latent before PipeFusion or displaced patch "
                                                 "parallelism use stale activations. Applies in auto mode too."}),
    # Newer inputs are optional, so graphs saved before them still load and queue.
    InputSpec("tensor_degree", "int", {"default": 1, "min": 1, "max": 8,
                                       "tooltip": "Tensor parallel: every block's attention heads and MLP split over "
                                                  "this many devices, each holding that share of the weights (exact)."},
              optional=True),
    InputSpec("patch_degree", "int", {"default": 1, "min": 1, "max": 8,
                                      "tooltip": "Displaced patch parallel (DistriFusion): each device computes its "
                                                 "patch against the other patches' previous-step K/V (approximate "
                                                 "after warm-up, no pipeline bubble)."}, optional=True),
    InputSpec("device_weights", "string", {"default": "",
                                           "tooltip": "Unequal devices: empty splits equally; 'measured' times each "
                                                      "device on this model first; relative speeds such as 3,2 split "
                                                      "tokens, heads and pipeline stages in proportion. Applies in "
                                                      "auto mode too."}, optional=True),
    InputSpec("shard_weights", "combo", {"options": list(SHARD_WEIGHTS), "default": "auto",
                                         "tooltip": "For models bigger than one device: the devices that would each "
                                                    "hold the whole model (CFG, Ulysses, Ring ranks) keep a share of "
                                                    "every block and gather a block just before it runs (exact). auto: "
                                                    "only when the model does not fit otherwise. Applies in auto mode "
                                                    "too."}, optional=True),
    InputSpec("p2p", "combo", {"options": list(P2P_SETTINGS), "default": "auto",
                               "tooltip": "GPU peer-to-peer transfers. off starts the workers with NCCL_P2P_DISABLE=1, "
                                          "for boards whose peer-to-peer is broken (the runtime says so at startup); "
                                          "auto leaves it to NCCL."}, optional=True),
    InputSpec("batch_degree", "int", {"default": 1, "min": 1, "max": 8,
                                      "tooltip": "Batch parallel: the latent's images split over this many groups of "
                                                 "devices, in proportion to their speed; no traffic between groups "
                                                 "until the end (exact). The fastest split when the batch has at "
                                                 "least as many images as devices; auto picks it there."},
              optional=True),
    InputSpec("cache", "combo", {"options": list(CACHE_MODES), "default": "off",
                                 "tooltip": "Parallel Sampler's step cache: first_block runs the first block each "
                                            "step and, where its output changed by less than cache_threshold "
                                            "(relative, over the whole image and both CFG branches), reuses the "
                                            "other blocks' last output instead of running them. Every device takes "
                                            "the same decision (under PipeFusion one step late). KSampler: use ComfyUI's "
                                            "EasyCache instead."}, optional=True),
    InputSpec("cache_threshold", "float", {"default": 0.1, "min": 0.0, "max": 10.0, "step": 0.01,
                                           "tooltip": "Relative change of the first block's output under which "
                                                      "a step is skipped: higher skips more steps, with more error; "
                                                      "0 never skips."}, optional=True),
    InputSpec("cache_start", "float", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                       "tooltip": "Fraction of the steps before which every step is computed."},
              optional=True),
    InputSpec("cache_end", "float", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                     "tooltip": "Fraction of the steps from which every step is computed."},
              optional=True),
)


DEVICES_TOOLTIP = ("auto: every visible GPU; 0,1,2,3: those GPUs; cpu:N: N CPU workers. Other machines (their agent "
                   "joined): NAME: starts that machine's entries, e.g. 0,1,gpu-box-2:0,1 (GPUs 0 and 1 here and on "
                   "gpu-box-2) or cpu:2,box-b:cpu:2; all: every GPU here and all of each joined machine's devices.")


def loader_inputs(unet_names: list[str]) -> tuple[InputSpec, ...]:
    return (
        InputSpec("unet_name", "combo", {"options": list(unet_names),
                                         "tooltip": "A DiT file in models/diffusion_models: Flux, SD3, Qwen-Image, "
                                                    "Wan, HunyuanVideo 1.5 or another family in ParaDiT's README."}),
        InputSpec("weight_dtype", "combo", {"options": list(WEIGHT_DTYPES), "default": "default"}),
        InputSpec("devices", "string", {"default": "auto", "tooltip": DEVICES_TOOLTIP}),
        InputSpec("strategy", STRATEGY_TYPE, {"tooltip": "From Strategy Selector; auto when left unconnected."},
                  optional=True),
        InputSpec("quantized_matmul", "combo", {
            "options": list(QUANTIZED_MATMUL), "default": "auto",
            "tooltip": "ComfyUI-quantized files (int8_convrot, fp8mixed, nvfp4, mxfp8): auto multiplies in the "
                       "quantized layout with comfy-kitchen's kernels where ComfyUI does (fp8 on RTX 40/H100 and "
                       "newer, int8 on CUDA GPUs, nvfp4/mxfp8 on Blackwell); dequantize always dequantizes each "
                       "layer first (exact across strategies); kernel uses comfy-kitchen's matmul wherever it "
                       "has one."}, optional=True),
    )


def sampler_inputs(samplers: tuple[str, ...], schedulers: tuple[str, ...]) -> tuple[InputSpec, ...]:
    """KSampler's inputs; the model must come from Load Parallel DiT."""
    return (
        InputSpec("model", MODEL_TYPE, {"tooltip": "From Load Parallel DiT."}),
        InputSpec("seed", "int", {"default": 0, "min": 0, "max": SEED_MAX, "control_after_generate": True,
                                  "tooltip": "The random seed used for creating the noise."}),
        InputSpec("steps", "int", {"default": 20, "min": 1, "max": 10000}),
        InputSpec("cfg", "float", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                                   "tooltip": "1.0 skips the negative branch (Flux dev/schnell use FluxGuidance instead)."}),
        InputSpec("sampler_name", "combo", {"options": list(samplers)}),
        InputSpec("scheduler", "combo", {"options": list(schedulers)}),
        InputSpec("positive", "CONDITIONING"),
        InputSpec("negative", "CONDITIONING"),
        InputSpec("latent_image", "LATENT"),
        InputSpec("denoise", "float", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
    )


_BUILTIN_SOCKETS = {"CONDITIONING": "Conditioning", "LATENT": "Latent"}


def build_inputs(io: Any, specs: tuple[InputSpec, ...]) -> list:
    """InputSpec rows -> comfy_api io inputs. `io` is comfy_api.latest.io, passed in so this file never imports it."""
    built = []
    for spec in specs:
        opts = dict(spec.options)
        if spec.kind == "int":
            built.append(io.Int.Input(spec.id, optional=spec.optional, **opts))
        elif spec.kind == "float":
            built.append(io.Float.Input(spec.id, optional=spec.optional, **opts))
        elif spec.kind == "string":
            built.append(io.String.Input(spec.id, optional=spec.optional, **opts))
        elif spec.kind == "combo":
            built.append(io.Combo.Input(spec.id, optional=spec.optional, **opts))
        elif spec.kind in _BUILTIN_SOCKETS:
            built.append(getattr(io, _BUILTIN_SOCKETS[spec.kind]).Input(spec.id, optional=spec.optional, **opts))
        else:
            built.append(io.Custom(spec.kind).Input(spec.id, optional=spec.optional, **opts))
    return built


# ---------------------------------------------------------------------------------------------
# Values on the custom sockets.

@dataclass(frozen=True)
class StrategyChoice:
    """PARADIT_STRATEGY: a fixed StrategySpec (manual) or a request to choose at sample time (auto).

    In auto mode `spec` holds only the PipeFusion knobs (num_pipeline_patch, warmup_steps) to lay
    over whatever the runtime picks. `node_id` is the Strategy Selector that made it, so the
    sampler can write the choice back onto that node.
    """

    mode: str = "auto"
    spec: StrategySpec = StrategySpec()
    node_id: str | None = None
    measured: bool = False  # device_weights 'measured': timed on the job's own shapes at sample time
    p2p: str = "auto"  # the workers' GPU peer-to-peer setting (runtime.links.p2p_setting)

    def describe(self) -> str:
        if self.mode == "auto":
            return "auto: degrees are chosen at sample time"
        return f"manual: {self.spec.label()} on {self.spec.world_size} worker(s)"


def strategy_choice(mode: str, cfg_degree: int = 1, pipefusion_degree: int = 1, ulysses_degree: int = 1,
                    ring_degree: int = 1, num_pipeline_patch: int = 0, warmup_steps: int = 1,
                    node_id: str | None = None, tensor_degree: int = 1, patch_degree: int = 1,
                    device_weights: str = "", shard_weights: str = "auto", p2p: str = "auto",
                    batch_degree: int = 1, cache: str = "off", cache_threshold: float = 0.1, cache_start: float = 0.0,
                    cache_end: float = 1.0) -> StrategyChoice:
    """Strategy Selector's inputs -> StrategyChoice; range errors are caught here, device fit at sample time."""
    from parallel_runtime.planning.balance import MEASURED, parse_device_weights

    if mode not in MODES:
        raise ConfigError(f"Unknown strategy mode {mode!r}; choose one of {', '.join(MODES)}.")
    ints = dict(cfg_degree=cfg_degree, pipefusion_degree=pipefusion_degree, ulysses_degree=ulysses_degree,
                ring_degree=ring_degree, num_pipeline_patch=num_pipeline_patch, warmup_steps=warmup_steps,
                tensor_degree=tensor_degree, patch_degree=patch_degree, batch_degree=batch_degree)
    for spec in STRATEGY_INPUTS:
        if spec.id in ints:
            value = ints[spec.id]
            if not isinstance(value, int) or not spec.options["min"] <= value <= spec.options["max"]:
                raise ConfigError(f"{spec.id} must be an integer from {spec.options['min']} to "
                                  f"{spec.options['max']}, got {value!r}.")
    weights = parse_device_weights(device_weights)
    fixed = () if weights == MEASURED else weights
    if shard_weights not in SHARD_WEIGHTS:
        raise ConfigError(f"shard_weights must be one of {', '.join(SHARD_WEIGHTS)}, got {shard_weights!r}.")
    shard = SHARD_WEIGHTS[shard_weights]
    if p2p not in P2P_SETTINGS:
        raise ConfigError(f"p2p must be one of {', '.join(P2P_SETTINGS)}, got {p2p!r}.")
    step_cache = dict(cache=cache, cache_threshold=cache_threshold, cache_start=cache_start, cache_end=cache_end)
    if mode == "auto":
        spec = StrategySpec(num_pipeline_patch=num_pipeline_patch, warmup_steps=warmup_steps, device_weights=fixed,
                            shard_weights=shard, **step_cache)
    else:
        spec = StrategySpec(**ints, device_weights=fixed, shard_weights=shard, **step_cache)  # device fit: at sample time
    return StrategyChoice(mode=mode, spec=spec, node_id=None if node_id is None else str(node_id),
                          measured=weights == MEASURED, p2p=p2p)


AUTO = StrategyChoice(spec=StrategySpec(shard_weights="auto"))  # no Selector: sharding only where nothing fits


@dataclass(frozen=True)
class ParaDiTModel:
    """What Load Parallel DiT's MODEL carries for the runtime (nodes/remote_model.py): the file, devices and
    strategy; the workers load the weights at the first sample."""

    model: ModelSpec
    devices: str = "auto"
    strategy: StrategyChoice = AUTO
    name: str = ""

    def describe(self, device_list: list[str] | None = None) -> str:
        where = ", ".join(device_list) if device_list else self.devices
        return f"{self.name or self.model.path} ({self.model.weight_dtype}) on {where}; {self.strategy.describe()}"


def local_devices(devices: str) -> list[str]:
    """The devices of this machine a devices string names (ComfyUI's models leave those before a prompt): every one
    where it names no other machine, none where it names only others (another machine's cuda:0 is not ours)."""
    from parallel_runtime.distributed.devices import parse_devices
    from parallel_runtime.runtime.cluster import names_remote, split_devices

    if not names_remote(devices):
        return parse_devices(devices)
    here = split_devices(devices)[0]
    return parse_devices(here) if here else []


def client_devices_here(client) -> list[str]:
    """The devices of a runtime client's ranks that run on this machine (another machine's cuda:0 is not ours)."""
    from parallel_runtime.runtime.cluster import LOCAL

    return [device for device, host in zip(client.devices, client.hosts) if host == LOCAL]


def normalize_devices(devices: str) -> str:
    text = (devices or "").strip().replace(" ", "")
    return text or "auto"


def model_handle(path: str, weight_dtype: str, devices: str, strategy: StrategyChoice | None,
                 name: str = "", quantized_matmul: str = "auto") -> ParaDiTModel:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"Unknown weight_dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}.")
    if quantized_matmul not in QUANTIZED_MATMUL:
        raise ConfigError(f"Unknown quantized_matmul {quantized_matmul!r}; choose one of "
                          f"{', '.join(QUANTIZED_MATMUL)}.")
    if strategy is not None and not isinstance(strategy, StrategyChoice):
        raise ConfigError("The strategy input must come from a Strategy Selector node.")
    return ParaDiTModel(model=ModelSpec(path=path, weight_dtype=weight_dtype, quantized_matmul=quantized_matmul),
                        devices=normalize_devices(devices),
                        strategy=strategy or AUTO, name=name)


# ---------------------------------------------------------------------------------------------
# CONDITIONING and LATENT.

# Keys of a conditioning dict that change what the model sees in ways the runtime does not do.
def conditioning(value: Any, which: str = "positive") -> Conditioning:
    """ComfyUI CONDITIONING ([[cond, {pooled_output, guidance, ...}]]) -> runtime Conditioning. Only what the
    workers' step loop reads arrives here: route.worker_loop_gap sends any other conditioning to ComfyUI's sampler."""
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        raise ConfigError(f"The {which} input is not a CONDITIONING; connect a CLIP Text Encode node to it.")
    entry = value[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor):
        raise ConfigError(f"The {which} input is not a CONDITIONING; connect a CLIP Text Encode node to it.")
    cond, extra = entry
    extra = extra or {}
    if cond.dim() != 3:
        raise ConfigError(f"The {which} conditioning tensor has shape {tuple(cond.shape)}, not [batch, tokens, "
                          f"channels]; encode it with CLIP Text Encode and the model's text encoder.")
    pooled = extra.get("pooled_output")
    if not isinstance(pooled, torch.Tensor):
        # T5-only encoders (Chroma, PixArt) give none; whether the model needs one is checked against the
        # model's family in the runtime, with the text encoder that family needs named.
        pooled = torch.zeros(cond.shape[0], 0)
    if pooled.dim() == 1:
        pooled = pooled.unsqueeze(0)
    guidance = extra.get("guidance")
    if guidance is not None:
        guidance = float(guidance.flatten()[0]) if isinstance(guidance, torch.Tensor) else float(guidance)
        if not math.isfinite(guidance):
            raise ConfigError(f"The {which} conditioning has guidance {guidance}; set a finite FluxGuidance value.")
    camera = extra.get("camera_conditions")  # WanCameraEmbedding's, as WanCameraImageToVideo sets it
    llama = extra.get("conditioning_llama3")  # CLIPTextEncodeHiDream's Llama 3.1 layers
    return Conditioning(cond=cond.detach().cpu(), pooled=pooled.detach().cpu(), guidance=guidance,
                        image_size=image_size(extra, which), **reference_latents(extra, which),
                        camera=camera.detach().cpu() if isinstance(camera, torch.Tensor) else None,
                        llama=llama.detach().float().cpu() if isinstance(llama, torch.Tensor) else None)


def image_size(extra: dict, which: str) -> tuple[float, float, float] | None:
    """(height, width, aspect ratio) of the `width`/`height` keys a text encode node may set (e.g.
    CLIPTextEncodePixArtAlpha; PixArt-α embeds them), aspect_ratio defaulting to height / width as ComfyUI's
    PixArt does; None when the node set none (the family then uses the latent's size)."""
    if extra.get("width") is None or extra.get("height") is None:
        return None
    height, width = float(extra["height"]), float(extra["width"])
    aspect = float(extra.get("aspect_ratio", height / width if width else float("nan")))
    if not all(math.isfinite(v) and v > 0 for v in (height, width, aspect)):
        raise ConfigError(f"The {which} conditioning's image size is {width:g}x{height:g} (aspect {aspect:g}); set a "
                          f"positive width and height on its text encode node.")
    return height, width, aspect


def reference_latents(extra: dict, which: str) -> dict:
    """ReferenceLatent's `reference_latents` (raw VAE latents, chained in order) and the placement chosen by
    FluxKontextMultiReferenceLatentMethod; the runtime checks them against the model's family."""
    refs = extra.get("reference_latents")
    if refs is None:
        return {}
    if isinstance(refs, torch.Tensor):
        refs = [refs]
    if not all(isinstance(r, torch.Tensor) for r in refs):
        raise ConfigError(f"The {which} conditioning's reference latents are not tensors; connect a VAE Encode "
                          f"output to ReferenceLatent.")
    method = extra.get("reference_latents_method")
    return {"references": tuple(image_latent(r, "reference latent").detach().float().cpu() for r in refs),
            "reference_method": None if method is None else str(method)}


def latent_samples(latent: Any, video_model: bool = False) -> tuple[torch.Tensor, dict]:
    """ComfyUI LATENT -> (samples on CPU: [B, C, H, W], or [B, C, T, H, W] for a video model; extra for Job.extra).
    A noise mask never gets here: route.worker_loop_gap sends such graphs to ComfyUI's sampler."""
    if not isinstance(latent, dict) or not isinstance(latent.get("samples"), torch.Tensor):
        raise ConfigError("The latent_image input is not a LATENT; connect an empty latent node (e.g. "
                          "EmptySD3LatentImage, EmptyHunyuanLatentVideo) or VAE Encode to it.")
    samples = latent["samples"]
    if not (video_model and samples.dim() == 5):
        samples = image_latent(samples, "latent")
    # Channels are the model's business: the runtime checks them against the file's family.
    extra = {}
    if latent.get("batch_index") is not None:
        extra["batch_index"] = [int(i) for i in latent["batch_index"]]
    return samples.detach().cpu(), extra


def av_streams(latent: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An audio-video model's LATENT (ComfyUI 2026's NestedTensor [video, audio]: LTXVConcatAVLatent,
    EmptyMiniMaxH3LatentAV) as (video, audio) on CPU; None for any other LATENT."""
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not getattr(samples, "is_nested", False) or isinstance(samples, torch.Tensor):
        return None
    streams = list(samples.unbind())
    if len(streams) != 2 or not all(isinstance(t, torch.Tensor) for t in streams):
        raise ConfigError(f"The latent holds {len(streams)} streams, not an audio-video model's (video, audio); "
                          f"connect LTXVConcatAVLatent's or EmptyMiniMaxH3LatentAV's latent to it.")
    return streams[0].detach().cpu(), streams[1].detach().cpu()


def av_latent_output(latent_in: dict, video: torch.Tensor, audio: torch.Tensor) -> dict:
    """The output LATENT of an audio-video model as KSampler makes it: the input's NestedTensor class over the
    sampled (video, audio), the input dict's other keys kept."""
    samples = latent_in["samples"]
    expected = tuple(tuple(t.shape) for t in samples.unbind())
    if (tuple(video.shape), tuple(audio.shape)) != expected:
        raise ConfigError(f"The runtime returned streams of shapes {tuple(video.shape)} and {tuple(audio.shape)} for "
                          f"an input of shapes {expected}; this is a ParaDiT bug, please report it.")
    out = dict(latent_in)
    out["samples"] = type(samples)([video.detach().to("cpu", torch.float32), audio.detach().to("cpu", torch.float32)])
    return out


def image_latent(samples: torch.Tensor, what: str) -> torch.Tensor:
    """[B, C, H, W], or a video VAE's one-frame [B, C, 1, H, W] (Qwen-Image's Wan latent) without its frame axis."""
    if samples.dim() == 5 and samples.shape[2] == 1:
        samples = samples[:, :, 0]
    if samples.dim() == 5:
        raise ConfigError(frames_for_an_image_model(samples.shape[2], f"the {what}'s model"))
    if samples.dim() != 4:
        raise ConfigError(f"The {what} has shape {tuple(samples.shape)}, not [batch, channels, height, width] (an "
                          f"image) or [batch, channels, frames, height, width] (a video); connect an empty latent "
                          f"node or VAE Encode to it.")
    return samples


def frames_for_an_image_model(frames: int, model: str) -> str:
    """One sentence, the same from both nodes, for a video latent given to an image model."""
    return (f"The latent has {frames} frames, but {model} is an image model, which samples one frame; use an image "
            f"latent (EmptySD3LatentImage, EmptyLatentImage) or load a video model (Wan, HunyuanVideo 1.5).")


def latent_output(latent_in: dict, samples: torch.Tensor) -> dict:
    """The output LATENT as KSampler makes it: the input dict's other keys, new samples. The runtime returns
    a video VAE's image latent (Qwen-Image's Wan latent) as [B, C, 1, H, W], as KSampler does, also for a 4D
    input (ComfyUI's fix_empty_latent_channels)."""
    expected = tuple(latent_in["samples"].shape)
    if isinstance(samples, torch.Tensor) and samples.dim() == 5 and len(expected) == 4:
        expected = expected[:2] + (1,) + expected[2:]
    if isinstance(samples, torch.Tensor) and samples.dim() == 4 and len(expected) == 5 and expected[2] == 1:
        samples = samples.unsqueeze(2)  # a one-frame [B, C, 1, H, W] latent for an image model comes back so
    if not isinstance(samples, torch.Tensor) or tuple(samples.shape) != expected:
        got = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ConfigError(f"The runtime returned a latent of shape {got} for an input of shape {expected}; "
                          f"this is a ParaDiT bug, please report it.")
    out = dict(latent_in)
    out["samples"] = samples.detach().to("cpu", torch.float32)
    return out


def devices_overlap_host(worker_devices: list[str], host_device: Any) -> bool:
    """Do the workers use the accelerator ComfyUI itself holds models on? (CPU never counts.)"""
    host = torch.device(host_device) if not isinstance(host_device, torch.device) else host_device
    if host.type == "cpu":
        return False
    for d in worker_devices:
        dev = torch.device(d)
        if dev.type == host.type and (dev.index or 0) == (host.index or 0):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Live status for the frontend.

def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def status_payload(*, node_id: str | None, state: str, strategy: StrategySpec | None, reason: str = "",
                   mode: str = "auto", strategy_node: str | None = None, devices: str = "",
                   step: int | None = None, total: int | None = None, status: dict | None = None,
                   info: dict | None = None, message: str = "") -> dict:
    """The "paradit.status" event: everything web/paradit.js draws on the Parallel nodes."""
    return _json_safe({
        "node": node_id,
        "strategy_node": strategy_node,
        "state": state,  # starting | running | done | cancelled | error
        "mode": mode,
        "strategy": strategy.label() if strategy is not None else None,
        "world_size": strategy.world_size if strategy is not None else None,
        "reason": reason,
        "devices": devices,
        "step": step,
        "total": total,
        "status": status or {},
        "info": info or {},
        "message": message,
    })


def strategy_text(strategy: StrategySpec, reason: str, mode: str) -> str:
    """The line shown on the Strategy Selector once the sampler knows what runs."""
    head = f"{mode}: {strategy.label()} on {strategy.world_size} worker(s)"
    if strategy.balanced:  # each rank's share of the tokens, heads and stages it splits
        total = sum(strategy.device_weights)
        head += " — shares " + ", ".join(f"{w / total:.0%}" for w in strategy.device_weights)
    return f"{head}\n{reason}" if reason and reason != "manual" else head
