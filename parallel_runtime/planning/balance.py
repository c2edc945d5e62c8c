"""Device weights as users give them: the Strategy Selector's `device_weights` text ('' for equal shares, 'measured'
for the runtime to time each device on the job's own shapes, or relative speeds such as '3,2'), and the measured
weights of one job."""
from __future__ import annotations

import math

from ..errors import ConfigError

MEASURED = "measured"


def parse_device_weights(text: str) -> tuple[float, ...] | str:
    """() for equal shares, MEASURED, or one positive weight per device (checked against the devices at sample
    time, where their number is known)."""
    text = (text or "").strip().lower()
    if text in ("", "equal"):
        return ()
    if text == MEASURED:
        return MEASURED
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        weights = ()
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"device_weights {text!r} is not understood; leave it empty for equal shares, write "
                          f"'measured' to time each device, or give relative speeds such as 3,2.")
    return weights


def measured_weights(client, model_path: str, latent_shape: tuple, text_len: int,
                     weight_dtype: str = "default") -> tuple[float, ...]:
    """Each worker's relative speed on this job's model and token counts (RuntimeClient.measure_speeds)."""
    from ..models.registry import prompt_rows, token_patch
    from ..distributed.topology import latent_plane
    from ..validate import model_config

    config = model_config(model_path)
    h, w = latent_plane(latent_shape[2:])
    p = token_patch(config)
    return client.measure_speeds(model_path, text_tokens=prompt_rows(config, text_len),
                                 image_tokens=(h // p) * (w // p), weight_dtype=weight_dtype)
