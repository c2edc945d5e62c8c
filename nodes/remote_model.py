"""A ComfyUI MODEL whose diffusion model runs on the ParaDiT workers.

Load Parallel DiT builds the same BaseModel UNETLoader builds (ComfyUI's own detection picks the model class,
model_sampling and latent format from the file's header), but without its diffusion model: in its place sits
`RemoteDiT`, which holds no weights and turns each call into one runtime job. So KSampler, KSamplerAdvanced,
SamplerCustomAdvanced, guiders and model-sampling patches work unchanged, and Parallel Sampler finds the handle
it needs on the same object.
"""
from __future__ import annotations

import logging
import types
import weakref

import torch

from . import av_call, controlnet, convert, hidream_o1_call, kandinsky6_call, ltx2_call
from .host import HOST

log = logging.getLogger(__name__)

# Families whose several-stream model calls RemoteDiT converts (their jobs still refused by Parallel Sampler).
_AV_DOORS = ("minimax_h3", "ltx2", "kandinsky6")
# ComfyUI's BaseModel classes whose diffusion model never runs DIFFUSION_MODEL wrappers (SD3's MMDiT, PixArt's
# PixArtMS): a wrapper such as EasyCache's does nothing on UNETLoader's model there, so it does nothing here either.
_UNWRAPPED_MODELS = {"SD3", "PixArt"}


class RemoteDiT(torch.nn.Module):
    """The diffusion model of a parallel MODEL: no parameters; `forward` runs on the workers."""

    def __init__(self, handle: convert.ParaDiTModel, dtype: torch.dtype, base, keys: dict):
        """`base`: the BaseModel this serves (held weakly: it owns us); `keys`: ComfyUI's parameter names ->
        (shape, dtype) of the file, so LoRA loaders find their keys."""
        super().__init__()
        self.handle = handle
        self.dtype = dtype  # ComfyUI's BaseModel.get_dtype reads it
        self._patch_size: int | None = None  # read from the file's header when extra_conds first asks
        self.latent_format = base.latent_format  # to hand reference latents back raw, as Conditioning carries them
        self.latent_channels = base.latent_format.latent_channels  # x's channels past these are c_concat
        self._video_model: bool | None = None  # read from the file's header at the first call
        self.family: str | None = None  # our family of the file (parallel_model sets it): which call conversion runs
        self._base = weakref.ref(base)  # not a submodule: read for its current patcher
        self._runs_wrappers = type(base).__name__ not in _UNWRAPPED_MODELS
        self._keys = keys
        if "patch_embedding.weight" in keys:  # Wan's concat_cond reads the input channels off this weight
            shape, dtype = keys["patch_embedding.weight"]
            self.patch_embedding = types.SimpleNamespace(weight=torch.empty(shape, dtype=dtype, device="meta"))
        self._strategies: dict = {}  # (latent shape, chunks) -> resolved StrategySpec, once per sampling setup
        self._patches = None  # (patches_uuid, WeightPatches) of the last LoRA stack seen
        self.last_strategy = None  # the StrategySpec of the last call (Parallel Sampler's per-call status line)
        self.on_call = None  # Parallel Sampler's per-call status: (schedule step, strategy, client) after each call

    def __deepcopy__(self, memo):
        """ComfyUI deep-copies a diffusion model only to put a clone on another device (its MultiGPU CFG Split,
        MultiGPU_WorkUnits): this one's devices are the workers', which already split cond and uncond when asked."""
        raise convert.ConfigError(
            "MultiGPU CFG Split (MultiGPU_WorkUnits) copies the model onto other GPUs, but Load Parallel DiT's "
            "model runs on the ParaDiT workers, which own their devices; remove that node and set cfg_degree 2 in "
            "the Strategy Selector, which splits cond and uncond the same way on the workers.")

    def video_model(self) -> bool:
        """Whether the file is a video model (Wan), whose calls keep [B, C, T, H, W]; an image model in a video VAE's
        latent format (Qwen-Image's Wan 2.1 VAE) gets one frame, which the workers take as [B, C, H, W]."""
        if self._video_model is None:
            from parallel_runtime.validate import model_config

            self._video_model = model_config(self.handle.model.path).video
        return self._video_model

    @property
    def patch_size(self) -> int:
        """Latent pixels per token side, which ComfyUI's Flux extra_conds reads to fit an attention mask to the
        image's tokens (2 for Flux.1, 1 for FLUX.2), and the strategy's fit to a call's latent uses. The family's
        adapter says it: a config's own patch_size may be a video's (t, h, w) tuple (Wan's (1, 2, 2))."""
        if self._patch_size is None:
            from parallel_runtime.models.registry import token_patch
            from parallel_runtime.validate import model_config

            self._patch_size = token_patch(model_config(self.handle.model.path))
        return self._patch_size

    def preprocess_text_embeds(self, text_states, unprocessed: bool = False):
        """ComfyUI 2026's LTXAV and MiniMaxH3 extra_conds prepare the prompt once per sampling through this, on the
        host. LTX-2: the file's prompt connectors run here, on the host, as LTXAVModel runs them (small beside the
        DiT, once per prompt, not per step), so the workers' model call takes the connectors' rows it already reads
        (ltx2_connectors.py). MiniMax-H3: the workers refine the prompt (the family's embed_text reads the raw
        states), so the states pass unchanged."""
        if self.family == "ltx2":
            from parallel_runtime.models.families.ltx2_connectors import preprocess_text_embeds
            from parallel_runtime.validate import model_config

            path = self.handle.model.path
            return preprocess_text_embeds(path, model_config(path), text_states, unprocessed)
        return text_states

    def parameter_shapes(self) -> dict:
        """ComfyUI's parameter name (no prefix) -> the file's shape."""
        return {name: shape for name, (shape, _) in self._keys.items()}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The file's parameters as meta tensors under ComfyUI's names: a LoRA loader maps its keys onto them
        (and the call then refuses what it cannot apply), without any memory here."""
        for name, (shape, dtype) in self._keys.items():
            destination[prefix + name] = torch.empty(shape, dtype=dtype, device="meta")

    def forward(self, x, timesteps, context=None, y=None, guidance=None, control=None, transformer_options=None,
                **kwargs):
        """The model call, inside ComfyUI's DIFFUSION_MODEL wrappers where the host's own class for this file runs
        them (EasyCache's): they run here on the host, so a step a wrapper answers from its cache never reaches
        the workers, and every rank sees only the calls that happen."""
        carry = av_call.AudioCarry.of(x, timesteps, transformer_options or {}, kwargs.get("minimax_payload"))
        if carry is not None:
            x = carry.into(x)
        wrappers = (transformer_options or {}).get("wrappers") if self._runs_wrappers else None
        if not wrappers:
            out = self._forward(x, timesteps, context, y, guidance, control, transformer_options, **kwargs)
        else:
            import comfy.patcher_extension as extension

            wrappers = extension.get_all_wrappers(extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
            # Positional, as ComfyUI's models pass them: EasyCache reads transformer_options as the last argument.
            out = extension.WrapperExecutor.new_class_executor(self._forward, self, wrappers).execute(
                x, timesteps, context, y, guidance, control, transformer_options, **kwargs)
        return out if carry is None else carry.out_of(out)

    def _forward(self, x, timesteps, context=None, y=None, guidance=None, control=None, transformer_options=None,
                 **kwargs):
        from parallel_runtime.runtime.client import get_client
        from parallel_runtime.spec import Job, SamplingSpec

        options = transformer_options or {}
        rope_options = scale_rope_options(options)
        if rope_options is not None and (self.family in ("ltx2", "kandinsky6") or av_call.is_av_call(x)):
            # These calls carry no RoPE grid to the workers: one sentence instead of ignoring the node.
            raise convert.ConfigError("ScaleROPE's RoPE scale and shift are not run by ParaDiT for this model; "
                                      "remove the ScaleROPE node or load the model with UNETLoader.")
        if self.family == "ltx2":
            return self._forward_ltx2(x, timesteps, context, control, options, **kwargs)
        if self.family == "kandinsky6":
            return self._forward_kandinsky6(x, timesteps, context, y, control, options, **kwargs)
        if av_call.is_av_call(x):
            return self._forward_minimax_h3(x, timesteps, context, control, options, **kwargs)
        if self.family == "kandinsky5":
            x = _with_start_frames(x, kwargs.pop("time_dim_replace", None))
        if self.family == "hidream_o1":  # its positions, mask and prompt ids, checked; the workers rebuild them
            context, kwargs = hidream_o1_call.take_conds(x, context, kwargs)
        _refuse_what_the_workers_cannot_do(control, options, kwargs)
        controls = control.inputs if isinstance(control, controlnet.RemoteControl) else ()
        skip_blocks = skipped_blocks(options.get("patches_replace"))
        patches = self._weight_patches(getattr(self._base(), "current_patcher", None))
        video = x.ndim == 5 and not self.video_model()
        if video and x.shape[2] > 1:
            raise convert.ConfigError(convert.frames_for_an_image_model(x.shape[2], self.handle.name or "this model"))
        if video:  # a video VAE's latent (Qwen-Image's Wan 2.1) with one frame: the workers take [B, C, H, W]
            x = x.squeeze(2)
        # ComfyUI concatenated the model's c_concat (Fill's masked image and mask, Canny/Depth's control image) to
        # the input-scaled latent; it travels as the chunk's conditioning, so each strategy splits it with the
        # latent's own tokens and each CFG rank gets its branch's.
        x, concat = x[:, :self.latent_channels], (x[:, self.latent_channels:] if x.shape[1] > self.latent_channels
                                                   else None)
        labels = list(options.get("cond_or_uncond") or [0])
        rows = x.shape[0]
        if rows % len(labels):
            raise convert.ConfigError(f"ParaDiT got a model call of {rows} rows in {len(labels)} chunks; this is a "
                                      f"ParaDiT bug, please report it.")
        batch = rows // len(labels)
        client = get_client(self.handle.devices, p2p=self.handle.strategy.p2p)
        step, last = _schedule_step(options)
        if step == 0:  # a sampling run starts: ComfyUI's models leave the workers' GPUs, as for Parallel Sampler
            HOST.free_memory_for(convert.client_devices_here(client))
        # One strategy for the whole call (its jobs then share the workers' stages: no reload between them).
        strategy = self._strategy((min(2, len(labels)) * batch, *x.shape[1:]), min(2, len(labels)), client)
        self.last_strategy = strategy
        outputs = []
        # Up to two chunks per runtime job (ComfyUI's cond and uncond); the CFG group splits them. The job's slot keys
        # the stale K/V the workers keep for the next call: which job of the call, and whether it starts with the
        # uncond, since ComfyUI runs cond and uncond as separate calls where their shapes differ (T5-only prompts
        # of other lengths, area conditionings), and those must not read each other's K/V.
        for slot, start in enumerate(range(0, len(labels), 2)):
            ks = list(range(start, min(start + 2, len(labels))))
            sl = slice(ks[0] * batch, (ks[-1] + 1) * batch)
            chunks = [_chunk_conditioning(k, batch, context, y, guidance, kwargs, self.latent_format, concat, controls)
                      for k in ks]
            job = Job(self.handle.model, strategy, SamplingSpec(steps=1), x[sl].detach().float().cpu(), chunks[0],
                      chunks[1] if len(chunks) > 1 else None, timestep=timesteps[sl].detach().float().cpu(),
                      weight_patches=patches, call_step=step, call_slot=2 * slot + int(labels[ks[0]] != 0),
                      call_last=last, skip_blocks=skip_blocks,
                      extra={} if rope_options is None else {"rope_options": rope_options})
            outputs.append(_run(client, job))
        if self.on_call is not None:
            self.on_call(step, strategy, client)
        out = torch.cat(outputs).to(x.device)
        return out.unsqueeze(2) if video else out

    def _forward_minimax_h3(self, x, timesteps, context, control, options: dict, minimax_payload=None,
                            denoise_mask=None, audio_denoise_mask=None, **kwargs):
        """MiniMax-H3's call (nodes/av_call.py says what is read and what refused): x = [video, audio], one runtime
        job per two chunks with Job.audio, the keyframes' and references' latents as each chunk's reference latents,
        the result back as ComfyUI's [video, audio]."""
        import dataclasses

        from parallel_runtime.runtime.client import get_client
        from parallel_runtime.spec import Job, SamplingSpec
        from parallel_runtime.validate import model_config

        config = model_config(self.handle.model.path)
        if config.family != "minimax_h3":  # another family's streams: no door of this module reads them
            raise convert.ConfigError(f"the model call carries several latent streams, which Load Parallel DiT's "
                                      f"MODEL runs for MiniMax-H3 and LTX-2 only, not for {config.title}; load the "
                                      f"model with UNETLoader.")

        _refuse_what_the_workers_cannot_do(control, options, kwargs)
        payload = minimax_payload or {}
        av_call.refuse_unsupported(payload, options, denoise_mask, audio_denoise_mask)
        video, audio = av_call.streams(x)  # the streams' own latents (forward undid the sampler's audio carry)
        # fl2va's keyframes and ref2va's reference images, with the prompt's tags: one payload for the whole call
        references, layout = av_call.conditioning_rows(payload, context.shape[1], video)
        labels = list(options.get("cond_or_uncond") or [0])
        batch = video.shape[0] // len(labels)
        if batch != 1 or video.shape[0] % len(labels):
            raise convert.ConfigError(f"the MiniMax-H3 call holds {video.shape[0]} rows for {len(labels)} prompt(s), "
                                      f"but the model runs one video per prompt (as ComfyUI's does); use a batch "
                                      f"size of 1.")
        client = get_client(self.handle.devices, p2p=self.handle.strategy.p2p)
        step, last = _schedule_step(options)
        if step == 0:
            HOST.free_memory_for(convert.client_devices_here(client))
        chunks_per_job = min(2, len(labels))
        strategy = self._strategy((chunks_per_job, *video.shape[1:]), chunks_per_job, client)
        self.last_strategy = strategy
        skip_blocks = skipped_blocks(options.get("patches_replace"))
        patches = self._weight_patches(getattr(self._base(), "current_patcher", None))
        videos, audios = [], []
        for slot, start in enumerate(range(0, len(labels), 2)):
            ks = list(range(start, min(start + 2, len(labels))))
            sl = slice(ks[0], ks[-1] + 1)
            chunks = [dataclasses.replace(_chunk_conditioning(k, 1, context, None, None, {}), references=references,
                                          reference_method=layout) for k in ks]
            job = Job(self.handle.model, strategy, SamplingSpec(steps=1), video[sl].detach().float().cpu(), chunks[0],
                      chunks[1] if len(chunks) > 1 else None, timestep=timesteps[sl].detach().float().cpu(),
                      weight_patches=patches, call_step=step, call_slot=2 * slot + int(labels[ks[0]] != 0),
                      call_last=last, skip_blocks=skip_blocks, audio=audio[sl].detach().float().cpu())
            result = _run(client, job, whole=True)
            videos.append(result.latent)
            audios.append(result.audio)
        if self.on_call is not None:
            self.on_call(step, strategy, client)
        video_out = torch.cat(videos).to(video.device, video.dtype)
        return [video_out, torch.cat(audios).to(audio.device, audio.dtype)]

    def _forward_ltx2(self, x, timesteps, context, control, options: dict, **kwargs):
        """LTX-2's call (nodes/ltx2_call.py says what is read and what refused): x = [video, audio], process_timestep's
        (video, audio) timesteps per frame, and the frame rate."""
        ltx2_call.refuse_unsupported(kwargs, options, control)
        rest = {k: v for k, v in kwargs.items() if k not in ltx2_call.READ_INPUTS}
        _refuse_what_the_workers_cannot_do(None, options, rest)
        video, audio = ltx2_call.streams(x)
        video_t, audio_t = ltx2_call.call_timesteps(timesteps, tuple(video.shape[2:]), audio.shape[2])
        return self._run_two_streams(video, audio, video_t, context, None, options, audio_t,
                                     {"frame_rate": ltx2_call.frame_rate(kwargs)},
                                     ltx2_call.guides(kwargs, tuple(video.shape[2:])),
                                     ltx2_call.reference_audio(kwargs))

    def _forward_kandinsky6(self, x, timesteps, context, y, control, options: dict, **kwargs):
        """Kandinsky 6's call (nodes/kandinsky6_call.py says what is read and what refused): x = [video, audio], one
        timestep per row for both, the prompt rows and the pooled CLIP-L vector."""
        kandinsky6_call.refuse_unsupported(kwargs, options, control)
        rest = {k: v for k, v in kwargs.items() if k not in kandinsky6_call.READ_INPUTS}
        _refuse_what_the_workers_cannot_do(None, options, rest)
        if y is None:
            raise convert.ConfigError("the Kandinsky 6 call carries no pooled CLIP-L vector; encode the prompt with "
                                      "Kandinsky 6's text encoder (Qwen2.5-VL with CLIP-L).")
        video, audio = kandinsky6_call.streams(x)
        return self._run_two_streams(video, audio, timesteps, context, y, options)

    def _run_two_streams(self, video, audio, video_t, context, y, options: dict, audio_t=None, extra=None,
                         video_guides=None, audio_reference=None) -> list:
        """A two-stream family's call (LTX-2, Kandinsky 6) as one runtime job per two chunks with Job.audio (and
        LTX-2's guide frames and reference audio, the same for every chunk), the result back as ComfyUI's [video,
        audio]."""
        from parallel_runtime.runtime.client import get_client
        from parallel_runtime.spec import Job, SamplingSpec

        labels = list(options.get("cond_or_uncond") or [0])
        if video.shape[0] % len(labels):
            raise convert.ConfigError(f"ParaDiT got a model call of {video.shape[0]} rows in {len(labels)} chunks; "
                                      f"this is a ParaDiT bug, please report it.")
        batch = video.shape[0] // len(labels)
        client = get_client(self.handle.devices, p2p=self.handle.strategy.p2p)
        step, last = _schedule_step(options)
        if step == 0:
            HOST.free_memory_for(convert.client_devices_here(client))
        chunks_per_job = min(2, len(labels))
        strategy = self._strategy((chunks_per_job * batch, *video.shape[1:]), chunks_per_job, client)
        self.last_strategy = strategy
        skip_blocks = skipped_blocks(options.get("patches_replace"))
        patches = self._weight_patches(getattr(self._base(), "current_patcher", None))
        videos, audios = [], []
        for slot, start in enumerate(range(0, len(labels), 2)):
            ks = list(range(start, min(start + 2, len(labels))))
            sl = slice(ks[0] * batch, (ks[-1] + 1) * batch)
            chunks = [_chunk_conditioning(k, batch, context, y, None, {}) for k in ks]
            job = Job(self.handle.model, strategy, SamplingSpec(steps=1), video[sl].detach().float().cpu(), chunks[0],
                      chunks[1] if len(chunks) > 1 else None, timestep=video_t[sl].detach().float().cpu(),
                      weight_patches=patches, call_step=step, call_slot=2 * slot + int(labels[ks[0]] != 0),
                      call_last=last, skip_blocks=skip_blocks, audio=audio[sl].detach().float().cpu(),
                      audio_timestep=None if audio_t is None else audio_t[sl].detach().float().cpu(),
                      extra=extra or {}, video_guides=video_guides,
                      audio_reference=None if audio_reference is None else audio_reference[:1] if
                      audio_reference.shape[0] == 1 else audio_reference[sl])
            result = _run(client, job, whole=True)
            videos.append(result.latent)
            audios.append(result.audio)
        if self.on_call is not None:
            self.on_call(step, strategy, client)
        return [torch.cat(videos).to(video.device, video.dtype), torch.cat(audios).to(audio.device, audio.dtype)]

    def _weight_patches(self, patcher):
        """The sampling patcher's LoRA stack for the workers, converted once per stack (ComfyUI's patches_uuid
        changes whenever the patches do)."""
        from .weight_patches import weight_patches_of

        uuid = getattr(patcher, "patches_uuid", None) if patcher is not None and patcher.patches else None
        if self._patches is None or self._patches[0] != uuid:
            self._patches = (uuid, weight_patches_of(patcher, self.parameter_shapes()))
        return self._patches[1]

    def _strategy(self, shape: tuple, chunks: int, client):
        """The handle's strategy for calls of this shape, planned by the runtime once per shape (per call:
        PipeFusion's pipeline drains every call, and the call's latent may be an area's crop)."""
        from parallel_runtime.runtime.entrance import plan

        key = (shape, chunks)
        if key not in self._strategies:
            cfg = 2.0 if chunks == 2 else 1.0  # a second chunk is ComfyUI's uncond: CFG parallel can take it
            per_image = (shape[0] // chunks, *shape[1:])
            strategy, _, note = plan(client, self.handle.strategy, self.handle.model, per_image, cfg,
                                     self.handle.devices, per_call=True, patch=self.patch_size)
            if note:
                log.warning("ParaDiT: %s.", note)
            self._strategies[key] = strategy
        return self._strategies[key]


def _schedule_step(options: dict) -> tuple[int | None, bool]:
    """(the step of the sampler's schedule this call belongs to, whether it is the run's last step). The step
    is how many of the schedule's sigmas (ComfyUI puts them in transformer_options) lie above the call's: a
    second evaluation within a step (Heun) counts as the next step. Without a schedule: (None, True), so
    PipeFusion warms up (exact) and keeps nothing for a next call."""
    schedule, sigma = options.get("sample_sigmas"), options.get("sigmas")
    if schedule is None or sigma is None:
        return None, True
    current = float(sigma.max())
    step = int((schedule.float() > current * (1 + 1e-6)).sum())
    return step, step >= len(schedule) - 2


def _run(client, job, whole: bool = False):
    """One runtime job's latent (`whole`: its JobResult); ComfyUI's Cancel stops the workers and raises ComfyUI's
    own interrupt."""
    from parallel_runtime.errors import Cancelled

    try:
        result = client.run(job, interrupted=HOST.interrupted)
        return result if whole else result.latent
    except Cancelled:
        raise HOST.interrupt() from None


def _chunk_conditioning(k: int, batch: int, context, y, guidance, kwargs, latent_format=None, concat=None,
                        controls=()):
    """Chunk k's rows of the call's conditioning inputs as a runtime Conditioning."""
    from parallel_runtime.spec import IN_CONTEXT_METHOD, Conditioning

    sl = slice(k * batch, (k + 1) * batch)
    cond = context[sl].detach().float().cpu()
    pooled = y[sl].detach().float().cpu() if y is not None else torch.zeros(batch, 0)
    g = None
    if guidance is not None:
        values = guidance[sl].detach().float().unique()
        if values.numel() != 1:
            raise convert.ConfigError("one chunk of the model call carries several guidance values; ParaDiT "
                                      "needs one per prompt (one FluxGuidance per conditioning).")
        g = float(values[0])
    size = None
    if kwargs.get("c_size") is not None and kwargs.get("c_ar") is not None:  # PixArt-α's size conditioning
        (height, width), aspect = kwargs["c_size"][k * batch].tolist(), float(kwargs["c_ar"][k * batch].flatten()[0])
        size = (float(height), float(width), aspect)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.ndim == 2:  # a prompt mask of all ones (_refuse_padded_prompt): it hides nothing
        mask = None
    mask, mask_key = _chunk_attention_mask(mask, sl)
    # clip_fea: the start image's vision tokens (Wan's CLIP ViT-H, HunyuanVideo 1.5's SigLIP); txt_byt5: HunyuanVideo
    # 1.5's ByT5 glyph tokens. Both in the model's dtype: sent as float32.
    clip, glyph = (None if t is None else t[sl].detach().float().cpu()
                   for t in (kwargs.get("clip_fea"), kwargs.get("txt_byt5")))
    refs = _chunk_references(kwargs.get("ref_latents"), k, batch, latent_format)
    if kwargs.get("reference_latent") is not None:  # Wan Fun control's ref_image (WAN21.extra_conds: the last one)
        # one frame of the video latent ([:, :, 0] of it): its latent format's statistics are [1, C, 1, 1, 1]
        refs = _chunk_references([kwargs["reference_latent"].unsqueeze(2)], k, batch, latent_format)
    method = kwargs.get("ref_latents_method")
    if kwargs.get("context_latents") is not None:  # Bernini's in-context streams: the reference kind the Wan family
        # reads through its patch embedding (the strategies already split reference rows like the video's)
        if refs:
            raise convert.ConfigError("the model call carries both Wan22FunControlToVideo's ref_image and Bernini's "
                                      "in-context latents (BerniniConditioning), which no Wan model reads together; "
                                      "remove one of them.")
        refs, method = _chunk_context_latents(kwargs["context_latents"], k, batch, latent_format), IN_CONTEXT_METHOD
    if kwargs.get("image_cond") is not None:  # HiDream E1's InstructPixToPixConditioning image (model_base.HiDream)
        refs, method = _chunk_references([kwargs["image_cond"]], k, batch, latent_format), "hidream_e1"
    return Conditioning(cond=cond, pooled=pooled, guidance=g, image_size=size, references=refs,
                        reference_method=method, reference_slots=_reference_slots(kwargs.get("image_slots"), len(refs)),
                        **_chunk_llama(kwargs.get("encoder_hidden_states_llama3"), sl),
                        concat=concat[sl].detach().float().cpu() if concat is not None else None, control=controls,
                        attention_mask=mask, attention_mask_key=mask_key, clip_vision=clip, glyph=glyph,
                        **_chunk_camera(kwargs.get("camera_conditions"), sl),
                        **_chunk_animate(kwargs.get("pose_latents"), kwargs.get("face_pixel_values"), sl),
                        **_chunk_vace(kwargs.get("vace_context"), kwargs.get("vace_strength"), sl),
                        **_chunk_vision(kwargs.get(hidream_o1_call.VISION_INPUT)))


def _reference_slots(slots, references: int) -> tuple[int, ...]:
    """Qwen-Image 2.1's image_slots (TextEncodeQwenImage21: the prompt row before which each reference sits), the
    same for every chunk of a call (ComfyUI batches only chunks whose slots agree); as build_sequence reads them,
    only the first `references` (a prompt whose images stayed vision tokens has slots but no references)."""
    if slots is None:
        return ()
    values = slots.flatten().tolist() if isinstance(slots, torch.Tensor) else list(slots)
    return tuple(int(v) for v in values)[:references]


def _chunk_vision(vision) -> dict:
    """HiDream O1's reference images on their vision-tower path (hidream_o1_call.take_conds): the tower's inputs,
    the same for every chunk (ComfyUI's model reads the first row's), as float32 pixels and int64 grids."""
    if vision is None:
        return {}
    pixels, grid = vision
    return {"vision": pixels.detach().float().cpu().contiguous(), "vision_grid": grid.detach().long().cpu()}


def _chunk_vace(context, strength, sl: slice) -> dict:
    """Chunk rows `sl` of a Wan VACE call's vace_context ([rows, inputs, 96, T, H, W], WAN21_Vace.extra_conds: the
    latents through process_in and the mask), one row where all are equal (WanVaceToVideo makes one per prompt;
    ComfyUI repeats it over the batch), in the call's dtype, and vace_strength (one per input)."""
    if context is None:
        return {}
    return {"vace": _one_row_if_equal(context[sl].detach().cpu()),
            "vace_strength": tuple(float(v) for v in (strength or ()))}


def _chunk_camera(camera, sl: slice) -> dict:
    """Chunk rows `sl` of a Wan Fun camera call's camera_conditions (WanCameraEmbedding's Plücker embedding, at pixel
    size), kept on the workers (_kept_rows). In the call's dtype: it is the call's largest input (24 channels at 8x
    the latent's size)."""
    return {} if camera is None else dict(zip(("camera", "camera_key"), _kept_rows(camera, sl, "camera")))


def _chunk_animate(pose, face, sl: slice) -> dict:
    """Chunk rows `sl` of a Wan Animate call's pose_latents (the pose video's latent after process_latent_in, in the
    model's space, as the workers add it) and face_pixel_values (the face crops at 512 x 512, kept on the workers:
    _kept_rows), one row where all are equal."""
    out = {}
    if pose is not None:
        out["pose"] = _one_row_if_equal(pose[sl].detach().float().cpu())
    if face is not None:
        out.update(zip(("face", "face_key"), _kept_rows(face, sl, "face")))
    return out


def _chunk_llama(llama, sl: slice) -> dict:
    """Chunk rows `sl` of a HiDream call's Llama 3.1 layers [rows, 32, N, 4096] (CLIPTextEncodeHiDream's
    conditioning_llama3: 64 MB per prompt in float32), kept on the workers (_kept_rows), in the call's dtype."""
    return {} if llama is None else dict(zip(("llama", "llama_key"), _kept_rows(llama, sl, "llama")))


def _kept_rows(tensor: torch.Tensor, sl: slice, kind: str) -> tuple[torch.Tensor, str]:
    """Rows `sl` of a large per-run input, one row where all are equal (the node makes one per prompt; ComfyUI
    repeats it over the batch), and the key the workers keep it under: a hash of its bytes (extra_conds rebuilds the
    tensor every call, its values stay the run's)."""
    from parallel_runtime.spec import kept_key

    rows = _one_row_if_equal(tensor[sl].detach().cpu())
    return rows, kept_key(kind, rows)


def _one_row_if_equal(rows: torch.Tensor) -> torch.Tensor:
    """A chunk's rows of a per-prompt input, one row where all are equal (the node makes one per prompt; ComfyUI
    repeats it over the batch), contiguous."""
    if rows.shape[0] > 1 and bool((rows == rows[:1]).all()):
        rows = rows[:1]
    return rows.contiguous()


def _chunk_attention_mask(mask, sl: slice) -> tuple[torch.Tensor | None, str | None]:
    """Chunk rows `sl` of the call's attention_mask (an additive bias [rows, L, L] over [text, image], already in
    the model's dtype and upscaled to the latent's tokens by the host's extra_conds), one row where all are equal
    (ComfyUI repeats a batch-1 mask over the batch), and the key it is kept under on the workers: a hash of its
    bytes, since extra_conds rebuilds the tensor on every call while its values stay those of the run."""
    return (None, None) if mask is None else _kept_rows(mask, sl, "mask")


def _chunk_references(refs, k: int, batch: int, latent_format) -> tuple:
    """ReferenceLatent's latents of chunk k, raw as the runtime takes them. ComfyUI hands them to the model
    after process_latent_in, repeated over each chunk's rows; the workers redo process_in (a round trip of one
    float32 rounding, ~1e-7 relative)."""
    if not refs:
        return ()
    out = []
    for ref in refs:
        one = ref[k * batch:k * batch + 1].detach().float().cpu()  # the chunk's rows are one latent repeated
        raw = latent_format.process_out(one) if latent_format is not None else one
        out.append(raw.squeeze(2) if raw.ndim == 5 else raw)  # a video latent format's frame axis
    return tuple(out)


def _chunk_context_latents(latents, k: int, batch: int, latent_format) -> tuple:
    """BerniniConditioning's in-context streams of chunk k (source video, reference video, reference images, in that
    order), raw [1, C, T, H, W] each at its own size, as the runtime takes them. ComfyUI hands the model the list
    after process_latent_in, each repeated over the call's rows (WAN21.extra_conds' CONDList); the workers redo
    process_in (a round trip of one float32 rounding, ~1e-7 relative)."""
    if not isinstance(latents, (list, tuple)) or not all(isinstance(z, torch.Tensor) and z.ndim == 5 for z in latents):
        raise convert.ConfigError("the model call's context_latents are not a list of video latents [rows, channels, "
                                  "frames, height, width], as BerniniConditioning makes them; remove the node that "
                                  "sets them or load the model with UNETLoader.")
    out = []
    for n, lat in enumerate(latents):
        rows = lat[k * batch:(k + 1) * batch].detach().float().cpu()
        if rows.shape[0] != batch or not bool((rows == rows[:1]).all()):
            raise convert.ConfigError(f"in-context latent {n + 1} of the model call differs between the images of one "
                                      f"prompt, but the Wan model runs one set of streams per prompt; give "
                                      f"BerniniConditioning one source (batch 1).")
        out.append(latent_format.process_out(rows[:1]) if latent_format is not None else rows[:1])
    return tuple(out)


# Extra model inputs (ComfyUI's extra_conds) the workers compute themselves or that a call may carry empty.
# denoise_mask: Wan 2.2's (WAN22) noise mask, which its model reads only through the per-frame timesteps
# process_timestep already made of it (the call's timesteps arrive [rows, frames]).
# num_tokens: Lumina 2's and Z-Image's count of unpadded prompt tokens, which must be the whole prompt
# (_refuse_padded_prompt).
_KNOWN_INPUTS = {"c_size", "c_ar", "attention_mask", "ref_latents", "ref_latents_method", "clip_fea", "denoise_mask",
                 "num_tokens", "txt_byt5", "camera_conditions", "reference_latent", "vace_context", "vace_strength",
                 "encoder_hidden_states_llama3", "image_cond", "context_latents", "image_slots", "pose_latents",
                 "face_pixel_values",
                 hidream_o1_call.VISION_INPUT}
# Inputs ComfyUI 2026's model classes pass that no family here reads yet, by what adds them (the refusal names it).
_INPUT_SOURCES = {
    "siglip_feats": "Z-Image Omni's SigLIP image features",
    "ref_contexts": "Z-Image Omni's reference prompts",
    "clip_text_pooled": "NewBie's pooled CLIP text",
    "guiding_frame_index": "HunyuanVideo 1.0 image-to-video's guiding frame",
    "ref_latent": "HunyuanVideo 1.0 image-to-video's reference latent",
    "disable_time_r": "the HunyuanVideo super-resolution model's time input",
    "time_dim_replace": "Kandinsky5ImageToVideo's start_image",
}


def _with_start_frames(x: torch.Tensor, frames: torch.Tensor | None) -> torch.Tensor:
    """Kandinsky5ImageToVideo's start image (time_dim_replace): ComfyUI's Kandinsky5 writes the clean start frames'
    latent over the input's first channels and frames before anything else, so the door does the same and the
    workers run an ordinary call."""
    if frames is None:
        return x
    if frames.ndim != 5 or frames.shape[1] > x.shape[1] or frames.shape[2] > x.shape[2] or \
            tuple(frames.shape[3:]) != tuple(x.shape[3:]):
        raise convert.ConfigError(f"Kandinsky5ImageToVideo's start image latent has shape {tuple(frames.shape)}, "
                                  f"which does not fit the video latent {tuple(x.shape)}; give the node the video's "
                                  f"width and height.")
    x = x.clone()
    x[:, :frames.shape[1], :frames.shape[2]] = frames.to(x)
    return x


def _refuse_what_the_workers_cannot_do(control, options: dict, kwargs: dict) -> None:
    """One sentence for each model input or patch the workers would otherwise silently ignore."""
    if control is not None and not isinstance(control, controlnet.RemoteControl):
        # Residuals computed elsewhere (a sampler that bypasses ComfyUI's guider, a custom control object).
        raise convert.ConfigError("this model call carries ControlNet residuals computed on the host, which "
                                  "ParaDiT does not add; sample with KSampler or SamplerCustomAdvanced, which run "
                                  "the ControlNet on the workers, or load the model with UNETLoader.")
    if options.get("patches"):
        _refuse_code_patch("patches", ", ".join(sorted(map(str, options["patches"]))))
    _refuse_padded_prompt(kwargs)
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN_INPUTS)
    if unknown:
        named = ", ".join(f"{k}: {_INPUT_SOURCES[k]}" if k in _INPUT_SOURCES else k for k in unknown)
        raise convert.ConfigError(f"the model call carries inputs ParaDiT does not run ({named}); "
                                  f"remove the node that adds them or load the model with UNETLoader.")


def scale_rope_options(options: dict) -> list[float] | None:
    """ScaleROPE's grid (transformer_options["rope_options"], as ComfyUI's set_model_rope_options stores it) in the
    runtime's order (validate.ROPE_OPTION_NAMES), missing entries at ComfyUI's defaults; None where no node set it.
    Validation (finite numbers, a family that reads them) is the client's, before any work."""
    from parallel_runtime.validate import ROPE_OPTION_NAMES

    given = options.get("rope_options")
    if given is None:
        return None
    return [given.get(name, 1.0 if name.startswith("scale") else 0.0) for name in ROPE_OPTION_NAMES]


def _refuse_padded_prompt(kwargs: dict) -> None:
    """A prompt mask [B, L] (Lumina 2's, HunyuanVideo's) hides padding its text encoder added; the workers run
    unpadded prompts only, where ComfyUI passes no mask (or one of all ones) and num_tokens is the prompt's length."""
    mask = kwargs.get("attention_mask")
    hidden = int(mask.numel() - mask.sum()) if mask is not None and mask.ndim == 2 else 0
    if hidden:
        raise convert.ConfigError(f"the prompt's attention mask hides {hidden} padding token(s), which ParaDiT does "
                                  f"not run for this model; use one prompt per conditioning without padding, or load "
                                  f"the model with UNETLoader.")


def _refuse_code_patch(kind: str, where: str):
    raise convert.ConfigError(
        f"a model patch ({kind}: {where}) runs its own code inside the diffusion model's blocks, which the ParaDiT "
        f"workers cannot run: no ParaDiT strategy supports it (ComfyUI runs it only with the whole model on one "
        f"device); remove that patch node or load the model with UNETLoader.")


def skipped_blocks(patches_replace: dict | None) -> tuple[tuple[str, int], ...]:
    """ComfyUI's block replacements as data the workers re-create: the ("double_block" | "single_block", index)
    keys of `patches_replace["dit"]` whose patch skips its block (SkipLayerGuidanceDiT, SkipLayerGuidanceSD3:
    `skip(args, extra) -> args`). Each patch is called once on marker arguments to tell what it does; a patch
    that only calls the original block is a no-op; any other patch is code, refused in one sentence."""
    skipped = []
    for group, patches in (patches_replace or {}).items():
        for key, patch in (patches or {}).items():
            valid_key = isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int)
            verdict = _probe_block_patch(patch) if group == "dit" and valid_key else None
            if verdict is None:
                _refuse_code_patch(f"patches_replace[{group!r}]", repr(key))
            if verdict == "skip":
                skipped.append((str(key[0]), int(key[1])))
    return tuple(sorted(skipped))


def _probe_block_patch(patch) -> str | None:
    """"skip" (returns its arguments untouched, never calling the block), "block" (returns what the original
    block returned, called once on its arguments), or None (anything else: code)."""
    args = {"img": object(), "txt": object(), "vec": object(), "pe": object(), "transformer_options": {}}
    seen, result = [], {"img": object(), "txt": object()}

    def original_block(block_args):
        seen.append(block_args)
        return result

    try:
        out = patch(args, {"original_block": original_block})
    except Exception:  # noqa: BLE001 - code that needs real tensors is code, not data
        return None
    if out is args and not seen:
        return "skip"
    if out is result and len(seen) == 1 and seen[0] is args:
        return "block"
    return None


def parallel_model(handle: convert.ParaDiTModel):
    """The MODEL Load Parallel DiT outputs: ComfyUI's BaseModel for the file, its diffusion model remote."""
    from parallel_runtime.validate import model_config

    # A file no family claims fails here, in one sentence naming what it is, before ComfyUI builds anything for it.
    # The audio-video families' (video, audio) calls run through RemoteDiT (_forward_minimax_h3, _forward_ltx2);
    # Parallel Sampler runs them too (their `not_sampled_yet` only refuses a job that lacks the audio latent).
    ours = model_config(handle.model.path)
    refusal = getattr(ours, "not_sampled_yet", None)
    if refusal and ours.family not in _AV_DOORS:
        raise convert.ConfigError(refusal)
    import comfy.model_detection as detection
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.utils

    sd, quantized = _meta_state_dict(handle.model.path)
    prefix = detection.unet_prefix_from_state_dict(sd)
    sd = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True) or sd
    config = detection.model_config_from_unet(sd, "")
    if config is None:  # diffusers keys: ComfyUI's model (and a LoRA's keys) use the converted names
        converted = detection.convert_diffusers_mmdit(sd, "")
        if converted is not None:
            sd = converted
            config = detection.model_config_from_unet(sd, "")
    if config is None:
        raise convert.ConfigError(f"ComfyUI does not recognise {handle.name or handle.model.path} as a diffusion "
                                  f"model it can sample; choose a DiT file ParaDiT runs.")
    dtype, manual_cast = _host_dtypes(handle, sd, quantized, config, mm)
    config.set_inference_dtype(dtype, manual_cast)
    config.unet_config["disable_unet_model_creation"] = True  # the DiT lives on the workers
    base = config.get_model(sd, "")
    base.diffusion_model = RemoteDiT(handle, dtype, base, {name: (tuple(t.shape), t.dtype) for name, t in sd.items()})
    base.diffusion_model.family = ours.family
    if ours.family == "ltx2":  # LTXAV.process_timestep patchifies the noise masks with the diffusion model's own
        base.diffusion_model.patchifier, base.diffusion_model.a_patchifier = ltx2_call.patchifiers()
    base.memory_required = lambda *args, **kwargs: 0  # nothing of the DiT's lives in the host's memory
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(),
                                               offload_device=mm.unet_offload_device(), size=1)
    controlnet.install(patcher)  # ControlNets in its conditionings run on the workers
    return patcher


def remote_dit(model) -> RemoteDiT | None:
    """The RemoteDiT inside a parallel MODEL, else None."""
    inner = getattr(getattr(model, "model", None), "diffusion_model", None)
    return inner if isinstance(inner, RemoteDiT) else None


def handle_of(model) -> convert.ParaDiTModel | None:
    """The ParaDiT handle behind a MODEL from Load Parallel DiT (or the handle itself), else None."""
    if isinstance(model, convert.ParaDiTModel):
        return model
    inner = remote_dit(model)
    return inner.handle if inner is not None else None


def parameter_shapes(model) -> dict:
    """ComfyUI's parameter name (no prefix) -> shape of the file behind a parallel MODEL ({} for a handle)."""
    inner = remote_dit(model)
    return inner.parameter_shapes() if inner is not None else {}


def _meta_state_dict(path: str) -> tuple[dict, bool]:
    """The checkpoint's tensors as meta tensors of the stored shape and dtype (ComfyUI's detection reads only
    names, shapes and dtypes, and nothing of the file's data is read here), and whether it has ComfyUI-quantized
    layers."""
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        sd = {k: torch.empty(reader.shape(k), dtype=reader.dtype(k), device="meta") for k in reader.keys()}
        return sd, bool(reader.quant_layers())


def _host_dtypes(handle, sd: dict, quantized: bool, config, mm) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype, manual cast dtype) UNETLoader would pick for this file (or the loader's weight_dtype): the host casts
    the model's input to it before each call, as for a model it holds. A ComfyUI-quantized file's stored dtypes
    say nothing of its compute dtype: ComfyUI's loader then passes no weight dtype, and casts from none."""
    import comfy.utils
    from parallel_runtime.distributed.devices import named_dtype

    dtype = named_dtype(handle.model.weight_dtype)
    if dtype is None:
        dtype = mm.unet_dtype(model_params=comfy.utils.calculate_parameters(sd),
                              supported_dtypes=list(config.supported_inference_dtypes),
                              weight_dtype=None if quantized else comfy.utils.weight_dtype(sd))
    return dtype, mm.unet_manual_cast(None if quantized else dtype, mm.get_torch_device(),
                                      config.supported_inference_dtypes)
