"""Load Parallel DiT: validates a checkpoint choice and a device list; the workers load it at sample time."""
from __future__ import annotations

import os

from comfy_api.latest import io, ui

from . import convert, front_door, remote_model


# folder -> ({directory: mtime} as walked, its .gguf files): a walk is redone only when a directory changed, as
# ComfyUI revalidates its own file lists (large network drives make a walk per schema request slow).
_GGUF_LISTS: dict[str, tuple[dict[str, float], list[str]]] = {}


def _unchanged(dirs: dict[str, float]) -> bool:
    try:
        return all(os.path.getmtime(d) == t for d, t in dirs.items())
    except OSError:  # a directory went away
        return False


def _gguf_files(folder: str) -> list[str]:
    import folder_paths

    cached = _GGUF_LISTS.get(folder)
    if cached is None or not _unchanged(cached[0]):
        files, dirs = folder_paths.recursive_search(folder, excluded_dir_names=[".git"])
        cached = _GGUF_LISTS[folder] = (dirs, folder_paths.filter_files_extensions(files, {".gguf"}))
    return cached[1]


def model_files() -> list[str]:
    """The loader's choices: ComfyUI's diffusion_models list (models/diffusion_models and models/unet) plus the
    `.gguf` files in the same folders, which ComfyUI lists only through ComfyUI-GGUF's own loader."""
    import folder_paths

    names = set(folder_paths.get_filename_list("diffusion_models"))
    for folder in folder_paths.get_folder_paths("diffusion_models"):
        if os.path.isdir(folder):
            names.update(_gguf_files(folder))
    return sorted(names)


class ParaDiTLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:

        return io.Schema(
            node_id="ParaDiTLoader",
            display_name="Load Parallel DiT",
            category=convert.CATEGORY,
            description="Picks a DiT checkpoint and the devices its worker processes run on, and outputs a MODEL "
                        "for KSampler, SamplerCustomAdvanced or Parallel Sampler. No weights load here: the workers "
                        "read them at the first sample.",
            inputs=convert.build_inputs(io, convert.loader_inputs(model_files())),
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, unet_name, weight_dtype, devices, strategy=None, quantized_matmul="auto") -> io.NodeOutput:
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        handle = convert.model_handle(path, weight_dtype, devices, strategy, name=unet_name,
                                      quantized_matmul=quantized_matmul)
        labels, notice = rank_labels(handle.devices)
        text = handle.describe(labels) + (f"\n{notice}" if notice else "")
        return io.NodeOutput(remote_model.parallel_model(handle), ui=ui.PreviewText(text))


def rank_labels(devices: str) -> tuple[list[str], str | None]:
    """Each rank's device as the runtime will place it ('cuda:0' here, 'gpu-box-2 cuda:0' on a joined machine) and
    a notice to show before anything loads. What the runtime refuses is refused here, in its sentence and before a
    prompt starts: several GPUs where torch has no NCCL, a machine whose agent has not joined."""
    from parallel_runtime.distributed.devices import runtime_devices
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.runtime.cluster import names_a_machine, names_remote, place_ranks

    if not names_remote(devices):
        return runtime_devices(devices)
    try:
        door = front_door.door()
    except ConfigError:
        if not names_a_machine(devices):
            # Only bare words and no front door: a typo of this machine's devices ('atuo') is what that most likely
            # is, and the local parser's sentence says what is valid here.
            return runtime_devices(devices)
        raise
    return [place.label for place in place_ranks(devices, door)], None
