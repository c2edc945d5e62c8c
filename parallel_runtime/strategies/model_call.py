"""One diffusion-model call of a stock ComfyUI sampler (KSampler, SamplerCustomAdvanced, ...), run in parallel.

Parallel Sampler hands the runtime a whole denoise; a stock sampler keeps the loop on the host and calls the
model once per evaluation, in ComfyUI's own convention: x already scaled by model_sampling.calculate_input,
t already in the model's timestep units, one row per (chunk, latent) with cond and uncond chunks batched
together when ComfyUI batched them. The call returns the raw model output (velocity, eps), not a denoised
latent: the host's model_sampling and sampler take it from there.

What stays the same as in the denoise loop: the token layout, the sequence split (Ulysses, Ring, naive patch)
and the family's blocks. What differs: the CFG group splits the call's rows (ComfyUI's cond and uncond chunks
go to different ranks), no sampler state lives on the workers, and nothing carries over between calls.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..runtime.topology import validate_strategy
from ..spec import Job
from .denoise import Branches, Denoiser


class ModelCallForward(Denoiser):
    """A Denoiser whose job is one model call (`job.timestep` set): returns the model output on the result
    rank, [rows, C, H, W] as the call's 4D input (a video latent's frame axis is the caller's), in float32 as
    ComfyUI's apply_model casts it."""

    def _run(self, job: Job) -> torch.Tensor | None:
        rows, _, h, w = job.latent.shape
        s, cfg = job.strategy, self.adapter.config
        if s.pipefusion_degree > 1:
            raise ConfigError("PipeFusion runs under Parallel Sampler only for now; under KSampler use ulysses, "
                              "ring or cfg degrees, or switch to Parallel Sampler.")
        validate_strategy(s, world_size=self.topology.world_size, heads=cfg.num_heads, num_blocks=cfg.num_blocks,
                          latent_hw=(h, w), steps=1)
        self.step_times, self.hw = [], (h, w)
        # The call's chunks in ComfyUI's order (positive = first chunk, negative = second), `batch` rows each.
        chunks = [job.positive] + ([job.negative] if job.negative is not None else [])
        batch = rows // len(chunks)
        # CFG parallel gives each member one chunk; a one-chunk call (cfg 1) runs whole on every member.
        split = self.topology.cfg > 1 and len(chunks) == self.topology.cfg
        mine = [self.coords["cfg"]] if split else list(range(len(chunks)))
        x = self.adapter.pack(job.latent.float()).to(self.adapter.device)
        t = job.timestep.to(self.adapter.device, torch.float32)
        out = torch.zeros_like(x)
        self._check_cancel()
        # Chunks with one token layout run as one batch, as ComfyUI batched them; others one by one.
        groups = [mine] if len({chunks[k].signature() for k in mine}) == 1 else [[k] for k in mine]
        for group in groups:
            idx = torch.cat([torch.arange(k * batch, (k + 1) * batch) for k in group])
            branches = Branches([chunks[k] for k in group], batch, self.adapter)
            out[idx] = self._gather_shards(self._forward(x[idx], t[idx.to(t.device)], branches))
        self._finish_vote()
        if split:
            mine_rows = out[mine[0] * batch:(mine[0] + 1) * batch].contiguous()
            out = torch.cat(self.comm.all_gather(mine_rows, self.comm.group("cfg"), op="cfg"))
        if not self._is_result_rank():
            return None
        return self.adapter.unpack(out, h, w).cpu()  # [rows, C, H, W]: the caller restores a frame axis

    def _forward(self, x: torch.Tensor, t: torch.Tensor, branches: Branches) -> torch.Tensor:
        """This rank's token rows of the model output for one group of chunks, in a tensor shaped like x."""
        self.branches = branches
        self._set_layout(branches, x.shape[1], patches=1)
        attention, image_attention, rope, text, refs = self._forward_setup(branches, x.device)
        self.context.attention, self.context.image_attention = attention, image_attention
        rows = self.layout.image_slice(self.shard, 0)
        index = torch.arange(rows.start, rows.stop, device=x.device)
        temb = self._embed_time(t, branches)
        image = self.adapter.embed_image(x[:, rows], index, self.hw)  # x arrives input-scaled
        if refs is not None:
            image = torch.cat([image, refs], dim=1)
        image, _ = self.adapter.run_blocks(image, text, temb, rope)
        out = torch.zeros_like(x)
        out[:, rows] = self.adapter.head(image[:, :len(index)], temb)
        return out
