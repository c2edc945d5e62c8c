"""One diffusion-model call of a stock ComfyUI sampler (KSampler, SamplerCustomAdvanced, ...), run in parallel.

Parallel Sampler hands the runtime a whole denoise; a stock sampler keeps the loop on the host and calls the
model once per evaluation, in ComfyUI's own convention: x already scaled by model_sampling.calculate_input,
t already in the model's timestep units, one row per (chunk, latent) with cond and uncond chunks batched
together when ComfyUI batched them. The call returns the raw model output (velocity, eps), not a denoised
latent: the host's model_sampling and sampler take it from there.

What stays the same as in the denoise loop: the token layout, the sequence split (Ulysses, Ring, naive patch),
PipeFusion's stages and the family's blocks. What differs: the CFG group splits the call's rows (ComfyUI's cond
and uncond chunks go to different ranks), no sampler state lives on the workers, and PipeFusion's pipeline
drains at the end of every call; only its stale K/V carries over from one call to the next.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..distributed.topology import latent_plane, validate_strategy
from ..spec import Job
from .attention import LocalAttention
from .control import ControlPass
from .denoise import Branches, Denoiser, control_caches, model_output, stale_caches
from .displaced import DisplacedPatchAttention
from .two_stream_call import run_two_stream_call


class ModelCallForward(Denoiser):
    """A Denoiser whose job is one model call (`job.timestep` set): returns the model output on the result
    rank, shaped as the call's input ([rows, C, H, W], or [rows, C, T, H, W] for a video model), in float32 as
    ComfyUI's apply_model casts it."""

    def _run(self, job: Job) -> torch.Tensor | None:
        if getattr(self.adapter, "two_streams", False):  # LTX-2: video and audio as two split streams
            return run_two_stream_call(self, job)
        out = self.call_outputs(job)
        if not self._is_result_rank():
            return None
        if job.audio is not None:  # (video, audio) in the call's shapes
            return tuple(part.cpu() for part in self.adapter.unpack_av(out, *self.hw))
        return self.adapter.unpack(out, *job.latent.shape[2:]).cpu()  # [rows, C, H, W] or a video's 5D

    def call_outputs(self, job: Job) -> torch.Tensor:
        """The call's model output as packed tokens [rows, N, C], whole on every rank but PipeFusion's earlier
        stages (Parallel Sampler's audio-video loop steps it on every rank: av_sampling.py)."""
        rows, _, *spatial = job.latent.shape  # (H, W), or (T, H, W) for a video
        s, cfg = job.strategy, self.adapter.config
        validate_strategy(s, world_size=self.topology.world_size, heads=cfg.num_heads, num_blocks=cfg.num_blocks,
                          latent_hw=latent_plane(spatial), steps=1, patch=self.adapter.patch)
        # An audio-video call's sizes end with the audio's frames (the family's tables read them).
        self.step_times, self.hw = [], tuple(spatial) + (() if job.audio is None else (job.audio.shape[-1],))
        self.device_weights, self.warmup_steps, self.patch_caches = s.device_weights, s.warmup_steps, {}
        self.rope_options = job.extra.get("rope_options")
        # The call's chunks in ComfyUI's order (positive = first chunk, negative = second), `batch` rows each.
        chunks = [job.positive] + ([job.negative] if job.negative is not None else [])
        batch = rows // len(chunks)
        # CFG parallel gives each member one chunk; a one-chunk call (cfg 1) runs whole on every member.
        split = self.topology.cfg > 1 and len(chunks) == self.topology.cfg
        mine = [self.coords["cfg"]] if split else list(range(len(chunks)))
        x = (self.adapter.pack(job.latent.float()) if job.audio is None  # [audio | video] rows of an AV call
             else self.adapter.pack_av(job.latent.float(), job.audio.float())).to(self.adapter.device)
        t = job.timestep.to(self.adapter.device, torch.float32)
        out = torch.zeros_like(x)
        self._check_cancel()
        # Chunks with one token layout run as one batch, as ComfyUI batched them; others one by one.
        pad = getattr(self.adapter, "prompt_tokens", 0)  # FLUX.2's prompts, padded to one length, batch together
        groups = [mine] if len({chunks[k].signature(pad) for k in mine}) == 1 else [[k] for k in mine]
        stale = self.topology.pipefusion > 1 or self.topology.patch > 1
        if stale and job.call_step == 0 and job.call_slot == 0:
            self.context.stale_kv.clear()  # a new sampling run: nothing of the last one is stale K/V of this one
        for group in groups:
            idx = torch.cat([torch.arange(k * batch, (k + 1) * batch) for k in group])
            branches = Branches([chunks[k] for k in group], batch, self.adapter, job.batch_rows, job.images)
            if self.topology.pipefusion > 1:
                part = self._pipeline(x[idx], t[idx.to(t.device)], branches, job, (job.call_slot, tuple(group)))
            else:
                part = self._forward(x[idx], t[idx.to(t.device)], branches, job, (job.call_slot, tuple(group)))
            out[idx] = self._gather_shards(part)
        self._finish_vote()
        if split:
            mine_rows = out[mine[0] * batch:(mine[0] + 1) * batch].contiguous()
            out = torch.cat(self.comm.all_gather(mine_rows, self.comm.group("cfg"), op="cfg"))
        return out

    def _forward(self, x: torch.Tensor, t: torch.Tensor, branches: Branches, job: Job, key: tuple) -> torch.Tensor:
        """This rank's token rows of the model output for one group of chunks, in a tensor shaped like x.
        Displaced patch parallelism reads the other patches' K/V as the slot's previous call left them (`key`:
        as for PipeFusion, see _pipeline), exact in the schedule's first `warmup_steps` calls."""
        self.branches, self.call_t = branches, t
        self._set_layout(branches, x.shape[1], patches=1)
        sync = True
        if self.topology.patch > 1:
            sync = self._stale_slot(job, key, (self.layout,))
            self.patch_caches[id(branches)] = self.context.stale_kv[key][1]
        attention, image_attention, rope, text, refs = self._forward_setup(branches, x.device)
        self.context.attention, self.context.image_attention = attention, image_attention
        rows = self.layout.image_slice(self.shard, 0)
        index = torch.arange(rows.start, rows.stop, device=x.device)
        temb = self._embed_time(t, branches)
        image = self._image_stream(0, x[:, rows], index, refs)
        control = self._control_pass(branches, t)
        extra = {"residuals": control.residuals(x[:, rows], index, rope)} if control is not None else {}
        with self._displaced(attention, image_attention, sync=sync):
            image, _ = self.adapter.run_blocks(image, text, temb, rope, **extra)
        out = torch.zeros_like(x)
        out[:, rows] = model_output(self.adapter, image[:, :len(index)], temb, rope, x[:, rows])
        return out

    def _pipeline(self, x: torch.Tensor, t: torch.Tensor, branches: Branches, job: Job, key: tuple) -> torch.Tensor:
        """PipeFusion within one call: the call's patches flow through the stages one after another, so a
        call costs (patches + stages - 1) patch-times of one stage where the denoise loop's pipeline never
        drains. Each attention layer reads the other patches' K/V as this rank's previous call left them
        (stale by one sampler evaluation); the first `warmup_steps` steps of the host's schedule, and any call
        without buffers of its layout, run the whole image at once: exact, and they fill the buffers.

        `key`: (the job's slot in the host's call, its chunks), so the jobs of one call never share buffers; a
        slot's buffers are replaced when its token layout changes (another prompt length, reference or size) or
        its ControlNet chain does."""
        s = job.strategy
        self.branches, self.call_t = branches, t
        self._set_layout(branches, x.shape[1], patches=s.patches)
        self.control = self._control_pass(branches, t, pipeline=True)
        # A ControlNet that starts (or stops) mid-run has no stale K/V of its own layers yet: warm up again.
        warmup = int(self._stale_slot(job, key, (self.layout, tuple(c.signature() for c in branches.control))))
        model_output = torch.zeros_like(x)
        self._run_pipefusion(x, warmup=warmup, n_steps=1, lanes=[(branches, self.context.stale_kv[key][1])],
                             model_output=model_output)
        return model_output

    def _stale_slot(self, job: Job, key: tuple, shape: tuple, caches=None) -> bool:
        """Whether this call must run exact (warm-up): in the first `warmup_steps` calls of the host's schedule, or
        where the slot holds no stale K/V of this `shape` (token layout, ControlNet chain), whose buffers it then
        replaces (`caches()`: new ones; by default the joint and image-only buffers of the call's layout). Every
        rank agrees, since all must run the same schedule."""
        store = self.context.stale_kv
        held = store.get(key)
        if self._anyone((job.call_step or 0) < job.strategy.warmup_steps or held is None or held[0] != shape):
            store.pop(key, None)  # the old buffers go before their successors fill
            store[key] = (shape, caches() if caches is not None else stale_caches(self.layout, self._ring_shards()))
            return True
        return False

    def _control_pass(self, branches: Branches, t: torch.Tensor, pipeline: bool = False) -> ControlPass | None:
        """The group's ControlNet chain for this call (its prompt rows: this rank's, as the DiT's), or None.
        `pipeline`: PipeFusion's stage points the attention at the ControlNet's sequence itself."""
        if not branches.control:
            return None
        sequence = None if pipeline else lambda extra: self._control_sequence(branches, extra, t.device)
        return ControlPass(self.controlnets, self.adapter.config, branches, t, self._text_rows(self.layout, branches),
                           self.hw, sequence=sequence, shares_sequence=pipeline or self.layout.ref_len == 0)

    def _control_sequence(self, branches: Branches, extra: int, device) -> tuple:
        """(this rank's prompt rows, joint attention, RoPE rows) of a ControlNet's own forward pass: its prompt is
        `extra` tokens longer, in front (a union ControlNet's types), and it has no reference rows (ComfyUI's
        ControlNets never see Kontext's). Prompt and image rows split as the DiT's are, so the image rows (and
        residuals) of each rank stay its own. Validation keeps typed passes out of PipeFusion."""
        layout = dataclasses.replace(self.layout, text_len=self.layout.text_len + extra, ref_len=0)
        shards = range(layout.shards)
        if self.topology.naive_patch > 1:
            attention = LocalAttention()
        elif self.topology.patch > 1:  # over buffers kept beside the DiT's; gathered before attending (exact)
            caches = control_caches(self.patch_caches[id(branches)], layout)
            attention = DisplacedPatchAttention(caches[0], self.comm, self.comm.group("patch"),
                                                [layout.positions(j, [0], device) for j in shards], LocalAttention())
        else:
            attention = self._sequence_attention([layout.seq_len(j, [0]) for j in shards])
        rope = self._rope(self._rope_full(branches, extra), layout.positions(self.shard, [0], device))
        return layout.text_rows(self.shard), attention, rope

    def _anyone(self, flag: bool) -> bool:
        """True on every rank if it is True on any: all stages must run the same schedule."""
        work, value = self.comm.vote_async(flag)
        if work is not None:
            work.wait()
        return bool(int(value.item()))

    def _timestep(self, i: int, branches: Branches) -> torch.Tensor:
        return self.call_t

    def _image_stream(self, i: int, x_rows: torch.Tensor, index: torch.Tensor, refs: torch.Tensor | None,
                      branches: Branches | None = None) -> torch.Tensor:
        """The call's x arrives input-scaled, one row per (chunk, latent): embedded as it is."""
        image = (branches or self.branches).embed(self.adapter, x_rows, index, self.hw)
        return image if refs is None else torch.cat([image, refs], dim=1)

    def _step_done(self, i: int, t0: float) -> None:
        self.step_times.append(time.perf_counter() - t0)  # the host's sampler drives the progress bar
