"""Checks a whole job against the model file and the device count before any worker does work."""
from __future__ import annotations

import math
import os
from functools import lru_cache

import torch

from .distributed.topology import latent_plane, validate_strategy
from .errors import ConfigError, ModelFileError
from .models.registry import token_patch
from .sampling import SAMPLERS, SCHEDULERS, cfg_uses_uncond
from .spec import REFERENCE_METHODS, Job


@lru_cache(maxsize=16)
def _model_config(path: str, mtime_ns: int, size: int):
    from .models.registry import read_model
    from .weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        return read_model(reader, os.path.basename(path))[2]


@lru_cache(maxsize=16)
def _parameter_kinds(path: str, mtime_ns: int, size: int) -> tuple[tuple[int, int], dict]:
    """((parameters, bytes) of the file's block-quantized tensors, {stored dtype: parameters} of the others)."""
    from .weights.checkpoint import open_checkpoint
    from .weights.comfy_quant import auxiliary_keys

    with open_checkpoint(path) as reader:
        # A ComfyUI quantized layer's scales and description count with its weight (stored_bytes), not as plain or
        # fp8 tensors (nvfp4 block scales are fp8).
        aux = auxiliary_keys(reader.quant_layers())
        quantized, by_dtype = [0, 0], {}
        for key in (k for k in reader.keys() if k not in aux):
            numel = math.prod(reader.shape(key))
            if reader.quant_format(key) is not None:
                quantized[0] += numel
                quantized[1] += reader.stored_bytes(key)
            else:
                dtype = reader.dtype(key)
                by_dtype[dtype] = by_dtype.get(dtype, 0) + numel
    return tuple(quantized), by_dtype


def stored_bytes_per_parameter(path: str, weight_dtype: str, plain_bytes: int) -> float:
    """Mean bytes a rank holds per parameter of this file, by the workers' own storage rule
    (`Storage.for_weight_dtype`), every tensor counted as a linear weight (they are nearly all of a DiT's);
    `plain_bytes`: the compute dtype's size."""
    from .weights.storage import Storage

    storage = Storage.for_weight_dtype(weight_dtype, torch.float32)
    st = os.stat(path)
    (quantized, quantized_bytes), by_dtype = _parameter_kinds(path, st.st_mtime_ns, st.st_size)
    held = storage.held_bytes(None, quantized_bytes / max(1, quantized), plain_bytes) * quantized
    held += sum(storage.held_bytes(dtype, 0, plain_bytes) * n for dtype, n in by_dtype.items())
    return held / max(1, quantized + sum(by_dtype.values()))


def model_config(path: str):
    """The config of a checkpoint (its family's), read from its header only (cached per file version)."""
    try:
        st = os.stat(path)
    except OSError:
        raise ModelFileError(f"model file {path} does not exist; put the checkpoint in ComfyUI's "
                             f"models/diffusion_models folder and pick it in the loader.") from None
    return _model_config(path, st.st_mtime_ns, st.st_size)


def validate_branches(job: Job) -> None:
    """The CFG branches and batch bookkeeping: checked by the client and again by each worker's Denoiser.
    Branches of different token layouts run as separate forward passes under every strategy (PipeFusion: one
    pipeline lane each)."""
    uses_uncond = cfg_uses_uncond(job.sampling.cfg)
    if uses_uncond and job.negative is None:
        raise ConfigError("cfg > 1 needs a negative conditioning; connect one or set cfg to 1.")
    batch_index = job.extra.get("batch_index")
    if batch_index is not None and len(batch_index) != job.images:  # a batch group's job: the whole batch's
        raise ConfigError(f"the latent's batch_index lists {len(batch_index)} entries for {job.images} "
                          f"image(s); re-create the batch with ComfyUI's latent batch nodes.")


ROPE_OPTION_NAMES = ("scale_t", "scale_y", "scale_x", "shift_t", "shift_y", "shift_x")


def validate_rope_options(job: Job, config) -> None:
    """ScaleROPE's grid (Job.extra["rope_options"], ROPE_OPTION_NAMES' order): six finite numbers, for a family
    whose RoPE the node scales (its adapter's reads_rope_options)."""
    options = job.extra.get("rope_options")
    if options is None:
        return
    from .models.registry import family_of

    if not getattr(family_of(config).adapter_class, "reads_rope_options", False):
        raise ConfigError(f"ScaleROPE's RoPE scale and shift are not run by ParaDiT for {config.title}; remove the "
                          f"ScaleROPE node or load the model with UNETLoader.")
    if len(options) != len(ROPE_OPTION_NAMES):
        raise ConfigError(f"ScaleROPE's options hold {len(options)} numbers, not the 6 of {', '.join(ROPE_OPTION_NAMES)}; "
                          f"this is a ParaDiT bug, please report it.")
    for name, value in zip(ROPE_OPTION_NAMES, options):
        _finite_number(f"ScaleROPE's {name}", value, "set it to a number in the ScaleROPE node")


def _finite_number(name: str, value, fix: str) -> None:
    try:
        ok = math.isfinite(float(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{name}={value!r} is not a finite number; {fix}.")


# The sampler settings both nodes check before anything runs, each with its fix.
SETTING_FIXES = {"cfg": "set cfg to a number such as 1.0 (Flux dev) or 3.5", "denoise": "set denoise between 0 and 1"}


def check_setting(name: str, value) -> None:
    """One sentence for a NaN / Inf / non-numeric sampler setting (cfg, denoise), the same from both nodes."""
    _finite_number(name, value, SETTING_FIXES[name])


def _finite_tensor(name: str, t: torch.Tensor | None, fix: str) -> None:
    if t is None or not t.is_floating_point():
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ConfigError(f"the {name} holds {bad} NaN/Inf value(s) of {t.numel()}; {fix}.")


def validate_numbers(job: Job) -> None:
    """NaN or Inf anywhere in the job's settings or tensors would silently sample garbage: refuse it."""
    sp = job.sampling
    check_setting("cfg", sp.cfg)
    check_setting("denoise", sp.denoise)
    upstream = "it comes from the node feeding it (often a half-precision overflow): re-run that node in fp32 or bf16"
    _finite_tensor("latent", job.latent, "re-create it (an empty latent, or VAE Encode of a valid image); " + upstream)
    _finite_tensor("audio latent", job.audio, "re-create it (an empty AV latent, or the audio VAE's encode); " + upstream)
    for name, c in (("positive", job.positive), ("negative", job.negative)):
        if c is None:
            continue
        if c.guidance is not None:
            _finite_number(f"the {name} conditioning's guidance", c.guidance, "set FluxGuidance to a number such as 3.5")
        _finite_tensor(f"{name} conditioning", c.cond, "re-encode the prompt; " + upstream)
        _finite_tensor(f"{name} pooled vector", c.pooled, "re-encode the prompt; " + upstream)


def validate_reference_slots(name: str, c, config) -> None:
    """Where the prompt holds the references (Qwen-Image 2.1's image slots): only for a family that reads them, one
    slot per reference at most, ascending prompt rows (TextEncodeQwenImage21 makes them so)."""
    slots = c.reference_slots
    if not slots:
        return
    if not getattr(config, "reads_reference_slots", False):
        raise ConfigError(f"the {name} conditioning places images inside the prompt (image slots), which this "
                          f"{config.family} model does not read; encode the prompt without images.")
    rows = c.cond.shape[1]
    if len(slots) > len(c.references) or list(slots) != sorted(slots) or min(slots) < 0 or max(slots) > rows:
        raise ConfigError(f"the {name} conditioning's image slots {list(slots)} do not fit its {rows}-row prompt and "
                          f"{len(c.references)} reference latent(s); encode the prompt and its images with one "
                          f"TextEncodeQwenImage21 node.")


def validate_references(name: str, c, config) -> None:
    """ReferenceLatent inputs: only families that read them, in this model's latent shape, placed by a known
    method."""
    validate_reference_slots(name, c, config)
    if not c.references:
        return
    if getattr(config, "reference_refusal", None):
        raise ConfigError(f"the {name} conditioning carries a reference latent, but {config.reference_refusal}.")
    if not getattr(config, "reads_references", False):
        raise ConfigError(f"the {name} conditioning carries reference latents (ReferenceLatent), which this "
                          f"{config.family} model does not read; remove the ReferenceLatent node or load a "
                          f"Flux Kontext model.")
    own = getattr(config, "reference_problem", None)
    if own is not None:  # a family that places its own conditioning rows (MiniMax-H3's keyframes and references)
        problem = own(name, c.references, c.reference_method)
        if problem is not None:
            raise ConfigError(problem)
        for k, ref in enumerate(c.references):
            _finite_tensor(f"conditioning latent {k + 1} of the {name} conditioning", ref,
                           "re-encode the image with VAE Encode")
        return
    if c.reference_method not in (None, *REFERENCE_METHODS):
        raise ConfigError(f"reference latent method {c.reference_method!r} is unknown; choose one of "
                          f"{', '.join(REFERENCE_METHODS)} in FluxKontextMultiReferenceLatentMethod.")
    channels = config.latent_channels
    for k, ref in enumerate(c.references):
        if ref.ndim != 4 or ref.shape[1] != channels or min(ref.shape[2:]) < 1:
            raise ConfigError(f"reference latent {k + 1} of the {name} conditioning has shape {tuple(ref.shape)}, "
                              f"not [batch, {channels}, height/8, width/8]; encode the reference image with this "
                              f"model's VAE (VAE Encode) before ReferenceLatent.")
        _finite_tensor(f"reference latent {k + 1} of the {name} conditioning", ref,
                       "re-encode the reference image with VAE Encode")


def validate_concat(name: str, c, config, latent: torch.Tensor, batch: int) -> None:
    """c_concat (Fill, Canny/Depth): exactly as many channels as the model reads beside the latent, at the
    latent's size; a model that reads such channels refuses a branch without them (ComfyUI always builds them)."""
    wanted = config.concat_channels
    if c.concat is None:
        if wanted and not getattr(config, "concat_optional", False):
            raise ConfigError(f"this {config.title} model reads {wanted} image channels beside the latent, and the "
                              f"{name} conditioning carries none; feed it through {config.concat_nodes}.")
        return
    if not wanted:
        raise ConfigError(f"the {name} conditioning carries {c.concat.shape[1]} concat channels (an inpaint or "
                          f"control image), which this {config.title} model does not read; load a Fill, Canny or "
                          f"Depth model or remove the node that adds them.")
    shape = (wanted, *latent.shape[2:])
    if c.concat.ndim != latent.ndim or tuple(c.concat.shape[1:]) != shape or c.concat.shape[0] not in (1, batch):
        raise ConfigError(f"the {name} conditioning's concat image has shape {tuple(c.concat.shape)} but this model "
                          f"needs [batch, {', '.join(map(str, shape))}]; encode the image with this model's VAE at the "
                          f"latent's size.")
    _finite_tensor(f"{name} conditioning's concat image", c.concat, "re-encode the image with VAE Encode")


def validate_timestep(job: Job, config) -> None:
    """A model call's timestep: one per latent row, or for a video model one per row and frame (Wan 2.2's
    per-frame timesteps under a noise mask, as ComfyUI's WAN22.process_timestep makes them)."""
    t, lat = job.timestep, job.latent
    if t is None:
        return
    shapes = [(lat.shape[0],)] + ([(lat.shape[0], lat.shape[2])] if config.video else [])
    if getattr(config, "token_timesteps", False):  # LTX-2: a noise mask that varies within a frame, per token
        shapes.append((lat.shape[0], math.prod(lat.shape[2:])))
    if tuple(t.shape) not in shapes:
        raise ConfigError(f"the model call's timestep has shape {tuple(t.shape)}, not "
                          f"{' or '.join(map(str, shapes))} for a latent of shape {tuple(lat.shape)}; a node patches "
                          f"the model's timesteps in a way ParaDiT does not split: remove it or load the model with "
                          f"UNETLoader.")
    _finite_tensor("model call's timestep", t, "check the sampler's sigmas (a scheduler or ModelSampling node)")


def validate_clip_vision(name: str, c, config, batch: int) -> None:
    """CLIP-vision tokens (clip_fea, Wan 2.1 I2V): CLIP ViT-H's width, one set per prompt or per latent row. A model
    that reads none ignores them, as ComfyUI's does."""
    clip = c.clip_vision
    if clip is None:
        return
    width = config.clip_vision_width
    if width is None:
        return
    if clip.ndim != 3 or clip.shape[-1] != width or clip.shape[0] not in (1, batch):
        model = getattr(config, "clip_vision_model", "clip_vision_h (CLIP ViT-H)")
        raise ConfigError(f"the {name} conditioning's CLIP vision output has shape {tuple(clip.shape)} but this "
                          f"{config.title} model reads [batch, tokens, {width}]; load {model} with CLIPVisionLoader "
                          f"for CLIPVisionEncode.")
    _finite_tensor(f"{name} conditioning's CLIP vision output", clip, "re-run CLIPVisionEncode on a valid image")


def validate_camera(name: str, c, config, latent: torch.Tensor, batch: int) -> None:
    """A camera embedding (camera_conditions, WanCameraEmbedding): only a model with a camera adapter reads one, of its
    channels, the latent's frames and 8x its height and width (the adapter unshuffles 8x8 pixels into each latent
    pixel), one per prompt or per latent row. A camera model without one runs without its adapter, as ComfyUI's."""
    camera = c.camera
    if camera is None:
        return
    channels = getattr(config, "camera_channels", 0)
    if not channels:
        raise ConfigError(f"the {name} conditioning carries a camera embedding (WanCameraEmbedding), which this "
                          f"{config.title} model does not read; load a Wan Fun camera model or disconnect "
                          f"camera_conditions from WanCameraImageToVideo.")
    t, h, w = latent.shape[2:] if latent.ndim == 5 else (None, None, None)
    shape = (channels, t, 8 * h, 8 * w) if t is not None else None
    if shape is None or camera.ndim != 5 or tuple(camera.shape[1:]) != shape or camera.shape[0] not in (1, batch):
        raise ConfigError(f"the {name} conditioning's camera embedding has shape {tuple(camera.shape)} but this "
                          f"{config.title} model reads [batch, {channels}, latent frames, 8 x latent height, 8 x "
                          f"latent width] = [batch, {', '.join(map(str, shape or ()))}]; set WanCameraEmbedding's "
                          f"width, height and length to those of WanCameraImageToVideo.")
    _finite_tensor(f"{name} conditioning's camera embedding", camera, "re-run WanCameraEmbedding")


def validate_animate(name: str, c, config, latent: torch.Tensor, batch: int) -> None:
    """Wan Animate's pose latent and face video (WanAnimateToVideo): only an Animate model reads them; the pose is
    the video's latent size (its frames may be fewer: a frame j joins the video's frame j + 1), the face video
    512 x 512 pixels of 3 channels; each one per prompt or per latent row. An Animate model without them runs
    without its pose embedding or face blocks, as ComfyUI's."""
    if c.pose is None and c.face is None:
        return
    if not getattr(config, "animate", False):
        raise ConfigError(f"the {name} conditioning carries Wan Animate's pose or face video (WanAnimateToVideo), which "
                          f"this {config.title} model does not read; load a Wan 2.2 Animate model or replace "
                          f"WanAnimateToVideo with WanImageToVideo.")
    size = tuple(latent.shape[3:]) if latent.ndim == 5 else ()
    pose = c.pose
    if pose is not None and (pose.ndim != 5 or pose.shape[1] != config.out_channels or pose.shape[2] < 1
                             or tuple(pose.shape[3:]) != size or pose.shape[0] not in (1, batch)):
        raise ConfigError(f"the {name} conditioning's pose latent has shape {tuple(pose.shape)}, not [batch, "
                          f"{config.out_channels}, frames, {', '.join(map(str, size))}] like the video's latent; give "
                          f"WanAnimateToVideo's pose_video the video's width and height and this model's VAE.")
    face = c.face
    if face is not None and (face.ndim != 5 or tuple(face.shape[1:2]) + tuple(face.shape[3:]) != (3, 512, 512)
                             or face.shape[2] < 1 or face.shape[0] not in (1, batch)):
        raise ConfigError(f"the {name} conditioning's face video has shape {tuple(face.shape)}, not [batch, 3, frames, "
                          f"512, 512] as WanAnimateToVideo makes it; connect face_video to WanAnimateToVideo.")
    _finite_tensor(f"{name} conditioning's pose latent", pose, "re-encode the pose video with the Wan VAE")
    _finite_tensor(f"{name} conditioning's face video", face, "load the face video again")


def validate_vace(name: str, c, config, latent: torch.Tensor, batch: int) -> None:
    """A VACE context (vace_context, WanVaceToVideo): a VACE model reads one, [batch, inputs, its channels, the
    latent's frames, height and width], with one strength per input; any other model reads none."""
    layers, vace = getattr(config, "vace_layers", 0), c.vace
    if vace is None and not layers:
        return
    if vace is None:
        raise ConfigError(f"this {config.title} model reads a VACE context; feed the {name} conditioning through "
                          f"WanVaceToVideo.")
    if not layers:
        raise ConfigError(f"the {name} conditioning carries a VACE context (WanVaceToVideo), which this "
                          f"{config.title} model does not read; load a Wan VACE model or remove WanVaceToVideo.")
    shape = (config.vace_channels, *latent.shape[2:])
    if vace.ndim != 6 or tuple(vace.shape[2:]) != shape or vace.shape[0] not in (1, batch):
        raise ConfigError(f"the {name} conditioning's VACE context has shape {tuple(vace.shape)} but this "
                          f"{config.title} model reads [batch, inputs, {', '.join(map(str, shape))}]; give "
                          f"WanVaceToVideo the width, height and length of the latent it samples.")
    if len(c.vace_strength) != vace.shape[1] or not all(math.isfinite(v) for v in c.vace_strength):
        raise ConfigError(f"the {name} conditioning has {vace.shape[1]} VACE inputs but strengths "
                          f"{list(c.vace_strength)}; set each WanVaceToVideo's strength to a finite number.")
    _finite_tensor(f"{name} conditioning's VACE context", vace, "re-run WanVaceToVideo on valid frames")


def validate_glyph(name: str, c, config, batch: int) -> None:
    """Glyph tokens (txt_byt5, ByT5 small) of a model that reads them: their width, one set per prompt or latent
    row. A model that reads none ignores them, as ComfyUI's does."""
    width = getattr(config, "glyph_width", None)
    if c.glyph is None or width is None:
        return
    if c.glyph.ndim != 3 or c.glyph.shape[-1] != width or c.glyph.shape[0] not in (1, batch):
        raise ConfigError(f"the {name} conditioning's glyph tokens have shape {tuple(c.glyph.shape)} but this "
                          f"{config.title} model reads [batch, tokens, {width}] (ByT5 small); encode the prompt with "
                          f"this model's text encoders.")
    _finite_tensor(f"{name} conditioning's glyph tokens", c.glyph, "re-encode the prompt")


def validate_llama(name: str, c, config, batch: int) -> None:
    """Llama 3.1's hidden layers over the prompt (conditioning_llama3) of a model that reads them (HiDream): enough
    layers for every block, its width, one set per prompt or latent row. A model that reads none ignores them, as
    ComfyUI's does."""
    width = getattr(config, "llama_dim", None)
    if width is None:
        return
    if c.llama is None:
        raise ConfigError(f"the {name} conditioning carries no Llama 3.1 layers, which every {config.title} block "
                          f"reads; encode the prompt with {config.text_encoders}.")
    layers = max(config.llama_layers) + 1
    if (c.llama.ndim != 4 or c.llama.shape[1] < layers or c.llama.shape[-1] != width
            or c.llama.shape[0] not in (1, batch)):
        raise ConfigError(f"the {name} conditioning's Llama layers have shape {tuple(c.llama.shape)} but this "
                          f"{config.title} model reads [batch, {layers} layers, tokens, {width}]; encode the prompt "
                          f"with {config.text_encoders}.")
    _finite_tensor(f"{name} conditioning's Llama layers", c.llama, "re-encode the prompt")


@lru_cache(maxsize=16)
def _controlnet_config(family, path: str, mtime_ns: int, size: int):
    """A ControlNet's config from its header, once per file version (a model call names it every step)."""
    from .weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        return family.controlnet_config(reader)


def validate_control(name: str, c, config, job: Job) -> None:
    """A branch's ControlNet chain: a family whose blocks take residuals, a stock sampler's call (Parallel
    Sampler's node refuses ControlNet before this), a ControlNet file of the model's family and width."""
    if not c.control:
        return
    from .models.registry import family_of

    family = family_of(config)
    title = getattr(config, "title", family.title)
    if family.load_controlnet is None:
        from .models.registry import families

        *others, last = [f.title for f in families() if f.load_controlnet is not None]
        runs = f"{', '.join(others)} and {last}" if others else last
        raise ConfigError(f"ControlNets for {title} do not run on the ParaDiT workers yet, only those for {runs}; "
                          f"remove the ControlNet node or load the model with UNETLoader.")
    if job.timestep is None:
        raise ConfigError("ControlNet runs under KSampler (or SamplerCustomAdvanced) with the parallel MODEL; "
                          "sample with KSampler instead of Parallel Sampler.")
    for control in c.control:
        if not math.isfinite(control.strength):
            raise ConfigError(f"a ControlNet of the {name} conditioning has strength {control.strength}; set a "
                              f"finite strength on its apply node.")
        try:
            st = os.stat(control.path)
            net = _controlnet_config(family, control.path, st.st_mtime_ns, st.st_size)
        except (OSError, ValueError) as exc:
            raise ModelFileError(f"the ControlNet file {control.path} cannot be read ({exc}); load the ControlNet "
                                 f"again.") from None
        if net.hidden_size != config.hidden_size or net.axes_dims_rope != getattr(config, "axes_dims_rope", None):
            raise ConfigError(f"the ControlNet is {net.hidden_size} wide but this {title} model is "
                              f"{config.hidden_size}; load a ControlNet made for this model.")
        _validate_union_types(control, net, job)


def _validate_union_types(control, net, job: Job) -> None:
    """SetUnionControlNetType's types: known to the union ControlNet (a model without types ignores them, as in
    ComfyUI), and not under PipeFusion, whose stale K/V buffers follow the DiT's prompt length."""
    if not control.types or not net.union_modes:
        return
    if any(not 0 <= t < net.union_modes for t in control.types):
        raise ConfigError(f"the union ControlNet knows {net.union_modes} control types but is given type(s) "
                          f"{list(control.types)}; pick a type this ControlNet was trained with in "
                          f"SetUnionControlNetType.")
    if job.strategy.pipefusion_degree > 1:
        raise ConfigError("a union ControlNet with a type (SetUnionControlNetType) runs under Ulysses, Ring and CFG "
                          "parallel but not PipeFusion; pick one of those in the Strategy Selector or remove the "
                          "type node.")


def validate_attention_mask(name: str, c, config, job: Job) -> None:
    """ComfyUI's attention_mask: a family whose model adds it, a bias over exactly this call's [text, image]
    rows, no NaN (-inf is a bias: StyleModelApply's strength 0 masks those keys out)."""
    mask = c.attention_mask
    if mask is None:
        return
    from .models.registry import family_of

    family = family_of(config)
    title = getattr(config, "title", family.title)
    if not family.attention_mask:
        from .models.registry import families

        readers = " and ".join(f.title for f in families() if f.attention_mask)
        raise ConfigError(f"the {name} conditioning carries an attention mask, which ParaDiT applies for {readers} "
                          f"only, not for {title}; remove the node that sets one (StyleModelApply's attn_bias, a "
                          f"masked text encode) or load the model with UNETLoader.")
    if c.references:
        raise ConfigError(f"the {name} conditioning has both an attention mask and reference latents (Kontext), "
                          f"which ComfyUI's Flux model cannot run together either; remove ReferenceLatent or set "
                          f"StyleModelApply's strength_type to multiply.")
    p = family.adapter_class.patch
    length = c.cond.shape[1] + -(-job.latent.shape[2] // p) * -(-job.latent.shape[3] // p)
    if mask.ndim != 3 or tuple(mask.shape[1:]) != (length, length) or mask.shape[0] not in (1, job.batch):
        raise ConfigError(f"the {name} conditioning's attention mask has shape {tuple(mask.shape)} but this call "
                          f"needs [batch, {length}, {length}] (prompt tokens + image tokens); re-create it for "
                          f"this prompt and image size.")
    if mask.is_floating_point() and bool(torch.isnan(mask).any()):
        # ComfyUI samples such a mask into a NaN image; its usual source is a -inf bias (StyleModelApply's
        # attn_bias at strength 0) that extra_conds' bilinear resize to the latent's tokens turns into NaN.
        raise ConfigError(f"the {name} conditioning's attention mask holds NaN values (StyleModelApply's attn_bias "
                          f"strength 0 gives -inf biases that ComfyUI's resize of the mask turns into NaN, which "
                          f"would sample a NaN image); set that strength above 0.")


def refuse_jobs_of(config, path: str) -> None:
    """One sentence for a model whose family runs on the seam but whose inputs no door carries yet
    (`config.jobs_refused`: what it is and what to do), before any work."""
    refused = getattr(config, "jobs_refused", None)
    if refused:
        raise ConfigError(f"{os.path.basename(path)} is {refused}.")


def is_av_family(config) -> bool:
    """Whether the family denoises an audio latent beside the video's (LTX-2, MiniMax-H3)."""
    return getattr(config, "model_call_problem", None) is not None or bool(getattr(config, "audio_channels", 0))


def av_sampling_problem(config, strategy) -> str | None:
    """What of a Parallel Sampler job's strategy the audio-video loop (strategies/av_sampling.py: both latents
    stepped together, each step one model call) cannot run, in one sentence, or None: the strategies that split such
    a call, whole batches, no step cache (auto's candidates skip the same: planning/auto.py)."""
    title = config.title
    # LTX-2's two-stream call says what it runs; MiniMax-H3's packed call runs every strategy of the model call.
    problem = getattr(config, "strategy_problem", None)
    if problem is not None and problem(strategy, "Parallel Sampler"):
        return problem(strategy, "Parallel Sampler") + "."
    if strategy.batch_degree > 1:
        return (f"batch parallelism does not cut {title}'s audio latent yet; set batch_degree to 1 and split the job "
                f"with cfg_degree, ulysses_degree or ring_degree.")
    if strategy.cache != "off":
        return (f"the step cache does not run on {title}'s audio-video steps yet; set the Strategy Selector's cache "
                f"to off.")
    return None


def validate_audio(job: Job, config) -> None:
    """An audio-video family's job carries its audio latent (Job.audio) beside the video's: a model call's x, or
    Parallel Sampler's latent (av_sampling_problem); any other family's job carries none."""
    if is_av_family(config) and job.audio is not None and job.timestep is None:
        problem = av_sampling_problem(config, job.strategy)
        if problem:
            raise ConfigError(problem)
        videos = job.latent.shape[0]
        if getattr(config, "single_video", False) and videos != 1:
            raise ConfigError(f"the latent holds {videos} videos but {config.title} runs one video per prompt, as "
                              f"ComfyUI's model does; set the empty latent's batch size to 1.")
    call_problem = getattr(config, "model_call_problem", None)  # LTX-2: its own audio latent layout and limits
    if call_problem is not None and job.audio is not None:
        problem = call_problem(job)
        if problem:
            raise ConfigError(problem + ".")
        return
    channels = getattr(config, "audio_channels", 0)
    if not channels:
        if job.audio is not None:
            raise ConfigError(f"the job carries an audio latent, but this {config.title} model reads none; send the "
                              f"video latent alone.")
        return
    if job.audio is None:
        refuse_jobs_of(config, job.model.path)
    if job.strategy.batch_degree > 1:
        raise ConfigError(f"batch parallelism does not cut {config.title}'s audio latent yet; set batch_degree to 1 "
                          f"and split the call with cfg_degree, ulysses_degree or ring_degree.")
    audio, rows = job.audio, job.latent.shape[0]
    if audio.ndim != 4 or tuple(audio.shape[:3]) != (rows, channels, 2) or audio.shape[-1] < 1:
        raise ConfigError(f"the audio latent has shape {tuple(audio.shape)} but this {config.title} model needs "
                          f"[{rows}, {channels}, 2, frames] beside its video latent; use the audio half of "
                          f"EmptyMiniMaxH3LatentAV's latent.")


def validate_latent_and_branches(job: Job, config) -> None:
    """The latent's shape for this family, the timestep, and each conditioning branch against the model."""
    lat = job.latent
    channels = config.latent_channels
    video = config.video
    if lat.ndim != (5 if video else 4) or lat.shape[1] != channels:
        if video:
            raise ConfigError(f"the latent has shape {tuple(lat.shape)} but this {config.title} model needs a video "
                              f"latent [batch, {channels}, frames, height/8, width/8]; use EmptyHunyuanLatentVideo "
                              f"(Wan's empty latent) or VAE Encode with the Wan VAE.")
        empty = "EmptySD3LatentImage" if channels == 16 else "Empty Latent Image"
        raise ConfigError(f"the latent has shape {tuple(lat.shape)} but this {config.family} model needs "
                          f"[batch, {channels}, height/8, width/8]; use {empty} or VAE Encode with this model's VAE.")
    if video and (lat.shape[-1] % 2 or lat.shape[-2] % 2):
        raise ConfigError(f"the video latent is {lat.shape[-1] * 8}x{lat.shape[-2] * 8} px, not a multiple of the "
                          f"model's 2x2 patch; use a width and height that are multiples of 16 pixels.")
    problem = getattr(config, "latent_problem", None)  # a family's own rule on the latent's size (HiDream O1's 32 px)
    if problem is not None and (sentence := problem(tuple(lat.shape))):
        raise ConfigError(f"{sentence}.")
    validate_timestep(job, config)
    if job.audio_reference is not None and (job.timestep is None or not hasattr(config, "guides_problem")):
        raise ConfigError(f"the job carries reference audio (LTXVReferenceAudio's), which {config.title} does not "
                          f"read in this way; remove the node, or sample an LTX-2 model with KSampler on Load "
                          f"Parallel DiT's MODEL.")
    if job.video_guides is not None and not hasattr(config, "guides_problem"):
        raise ConfigError(f"the job carries guide frames (LTXVAddGuide's), which {config.title} does not read; remove "
                          f"the guide node.")
    if job.video_guides is not None and job.timestep is None:
        raise ConfigError("guide frames ride in a model call only, not in the workers' own step loop; sample with "
                          "KSampler (or Parallel Sampler, which hands such a graph to it) on Load Parallel DiT's "
                          "MODEL.")
    for name, c in (("positive", job.positive), ("negative", job.negative)):
        if c is None:
            continue
        if c.cond.ndim != 3 or c.cond.shape[-1] != config.context_dim:
            raise ConfigError(f"the {name} conditioning has width {c.cond.shape[-1]} but this model expects "
                              f"{config.context_dim}; encode the prompt with {config.text_encoders}.")
        prompt_problem = getattr(config, "prompt_problem", None)  # a family's own prompt rule (HiDream O1's ids)
        if prompt_problem is not None and (sentence := prompt_problem(name, c.cond)):
            raise ConfigError(f"{sentence}.")
        if config.pooled_dim and (c.pooled is None or c.pooled.shape[-1] != config.pooled_dim):
            raise ConfigError(f"the {name} conditioning lacks a {config.pooled_dim}-wide pooled CLIP vector; "
                              f"encode the prompt with {config.text_encoders}.")
        if c.cond.shape[0] not in (1, job.batch):
            raise ConfigError(f"the {name} conditioning has batch {c.cond.shape[0]} but the latent has batch "
                              f"{job.batch}; use one prompt or match the batch sizes.")
        validate_references(name, c, config)
        vision_problem = getattr(config, "vision_problem", None)  # HiDream O1's reference images' vision-tower path
        if c.vision is not None and vision_problem is None:
            raise ConfigError(f"the {name} conditioning carries reference images for a vision tower, which this "
                              f"{config.family} model does not have; remove HiDreamO1ReferenceImages.")
        if vision_problem is not None and (sentence := vision_problem(name, c)):
            raise ConfigError(f"{sentence}.")
        problem = c.references and getattr(config, "reference_latent_problem", None)
        if problem and (sentence := problem(c.references, tuple(lat.shape), job.timestep, c.reference_method)):
            raise ConfigError(f"{sentence}.")
        validate_concat(name, c, config, lat, job.batch)
        validate_clip_vision(name, c, config, job.batch)
        validate_glyph(name, c, config, job.batch)
        validate_llama(name, c, config, job.batch)
        validate_camera(name, c, config, lat, job.batch)
        validate_animate(name, c, config, lat, job.batch)
        validate_vace(name, c, config, lat, job.batch)
        validate_control(name, c, config, job)
        validate_attention_mask(name, c, config, job)
        if c.image_size is not None and (len(c.image_size) != 3 or
                                         not all(math.isfinite(v) and v > 0 for v in c.image_size)):
            raise ConfigError(f"the {name} conditioning's image size {tuple(c.image_size)} is not (height, width, "
                              f"aspect ratio) with positive values; set a positive width and height on its text "
                              f"encode node.")
        if c.pooled.shape[0] != c.cond.shape[0]:
            raise ConfigError(f"the {name} conditioning has {c.cond.shape[0]} prompt(s) but {c.pooled.shape[0]} pooled "
                              f"vector(s); encode it with one text-encode node so the two match.")


def validate_job(job: Job, world_size: int) -> None:
    from .weights.comfy_quant import check_quantized_matmul

    sp = job.sampling
    validate_numbers(job)
    check_quantized_matmul(job.model.quantized_matmul)
    if sp.sampler_name not in SAMPLERS:
        raise ConfigError(f"sampler {sp.sampler_name!r} is not supported by the parallel sampler; "
                          f"choose one of {', '.join(SAMPLERS)}.")
    if sp.scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler {sp.scheduler!r} is not supported; choose one of {', '.join(SCHEDULERS)}.")
    if not 0.0 <= sp.denoise <= 1.0:
        raise ConfigError(f"denoise={sp.denoise} is outside 0..1; set it between 0 and 1.")
    config = model_config(job.model.path)
    dtype_refusal = getattr(config, "refused_weight_dtypes", {}).get(job.model.weight_dtype)  # HiDream O1's fp16
    if dtype_refusal:
        raise ConfigError(f"{dtype_refusal}.")
    refusal = getattr(config, "not_sampled_yet", None)  # LTX-2: a job without its audio latent
    if refusal and job.audio is None:
        raise ConfigError(refusal)
    validate_audio(job, config)
    validate_latent_and_branches(job, config)
    lat = job.latent
    side = getattr(config, "max_latent_size", None)  # families with a stored position table (SD3)
    if side is not None and max(lat.shape[2:]) > side:
        raise ConfigError(f"the latent is {lat.shape[3] * 8}x{lat.shape[2] * 8} px but this model's position table "
                          f"covers at most {side * 8} px a side; generate a smaller image.")
    mean_side = getattr(config, "min_mean_latent_side", None)  # PixArt: positions scale to the image's size
    if mean_side is not None and (lat.shape[-2] + lat.shape[-1]) // 2 < mean_side:
        raise ConfigError(f"the latent is {lat.shape[-1] * 8}x{lat.shape[-2] * 8} px but {config.title} has no "
                          f"positions below an average side of {mean_side * 8} px; generate a larger image.")
    from .models.registry import family_of

    validate_branches(job)
    validate_rope_options(job, config)
    if job.weight_patches is not None:
        from .weights.patches import validate_weight_patches

        family = family_of(config)
        validate_weight_patches(job.weight_patches, family.weight_patch_targets(config),
                                f"this {getattr(config, 'title', family.title)} file")
    validate_strategy(job.strategy, world_size=world_size, heads=config.num_heads,
                      num_blocks=config.num_blocks, latent_hw=latent_plane(lat.shape[2:]),
                      cfg_scale=sp.cfg if job.timestep is None else None, steps=sp.steps,
                      patch=token_patch(config), mlp_hidden=getattr(config, "mlp_hidden", None), batch=job.batch)
    tensor_problem = getattr(config, "tensor_problem", None)  # a family's own limit (HiDream O1's kv heads)
    if job.strategy.tensor_degree > 1 and tensor_problem is not None and (sentence := tensor_problem(
            job.strategy.tensor_degree)):
        raise ConfigError(f"{sentence}.")
    if job.strategy.tensor_degree > 1 and not family_of(config).tensor_plan_for(config):
        raise ConfigError(f"{getattr(config, 'title', family_of(config).title)} does not split its layers for tensor "
                          f"parallelism yet; set tensor_degree=1 and split it with ulysses_degree or ring_degree.")
