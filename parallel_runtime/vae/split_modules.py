"""Split versions of a VAE decoder's modules: the same maths on a band of rows, exact up to round-off.

`plan_split(model)` walks the modules a decode runs and sorts each into what it needs on a band of rows:

- row-local (nothing to do): 1x1 convolutions, activations, dropout, per-pixel norms over channels (Wan's RMS norm),
  nearest and duplicating upsampling, reshapes;
- convolutions with a kernel taller than one row (Conv2d / Conv3d, and Wan's CausalConv3d, which pads itself and is
  called as forward(x, cache_x) with the previous frames' rows): the band runs the module's own forward, whose zero
  padding is right at the image's edges, then recomputes its first and last halo-many output rows from a thin strip
  of the neighbouring band's rows (for a causal convolution, its time-cached rows too). No padded copy of the band:
  memory stays the unsplit module's;
- GroupNorm: each band's per-group count, mean and centred sum of squares, combined across bands in band order
  (Chan's parallel variance: as stable as two passes, one exchange), then the usual normalisation;
- attention at the decoder's lowest resolution (ComfyUI's LDM `AttnBlock`, Wan's `AttentionBlock`): each band's
  queries attend to the keys and values gathered from all bands.

Anything else with a reach across rows (an unknown block, a stride, a transposed convolution, replicate padding) makes
the decoder not exactly splittable; `plan_split` says which module and why. Blocks are recognised by module path and
class name (their forward code was read: it only calls the modules above and row-local tensor ops); torch's own
layers by type. The split forwards are installed on the module instances and act only in a thread that has joined a
band group (`exchange.joined`): elsewhere, e.g. ComfyUI's own VAEDecode on the same module, they run the original.
This package never imports ComfyUI.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import exchange

# Blocks whose forward code only calls their child modules and row-local tensor ops (nearest upsampling, reshapes
# over channels and time, the per-frame causal cache), and row-local leaves, by module path and class name.
KNOWN_CLASSES: dict[str, set[str]] = {
    "comfy.ldm.models.autoencoder": {"AutoencodingEngine", "AutoencodingEngineLegacy", "AutoencoderKL"},
    "comfy.ldm.modules.diffusionmodules.model": {"Decoder", "ResnetBlock", "Upsample", "AttnBlock"},
    "comfy.ldm.wan.vae": {"WanVAE", "Decoder3d", "ResidualBlock", "Resample", "AttentionBlock", "RMS_norm",
                          "CausalConv3d"},
    "comfy.ldm.wan.vae2_2": {"WanVAE", "Decoder3d", "ResidualBlock", "Resample", "Up_ResidualBlock", "DupUp3D"},
}
ATTENTION_KINDS = {"AttnBlock": ("q", "k", "v", "proj_out", "norm"), "AttentionBlock": ("to_qkv", "proj", "norm")}
GROUP_CHUNK = 4  # GroupNorm groups widened to float32 at a time (half-precision inputs)
# Children of an autoencoder that only its encode runs.
ENCODE_ONLY = frozenset({"encoder", "quant_conv", "regularization", "loss"})
LOCAL_TORCH_LEAVES = (nn.SiLU, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout)
# ComfyUI's Decoder also groups its levels in bare nn.Module()s.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclasses.dataclass
class SplitPlan:
    split: list[tuple[nn.Module, str]]  # (module, kind) whose forward is replaced
    refusals: list[str]  # why the decoder is not exactly splittable (empty: it is)

    @property
    def exact(self) -> bool:
        return not self.refusals


def plan_split(model: nn.Module, known: dict[str, set[str]] | None = None) -> SplitPlan:
    """What each module of `model`'s decode needs on a band of rows. `known` adds classes to KNOWN_CLASSES (tests
    use it for their own small blocks)."""
    names = {path: set(classes) for path, classes in KNOWN_CLASSES.items()}
    for path, classes in (known or {}).items():
        names.setdefault(path, set()).update(classes)
    split, refusals = [], []
    for name, module in _decode_modules(model):
        kind, reason = _classify(module, names)
        if reason:
            refusals.append(f"{name or 'the model'} ({type(module).__name__}): {reason}")
        elif kind not in ("block", "local"):
            split.append((module, kind))
    return SplitPlan(split, refusals)


def install(plan: SplitPlan) -> None:
    """Give each module of the plan its split forward (once; a deep copy keeps it, bound to the copy)."""
    for module, kind in plan.split:
        if getattr(module, "_paradit_split", None) != kind:
            module.forward = functools.partial(SPLIT_FORWARDS[kind], module)
            module._paradit_split = kind


def _decode_modules(model: nn.Module):
    for name, module in model.named_modules():
        if name.split(".")[0] not in ENCODE_ONLY:
            yield name, module


def _classify(module: nn.Module, known: dict[str, set[str]]) -> tuple[str | None, str | None]:
    """(kind, None) or (None, why the module keeps the decoder from an exact row split)."""
    cls = type(module)
    # torch's layers and ComfyUI's casting wrappers of them (comfy.ops) keep torch's maths; anything else whose
    # forward was not read may do something else, even when it subclasses a convolution.
    if not (cls.__module__.startswith("torch.nn.modules.") or cls.__module__ == "comfy.ops"
            or cls.__name__ in known.get(cls.__module__, ())):
        return None, "a block the exact split does not know (its forward may mix rows)"
    if isinstance(module, nn.modules.conv._ConvNd):
        return _classify_conv(module)
    if isinstance(module, nn.GroupNorm):
        return "group_norm", None
    if isinstance(module, LOCAL_TORCH_LEAVES):
        return "local", None
    if isinstance(module, nn.Upsample):
        scales = module.scale_factor if isinstance(module.scale_factor, tuple) else (module.scale_factor,)
        if module.mode in ("nearest", "nearest-exact") and module.size is None and all(
                s is not None and float(s).is_integer() for s in scales):
            return "local", None
        return None, f"upsampling mode {module.mode!r} / scale {module.scale_factor} mixes rows"
    attrs = ATTENTION_KINDS.get(cls.__name__)
    if attrs is not None:
        if not all(hasattr(module, a) for a in attrs):
            return None, "an attention block without the expected projections"
        return "attention_" + ("ldm" if "q" in attrs else "wan"), None
    if cls.__module__.startswith("torch.nn.modules.") and not (cls is nn.Module or isinstance(module, CONTAINERS)):
        return None, "a torch layer the exact split does not know"
    return ("block" if any(True for _ in module.children()) else "local"), None


def _classify_conv(conv: nn.modules.conv._ConvNd) -> tuple[str | None, str | None]:
    causal = getattr(conv, "_padding", None)
    if conv.transposed:
        return None, "a transposed convolution"
    if isinstance(conv.padding, str):
        return None, f"padding {conv.padding!r}"
    if causal is not None:  # pads itself (W, W, H, H, T, 0) with zeros; its own padding is 0
        if len(causal) != 6 or any(conv.padding) or causal[2] != causal[3]:
            return None, f"a self-padding convolution with padding {tuple(causal)}"
        pad_rows = causal[2]
    else:
        pad_rows = conv.padding[-2]
        if any(conv.padding) and conv.padding_mode != "zeros":
            return None, f"{conv.padding_mode} padding"
    rows = conv.kernel_size[-2]
    if conv.stride[-2] != 1 or conv.dilation[-2] != 1:
        return None, f"stride {conv.stride} / dilation {conv.dilation} over rows"
    if rows == 1:
        return ("local", None) if pad_rows == 0 else (None, "zero rows padded around a 1-row kernel")
    if 2 * pad_rows != rows - 1:
        return None, f"kernel {rows} rows high with padding {pad_rows} (not 'same')"
    return ("causal_conv" if causal is not None else "conv"), None


# -- split forwards ---------------------------------------------------------------------------------------------
# Each runs the original forward outside a band group (and in a group of one), and makes exactly the same exchanges
# in every band: the bands run the same modules in the same order, so their exchanges pair up.


def _conv_forward(conv, x, *args, **kwargs):
    out = type(conv).forward(conv, x, *args, **kwargs)
    member = exchange.current()
    if member is not None and member.size > 1:
        pad = list(conv.padding)
        pad[-2] = 0
        _fix_edge_rows(member, out, lambda lo, hi: x[..., lo:hi, :], conv.padding[-2],
                       lambda strip: _conv_nd(conv, strip, tuple(pad)))
    return out


def _causal_conv_forward(conv, x, cache_x=None, cache_list=None, cache_idx=None):
    """Wan's CausalConv3d: the time cache (this band's rows of the previous frames) goes before x in time, then zero
    padding in time, width and, at the image's edges, rows."""
    if cache_list is not None:  # the cache is handed over and dropped from the list, as the original does
        cache_x = cache_list[cache_idx]
        cache_list[cache_idx] = None
    out = type(conv).forward(conv, x, cache_x)
    member = exchange.current()
    if member is not None and member.size > 1:
        pad = list(conv._padding)
        use_cache = cache_x is not None and pad[4] > 0
        if use_cache:
            pad[4] -= cache_x.shape[2]
        pad[2] = pad[3] = 0

        def rows(lo, hi):  # rows lo:hi of the convolution's input before its row padding
            part = x[..., lo:hi, :]
            return torch.cat([cache_x[..., lo:hi, :].to(x.device), part], 2) if use_cache else part

        _fix_edge_rows(member, out, rows, conv._padding[2],
                       lambda strip: F.conv3d(F.pad(strip, pad), _param(conv.weight, strip),
                                              _param(conv.bias, strip), conv.stride, 0, conv.dilation, conv.groups))
    return out


def _fix_edge_rows(member, out, rows, halo, conv_strip) -> None:
    """Overwrite the band's first and last `halo` output rows (the module computed them against zero padding) with
    what a whole-image convolution gives: each from a strip of the neighbour's `halo` rows and the band's own first
    (last) 2 * halo input rows, convolved without row padding. `rows(lo, hi)` gives input rows lo:hi."""
    height = out.shape[-2]
    if height < 2 * halo:
        raise RuntimeError(f"a band of {height} rows is too short for a {2 * halo + 1}-row kernel; use fewer devices "
                           f"for a latent this short.")
    above, below = member.trade_edges(rows(0, halo), rows(height - halo, height))
    if above is not None:
        out[..., :halo, :] = conv_strip(torch.cat([above, rows(0, 2 * halo)], -2))
    if below is not None:
        out[..., height - halo:, :] = conv_strip(torch.cat([rows(height - 2 * halo, height), below], -2))


def _conv_nd(conv, strip, padding):
    fn = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[strip.ndim]
    return fn(strip, _param(conv.weight, strip), _param(conv.bias, strip), conv.stride, padding, conv.dilation,
              conv.groups)


def _param(p, like):
    """A weight in the input's dtype and on its device (ComfyUI may keep weights offloaded or in another dtype)."""
    return None if p is None else p.to(device=like.device, dtype=like.dtype)


def _group_norm_forward(norm, x):
    member = exchange.current()
    if member is None or member.size == 1:
        return type(norm).forward(norm, x)
    b, c, groups = x.shape[0], x.shape[1], norm.num_groups
    xg = x.reshape(b, groups, -1)
    mean, m2 = _group_stats(xg)
    count = torch.full_like(mean, xg.shape[-1])
    parts = member.gather_list(torch.stack([count, mean, m2]))
    count, mean, m2 = parts[0].unbind(0)
    for part in parts[1:]:  # Chan et al.'s pairwise combination, in band order
        n_b, mean_b, m2_b = part.unbind(0)
        total = count + n_b
        delta = mean_b - mean
        mean = mean + delta * (n_b / total)
        m2 = m2 + m2_b + delta * delta * (count * n_b / total)
        count = total
    per_group = c // groups
    scale = torch.rsqrt(m2 / count + norm.eps).unsqueeze(-1).expand(b, groups, per_group)  # [b, groups, per_group]
    if norm.weight is not None:
        scale = scale * norm.weight.to(device=scale.device, dtype=scale.dtype).view(1, groups, per_group)
    bias = None if norm.bias is None else norm.bias.to(device=x.device, dtype=torch.float32).view(groups, per_group)
    # (x - mean) * scale + bias in float32 as torch's GroupNorm, a few groups at a time: one output of x's size.
    xc = x.reshape(b, groups, per_group, -1)
    y = torch.empty_like(xc)
    for first in range(0, groups, GROUP_CHUNK):
        part = slice(first, first + GROUP_CHUNK)
        out = xc[:, part].float() - mean[:, part, None, None]
        out.mul_(scale[:, part, :, None])
        if bias is not None:
            out.add_(bias[part, :, None])
        y[:, part] = out
    return y.reshape(x.shape)


def _group_stats(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per [batch, group]: mean and centred sum of squares of this band's values, in float32 (half-precision
    inputs are widened a few groups at a time, not the whole band at once)."""
    if xg.dtype == torch.float32:
        var, mean = torch.var_mean(xg, dim=-1, correction=0)
    else:
        pairs = [torch.var_mean(chunk.float(), dim=-1, correction=0) for chunk in xg.split(GROUP_CHUNK, dim=1)]
        var, mean = torch.cat([v for v, _ in pairs], 1), torch.cat([m for _, m in pairs], 1)
    return mean, var * xg.shape[-1]


def _attention(q, k, v):
    """Single-head attention over channels as ComfyUI's VAE attention computes it: q [B, C, h, W] of this band's
    pixels, k and v [B, C, H, W] of the whole image; scale 1/sqrt(C)."""
    b, c = q.shape[:2]
    shape = q.shape
    q, k, v = (t.reshape(b, 1, c, -1).transpose(2, 3) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(shape)


def _ldm_attention_forward(block, x):
    """ComfyUI's LDM AttnBlock (Flux, SD3, SD and PixArt VAEs): GroupNorm, 1x1 q/k/v, attention, 1x1 out."""
    member = exchange.current()
    if member is None or member.size == 1:
        return type(block).forward(block, x)
    h = block.norm(x)
    q, k, v = block.q(h), block.k(h), block.v(h)
    del h
    out = _attention(q, member.all_gather(k, -2), member.all_gather(v, -2))
    return x + block.proj_out(out)


def _wan_attention_forward(block, x):
    """Wan's AttentionBlock: per frame, RMS norm over channels, one 1x1 conv to q/k/v, attention, 1x1 out."""
    member = exchange.current()
    if member is None or member.size == 1:
        return type(block).forward(block, x)
    b, c, t, h, w = x.shape
    frames = x.transpose(1, 2).reshape(b * t, c, h, w)  # [(b t), c, h, w], batch-major as the original
    q, k, v = block.to_qkv(block.norm(frames)).chunk(3, dim=1)
    out = block.proj(_attention(q, member.all_gather(k, -2), member.all_gather(v, -2)))
    return out.reshape(b, t, c, h, w).transpose(1, 2) + x


SPLIT_FORWARDS = {"conv": _conv_forward, "causal_conv": _causal_conv_forward, "group_norm": _group_norm_forward,
                  "attention_ldm": _ldm_attention_forward, "attention_wan": _wan_attention_forward}
