"""The few ComfyUI services the nodes use (progress bar, interrupt, freeing ComfyUI's models, status events),
imported when first needed; tests swap in a fake."""
from __future__ import annotations

from . import convert


class ComfyHost:
    """The few ComfyUI services the sampler uses, imported when first needed (tests swap in a fake)."""

    def free_memory_for(self, worker_devices: list[str]) -> None:
        import comfy.model_management as mm

        if convert.devices_overlap_host(worker_devices, mm.get_torch_device()):
            mm.unload_all_models()
            mm.soft_empty_cache()

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
