"""ComfyUI's ControlNets (ControlNetLoader + ControlNetApply / ControlNetApplyAdvanced) on the ParaDiT workers.

ComfyUI runs a ControlNet chain on the host before every model call and hands the diffusion model its
residuals. With a parallel MODEL that would put the ControlNet on the host's GPU (one the workers own) and
run it serially every step. Instead, when a sampler starts, each ControlNet in the conditionings is swapped
for a `RemoteControlNet`: ComfyUI still decides which members of the chain are active at each step and
prepares each hint exactly as its ControlNet does (upscale, VAE encode), but the ControlNet's weights go to
the workers once (exported as safetensors into ComfyUI's temp folder) and run there under the DiT's own token
split; the model call receives a `RemoteControl` naming them instead of residuals.
"""
from __future__ import annotations

import os
import uuid
import weakref

from . import convert

WRAPPER_KEY = "paradit_controlnet"
_EXPORTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # ComfyUI control model -> exported file


class RemoteControl:
    """What a model call receives in place of ControlNet residuals: the active chain, as runtime ControlInputs."""

    def __init__(self, inputs: tuple):
        self.inputs = inputs


def install(patcher) -> None:
    """Swap ControlNets for their remote twins whenever a sampler starts with this MODEL."""
    import comfy.patcher_extension as ext

    patcher.add_wrapper_with_key(ext.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample)


def _outer_sample(executor, *args, **kwargs):
    """ComfyUI's CFGGuider.outer_sample with each conditioning's ControlNet replaced (the guider's conds are
    per-run copies, so the graph's own conditioning keeps the original), before any model is loaded."""
    remote: dict[int, RemoteControlNet] = {}
    for conds in executor.class_obj.conds.values():
        for cond in conds:
            control = cond.get("control")
            if control is None or isinstance(control, RemoteControlNet):
                continue
            if id(control) not in remote:  # one twin per object: ComfyUI batches conds by control identity
                remote[id(control)] = RemoteControlNet(control)
            cond["control"] = remote[id(control)]
    return executor(*args, **kwargs)


class RemoteControlNet:
    """A ControlNet chain (the last-applied ControlNet and its `previous_controlnet`s) that runs on the workers.
    ComfyUI's sampler calls it as it calls a ControlNet; it loads nothing on the host."""

    def __init__(self, control):
        chain = []
        while control is not None:
            chain.insert(0, control)  # first applied first: the order ComfyUI sums residuals in
            control = control.previous_controlnet
        for c in chain:
            _check_supported(c)
        self.chain = chain
        self.last = chain[-1]
        self.paths = [_export(c.control_model) for c in chain]
        self.hints: dict[tuple, tuple[str, object]] = {}  # (chain index, latent size) -> (key, hint)

    # -- ComfyUI's ControlBase interface ------------------------------------------------------------------

    def pre_run(self, model, percent_to_timestep_function):
        """ComfyUI's ControlNet.pre_run for each member (its timestep range, the model's sampling), one by one.
        ControlNetSD35's own pre_run would first copy the DiT's x or y embedder into its ControlNet from the host's
        model, which holds no DiT weights: the workers read those layers from their DiT instead."""
        import comfy.controlnet

        for c in self.chain:
            previous, c.previous_controlnet = c.previous_controlnet, None  # each member once, not its chain again
            try:
                comfy.controlnet.ControlNet.pre_run(c, model, percent_to_timestep_function)
            finally:
                c.previous_controlnet = previous

    def cleanup(self):
        self.last.cleanup()
        self.hints.clear()

    def get_models(self):
        return []  # nothing to load on the host: the workers hold the ControlNets

    def get_extra_hooks(self):
        return []

    def inference_memory_requirements(self, dtype):
        return 0

    def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
        """The chain members active at sigma t (ComfyUI's timestep_range test), with their hints."""
        from parallel_runtime.spec import ControlInput

        if cond.get("crossattn_controlnet") is not None:
            raise convert.ConfigError("this ControlNet reads its own text conditioning (crossattn_controlnet), "
                                      "which the ParaDiT workers do not run; remove that node or load the model "
                                      "with UNETLoader.")
        inputs = []
        for i, c in enumerate(self.chain):
            if c.timestep_range is not None and (t[0] > c.timestep_range[0] or t[0] < c.timestep_range[1]):
                continue
            key, hint = self._hint(i, c, x_noisy)
            types = tuple(int(v) for v in c.extra_args.get("control_type") or ())  # SetUnionControlNetType's
            inputs.append(ControlInput(self.paths[i], key, float(c.strength), hint, types=types))
        return RemoteControl(tuple(inputs)) if inputs else None

    def _hint(self, i: int, c, x_noisy):
        """Member i's cond_hint for this latent size, prepared as ComfyUI's ControlNet.get_control prepares it
        (once per size: the workers keep it under its key)."""
        import comfy.model_management as mm
        import comfy.utils
        import torch

        size = tuple(x_noisy.shape[2:])
        if (i, size) in self.hints:
            return self.hints[(i, size)]
        ratio = c.compression_ratio
        if c.vae is not None:
            ratio *= c.vae.spacial_compression_encode()
        elif c.latent_format is not None:
            raise convert.ConfigError("this ControlNet needs a VAE; connect one to the ControlNet apply node's "
                                      "vae input.")
        hint = comfy.utils.common_upscale(c.cond_hint_original, x_noisy.shape[-1] * ratio, x_noisy.shape[-2] * ratio,
                                          c.upscale_algorithm, "center")
        hint = c.preprocess_image(hint)
        if c.vae is not None:
            loaded = mm.loaded_models(only_currently_used=True)
            hint = c.vae.encode(hint.movedim(1, -1))
            mm.load_models_gpu(loaded)
        if c.latent_format is not None:
            hint = c.latent_format.process_in(hint)
        if c.extra_concat_orig:  # an inpainting ControlNet's mask channels
            extra = [comfy.utils.repeat_to_batch_size(
                comfy.utils.common_upscale(e.to(hint.device), hint.shape[-1], hint.shape[-2], c.upscale_algorithm,
                                           "center"), hint.shape[0]) for e in c.extra_concat_orig]
            hint = torch.cat([hint] + extra, dim=1)
        self.hints[(i, size)] = (uuid.uuid4().hex, hint.detach().float().cpu())
        return self.hints[(i, size)]


def _check_supported(control) -> None:
    """One sentence for a ControlNet the workers cannot run, before sampling starts."""
    import comfy.cldm.dit_embedder
    import comfy.cldm.mmdit
    import comfy.controlnet
    import comfy.ldm.flux.controlnet
    import comfy.ldm.qwen_image.controlnet

    name = type(control).__name__
    model = getattr(control, "control_model", None)
    # The workers' ControlNets, by ComfyUI's classes: each family's read_config checks the file against its DiT.
    runs = {(comfy.controlnet.ControlNet, comfy.ldm.flux.controlnet.ControlNetFlux),
            (comfy.controlnet.ControlNet, comfy.cldm.mmdit.ControlNet),
            (comfy.controlnet.ControlNetSD35, comfy.cldm.dit_embedder.ControlNetEmbedder),
            (comfy.controlnet.ControlNet, comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel)}
    if (type(control), type(model)) not in runs:
        what = type(model).__name__ if model is not None else name
        raise convert.ConfigError(f"this ControlNet ({what}) does not run on the ParaDiT workers, which run Flux "
                                  f"ControlNets (XLabs, Mistoline, InstantX, InstantX Union), SD3 / SD3.5 ControlNets "
                                  f"(InstantX's, Stability's) and Qwen-Image ControlNets (InstantX's); remove it or "
                                  f"load the model with UNETLoader.")
    if control.strength_type != comfy.controlnet.StrengthType.CONSTANT or control.global_average_pooling:
        raise convert.ConfigError("this ControlNet scales its residuals per block, which the ParaDiT workers do "
                                  "not run; remove it or load the model with UNETLoader.")
    if control.get_extra_hooks():
        raise convert.ConfigError("this ControlNet carries hooks, which the ParaDiT workers do not run; remove "
                                  "them or load the model with UNETLoader.")


def _export(control_model) -> str:
    """The control model's weights as a safetensors file the workers load (ComfyUI's layout, its dtypes): written
    once per loaded ControlNet into ComfyUI's temp folder, removed when ComfyUI drops the ControlNet."""
    import folder_paths
    from safetensors.torch import save_file

    path = _EXPORTS.get(control_model)
    if path is not None and os.path.exists(path):
        return path
    folder = os.path.join(folder_paths.get_temp_directory(), "paradit-controlnets")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{uuid.uuid4().hex}.safetensors")
    tensors = {k: v.detach().cpu().contiguous() for k, v in control_model.state_dict().items()}
    save_file(tensors, path + ".part")
    os.replace(path + ".part", path)  # the workers never see half a file
    _EXPORTS[control_model] = path
    weakref.finalize(control_model, _remove, path)
    return path


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
