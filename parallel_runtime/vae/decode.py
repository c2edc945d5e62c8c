"""Running one decode as bands of rows, one Python thread per band, each on its own device and decoder replica.

`run_bands(latent, replicas, decode)` cuts the latent's rows into near-equal bands, runs `decode(replica, band)`
in every band's thread inside a band group (so the replica's split modules trade halos, statistics and keys), and
stacks the bands' outputs along rows. `replica_for(model, device)` makes the decoder copy a band runs: its
parameters shared with `model` where the device is the same (no copy of the weights), copied onto the device
otherwise. Both are plain torch: the caller (the ComfyUI node, the bench, the tests) picks the model and the call.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Callable

import torch
from torch import nn

from . import exchange
from .bands import band_rows

# Threads waiting at a band barrier give up after this long (a band stuck in a kernel, a deadlock bug): every
# band then raises instead of ComfyUI hanging.
BARRIER_TIMEOUT_S = 600.0


def replica_for(model: nn.Module, device: torch.device | str, leave_out: tuple[str, ...] = ("encoder",)) -> nn.Module:
    """A deep copy of `model` for a band on `device`: the module tree (with any split forwards) is new; parameters
    and buffers are `model`'s own where they already live on `device`, else copied there (never via another
    device). The children named in `leave_out` (the encoder: a decode never runs it) are empty modules in the copy
    (Wan 2.2's decode still counts the encoder's convolutions, finding none)."""
    device = torch.device(device)
    memo: dict[int, object] = {id(child): nn.Module() for name, child in model.named_children() if name in leave_out}
    kept = [model] + [child for name, child in model.named_children() if name not in leave_out]
    for tensor in {id(t): t for m in kept for t in _tensors(m, recurse=m is not model)}.values():
        if same_device(tensor.device, device):
            memo[id(tensor)] = tensor
        else:
            moved = tensor.detach().to(device, copy=True)
            memo[id(tensor)] = nn.Parameter(moved, requires_grad=False) if isinstance(tensor, nn.Parameter) else moved
    return copy.deepcopy(model, memo)


def _tensors(module: nn.Module, recurse: bool) -> list[torch.Tensor]:
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def on_device(model: nn.Module, device: torch.device | str) -> bool:
    """Whether every parameter and buffer of `model` is on `device` (a replica whose source moved is stale)."""
    device = torch.device(device)
    return all(same_device(t.device, device) for t in [*model.parameters(), *model.buffers()])


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    index = torch.cuda.current_device
    return (a.index if a.index is not None else index()) == (b.index if b.index is not None else index())


def run_bands(latent: torch.Tensor, replicas: list[tuple[nn.Module, torch.device]],
              decode: Callable[[nn.Module, torch.Tensor], torch.Tensor], *, out_device: torch.device | str = "cpu",
              out_dtype: torch.dtype | None = None, cpu_threads: int | None = None,
              context_rows: int = 0, around: Callable[[int], contextlib.AbstractContextManager] | None = None
              ) -> torch.Tensor:
    """Decode `latent` ([B, C, H, W] or [B, C, T, H, W]) as len(replicas) bands of its rows (dim -2), band k in
    its own thread on replicas[k]; returns the bands' outputs stacked along rows on `out_device`.

    `context_rows` > 0 (a decode that is not split exactly): each band decodes that many more latent rows above
    and below its own where the image has them, and keeps only its own rows of the output. `around(rank)`, if
    given, is a context band `rank`'s thread decodes in (the bench's memory meter).

    Bands on the CPU share its cores: each gets `cpu_threads` intra-op threads (default: this thread's count
    divided among them); the previous setting is restored after."""
    layout = band_rows(latent.shape[-2], len(replicas))
    group = exchange.BandGroup(len(replicas), timeout_s=BARRIER_TIMEOUT_S)
    outputs: list[torch.Tensor | None] = [None] * len(replicas)
    errors: list[BaseException] = []
    cpu_bands = sum(torch.device(d).type == "cpu" for _, d in replicas)
    previous_threads = torch.get_num_threads()
    threads = cpu_threads or max(1, previous_threads // max(1, cpu_bands))

    def band(rank: int) -> None:
        model, device = replicas[rank]
        device = torch.device(device)
        start, stop = layout[rank]
        first, last = max(0, start - context_rows), min(latent.shape[-2], stop + context_rows)
        try:
            with _on(device, threads), torch.inference_mode(), exchange.joined(group.member(rank, device)), \
                    (around(rank) if around is not None else contextlib.nullcontext()):
                out = decode(model, latent[..., first:last, :].to(device))
                scale = out.shape[-2] // (last - first)  # the decoder's rows per latent row
                out = out[..., (start - first) * scale:(stop - first) * scale, :]
                outputs[rank] = out.to(out_device, out_dtype or out.dtype)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread below
            errors.append(exc)
            group.abort()

    workers = [threading.Thread(target=band, args=(k,), name=f"paradit-vae-band{k}", daemon=True)
               for k in range(len(replicas))]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(previous_threads)
    if errors:  # the first real error, not the broken barriers it caused in the other bands
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return torch.cat(outputs, dim=-2)


@contextlib.contextmanager
def _on(device: torch.device, cpu_threads: int):
    """This thread's device (CUDA: the current device for its kernels; CPU: its intra-op thread count)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        torch.set_num_threads(cpu_threads)
        yield
