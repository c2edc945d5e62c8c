"""Parallel VAE Decode: ComfyUI's VAEDecode split over several devices, by bands of latent rows.

It runs in ComfyUI's process, one Python thread per band, each on its own device, all running ComfyUI's own decoder
module (`vae.first_stage_model`): ComfyUI's loaded copy for the first band on the VAE's device, a replica for every
other band (weights shared where the device is the same, copied onto other devices). The decoder's row-reaching
modules trade convolution halo rows, GroupNorm statistics and attention keys/values between bands
(parallel_runtime/vae), so the image equals VAEDecode's up to float round-off: the Flux / SD3 16-channel VAE,
PixArt's (SD's) 4-channel one, and the Wan 2.1 (Qwen-Image) and Wan 2.2 causal video VAEs, frame by frame with
their time caches. A VAE with some other module that reaches across rows is decoded by ComfyUI's own tiled decode,
one band per device with context rows, and the status says so (not exact).

Device memory: each device holds its band's activations (about 1/N of VAEDecode's) and one copy of the decoder's
weights — ComfyUI's own copy on the VAE's device, a cached replica (decoder only, no encoder) on each other device,
kept with the VAE object and released with it. The DiT's workers keep their weights; only when a CUDA device has
too little free memory for its band are the workers' weights released first (the next sample reloads them), and
the status says so. Never two copies of one model by surprise.
"""
from __future__ import annotations

import copy
import time
import weakref

from comfy_api.latest import io, ui

from . import convert

# VAE object -> {band slot ('cuda:1', 'cpu#1'): decoder replica}; a replica lives as long as its VAE.
_REPLICAS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# ComfyUI's tiled decode (the fallback): tiles and context rows in latent units, as its own out-of-memory retry.
TILE_2D, OVERLAP_2D, TILE_3D_PIXELS = 64, 16, 256


class ParaDiTVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParaDiTVAEDecode",
            display_name="Parallel VAE Decode",
            category=convert.CATEGORY,
            description="VAE Decode split over several devices by bands of rows; the same image as VAE Decode. "
                        "Each device decodes its band with ComfyUI's own VAE and about 1/N of the memory.",
            inputs=[io.Latent.Input("samples", tooltip="The latent to decode."),
                    io.Vae.Input("vae", tooltip="The VAE to decode with."),
                    io.String.Input("devices", default="", optional=True,
                                    tooltip="Devices of this machine for the bands, e.g. 0,1 (GPUs) or cpu:2. Empty: "
                                            "the running Parallel DiT's devices here, else every GPU, else two CPU "
                                            "bands.")],
            outputs=[io.Image.Output(tooltip="The decoded image(s), as VAE Decode gives them."),
                     io.String.Output(display_name="status", tooltip="Bands, devices, exact split or tiled.")],
        )

    @classmethod
    def execute(cls, samples, vae, devices="") -> io.NodeOutput:
        images, status = decode(vae, samples["samples"], devices)
        return io.NodeOutput(images, status, ui=ui.PreviewText(status))


def decode(vae, latent, devices: str = ""):
    """(IMAGE [N, H, W, 3] as VAEDecode gives it, status line). ComfyUI's VAE.decode around the model call: the
    latent in `vae.vae_dtype`, the output to `vae.output_device` in float32, `process_output`, channels last, a
    video's frames as images."""
    import comfy.model_management as mm
    import torch

    from parallel_runtime.vae.bands import band_count, band_rows, describe
    from parallel_runtime.vae.split_modules import install, plan_split

    vae.throw_exception_if_invalid()
    started = time.monotonic()
    if latent.ndim not in (4, 5):
        return _own_decode(vae, latent), f"ComfyUI's own decode: a {latent.ndim - 2}-D latent has no rows to split"
    wanted = band_devices(devices)
    n = band_count(latent.shape[-2], len(wanted))
    used = wanted[:n]
    memory = vae.memory_used_decode(latent.shape, vae.vae_dtype)
    mm.load_models_gpu([vae.patcher], memory_required=memory / n, force_full_load=vae.disable_offload)
    if n == 1:
        why = f"{latent.shape[-2]} latent rows are too few to split" if len(wanted) > 1 else "one device"
        return _own_decode(vae, latent), f"ComfyUI's own decode on one device ({why})"
    notes = _make_room(vae, used, memory / n)
    plan = plan_split(vae.first_stage_model)
    if plan.exact:
        install(plan)
    replicas = _replicas(vae, used)
    layout = band_rows(latent.shape[-2], n)
    chunks = []
    for batch in latent.split(_batch_size(vae, used, memory / (n * latent.shape[0])), dim=0):
        if plan.exact:
            pixels = _run(vae, batch, replicas, lambda m, z: m.decode(z))
            chunks.append(vae.process_output(pixels))
        else:
            chunks.append(_run(vae, batch, replicas, _tiled_decode(vae), context=_context_rows(vae, latent)))
    images = _images(torch.cat(chunks))
    how = "exact split" if plan.exact else f"ComfyUI's tiled decode per band, NOT exact ({plan.refusals[0]})"
    status = (f"{how}: {n} bands ({describe(layout)}) on {', '.join(map(str, used))}, "
              f"{time.monotonic() - started:.1f} s")
    return images, "; ".join([status, *notes])


def band_devices(spec: str) -> list:
    """The devices of the bands: `spec` as Load Parallel DiT takes it, else the running runtime's devices, else
    every GPU, else two CPU bands."""
    import torch

    from parallel_runtime.runtime.client import active_clients
    from parallel_runtime.runtime.cluster import names_remote
    from parallel_runtime.distributed.devices import parse_devices

    spec = (spec or "").strip()
    if spec and names_remote(spec):
        raise convert.ConfigError(f"devices {spec!r} names other machines, but Parallel VAE Decode runs in this "
                                  f"ComfyUI process, on this machine's devices; name only those (e.g. 0,1 or cpu:2), "
                                  f"or leave devices empty.")
    if spec:
        names = parse_devices(spec)
    else:  # the running runtime's ranks on this machine (another machine's cuda:0 is not ours)
        running = [convert.client_devices_here(c) for c in active_clients()]
        names = running[0] if running and running[0] else parse_devices("auto")
        if names == ["cpu"]:
            names = ["cpu", "cpu"]
    return [torch.device(name) for name in names]


def _run(vae, batch, replicas, band_decode, context: int = 0):
    import torch

    from parallel_runtime.vae.decode import run_bands

    return run_bands(batch.to(vae.vae_dtype), replicas, band_decode, out_device=vae.output_device,
                     out_dtype=torch.float32, context_rows=context)


def _replicas(vae, devices) -> list:
    """(decoder, device) per band: ComfyUI's loaded copy for the first band on the VAE's own device, cached replicas
    for the others (rebuilt when the copy they came from moved)."""
    from parallel_runtime.vae.decode import on_device, replica_for

    source = vae.first_stage_model
    cache = _REPLICAS.setdefault(vae, {})
    out, seen = [], {}
    for device in devices:
        slot = str(device) + (f"#{seen[str(device)]}" if str(device) in seen else "")
        seen[str(device)] = seen.get(str(device), 0) + 1
        if slot == str(device) and on_device(source, device):
            out.append((source, device))
            continue
        replica = cache.get(slot)
        if replica is None or not on_device(replica, device):
            replica = cache[slot] = replica_for(source, device)
        out.append((replica, device))
    return out


def _make_room(vae, devices, band_bytes: float) -> list[str]:
    """Free memory on each CUDA band device: ComfyUI's models first, then, if still short, the ParaDiT workers'
    weights. Returns notes for the status."""
    import comfy.model_management as mm
    import torch

    from parallel_runtime.runtime.client import active_clients
    from parallel_runtime.vae.decode import same_device

    notes = []
    weights = sum(p.numel() * p.element_size() for name, p in vae.first_stage_model.named_parameters()
                  if not name.startswith("encoder."))
    for device in devices:
        if device.type != "cuda":
            continue
        need = band_bytes + (0 if same_device(device, vae.device) else weights)
        mm.free_memory(need, device)
        if torch.cuda.mem_get_info(device)[0] >= need:
            continue
        for client in active_clients():
            if str(device) in convert.client_devices_here(client) and client.resident_models:
                client.release()
                notes.append(f"released the DiT workers' weights to make room on {device} (the next sample "
                             f"reloads them)")
    return notes


def _batch_size(vae, devices, per_item_bytes: float) -> int:
    """Latents per decode, as VAE.decode picks them: what the tightest device's free memory holds."""
    import comfy.model_management as mm

    free = min(mm.get_free_memory(d) for d in devices)
    return max(1, int(free / max(1.0, per_item_bytes)))


def _tiled_decode(vae):
    """The fallback's band decode: ComfyUI's own tiled decode of the band's rows (with context) on the band's
    replica and device, already through process_output."""
    def band(model, z):
        from parallel_runtime.vae import exchange

        local = copy.copy(vae)  # ComfyUI's VAE object, pointed at this band's decoder and device
        local.first_stage_model, local.device = model, exchange.current().device
        if z.ndim == 4:
            return local.decode_tiled_(z, tile_x=TILE_2D, tile_y=TILE_2D, overlap=OVERLAP_2D)
        tile = TILE_3D_PIXELS // vae.spacial_compression_decode()
        return local.decode_tiled_3d(z, tile_x=tile, tile_y=tile, overlap=(1, tile // 4, tile // 4))

    return band


def _context_rows(vae, latent) -> int:
    return OVERLAP_2D if latent.ndim == 4 else TILE_3D_PIXELS // vae.spacial_compression_decode() // 4


def _own_decode(vae, latent):
    """VAEDecode itself: ComfyUI's VAE.decode (channels last already), a video's frames as images."""
    images = vae.decode(latent)
    return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images


def _images(pixels):
    """[B, C, (T,) H, W] -> channels last; a video's frames (or Wan's one-frame images) as a batch of images."""
    images = pixels.movedim(1, -1)
    return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images
