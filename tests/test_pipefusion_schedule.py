"""PipeFusion's message schedule under NCCL's rules, without GPUs.

gloo progresses posted receives in the background, so the CPU parity tests cannot catch a schedule that
deadlocks on NCCL, where a communicator's sends and receives run one after another in posting order and a
transfer completes only when both sides reach it. Here every rank's real `Denoiser._run_pipefusion` runs
against a recording comm (no model: blocks are identities), and the recorded posting orders are replayed
with one in-order stream per link direction — the groups comm.py gives PipeFusion's p2p. The replay must
complete, and every link must pair its k-th send with its k-th receive of the same size.
"""
from __future__ import annotations

import itertools
import types

import pytest
import torch

from parallel_runtime.models.families.flux_adapter import FluxAdapter
from parallel_runtime.sampling import FLUX_LATENT, model_sampling_for

from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.distributed.comm import Group
from parallel_runtime.strategies.denoise import Denoiser
from parallel_runtime.errors import Cancelled
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
from parallel_runtime.distributed.topology import DIMS, STEP_ROW_DIMS, Topology


class RecordingComm:
    def __init__(self, topology: Topology, rank: int):
        self.topology, self.rank, self.device = topology, rank, torch.device("cpu")
        self.log: list[tuple] = []
        self._groups = {}
        for name, groups in [(d, topology.groups(d)) for d in DIMS] + [("sp", topology.sp_groups()),
                                                                        ("step_rows", topology.spanning_groups(STEP_ROW_DIMS))]:
            for ranks in groups:
                if rank in ranks:
                    self._groups[name] = Group(ranks, ranks.index(rank))

    def group(self, name):
        return self._groups[name]

    def _p2p(self, kind, peer, t):
        op_id = len(self.log)
        self.log.append((kind, peer, t.numel() * t.element_size(), op_id))
        log = self.log
        return types.SimpleNamespace(wait=lambda: log.append(("wait", op_id)), is_completed=lambda: False)

    def isend(self, t, dst, op="p2p"):
        return self._p2p("send", dst, t)

    def irecv(self, t, src, op="p2p"):
        return self._p2p("recv", src, t)

    def all_gather(self, t, group, op=""):
        return [t] * group.size  # CFG exchange between identical pipelines: not a p2p link

    def all_reduce(self, t, group, op=""):
        return t  # the step cache's sums over stage 0's row peers: not a p2p link

    def vote_async(self, flag):
        return None, torch.tensor([int(flag)])


class IdentityFlux:
    """Just enough of FluxAdapter for the schedule: shapes in, shapes out."""

    def __init__(self, chunks: int, hidden: int = 8):
        self.config = types.SimpleNamespace(hidden_size=hidden, num_heads=4, num_layers=4, num_single_layers=8,
                                            num_blocks=12)
        self.chunks = [range(1)] * chunks
        self.device, self.dtype, self.variant = torch.device("cpu"), torch.float32, "dev"

    pack, unpack = staticmethod(FluxAdapter.pack), staticmethod(FluxAdapter.unpack)  # the token layout itself
    model_sampling, latent_format, default_guidance, patch = model_sampling_for("dev"), FLUX_LATENT, 3.5, 2

    def rope(self, text_len, h, w, references=(), method=None):
        n = text_len + (h // 2) * (w // 2)
        return torch.zeros(n, 1), torch.zeros(n, 1)

    def embed_image(self, t, index, hw):
        return torch.zeros(t.shape[0], t.shape[1], self.config.hidden_size)

    def embed_text(self, c):
        return torch.zeros(c.shape[0], c.shape[1], self.config.hidden_size)

    def timestep_embedding(self, sigma, pooled, guidance, hw=None):
        return torch.zeros(sigma.shape[0], self.config.hidden_size)

    def run_blocks(self, image, text, temb, rope, chunk=0):
        return image, text

    def head(self, image, temb, rope=None):
        return torch.zeros(image.shape[0], image.shape[1], 64)


def record(stages, chunks, patches, warmup, steps, cfg_degree=1, cancel_after=None, cache="off"):
    strategy = StrategySpec(cfg_degree=cfg_degree, pipefusion_degree=stages, num_pipeline_patch=patches,
                            warmup_steps=warmup, cache=cache)
    topology = Topology.from_strategy(strategy)
    cond = Conditioning(torch.zeros(1, 5, 16), torch.zeros(1, 8), 3.5)
    job = Job(ModelSpec("unused"), strategy, SamplingSpec(steps=steps, cfg=2.0 if cfg_degree == 2 else 1.0),
              torch.zeros(1, 16, 8, 8), cond, cond if cfg_degree == 2 else None)
    logs = {}
    for rank in range(topology.world_size):
        comm = RecordingComm(topology, rank)
        calls = itertools.count()
        stop = (lambda: next(calls) >= cancel_after) if cancel_after is not None else (lambda: False)
        try:
            Denoiser(IdentityFlux(chunks), topology, comm, AttentionContext()).run(job, cancel_requested=stop)
        except Cancelled:
            pass
        logs[rank] = comm.log
    return logs


def replay_completes(logs, one_stream_per_rank: bool = False) -> bool:
    """Each link direction is one in-order stream (or, with `one_stream_per_rank`, all of a rank's p2p share
    one, as on a single NCCL communicator); a transfer needs both ends posted and reached; a rank's later
    posts wait for the operations it waited on."""
    ops = {}
    for rank, log in logs.items():
        waited, last_on_stream, mine = set(), {}, []
        for entry in log:
            if entry[0] == "wait":
                waited.add(entry[1])
                continue
            kind, peer, nbytes, op_id = entry
            stream = "all" if one_stream_per_rank else ((rank, peer) if kind == "send" else (peer, rank))
            mine.append({"kind": kind, "peer": peer, "id": op_id, "deps": set(waited),
                         "prev": last_on_stream.get(stream), "k": sum(1 for m in mine if m["kind"] == kind
                                                                      and m["peer"] == peer)})
            last_on_stream[stream] = op_id
        ops[rank] = mine
    done = {r: set() for r in ops}

    def ready(rank, op):
        return (op["prev"] is None or op["prev"] in done[rank]) and op["deps"] <= done[rank]

    progress = True
    while progress:
        progress = False
        for rank, mine in ops.items():
            for op in mine:
                if op["id"] in done[rank] or not ready(rank, op):
                    continue
                other = "recv" if op["kind"] == "send" else "send"
                partner = next((p for p in ops[op["peer"]] if p["kind"] == other and p["peer"] == rank
                                and p["k"] == op["k"]), None)
                if partner is not None and partner["id"] not in done[op["peer"]] and ready(op["peer"], partner):
                    done[rank].add(op["id"])
                    done[op["peer"]].add(partner["id"])
                    progress = True
    return all(len(done[r]) == len(ops[r]) for r in ops)


def links_pair_up(logs) -> bool:
    for a, b in itertools.permutations(logs, 2):
        sent = [e[2] for e in logs[a] if e[0] == "send" and e[1] == b]
        received = [e[2] for e in logs[b] if e[0] == "recv" and e[1] == a]
        if sent != received:
            return False
    return True


@pytest.mark.parametrize("stages,chunks,patches,warmup,steps,cfg_degree", [
    (2, 1, 2, 1, 4, 1), (2, 2, 2, 1, 4, 1), (2, 2, 4, 2, 5, 1), (3, 2, 2, 1, 3, 1), (3, 1, 4, 1, 3, 1),
    (4, 1, 4, 1, 3, 1), (2, 2, 1, 1, 3, 1), (2, 2, 2, 3, 3, 1), (2, 2, 2, 1, 4, 2),
])
def test_schedule_completes_on_in_order_links(stages, chunks, patches, warmup, steps, cfg_degree):
    logs = record(stages, chunks, patches, warmup, steps, cfg_degree)
    assert links_pair_up(logs)
    assert replay_completes(logs)


@pytest.mark.parametrize("stages,chunks", [(2, 1), (2, 2), (3, 2)])
def test_cache_decisions_relayed_between_stages_complete_on_in_order_links(stages, chunks):
    """The step cache's decision goes stage to stage ahead of each step's hidden rows (a skipped step sends the
    same rows, so the schedule does not depend on the decision): one more message per link and step."""
    logs = record(stages, chunks, 2, 1, 5, cache="first_block")
    assert links_pair_up(logs)
    assert replay_completes(logs)
    plain = record(stages, chunks, 2, 1, 5)
    for rank in logs:  # stages 0 .. stages-2 send the decision of each of the 5 steps to the next stage
        sent = [e for e in logs[rank] if e[0] == "send"]
        assert len(sent) - len([e for e in plain[rank] if e[0] == "send"]) == (5 if rank < stages - 1 else 0)


@pytest.mark.parametrize("cancel_after", [1, 2, 3])
def test_cancelled_schedule_leaves_no_message_in_flight(cancel_after):
    logs = record(2, 2, 2, 1, 6, cancel_after=cancel_after)
    assert links_pair_up(logs)
    assert replay_completes(logs)


def test_replay_detects_the_deadlock_of_one_shared_communicator():
    """The same schedule on one in-order stream per rank (receives posted ahead of sends) never finishes:
    the reason comm.py gives each link direction its own group."""
    assert not replay_completes(record(2, 2, 2, 1, 4), one_stream_per_rank=True)
