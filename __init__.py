"""ParaDiT: ComfyUI entry point.

Light on purpose: nothing here starts workers, touches torch.distributed or loads a model. ComfyUI
calls `comfy_entrypoint()` once at start-up for the node list; the workers start at sample time. The one thing
that starts with the node list is the front door other machines' agents join, where the user configured one
(nodes/front_door.py), so they can join before the first prompt.
"""
import os
import sys

WEB_DIRECTORY = "./web"

# The nodes import `parallel_runtime` as a top-level package (as the worker processes do); make the
# plugin folder findable without letting it shadow anything of ComfyUI's (appended, not prepended).
_ROOT = os.path.dirname(os.path.abspath(__file__))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    from .nodes import node_list

    class ParaDiTExtension(ComfyExtension):
        async def get_node_list(self):
            return node_list()

    return ParaDiTExtension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
