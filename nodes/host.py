"""The few ComfyUI services the nodes use (progress bar, interrupt, freeing ComfyUI's models, status events,
KSampler's own sampling), imported when first needed; tests swap in a fake."""
from __future__ import annotations

import sys

import torch

from . import convert


class ComfyHost:
    """The few ComfyUI services the sampler uses, imported when first needed (tests swap in a fake)."""

    def free_memory_for(self, worker_devices: list[str]) -> None:
        import comfy.model_management as mm

        if convert.devices_overlap_host(worker_devices, mm.get_torch_device()):
            mm.unload_all_models()
            mm.soft_empty_cache()

    def sampler_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(samplers, schedulers) KSampler offers: Parallel Sampler takes every one (those the workers' own loop
        lacks run through ComfyUI's sampler); the runtime's own lists where ComfyUI is absent."""
        try:
            import comfy.samplers
        except ImportError:
            return convert.sampler_names(), convert.scheduler_names()
        return tuple(comfy.samplers.KSampler.SAMPLERS), tuple(comfy.samplers.KSampler.SCHEDULERS)

    def ksampler(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise):
        """KSampler's own work on `model` (ComfyUI's common_ksampler: its noise, noise mask, preview and progress
        bar), so a graph Parallel Sampler routes here gets KSampler's latent whatever the ComfyUI version."""
        comfy_nodes = sys.modules.get("nodes")  # ComfyUI's nodes.py: imported before any custom node loads
        if not hasattr(comfy_nodes, "common_ksampler"):
            raise convert.ConfigError("This graph needs ComfyUI's own sampler, which is not loaded here; run it inside "
                                      "ComfyUI (or headless through ComfyUI's API).")
        return comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                           latent, denoise=denoise)[0]

    def fixed_latent(self, model, latent: dict) -> dict:
        """The LATENT as KSampler samples it: ComfyUI's fix_empty_latent_channels widens an empty latent to the
        model's channels (Empty Latent Image's 4 for Flux's 16) and gives a video-format model its frame axis."""
        import comfy.sample

        samples = latent.get("samples") if isinstance(latent, dict) else None
        if not isinstance(samples, torch.Tensor):
            return latent  # not a LATENT: the conversion says so in one sentence
        fixed = comfy.sample.fix_empty_latent_channels(model, samples)
        return latent if fixed is samples else dict(latent, samples=fixed)

    def progress_bar(self, total: int, node_id: str | None):
        import comfy.utils

        return comfy.utils.ProgressBar(total, node_id=node_id)

    def interrupted(self) -> bool:
        import comfy.model_management as mm

        return mm.processing_interrupted()

    def interrupt(self) -> Exception:
        """ComfyUI's own exception for "the user pressed Cancel", with the flag cleared as ComfyUI does."""
        import comfy.model_management as mm

        try:
            mm.throw_exception_if_processing_interrupted()
        except mm.InterruptProcessingException as e:
            return e
        return mm.InterruptProcessingException()

    def is_interrupt(self, exc: BaseException) -> bool:
        import comfy.model_management as mm

        return isinstance(exc, mm.InterruptProcessingException)

    def send(self, payload: dict) -> None:
        server = self._server()
        if server is not None:
            server.send_sync(convert.STATUS_EVENT, payload)

    def send_text(self, text: str, node_id: str | None) -> None:
        server = self._server()
        if server is not None and node_id is not None:
            server.send_progress_text(text, node_id)

    @staticmethod
    def _server():
        try:
            from server import PromptServer
        except ImportError:
            return None
        return getattr(PromptServer, "instance", None)


HOST = ComfyHost()
