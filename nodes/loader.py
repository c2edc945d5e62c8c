"""Load Parallel DiT: validates a checkpoint choice and a device list; the workers load it at sample time."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import convert, remote_model



class ParaDiTLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id="ParaDiTLoader",
            display_name="Load Parallel DiT",
            category=convert.CATEGORY,
            description="Picks a DiT checkpoint and the devices its worker processes run on, and outputs a MODEL "
                        "for KSampler, SamplerCustomAdvanced or Parallel Sampler. No weights load here: the workers "
                        "read them at the first sample.",
            inputs=convert.build_inputs(io, convert.loader_inputs(folder_paths.get_filename_list("diffusion_models"))),
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, unet_name, weight_dtype, devices, strategy=None) -> io.NodeOutput:
        import folder_paths
        from parallel_runtime.runtime.devices import parse_devices

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        handle = convert.model_handle(path, weight_dtype, devices, strategy, name=unet_name)
        device_list = parse_devices(handle.devices)  # raises ConfigError with the fix
        return io.NodeOutput(remote_model.parallel_model(handle), ui=ui.PreviewText(handle.describe(device_list)))
