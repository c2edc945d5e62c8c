"""One stock-sampler model call of a two-stream audio-video family (LTX-2), run in parallel.

The family says which kind of call it takes through its adapter: `two_streams = True` (LTX-2) keeps the video tokens
and the audio tokens as two sequences, each split over the sequence-parallel ranks, with self-attention per stream
and the a2v / v2a cross-attentions between them (attention/streams.py); MiniMax-H3's adapter instead packs
[audio | video] rows into the one image stream the ordinary model call splits (pack_av). The call's chunks split
over the CFG group as in model_call.py; every per-token table (timesteps, RoPE) is computed for the rows a rank
holds, and the timesteps' maxima that LTX-2 reads (the prompt's and the a2v / v2a gates') over the whole call, so
any split equals the serial call. Naive patch splits both streams' rows as sequence parallelism does, each rank
attending its own rows alone (a baseline); PipeFusion runs the call's patches through the stages
(two_stream_pipefusion.py).
"""
from __future__ import annotations

import math

import torch

from ..distributed.topology import latent_plane, validate_strategy
from ..spec import Job
from .attention import LocalAttention
from .attention.streams import stream_attention
from .layout import shard_rows


def run_two_stream_call(runner, job: Job):
    """(video [rows, C, T, H, W], audio [rows, channels, frames, bins]) model outputs on the result rank, else
    None. `runner`: the job's ModelCallForward (its topology, comm, coordinates and attention context)."""
    v_out, a_out = two_stream_outputs(runner, job)
    if not runner._is_result_rank():
        return None
    return (runner.adapter.unpack(v_out, *job.latent.shape[2:]).cpu(),
            runner.adapter.unpack_audio(a_out, job.audio.shape[1]).cpu())


def two_stream_outputs(runner, job: Job) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's (video, audio) model outputs as packed tokens, whole on every rank (Parallel Sampler's
    audio-video loop steps them on every rank: av_sampling.py)."""
    adapter, topology, comm = runner.adapter, runner.topology, runner.comm
    cfg = adapter.config
    rows, _, *thw = job.latent.shape
    validate_strategy(job.strategy, world_size=topology.world_size, heads=cfg.num_heads, num_blocks=cfg.num_blocks,
                      latent_hw=latent_plane(thw), steps=1, patch=1)
    runner.step_times = []
    chunks = [job.positive] + ([job.negative] if job.negative is not None else [])
    batch = rows // len(chunks)
    split = topology.cfg > 1 and len(chunks) == topology.cfg
    mine = [runner.coords["cfg"]] if split else list(range(len(chunks)))
    idx = torch.cat([torch.arange(k * batch, (k + 1) * batch) for k in mine])
    device = adapter.device
    video = adapter.pack(job.latent.float())[idx].to(device)
    audio = adapter.pack_audio(job.audio.float())[idx].to(device)
    frames = audio.shape[1]
    # Timesteps of every row of the call: ComfyUI runs cond and uncond in one call, so the maxima are the call's.
    video_t, audio_t = adapter.call_timesteps(job.timestep, job.audio_timestep, tuple(thw), frames)
    prefix = 0  # LTX-2's reference audio (ID-LoRA): rows before the audio's own, at timestep 0, outputs dropped
    if job.audio_reference is not None:
        ref = job.audio_reference.float().expand(rows, -1, -1)
        prefix, frames = ref.shape[1], ref.shape[1] + frames
        audio = torch.cat([ref[idx].to(device), audio], dim=1)
        audio_t = torch.cat([audio_t.new_zeros(rows, prefix), audio_t], dim=1)
    guides = job.video_guides  # LTX-2's guide frames: only the kept tokens run (ltx2_guides.py), maxima over them
    if guides is not None:
        video, video_t = video[:, guides.kept.to(device)], video_t[:, guides.kept]
    peaks = video_t.max(), audio_t.max()
    sigma, audio_sigma = video_t.amax(dim=1)[idx], audio_t.amax(dim=1)[idx]
    context = torch.cat([_repeat(chunks[k].cond.float(), batch) for k in mine]).to(device)
    pooled = torch.cat([_repeat(chunks[k].pooled.float(), batch) for k in mine]).to(device)
    video_context, audio_context = adapter.split_prompt(context, pooled)  # Kandinsky 6 reads the pooled vector

    fps = float(job.extra.get("frame_rate", 24.0))
    placed = ({} if guides is None else {"guides": guides}) | ({"audio_prefix": prefix} if prefix else {})
    marker_of = getattr(adapter, "keyframe_marker", None)  # LTX-2.5's keyframe row, on the tokens ComfyUI adds it to
    marker = marker_of(tuple(thw), guides, len(idx)) if marker_of is not None else None
    # The video self-attention's bias (LTX-2's guide attention), cut for each split by its rows.
    bias = adapter.video_bias(guides, video.shape[1]) if guides is not None else None
    if topology.pipefusion > 1:
        v_out, a_out = _pipeline(runner, job, video, audio, (video_context, audio_context),
                                 (video_t[idx], audio_t[idx], sigma, audio_sigma, peaks), tuple(thw), fps, mine,
                                 marker, placed, bias)
    else:
        # The group whose members split both streams' rows: naive patch's (each attends its own rows alone), else
        # the sequence-parallel ranks'.
        group = comm.group("naive_patch" if topology.naive_patch > 1 else "sp")
        video_shards, audio_shards = shard_rows(video.shape[1], group.size), shard_rows(frames, group.size)
        v_rows, a_rows = video_shards[group.index], audio_shards[group.index]
        _point_attention(runner, video_shards, [len(r) for r in audio_shards], bias)
        rope = adapter.rope(tuple(thw), v_rows, frames, a_rows, fps=fps, batch=len(idx), **placed)
        runner._check_cancel()
        with torch.no_grad():
            v_out, a_out = adapter.forward_rows(video[:, v_rows], audio[:, a_rows], video_context, audio_context,
                                                video_t[idx][:, v_rows], audio_t[idx][:, a_rows], sigma, audio_sigma,
                                                rope, peaks=peaks,
                                                **({} if marker is None else {"keyframes": marker[:, v_rows]}))
        v_out, a_out = _gather(comm, group, v_out, video_shards), _gather(comm, group, a_out, audio_shards)
    runner._finish_vote()
    if split:
        v_out = torch.cat(comm.all_gather(v_out.contiguous(), comm.group("cfg"), op="cfg"))
        a_out = torch.cat(comm.all_gather(a_out.contiguous(), comm.group("cfg"), op="cfg"))
    a_out = a_out[:, prefix:]  # the reference audio's rows are not the call's output
    if guides is not None:  # dropped tokens come back as zeros, as ComfyUI's _process_output writes them
        whole = v_out.new_zeros(v_out.shape[0], math.prod(thw), v_out.shape[2])
        whole[:, guides.kept.to(whole.device)] = v_out
        v_out = whole
    return v_out, a_out


def _repeat(t: torch.Tensor, batch: int) -> torch.Tensor:
    return t.expand(batch, *t.shape[1:]) if t.shape[0] == 1 and batch > 1 else t


def _pipeline(runner, job: Job, video, audio, context: tuple, times: tuple, thw: tuple, fps: float,
              mine: list[int], marker: torch.Tensor | None, placed: dict, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """PipeFusion over the call's patches (two_stream_pipefusion.py), its outputs whole on every stage. `placed`:
    adapter.rope's guide frames and reference audio rows of the call; `bias`: its video self-attention's bias."""
    from .two_stream_pipefusion import pipeline_outputs

    adapter, comm = runner.adapter, runner.comm
    if job.call_step == 0 and job.call_slot == 0:
        runner.context.stale_kv.clear()  # a new sampling run: nothing of the last one is stale K/V of this one
    frames = audio.shape[1]

    def rope_of(v_rows, a_rows):
        return adapter.rope(thw, v_rows, frames, a_rows, fps=fps, batch=video.shape[0], **placed)

    runner._check_cancel()
    with torch.no_grad():
        v_out, a_out = pipeline_outputs(runner, job, video, audio, adapter.embed_prompt(*context), times, rope_of,
                                        (job.call_slot, tuple(mine)), marker, bias)
    group = comm.group("pipefusion")  # only the last stage holds the outputs, the others zeros: a sum is exact
    return comm.all_reduce(v_out, group, op="pipefusion"), comm.all_reduce(a_out, group, op="pipefusion")


def _point_attention(runner, video_shards: list[torch.Tensor], audio_lengths: list[int], video_bias=None) -> None:
    """The context's four attentions over this split: each stream's self-attention and a2v / v2a across them
    (naive patch: each rank's rows alone). `video_bias`: the video self-attention's bias (LTX-2's guide attention,
    ltx2_guides.GuideBias), cut for each split by the shards' rows."""
    comm, topology = runner.comm, runner.topology
    if topology.naive_patch > 1:
        mine = video_shards[comm.group("naive_patch").index]
        runner.context.attention = LocalAttention(None if video_bias is None else video_bias.block(mine, mine))
        runner.context.streams = {name: LocalAttention() for name in ("audio", "a2v", "v2a")}
        return
    ring = runner.coords["ring"]
    video_lengths = [len(r) for r in video_shards]

    def attention(q, kv, bias=None):
        return stream_attention(comm, topology.ulysses, ring, q, kv, bias, video_shards if bias is not None else None)

    runner.context.attention = attention(video_lengths, video_lengths, video_bias)
    runner.context.streams = {"audio": attention(audio_lengths, audio_lengths),
                              "a2v": attention(video_lengths, audio_lengths),
                              "v2a": attention(audio_lengths, video_lengths)}


def _gather(comm, group, part: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """Every member's rows of one stream, whole (shards padded to one length to be gathered)."""
    if len(shards) == 1:
        return part
    longest = max(len(r) for r in shards)
    padded = part.new_zeros(part.shape[0], longest, part.shape[2])
    padded[:, :part.shape[1]] = part
    pieces = comm.all_gather(padded, group, op="result")
    return torch.cat([piece[:, :len(r)] for piece, r in zip(pieces, shards)], dim=1)
