"""--parallel for queue_workflow.py: put Load Parallel DiT where an API-format graph loads its diffusion model.

Standard library only. Every `UNETLoader` becomes a `ParaDiTLoader` under the same node id (same unet_name, its
weight_dtype mapped), fed by one `ParaDiTStrategy` node added to the graph; so `--set ParaDiTStrategy.X=...` and
`--set ParaDiTLoader.X=...` reach them. A `CheckpointLoaderSimple` keeps giving CLIP and VAE; the consumers of its
MODEL are rewired to a new ParaDiTLoader for the same file name, which must be listed among the server's
diffusion models (Load Parallel DiT reads models/diffusion_models, not models/checkpoints): otherwise one
sentence says so. The host still runs the checkpoint loader, so it also holds that file's own copy of the model.
A loader of a model that is not a DiT (an SD UNet feeding a depth estimator, say) can be kept with --keep-loader.

Strategy text: `auto`, or degrees joined by commas: `ulysses=2`, `cfg=2,ulysses=2`, `pipefusion=2`, `ring=2`,
optionally with `patches=N` (PipeFusion patches) and `warmup=N` (warm-up steps), which also go with `auto`.
"""
from __future__ import annotations

import copy

DEGREES = {"cfg": "cfg_degree", "pipefusion": "pipefusion_degree", "pp": "pipefusion_degree",
           "ulysses": "ulysses_degree", "ring": "ring_degree"}
TUNING = {"patches": "num_pipeline_patch", "warmup": "warmup_steps"}
STRATEGY_DEFAULTS = {"mode": "auto", "cfg_degree": 1, "pipefusion_degree": 1, "ulysses_degree": 1, "ring_degree": 1,
                     "num_pipeline_patch": 0, "warmup_steps": 1}
# UNETLoader's weight_dtype -> Load Parallel DiT's (which has no separate fast-fp8 switch).
WEIGHT_DTYPES = {"default": "default", "fp8_e4m3fn": "fp8_e4m3fn", "fp8_e4m3fn_fast": "fp8_e4m3fn",
                 "fp8_e5m2": "fp8_e5m2"}
LOADERS = ("UNETLoader", "CheckpointLoaderSimple")


class SwapError(ValueError):
    """--parallel / --devices cannot be applied; the message is one sentence with the fix."""


def parse_strategy(text: str) -> dict:
    """`--parallel` text -> the inputs of a ParaDiTStrategy node."""
    inputs = dict(STRATEGY_DEFAULTS)
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    if not words:
        raise SwapError("--parallel needs a strategy: auto, or degrees such as ulysses=2 or cfg=2,ulysses=2.")
    degrees = set()
    for word in words:
        if word.lower() == "auto":
            continue
        key, sep, value = word.partition("=")
        key = key.strip().lower().removesuffix("_degree")
        name = DEGREES.get(key) or TUNING.get(key) or (key if key in STRATEGY_DEFAULTS else None)
        if not sep or name is None or name == "mode":
            raise SwapError(f"--parallel {text!r}: {word!r} is not auto or NAME=N with NAME one of cfg, pipefusion, "
                            f"ulysses, ring, patches, warmup.")
        try:
            number = int(value)
        except ValueError:
            raise SwapError(f"--parallel {text!r}: {word!r} needs a whole number after '='.") from None
        low = 0 if name in TUNING.values() else 1
        if number < low or (name == "cfg_degree" and number > 2):
            raise SwapError(f"--parallel {text!r}: {word!r} is out of range ({name} is "
                            f"{'1 or 2' if name == 'cfg_degree' else f'at least {low}'}).")
        inputs[name] = number
        degrees.update([name] if name in DEGREES.values() else [])
    if degrees and any(w.lower() == "auto" for w in words):
        raise SwapError(f"--parallel {text!r}: give auto or degrees, not both.")
    if degrees:
        inputs["mode"] = "manual"
    return inputs


def device_count(devices: str) -> int | None:
    """How many workers `devices` names: cpu:N -> N, "0,1" -> 2; None for auto (all visible GPUs)."""
    text = str(devices).strip().lower()
    if text in ("", "auto"):
        return None
    if text.startswith("cpu:"):
        count = text[4:]
        return int(count) if count.isdigit() else None
    parts = [p.strip() for p in text.split(",")]
    return len(parts) if all(p.isdigit() for p in parts) else None


def check_devices(strategy: dict, devices: str) -> None:
    count = device_count(devices)
    if strategy["mode"] != "manual" or count is None:
        return
    product = 1
    for name in set(DEGREES.values()):
        product *= strategy[name]
    if product != count:
        raise SwapError(f"--parallel asks for {product} worker(s) (the product of its degrees) but --devices "
                        f"{devices} names {count}: make them equal, e.g. --devices cpu:{product} or "
                        f"--parallel ulysses={count}.")


def _new_id(graph: dict) -> str:
    tops = [int(k.split(":")[0]) for k in graph if k.split(":")[0].isdigit()]
    return str(max(tops, default=0) + 1)


def _loader(unet_name, weight_dtype, devices: str, strategy_id: str) -> dict:
    return {"inputs": {"unet_name": unet_name, "weight_dtype": weight_dtype, "devices": devices,
                       "strategy": [strategy_id, 0]},
            "class_type": "ParaDiTLoader", "_meta": {"title": "Load Parallel DiT"}}


def _weight_dtype(node_id: str, value):
    if isinstance(value, list):
        return value  # a link: left to the server
    if value not in WEIGHT_DTYPES:
        raise SwapError(f"--parallel: UNETLoader {node_id} has weight_dtype {value!r}, which Load Parallel DiT has "
                        f"no match for ({', '.join(WEIGHT_DTYPES)} map); change it in the workflow or with --set.")
    return WEIGHT_DTYPES[value]


def _diffusion_models(object_info: dict | None) -> list | None:
    """Load Parallel DiT's unet_name choices on the server (None: not known here)."""
    if object_info is None:
        return None
    spec = object_info.get("ParaDiTLoader")
    if spec is None:
        raise SwapError("--parallel: this ComfyUI server has no Load Parallel DiT node (ParaDiTLoader): install "
                        "ParaDiT in its custom_nodes folder and restart it.")
    entry = (spec.get("input") or {}).get("required", {}).get("unet_name") or [None]
    kind = entry[0]
    return kind if isinstance(kind, list) else (entry[1].get("options") if len(entry) > 1 else None)


def _swap_checkpoint(graph: dict, node_id: str, devices: str, strategy_id: str, known: list | None, notes: list):
    """Rewire the consumers of a CheckpointLoaderSimple's MODEL to a new Load Parallel DiT on the same file."""
    consumers = [(nid, name) for nid, node in graph.items() for name, value in node["inputs"].items()
                 if value == [node_id, 0]]
    if not consumers:
        return
    ckpt = graph[node_id]["inputs"].get("ckpt_name")
    if not isinstance(ckpt, str):
        raise SwapError(f"--parallel: CheckpointLoaderSimple {node_id} takes its ckpt_name from another node; set "
                        f"it to a file name in the workflow first.")
    if known is not None and ckpt not in known:
        raise SwapError(f"--parallel: CheckpointLoaderSimple {node_id} loads {ckpt!r} from models/checkpoints, but "
                        f"Load Parallel DiT reads diffusion-model files from models/diffusion_models and the server "
                        f"lists no {ckpt!r} there: put the file (or a link to it) in models/diffusion_models, or "
                        f"use a workflow that loads the model with Load Diffusion Model (UNETLoader).")
    loader_id = _new_id(graph)
    graph[loader_id] = _loader(ckpt, "default", devices, strategy_id)
    for nid, name in consumers:
        graph[nid]["inputs"][name] = [loader_id, 0]
    notes.append(f"the MODEL of CheckpointLoaderSimple {node_id} ({ckpt}) now comes from Load Parallel DiT "
                 f"{loader_id}; node {node_id} still loads the file for its CLIP and VAE")


def swap_loaders(graph: dict, strategy: dict, devices: str = "auto", object_info: dict | None = None,
                 keep: tuple = ()) -> tuple[dict, list[str]]:
    """(a copy of `graph` with Load Parallel DiT in place of its diffusion-model loaders, except the node ids in
    `keep`, notes)."""
    check_devices(strategy, devices)
    loaders = [nid for nid, node in graph.items() if node.get("class_type") in LOADERS and nid not in keep]
    if not loaders:
        ours = any(node.get("class_type") == "ParaDiTLoader" for node in graph.values())
        raise SwapError("--parallel: the workflow has no UNETLoader or CheckpointLoaderSimple to put Load Parallel "
                        "DiT in place of" + (" (other than those --keep-loader names)" if keep else "") +
                        ("; it already uses Load Parallel DiT: change its strategy with --set ParaDiTStrategy.NAME=N "
                         "instead." if ours else "."))
    known = _diffusion_models(object_info)
    graph, notes = copy.deepcopy(graph), []
    strategy_id = _new_id(graph)
    graph[strategy_id] = {"inputs": dict(strategy), "class_type": "ParaDiTStrategy",
                          "_meta": {"title": "Strategy Selector"}}
    for nid in loaders:
        inputs = graph[nid]["inputs"]
        if graph[nid]["class_type"] == "UNETLoader":
            graph[nid] = _loader(inputs.get("unet_name"), _weight_dtype(nid, inputs.get("weight_dtype", "default")),
                                 devices, strategy_id)
            notes.append(f"UNETLoader {nid} ({inputs.get('unet_name')}) is now Load Parallel DiT {nid}")
        else:
            _swap_checkpoint(graph, nid, devices, strategy_id, known, notes)
    if not any(value == [strategy_id, 0] for node in graph.values() for value in node["inputs"].values()):
        raise SwapError("--parallel: no node of the workflow uses the MODEL of its checkpoint loader, so there is "
                        "nothing to run in parallel.")
    return graph, notes
