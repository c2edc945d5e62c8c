"""The VAE decode a user pays after the DiT, timed apart from it and never inside a speed-up.

A bench that timed the decode together with the denoise once read as a 'slow Ulysses': the decode runs in one
process whatever the DiT's strategy, so it adds the same seconds to the serial and the parallel run and pulls
every ratio towards 1. Here it is its own line and JSON entry: diffusers' AutoencoderKLWan at the Wan 2.1 VAE's
config (its defaults: full size, 127M parameters) with random weights, fp32 on CPU, decoding the bench's latent.
Decoding costs the same with random and trained weights (same convolutions on the same shapes).

The decoder runs once per latent frame with a causal cache (the first latent frame gives 1 video frame, each later
one 4), so on a small CPU it decodes the first few latent frames and extrapolates from their per-frame times.
"""
from __future__ import annotations

import statistics
import time

import torch

TEMPORAL = 4  # Wan 2.1's VAE: each latent frame after the first holds 4 video frames
# A 2-core CPU decodes one 320x320 latent frame in 25-60 s (more when the machine is shared), so the bench decodes
# the first frame (cheaper: 1 video frame) and one steady frame, and extrapolates to the rest.
CPU_LATENT_FRAMES = 2


def latent_frames(video_frames: int) -> int:
    if video_frames < 1 or (video_frames - 1) % TEMPORAL:
        raise SystemExit(f"--frames {video_frames}: Wan's VAE takes 4k + 1 video frames (e.g. 5, 33, 81)")
    return (video_frames - 1) // TEMPORAL + 1


def video_frames(latent_frames: int) -> int:
    return 1 + TEMPORAL * (latent_frames - 1) if latent_frames else 0


def time_decode(latent_shape: tuple, decode_frames: int | None = None, seed: int = 0) -> dict:
    """Decode the first `decode_frames` latent frames (all when None) of a random latent of `latent_shape`
    [B, 16, T, H, W] once and time it; the whole latent's decode is extrapolated as the first frame plus each
    later frame at the median of the decoded later frames (exact when every frame was decoded)."""
    from diffusers import AutoencoderKLWan

    total = latent_shape[2]
    k = total if decode_frames is None else max(1, min(decode_frames, total))
    torch.manual_seed(seed)
    vae = AutoencoderKLWan().eval()  # diffusers' defaults are the Wan 2.1 VAE's config
    frame_s: list[float] = []
    starts: list[float] = []
    hooks = (vae.decoder.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())),
             vae.decoder.register_forward_hook(lambda *_: frame_s.append(time.perf_counter() - starts[-1])))
    z = torch.randn(*latent_shape[:2], k, *latent_shape[3:], generator=torch.Generator().manual_seed(seed))
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = vae.decode(z).sample
            decoded_s = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    if len(frame_s) == k and k > 1:  # one decoder call per latent frame, as diffusers 0.3x-0.4x decode
        whole = decoded_s + (total - k) * statistics.median(frame_s[1:])
    else:  # another decode loop: scale the whole decode by frames
        whole = decoded_s * total / k
    return {"vae": "AutoencoderKLWan, Wan 2.1 VAE config, random weights",
            "parameters": sum(p.numel() for p in vae.parameters()), "dtype": "float32", "device": "cpu",
            "threads": torch.get_num_threads(), "latent_shape": list(latent_shape), "latent_frames": total,
            "decoded_latent_frames": k, "decoded_video_frames": int(out.shape[2]),
            "video_frames": video_frames(total), "frame_s": frame_s, "decoded_s": decoded_s,
            "whole_s": whole, "extrapolated": k < total, "in_dit_speedup": False}


def describe(rec: dict) -> str:
    """The report's line: what was decoded, in how long, and the whole latent's (measured or extrapolated)."""
    head = (f"VAE decode (NOT part of the DiT time or any speed-up above; {rec['vae']}, "
            f"{rec['parameters'] / 1e6:.0f}M parameters, fp32, CPU, {rec['threads']} thread(s)): ")
    if not rec["extrapolated"]:
        return head + (f"all {rec['latent_frames']} latent frames ({rec['video_frames']} video frames) in "
                       f"{rec['decoded_s']:.1f} s")
    frames = rec["frame_s"]
    split = (f" (first frame {frames[0]:.1f} s, later frames {statistics.median(frames[1:]):.1f} s each)"
             if len(frames) > 1 else "")
    return head + (f"first {rec['decoded_latent_frames']} of {rec['latent_frames']} latent frames "
                   f"({rec['decoded_video_frames']} of {rec['video_frames']} video frames) in {rec['decoded_s']:.1f} s"
                   f"{split} -> whole latent ~{rec['whole_s']:.0f} s extrapolated (a fraction decoded to keep the "
                   f"bench short on this CPU; --vae-frames N decodes more)")


def dilution(rec: dict, serial_job_s: float, row_job_s: float) -> float:
    """The speed-up a timing with the decode inside would report: the same decode seconds added to both jobs."""
    return (serial_job_s + rec["whole_s"]) / (row_job_s + rec["whole_s"])
