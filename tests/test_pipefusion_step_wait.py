"""What a PipeFusion step waits for at its end: its compute stream, never its sends still in flight.

A stage's last sends of a step (the last chunk's hidden states, the last stage's x going back to stage 0) are
needed by the peer's next step, not by this stage's. A device-wide sync at the step's end (torch.cuda.synchronize
waits for NCCL's streams too) held every stage until the peer had received them: in a timeline model, 5.3 t instead
of 4.2 t per step at 2 stages x 4 patches. Every rank's real `Denoiser._run_pipefusion` runs here against the
recording comm of test_pipefusion_schedule (its transfers never complete), with the step's end recorded in the same
log as the transfers: the step waits for a mark of its own stream once per step, and on no send before the run's
final drain.
"""
from __future__ import annotations

import pytest
import torch

from test_pipefusion_schedule import IdentityFlux, RecordingComm

from parallel_runtime.strategies import denoise
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.strategies.denoise import Denoiser
from parallel_runtime.distributed.streams import StreamMark
from parallel_runtime.distributed.topology import Topology
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec


@pytest.mark.parametrize("stages,chunks,patches,warmup,steps", [(2, 1, 4, 1, 5), (3, 2, 2, 1, 4)])
def test_a_step_ends_on_its_compute_stream_not_on_its_sends(monkeypatch, stages, chunks, patches, warmup, steps):
    strategy = StrategySpec(pipefusion_degree=stages, num_pipeline_patch=patches, warmup_steps=warmup)
    topology = Topology.from_strategy(strategy)
    cond = Conditioning(torch.zeros(1, 5, 16), torch.zeros(1, 8), 3.5)
    job = Job(ModelSpec("unused"), strategy, SamplingSpec(steps=steps, cfg=1.0), torch.zeros(1, 16, 8, 8), cond)
    log: list = []

    class LoggedMark(StreamMark):  # the step end's wait, in the log of the rank that runs
        def wait(self):
            log.append(("step end",))
            super().wait()

    monkeypatch.setattr(denoise, "StreamMark", LoggedMark)
    for rank in range(topology.world_size):
        comm = RecordingComm(topology, rank)
        log = comm.log
        Denoiser(IdentityFlux(chunks), topology, comm, AttentionContext()).run(job)
        step_ends = [k for k, entry in enumerate(log) if entry[0] == "step end"]
        assert len(step_ends) == steps, (rank, len(step_ends))  # one wait per step, on the compute stream
        sends = {entry[3] for entry in log if entry[0] == "send"}
        assert sends, rank  # every stage sends (the last one x back to stage 0)
        waited_sends = [k for k, entry in enumerate(log) if entry[0] == "wait" and entry[1] in sends]
        # The sends are waited on once the last step ended (the run's drain, before its result), never within it.
        assert all(k > step_ends[-1] for k in waited_sends), (rank, waited_sends, step_ends)
