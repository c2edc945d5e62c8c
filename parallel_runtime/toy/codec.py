"""The toy model's "VAE": a fixed, lossy map between pixels and 16-channel latents at 1/8 of the size.

Flux latents are 16 channels at 1/8 of the image size; so are these. Each latent pixel holds the mean
colour of the 2x2 cells of 4x4 pixels under it (12 channels: RGB-major, the cells inside), centred and
scaled to about unit variance. The last 4 channels are the same in every image: where the latent pixel is
on the canvas (x and y from -1 to 1, and their cosines, which peak at the centre). The model has to draw
those too, which it learns early (like a background every image shares); once drawn, each token reads its
place from its own input instead of only through RoPE's angles to the text tokens, and that is what lets
a model trained in minutes put "top left" at the top left.

Decoding is bilinear upsampling of the quarter-size image (the position channels are not pixels): soft
edges, flat colours exact, no learnt decoder to ship. A smooth target is also what a model trained in
minutes can draw cleanly (a codec that kept edge detail in weak channels came back as speckle). The
LATENT the runtime returns is in ComfyUI's Flux space (the sampler's process_latent_out); the codec undoes
that before decoding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sampling import process_latent_in, process_latent_out

PATCH = 8  # pixels per latent pixel (Flux's VAE factor)
CELL = 4  # pixels per cell side: 2x2 cells per latent pixel
COLOUR_CHANNELS = 12
CHANNELS = 16
CENTER, SCALE = 0.5, 0.3  # pixel values are in [0, 1]; scenes' colours spread about 0.3 around mid-grey
POSITION_SCALE = 1.5  # x, y uniform in [-1, 1] have std 0.58: scaled to about the colour channels' spread


def position_channels(h: int, w: int) -> torch.Tensor:
    """[1, 4, h, w]: x and y (-1 to 1 across the canvas, at pixel centres), then each mapped through
    2 cos(pi t / 2) - 1 (1 at the centre, -1 at the edges), times POSITION_SCALE."""
    y = (torch.arange(h, dtype=torch.float32) + 0.5) / h * 2 - 1
    x = (torch.arange(w, dtype=torch.float32) + 0.5) / w * 2 - 1
    yy, xx = y[:, None].expand(h, w), x[None, :].expand(h, w)
    peak = lambda t: torch.cos(torch.pi * t / 2) * 2 - 1  # noqa: E731
    return torch.stack([xx, yy, peak(xx), peak(yy)])[None] * POSITION_SCALE


class ColourGrid:
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> the model-space latent [B, 16, H/8, W/8]."""
        b, _, h, w = images.shape
        cells = F.avg_pool2d(images.float(), CELL)  # [B, 3, H/4, W/4]
        latent = F.pixel_unshuffle((cells - CENTER) / SCALE, PATCH // CELL)  # [B, 12, H/8, W/8], RGB-major
        return torch.cat([latent, position_channels(h // PATCH, w // PATCH).to(latent).expand(b, -1, -1, -1)], dim=1)

    def decode(self, model_latent: torch.Tensor) -> torch.Tensor:
        """Model-space latent [B, 16, h, w] -> images [B, 3, 8h, 8w] clamped to [0, 1]."""
        cells = F.pixel_shuffle(model_latent[:, :COLOUR_CHANNELS].float(), PATCH // CELL) * SCALE + CENTER
        return F.interpolate(cells, scale_factor=CELL, mode="bilinear", align_corners=False).clamp(0, 1)

    def to_comfy_latent(self, model_latent: torch.Tensor) -> torch.Tensor:
        return process_latent_out(model_latent)

    def decode_comfy_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """A LATENT as the runtime returns it -> images [B, 3, H, W]."""
        return self.decode(process_latent_in(latent.float()))
