"""PipeFusion within one model call of a two-stream audio-video family (LTX-2).

The same scheme as the single-stream pipeline (pipefusion.py; model_call.py's `_pipeline`): the blocks split into
contiguous stages, one per pipeline rank (or interleaved chunks), and the call's tokens into patches that follow
each other down the stages, so the pipeline drains at the end of every call and only the stale K/V carries over
from one call to the next. A patch is a run of video tokens; the audio rows ride with patch 0 (audio is ~2% of the
tokens at the released shapes), so patch 0 carries both streams and the later patches carry video alone.

Each of a block's four stream attentions keeps its own full-sequence K/V buffer per layer (StaleKVCache) over its
key stream: video self-attention and video-to-audio over the video rows, audio self-attention and audio-to-video
over the audio rows. A patch writes its fresh rows and reads the others as they stand: the patches before it in
this call, the rest as the previous call left them. Since the audio rows travel with patch 0, every later patch's
audio-to-video reads this call's audio K/V; the audio's video-to-audio reads the other patches' video as the
previous call left it. The first `warmup_steps` calls of the schedule (and any call without buffers of its shape)
run the whole call as one token set: exact, and they fill the buffers. Prompt cross-attention is local (every
stage holds the prompt), and per-token modulation and RoPE are computed per patch for its rows.
"""
from __future__ import annotations

import torch

from ..spec import Job
from .attention import LocalAttention
from .layout import shard_rows
from .pipefusion import StaleKVAttention, StaleKVCache

# Each stream attention's key stream: its buffer's rows (strategies' slots as attention/streams.py names them).
KEY_STREAMS = {"video": "video", "audio": "audio", "a2v": "audio", "v2a": "video"}


def stale_stream_caches(video_rows: int, audio_rows: int) -> tuple[StaleKVCache, ...]:
    """One stage's K/V buffers of the four stream attentions (in KEY_STREAMS' order), each over its key stream's
    rows."""
    lengths = {"video": video_rows, "audio": audio_rows}
    return tuple(StaleKVCache(lengths[keys]) for keys in KEY_STREAMS.values())


def pipeline_outputs(runner, job: Job, video, audio, prompt: tuple, times: tuple, rope_of, key: tuple,
                     marker: torch.Tensor | None = None, video_bias=None):
    """This call's (video, audio) model outputs as packed tokens: filled on the last stage, zeros elsewhere (a sum
    over the pipeline group is exact). `video` / `audio`: the call's input tokens; `prompt`: each stream's prompt
    rows; `times`: (video_t, audio_t, sigma, audio_sigma, peaks) of the call's rows; `rope_of(video_rows,
    audio_rows)`: the RoPE tables of a token set; `key`: the slot whose stale K/V this call reads (model_call.py);
    `marker`: LTX-2.5's keyframe marker per video token (adapter.keyframe_marker), or None; `video_bias`: the video
    self-attention's bias (LTX-2's guide attention), cut for each token set's queries over the whole buffer."""
    adapter, comm = runner.adapter, runner.comm
    nv, na = video.shape[1], audio.shape[1]
    shape = ("two-stream", tuple(video.shape), tuple(audio.shape), job.strategy.patches)
    warmup = runner._stale_slot(job, key, shape, caches=lambda: stale_stream_caches(nv, na))
    caches = runner.context.stale_kv[key][1]
    attention = {name: StaleKVAttention(cache, LocalAttention()) for name, cache in zip(KEY_STREAMS, caches)}
    runner.context.attention = attention["video"]
    runner.context.streams = {name: attention[name] for name in ("audio", "a2v", "v2a")}

    everything = [(torch.arange(nv), torch.arange(na))]
    token_sets = everything if warmup else [
        (rows, torch.arange(na) if p == 0 else torch.arange(0))
        for p, rows in enumerate(shard_rows(nv, job.strategy.patches))]
    pp = comm.group("pipefusion")
    stage, stages, chunks = pp.index, pp.size, len(adapter.chunks)
    after, before = pp.ranks[(stage + 1) % stages], pp.ranks[(stage - 1) % stages]
    v_out = torch.zeros(video.shape[0], nv, adapter.config.in_channels, device=video.device)
    a_out = torch.zeros(audio.shape[0], na, adapter.config.audio_in_channels, device=video.device)
    video_t, audio_t, sigma, audio_sigma, peaks = times
    sends = []
    try:
        # Items in (chunk, token set) order: a patch leaves a stage while the next one enters it.
        for chunk in range(chunks):
            for v_rows, a_rows in token_sets:
                mod = adapter.modulation(video_t[:, v_rows], audio_t[:, a_rows], sigma, audio_sigma, peaks)
                for name, attend in attention.items():  # the rows whose fresh K/V this pass writes
                    attend.positions = (v_rows if KEY_STREAMS[name] == "video" else a_rows).to(video.device)
                if video_bias is not None:  # these queries' rows of the bias over every key of the buffer
                    attention["video"].inner = LocalAttention(video_bias.block(v_rows))
                rope = rope_of(v_rows, a_rows)
                if stage == 0 and chunk == 0:
                    marked = () if marker is None else (marker[:, v_rows],)  # LTX-2.5's keyframe row
                    v, a = adapter.embed_video(video[:, v_rows], *marked), adapter.embed_audio(audio[:, a_rows])
                else:
                    v, a = _receive(runner, before, video.shape[0], len(v_rows), len(a_rows))
                v, a = adapter.run_blocks(v, a, prompt, mod, rope, chunk=chunk)
                if stage == stages - 1 and chunk == chunks - 1:
                    v_out[:, v_rows], a_out[:, a_rows] = adapter.head(v, a, mod)
                else:
                    message = torch.cat([v.flatten(1), a.flatten(1)], dim=1).contiguous()
                    sends.append((comm.isend(message, after, op="pipefusion"), message))
    finally:
        for work, _ in sends:
            work.wait()
    return v_out, a_out


def _receive(runner, src: int, batch: int, video_rows: int, audio_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token set's hidden rows from the chunk before: video then audio rows, flattened into one message."""
    adapter, c = runner.adapter, runner.adapter.config
    message = torch.empty(batch, video_rows * c.hidden_size + audio_rows * c.audio_hidden_size,
                          dtype=adapter.dtype, device=adapter.device)
    runner._recv(message, src, "pipefusion")
    cut = video_rows * c.hidden_size
    return (message[:, :cut].view(batch, video_rows, c.hidden_size),
            message[:, cut:].view(batch, audio_rows, c.audio_hidden_size))
