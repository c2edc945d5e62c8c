"""Every family the runtime runs, and how a checkpoint finds its own: the only module that imports the
families. A new family is one module under `families/` plus one line in `families()`; nothing imports this
module back from the families or the seam, so there is no circle."""
from __future__ import annotations

import os
from typing import Iterable

from ..errors import ModelFileError
from .family import Match, ModelFamily, describe_keys, refuse_known_unsupported


def families() -> list[ModelFamily]:
    """Every family the runtime runs, in detection order (imported lazily: diffusers is heavy). LTX-2 comes before
    PixArt: its unprefixed files carry adaln_single and caption_projection, which PixArt's diffusers layout reads."""
    from .families.chroma import CHROMA
    from .families.flux2 import FLUX2
    from .families.flux3 import FLUX3
    from .families.flux_adapter import FLUX
    from .families.hidream import HIDREAM
    from .families.hidream_o1 import HIDREAM_O1
    from .families.hunyuan_video15 import HUNYUAN_VIDEO15
    from .families.kandinsky5 import KANDINSKY5
    from .families.kandinsky6 import KANDINSKY6
    from .families.ltx2 import LTX2
    from .families.lumina2 import LUMINA2
    from .families.minimax_h3 import MINIMAX_H3
    from .families.pixart import PIXART
    from .families.qwen_image_controlnet import QWEN_IMAGE  # Qwen-Image's family with its ControlNets
    from .families.qwen_image21 import QWEN_IMAGE21
    from .families.sd3_controlnet import SD3  # SD3's family with its ControlNets
    from .families.wan import WAN
    from .families.z_image import Z_IMAGE

    return [FLUX3, FLUX2, FLUX, CHROMA, SD3, QWEN_IMAGE21, QWEN_IMAGE, LTX2, PIXART, WAN, Z_IMAGE, LUMINA2,
            HUNYUAN_VIDEO15, MINIMAX_H3, KANDINSKY6, HIDREAM, HIDREAM_O1, KANDINSKY5]


def detect_family(keys: Iterable[str], name: str = "checkpoint") -> tuple[ModelFamily, Match]:
    """The family and key layout of a checkpoint, or one sentence naming what the file looks like."""
    keys = list(keys)
    refuse_known_unsupported(keys, name)
    for family in families():
        match = family.match(keys)
        if match is not None:
            return family, match
    supported = ", ".join(f.title for f in families())
    raise ModelFileError(f"{name} is not a DiT checkpoint ParaDiT runs ({describe_keys(keys)}); ParaDiT runs "
                         f"{supported}: choose one of those from models/diffusion_models.")


def family_of(config) -> ModelFamily:
    """The family a config belongs to (each config class names its family)."""
    for family in families():
        if family.name == config.family:
            return family
    raise ValueError(f"no model family named {config.family!r}")


def read_model(reader, name: str | None = None):
    """(family, match, config) of an open checkpoint, from its header only."""
    name = name or os.path.basename(getattr(reader, "path", "checkpoint"))
    family, match = detect_family(reader.keys(), name)
    return family, match, family.infer_config(reader, match, name)


def token_patch(config) -> int:
    """Latent pixels per token side in a config's family: its adapter's `patch` (2 for Flux's 2x2 patches, 1 where
    the VAE already compresses 16x, as FLUX.2's)."""
    return family_of(config).adapter_class.patch


def prompt_rows(config, tokens: int) -> int:
    """Rows a prompt of `tokens` tokens takes in the model's attention sequence: as many, unless the family pads it
    (FLUX.2 to 512 at the front, `prompt_tokens`; Z-Image to a multiple of 32 with learned rows, `prompt_rows`) or
    joins rows to it (HiDream's two Llama layers, `sequence_rows`).
    The cost model, auto and the bench's analytic traffic count these rows, as the workers run them."""
    adapter = family_of(config).adapter_class
    tokens = max(tokens, getattr(adapter, "prompt_tokens", 0))
    rows = getattr(adapter, "prompt_rows", lambda n: n)(tokens)
    # Rows a family joins to the embedded prompt (HiDream's Llama layers: adapter.joined_rows at the job's shapes).
    return getattr(adapter, "sequence_rows", lambda n: n)(rows)
