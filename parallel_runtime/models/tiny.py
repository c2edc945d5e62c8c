"""Small Flux configs and a writer of deterministic random checkpoints of any family (for tests/benchmarks)."""

from __future__ import annotations

import dataclasses
import os

import torch
from safetensors.torch import save_file

from ..weights.keymap import apply_transform
from .families.flux import FluxConfig

TINY = FluxConfig(
    hidden_size=128,
    num_heads=4,
    head_dim=32,
    num_layers=2,
    num_single_layers=2,
    in_channels=64,
    context_dim=64,
    pooled_dim=32,
    guidance_embeds=True,
    mlp_ratio=4.0,
)

BENCH = dataclasses.replace(TINY, hidden_size=256, head_dim=64, axes_dims_rope=None)

# Init scales (relative to 1/sqrt(fan_in) for weights).
_WEIGHT_GAIN = 1.0
_MOD_GAIN = 0.5  # modulation (adaLN) weights: gates/scales of O(0.3), neither ~0 nor exploding
_BIAS_STD = 0.02
_NORM_STD = 0.05  # RMSNorm scales ~ 1 +- 0.05


def _random_original(config, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors for every key of the family's original (ComfyUI) layout, in a fixed order."""
    from .registry import family_of

    return _random_tensors(family_of(config).checkpoint_shapes(config), seed, dtype)


def _random_tensors(shapes: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors of {key: (shape, kind)}, each kind at its scale, in the dict's order."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    tensors: dict[str, torch.Tensor] = {}
    for key, (shape, kind) in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "weight":
            t.mul_(_WEIGHT_GAIN / shape[1] ** 0.5)
        elif kind == "mod":
            t.mul_(_MOD_GAIN / shape[1] ** 0.5)
        elif kind == "bias":
            t.mul_(_BIAS_STD)
        elif kind == "norm":
            t.mul_(_NORM_STD).add_(1.0)
        elif kind == "table":  # stored position tables: O(1) entries like sin/cos ones
            t.mul_(0.5)
        elif kind == "equal":  # StyleGAN's equalized layers (Wan Animate's motion encoder): unit variance
            pass
        elif kind == "blur":  # a stored antialiasing kernel (Wan Animate's): the real one, [1, 3, 3, 1] squared
            taps = torch.tensor([1.0, 3.0, 3.0, 1.0])
            t = (taps[:, None] * taps[None, :]) / 64.0
        elif kind == "rope_frequencies":  # a stored RoPE frequency buffer (MiniMax-H3's): the real ones, theta 1e4
            t = 1.0 / 10000.0 ** (torch.arange(0, 2 * shape[0], 2, dtype=torch.float32) / (2 * shape[0]))
        tensors[key] = t.to(dtype)
    return tensors


def write_checkpoint(
    path: str | os.PathLike,
    config,
    seed: int = 0,
    layout: str = "bfl",
    prefix: str = "",
    dtype: torch.dtype = torch.float32,
) -> str:
    """Write deterministic random weights of any family's ``config`` to ``path`` (.safetensors) in ``layout``:
    "diffusers", or the family's original (ComfyUI) layout under any other name ("bfl" for Flux).

    The numbers depend only on ``config`` and ``seed``: an original file and its "diffusers"
    twin hold exactly the same values (the latter via our own key map).
    """
    from .registry import family_of

    path = os.fspath(path)
    bfl = _random_original(config, seed, dtype)
    if layout != "diffusers":
        tensors = {prefix + k: v for k, v in bfl.items()}
    else:
        tensors = {}
        for name, src in family_of(config).source_map(config, "bfl", "").items():
            t = bfl[src.key]
            if src.rows is not None:
                t = t[src.rows]
            tensors[prefix + name] = apply_transform(t, src.transform).contiguous().clone()
        del bfl
    metadata = {"format": "pt", "paradit_layout": layout, "paradit_seed": str(seed)}
    save_file(tensors, path, metadata=metadata)
    return path


# Hint encoders of ComfyUI's Flux ControlNets: conv (in, out, kernel) per entry, at even Sequential indices.
_XLABS_HINT = [(3, 16, 3)] + [(16, 16, 3)] * 7
_MISTOLINE_HINT = [(3, 16, 3), (16, 16, 1)] + [(16, 16, 3)] * 7 + [(16, 16, 1), (16, 16, 3)]


def write_controlnet(path: str | os.PathLike, config: FluxConfig, kind: str = "xlabs", double: int = 2,
                     single: int = 0, union_modes: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Deterministic random weights of a Flux ControlNet for the DiT `config`, in ComfyUI's ControlNetFlux
    layout (what ComfyUI's loaders build from XLabs, Mistoline and InstantX files, and what the host hands
    the workers): `kind` "xlabs" (hint image through a conv stack), "mistoline" (its conv stack and Linear+SiLU
    projections) or "instantx" (a latent hint). Residual projections get a sizeable scale, so a residual
    added to the wrong block or rows shows."""
    channels = 4 * config.latent_channels  # a ControlNet reads the latent alone (no Fill/Canny concat)
    net = dataclasses.replace(config, num_layers=double, num_single_layers=single, in_channels=channels,
                              out_channels=channels)
    tensors = {k: v for k, v in _random_original(net, seed, dtype).items() if not k.startswith("final_layer.")}
    gen = torch.Generator().manual_seed(int(seed) + 1)
    h = config.hidden_size

    def linear(name: str, n_out: int, n_in: int, gain: float = 1.0) -> None:
        tensors[f"{name}.weight"] = (torch.randn(n_out, n_in, generator=gen) * gain / n_in ** 0.5).to(dtype)
        tensors[f"{name}.bias"] = (torch.randn(n_out, generator=gen) * _BIAS_STD).to(dtype)

    projection = "{}.{}.linear" if kind == "mistoline" else "{}.{}"
    for name, count in (("controlnet_blocks", double), ("controlnet_single_blocks", single)):
        for i in range(count):
            linear(projection.format(name, i), h, h, gain=0.5)
    linear("pos_embed_input", h, 64)
    hint = {"xlabs": ("input_hint_block", _XLABS_HINT), "mistoline": ("input_cond_block.encoder", _MISTOLINE_HINT)}
    if kind in hint:
        prefix, convs = hint[kind]
        for n, (c_in, c_out, k) in enumerate(convs):
            tensors[f"{prefix}.{2 * n}.weight"] = (torch.randn(c_out, c_in, k, k, generator=gen)
                                                   / (c_in * k * k) ** 0.5).to(dtype)
            tensors[f"{prefix}.{2 * n}.bias"] = (torch.randn(c_out, generator=gen) * _BIAS_STD).to(dtype)
    elif kind != "instantx":
        raise ValueError(f"unknown ControlNet kind {kind!r}")
    if union_modes:
        tensors["controlnet_mode_embedder.weight"] = torch.randn(union_modes, h, generator=gen).to(dtype)
    save_file(tensors, os.fspath(path), metadata={"format": "pt", "paradit_controlnet": kind})
    return os.fspath(path)


def write_sd3_controlnet(path: str | os.PathLike, config, blocks: int = 1, seed: int = 0, hint_channels: int = 16,
                         dual_attention_layers: tuple[int, ...] = (), layout: str = "comfy",
                         dtype: torch.dtype = torch.float32) -> str:
    """Deterministic random weights of an SD3 ControlNet of `blocks` joint blocks for the SD3 DiT `config`: in
    ComfyUI's comfy.cldm.mmdit layout (what the host hands the workers), or `layout` "diffusers" (an
    SD3ControlNetModel file as InstantX ships one, which ComfyUI's loader converts). Residual projections and the
    hint embedding get a sizeable scale, so a residual added to the wrong block or rows shows."""
    from .families import sd3_controlnet

    net = sd3_controlnet.SD3ControlNetConfig(
        dataclasses.replace(config, num_layers=blocks, dual_attention_layers=dual_attention_layers), hint_channels)
    shapes = sd3_controlnet.controlnet_shapes(net)
    for key, (shape, kind) in shapes.items():
        if key.startswith(("controlnet_blocks.", "pos_embed_input.")) and kind == "weight":
            shapes[key] = (shape, "mod")  # half the usual gain: residuals of O(0.5)
    comfy = _random_tensors(shapes, seed, dtype)
    if layout == "comfy":
        tensors = comfy
    else:
        tensors = {}
        for name, src in sd3_controlnet.source_map(net).items():
            t = comfy[src.key] if src.rows is None else comfy[src.key][src.rows]
            tensors[name] = apply_transform(t, src.transform).contiguous().clone()
    save_file(tensors, os.fspath(path), metadata={"format": "pt", "paradit_controlnet": "sd3"})
    return os.fspath(path)


def write_sd35_controlnet(path: str | os.PathLike, config, blocks: int = 1, double_y: bool = False, seed: int = 0,
                          dtype: torch.dtype = torch.float32) -> str:
    """Deterministic random weights of a Stability SD3.5 ControlNet of `blocks` image-only blocks for the SD3 DiT
    `config`, in ComfyUI's ControlNetEmbedder names and, as its files come, without the layers it takes from the DiT
    (the x embedder, or for a `double_y` one the first y embedder)."""
    from .families import sd3_controlnet

    net = sd3_controlnet.SD35ControlNetConfig(config.hidden_size, blocks, double_y,
                                              config.hidden_size if double_y else config.pooled_dim, 16)
    shapes = sd3_controlnet.sd35_controlnet_shapes(net)
    for key, (shape, kind) in shapes.items():
        if key.startswith(("controlnet_blocks.", "pos_embed_input.")) and kind == "weight":
            shapes[key] = (shape, "mod")  # half the usual gain: residuals of O(0.5)
    save_file(_random_tensors(shapes, seed, dtype), os.fspath(path), metadata={"format": "pt",
                                                                                "paradit_controlnet": "sd35"})
    return os.fspath(path)


def write_qwen_image_controlnet(path: str | os.PathLike, config, blocks: int = 1, seed: int = 0,
                                hint_channels: int = 64, dtype: torch.dtype = torch.float32) -> str:
    """Deterministic random weights of an InstantX Qwen-Image ControlNet of `blocks` blocks for the Qwen-Image DiT
    `config`, in ComfyUI's (= diffusers') names; `hint_channels` 68 for the inpainting one. Residual projections and
    the hint embedding at half the usual gain, so a residual on the wrong block or rows shows."""
    from .families import qwen_image_controlnet

    net = qwen_image_controlnet.QwenImageControlNetConfig(dataclasses.replace(config, num_layers=blocks),
                                                          hint_channels)
    shapes = qwen_image_controlnet.controlnet_shapes(net)
    for key, (shape, kind) in shapes.items():
        if key.startswith(("controlnet_blocks.", "controlnet_x_embedder.")) and kind == "weight":
            shapes[key] = (shape, "mod")
    save_file(_random_tensors(shapes, seed, dtype), os.fspath(path), metadata={"format": "pt",
                                                                                "paradit_controlnet": "qwen_image"})
    return os.fspath(path)
