"""Lazy, per-rank reading of GGUF diffusion-model files (ComfyUI-GGUF's `.gguf` DiTs).

The `gguf` package parses the file (memory-mapped; nothing is unpickled) and this class gives it the same
interface as `checkpoint.CheckpointReader`: header-only `keys`/`shape`/`dtype`, and `read` of one tensor (or a
range of its rows), dequantized. A quantized linear weight is instead taken as its raw blocks
(`read_quantized`), which the rank keeps and dequantizes per layer when it runs (`GGUFLinear`).

Tensor names are the original checkpoint's (ComfyUI-GGUF's converter keeps them), so the model families
detect a GGUF file by its keys exactly as they detect a safetensors one; `general.architecture` only turns
away what is not an image model (a GGUF text encoder or LLM) with a sentence of its own.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy
import torch
import torch.nn.functional as F

from ..errors import ConfigError, ModelFileError
from . import gguf_quants
from .keymap import Rows, apply_transform, read_pieces
from .storage import KeptLinear

# `general.architecture` values of the image models ComfyUI-GGUF converts (its IMG_ARCH_LIST) and the names
# users know them by; any other value is a text encoder, an LLM or a vision tower.
IMAGE_ARCHITECTURES = {"flux": "Flux", "sd3": "SD3", "qwen_image": "Qwen-Image",
                       "qwen_image21": "Qwen-Image 2.1", "chroma": "Chroma",
                       "pixart": "PixArt", "sd1": "SD1.x", "sdxl": "SDXL", "aura": "AuraFlow",
                       "hidream": "HiDream", "cosmos": "Cosmos", "ltxv": "LTX-Video", "hyvid": "HunyuanVideo",
                       "wan": "Wan", "lumina2": "Lumina 2"}
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a pinned requirement
        raise ModelFileError("reading .gguf files needs the 'gguf' package; pip install gguf==0.19.0 into "
                             "ComfyUI's Python.") from None
    return gguf


class GGUFCheckpoint:
    """Read-only, lazy view of one ``.gguf`` diffusion model; see the module docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        if not os.path.isfile(self.path):
            raise ModelFileError(f"Checkpoint {self.path} does not exist or is not a file; put the model file "
                                 f"there or pick an existing one.")
        gguf = _gguf()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._file = gguf.GGUFReader(self.path, "r")
            tensors = {t.name: t for t in self._file.tensors}
        except Exception as exc:  # bad magic, truncated header or data, unknown tensor type...
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFileError(f"{self.name} is not a valid GGUF file ({reason}); the download is incomplete "
                                 f"or damaged, so re-download it.") from exc
        self._check_architecture()
        self._tensors = tensors
        self._keys = list(tensors)
        self._formats = {k: t.tensor_type.name for k, t in tensors.items()}
        self._shapes = {k: self._logical_shape(t) for k, t in tensors.items()}
        for key, fmt in self._formats.items():
            if fmt not in _PLAIN and fmt not in gguf_quants.BLOCKS and not self._numpy_can_dequantize(fmt):
                raise ModelFileError(f"{self.name} stores {key!r} as GGUF type {fmt}, which ParaDiT cannot read; "
                                     f"use a Q8_0, Q6_K, Q5_K, Q4_K, Q4_0 or F16 release of the model.")

    # -- header-only queries -------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def metadata(self) -> dict[str, str]:
        if self._file is None:
            raise ValueError(f"GGUFCheckpoint for {self.path} is closed")
        return {"format": "gguf", **({"architecture": self.architecture} if self.architecture else {})}

    def shape(self, key: str) -> tuple[int, ...]:
        self._tensor(key)
        return self._shapes[key]

    def dtype(self, key: str) -> torch.dtype:
        """The dtype `read` returns by default: the stored one for F32/F16/BF16, float32 for quantized data."""
        return _PLAIN.get(self._format(key), torch.float32)

    def quant_layers(self) -> dict[str, dict]:
        """ComfyUI's quantized layers (comfy_quant): a safetensors-only layout, none in a GGUF file."""
        return {}

    def quant_format(self, key: str) -> str | None:
        """The block format of a quantized tensor ("Q4_K"), None for one stored as plain floats."""
        fmt = self._format(key)
        return None if fmt in _PLAIN else fmt

    def stored_bytes(self, key: str) -> int:
        """Bytes of `key` in the file (its blocks, for a quantized tensor)."""
        return int(self._tensor(key).n_bytes)

    # -- data ----------------------------------------------------------------------
    def read(self, key: str, rows: Rows = None, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu", cols: tuple[slice, ...] | None = None) -> torch.Tensor:
        """`key` (only `rows` of its first dimension and `cols` of its second when given), dequantized, cast and
        moved."""
        fmt, shape = self._format(key), self._shapes[key]
        # Moved as stored, then dequantized and cast on the device (as checkpoint.CheckpointReader.read_raw).
        if fmt in _PLAIN:
            data = self._raw(key, rows, self._stored_columns(key, cols))
            value = data.view(_PLAIN[fmt]) if fmt == "BF16" else data
            value = value.reshape(self._part_shape(shape, rows, cols))
            value = _own(value, value.to(device))
        else:
            raw, part = self.read_quantized(key, rows, device, cols), self._part_shape(shape, rows, cols)
            value = dequantize_blocks(raw, fmt, part)
        return value.to(dtype or value.dtype).contiguous()

    def read_quantized(self, key: str, rows: Rows = None, device: str | torch.device = "cpu",
                       cols: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The raw blocks of a quantized tensor's `rows` (and `cols`: whole blocks only) as uint8 [rows, bytes per
        row]."""
        shape = self._shapes[key]
        raw = self._raw(key, rows, self._stored_columns(key, cols))
        raw = raw.reshape(-1, raw.shape[-1] if len(shape) > 1 else raw.numel())
        return _own(raw, raw.to(device))

    def read_kept(self, key: str, rows: Rows, transform: str | None, device, cols: tuple[slice, ...] | None = None):
        """The raw blocks of a quantized weight's `rows` (and `cols`) as a rank keeps them (GGUFWeight)."""
        blocks = apply_transform(self.read_quantized(key, rows=rows, device=device, cols=cols), transform)
        width = self.shape(key)[1] if cols is None else sum(c.stop - c.start for c in cols)
        return GGUFWeight(blocks, self.quant_format(key), (blocks.shape[0], width))

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        self._file, self._tensors = None, {}  # drops the memory map (the tensors' data are views of it)

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({self.path!r}, {len(self._keys)} tensors)"

    # -- internals -----------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        return self._string_field("general.architecture")

    def _check_architecture(self) -> None:
        arch = self.architecture
        if arch is None or arch in IMAGE_ARCHITECTURES:
            return  # no field (stable-diffusion.cpp files): the keys decide
        raise ModelFileError(f"{self.name} is a GGUF of a '{arch}' model (a text encoder, LLM or vision tower), "
                             f"not a diffusion transformer; load it with a text-encoder loader and pick a DiT "
                             f"file in Load Parallel DiT.")

    def _string_field(self, name: str) -> str | None:
        field = self._file.get_field(name) if self._file is not None else None
        if field is None or not field.data:
            return None
        try:
            return bytes(field.parts[field.data[-1]]).decode("utf-8")
        except (UnicodeDecodeError, TypeError, IndexError):
            return None

    def _logical_shape(self, tensor) -> tuple[int, ...]:
        """The tensor's torch shape: GGUF stores dims fastest-first; ComfyUI-GGUF's converter records the
        original shape of tensors it had to reshape (5-D convs) in `comfy.gguf.orig_shape.<name>`."""
        field = self._file.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
        if field is not None:
            return tuple(int(field.parts[i][0]) for i in field.data)
        return tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def _tensor(self, key: str):
        if self._file is None:
            raise ValueError(f"GGUFCheckpoint for {self.path} is closed")
        try:
            return self._tensors[key]
        except KeyError:
            raise ModelFileError(f"{self.path} has no tensor {key!r}; the file is incomplete or not the model "
                                 f"expected, so re-download it.") from None

    def _format(self, key: str) -> str:
        self._tensor(key)
        return self._formats[key]

    def _raw(self, key: str, rows: Rows, cols: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The stored data of `rows` and `cols` (columns of the stored row: values, or bytes of blocks)."""
        data = self._tensor(key).data
        if rows is not None or cols is not None:
            data = read_pieces(lambda index: data.reshape(self._shapes[key][0], -1)[index], rows, cols,
                               lambda parts, dim: numpy.concatenate(parts, axis=dim))
        with warnings.catch_warnings():  # a read-only memory map: we copy before anyone writes
            warnings.simplefilter("ignore")
            return torch.from_numpy(data)

    def _stored_columns(self, key: str, cols: tuple[slice, ...] | None) -> tuple[slice, ...] | None:
        """Where columns `cols` lie in each stored row: the same columns of an F32/F16 tensor, the bytes of whole
        blocks of a BF16 or quantized one; a cut inside a block is refused in one sentence (a tensor-parallel rank
        would need another rank's bytes to dequantize it)."""
        fmt = self._format(key)
        if cols is None or fmt in ("F32", "F16"):
            return cols
        gguf = _gguf()
        values, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, fmt)]
        for c in cols:
            if c.start % values or c.stop % values:
                cut = c.start if c.start % values else c.stop
                raise ConfigError(f"tensor parallelism would cut {key} at column {cut}, inside one of its {fmt} "
                                  f"blocks of {values} values; pick a lower tensor_degree or a GGUF of smaller blocks "
                                  f"(Q8_0's hold 32 values).")
        return tuple(slice(c.start // values * size, c.stop // values * size) for c in cols)

    @staticmethod
    def _part_shape(shape: tuple[int, ...], rows: Rows, cols: tuple[slice, ...] | None) -> tuple[int, ...]:
        if rows is not None:
            runs = rows if isinstance(rows, tuple) else (rows,)
            shape = (sum(len(range(*r.indices(shape[0]))) for r in runs), *shape[1:])
        if cols is not None:
            shape = (shape[0], sum(c.stop - c.start for c in cols), *shape[2:])
        return shape

    @staticmethod
    def _numpy_can_dequantize(fmt: str) -> bool:
        gguf = _gguf()
        return getattr(gguf.GGMLQuantizationType, fmt, None) in getattr(gguf.quants, "_type_traits", {})


def _own(source: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """`moved` as a tensor of its own: a copy only where `.to` returned a view of the memory-mapped file."""
    return moved.clone() if moved.data_ptr() == source.data_ptr() else moved


def dequantize_blocks(raw: torch.Tensor, fmt: str, shape: tuple[int, ...],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw rows of `fmt` blocks -> `dtype` values of `shape`: torch for the formats `gguf_quants` knows (on the
    blocks' device), else the `gguf` package's numpy reference on the CPU (slow, as in ComfyUI-GGUF)."""
    if fmt in gguf_quants.BLOCKS:
        return gguf_quants.dequantize(raw, fmt, shape, dtype)
    gguf = _gguf()
    values = gguf.quants.dequantize(raw.cpu().numpy(), getattr(gguf.GGMLQuantizationType, fmt))
    return torch.from_numpy(values).reshape(shape).to(device=raw.device, dtype=dtype)


class GGUFLinear(KeptLinear):
    """A Linear whose weight stays in GGUF blocks on the rank (uint8 [out, bytes per row], a buffer: it is not a
    float parameter); each call dequantizes it to the input's dtype, as ComfyUI-GGUF's layers do. A LoRA is
    applied per call too (`patch`, see patches.PatchedPerCall), so the patched weight is never held."""

    def __init__(self, blocks: torch.Tensor, quant_format: str, shape: tuple[int, int], bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = shape
        self.quant_format = quant_format
        self.register_buffer("weight_blocks", blocks)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight_blocks, self.quant_format, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.patch(self, x.dtype) if self.patch is not None else self.dequantized(x.dtype)
        return F.linear(x, weight, self.bias.to(x.dtype) if self.bias is not None else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.quant_format}"


@dataclass
class GGUFWeight:
    """A linear weight a rank keeps in GGUF blocks: its rows' raw bytes and the block format."""

    blocks: torch.Tensor
    quant_format: str
    shape: tuple[int, int]

    def linear(self, bias: torch.Tensor | None, storage=None) -> torch.nn.Module:
        return GGUFLinear(self.blocks.contiguous(), self.quant_format, self.shape, bias)
