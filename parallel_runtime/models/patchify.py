"""Latents to tokens and back: non-overlapping patches, channel-major inside each patch (c, ph, pw: the order of
a patch conv's weights, what ComfyUI's process_img and Wan's patch embedding read), row-major over the grid,
frame after frame for video. One token per latent pixel where the VAE already compresses enough (`patch` 1:
FLUX.2, Qwen-Image 2.1, HunyuanVideo 1.5, LTX-2)."""
from __future__ import annotations

import torch


def patchify(latent: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)(W/p), C p p]; [B, C, T, H, W] -> [B, T (H/p)(W/p), C p p] (patches one frame deep)."""
    if patch == 1:
        return latent.flatten(2).transpose(1, 2)
    x = latent if latent.ndim == 5 else latent.unsqueeze(2)
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // patch, patch, w // patch, patch).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, t * (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: torch.Tensor, size: tuple[int, ...], patch: int = 2) -> torch.Tensor:
    """patchify's inverse: tokens -> [B, C, *size] for a latent of `size` (H, W) or (T, H, W) in latent pixels."""
    if patch == 1:
        return tokens.transpose(1, 2).unflatten(2, tuple(size))
    *frames, h, w = size
    t = frames[0] if frames else 1
    b, _, d = tokens.shape
    c = d // (patch * patch)
    x = tokens.reshape(b, t, h // patch, w // patch, c, patch, patch).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(b, c, *size)


class PatchTokens:
    """An adapter's `pack` / `unpack` from its `patch` (latent pixels per token side): `unpack(tokens, h, w)` for
    an image family, `unpack(tokens, t, h, w)` for a video one."""

    patch = 2

    @classmethod
    def pack(cls, latent: torch.Tensor) -> torch.Tensor:
        return patchify(latent, cls.patch)

    @classmethod
    def unpack(cls, tokens: torch.Tensor, *size: int) -> torch.Tensor:
        return unpatchify(tokens, size, cls.patch)


def rows_cached(cache: dict, index: torch.Tensor, make):
    """make()'s result for the token rows `index` (or any per-rows table: a rank's RoPE frames), made once per index
    tensor. The step loops build each rank's index once per job (per patch set under PipeFusion), so the tensor
    itself is the key: reading its values to key on them would be a device sync every forward on a GPU
    (test_gpu_readiness). The entry holds the index, so its id cannot be reused by another tensor while cached."""
    hit = cache.get(id(index))
    if hit is None or hit[0] is not index:
        hit = cache[id(index)] = (index, make())
    return hit[1]
