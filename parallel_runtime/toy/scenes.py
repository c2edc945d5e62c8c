"""The toy world: one coloured shape on a background, described by a few words, drawn procedurally.

A scene has five attributes, each named by one word of its own category (positions by one or two), so a
prompt is a bag of words with no ambiguity: "a large yellow circle at the top right on sky". Geometry is in
canvas units (fractions of the image side), so the same scene draws at any resolution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# A small world, so that a model trained in minutes on a CPU learns every word: 2 sizes, 7 colours, 4 shapes,
# 9 positions, 4 backgrounds (2,016 prompts). Colours are far apart and none is a background's colour.
SIZES = {"small": 0.13, "large": 0.22}  # shape radius, in image sides
COLOURS = {
    "red": (0.90, 0.12, 0.12), "orange": (1.00, 0.55, 0.05), "yellow": (1.00, 0.88, 0.10),
    "green": (0.15, 0.80, 0.20), "blue": (0.15, 0.30, 0.95), "purple": (0.60, 0.20, 0.80),
    "white": (0.97, 0.97, 0.97),
}
SHAPES = ("circle", "square", "triangle", "cross")
# Backgrounds are nouns, not colour words, so "blue" always means the shape: (top colour, bottom colour).
BACKGROUNDS = {
    "night": ((0.02, 0.02, 0.08), (0.10, 0.12, 0.30)), "sky": ((0.35, 0.60, 0.95), (0.75, 0.87, 1.00)),
    "sand": ((0.87, 0.78, 0.58), (0.78, 0.66, 0.44)), "grass": ((0.30, 0.55, 0.22), (0.12, 0.33, 0.10)),
}
# 3x3 grid of anchor positions; a position is written as its row word and/or column word.
ROWS = {"top": 0.25, None: 0.5, "bottom": 0.75}
COLUMNS = {"left": 0.25, None: 0.5, "right": 0.75}
CENTER = "center"
POSITION_WORDS = ("top", "bottom", "left", "right", CENTER)
STOPWORDS = frozenset({"a", "an", "the", "at", "on", "in", "of", "with", "and", "over", "against"})

ATTRIBUTES = ("size", "colour", "shape", "position", "background")
# Jitter the words do not fix. Zero: a scene is fixed by its words, so from pure noise the model has one
# picture to draw, not a blur of many (train.py). The draws stay: they are part of the seeded data stream
# the shipped weights were trained on, so removing them would change what the training command writes.
POSITION_JITTER = 0.0  # canvas units
SIZE_JITTER = 0.0  # relative
MAX_ROTATION = 0.0


@dataclass(frozen=True)
class Scene:
    size: str
    colour: str
    shape: str
    row: str | None  # "top", "bottom" or None (middle)
    column: str | None  # "left", "right" or None (middle)
    background: str
    # Continuous jitter the words do not fix.
    dx: float = 0.0
    dy: float = 0.0
    scale: float = 1.0
    rotation: float = 0.0

    def position_words(self) -> list[str]:
        words = [w for w in (self.row, self.column) if w]
        return words or [CENTER]

    def words(self, keep: dict[str, bool] | None = None) -> list[str]:
        """The prompt's content words in a fixed order; `keep[attribute]` False leaves an attribute unsaid."""
        keep = keep or {}
        parts = {"size": [self.size], "colour": [self.colour], "shape": [self.shape],
                 "position": self.position_words(), "background": [self.background]}
        return [w for a in ATTRIBUTES if keep.get(a, True) for w in parts[a]]

    def prompt(self, keep: dict[str, bool] | None = None) -> str:
        return " ".join(self.words(keep))


def random_scene(rng: np.random.Generator) -> Scene:
    return Scene(size=_pick(rng, SIZES), colour=_pick(rng, COLOURS), shape=_pick(rng, SHAPES),
                 row=_pick(rng, ROWS), column=_pick(rng, COLUMNS), background=_pick(rng, BACKGROUNDS),
                 dx=float(rng.uniform(-POSITION_JITTER, POSITION_JITTER)),
                 dy=float(rng.uniform(-POSITION_JITTER, POSITION_JITTER)),
                 scale=float(rng.uniform(1 - SIZE_JITTER, 1 + SIZE_JITTER)),
                 rotation=float(rng.uniform(-MAX_ROTATION, MAX_ROTATION)))


def scene_from_words(words: list[str], rng: np.random.Generator) -> Scene:
    """A scene that fits `words` (content words only); what they leave open is drawn from `rng`."""
    scene = random_scene(rng)
    fields = {}
    for w in words:
        if w in SIZES:
            fields["size"] = w
        elif w in COLOURS:
            fields["colour"] = w
        elif w in SHAPES:
            fields["shape"] = w
        elif w in BACKGROUNDS:
            fields["background"] = w
        elif w in POSITION_WORDS:
            fields.setdefault("row", None)
            fields.setdefault("column", None)
            if w in ROWS:
                fields["row"] = w
            elif w in COLUMNS:
                fields["column"] = w
    return Scene(**{**scene.__dict__, **fields})


def _pick(rng: np.random.Generator, options):
    options = list(options)
    return options[int(rng.integers(len(options)))]


# -------------------------------------------------------------------------------------------------
# Drawing


def render(scene: Scene, height: int, width: int) -> np.ndarray:
    """The scene as float32 RGB in [0, 1], shape [height, width, 3], edges anti-aliased over one pixel."""
    side = min(height, width)
    ys = (np.arange(height, dtype=np.float32) + 0.5) / height
    xs = (np.arange(width, dtype=np.float32) + 0.5) / width
    top, bottom = (np.asarray(c, dtype=np.float32) for c in BACKGROUNDS[scene.background])
    image = np.broadcast_to((top + (bottom - top) * ys[:, None])[:, None, :], (height, width, 3)).copy()

    # Shape-local coordinates in image sides, rotated by the scene's jitter.
    cy = ROWS[scene.row] + scene.dy
    cx = COLUMNS[scene.column] + scene.dx
    py = (ys[:, None] - cy) * height / side
    px = (xs[None, :] - cx) * width / side
    c, s = math.cos(scene.rotation), math.sin(scene.rotation)
    u, v = c * px + s * py, -s * px + c * py
    dist = _signed_distance(scene.shape, u, v, SIZES[scene.size] * scene.scale)
    alpha = np.clip(0.5 - dist * side, 0.0, 1.0)[..., None]
    colour = np.asarray(COLOURS[scene.colour], dtype=np.float32)
    return (image * (1 - alpha) + colour * alpha).astype(np.float32)


def _signed_distance(shape: str, u: np.ndarray, v: np.ndarray, r: float) -> np.ndarray:
    """Signed distance (negative inside, in image sides) to a shape of radius r centred at 0; v points down."""
    if shape == "circle":
        return np.hypot(u, v) - r
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) - 0.85 * r
    if shape == "cross":
        arm, half = 0.30 * r, 0.95 * r
        bar = lambda a, b: np.maximum(np.abs(a) - half, np.abs(b) - arm)  # noqa: E731
        return np.minimum(bar(u, v), bar(v, u))
    if shape == "triangle":
        # Equilateral, pointing up, circumradius 1.1 r: the largest distance to its three edge lines.
        apothem = 0.55 * r
        normals = ((0.0, 1.0), (math.sqrt(3) / 2, -0.5), (-math.sqrt(3) / 2, -0.5))  # (u, v) outward normals
        return np.max(np.stack([nu * u + nv * v for nu, nv in normals]), axis=0) - apothem
    raise ValueError(f"unknown shape {shape!r}")
