"""Parallel Sampler: KSampler's inputs, run by the ParaDiT workers."""
from __future__ import annotations

import dataclasses
import time

from comfy_api.latest import io, ui

from . import convert, remote_model, route
from .host import HOST
from .weight_patches import weight_patches_of

STATUS_INTERVAL_S = 1.0  # at most this often a client.status() call and a "paradit.status" event while sampling




class ParaDiTSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParaDiTSampler",
            display_name="Parallel Sampler",
            category=convert.CATEGORY,
            description="Denoises the latent like KSampler, split over the devices of Load Parallel DiT. "
                        "Connect its LATENT to VAE Decode as usual.",
            inputs=convert.build_inputs(io, convert.sampler_inputs(*HOST.sampler_names())),
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                denoise=1.0) -> io.NodeOutput:
        node_id = getattr(cls.hidden, "unique_id", None) if cls.hidden is not None else None
        latent_out, summary = sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                     latent_image, denoise, node_id=node_id, host=HOST)
        return io.NodeOutput(latent_out, ui=ui.PreviewText(summary))


def sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise=1.0,
           *, node_id=None, host=None) -> tuple[dict, str]:
    """The node's work, apart from ComfyUI's io: returns (LATENT, one-line summary). The workers run the whole
    step loop where they can (route.worker_loop_gap); any other graph is sampled as KSampler samples it."""
    host = host or HOST
    handle = remote_model.handle_of(model)
    if handle is None:
        raise convert.ConfigError("Parallel Sampler needs the MODEL of a Load Parallel DiT node, not an ordinary one "
                                  "(e.g. from UNETLoader); load the file with Load Parallel DiT, or sample this model "
                                  "with KSampler.")
    remote = remote_model.remote_dit(model)
    if remote is not None:  # KSampler's own first step: an empty latent widened to the model's channels and frames
        latent_image = host.fixed_latent(model, latent_image)
    # A bare handle (headless, tests) has no BaseModel to ask: the workers check a video latent against the file.
    video = remote.video_model() if remote is not None else _has_frames(latent_image)
    gap = route.worker_loop_gap(model, cfg, sampler_name, scheduler, positive, negative, latent_image, video)
    args = (model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise)
    if gap is None:
        return _sample_on_workers(*args, handle=handle, video=video, node_id=node_id, host=host)
    if remote is None:
        raise convert.ConfigError(f"This graph has {gap}, which Parallel Sampler runs through ComfyUI's sampler on "
                                  f"the MODEL output of Load Parallel DiT; connect that output to the model input.")
    return _sample_per_call(*args, gap=gap, remote=remote, node_id=node_id, host=host)


def _has_frames(latent) -> bool:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    return getattr(samples, "ndim", 0) == 5 and samples.shape[2] > 1


def _sample_on_workers(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                       *, handle, video, node_id, host) -> tuple[dict, str]:
    """The whole denoise as one runtime job: the workers' own step loop (PipeFusion pipelines across steps)."""
    from parallel_runtime.runtime.client import get_client

    base = getattr(model, "model", None)  # ComfyUI's BaseModel behind a parallel MODEL (None for a bare handle)
    lora = weight_patches_of(model, remote_model.parameter_shapes(model))
    job = _validated_job(handle, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                         denoise, video)
    job = _with_concat(base, job, positive, negative)
    job = _with_vace(base, job, positive, negative)
    job = _with_image_inputs(base, job, positive, negative)
    job = _with_prompt_states(base, job, positive, negative)
    # ComfyUI's models leave the workers' GPUs on this machine first, so the workers' memory report (auto's budget)
    # sees it free.
    host.free_memory_for(convert.local_devices(handle.devices))
    client = get_client(handle.devices, p2p=handle.strategy.p2p)
    if client.notice:
        host.send_text(client.notice, node_id)

    choice = handle.strategy
    strategy, reason = _plan(choice, handle, job, cfg, client, host)
    status = _JobStatus(host, client, dict(node_id=node_id, strategy=strategy, reason=reason, mode=choice.mode,
                                           strategy_node=choice.node_id, devices=handle.devices))
    status.start(int(steps), node_id)
    job = dataclasses.replace(job, strategy=strategy, weight_patches=lora)
    out = _run_job(client, job, status, host)
    elapsed = time.monotonic() - status.started
    if job.audio is not None:  # an audio-video model: both streams back in the input's NestedTensor
        result = convert.av_latent_output(latent_image, out.latent, out.audio)
    else:
        result = convert.latent_output(latent_image, out)
    status.send("done", step=int(steps), total=int(steps))
    summary = f"{strategy.label()} on {strategy.world_size} worker(s): {int(steps)} steps in {elapsed:.1f} s"
    if client.notice:
        summary += f" — note: {client.notice}"
    return result, summary


def _sample_per_call(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                     *, gap, remote, node_id, host) -> tuple[dict, str]:
    """KSampler's own sampling (ComfyUI's sampler calls the workers once per model evaluation): the result is
    KSampler's by construction. PipeFusion then pipelines within each call, not across steps."""
    from parallel_runtime.validate import check_setting

    for name, value in (("cfg", cfg), ("denoise", denoise)):  # refused before anything runs, as on the workers' path
        check_setting(name, value)
    choice = remote.handle.strategy
    line = f"per-call pipeline: the graph has {gap}"
    common = dict(node_id=node_id, mode=choice.mode, strategy_node=choice.node_id, devices=remote.handle.devices,
                  reason=line)
    host.send_text(line, node_id)
    host.send(convert.status_payload(state="starting", strategy=None, step=0, total=int(steps), **common))
    started = time.monotonic()
    remote.last_strategy = None  # set by this run's first model call (none where denoise leaves no step)
    remote.on_call = _CallStatus(host, common, int(steps)).after_call
    try:
        out = host.ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                            denoise)
    except BaseException as e:
        cancelled = host.is_interrupt(e)
        host.send(convert.status_payload(state="cancelled" if cancelled else "error", strategy=remote.last_strategy,
                                         message="Cancelled." if cancelled else str(e), **common))
        raise
    finally:
        remote.on_call = None
    elapsed = time.monotonic() - started
    strategy = remote.last_strategy
    host.send(convert.status_payload(state="done", strategy=strategy, step=int(steps), total=int(steps), **common))
    label = f"{strategy.label()} on {strategy.world_size} worker(s)" if strategy is not None else "ParaDiT"
    return out, f"{label}, one runtime job per model call ({line}): {int(steps)} steps in {elapsed:.1f} s"


def _with_concat(base, job, positive, negative):
    """Each branch's c_concat (Fill's masked image and mask, Canny/Depth's control image) as KSampler builds it:
    the MODEL's own BaseModel.concat_cond on the conditioning's concat_latent_image / concat_mask (zeros where a
    concat model's branch has none, as in ComfyUI; None for a model that reads no extra channels)."""
    if base is None or not hasattr(base, "concat_cond"):
        return job
    import torch

    def concat(value):
        extra = value[0][1] or {}
        made = base.concat_cond(noise=job.latent, device=torch.device("cpu"),
                                concat_latent_image=extra.get("concat_latent_image"),
                                concat_mask=extra.get("concat_mask"),
                                concat_mask_index=extra.get("concat_mask_index", 0))  # Wan22FunControlToVideo's
        return None if made is None else made.detach().float().cpu()

    def with_concat(value, c):
        image = (value[0][1] or {}).get("concat_latent_image")
        if type(base).__name__ == "HiDream" and image is not None:  # E1: its image_cond, concatenated along the width
            return dataclasses.replace(c, references=(image.detach().float().cpu(),), reference_method="hidream_e1")
        return dataclasses.replace(c, concat=concat(value))

    pos = with_concat(positive, job.positive)
    neg = with_concat(negative, job.negative) if job.negative is not None else None
    return dataclasses.replace(job, positive=pos, negative=neg)


def _with_vace(base, job, positive, negative):
    """Each branch's VACE context as KSampler builds it for a VACE model (ComfyUI's others ignore WanVaceToVideo's
    keys): the MODEL's own WAN21_Vace.extra_conds on the conditioning's vace_frames / vace_mask / vace_strength (zero
    frames under a mask of ones where a branch has none), its vace_context and vace_strength."""
    if base is None or type(base).__name__ != "WAN21_Vace":
        return job
    import torch

    def vace(value, c):
        extra = value[0][1] or {}
        keys = ("vace_frames", "vace_mask", "vace_strength")
        out = base.extra_conds(noise=job.latent, device=torch.device("cpu"),
                               **{k: extra[k] for k in keys if extra.get(k) is not None})
        context = out["vace_context"].cond.detach().float().cpu()
        return dataclasses.replace(c, vace=context, vace_strength=tuple(float(v) for v in out["vace_strength"].cond))

    pos = vace(positive, job.positive)
    neg = vace(negative, job.negative) if job.negative is not None else None
    return dataclasses.replace(job, positive=pos, negative=neg)


# Conditioning keys whose model inputs the MODEL's own extra_conds makes (route._READ_KEYS lists them), and the
# model-call input each becomes: a start image's CLIP-vision tokens (Wan 2.1 I2V / FLF2V and its variants: clip_fea),
# Wan Animate's pose latent (after process_latent_in) and face video.
IMAGE_INPUT_KEYS = ("clip_vision_output", "pose_video_latent", "face_video_pixels")


def _with_image_inputs(base, job, positive, negative):
    """Each branch's CLIP-vision tokens and Wan Animate's pose latent and face video as KSampler's model calls get
    them: the MODEL's own extra_conds on the conditioning's keys (the family's choice of hidden states, its latent
    format), through the door's own chunking (the face video kept on the workers by the hash of its bytes)."""
    if base is None or not hasattr(base, "extra_conds"):
        return job
    import torch

    def inputs(value, c):
        extra = value[0][1] or {}
        given = {k: extra[k] for k in IMAGE_INPUT_KEYS if extra.get(k) is not None}
        if not given:
            return c
        out = base.extra_conds(noise=job.latent, device=torch.device("cpu"), **given)
        made = {name: out[name].cond for name in ("clip_fea", "pose_latents", "face_pixel_values") if name in out}
        clip = made.get("clip_fea")
        return dataclasses.replace(c, clip_vision=None if clip is None else clip.detach().float().cpu(),
                                   **remote_model._chunk_animate(made.get("pose_latents"),
                                                                 made.get("face_pixel_values"), slice(None)))

    pos = inputs(positive, job.positive)
    neg = inputs(negative, job.negative) if job.negative is not None else None
    return dataclasses.replace(job, positive=pos, negative=neg)


def _with_prompt_states(base, job, positive, negative):
    """An audio-video model's prompt rows as ComfyUI's extra_conds hands them to it (LTXAV, MiniMaxH3): through
    the diffusion model's preprocess_text_embeds (Load Parallel DiT's: LTX-2's connectors; MiniMax-H3's states pass
    unchanged, its workers refine them)."""
    model = getattr(base, "diffusion_model", None)
    if job.audio is None or not hasattr(model, "preprocess_text_embeds"):
        return job

    def states(value, c):
        unprocessed = (value[0][1] or {}).get("unprocessed_ltxav_embeds", False)
        made = (model.preprocess_text_embeds(c.cond, unprocessed=unprocessed) if unprocessed
                else model.preprocess_text_embeds(c.cond))
        return dataclasses.replace(c, cond=made.detach().float().cpu())

    neg = states(negative, job.negative) if job.negative is not None else None
    return dataclasses.replace(job, positive=states(positive, job.positive), negative=neg)


def _validated_job(handle, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                   video):
    """The node's inputs as a Job (strategy not yet chosen), its numbers checked. An audio-video model's latent
    (a NestedTensor) becomes the job's video latent and its audio latent (Job.audio)."""
    from parallel_runtime.sampling import cfg_uses_uncond
    from parallel_runtime.spec import Job, SamplingSpec, StrategySpec
    from parallel_runtime.validate import validate_numbers

    streams = convert.av_streams(latent_image)
    if streams is not None:
        (samples, audio), extra = streams, {}
        if latent_image.get("batch_index") is not None:  # prepare_noise's noise_inds, for each stream alike
            extra["batch_index"] = [int(i) for i in latent_image["batch_index"]]
        frame_rate = (positive[0][1] or {}).get("frame_rate") if isinstance(positive, (list, tuple)) else None
        if frame_rate is not None:  # LTXVConditioning: LTX-2's RoPE time axis in seconds
            extra["frame_rate"] = float(frame_rate)
    else:
        (samples, extra), audio = convert.latent_samples(latent_image, video), None
    pos = convert.conditioning(positive, "positive")
    # ComfyUI skips the negative branch at cfg 1.0; so does the runtime (and so it isn't validated).
    neg = convert.conditioning(negative, "negative") if cfg_uses_uncond(float(cfg)) else None
    sampling = SamplingSpec(seed=int(seed), steps=int(steps), cfg=float(cfg), sampler_name=sampler_name,
                            scheduler=scheduler, denoise=float(denoise))
    job = Job(model=handle.model, strategy=StrategySpec(), sampling=sampling, latent=samples, positive=pos,
              negative=neg, extra=extra, audio=audio)
    # NaN/Inf settings are refused before anything is freed, started or planned with them.
    validate_numbers(job)
    return job


def _plan(choice, handle, job, cfg, client, host):
    """(StrategySpec, reason): the Strategy Selector's choice resolved by the runtime (auto plans it), shown on
    that node."""
    from parallel_runtime.runtime.entrance import plan

    strategy, reason, _ = plan(client, choice, handle.model, tuple(job.latent.shape), cfg, handle.devices,
                               text_tokens=job.positive.cond.shape[1])
    host.send_text(convert.strategy_text(strategy, reason, choice.mode), choice.node_id)
    return strategy, reason


class _CallStatus:
    """Parallel Sampler's "running" events while ComfyUI's sampler calls the workers (at most one per
    STATUS_INTERVAL_S, as for a worker-loop job: the same worker status the node draws); the progress bar is
    ComfyUI's own there."""

    def __init__(self, host, common: dict, steps: int):
        self.host, self.common, self.steps = host, common, steps
        self.last_sent = 0.0

    def after_call(self, step: int | None, strategy, client) -> None:
        now = time.monotonic()
        if now - self.last_sent < STATUS_INTERVAL_S:
            return
        self.last_sent = now
        done = None if step is None else min(step + 1, self.steps)
        self.host.send(convert.status_payload(state="running", strategy=strategy, step=done, total=self.steps,
                                              status=_worker_status(client), **self.common))


def _worker_status(client) -> dict:
    """The workers' status for a "paradit.status" event; status is decoration: never let it fail a job."""
    try:
        return client.status()
    except Exception as e:
        return {"error": str(e)}


class _JobStatus:
    """The node's "paradit.status" events and progress bar while one job runs."""

    def __init__(self, host, client, common: dict):
        self.host, self.client, self.common = host, client, common
        self.pbar = None
        self.started = self.last_sent = 0.0

    def send(self, state, *, status=None, **kw):
        if status is None:
            status = _worker_status(self.client)
        self.host.send(convert.status_payload(state=state, status=status, **self.common, **kw))

    def start(self, steps: int, node_id) -> None:
        """The "starting" event, then the progress bar; the job's clock starts."""
        self.send("starting", step=0, total=steps)
        self.pbar = self.host.progress_bar(steps, node_id)
        self.started = self.last_sent = time.monotonic()

    def progress(self, step: int, total: int, info: dict | None = None) -> None:
        # On Cancel, ComfyUI's progress hook raises its InterruptProcessingException here; the client then
        # cancels the workers and re-raises it once they have stopped.
        self.pbar.update_absolute(step, total)
        now = time.monotonic()
        if now - self.last_sent >= STATUS_INTERVAL_S or step >= total:
            self.last_sent = now
            self.send("running", step=step, total=total, info=info)


def _run_job(client, job, status: _JobStatus, host):
    """The workers' result for `job`; a failure or Cancel is reported as a status event and raised to ComfyUI
    (a Cancel as the host's own interrupt)."""
    from parallel_runtime.errors import Cancelled, ParaDiTError

    try:
        if job.audio is not None:  # the result's audio rides beside the latent
            return client.run(job, progress=status.progress, interrupted=host.interrupted)
        return client.sample(job, progress=status.progress, interrupted=host.interrupted)
    except Cancelled:
        status.send("cancelled", message="Cancelled.")
        raise host.interrupt() from None
    except ParaDiTError as e:
        status.send("error", message=str(e))
        raise
    except BaseException as e:
        cancelled = host.is_interrupt(e)
        status.send("cancelled" if cancelled else "error", message="Cancelled." if cancelled else str(e))
        raise
