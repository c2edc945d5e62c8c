"""Lazy, per-rank reading of checkpoints: `.safetensors` here, `.gguf` in `gguf_file`, one interface.

Nothing here unpickles: only ``.safetensors`` and ``.gguf`` files are accepted, and tensors are read
one at a time (optionally only a range of rows) so a rank never touches weights it does
not own.
"""

from __future__ import annotations

import math
import os
from typing import Iterable

import torch
from safetensors import safe_open

from ..errors import ModelFileError
from .keymap import Rows, read_pieces

# safetensors dtype tags -> torch dtypes (only those torch knows in this build).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _tag, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"), ("U16", "uint16"),
                    ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        _DTYPES[_tag] = getattr(torch, _name)

_PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")


def open_checkpoint(path: str | os.PathLike):
    """A reader for a model file: a `GGUFCheckpoint` for `.gguf`, else a `CheckpointReader` (which refuses
    anything but safetensors with a sentence)."""
    if os.fspath(path).lower().endswith(".gguf"):
        from .gguf_file import GGUFCheckpoint

        return GGUFCheckpoint(path)
    return CheckpointReader(path)


class CheckpointReader:
    """Read-only, lazy view of one ``.safetensors`` file.

    ``keys()``, ``shape()`` and ``dtype()`` only look at the header; ``read()`` loads a
    single tensor (or a row range of it) and returns an independent copy.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        name = os.path.basename(self.path)
        lower = self.path.lower()
        if not lower.endswith(".safetensors"):
            if lower.endswith(_PICKLE_SUFFIXES):
                fix = "convert it to .safetensors (pickled checkpoints are never loaded)"
            else:
                fix = "convert it to .safetensors or .gguf"
            raise ModelFileError(f"{name} is not a .safetensors or .gguf file; {fix}.")
        if not os.path.exists(self.path):
            raise ModelFileError(
                f"Checkpoint {self.path} does not exist; put the model file there or pick an existing one."
            )
        if not os.path.isfile(self.path):
            raise ModelFileError(f"Checkpoint {self.path} is not a regular file; pick a .safetensors model file.")
        try:
            self._file = safe_open(self.path, framework="pt", device="cpu")
            self._keys = list(self._file.keys())
        except Exception as exc:  # SafetensorError, OSError, ...
            reason = str(exc) or type(exc).__name__
            raise ModelFileError(
                f"{self.path} is not a valid safetensors file ({reason}); re-download or re-save it."
            ) from exc
        self._key_set = frozenset(self._keys)
        self._closed = False
        self._quant_layers = None  # ComfyUI quantized layers (comfy_quant), read on first use

    # -- header-only queries -------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def metadata(self) -> dict[str, str]:
        self._check_open()
        return dict(self._file.metadata() or {})

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape; a ComfyUI-quantized weight's logical one (nvfp4 packs two values a byte)."""
        shape = self.stored_shape(key)
        if self.quant_format(key) == "nvfp4":
            shape = (shape[0], 2 * shape[1])
        return shape

    def stored_shape(self, key: str) -> tuple[int, ...]:
        """The shape of the tensor as stored (a quantized weight's packed data)."""
        return tuple(int(d) for d in self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype; float32 for a ComfyUI-quantized weight, which `read` dequantizes."""
        if self.quant_format(key) is not None:
            return torch.float32
        tag = self._slice(key).get_dtype()
        try:
            return _DTYPES[tag]
        except KeyError:
            raise ModelFileError(
                f"{self.path} stores {key!r} as {tag}, which this torch cannot load; re-save the model in bf16/fp16/fp32."
            ) from None

    def quant_layers(self) -> dict[str, dict]:
        """ComfyUI's quantized layers of this file (layer -> comfy_quant config); empty for a plain file."""
        if self._quant_layers is None:
            from . import comfy_quant

            self._quant_layers = comfy_quant.layer_formats(self)  # kept only when it succeeds
        return self._quant_layers

    def quant_format(self, key: str) -> str | None:
        """The ComfyUI quantized format of a weight ("nvfp4", "int8_tensorwise", ...), None for a plain tensor."""
        if not key.endswith(".weight"):
            return None
        conf = self.quant_layers().get(key[: -len(".weight")])
        return conf["format"] if conf else None

    def read_kept(self, key: str, rows: Rows, transform: str | None, device, cols: tuple[slice, ...] | None = None):
        """The rows (and columns) of a quantized weight as a rank keeps them (comfy_quant.ComfyQuantWeight)."""
        from . import comfy_quant

        layer = key[: -len(".weight")]
        return comfy_quant.read_rows(self, layer, self.quant_layers()[layer], rows, transform, device, cols)

    def stored_bytes(self, key: str) -> int:
        """Bytes of `key` in the file (a quantized weight with its scales)."""
        names = [key]
        if self.quant_format(key) is not None:
            from .comfy_quant import SCALES

            names += [k for k in (key[: -len(".weight")] + s for s in SCALES) if k in self]
        total = 0
        for name in names:
            sl = self._slice(name)
            total += _DTYPES[sl.get_dtype()].itemsize * math.prod(sl.get_shape())
        return total

    # -- data ----------------------------------------------------------------------
    def read(
        self,
        key: str,
        rows: Rows = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        cols: tuple[slice, ...] | None = None,
    ) -> torch.Tensor:
        """Load ``key`` (only ``rows`` of its first dimension and ``cols`` of its second when given: a tensor-parallel
        rank's part), cast and move it. A ComfyUI-quantized weight comes back dequantized (float32 unless `dtype`
        says otherwise)."""
        if self.quant_format(key) is not None:
            return self.read_kept(key, rows, None, device, cols).linear(None).effective_weight(dtype or torch.float32)
        return self.read_raw(key, rows, dtype, device, cols)

    def read_raw(self, key: str, rows: Rows = None, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", cols: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``key`` as stored (only ``rows`` and ``cols`` when given), cast and moved: a quantized weight's raw data."""
        sl = self._slice(key)
        try:
            if rows is None and cols is None:
                tensor = self._file.get_tensor(key)
            else:
                tensor = read_pieces(lambda index: sl[index], rows, cols, torch.cat)
        except Exception as exc:
            raise ModelFileError(
                f"{self.path} is not a valid safetensors file (cannot read {key!r}: {exc}); re-download or re-save it."
            ) from exc
        # Moved in the file's dtype, then cast where it lands: one .to(device, dtype) would convert on the host
        # before an upload (a GPU worker's one share of the cores), where the device does the same IEEE conversion.
        if torch.device(device) != tensor.device:
            tensor = tensor.to(device)
        if dtype is not None:
            tensor = tensor.to(dtype)
        if tensor.device.type == "cpu" and tensor.data_ptr() % 64:
            # safetensors hands back tensors inside a Python buffer, not 64-byte aligned. BLAS
            # kernels take different (slower, differently rounded) paths for such weights, so
            # give every tensor its own aligned storage: identical numbers -> identical outputs.
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return tensor

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._file.__exit__(None, None, None)
            except Exception:
                pass
            self._file = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):  # best effort
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"CheckpointReader({self.path!r}, {len(self._keys)} tensors)"

    # -- internals -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"CheckpointReader for {self.path} is closed")

    def _slice(self, key: str):
        self._check_open()
        if key not in self._key_set:
            raise ModelFileError(
                f"{self.path} has no tensor {key!r}; the file is incomplete or not the model expected, so re-download it."
            )
        return self._file.get_slice(key)


def _tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers that are not on the meta device."""
    return sum(t.numel() * t.element_size() for t in _tensors(module) if t.device.type != "meta")
