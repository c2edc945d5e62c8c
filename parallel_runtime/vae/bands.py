"""How a latent's rows are cut into bands, one per device.

Bands are horizontal strips of latent rows, near-equal (the first `rows % n` bands get one row more), top to bottom
in device order. Every operation of a splittable decoder keeps a band's rows its own: convolutions borrow halo rows,
upsampling multiplies rows by the same factor in every band. So a band's output rows are its latent rows times the
decoder's spatial factor, and the image is the bands' outputs stacked in order.
"""
from __future__ import annotations

# A band needs at least a convolution's halo (1 row for the 3x3 kernels of these decoders) at the latent's size;
# a few rows keep the halo's share of the work small. Latents shorter than this per device use fewer devices.
MIN_BAND_ROWS = 4


def band_count(rows: int, devices: int) -> int:
    """How many of `devices` get a band of a latent `rows` high (at least 1)."""
    return max(1, min(devices, rows // MIN_BAND_ROWS))


def band_rows(rows: int, bands: int) -> list[tuple[int, int]]:
    """[(start, stop)] latent rows of each band, near-equal, top to bottom."""
    if not 1 <= bands <= rows:
        raise ValueError(f"{bands} bands cannot split {rows} latent rows")
    base, extra = divmod(rows, bands)
    edges = [0]
    for k in range(bands):
        edges.append(edges[-1] + base + (k < extra))
    return list(zip(edges[:-1], edges[1:]))


def describe(layout: list[tuple[int, int]]) -> str:
    """'12+12 latent rows' for the status line."""
    return "+".join(str(stop - start) for start, stop in layout) + " latent rows"
