"""Model families behind one seam: `family` (what a family supplies and what strategies call: `ModelFamily`,
`DiTFamily`, `Match`, the config mixins), `registry` (every family, detection by a file's keys; the only module
that imports `families/`), `families/` (one module per family), `tiny` (random test checkpoints of any family)."""
