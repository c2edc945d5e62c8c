"""The model families ParaDiT runs, one module each (Flux keeps its key map in `flux` and the strategies' view of it,
which the other families build on, in `flux_adapter`). Each imports the seam (`models.family`) and the weights'
key-map vocabulary; only `models.registry` imports them."""
