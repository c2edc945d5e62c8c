"""`bench --width`: a family's bench model at a wider width, every width-like field scaled alike (heads keep their
size), refused in one sentence where the width is not a multiple or the family's widths follow another rule."""
from __future__ import annotations

import pytest

from parallel_runtime.bench.models import BENCH_FAMILIES, widened
from parallel_runtime.models.registry import family_of


@pytest.mark.parametrize("name", ["flux3", "hidream", "hidream_o1", "kandinsky5", "kandinsky6", "ltx2", "wan"])
def test_widened_keeps_head_sizes_and_the_mlp_ratio(name):
    base = BENCH_FAMILIES[name]
    wide = widened(base, 1024)
    assert wide.hidden_size == 1024 and wide.head_dim == base.head_dim
    assert wide.num_heads == 4 * base.num_heads  # 4x the width, heads of the same size: 4x as many
    if name != "hidream":  # HiDream's experts' widths follow hidden_size itself (mlp_hidden is their common divisor)
        assert wide.mlp_hidden * base.hidden_size == base.mlp_hidden * 1024  # the block's MLP ratio kept
    assert family_of(wide).name == family_of(base).name
    assert widened(base, base.hidden_size) is base


def test_a_width_that_does_not_fit_is_refused_in_one_sentence():
    with pytest.raises(SystemExit, match=r"^--width 300: give a whole multiple of the bench model's width 256$"):
        widened(BENCH_FAMILIES["flux3"], 300)
    with pytest.raises(SystemExit, match=r"^--width 1024: the z_image bench model does not scale to that width \("):
        widened(BENCH_FAMILIES["z_image"], 1024)


def test_width_on_a_model_that_is_no_family_bench_model_is_refused_before_any_work():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "parallel_runtime", "bench", "--model", "toy", "--width", "512",
                          "--quick"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == ("--width widens a family's bench model only, not toy; drop it or "
                                                   "give --family.")
