"""Parallel Sampler: KSampler's inputs, run by the ParaDiT workers."""
from __future__ import annotations

import dataclasses
import time

from comfy_api.latest import io, ui

from . import convert, remote_model
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
            inputs=convert.build_inputs(io, convert.sampler_inputs(convert.sampler_names(), convert.scheduler_names())),
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
    """The node's work, apart from ComfyUI's io: returns (LATENT, one-line summary)."""
    from parallel_runtime.runtime.client import get_client
    from parallel_runtime.distributed.devices import parse_devices

    host = host or HOST
    base = getattr(model, "model", None)  # ComfyUI's BaseModel behind a parallel MODEL (None for a bare handle)
    model, lora = _parallel_model(model)
    job = _validated_job(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise)
    job = _with_concat(base, job, positive, negative)
    worker_devices = parse_devices(model.devices)
    # ComfyUI's models leave the workers' GPUs first, so the workers' memory report (auto's budget) sees it free.
    host.free_memory_for(worker_devices)
    client = get_client(model.devices, p2p=model.strategy.p2p)
    if client.notice:
        host.send_text(client.notice, node_id)

    choice = model.strategy
    strategy, reason = _plan(choice, model, job, cfg, client, host)
    status = _JobStatus(host, client, dict(node_id=node_id, strategy=strategy, reason=reason, mode=choice.mode,
                                           strategy_node=choice.node_id, devices=model.devices))
    status.start(int(steps), node_id)
    job = dataclasses.replace(job, strategy=strategy, weight_patches=lora)
    out = _run_job(client, job, status, host)
    elapsed = time.monotonic() - status.started
    result = convert.latent_output(latent_image, out)
    status.send("done", step=int(steps), total=int(steps))
    summary = f"{strategy.label()} on {strategy.world_size} worker(s): {int(steps)} steps in {elapsed:.1f} s"
    if client.notice:
        summary += f" — note: {client.notice}"
    return result, summary


def _parallel_model(model):
    """(the Load Parallel DiT handle behind a MODEL, its LoRA-style weight patches); refuses any other MODEL."""
    from parallel_runtime.errors import ConfigError

    remote_model.refuse_model_patches(model)
    handle = remote_model.handle_of(model)
    if handle is None:
        raise ConfigError("Parallel Sampler needs the MODEL of a Load Parallel DiT node, not an ordinary one (e.g. "
                          "from UNETLoader); load the file with Load Parallel DiT, or sample this model with KSampler.")
    return handle, weight_patches_of(model, remote_model.parameter_shapes(model))


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
                                concat_mask=extra.get("concat_mask"))
        return None if made is None else made.detach().float().cpu()

    pos = dataclasses.replace(job.positive, concat=concat(positive))
    neg = dataclasses.replace(job.negative, concat=concat(negative)) if job.negative is not None else None
    return dataclasses.replace(job, positive=pos, negative=neg)


def _validated_job(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise):
    """The node's inputs as a Job (strategy not yet chosen), its numbers checked."""
    from parallel_runtime.sampling import cfg_uses_uncond
    from parallel_runtime.spec import Job, SamplingSpec, StrategySpec
    from parallel_runtime.validate import validate_numbers

    samples, extra = convert.latent_samples(latent_image)
    pos = convert.conditioning(positive, "positive")
    # ComfyUI skips the negative branch at cfg 1.0; so does the runtime (and so it isn't validated).
    neg = convert.conditioning(negative, "negative") if cfg_uses_uncond(float(cfg)) else None
    sampling = SamplingSpec(seed=int(seed), steps=int(steps), cfg=float(cfg), sampler_name=sampler_name,
                            scheduler=scheduler, denoise=float(denoise))
    job = Job(model=model.model, strategy=StrategySpec(), sampling=sampling, latent=samples, positive=pos,
              negative=neg, extra=extra)
    # NaN/Inf settings are refused before anything is freed, started or planned with them.
    validate_numbers(job)
    return job


def _plan(choice, model, job, cfg, client, host):
    """(StrategySpec, reason): the Strategy Selector's choice resolved (auto plans it), shown on that node."""
    def choose_strategy(*args, **kw):  # imported only in auto mode
        from parallel_runtime.planning.auto import choose_strategy

        return choose_strategy(*args, memory_budget_bytes=client.memory_budget(), **kw)

    def measure():  # device_weights 'measured'
        from parallel_runtime.planning.balance import measured_weights

        return measured_weights(client, model.model.path, tuple(job.latent.shape), job.positive.cond.shape[1],
                                model.model.weight_dtype)

    strategy, reason = convert.resolve_strategy(choice, choose_strategy, model.model.path, tuple(job.latent.shape),
                                                cfg, model.devices, measure)
    host.send_text(convert.strategy_text(strategy, reason, choice.mode), choice.node_id)
    return strategy, reason


class _JobStatus:
    """The node's "paradit.status" events and progress bar while one job runs."""

    def __init__(self, host, client, common: dict):
        self.host, self.client, self.common = host, client, common
        self.pbar = None
        self.started = self.last_sent = 0.0

    def send(self, state, *, status=None, **kw):
        if status is None:
            try:
                status = self.client.status()
            except Exception as e:  # status is decoration: never let it fail a job
                status = {"error": str(e)}
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
