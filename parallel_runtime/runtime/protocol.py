"""Messages on the control channel between the client and its workers.

A message is a JSON header plus an optional safetensors blob: tensors cross the channel as raw bytes
with dtype and shape, never as pickles, so a peer can send data but never code. The channel itself is
an authenticated AF_UNIX socket in a private directory, or loopback TCP where Python has no AF_UNIX (see
client.py).
"""
from __future__ import annotations

import json
import struct
from collections import OrderedDict

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..strategies.control import HINTS_KEPT

_HEADER = struct.Struct("<I")


# safetensors' names of the dtypes a message carries (its format's spelling; little-endian, as every host here).
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2"}


def encode(kind: str, meta: dict | None = None, tensors: dict[str, torch.Tensor] | None = None) -> bytearray:
    """One message: its JSON header, then the tensors as a safetensors blob (`decode` reads it with safetensors'
    own parser). The blob is written here, each tensor copied once into the message: safetensors' `save` copies a
    tensor three times and the message once more (16 ms of a 12.6 MB pixel latent's 18 ms, on every model call of
    a stock sampler, both ways)."""
    header = json.dumps({"kind": kind, "meta": meta or {}}).encode()
    tensors = {name: t.detach().cpu() for name, t in (tensors or {}).items()}
    if any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):
        blob = st_save(_unshared(tensors))  # a dtype not listed: safetensors' own writer knows every one it has
        return bytearray(_HEADER.pack(len(header)) + header + blob)
    entries, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    index = json.dumps(entries, separators=(",", ":")).encode() if tensors else b""
    index += b" " * (-len(index) % 8)  # safetensors pads its header so that the data starts 8-byte aligned
    start = _HEADER.size + len(header) + (8 + len(index) if tensors else 0)
    message = bytearray(start + offset)
    message[:start] = (_HEADER.pack(len(header)) + header
                       + (struct.pack("<Q", len(index)) + index if tensors else b""))
    if offset:
        body = torch.frombuffer(message, dtype=torch.uint8, count=offset, offset=start)
        for name, t in tensors.items():
            begin, end = entries[name]["data_offsets"]
            if end > begin:
                body[begin:end].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return message


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors safetensors can write: it refuses two names on one storage, which a graph makes when the
    positive and negative share a tensor (one reference latent, one ConditioningZeroOut'd prompt)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    return out


def decode(buf: bytes) -> tuple[str, dict, dict[str, torch.Tensor]]:
    (n,) = _HEADER.unpack_from(buf)
    header = json.loads(buf[_HEADER.size:_HEADER.size + n])
    blob = buf[_HEADER.size + n:]
    tensors = st_load(bytes(blob)) if blob else {}
    return header["kind"], header["meta"], tensors


class Channel:
    """A multiprocessing Connection speaking `encode`/`decode`, safe to send on from two threads."""

    def __init__(self, conn):
        import threading

        self.conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, meta: dict | None = None, tensors: dict | None = None) -> None:
        self.send_bytes(encode(kind, meta, tensors))

    def send_bytes(self, data: bytes) -> None:
        """Send an already encoded message (one encoding for every worker of a job)."""
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self, maxlength: int | None = None) -> tuple[str, dict, dict]:
        """The next message; with `maxlength`, a longer one is refused unread (a reader that expects small ones)."""
        return decode(self.conn.recv_bytes() if maxlength is None else self.conn.recv_bytes(maxlength))

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


# LoRA stacks (WeightPatches) the workers keep by id: one per resident model, so the two experts of a Wan 2.2 graph,
# each with its own step-distillation LoRA, take turns without the client re-sending either stack.
PATCH_SETS_KEPT = 2


def keep_hints(kept: OrderedDict, named: list[str], new: dict) -> None:
    """The ControlNet hints a client and its workers hold, updated in lockstep after each job: the job's new
    hints join, the ones it names move to the back, and the least recently named others leave past
    HINTS_KEPT. The client keeps only the keys (values None), so it sends each hint once."""
    for key, value in new.items():
        kept[key] = value
    for key in named:
        kept.move_to_end(key)
    for key in list(kept):
        if len(kept) <= HINTS_KEPT:
            break
        if key not in named:
            del kept[key]


def keep_recent(kept: OrderedDict, key, value, limit: int) -> None:
    """`key` (with `value`) becomes the most recent of `kept`, and the least recent ones leave past `limit`: the
    client and its workers apply the same rule after each job, so they agree on what the workers hold."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > limit:
        kept.popitem(last=False)
