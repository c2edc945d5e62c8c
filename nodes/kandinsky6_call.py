"""ComfyUI 2026's model call for Kandinsky 6, read into the runtime's two-stream model call.

What BaseModel._apply_model hands Kandinsky6NativeAVDiT.forward (comfy/ldm/kandinsky6/model.py): x = [video
[B, 16, T, H, W], audio [B, frames, 40]] (utils.unpack_latents of Kandinsky6EmptyLatent's joint latent); timestep =
sigma x 1000 per row (ModelSamplingDiscreteFlow), one for both streams; context = the Qwen2.5-VL rows, y = the
pooled CLIP-L vector, both streams' prompt. Read: the streams, the timestep, context and y, and the wrappers, LoRA and
block-skip patches RemoteDiT reads for every family. Refused in one sentence naming the node that adds it: the
image-to-video-and-audio reference tail (Kandinsky6ImageToVideoAudio's image), token types, another audio prompt or
RoPE rate, MagCache, ControlNet residuals.
"""
from __future__ import annotations

import torch

from . import convert

# Model inputs ComfyUI 2026 passes that the workers do not run, by the node that adds them.
_INPUT_SOURCES = {
    "k6_reference_tail": "Kandinsky6ImageToVideoAudio's reference image",
    "visual_token_type_ids": "Kandinsky6ImageToVideoAudio's reference image",
    "k6_audio_context": "a node giving the audio its own prompt",
    "k6_audio_pooled_output": "a node giving the audio its own prompt",
    "freqs_scaling": "a node changing the audio RoPE rate",
}
READ_INPUTS = ("latent_shapes",) + tuple(_INPUT_SOURCES)


def streams(x) -> tuple[torch.Tensor, torch.Tensor]:
    parts = list(getattr(x, "tensors", x)) if isinstance(x, (list, tuple)) or getattr(x, "is_nested", False) else [x]
    if len(parts) != 2 or parts[0].ndim != 5 or parts[1].ndim != 3:
        raise convert.ConfigError(f"the model call's latent has {len(parts)} stream(s) but Kandinsky 6 needs (video, "
                                  f"audio); start from Kandinsky6EmptyLatent's joint latent.")
    return parts[0], parts[1]


def refuse_unsupported(kwargs: dict, options: dict, control) -> None:
    """One sentence for each input of the call the workers would otherwise silently ignore."""
    present = [k for k in _INPUT_SOURCES if kwargs.get(k) not in (None, False)]
    if options.get("k6_magcache") is not None:
        raise convert.ConfigError("the Kandinsky 6 call carries MagCache's state (Kandinsky 6's cache node), which "
                                  "ParaDiT does not run; remove that node or load the model with UNETLoader.")
    if present:
        named = ", ".join(f"{k}: {_INPUT_SOURCES[k]}" for k in present)
        raise convert.ConfigError(f"the Kandinsky 6 call carries inputs ParaDiT does not run yet ({named}); remove "
                                  f"that node or load the model with UNETLoader.")
    if control is not None:
        raise convert.ConfigError("the Kandinsky 6 call carries ControlNet residuals, which ParaDiT does not add for "
                                  "this model; remove the ControlNet or load the model with UNETLoader.")
