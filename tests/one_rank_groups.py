"""One rank's process groups, made as a worker makes them (the default group with the configured timeout, then
every kind of group through a GroupPool), running on them each collective comm.py issues, called as comm.py
calls it and with the dtypes the strategies send. Shared by the gloo check (tests/test_one_rank_groups.py) and
the NCCL one (tests/gpu/test_cuda_process_groups.py)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from parallel_runtime.distributed.comm import GroupPool, group_timeout

# What each strategy sends through comm.py, by the call it makes.
WEIGHTS = torch.uint8  # sharded blocks: their raw bytes (weights/sharded.py), all_gather_single / _into_tensor
VOTE = torch.int32  # Cancel votes on the control group (gloo, on the host)


def run_one_rank(backend: str, device: torch.device, timeout: timedelta, dtype: torch.dtype) -> dict:
    """Every collective on one rank's groups; returns {group key: its timeout} and the names of the checked calls.
    `dtype`: the activations' (the model's) dtype. The default group is destroyed whatever happens."""
    assert not dist.is_initialized(), "a process group is already set up in this process"
    cuda = device.type == "cuda"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                            **({"device_id": device} if cuda else {}))
    pool = None
    try:
        pool = GroupPool(spare=2, timeout=timeout)
        groups = {key: pool.get(key, [0], backend) for key, backend in
                  ((("data", (0,)), None), (("link", 0, 0), None), (("weights", (0,)), None), (("control",), "gloo"))}
        timeouts = {"default": group_timeout(dist.group.WORLD), **{repr(k): group_timeout(g) for k, g in groups.items()}}
        data, link, weights, control = groups.values()
        checked = _collectives(device, dtype, data, link, weights, control)
        return {"timeouts": timeouts, "checked": checked}
    finally:
        if pool is not None:
            pool.close()
        dist.destroy_process_group()


def _collectives(device, dtype, data, link, weights, control) -> list[str]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    checked = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu()), name
        checked.append(name)

    # Sharded weights: a block's bytes, asynchronously (Comm.all_gather_into_async).
    kept = torch.randint(0, 256, (4099,), generator=g, dtype=WEIGHTS).to(device)
    flat = torch.empty_like(kept)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, kept, group=weights, async_op=True).wait()
    check("all_gather_into_tensor uint8 (weights)", flat, kept)
    # Ulysses: rows [S, B, 3, H/U, D] with explicit split sizes (Comm.all_to_all), and the flattened pieces of its
    # uneven-heads path (element splits).
    qkv = rand(37, 1, 3, 2, 16)
    out = torch.empty_like(qkv)
    dist.all_to_all_single(out, qkv, [37], [37], group=data)
    check("all_to_all_single rows (ulysses)", out, qkv)
    flat_qkv = qkv.reshape(-1)
    flat_out = torch.empty_like(flat_qkv)
    dist.all_to_all_single(flat_out, flat_qkv, [flat_qkv.numel()], [flat_qkv.numel()], group=data)
    check("all_to_all_single elements (ulysses uneven heads)", flat_out, flat_qkv)
    # CFG's float32 predictions and the result gather (Comm.all_gather), displaced patch's K/V
    # (all_gather_into_async, concatenated along dim 0).
    den = rand(1, 64, 64, dt=torch.float32)
    parts = [torch.empty_like(den)]
    dist.all_gather(parts, den, group=data)
    check("all_gather float32 (cfg, result)", parts[0], den)
    kv = rand(2, 1, 40, 4, 32)
    gathered = torch.empty_like(kv)  # [members * 2, ...]: one member here
    gather(gathered, kv, group=data, async_op=True).wait()
    check("all_gather_into_tensor async (displaced patch)", gathered, kv)
    # Tensor parallel's sums, the input amax's max (Comm._all_reduce), PipeFusion's prompt broadcast.
    partial = rand(1, 50, 128)
    want = partial.clone()
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=data)
    check("all_reduce sum (tensor parallel)", partial, want)
    amax = rand(7, dt=torch.float32).abs()
    want = amax.clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=data)
    check("all_reduce max float32 (input amax)", amax, want)
    sums = torch.tensor([3.25, 7.5], dtype=torch.float64, device=device)  # the step cache's two L1 sums
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=data)
    check("all_reduce sum float64 (step cache decision)", sums, torch.tensor([3.25, 7.5], dtype=torch.float64))
    text = rand(1, 7, 128)
    want = text.clone()
    dist.broadcast(text, src=0, group=data)
    check("broadcast (pipefusion prompt)", text, want)
    if device.type == "cuda":
        # Ring's exchange (Comm.ring_exchange) to itself: NCCL pairs a send and a receive of one rank in one group
        # call. Gloo has no pair to its own rank ("Pair is not connected"); its 2-rank tests send for real.
        send, recv = rand(2, 1, 40, 4, 32), torch.empty(2, 1, 40, 4, 32, device=device, dtype=dtype)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 0, group=data),
                                        dist.P2POp(dist.irecv, recv, 0, group=data)])
        for w in works:
            w.wait()
        check("batch_isend_irecv to itself (ring)", recv, send)
        x_rows, buf = rand(1, 32, 64, dt=torch.float32), torch.empty(1, 32, 64, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x_rows, 0, group=link),
                                        dist.P2POp(dist.irecv, buf, 0, group=link)])
        for w in works:
            w.wait()
        check("batch_isend_irecv float32 on a link group (pipefusion x)", buf, x_rows)
    # Cancel's vote on the control group, on the host (Comm.vote_async).
    vote = torch.tensor([1], dtype=VOTE)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=control, async_op=True).wait()
    check("all_reduce max int32 on the control group (cancel vote)", vote, torch.tensor([1], dtype=VOTE))
    return checked
