"""The demo's picture: each strategy's image side by side, its difference from serial (x10) under it."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

DIFF_GAIN = 10  # |image - serial| x 10: a 1% (2.5 / 255) difference shows as 25 / 255
MARGIN = 8


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)  # a scalable font on Pillow >= 10.1 with FreeType
    except TypeError:
        return ImageFont.load_default()


def _to_pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray((image.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


def contact_sheet(images: list[torch.Tensor], titles: list[str], notes: list[str], reference: torch.Tensor,
                  caption: str) -> Image.Image:
    """`images` [3, H, W] in [0, 1], one column each: title, image, x10 difference from `reference`, note."""
    _, h, w = reference.shape
    size = max(12, w // 24)
    font, small = _font(size), _font(max(10, size * 3 // 4))
    line = size + MARGIN
    top = line * 2
    sheet = Image.new("RGB", (len(images) * (w + MARGIN) + MARGIN, top + 2 * (h + MARGIN) + line * 2), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((MARGIN, MARGIN // 2), caption, fill="black", font=small)
    for i, (image, title, note) in enumerate(zip(images, titles, notes)):
        x = MARGIN + i * (w + MARGIN)
        draw.text((x, line), title, fill="black", font=font)
        sheet.paste(_to_pil(image), (x, top))
        sheet.paste(_to_pil((image - reference).abs() * DIFF_GAIN), (x, top + h + MARGIN))
        draw.text((x, top + 2 * (h + MARGIN)), note, fill="black", font=small)
    draw.text((MARGIN, top + 2 * (h + MARGIN) + line), f"row 2: |image - serial| x {DIFF_GAIN} (black = identical)",
              fill="black", font=small)
    return sheet
