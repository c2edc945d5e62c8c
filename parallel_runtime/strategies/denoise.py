"""One denoise job on one rank: token layout, the step loop, CFG exchange, PipeFusion schedule.

Every rank runs `Denoiser.run` with the same job; the topology coordinates decide which tokens, which
CFG branch and which blocks this rank handles. With a world of one it is the serial reference, run
in-process with no torch.distributed at all.

Ownership of image tokens: the image is cut into M row patches (M = 1 unless PipeFusion), and each
patch into `shards` equal token ranges, one per sequence-parallel rank; a rank owns its shard of every
patch. The sampler state `x` is the full [B, N, 64] token tensor on every rank that samples, of which a
rank only updates the rows it owns; rows are gathered once, at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, NamedTuple

import torch

from ..distributed.comm import Comm
from ..distributed.streams import StreamMark
from ..distributed.topology import Topology, latent_plane, validate_strategy
from ..errors import Cancelled
from ..models.family import DiTAdapter
from ..models.patchify import rows_cached
from .attention import AttentionBias, LocalAttention, RingAttention, UlyssesAttention
from .attention.bias import ring_blocks
from .attention.processor import AttentionContext
from .batch import batch_shares, cut_job, gather_batch, group_speeds, job_noise, repeat_to_batch
from .control import ControlNets, ControlPass, Residuals
from .forward_amax import forward_amax_reduce
from .displaced import DisplacedPatchAttention
from .layout import TokenLayout, weighted_counts
from .pipefusion import StaleKVAttention, StaleKVCache
from .step_cache import FirstBlockCache, run_block_range, split_first
from ..sampling import (cfg_combine, cfg_uses_uncond, final_latent, ksampler_sigmas, make_sampler,
                       start_latent)
from ..spec import IN_CONTEXT_METHOD, Conditioning, Job
from ..validate import validate_branches


def pad_prompt(cond: torch.Tensor, tokens: int) -> torch.Tensor:
    """A prompt shorter than `tokens` padded at the front with zero tokens, as a family's ComfyUI model_base pads
    it (FLUX.2's extra_conds, to 512); others as they are."""
    short = tokens - cond.shape[1]
    return torch.nn.functional.pad(cond, (0, 0, short, 0)) if short > 0 else cond


def model_output(adapter: DiTAdapter, image: torch.Tensor, temb, rope, x_rows: torch.Tensor) -> torch.Tensor:
    """The family's model output for these rows: its head on the blocks' image rows, also handed the input rows where
    the family predicts x0 and returns ComfyUI's velocity from it (`head_reads_input`: HiDream O1's (x - x_pred) /
    sigma)."""
    if getattr(adapter, "head_reads_input", False):
        return adapter.head(image, temb, rope, x_rows)
    return adapter.head(image, temb, rope)


def reference_tokens(adapter: DiTAdapter, references: tuple[torch.Tensor, ...], batch: int) -> torch.Tensor:
    """ReferenceLatent latents as packed image-stream tokens [B, R, C*p*p], as ComfyUI's model sees them:
    the latent format's process_in, the batch tiled, odd sizes padded circularly to the patch size (a video latent's
    frames as they are: a family with reference videos patches one frame per token)."""
    p = adapter.patch
    parts = []
    for ref in references:
        ref = repeat_to_batch(adapter.latent_format.process_in(ref.float()), batch)
        pad_h, pad_w = (-ref.shape[-2]) % p, (-ref.shape[-1]) % p
        if pad_h or pad_w:  # circular padding names every axis after the channels: none on a video's frames
            ref = torch.nn.functional.pad(ref, (0, pad_w, 0, pad_h) + (0, 0) * (ref.ndim - 4), mode="circular")
        parts.append(adapter.pack(ref))
    return torch.cat(parts, dim=1)


class Branches:
    """The CFG branches this rank evaluates, batched into one forward pass."""

    def __init__(self, conds: list[Conditioning], batch: int, adapter: DiTAdapter, batch_rows: slice | None = None,
                 whole_batch: int | None = None):
        # The Denoiser batches only branches with the same token layout (Conditioning.signature). Everything
        # moves to the worker's device once per job, not once per step (each blocking upload is a sync on CUDA).
        self.count = len(conds)
        self.batch = batch
        # Batch parallel: these `batch` images are rows `batch_rows` of `whole_batch` (what a ControlNet hint of
        # several images is tiled to before it is cut; the conditionings arrive cut: batch.cut_job).
        self.batch_rows, self.whole_batch = batch_rows, whole_batch or batch
        device = adapter.device

        def rep(t):  # ComfyUI repeats a batch-1 conditioning over the latent batch
            return t.expand(batch, *t.shape[1:]) if t.shape[0] == 1 and batch > 1 else t

        prompt = getattr(adapter, "prompt_tokens", 0)
        self.cond = torch.cat([rep(pad_prompt(c.cond, prompt)) for c in conds]).to(device)
        self.pooled = torch.cat([rep(c.pooled) for c in conds]).to(device)
        guidance = [adapter.default_guidance if c.guidance is None else float(c.guidance) for c in conds]
        self.guidance = torch.cat([torch.full((batch,), g) for g in guidance]).to(device)
        first = conds[0]
        # (h, w) of each reference, or (frames, h, w) of an in-context stream, whose RoPE grid spans its frames
        self.reference_shapes = tuple(tuple(r.shape[-3 if first.reference_method == IN_CONTEXT_METHOD else -2:])
                                      for r in first.references)
        self.reference_method = first.reference_method
        self.reference_slots = first.reference_slots  # where the prompt holds them (the same for every branch here)
        self.references = (torch.cat([reference_tokens(adapter, c.references, batch) for c in conds]).to(device)
                           if first.references else None)
        # Per branch, the image size its text encode node attached (None: the latent's); families that embed it
        # (PixArt-α) read it through timestep_embedding's `sizes`.
        self.image_sizes = tuple(c.image_size for c in conds)
        # c_concat as packed tokens beside the latent's own [branches x batch, N, Cc*p*p]: a strategy embeds the
        # same token rows of both, so every split of the latent splits it alike (packed once per job).
        self.concat = (torch.cat([repeat_to_batch(adapter.pack(c.concat.float()), batch) for c in conds]).to(device)
                       if first.concat is not None else None)
        self.control = first.control  # the ControlNet chain, the same for every branch batched here (signature)
        # CLIP-vision tokens of the start image (Wan 2.1 image-to-video), per row; their count is in the signature.
        self.clip_vision = (torch.cat([rep(c.clip_vision.float()) for c in conds]).to(device)
                            if first.clip_vision is not None else None)
        # Glyph tokens of quoted text (ByT5: HunyuanVideo 1.5), per row; their count is in the signature.
        self.glyph = torch.cat([rep(c.glyph.float()) for c in conds]).to(device) if first.glyph is not None else None
        # Llama 3.1's hidden layers over the prompt (HiDream's blocks each project one), per row; shape in the signature.
        self.llama = torch.cat([rep(c.llama.float()) for c in conds]).to(device) if first.llama is not None else None
        # HiDream O1's reference images on the vision-tower path: one set per forward pass (ComfyUI's model reads the
        # first chunk's), left on the host side until a rank that embeds the prompt runs the tower, once per job.
        self.vision = first.vision
        self.vision_grid = (tuple(tuple(int(v) for v in row) for row in first.vision_grid.tolist())
                            if first.vision is not None else ())
        self._vision_rows = None
        # WanCameraEmbedding's Plücker embedding per row, left where the message put it: each forward moves only the
        # frames its tokens lie in to the device (adapter.embed_camera), once per job for each set of rows.
        self.camera = torch.cat([rep(c.camera) for c in conds]) if first.camera is not None else None
        self._camera_rows: dict[int, tuple] = {}
        # A VACE model's context per row, packed like the latent [rows, n inputs, tokens, C*4], left where the message
        # put it: each forward moves only its own tokens' rows to the device (embed), once per job for each set of
        # rows; one strength per input (the same for every branch batched here: signature).
        self.vace = (torch.cat([rep(adapter.pack(c.vace.flatten(0, 1).float()).unflatten(0, (c.vace.shape[0], -1)))
                                for c in conds]) if first.vace is not None else None)
        self.vace_strength = first.vace_strength
        self._vace_rows: dict[int, tuple] = {}
        # Wan Animate's pose latent per row, packed like the latent: each forward embeds only its own tokens' rows
        # (adapter.embed_pose), once per job for each set of rows. Its face video stays per branch (with its key):
        # the adapter turns each into motion tokens once per run (face_rows).
        self.pose = (torch.cat([rep(adapter.pack(c.pose.float())) for c in conds]).to(device)
                     if first.pose is not None else None)
        self._pose_rows: dict[int, tuple] = {}
        self.faces = tuple((c.face, c.face_key) for c in conds) if first.face is not None else ()
        self._face_rows = None
        # Rows the family joins to the embedded prompt from other inputs (HunyuanVideo 1.5: the start image's
        # vision tokens and the glyph tokens, which its embed_text puts in front of the prompt).
        self.joined_rows = getattr(adapter, "joined_rows", lambda branches: 0)(self)
        self.attention_mask = _attention_masks(conds, batch, device)
        # Rows of the embedded prompt (a family may pad it with learned tokens: adapter.prompt_rows) and the learned
        # pad rows the family appends to an image stream of n rows (adapter.stream_pad; none by default).
        self.text_len = getattr(adapter, "prompt_rows", lambda n: n)(self.cond.shape[1])
        self._stream_pad = getattr(adapter, "stream_pad", lambda n: 0)

    def with_concat(self, x_rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The model's input tokens for these rows: the latent's, then the c_concat channels of the same rows."""
        return x_rows if self.concat is None else torch.cat([x_rows, self.concat[:, index]], dim=-1)

    def embed(self, adapter: DiTAdapter, x_rows: torch.Tensor, index: torch.Tensor, hw) -> torch.Tensor:
        """The embedded image rows `index` of these branches: the latent's and c_concat's tokens through the patch
        embedding, plus a camera model's adapter rows (the same every step: computed once per job and rows)."""
        image = adapter.embed_image(self.with_concat(x_rows, index), index, hw)
        if self.camera is not None:
            image = image + rows_cached(self._camera_rows, index,
                                         lambda: adapter.embed_camera(self.camera, index, hw).to(image.dtype))
        if self.pose is not None:
            image = image + rows_cached(self._pose_rows, index, lambda: adapter.embed_pose(self.pose, index, hw))
        if self.vace is not None:  # the context rows ride behind the video's (adapter.run_blocks takes them off)
            vace = rows_cached(self._vace_rows, index,
                                lambda: adapter.embed_vace(self.vace[:, :, index.cpu()]).to(image.dtype))
            image = torch.cat([image, vace], dim=1)
        return image

    def face_rows(self, adapter: DiTAdapter, hw, share=None) -> torch.Tensor | None:
        """Wan Animate's motion tokens per row [rows, frames, 5, dim] (None: no face video), made on first use from
        each branch's face video (the adapter keeps them per face input across the run's model calls); `share`: the
        ranks that split its frames (Denoiser._face_share)."""
        if self.faces and self._face_rows is None:
            def rep(t):
                return t.expand(self.batch, *t.shape[1:]) if t.shape[0] == 1 and self.batch > 1 else t
            self._face_rows = torch.cat([rep(adapter.face_rows(face, key, hw, share)) for face, key in self.faces])
        return self._face_rows

    def vision_rows(self, adapter: DiTAdapter) -> torch.Tensor | None:
        """The vision tower's tokens of these branches' reference images (None: none), computed on first use: the
        references do not change within a job, so the tower runs once per job, not per step."""
        if self.vision is not None and self._vision_rows is None:
            self._vision_rows = adapter.embed_vision(self.vision, self.vision_grid)
        return self._vision_rows

    @property
    def carried(self) -> int:
        """Row sets riding behind the image rows through the blocks, each as many as the image's: a VACE model's
        context tokens, one set per input (their hidden states pass from block to block, and stage to stage)."""
        return 0 if self.vace is None else self.vace.shape[1]

    @property
    def ref_len(self) -> int:
        return 0 if self.references is None else self.references.shape[1]

    def extra_len(self, image_len: int) -> int:
        """Image-stream rows after the image's own: reference tokens, then the family's learned pad rows."""
        return self.ref_len + self._stream_pad(image_len + self.ref_len)


def _attention_masks(conds: list[Conditioning], batch: int, device) -> torch.Tensor | None:
    """The branches' attention masks as one bias over their rows [1 or branches x batch, L, L] (None: unmasked;
    the signature batches masked branches only with masked ones): a single mask shared by every row stays one."""
    if conds[0].attention_mask is None:
        return None
    keys = {c.attention_mask_key for c in conds}  # one key is one tensor
    if len(keys) == 1 and None not in keys and conds[0].attention_mask.shape[0] == 1:
        return conds[0].attention_mask.to(device)
    return torch.cat([repeat_to_batch(c.attention_mask, batch) for c in conds]).to(device)


def stale_caches(layout: TokenLayout, shards: range | None = None) -> tuple[StaleKVCache, StaleKVCache]:
    """Fresh joint and image-only stale K/V buffers over `layout`'s rows, or over the rows of `shards` only (every
    patch of them: a ring member's under PipeFusion x Ring)."""
    if shards is None:
        return (StaleKVCache(layout.text_len + layout.image_len + layout.ref_len),
                StaleKVCache(layout.image_len + layout.ref_len))
    every = list(range(layout.patches))
    return (StaleKVCache(sum(layout.seq_len(j, every) for j in shards)),
            StaleKVCache(sum(layout.stream_len(j, every) for j in shards)))


def control_caches(caches: tuple[StaleKVCache, StaleKVCache], layout: TokenLayout,
                   shards: range | None = None) -> tuple[StaleKVCache, StaleKVCache]:
    """The stale K/V buffers of a ControlNet's own sequence (`layout`: the DiT's without reference rows, which
    ComfyUI's ControlNets never see), kept beside the DiT's `caches` so they live and are replaced with them."""
    fresh = stale_caches(layout, shards)
    return caches[0].companion(fresh[0].seq_len), caches[1].companion(fresh[1].seq_len)


class Denoiser:
    def __init__(self, adapter: DiTAdapter, topology: Topology, comm: Comm, context: AttentionContext,
                 controlnets: ControlNets | None = None):
        self.adapter, self.topology, self.comm, self.context = adapter, topology, comm, context
        self.controlnets = controlnets or ControlNets()
        self.control: ControlPass | None = None  # the current group's ControlNet chain (model calls only)
        self.rank = comm.rank
        self.coords = topology.coords(self.rank)
        self._vote = None
        self.step_times: list[float] = []
        self.step_cache: FirstBlockCache | None = None  # the runtime's step cache of the current job (spec.cache)
        self.rope_options: list[float] | None = None  # the current job's ScaleROPE grid (Job.extra["rope_options"])

    # -- entry -----------------------------------------------------------------------------------------

    def run(self, job: Job, progress: Callable[[int, int], None] | None = None,
            cancel_requested: Callable[[], bool] = lambda: False) -> torch.Tensor | None:
        """Returns the final LATENT on the result rank, None elsewhere."""
        self.progress, self.cancel_requested = progress or (lambda i, n: None), cancel_requested
        prompt = getattr(self.adapter, "prompt_tokens", 0)
        self.context.input_amax.reduce = self._amax_exact = forward_amax_reduce(self.comm, job, prompt)
        self._amax_stale = forward_amax_reduce(self.comm, job, prompt, skip=("patch",))  # displaced patch's stale steps
        try:
            if self.topology.batch == 1:
                return self._run(job)
            return self._run_batch_group(job)
        finally:
            # The worker's callbacks close over this Denoiser: dropping them breaks the cycle, so the
            # Denoiser (and the model and K/V it references) dies with its last reference instead of
            # waiting for a full GC — which, after a model reload, came ~80 jobs later (+0.9 MiB per job).
            self.progress = self.cancel_requested = None

    def _run_batch_group(self, job: Job) -> torch.Tensor | None:
        """Batch parallel (strategies/batch.py): this rank's group runs its images, whose rows the group result
        ranks then gather; the whole batch's result comes back from group 0's."""
        validate_strategy(job.strategy, world_size=self.topology.world_size, batch=job.batch)
        shares = batch_shares(job.batch, group_speeds(job.strategy))
        group = self.coords["batch"]
        part = self._run(cut_job(job, shares[group]))
        if part is None:
            return None
        whole = gather_batch(self.comm, part, job, shares, group)
        return whole if group == 0 else None

    def _run(self, job: Job) -> torch.Tensor | None:
        if job.audio is not None:  # the worker runs these on av_sampling.AudioVideoDenoiser, which steps both latents
            raise TypeError("an audio-video job (Job.audio) runs on AudioVideoDenoiser, not on Denoiser")
        s, sp = job.strategy, job.sampling
        b, c, *spatial = job.latent.shape  # (H, W), or (T, H, W) for a video
        cfg = self.adapter.config
        validate_strategy(s, world_size=self.topology.world_size, heads=cfg.num_heads,
                          num_blocks=cfg.num_blocks, latent_hw=latent_plane(spatial),
                          cfg_scale=sp.cfg, steps=sp.steps, patch=self.adapter.patch)
        validate_branches(job)
        self.step_times = []
        self.device_weights, self.warmup_steps, self.patch_caches = s.device_weights, s.warmup_steps, {}
        self.rope_options = job.extra.get("rope_options")

        sigmas = ksampler_sigmas(self.adapter.model_sampling, sp.scheduler, sp.steps, sp.denoise)
        if len(sigmas) <= 1:  # denoise 0: KSampler returns the input untouched
            return self._comfy_shape(job.latent.clone()) if self._is_result_rank() else None
        noise = job_noise(job)
        # The sampler state lives on the worker's device, in float32 as in ComfyUI.
        ms = self.adapter.model_sampling
        x = self.adapter.pack(start_latent(job.latent.float(), noise, sigmas[0], self.adapter.latent_format, ms))
        x = x.to(self.adapter.device)
        self.sigmas = sigmas  # on the host: Python-side decisions never wait for the device
        self.sigmas_on_device = sigmas.to(self.adapter.device)  # calculate_input's sigma, uploaded once
        # The time embedding's input: the model's own timestep units (ComfyUI's model_sampling.timestep(sigma)
        # .float(), as model_base passes it), so a stock sampler's call and our loop feed the same number.
        self.timesteps_on_device = self.adapter.model_sampling.timestep(self.sigmas_on_device).float()
        self.sampler = make_sampler(sp.sampler_name, sigmas, sp.seed, (job.images, *job.latent.shape[1:]),
                                    to_state=self.adapter.pack, prediction=ms.prediction, batch_rows=job.batch_rows)

        conds = [job.positive] + ([job.negative] if cfg_uses_uncond(sp.cfg) else [])
        if s.cfg_degree == 2:
            conds = [conds[self.coords["cfg"]]]
        # Branches with the same token layout share one forward pass (a batch); otherwise each runs its own,
        # as ComfyUI runs them (T5-only encoders such as Chroma's do not pad prompts; a Kontext negative
        # often has no reference latent).
        same_layout = len({c.signature(getattr(self.adapter, "prompt_tokens", 0)) for c in conds}) == 1
        self.groups = [Branches(group, b, self.adapter, job.batch_rows, job.images)
                       for group in ([conds] if same_layout else [[c] for c in conds])]
        self.branches = self.groups[0]  # PipeFusion runs one pipeline lane per group through the same stages
        self.cfg_scale = sp.cfg
        self.uses_uncond = cfg_uses_uncond(sp.cfg)

        self._set_layout(self.branches, x.shape[1], s.patches if self.topology.pipefusion > 1 else 1)
        self.step_cache = FirstBlockCache(s, len(sigmas) - 1, self.comm) if s.cache != "off" else None
        self.hw = tuple(spatial)
        try:
            if self.topology.pipefusion > 1:
                x = self._run_pipefusion(x, s.warmup_steps, len(sigmas) - 1)
            else:
                x = self._run_sequence_parallel(x)
        finally:
            self._finish_vote()
        return self._gather_result(x, spatial)

    # -- shared pieces ---------------------------------------------------------------------------------

    def _is_result_rank(self) -> bool:
        return self.coords["pipefusion"] == self.topology.pipefusion - 1 and all(
            self.coords[d] == 0 for d in ("cfg", "naive_patch", "patch", "ring", "ulysses", "tensor"))

    @staticmethod
    def _rope(rope_full, positions: torch.Tensor):
        """The rows of the full sequence's per-token tables (adapter.rope: RoPE's cos and sin, and Wan's frame of
        each token) at `positions`."""
        if rope_full is None:  # families with absolute position embeddings (added in embed_image)
            return None
        return tuple(table[positions] for table in rope_full)

    @staticmethod
    def _prompt_len(branches: Branches) -> int:
        """Rows of the embedded prompt: the conditioning's, and those the family joins to it (joined_rows)."""
        return branches.text_len + branches.joined_rows

    def _sequence_text_len(self, branches: Branches) -> int:
        """Prompt rows in the attention sequence: none where the prompt is cross-attended (PixArt)."""
        return self._prompt_len(branches) if getattr(self.adapter, "joint_text", True) else 0

    def _text_rows(self, layout: TokenLayout, branches: Branches) -> range:
        """The prompt rows this rank embeds: its shard of a joint sequence, or the whole cross-attended prompt."""
        return layout.text_rows(self.shard) if getattr(self.adapter, "joint_text", True) else range(self._prompt_len(branches))

    def _rope_full(self, branches: Branches, extra_text: int = 0):
        """The adapter's RoPE table for the canonical sequence of one forward pass over `branches` (whose prompt is
        `extra_text` tokens longer, in front: a union ControlNet's type tokens)."""
        # Family-specific grid inputs: ScaleROPE's scale and shift (Wan), HiDream O1's prompt image blocks.
        grid = {"rope_options": self.rope_options} if self.rope_options is not None else {}
        if branches.vision_grid:
            grid["vision"] = branches.vision_grid
        if branches.reference_slots:  # Qwen-Image 2.1's references inside the prompt
            grid["slots"] = branches.reference_slots
        return self.adapter.rope(self._prompt_len(branches) + extra_text, *self.hw, branches.reference_shapes,
                                 branches.reference_method, **grid)

    def _references(self, branches: Branches, layout: TokenLayout, patches: list[int]) -> torch.Tensor | None:
        """This rank's embedded reference tokens and learned pad rows (adapter.pad_rows) for these patches, in
        the layout's [references, pads] order (fixed for the whole job: embed once)."""
        if layout.ref_len == 0:
            return None
        index = layout.ref_index(self.shard, patches, self.adapter.device)
        if branches.ref_len == layout.ref_len:  # no pad rows
            return self.adapter.embed_image(branches.references[:, index], layout.image_len + index, self.hw)
        rows = self.adapter.pad_rows(len(index), branches.cond.shape[0])
        if branches.ref_len:
            real = index < branches.ref_len
            rows = rows.clone()
            rows[:, real] = self.adapter.embed_image(branches.references[:, index[real]],
                                                     layout.image_len + index[real], self.hw)
        return rows

    def _image_stream(self, i: int, x_rows: torch.Tensor, index: torch.Tensor, refs: torch.Tensor | None,
                      branches: Branches | None = None) -> torch.Tensor:
        """Embedded image tokens of step i's forward pass (the model's input scaling applied, e.g. EPS's
        x / sqrt(sigma^2 + 1)), followed by this rank's reference tokens."""
        x_in = self.adapter.model_sampling.calculate_input(self.sigmas_on_device[i], x_rows)
        image = (branches or self.branches).embed(self.adapter, self._repeat(x_in, branches), index, self.hw)
        return image if refs is None else torch.cat([image, refs], dim=1)

    def _bias(self, branches: Branches) -> AttentionBias | None:
        """The additive attention bias of one forward pass over `branches`: ComfyUI's attention_mask, plus the
        family's own mask over the canonical sequence where its attention has a fixed structure
        (`adapter.sequence_bias`, e.g. Qwen-Image 2.1's block-causal prompt); None where neither applies."""
        mask = branches.attention_mask
        own = getattr(self.adapter, "sequence_bias", None)
        if own is not None:
            slots = {"slots": branches.reference_slots} if branches.reference_slots else {}
            own = own(self._sequence_text_len(branches), self.hw, branches.reference_shapes, **slots)
            mask = own if mask is None else mask + own
        return None if mask is None else AttentionBias(mask)

    def _text(self, rows: range, branches: Branches | None = None, t: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's embedded prompt rows. A family whose prompt embedding mixes its tokens (Lumina 2's context
        refiner) embeds the whole prompt and gives each rank its rows of it; one whose embedding also reads the
        timestep `t` (`prompt_reads_timestep`: HunyuanVideo's token refiner) embeds it again every step, with the
        inputs it joins to it (CLIP-vision and glyph tokens)."""
        b = branches or self.branches
        if getattr(self.adapter, "prompt_reads_timestep", False):
            vision = {"vision": b.vision_rows(self.adapter)} if b.vision is not None else {}  # HiDream O1's references
            return self.adapter.embed_text(b.cond, t, b.clip_vision, b.glyph, **vision)[:, rows.start:rows.stop]
        cond = b.cond
        if getattr(self.adapter, "reads_llama", False):  # HiDream: the prompt rows are T5's and Llama layers'
            return self.adapter.embed_text(cond, b.llama)[:, rows.start:rows.stop]
        if getattr(self.adapter, "embeds_whole_prompt", False):
            return self.adapter.embed_text(cond)[:, rows.start:rows.stop]
        return self.adapter.embed_text(cond[:, rows.start:rows.stop])

    def _set_layout(self, branches: Branches, image_len: int, patches: int) -> None:
        """This rank's TokenLayout and shard index: naive patch splits the image only, sequence parallelism the
        whole [text, image, references] sequence."""
        naive = self.topology.naive_patch > 1
        group = self.comm.group(self._shard_group())
        self.layout = TokenLayout(text_len=self._sequence_text_len(branches), image_len=image_len, patches=patches,
                                  shards=group.size, split_text=not naive, ref_len=branches.extra_len(image_len),
                                  weights=self._weights_of(group.ranks))
        self.shard = group.index

    def _layout_of(self, branches: Branches) -> TokenLayout:
        """The layout of a forward pass over `branches`: their prompt and reference lengths decide the shards and
        every position after them (the image rows are the same for every group)."""
        return dataclasses.replace(self.layout, text_len=self._sequence_text_len(branches),
                                   ref_len=branches.extra_len(self.layout.image_len))

    def _face_share(self):
        """Who splits Wan Animate's motion encoder (a per-frame network on 512x512 faces): the ranks that split the
        image tokens hold the same branches, so each encodes a run of the frames and they gather the codes. Tensor
        ranks and pipeline stages each encode all (one pass per run and face input)."""
        group = self.comm.group(self._shard_group())
        if group.size == 1:
            return None
        return group.index, group.size, lambda t: self.comm.all_gather(t.contiguous(), group, op="face")

    def _shard_group(self) -> str:
        """The group whose members split the image tokens: naive or displaced patch's, else the sequence group."""
        return next((d for d in ("naive_patch", "patch") if getattr(self.topology, d) > 1), "sp")

    def _weights_of(self, ranks: list[int], dims: tuple[str, ...] | None = None) -> tuple[float, ...]:
        """Each member's share of a split over `ranks` (empty where the job splits equally): the slowest device
        among all that hold the same piece, i.e. agree with the member on `dims` (default: the shard group's own).
        CFG partners and pipeline stages must hold the same rows (they exchange them), so their shares agree."""
        weights = getattr(self, "device_weights", ())
        if len(set(weights)) <= 1:
            return ()
        t = self.topology
        dims = dims or {"naive_patch": ("naive_patch",), "patch": ("patch",)}.get(self._shard_group(),
                                                                                   ("ring", "ulysses"))

        def share(member: int) -> float:
            mine = t.coords(member)
            return min(weights[r] for r in range(t.world_size) if all(t.coords(r)[d] == mine[d] for d in dims))

        return tuple(share(r) for r in ranks)

    def _temb(self, i: int, branches: Branches | None = None) -> torch.Tensor:
        branches = branches or self.branches
        return self._embed_time(self._timestep(i, branches), branches)

    def _timestep(self, i: int, branches: Branches) -> torch.Tensor:
        """Step i's timestep per row of `branches`, in the model's units."""
        return self.timesteps_on_device[i].expand(branches.cond.shape[0])

    def _embed_time(self, t: torch.Tensor, branches: Branches) -> torch.Tensor:
        """The adapter's embedding of per-row timesteps t: the per-row conditioning every block reads. PixArt-α also
        embeds the branches' image sizes there, Wan 2.1 image-to-video the start image's CLIP-vision tokens."""
        extra = {"sizes": branches.image_sizes} if getattr(self.adapter, "reads_image_size", False) else {}
        if getattr(self.adapter, "reads_clip_vision", False):
            extra["clip_vision"] = branches.clip_vision
        if branches.vace is not None:  # how many context row sets ride behind the image rows, and their strengths
            extra["vace_strength"] = branches.vace_strength
        if getattr(self.adapter, "reads_llama", False):  # HiDream's blocks each project a Llama layer of the prompt
            extra["llama"] = branches.llama
        if branches.faces:  # Wan Animate's face blocks read each row's motion tokens
            extra["face"] = branches.face_rows(self.adapter, self.hw, self._face_share())
        return self.adapter.timestep_embedding(t, branches.pooled, branches.guidance, self.hw, **extra)

    def _repeat(self, x: torch.Tensor, branches: Branches | None = None) -> torch.Tensor:
        count = (branches or self.branches).count
        return x.repeat(count, 1, 1) if count > 1 else x

    def _branch_denoised(self, i: int, x_rows: torch.Tensor, image_hidden: torch.Tensor, temb: torch.Tensor,
                         rope, branches: Branches | None = None) -> tuple[torch.Tensor, ...]:
        """Last-stage head of one forward pass: velocity -> denoised, one tensor per branch it carried."""
        branches = branches or self.branches
        x = self._repeat(x_rows, branches)
        v = model_output(self.adapter, image_hidden, temb, rope, x)
        return self.adapter.model_sampling.calculate_denoised(self.sigmas[i], v, x).chunk(branches.count)

    def _denoised(self, i: int, x_rows: torch.Tensor, image_hidden: torch.Tensor, temb: torch.Tensor,
                  rope) -> torch.Tensor:
        """Last-stage head, then CFG across branches (and ranks)."""
        return self._cfg(self._branch_denoised(i, x_rows, image_hidden, temb, rope))

    def _cfg(self, den: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.topology.cfg > 1:
            den = self.comm.all_gather(den[0].contiguous(), self.comm.group("cfg"), op="cfg")
        return cfg_combine(den[0], den[1] if self.uses_uncond else None, self.cfg_scale)

    def _check_cancel(self) -> None:
        """All ranks agree to stop at the same step: each step's vote is read one step later, so no rank
        waits on the vote (and the pipeline never stalls for it)."""
        previous = self._vote
        self._vote = self.comm.vote_async(self.cancel_requested())
        if previous is not None:
            work, flag = previous
            if work is not None:
                work.wait()
            if int(flag.item()):
                raise Cancelled("cancelled by the user")

    def _finish_vote(self) -> None:
        if self._vote is not None and self._vote[0] is not None:
            self._vote[0].wait()
        self._vote = None

    @property
    def reports_progress(self) -> bool:
        return self._is_result_rank() and self.coords["batch"] == 0

    def _step_done(self, i: int, t0: float) -> None:
        # Time the work, not how fast it was queued: wait until the compute stream ran the step, and for nothing
        # else. A device-wide sync would also wait for the transfers still in flight on NCCL's streams (PipeFusion's
        # last sends of the step), holding every stage until its peer had received them.
        StreamMark(self.adapter.device).wait()
        self.step_times.append(time.perf_counter() - t0)
        self.progress(i + 1, len(self.sigmas) - 1)

    def _gather_shards(self, x: torch.Tensor) -> torch.Tensor:
        """x with every shard's image rows filled in from the rank that holds them (sequence or naive patch)."""
        group = self.comm.group(self._shard_group())
        if group.size == 1:
            return x
        parts = self.comm.all_gather(x, group, op="result")
        full = x.clone()
        for j, part in enumerate(parts):
            idx = self.layout.image_index(j, list(range(self.layout.patches)), x.device)
            full[:, idx] = part[:, idx]
        return full

    def _gather_result(self, x: torch.Tensor, spatial) -> torch.Tensor | None:
        if self.topology.pipefusion > 1 and self.coords["pipefusion"] != self.topology.pipefusion - 1:
            return None  # only the last stage holds the sampled rows
        x = self._gather_shards(x)
        if not self._is_result_rank():
            return None
        return self._comfy_shape(final_latent(self.adapter.unpack(x, *spatial), self.sigmas[-1],
                                              self.adapter.latent_format, self.adapter.model_sampling).cpu())

    def _comfy_shape(self, latent: torch.Tensor) -> torch.Tensor:
        """The result as KSampler returns it: an image in a video VAE's latent format (Qwen-Image's Wan 2.1) is 5D
        there, with one frame; a video already is."""
        return latent.unsqueeze(2) if self.adapter.latent_format.dimensions == 3 and latent.ndim == 4 else latent

    # -- sequence parallel (also serial, CFG-only and naive patch) -------------------------------------

    def _run_sequence_parallel(self, x: torch.Tensor) -> torch.Tensor:
        me = self.shard
        forwards = [self._forward_setup(branches, x.device) for branches in self.groups]
        rows = self.layout.image_slice(me, 0)
        index = torch.arange(rows.start, rows.stop, device=x.device)
        for i in range(len(self.sigmas) - 1):
            t0 = time.perf_counter()
            self._check_cancel()
            if i and getattr(self.adapter, "prompt_reads_timestep", False):  # this step's embedded prompt
                forwards = [self._forward_setup(branches, x.device, i) for branches in self.groups]
            x_rows = x[:, rows]
            predict = self._predictions if self.step_cache is None else self._cached_predictions
            x[:, rows] = self.sampler.step(i, x_rows, self._cfg(predict(i, x_rows, index, forwards)), region=rows)
            self._step_done(i, t0)
        return x

    def _predictions(self, i: int, x_rows: torch.Tensor, index: torch.Tensor,
                     forwards: list[tuple]) -> tuple[torch.Tensor, ...]:
        """Step i's per-branch predictions of this rank's rows: one forward pass per branch group."""
        den: tuple[torch.Tensor, ...] = ()
        for branches, (attention, image_attention, rope, text, refs) in zip(self.groups, forwards):
            self.context.attention, self.context.image_attention = attention, image_attention
            temb = self._temb(i, branches)
            image = self._image_stream(i, x_rows, index, refs, branches)
            with self._displaced(attention, image_attention, sync=i < self.warmup_steps):
                image, _ = self.adapter.run_blocks(image, text, temb, rope)
            den += self._branch_denoised(i, x_rows, image[:, :len(index)], temb, rope, branches)
        return den

    def _cached_predictions(self, i: int, x_rows: torch.Tensor, index: torch.Tensor,
                            forwards: list[tuple]) -> tuple[torch.Tensor, ...]:
        """_predictions under the First-Block Cache (step_cache.py): every group's first block,
        one decision for the whole step (all ranks), then every group's remaining blocks or their cached delta."""
        cache = self.step_cache
        first_blocks, rest = split_first(self.adapter.chunks[0])
        passes = []
        for k, (branches, (attention, image_attention, rope, text, refs)) in enumerate(zip(self.groups, forwards)):
            self.context.attention, self.context.image_attention = attention, image_attention
            temb = self._temb(i, branches)
            image = self._image_stream(i, x_rows, index, refs, branches)
            with self._displaced(attention, image_attention, sync=i < self.warmup_steps):
                first, first_text = run_block_range(self.adapter, first_blocks, image, text, temb, rope)
            residual = first - image
            cache.measure(k, residual)
            passes.append((temb, first, first_text, residual))
        skip = cache.decide(i, list(range(len(passes))))
        den: tuple[torch.Tensor, ...] = ()
        for k, (branches, forward, (temb, first, first_text, residual)) in enumerate(zip(self.groups, forwards,
                                                                                      passes)):
            attention, image_attention, rope = forward[:3]
            if skip:
                image = cache.reuse(k, first)
            else:
                self.context.attention, self.context.image_attention = attention, image_attention
                with self._displaced(attention, image_attention, sync=i < self.warmup_steps):
                    image, _ = run_block_range(self.adapter, rest, first, first_text, temb, rope)
                cache.refresh(k, first, image, residual)
            den += self._branch_denoised(i, x_rows, image[:, :len(index)], temb, rope, branches)
        return den

    @contextlib.contextmanager
    def _displaced(self, *attentions, sync: bool):
        """One forward pass's displaced patch attention: exact (`sync`: warm-up) or over last step's K/V of the
        other patches, whose exchange lands when the pass ends. Other attentions pass through."""
        displaced = [a for a in attentions if isinstance(a, DisplacedPatchAttention)]
        for a in displaced:
            a.sync = sync
        if displaced:  # see forward_amax.py: a stale step's patches keep their own input amax
            self.context.input_amax.reduce = self._amax_exact if sync else self._amax_stale
        try:
            yield
        finally:
            for a in displaced:  # also on an error: no exchange may stay in flight into the next job
                a.land()

    def _forward_setup(self, branches: Branches, device, step: int = 0) -> tuple:
        """(joint attention, image-only attention, RoPE rows, embedded text rows, embedded reference rows) of
        this rank for one forward pass over `branches` (at `step`, for a prompt embedding that reads the
        timestep): its prompt and reference lengths decide the shards and every position after them."""
        layout = self._layout_of(branches)
        me, bias = self.shard, self._bias(branches)
        if self.topology.naive_patch > 1:
            mine = layout.positions(me, [0], device)
            attention = LocalAttention(bias.block(mine, mine) if bias is not None else None)
            image_attention = LocalAttention()
        elif self.topology.patch > 1:
            attention, image_attention = self._displaced_attention(branches, layout, bias, device)
        else:
            shards = range(layout.shards)
            rows = [layout.positions(j, [0], device) for j in shards] if bias is not None else None
            attention = self._sequence_attention([layout.seq_len(j, [0]) for j in shards], bias, rows)
            image_attention = self._sequence_attention([layout.stream_len(j, [0]) for j in shards])
        rope = self._rope(self._rope_full(branches), layout.positions(me, [0], device))
        text = self._text(self._text_rows(layout, branches), branches, self._timestep(step, branches))
        return attention, image_attention, rope, text, self._references(branches, layout, [0])

    def _displaced_attention(self, branches: Branches, layout: TokenLayout, bias: AttentionBias | None,
                             device) -> tuple[DisplacedPatchAttention, DisplacedPatchAttention]:
        """Joint and image-only attention of displaced patch parallelism over `branches`' stale buffers, which
        live as long as the job (a stock sampler's call: its slot, see model_call.py)."""
        caches = self.patch_caches.get(id(branches))
        if caches is None or caches[0].seq_len != layout.text_len + layout.image_len + layout.ref_len:
            caches = self.patch_caches[id(branches)] = stale_caches(layout)
        group, shards = self.comm.group("patch"), range(layout.shards)
        joint = [layout.positions(j, [0], device) for j in shards]
        inner = LocalAttention(bias.block(joint[self.shard]) if bias is not None else None)
        return (DisplacedPatchAttention(caches[0], self.comm, group, joint, inner),
                DisplacedPatchAttention(caches[1], self.comm, group,
                                        [layout.image_positions(j, [0], device) for j in shards], LocalAttention()))

    def _ulysses_heads(self, uly) -> list[int] | None:
        """Heads per Ulysses member under device weights (None: equal), the same for every ring member, stage and
        CFG branch of one Ulysses coordinate (ring blocks and stale buffers carry that member's heads)."""
        weights = self._weights_of(uly.ranks, dims=("ulysses",))
        heads = self.adapter.config.num_heads // self.topology.tensor
        return weighted_counts(heads, weights) if weights else None

    def _sequence_attention(self, seq: list[int], bias: AttentionBias | None = None,
                            rows: list[torch.Tensor] | None = None):
        """Ring over Ulysses groups for tokens whose per-shard lengths are `seq` (sequence-parallel order:
        shard r * ulysses + u). Joint [text, image] attention and image-only attention differ only in `seq`.

        With an attention mask, `rows[j]` are shard j's canonical positions: a Ulysses group's attention sees
        its members' rows in member order, as queries and as the keys of the ring block it starts with."""
        t = self.topology
        ring, uly = self.comm.group("ring"), self.comm.group("ulysses")
        kv_lengths = [sum(seq[r * t.ulysses:(r + 1) * t.ulysses]) for r in range(t.ring)]
        blocks = ring_blocks(bias, rows, t.ulysses, self.coords["ring"]) if bias is not None else None
        attention = (RingAttention(self.comm, ring, kv_lengths, blocks) if ring.size > 1
                     else LocalAttention(blocks[0] if blocks else None))
        if uly.size > 1:
            r = self.coords["ring"]
            attention = UlyssesAttention(self.comm, uly, seq[r * t.ulysses:(r + 1) * t.ulysses], attention,
                                         self._ulysses_heads(uly))
        return attention

    # -- PipeFusion ------------------------------------------------------------------------------------

    def _run_pipefusion(self, x: torch.Tensor, warmup: int, n_steps: int,
                        lanes: list[tuple[Branches, tuple[StaleKVCache, StaleKVCache]]] | None = None,
                        model_output: torch.Tensor | None = None) -> torch.Tensor:
        """Stage loop. A rank runs its chunks of blocks (one, or two interleaved virtual stages) for each
        token set in turn; messages between chunks are the [text ; image] hidden rows of this Ulysses shard,
        and the last chunk sends each updated patch of x straight back to rank 0.

        Branch groups of different token layouts (prompts of different lengths, a reference latent on one side)
        each run their own lane through the same stages: its rows, its stale buffers, its embedded prompt.
        A stock sampler's call (model_call.py) passes its one group with the stale buffers its previous call left
        (`lanes`) and `model_output`, where the last chunk then writes each patch's model output instead of
        sampling."""
        # Joint [text, image] attention and image-only attention (SD3.5 Medium's second attention, PixArt's
        # self-attention) each keep their own stale buffers, over their own rows.
        lanes = lanes or [(branches, stale_caches(self._layout_of(branches), self._ring_shards()))
                          for branches in self.groups]
        self.cache, self.image_cache = lanes[0][1]
        return _PipeFusionStage(self, x, warmup, n_steps, model_output, lanes).run()

    def _ring_shards(self) -> range | None:
        """Under PipeFusion x Ring, the shards whose rows this rank's ring member holds (its Ulysses group's, in
        sequence-parallel order ring * ulysses + u) and whose K/V its stale buffers keep; None without Ring."""
        t = self.topology
        if t.ring == 1:
            return None
        return range(self.coords["ring"] * t.ulysses, (self.coords["ring"] + 1) * t.ulysses)

    def _share_prompt(self, text: torch.Tensor | None, rows: int, pp, branches: Branches) -> torch.Tensor:
        """Stage 0's embedded prompt, broadcast once per job to every other stage of its pipeline."""
        if pp.index != 0:
            text = torch.empty((branches.cond.shape[0], rows, self.adapter.config.hidden_size),
                               dtype=self.adapter.dtype, device=self.adapter.device)
        return self.comm.broadcast(text.contiguous(), pp, op="pipefusion")

    def _recv(self, buf: torch.Tensor, src: int, op: str) -> torch.Tensor:
        self.comm.irecv(buf, src, op=op).wait()
        return buf


class _TokenSet(NamedTuple):
    """One lane's token set (the whole image or one patch) on this rank, built once: the buffer rows its fresh K/V
    go to and the attention over the buffer (joint, then image-only), the Ulysses members' sequence lengths, this
    rank's rows of x, its RoPE rows, the image-stream lengths and its embedded references (stage 0)."""

    rows: torch.Tensor
    inner: object
    image_rows: torch.Tensor
    image_inner: object
    lengths: list[int]
    index: torch.Tensor
    rope: object
    stream_lengths: list[int]
    refs: torch.Tensor | None


class _Lane:
    """One branch group's way through the stages: its token layout, stale K/V buffers and attention over them,
    embedded prompt rows and per-set token tables. PipeFusion without CFG parallel runs one lane per token layout
    of the CFG branches (a prompt of another length, a reference latent on one side only), as serial runs them
    as separate forward passes; branches of one layout share a lane (one batch)."""

    def __init__(self, branches: Branches, layout: TokenLayout, caches: tuple[StaleKVCache, StaleKVCache]):
        self.branches, self.layout = branches, layout
        self.cache, self.image_cache = caches
        self.token_sets: dict = {}  # built once per token set, on x's device: no host-device traffic in the pipeline
        self.temb: torch.Tensor | None = None  # this step's time embedding of the lane's rows


class _PipeFusionStage:
    """This rank's stage of one PipeFusion run (Denoiser._run_pipefusion), updating the sampler state x in
    place: its attention over the stale K/V buffers, its token sets, and the step loop that passes hidden rows
    from chunk to chunk. Items run in the order (chunk, token set, lane); the last chunk samples a token set once
    every lane has predicted it."""

    def __init__(self, denoiser: Denoiser, x: torch.Tensor, warmup: int, n_steps: int,
                 model_output: torch.Tensor | None, lanes: list[tuple[Branches, tuple[StaleKVCache, StaleKVCache]]]):
        self.denoiser, self.x, self.warmup, self.n_steps = denoiser, x, warmup, n_steps
        self.model_output = model_output
        self.adapter, self.comm = denoiser.adapter, denoiser.comm
        self.me = denoiser.shard
        self.pp, self.uly, self.ring = (self.comm.group(name) for name in ("pipefusion", "ulysses", "ring"))
        self.stage, self.stages = self.pp.index, self.pp.size
        # The shards of this rank's Ulysses group (its ring member's rows), in sequence-parallel order.
        self.shards = denoiser._ring_shards() or range(self.uly.size)
        self.chunks = len(self.adapter.chunks)
        # Where this rank's chunk outputs go (rank 0 after the last rank), and where its inputs come from.
        self.after = self.pp.ranks[(self.stage + 1) % self.stages]
        self.before = self.pp.ranks[(self.stage - 1) % self.stages]
        self.all_patches = list(range(denoiser.layout.patches))
        self.joint = getattr(self.adapter, "joint_text", True)
        self.lanes = [self._lane(branches, caches) for branches, caches in lanes]
        self.den: tuple[torch.Tensor, ...] = ()  # the last chunk's per-branch predictions of the current token set
        self.sends: list = []
        # A model call's ControlNet chain: the first stage runs it on each token set, and its distinct residuals
        # (n_res tensors of the set's image rows) ride behind the hidden rows to the stages that add them.
        self.control = denoiser.control
        self.n_res = self.control.plan.count if self.control is not None else 0
        self.control_lanes: dict[int, _Lane] = {}  # id(lane) -> the ControlNet's lane, where the lane has references

    def _lane(self, branches: Branches, caches: tuple[StaleKVCache, StaleKVCache],
              layout: TokenLayout | None = None) -> _Lane:
        """The lane of a branch group; `layout`: another sequence over the same image rows (a ControlNet's), whose
        lane only attends (the ControlPass embeds its own prompt)."""
        d = self.denoiser
        lane = _Lane(branches, layout or d._layout_of(branches), caches)
        lane.bias, lane.rope_full = d._bias(branches) if layout is None else None, d._rope_full(branches)
        if self.ring.size > 1:
            lane.ring_rows = self._ring_buffer_rows(lane.layout.positions)
            lane.ring_image_rows = self._ring_buffer_rows(lane.layout.image_positions)
        self._attach_attention(lane)
        if layout is None:
            self._embed_prompt(lane)
        return lane

    def _control_outputs(self, lane: _Lane, patches: list[int], idx: torch.Tensor, rope) -> list[torch.Tensor]:
        """The ControlNet chain's residuals of one token set (stage 0). ComfyUI's ControlNets never see the
        reference rows: where the lane has some, the chain attends over its own lane (the layout without them,
        its stale buffers kept beside the lane's), then the DiT's attention is pointed back at the lane."""
        if lane.layout.ref_len == 0:
            return self.control.outputs(self.x[:, idx], idx, rope)
        own = self.control_lanes.get(id(lane))
        if own is None:
            layout = dataclasses.replace(lane.layout, ref_len=0)
            caches = control_caches((lane.cache, lane.image_cache), layout, self.denoiser._ring_shards())
            own = self.control_lanes[id(lane)] = self._lane(lane.branches, caches, layout)
        _, own_rope, _ = self._configure(own, patches)
        try:
            return self.control.outputs(self.x[:, idx], idx, own_rope)
        finally:
            self._configure(lane, patches)

    def _ring_buffer_rows(self, rows_of) -> list[torch.Tensor]:
        """Each ring member's stale buffer rows, in canonical order: `rows_of(shard, patches, device)` of its
        Ulysses group's shards, every patch."""
        u, device = self.uly.size, self.x.device
        return [torch.cat([rows_of(j, self.all_patches, device) for j in range(q * u, (q + 1) * u)]).sort().values
                for q in range(self.ring.size)]

    def _attach_attention(self, lane: _Lane) -> None:
        """The model's joint and image-only attention over the lane's stale buffers (through Ulysses where the
        stage is sharded)."""
        uly = self.uly
        lane.image_inner = LocalAttention()
        lane.stale = StaleKVAttention(lane.cache, LocalAttention())  # inner attention: per token set
        lane.stale_image = StaleKVAttention(lane.image_cache, lane.image_inner)
        heads = self.denoiser._ulysses_heads(uly)
        lane.attention = lane.stale if uly.size == 1 else UlyssesAttention(self.comm, uly, [], lane.stale, heads)
        lane.image_attention = (lane.stale_image if uly.size == 1
                                else UlyssesAttention(self.comm, uly, [], lane.stale_image, heads))

    def _embed_prompt(self, lane: _Lane) -> None:
        """Stage 0's embedded prompt rows of the lane (every stage's, where the prompt is cross-attended)."""
        d, b = self.denoiser, lane.branches
        text_rows = lane.text_rows = d._text_rows(lane.layout, b)
        lane.text = d._text(text_rows, b, t=d._timestep(0, b)) if self.stage == 0 else None
        if not self.joint:  # a cross-attended prompt never changes: every stage gets it once, not with every patch
            lane.text = d._share_prompt(lane.text, len(text_rows), self.pp, b)
        lane.n_text = len(text_rows) if self.joint else 0  # prompt rows in each message between chunks

    def _is_first(self, chunk: int) -> bool:  # the very first virtual stage embeds
        return self.stage == 0 and chunk == 0

    def _is_last(self, chunk: int) -> bool:  # the very last one predicts, samples and returns x
        return self.stage == self.stages - 1 and chunk == self.chunks - 1

    def _token_set(self, lane: _Lane, patches: list[int]):
        key = tuple(patches)
        if key not in lane.token_sets:
            layout, device = lane.layout, self.x.device
            positions = torch.cat([layout.positions(j, patches, device) for j in self.shards])
            image_positions = torch.cat([layout.image_positions(j, patches, device) for j in self.shards])
            lane.token_sets[key] = _TokenSet(
                *self._buffer_attention(lane, positions, image_positions),
                [layout.seq_len(j, patches) for j in self.shards],
                layout.image_index(self.me, patches, device),
                self.denoiser._rope(lane.rope_full, layout.positions(self.me, patches, device)),
                [layout.stream_len(j, patches) for j in self.shards],
                self.denoiser._references(lane.branches, layout, patches) if self.stage == 0 else None)
        return lane.token_sets[key]

    def _buffer_attention(self, lane: _Lane, positions: torch.Tensor, image_positions: torch.Tensor) -> tuple:
        """(buffer rows, attention over the buffer) of the joint and the image-only attention for the queries at
        these canonical `positions` (the Ulysses group's rows, in member order). Without Ring the buffers hold the
        whole sequence in canonical order; under Ring each member's buffer holds its own rows (`ring_rows`), which
        RingAttention passes around whole: fresh rows of this token set from every member, stale rows of the
        others."""
        bias = lane.bias
        if self.ring.size == 1:  # the attention mask's rows of these queries over the whole buffer's keys
            joint = LocalAttention(bias.block(positions) if bias is not None else None)
            return positions, joint, image_positions, lane.image_inner
        keys, image_keys, mine = lane.ring_rows, lane.ring_image_rows, self.ring.index
        blocks = [bias.block(positions, k) for k in keys] if bias is not None else None
        joint = RingAttention(self.comm, self.ring, [len(k) for k in keys], blocks)
        image = RingAttention(self.comm, self.ring, [len(k) for k in image_keys])
        return (torch.searchsorted(keys[mine], positions), joint,
                torch.searchsorted(image_keys[mine], image_positions), image)

    def _configure(self, lane: _Lane, patches: list[int]):
        """Point the model's attention at the lane's token set of one forward: whole image (warmup) or one
        patch."""
        (lane.stale.positions, lane.stale.inner, lane.stale_image.positions, lane.stale_image.inner, lengths, idx, rope,
         stream_lengths, refs) = self._token_set(lane, patches)
        if self.uly.size > 1:
            lane.attention.seq_lengths = lengths
            lane.image_attention.seq_lengths = stream_lengths
        self.denoiser.context.attention, self.denoiser.context.image_attention = lane.attention, lane.image_attention
        return idx, rope, refs

    def _hidden_buffer(self, lane: _Lane, patches) -> torch.Tensor:
        """The receive buffer of one message between chunks: its size is the lane's (prompt and reference rows)."""
        carried = self.n_res + lane.branches.carried  # ControlNet residuals, VACE context rows: image-sized each
        n_stream = lane.layout.stream_len(self.me, patches) + carried * len(self._token_set(lane, patches).index)
        batch, width = lane.branches.cond.shape[0], self.adapter.config.hidden_size
        return torch.empty((batch, lane.n_text + n_stream, width), dtype=self.adapter.dtype, device=self.adapter.device)

    def _send(self, tensor: torch.Tensor, dst: int, op: str) -> None:
        self.sends.append((self.comm.isend(tensor, dst, op=op), tensor))

    def _chunk_forward(self, i, chunk, patches, lane: _Lane, incoming):
        """Run one chunk of blocks on one lane's token set; the last chunk also samples and sends x back."""
        idx, rope, refs = self._configure(lane, patches)
        res = []
        if self._is_first(chunk):
            image, txt = self.denoiser._image_stream(i, self.x[:, idx], idx, refs, lane.branches), lane.text
            if self.control is not None:
                res = self._control_outputs(lane, patches, idx, rope)
        else:
            if self.n_res:
                incoming, res = incoming[:, :-self.n_res * len(idx)], list(incoming[:, -self.n_res * len(idx):]
                                                                             .split(len(idx), dim=1))
            n_text = lane.n_text
            txt, image = (incoming[:, :n_text], incoming[:, n_text:]) if self.joint else (lane.text, incoming)
        extra = {"residuals": Residuals(res, self.control.plan)} if self.control is not None else {}
        image, txt = self._blocks(i, chunk, patches, lane, image, txt, rope, extra)
        if not self._is_last(chunk):
            self._send(torch.cat(([txt] if self.joint else []) + [image] + res, dim=1).contiguous(), self.after,
                       "pipefusion")
            return
        if self.model_output is not None:  # a stock sampler's call (one lane): the host samples
            self.model_output[:, idx] = model_output(self.adapter, image[:, :len(idx)], lane.temb, rope, self.x[:, idx])
            return
        self.den += self.denoiser._branch_denoised(i, self.x[:, idx], image[:, :len(idx)], lane.temb, rope,
                                                   lane.branches)
        if lane is self.lanes[-1]:  # every branch has predicted these rows: CFG, then the sampler step
            den, self.den = self.denoiser._cfg(self.den), ()
            self._sample_patches(i, patches, idx, den)

    def _blocks(self, i, chunk, patches, lane: _Lane, image, txt, rope, extra):
        """One chunk's blocks on one token set. Under the step cache (patch steps only), the very first chunk's
        first block measures this step's change of the patch, and a skipped step adds each chunk's cached delta of
        the patch instead of running its blocks (so it refreshes none of their stale K/V)."""
        cache = self.denoiser.step_cache
        if cache is None or i < self.warmup:
            return self.adapter.run_blocks(image, txt, lane.temb, rope, chunk=chunk, **extra)
        key, blocks, residual = (self.lanes.index(lane), patches[0], chunk), self.adapter.chunks[chunk], None
        first = image
        if self._is_first(chunk):
            head, blocks = split_first(blocks)
            first, txt = run_block_range(self.adapter, head, image, txt, lane.temb, rope, **extra)
            residual = first - image
            cache.measure(key, residual)
        if self.skip:
            return cache.reuse(key, first), txt
        out, txt = run_block_range(self.adapter, blocks, first, txt, lane.temb, rope, **extra)
        cache.refresh(key, first, out, residual)
        return out, txt

    def _cache_decision(self, i: int) -> bool:
        """Whether step i skips, the same on every rank: stage 0 decides from step i-1's change over every patch
        (all-reduced over its row peers), and each stage sends the decision on to the next ahead of the step's
        hidden rows, which it waits for anyway."""
        cache = self.denoiser.step_cache
        if self.stage == 0:
            keys = [(k, p, c) for k in range(len(self.lanes)) for p in self.all_patches for c in range(self.chunks)]
            skip = cache.decide(i, keys)
            flag = torch.full((1,), int(skip), dtype=torch.int32, device=self.x.device)
        else:
            flag = self.denoiser._recv(torch.zeros(1, dtype=torch.int32, device=self.x.device), self.before,
                                       "pipefusion")
            skip = bool(flag.item())
            if skip:  # stage 0's decide() keeps its own list
                cache.skipped.append(i)
        if self.stage + 1 < self.stages:
            self._send(flag, self.after, "pipefusion")
        return skip

    def _sample_patches(self, i, patches, idx, den) -> None:
        """The last chunk's sampler step on this rank's rows of `patches` (CFG-combined prediction `den`), sent
        back to rank 0 for step i + 1."""
        x = self.x
        x_rows = x[:, idx]
        # The sampler works on contiguous slices; a rank's rows are one slice per patch.
        offset = 0
        for sl in (self.lanes[0].layout.image_slice(self.me, p) for p in patches):
            n = sl.stop - sl.start
            x[:, sl] = self.denoiser.sampler.step(i, x_rows[:, offset:offset + n], den[:, offset:offset + n],
                                                  region=sl)
            offset += n
        if i + 1 < self.n_steps:
            self._send(x[:, idx].contiguous(), self.pp.ranks[0], "pipefusion_x")

    def _receive_x(self, patches):
        x = self.x
        idx = self._token_set(self.lanes[0], patches).index  # image rows: the same in every lane
        x[:, idx] = self.denoiser._recv(x.new_empty((x.shape[0], len(idx), x.shape[2])), self.pp.ranks[-1],
                                        "pipefusion_x")

    def _schedule(self, i):
        """The token sets of step i, in order: the whole image while warming up, then patch by patch. The
        last chunk sends x back in the same pieces."""
        return [self.all_patches] if i < self.warmup else [[p] for p in self.all_patches]

    def run(self) -> torch.Tensor:
        i = 0
        try:
            for i in range(self.n_steps):
                self._step(i)
        except Cancelled:
            # Rank 0 drains what the last chunk already sent back after step i-1, so no message is left in
            # flight to pair with the next job's receives.
            if self.stage == 0 and i > 0:
                for patches in self._schedule(i - 1):
                    self._receive_x(patches)
            raise
        finally:
            for work, _ in self.sends:
                work.wait()
        return self.x

    def _step(self, i: int) -> None:
        """Step i: this rank's chunks over the step's token sets and lanes, each chunk's input received while the
        chunk before it computes."""
        d = self.denoiser
        t0 = time.perf_counter()
        d._check_cancel()
        self.skip = d.step_cache is not None and self._cache_decision(i)
        for lane in self.lanes:
            lane.temb = d._temb(i, lane.branches)
            if i and self.stage == 0 and getattr(self.adapter, "prompt_reads_timestep", False):  # this step's prompt
                lane.text = d._text(lane.text_rows, lane.branches, t=d._timestep(i, lane.branches))
        items = [(c, patches, lane) for c in range(self.chunks) for patches in self._schedule(i) for lane in self.lanes]
        if self.stage == 0 and i > 0 and i - 1 < self.warmup:
            self._receive_x(self.all_patches)  # the update of the last synchronous step
        pending = None
        for k, (chunk, patches, lane) in enumerate(items):
            if self._is_first(chunk) and lane is self.lanes[0] and i > 0 and i - 1 >= self.warmup:
                self._receive_x(patches)  # this patch's update from the previous step, fresh off the last chunk
            incoming = None
            if not self._is_first(chunk):
                incoming = pending.result() if pending else d._recv(self._hidden_buffer(lane, patches), self.before,
                                                                    "pipefusion")
                pending = None
            # Post the next item's receive (sized by its lane) before computing this one: transfer overlaps compute.
            if k + 1 < len(items) and not self._is_first(items[k + 1][0]):
                _, next_patches, next_lane = items[k + 1]
                pending = _Pending(self.comm, self._hidden_buffer(next_lane, next_patches), self.before)
            self._chunk_forward(i, chunk, patches, lane, incoming)
            self.sends[:] = [s for s in self.sends if not s[0].is_completed()]
        d._step_done(i, t0)


class _Pending:
    """A posted receive whose buffer is read later."""

    def __init__(self, comm: Comm, buf: torch.Tensor, src: int):
        self.buf, self.work = buf, comm.irecv(buf, src, op="pipefusion")

    def result(self) -> torch.Tensor:
        self.work.wait()
        return self.buf
