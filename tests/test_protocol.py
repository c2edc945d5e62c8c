"""The control channel's message format: a JSON header, then the tensors as a safetensors blob that `encode`
writes itself (one copy per tensor) and safetensors' own parser reads back."""
from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load as st_load

from parallel_runtime.runtime.protocol import _HEADER, decode, encode


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (fp8 has no equality kernel; bytes compare every dtype exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_every_dtype_and_layout_comes_back_bit_for_bit():
    x = torch.arange(12.0).view(3, 4)
    tensors = {"f32": torch.randn(2, 3), "bf16": torch.randn(3, 5).bfloat16(), "f16": torch.randn(4).half(),
               "f64": torch.randn(2).double(), "fp8": torch.randn(6).to(torch.float8_e4m3fn),
               "fp8_e5m2": torch.randn(3).to(torch.float8_e5m2), "bool": torch.tensor([True, False, True]),
               "i64": torch.arange(7), "i32": torch.arange(3, dtype=torch.int32), "u8": torch.arange(5).to(torch.uint8),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "transposed": x.t(),
               "shared": x, "shared_again": x, "slice": x[1:, 2:]}  # a view, and one storage under two names
    kind, meta, got = decode(bytes(encode("job", {"steps": 4, "path": "m.safetensors"}, tensors)))
    assert (kind, meta) == ("job", {"steps": 4, "path": "m.safetensors"})
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bits(got[name]), _bits(t)), name


def test_the_blob_is_a_valid_safetensors_file():
    """What follows the JSON header is read by safetensors' own parser: its 8-byte-aligned header, offsets that
    tile the data exactly (the parser refuses gaps and overlaps)."""
    t = {"a": torch.randn(3, 3), "b": torch.arange(5, dtype=torch.int16)}
    message = bytes(encode("result", {}, t))
    (n,) = _HEADER.unpack_from(message)
    blob = message[_HEADER.size + n:]
    (index_bytes,) = struct.unpack_from("<Q", blob)
    assert index_bytes % 8 == 0
    back = st_load(blob)
    assert torch.equal(back["a"], t["a"]) and torch.equal(back["b"], t["b"])


def test_a_message_without_tensors_has_no_blob():
    message = encode("ping")
    (n,) = _HEADER.unpack_from(message)
    assert len(message) == _HEADER.size + n
    assert decode(bytes(message)) == ("ping", {}, {})


@pytest.mark.skipif(not hasattr(torch, "uint16"), reason="this torch has no uint16")
def test_a_dtype_outside_the_list_goes_through_safetensors_writer():
    t = {"u16": torch.arange(4, dtype=torch.int32).to(torch.uint16)}
    _, _, got = decode(bytes(encode("job", {}, t)))
    assert got["u16"].dtype == torch.uint16
    assert torch.equal(got["u16"].to(torch.int32), torch.arange(4, dtype=torch.int32))
