"""The benchmark commands: `python -m parallel_runtime bench` (every strategy measured on this machine, the
targets judged, the cost model's projection to GPUs) and `bench-storage` (weight bytes per rank per file kind).

`cli` runs one invocation; `grid` says which configurations, `runs` runs one, `measure` times it (shared with
the demo and the soak), `report` tabulates, `targets` judges, `projection` projects; `models` holds the bench's
random models, `vae` times a video model's VAE decode apart from the DiT, `storage` the file-kind bench.
"""
