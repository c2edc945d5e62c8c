"""`python -m parallel_runtime bench-storage`: weight bytes per rank for each file kind users have.

The bench model (or a family's) is written as the files ComfyUI users load (bf16; fp8 e4m3fn with norms and
biases in bf16, as fp8 releases ship; GGUF Q8_0 and Q4_K with 1-D tensors in F32, as ComfyUI-GGUF's converter
writes them; ComfyUI's own quantized files, written with comfy-kitchen: fp8 per-tensor (fp8mixed), int8 per-tensor
and with ConvRot, mxfp8, nvfp4, the other tensors bf16) and each runs a short job through the runtime at one worker and under PipeFusion-2. The table gives
the weight bytes the busiest rank holds (the workers' own count), the analytic figure (each owned tensor as the
rank stores it), the ratio to bf16, the step time and the latent's distance from the fp32 file's (what the
format's rounding costs). Q4_K blocks are crafted with moderate scales (gguf-py cannot write K-quants), so that
row measures bytes and speed, not image quality.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

from ..spec import ModelSpec, StrategySpec
from ..weights.comfy_quant import QUANTIZED_MATMUL
from .measure import rel_err
from .models import NAMED_MODELS
from .report import fmt_table
from .runs import make_job, run_config

KINDS = ("fp32", "bf16", "fp8_e4m3fn", "Q8_0", "Q4_K", "fp8mixed", "int8_tensorwise", "int8_convrot", "mxfp8", "nvfp4")
# ComfyUI quantized kinds: comfy-kitchen layout, its options, the comfy_quant entry
COMFY_KINDS = {"fp8mixed": ("TensorCoreFP8Layout", {}, {"format": "float8_e4m3fn"}),
               "int8_tensorwise": ("TensorWiseINT8Layout", {}, {"format": "int8_tensorwise"}),
               "int8_convrot": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 256},
                                {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}),
               "mxfp8": ("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"}),
               "nvfp4": ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"})}


def write_kinds(base_path: str, folder: str) -> dict[str, tuple[str, str]]:
    """kind -> (file, weight_dtype) for each file kind, from the fp32 bench file."""
    import gguf
    from safetensors.torch import load_file, save_file

    base = load_file(base_path)
    linear = {k for k, t in base.items() if k.endswith(".weight") and t.ndim == 2}
    files = {"fp32": (base_path, "default")}
    save_file({k: t.to(torch.bfloat16) for k, t in base.items()}, os.path.join(folder, "bf16.safetensors"))
    files["bf16"] = (os.path.join(folder, "bf16.safetensors"), "bf16")
    save_file({k: t.to(torch.float8_e4m3fn if k in linear else torch.bfloat16) for k, t in base.items()},
              os.path.join(folder, "fp8.safetensors"))
    files["fp8_e4m3fn"] = (os.path.join(folder, "fp8.safetensors"), "default")
    for kind in ("Q8_0", "Q4_K"):
        path = os.path.join(folder, f"{kind}.gguf")
        writer = gguf.GGUFWriter(path, arch="flux")
        rng = np.random.default_rng(0)
        for key, t in base.items():
            if key in linear and kind == "Q4_K" and t.shape[1] % 256 == 0:
                writer.add_tensor(key, _crafted_q4_k(t, rng), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            elif key in linear and t.shape[1] % 32 == 0:  # Q4_K's fallback too, as the converter's
                writer.add_tensor(key, gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(key, t.numpy() if t.ndim < 2 else t.numpy().astype(np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files[kind] = (path, "default")
    for kind, (layout, options, conf) in COMFY_KINDS.items():
        files[kind] = (_comfy_quant_file(base, linear, os.path.join(folder, f"{kind}.safetensors"), layout, options,
                                         conf), "default")
    return files


def _comfy_quant_file(base: dict, linear: set, path: str, layout: str, options: dict, conf: dict) -> str:
    """A ComfyUI quantized file: every linear weight of whole 256-blocks in `layout`, the rest bf16."""
    from comfy_kitchen.tensor import QuantizedTensor
    from safetensors.torch import save_file

    out = {}
    for key, t in base.items():
        if key in linear and t.shape[0] % 128 == 0 and t.shape[1] % 256 == 0:
            out.update(QuantizedTensor.from_float(t, layout, **options).state_dict(key))
            out[key[: -len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        else:
            out[key] = t.to(torch.bfloat16)
    save_file(out, path)
    return path


def _crafted_q4_k(t: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks of `t`'s shape whose values have roughly its spread: random 4-bit codes and 6-bit sub-scales,
    the super-block scale set from the tensor's standard deviation."""
    blocks = rng.integers(0, 256, size=(t.numel() // 256, 144), dtype=np.uint8)
    d = float(t.std()) / (31 * 7.5)  # sub-scale ~31, code ~7.5 from the middle
    blocks[:, 0:2] = np.full((blocks.shape[0], 1), d, np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((blocks.shape[0], 1), d * 7.5, np.float16).view(np.uint8)
    return blocks.reshape(t.shape[0], -1)


def analytic_rank_bytes(path: str, weight_dtype: str, stage: int = 0, stages: int = 1) -> int:
    """Bytes a CPU rank of PipeFusion-`stages` holds, from the file's header and the family's meta model: linear
    weights kept compact as stored (GGUF blocks and ComfyUI layouts with their scales, for the rank's rows; fp8
    at 1 byte plus a scaled file's 4-byte scale), cast to fp8 under an fp8 weight_dtype, every other tensor in the
    compute dtype (fp32 on CPU, bf16 under weight_dtype bf16)."""
    from ..models.registry import read_model
    from ..weights.checkpoint import open_checkpoint
    from ..weights.storage import FP8_DTYPES, scale_key

    compute = 2 if weight_dtype == "bf16" else 4
    cast_fp8, keep = weight_dtype.startswith("fp8"), weight_dtype == "default"
    with open_checkpoint(path) as reader:
        family, match, config = read_model(reader)
        model = family.meta_model(config)
        smap = family.source_map(config, match.layout, match.prefix)
        owned = family.stage_ownership(config, family.pipeline_stages(config, stages)[stage], first=stage == 0,
                                       last=stage == stages - 1)
        linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        total = 0
        for name, t in model.state_dict().items():
            if not owned(name):
                continue
            key = smap[name].key
            if name in linears and cast_fp8:
                total += t.numel()
            elif name in linears and keep and reader.quant_format(key) is not None:
                total += reader.stored_bytes(key) * t.shape[0] // reader.shape(key)[0]
            elif name in linears and keep and reader.dtype(key) in FP8_DTYPES:
                total += t.numel() + (4 if scale_key(key) in reader else 0)
            else:
                total += compute * t.numel()
    return total


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime bench-storage", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", choices=sorted(NAMED_MODELS), help="bench model (default: bench)")
    ap.add_argument("--resolution", type=int, default=512, help="square image side in px (default 512)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--devices", default="cpu:2", help="at least 2 workers for the PipeFusion-2 rows")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--quantized-matmul", default="auto", choices=QUANTIZED_MATMUL,
                    help="how ComfyUI-quantized layers multiply (default auto: comfy-kitchen's kernels where "
                         "ComfyUI uses them; on a GPU, compare with dequantize)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from ..models.tiny import write_checkpoint

    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = NAMED_MODELS[args.model]
    side = args.resolution // 8
    # A video model takes [B, C, frames, H, W]: 5 latent frames (17 video frames) of the same side.
    latent_shape = (1, config.latent_channels, *((5,) if config.video else ()), side, side)
    folder = tempfile.mkdtemp(prefix="paradit-bench-storage-")
    rows, table = [], []
    try:
        files = write_kinds(write_checkpoint(os.path.join(folder, "fp32.safetensors"), config, seed=0), folder)
        reference = None
        for world, strategy in ((1, StrategySpec()), (2, StrategySpec(pipefusion_degree=2, warmup_steps=args.steps))):
            bf16 = None
            for kind in KINDS:
                path, weight_dtype = files[kind]
                job = make_job(path, config, strategy, latent_shape, 64, 1.0, args.steps)
                job = dataclasses.replace(job, model=ModelSpec(path, weight_dtype=weight_dtype,
                                                               quantized_matmul=args.quantized_matmul))
                devices = "cpu:1" if world == 1 else args.devices
                res = run_config(devices, job, threads=1)
                held = [st["param_bytes"] for st in res["stats"]]
                analytic = [analytic_rank_bytes(path, weight_dtype, r, world) for r in range(world)]
                reference = res["latent"] if kind == "fp32" and world == 1 else reference
                bf16 = max(held) if kind == "bf16" else bf16
                row = {"kind": kind, "world": world, "strategy": strategy.label(), "weight_dtype": weight_dtype,
                       "file_bytes": os.path.getsize(path), "param_bytes": held, "analytic_bytes": analytic,
                       "vs_analytic": max(abs(h / a - 1) for h, a in zip(held, analytic)),
                       "vs_bf16": max(held) / bf16 if bf16 else None, "step_s": res["step_s"],
                       "rel_err_vs_fp32": rel_err(res["latent"], reference)}
                rows.append(row)
                table.append([kind, strategy.label(), f"{max(held) / 2**20:.2f}", f"{max(analytic) / 2**20:.2f}",
                              f"{row['vs_analytic']:.1%}", "" if row["vs_bf16"] is None else f"{row['vs_bf16']:.2f}",
                              f"{row['step_s'] * 1e3:.0f}", f"{row['rel_err_vs_fp32']:.1e}"])
                print(f"  {kind} {strategy.label()}: {max(held) / 2**20:.2f} MB/rank", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"Weight bytes per rank — {args.model} model ({config.hidden_size} wide), {args.resolution} px, "
          f"{args.steps} steps, {args.devices} workers (compute fp32 on CPUs; bf16 row computes in bf16), "
          f"quantized_matmul {args.quantized_matmul}")
    print(fmt_table(["file", "strategy", "MB/rank (busiest)", "analytic MB", "off analytic", "x bf16", "ms/step",
                      "rel. L2 vs fp32 file"], table))
    print("  fp8, GGUF and ComfyUI quantized files: linear weights kept as stored (with their scales), norms/biases/"
          "embeddings in the compute dtype; Q4_K values are crafted blocks (bytes and speed only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)
    return 0 if all(r["vs_analytic"] <= 0.05 for r in rows) and all(math.isfinite(r["rel_err_vs_fp32"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
