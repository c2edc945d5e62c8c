"""`python -m parallel_runtime bench`: measure every strategy on this machine and check the targets.

For each configuration of the grid (serial; CFG-2; Ulysses-2/4; Ring-2/4; PipeFusion-2/4 with M = N and
M = 2N patches; hybrids that fit the device count; naive patch) it runs real jobs through the runtime
(fresh workers per configuration, so peak memory is that configuration's) and reports:

* DiT seconds per step: median over the steps after warm-up (step 0, and PipeFusion's synchronous
  warm-up steps and pipeline fill), the slowest rank's median, best of `--repeats` jobs; no VAE runs
  inside it. The whole job's time (as the workers measured it, model load excluded) sits beside it. For a
  video model (--family wan) the VAE decode a user also pays is timed apart, on its own line (bench/vae.py).
* speed-up against the serial run of the same invocation (at the same cfg);
* bytes sent and received per rank per step from the runtime's own counters, next to `traffic.py`'s
  analytic figure (they must agree within 10%);
* per-rank parameters, PipeFusion KV buffers and peak process RSS (sampled with psutil);
* relative error of the final latent against serial.

Then the targets (PASS/FAIL), auto's pick next to the best measured configuration, and the cost model's
projection to 2/4/8 GPUs on NVLink and PCIe with the measured inputs it used.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from ..errors import ConfigError
from ..planning import costmodel
from ..planning.traffic import compare, job_traffic, shapes_of
from ..distributed.devices import default_dtype
from ..distributed.topology import latent_plane
from ..toy.text import TEXT_TOKENS
from .cache import DEFAULT_STEPS as DEFAULT_CACHE_STEPS, DEFAULT_THRESHOLD as DEFAULT_CACHE_THRESHOLD
from .av_calls import AV_FAMILIES, AV_SIZES, av_call_bench, av_shape
from .controlnet import controlnet_row
from .grid import CFG_PARALLEL_SCALE, grid, row_label, subset_devices
from .measure import cpu_capacity
from .models import (BENCH_FAMILIES, FLUX_DEV, NAMED_MODELS, RELEASE_SHAPES, RELEASE_VIDEO_SIZES, TOY, VIDEO_SIZE,
                     widened)
from .projection import av_projection, gpu_projection, video_projection, xdit_published
from .report import fmt_table, result_rows
from .runs import in_process_reference, make_job, pipefusion_per_call, run_calls, run_config, run_in_process
from .targets import TARGET_OVERHEAD, TARGET_TRAFFIC, auto_target, measured_targets
from .vae import CPU_LATENT_FRAMES, latent_frames


def _mode_arguments(ap) -> None:
    """The flags that run one focused bench instead of the grid (BenchRun._mode_bench)."""
    ap.add_argument("--balance", action="store_true",
                    help="unequal devices (e.g. --devices cpu:0,cpu:0,cpu:1): each strategy over all of them with "
                         "equal shares and with shares by measured speed, then auto's pick on those speeds")
    ap.add_argument("--entrances", action="store_true",
                    help="Parallel Sampler's job against KSampler's way in (one job per model call, the sampler loop "
                         "here) on the same warm workers: serial, CFG-2, Ulysses-2, Ring-2, PipeFusion-2 (or "
                         "--configs), --repeats each; the latents must agree (exit 1 if not)")
    ap.add_argument("--batch", type=int, default=None, metavar="N",
                    help="a batch of N images per strategy: serial, batch parallel, Ulysses, Ring (and CFG x Ulysses "
                         "at --cfg > 1) on --devices, images per minute and every image against serial's")
    ap.add_argument("--cache", nargs="?", type=float, const=DEFAULT_CACHE_THRESHOLD, default=None,
                    metavar="THRESHOLD",
                    help=f"the runtime's First-Block Cache off and on (threshold default {DEFAULT_CACHE_THRESHOLD:g}) "
                         f"for serial and each exact strategy on the same warm workers: speed-ups, the cache's gain "
                         f"and its error against the uncached serial latent (default {DEFAULT_CACHE_STEPS} steps; "
                         f"--model toy is the trained demo model)")
    ap.add_argument("--memory-plans", action="store_true",
                    help="memory per rank of the family's released model (--family ltx2: LTX-2.3 22B) at its released "
                         "video size, bf16 and fp8, for each plan on 2 and 4 GPUs of --gpu-memory GB: which fit")
    ap.add_argument("--gpu-memory", type=float, default=24.0, metavar="GB",
                    help="--memory-plans: memory of each GPU in GiB (default 24)")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="'bench' (Flux-shaped: width 256, 2 double + 4 single blocks), 'tiny', 'toy' (the trained "
                         "demo model with the demo's prompt; default 512x512), or a Flux .safetensors path "
                         "(default: bench)")
    ap.add_argument("--family", default=None, choices=sorted(BENCH_FAMILIES),
                    help="run the grid on a random model with this family's block shapes (flux = --model bench)")
    ap.add_argument("--blocks", default=None, metavar="D,S",
                    help="double,single block counts for a named model (e.g. 0,6 or 4,8)")
    ap.add_argument("--width", type=int, default=None,
                    help="model width of a family's bench model, a multiple of its own (256; PixArt 288): its MLPs "
                         "and head counts grow with it, head sizes stay, nearer a release's mix of matmul and "
                         "per-token work")
    ap.add_argument("--resolution", default=None, metavar="WxH",
                    help="image size in pixels; latent = size/8, image tokens = (size/16)^2 (default 1024x1024 "
                         "-> 4096 tokens)")
    ap.add_argument("--frames", type=int, default=None,
                    help="video frames for a video model, 4k + 1 (default 81 = 21 latent frames; --family wan "
                         "defaults to 81 frames of 320x320 -> 8,400 video tokens and 512 prompt tokens)")
    ap.add_argument("--vae-frames", default=None, metavar="N|all",
                    help=f"video models: latent frames the separately timed VAE decode decodes, the rest "
                         f"extrapolated (default {CPU_LATENT_FRAMES}; 'all' decodes the whole latent; 0 skips it)")
    ap.add_argument("--text-tokens", type=int, default=None, help="T5 prompt tokens (default 128)")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps per job (default 5)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds over the grid, round robin; each configuration keeps its fastest run (default 2)")
    ap.add_argument("--devices", default=None, help="cpu:N or GPU indices like 0,1,2,3 (default cpu:2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per CPU worker (default 1)")
    ap.add_argument("--cfg", type=float, default=1.0,
                    help=f"cfg of the grid (default 1); at cfg 1 the CFG-parallel rows run at cfg "
                         f"{CFG_PARALLEL_SCALE} against their own serial run")
    ap.add_argument("--configs", default=None,
                    help="comma-separated labels to run (e.g. serial,ulysses2,pp2xM2w1); default: the whole grid")
    ap.add_argument("--auto", action="store_true",
                    help="only serial and auto's pick (plus the cost model's projections)")
    ap.add_argument("--no-auto", action="store_true", help="skip auto's pick and the projections")
    ap.add_argument("--no-overhead", action="store_true", help="skip the in-process serial reference")
    ap.add_argument("--recalibrate", action="store_true", help="re-measure the cached link timing too")
    ap.add_argument("--gpu-tflops", type=float, default=costmodel.GPU_TFLOPS,
                    help=f"effective GPU TFLOP/s assumed by the GPU projection (default {costmodel.GPU_TFLOPS:.0f})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke preset (< 1 min): tiny model, 256x256 (256 tokens), 32 text tokens, cpu:2, 3 steps, "
                         "1 repeat; options given explicitly still apply")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write a machine-readable record to PATH, or to stdout with no PATH (the table then "
                         "goes to stderr)")
    _mode_arguments(ap)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = ap.parse_args(argv)
    if args.family:
        if args.model is not None:
            ap.error("give --family or --model, not both")
        args.model = "bench" if args.family == "flux" else args.family
    if args.cache is not None:
        if not args.cache >= 0:  # also NaN
            raise SystemExit(f"--cache {args.cache}: give a threshold of 0 or more")
        if args.steps is None:
            args.steps = DEFAULT_CACHE_STEPS
    args.preset_size = args.quick and args.resolution is None  # main raises it to the family's smallest image
    defaults = QUICK if args.quick else TOY_DEFAULTS if args.model == TOY else DEFAULTS
    if args.family and BENCH_FAMILIES[args.family].video:
        defaults = dict(defaults, **(QUICK_VIDEO if args.quick else VIDEO_SIZE))
    if args.family in AV_SIZES and not args.quick:  # each audio-video family's frame grid and prompt length
        defaults = dict(defaults, **{k: v for k, v in AV_SIZES[args.family].items() if k != "fps"})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.batch is not None and args.batch < 2:
        raise SystemExit("--batch needs at least 2 images")
    if args.steps < 2 or args.repeats < 1:
        raise SystemExit("--steps must be at least 2 (the first step is left out) and --repeats at least 1")
    if args.vae_frames not in (None, "all") and not args.vae_frames.isdigit():
        raise SystemExit(f"--vae-frames {args.vae_frames!r}: give a number of latent frames (0 skips) or 'all'")
    return args


DEFAULTS = dict(model="bench", resolution="1024x1024", text_tokens=128, devices="cpu:2", threads=1, steps=5, repeats=2)
# The demo model was trained up to 512x512; its prompts are TEXT_TOKENS long.
TOY_DEFAULTS = dict(DEFAULTS, resolution="512x512", text_tokens=TEXT_TOKENS)
QUICK = dict(model="tiny", resolution="256x256", text_tokens=32, devices="cpu:2", threads=1, steps=3, repeats=1)
# A video family's smoke run: 5 frames (2 latent frames, 512 tokens at 256x256); the VAE decodes one latent frame.
QUICK_VIDEO = dict(frames=5, vae_frames="1")


def parse_resolution(text: str) -> tuple[int, int]:
    parts = text.lower().replace(" ", "").split("x")
    try:
        w, h = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise SystemExit(f"--resolution {text!r}: use WIDTHxHEIGHT in pixels, e.g. 1024x1024") from None
    if w % 16 or h % 16 or w <= 0 or h <= 0:
        raise SystemExit(f"--resolution {text!r}: width and height must be positive multiples of 16 pixels")
    return w, h


def bench_latent(config, width: int, height: int, frames: int | None) -> tuple[tuple, int]:
    """The bench's latent shape and its token count: [1, C, H/8, W/8] for an image model (H/16, W/16 where the VAE
    compresses 16x: config.latent_downscale); [1, C, T, H/8, W/8] for a video model, T latent frames for `frames`
    video frames (VIDEO_SIZE's 81 when not given). Tokens are the family's patches of the latent."""
    from ..models.registry import family_of

    down, p = getattr(config, "latent_downscale", 8), family_of(config).adapter_class.patch
    rows, cols = height // down, width // down
    if not config.video:
        if frames is not None:
            raise SystemExit("--frames is for video models (e.g. --family wan)")
        return (1, config.latent_channels, rows, cols), (rows // p) * (cols // p)
    t = latent_frames(frames or VIDEO_SIZE["frames"])
    return (1, config.latent_channels, t, rows, cols), t * (rows // p) * (cols // p)


def main(argv: list[str] | None = None, workers: dict | None = None) -> int:
    """`workers`: a pool of runtime clients by device string that --quick rows run on and leave running, for a
    caller that smoke-runs several grids (tests/test_bench_grids.py); its owner shuts them down."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--in-process-reference"]:  # internal: see runs.run_in_process
        in_process_reference(json.loads(argv[1]))
        return 0
    args = parse_args(argv)
    out_stream = sys.stderr if args.json == "-" else sys.stdout

    def say(text: str = "") -> None:
        print(text, file=out_stream, flush=True)

    import diffusers  # noqa: F401 - fail early if diffusers is missing
    from ..distributed.devices import parse_devices

    t_start = time.perf_counter()
    width, height = parse_resolution(args.resolution)
    devices = parse_devices(args.devices)
    tmp = tempfile.mkdtemp(prefix="paradit-bench-") if args.model in NAMED_MODELS else None
    try:
        path, config, model_name, conditioning = _model(args, tmp, height, width)
        if args.preset_size:  # PixArt has no positions below 264 px a side: the smoke preset runs at its smallest
            side = -(-getattr(config, "min_mean_latent_side", 0) * 8 // 16) * 16
            width, height = max(width, side), max(height, side)
        shape = None
        if config.family in AV_FAMILIES:  # a video latent and its audio latent
            fps = AV_SIZES[config.family]["fps"]
            shape = av_shape(config, width, height, args.frames or AV_SIZES[config.family]["frames"], fps)
            latent_shape, tokens = shape.video, shape.video_tokens
        else:
            latent_shape, tokens = bench_latent(config, width, height, args.frames)
        run = BenchRun(args, say, path, config, model_name, latent_shape, tokens, devices, conditioning, t_start,
                       workers, shape)
        return run.main()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _model(args, tmp: str | None, height: int, width: int):
    """(checkpoint path, config, the name the report gives it, the demo prompt's conditioning or None)."""
    from ..models.registry import family_of
    from ..models.tiny import write_checkpoint
    from ..validate import model_config

    if args.model in NAMED_MODELS:
        config = NAMED_MODELS[args.model]
        if args.blocks:
            d, s = (int(x) for x in args.blocks.split(","))
            config = dataclasses.replace(config, num_layers=d, num_single_layers=s)
        if args.width:
            config = widened(config, args.width)
        path = write_checkpoint(os.path.join(tmp, f"{args.model}.safetensors"), config, seed=0)
        single = getattr(config, "num_single_layers", 0)  # one-block-list families have none
        return path, config, (f"{args.model} ({family_of(config).title}-shaped, random weights: width "
                              f"{config.hidden_size}, {config.num_heads} heads x {config.head_dim}, "
                              f"{config.num_layers} double/joint + {single} single blocks)"), None
    if args.width:
        raise SystemExit(f"--width widens a family's bench model only, not {args.model}; drop it or give --family.")
    path, conditioning, prompt = os.path.abspath(args.model), None, ""
    if args.model == TOY:
        from ..toy import DEFAULT_PROMPT, MODEL_PATH, load_companions

        path, text_encoder = MODEL_PATH, load_companions()[1]
        conditioning = (text_encoder.encode(DEFAULT_PROMPT, height, width), text_encoder.encode("", height, width))
        prompt = f', prompt "{DEFAULT_PROMPT}"'
    config = model_config(path)
    return path, config, (f"{os.path.basename(path)} (width {config.hidden_size}, {config.num_layers} double + "
                          f"{config.num_single_layers} single blocks){prompt}"), conditioning


@dataclasses.dataclass
class BenchRun:
    """One invocation of the bench: calibrate, choose the rows, run them, report, judge the targets."""

    args: argparse.Namespace
    say: object
    path: str
    config: object
    model_name: str
    latent_shape: tuple
    image_tokens: int
    devices: list
    conditioning: tuple | None
    t_start: float
    workers: dict | None = None  # main's `workers`
    av_shape: object = None  # an audio-video family's video and audio latents (av_calls.AVShape)

    def __post_init__(self):
        self.text = self.args.text_tokens
        # The prompt's rows in the model's sequence (FLUX.2 pads it to 512): what the analytic traffic, the memory
        # estimate and the cost model count; the jobs carry the prompt as given, as a user's would.
        from ..models.registry import prompt_rows

        self.seq_text = prompt_rows(self.config, self.text)
        self.video = self.config.video  # latent [B, C, T, H, W]; its tokens are video tokens
        self.tokens_name = "video" if self.video else "image"
        self.max_world = len(self.devices)
        self.kind = "cpu" if self.devices[0] == "cpu" else "cuda"
        self.act_bytes = 4 if self.kind == "cpu" else 2
        self.cores = costmodel.available_cores()
        self.calib = None
        self.targets: list[dict] = []
        self.not_applicable: list[dict] = []  # grid rows this model or latent cannot run, with the reason

    def main(self) -> int:
        from ..models.registry import family_of

        args, say = self.args, self.say
        self._header()
        family = family_of(self.config).name
        record: dict = {"model": self.model_name, "family": family,
                        "model_path": self.path if args.model not in NAMED_MODELS else args.model,
                        "config": dataclasses.asdict(self.config),
                        "resolution": [self.latent_shape[-1] * 8, self.latent_shape[-2] * 8],
                        "frames": args.frames if self.video else None, "latent_shape": list(self.latent_shape),
                        "image_tokens": self.image_tokens, "text_tokens": self.text, "steps": args.steps,
                        "devices": args.devices, "threads": args.threads, "repeats": args.repeats,
                        "cores": self.cores, "rows": []}
        mode = self._mode_bench(record)
        if mode is not None:
            return mode
        # --quick keeps one set of workers per device count for the whole run, grid and per-call rows alike
        # (starting workers is most of a smoke row's time); the full bench starts fresh ones per row, so each row's
        # peak RSS is its own.
        owned = args.quick and self.workers is None
        if owned:
            self.workers = {}
        try:
            return self._grid(record, family)
        finally:
            if owned:
                for client in self.workers.values():
                    client.shutdown()

    def _client(self, where: str):
        """--quick's warm workers on `where` (started on first use), else None: the caller starts fresh ones."""
        from ..runtime.client import RuntimeClient

        if not self.args.quick:
            return None
        if where not in self.workers:
            self.workers[where] = RuntimeClient(where, threads_per_worker=self.args.threads)
        return self.workers[where]

    def _grid(self, record: dict, family: str) -> int:
        """The grid's rows, the stock-sampler rows beside them, the report and the targets."""
        args, say = self.args, self.say
        if not args.no_auto:
            record["calibration"] = self._calibrate()
        rows, auto_pick, auto_reason = self._rows()
        best, inproc_runs, call_runs = self._run_grid(rows)
        results, serial, total_params = self._results(rows, best)

        headers, table, json_rows = result_rows(results, serial, args.steps, self.kind)
        record["rows"].extend(dict(row, family=family) for row in json_rows)
        record["not_applicable"] = self.not_applicable
        say("")
        say(f"Results — {self.model_name}, {self.image_tokens} {self.tokens_name} + {self.text} text tokens{self._padded_note()}, "
            f"{args.devices} x {args.threads} thread(s)")
        say(fmt_table(headers, table))
        say("  work: serial's CPU seconds per step over the busiest rank's (the least of the runs): what the split "
            "saved in work, without waits on a peer or time the VM gave other processes (two busy cores still slow "
            "each other's work: compare cfg2's rank, which does serial's one-branch work, with serial at cfg 1); "
            "cores: how many cores the workers' count of concurrent FP-bound probes got just before that run (shared "
            "VMs vary); proj: cost model; MB/rank/step: busiest rank, runtime counters, result gather amortised; "
            "analytic: traffic.py; act: cost-model estimate of live activations")
        if self.video:
            record["vae_decode"] = self._vae_decode(results, serial)

        if not args.no_overhead and self.max_world > 1:
            say("")
            record["pipefusion_per_call"] = pipefusion_per_call(say, args, self.path, self.config, self.latent_shape,
                                                                self.text, results, self.calib, self.devices,
                                                                self._client)
            record["controlnet"] = controlnet_row(say, args, self.path, self.config, self.latent_shape, self.text,
                                                  results, self.devices, self.target, self._client)
        record["in_process_step_s"], record["model_call_s"] = inproc_runs, call_runs
        inproc = min(inproc_runs) if inproc_runs else None
        measured_targets(args, results, serial, inproc, total_params, self.target, family=family)
        self._model_call_target(call_runs, inproc)
        record["auto"] = auto_target(args, results, auto_pick, auto_reason, self.max_world, self.target)
        self._report_targets()
        record["targets"] = self.targets
        if self.calib is not None:
            self._report_auto(auto_pick, auto_reason, record)
        return self._finish(record)

    def _mode_bench(self, record: dict) -> int | None:
        """The bench of a mode flag (--balance, --batch, --entrances, --cache) into `record`, and its exit status;
        None without one (the grid runs)."""
        args = self.args
        common = (self.say, args, self.path, self.config, self.latent_shape, self.text)
        if args.balance:
            from .balance import balance_bench

            record["balance"] = balance_bench(*common, self.target)
        elif args.batch:
            from .batch import batch_bench

            record["batch"] = batch_bench(*common, self.devices, self.target, self.workers, self.conditioning)
        elif args.entrances:
            from .entrances import entrances_bench

            record["entrances"] = entrances_bench(*common, self.devices, self.target, self.workers, self.conditioning)
        elif args.cache is not None:
            from .cache import cache_bench

            record["cache"] = cache_bench(*common, self.devices, self.target, self.workers, self.conditioning)
        elif args.memory_plans:
            from .memory_plans import memory_plans

            record["memory_plans"] = memory_plans(self.say, args.model, args.gpu_memory)
        elif self.av_shape is not None:
            # Parallel Sampler does not carry these families' audio yet: their model call is what runs.
            record.update(audio_tokens=self.av_shape.audio_tokens, audio_shape=list(self.av_shape.audio))
            if not args.no_auto:
                record["calibration"] = self._calibrate()
            record["av_calls"] = av_call_bench(self.say, args, self.path, self.config, self.av_shape, self.devices,
                                               self.target, self.workers, self.calib)
            if not args.no_auto:
                self.say("")
                record["projection"] = av_projection(self.say, args.model, args.cfg, args.gpu_tflops)
        else:
            return None
        self._report_targets()
        record["targets"] = self.targets
        status = self._finish(record)
        if args.entrances and not record["entrances"]["latents_agree"]:
            return 1  # a wrong result is no timing noise
        if record.get("av_calls", {}).get("differ_from_serial"):
            return 1
        return status

    def target(self, name: str, ok: bool | None, detail: str) -> None:
        self.targets.append({"target": name, "status": "n/a" if ok is None else ("PASS" if ok else "FAIL"),
                             "detail": detail})

    def _padded_note(self) -> str:
        return f" ({self.seq_text} rows once the model pads it)" if self.seq_text != self.text else ""

    def _header(self) -> None:
        args, say, shape = self.args, self.say, self.latent_shape
        down = getattr(self.config, "latent_downscale", 8)  # FLUX.2, Qwen-Image 2.1, HunyuanVideo 1.5: 16
        size = f"{shape[-1] * down}x{shape[-2] * down} px"
        if self.video:
            size = f"{args.frames} frames of {size}"
        say(f"ParaDiT bench — model {self.model_name}")
        audio = f" + {self.av_shape.audio_tokens} audio tokens" if self.av_shape is not None else ""
        say(f"  {size} -> latent {'x'.join(map(str, shape[2:]))} -> {self.image_tokens} {self.tokens_name} tokens"
            f"{audio} + {self.text} text tokens{self._padded_note()}; {args.steps} "
            + ("model calls per strategy, seconds per call = median, best of " if self.av_shape is not None else
               "steps (euler/simple), both entrances per strategy, each its fastest of " if args.entrances else
               "steps (euler/simple), seconds per step = median after warm-up, slowest rank, best of ")
            + f"{args.repeats}; no VAE in any DiT time"
            + ("; the VAE decode is timed apart after the grid" if self.video and not args.entrances
               and self.av_shape is None else ""))
        say(f"  devices {args.devices} ({self.max_world} worker(s)), {args.threads} thread(s) per worker, "
            f"{self.cores} core(s) here")
        say("")

    def _stream_tokens(self) -> int:
        """The image stream's rows the blocks run: the image tokens, and MiniMax-H3's audio rows packed beside its
        video's (LTX-2's audio is a stream of its own, which the cost model counts from the video's)."""
        from ..models.registry import family_of

        shape = self.av_shape
        packed = shape is not None and not getattr(family_of(self.config).adapter_class, "two_streams", False)
        return self.image_tokens + (shape.audio_tokens if packed else 0)

    def _calibrate(self) -> dict:
        """The cost model's measured inputs: this model's blocks at this token count, the link between workers."""
        args, devices = self.args, self.devices
        self.say("calibrating the cost model ...")
        dtype = default_dtype(self.kind, torch.cuda.get_device_capability(devices[0]) if self.kind == "cuda" else None)
        blocks = costmodel.block_timing(self.config, self.seq_text, self._stream_tokens(), device=devices[0],
                                        dtype=dtype, threads=args.threads, refresh=True)
        link = costmodel.link_timing(devices, refresh=args.recalibrate) if self.max_world > 1 else None
        self.calib = costmodel.Calibration(blocks, link, self.kind, threads=args.threads, cores=self.cores,
                                           overlap=self.kind == "cuda",
                                           fixed_rows=costmodel.GPU_FIXED_ROWS if self.kind == "cuda" else 0.0)
        self.say(f"  {self.calib.describe()}")
        return self.calib.to_json()

    def _rows(self):
        """The grid's (strategy, cfg) rows, narrowed by --configs / --auto, with auto's pick among them."""
        from ..planning import auto

        from ..models.registry import family_of, token_patch

        args, shape, config = self.args, self.latent_shape, self.config
        skipped: list[tuple[str, str]] = []
        rows = grid(self.max_world, cfg=args.cfg, heads=config.num_heads, num_blocks=config.num_blocks,
                    latent_hw=latent_plane(shape[2:]), patch=token_patch(config),
                    mlp_hidden=getattr(config, "mlp_hidden", None), tensor=bool(family_of(config).tensor_plan_for(config)),
                    skipped=skipped)
        self.not_applicable = [{"label": label, "reason": reason} for label, reason in skipped]
        for label, reason in skipped:
            self.say(f"  not applicable here: {label} ({reason})")
        auto_pick, auto_reason = None, None
        if self.calib is not None and self.max_world > 1:
            auto_pick, auto_reason = auto.choose_strategy(self.path, shape, args.cfg, args.devices, text_len=self.text,
                                                          threads=args.threads, calibration=self.calib)
            self.say(f"  auto picks {auto_pick.label()}: {auto_reason}")
            if args.auto:
                rows = [r for r in rows if r[0].world_size == 1 and abs(r[1] - args.cfg) < 1e-9] + [(auto_pick, args.cfg)]
            elif not any(s == auto_pick and abs(c - args.cfg) < 1e-9 for s, c in rows):
                rows.append((auto_pick, args.cfg))
        if args.configs:
            wanted = set(args.configs.split(","))
            chosen = [r for r in rows if r[0].world_size > 1 and (r[0].label() in wanted or row_label(*r) in wanted)]
            cfgs = {round(args.cfg, 6)} | {round(c, 6) for _, c in chosen}
            rows = [r for r in rows if r[0].world_size == 1 and round(r[1], 6) in cfgs] + chosen
        self.say("")
        return rows, auto_pick, auto_reason

    def _run_grid(self, rows):
        """Every row `--repeats` times, round robin (a burst of contention on a shared machine hits one run of a
        configuration, not all), keeping each row's fastest run; the in-process and per-call serial references."""
        args, say = self.args, self.say
        best: dict[int, dict] = {}
        inproc_runs, call_runs = [], []
        want_inproc = not args.no_overhead and self.kind == "cpu"
        for rep in range(args.repeats):
            for idx, (s, cfg) in enumerate(rows):
                if want_inproc and idx == 0:
                    self._serial_references(rep, cfg, inproc_runs, call_runs)
                where = subset_devices(self.devices, args.devices, s.world_size)
                probe = self.kind == "cpu" and s.world_size > 1 and not args.quick  # its probes take seconds
                cap = cpu_capacity(s.world_size) if probe else None
                job = make_job(self.path, self.config, s, self.latent_shape, self.text, cfg, args.steps,
                               self.conditioning)
                try:
                    res = run_config(where, job, args.threads, self._client(where))
                except ConfigError as exc:  # a row the runtime refuses is reported, and the grid goes on
                    say(f"[{rep + 1}/{args.repeats}] {row_label(s, cfg)} on {where}: not applicable ({exc})")
                    if rep == 0:
                        self.not_applicable.append({"label": row_label(s, cfg), "reason": str(exc)})
                    continue
                res["capacity"] = cap
                runs = best.get(idx, {}).get("runs", []) + [{"step_s": res["step_s"], "job_s": res["job_s"],
                                                              "capacity": cap}]
                least_work = min(res["cpu_step_s"], best[idx]["cpu_step_s"]) if idx in best else res["cpu_step_s"]
                if idx not in best or res["step_s"] < best[idx]["step_s"]:
                    best[idx] = res
                best[idx]["runs"], best[idx]["cpu_step_s"] = runs, least_work  # the least work any run needed
                say(f"[{rep + 1}/{args.repeats}] {row_label(s, cfg)} on {where}: {res['step_s'] * 1e3:.0f} ms/step, "
                    f"job {res['job_s']:.1f} s" + (f", cores available to {s.world_size} workers: {cap:.2f}" if cap else ""))
        return best, inproc_runs, call_runs

    def _serial_references(self, rep: int, cfg: float, inproc_runs: list, call_runs: list) -> None:
        """Run right before the 1-worker run they are compared with: the same denoise in-process (no runtime), and
        one runtime job per model call (a stock KSampler's way in)."""
        args = self.args
        t = run_in_process(self.path, self.latent_shape, self.text, cfg, args.steps, args.threads)
        inproc_runs.append(t)
        self.say(f"[{rep + 1}/{args.repeats}] serial in-process (no runtime): {t * 1e3:.0f} ms/step")
        calls = run_calls(self.path, self.config, self.latent_shape, self.text, cfg, args.steps, args.threads,
                          client=self._client("cpu:1"))
        call_runs.append(statistics.median(calls))
        self.say(f"[{rep + 1}/{args.repeats}] serial, one runtime job per model call (stock KSampler's way in): "
                 f"{call_runs[-1] * 1e3:.0f} ms/call")

    def _results(self, rows, best):
        """Each row's best run with its analytic traffic, projection and activation estimate; the serial runs by cfg."""
        args, config, shape = self.args, self.config, self.latent_shape
        results, serial, total_params = [], {}, None
        for idx, (s, cfg) in enumerate(rows):
            if idx not in best:  # refused by the runtime (reported as not applicable)
                continue
            res = best[idx]
            res.update(strategy=s, cfg=cfg, label=row_label(s, cfg))
            if s.world_size == 1:
                serial[round(cfg, 6)] = res
                total_params = res["stats"][0]["param_bytes"]
            # A sharded row's block gathers: the bench file's weights are held in the compute dtype.
            shapes = shapes_of(config, image_tokens=self.image_tokens, text_tokens=self.seq_text,
                               pipefusion=s.pipefusion_degree, batch=shape[0], act_bytes=self.act_bytes,
                               weight_bytes=self.act_bytes if s.sharded else 0.0)
            analytic = job_traffic(s, shapes, steps=args.steps, cfg=cfg)
            ok, worst = compare([st["traffic"] for st in res["stats"]], analytic, TARGET_TRAFFIC)
            res.update(analytic=analytic, traffic_ok=ok, traffic_diff=worst)
            if self.calib is not None:
                res["projected_step_s"] = costmodel.project(s, config, self.calib, cfg=cfg, steps=args.steps,
                                                            batch=shape[0], act_bytes=self.act_bytes).step_s
            res["act_est"] = costmodel.rank_memory(s, config, text_tokens=self.seq_text, image_tokens=self.image_tokens,
                                                   batch=shape[0], cfg=cfg, weight_bytes=self.act_bytes,
                                                   act_bytes=self.act_bytes)["activations"]
            results.append(res)
        return results, serial, total_params

    def _vae_decode(self, results: list[dict], serial: dict) -> dict | None:
        """Time the VAE decode of this latent apart from the DiT (bench/vae.py), print it on its own line, and
        what a timing with the decode inside would have read for the fastest exact 2+ worker row."""
        from .vae import describe, dilution, time_decode

        wanted = self.args.vae_frames or str(CPU_LATENT_FRAMES)
        self.say("")
        if wanted == "0" or self.latent_shape[1] != 16:
            self.say("VAE decode: not timed (" + ("--vae-frames 0" if wanted == "0" else "only the Wan 2.1 VAE's "
                     "16-channel latent is timed") + ")")
            return None
        rec = time_decode(self.latent_shape, None if wanted == "all" else int(wanted))
        self.say(describe(rec))
        exact = [r for r in results if r["strategy"].world_size > 1 and r["strategy"].exact
                 and round(r["cfg"], 6) in serial]
        if exact:
            row = max(exact, key=lambda r: r["speedup"])
            steps = self.args.steps
            serial_job, row_job = serial[round(row["cfg"], 6)]["step_s"] * steps, row["step_s"] * steps
            rec["diluted"] = {"label": row["label"], "speedup": row["speedup"],
                              "with_decode": dilution(rec, serial_job, row_job)}
            self.say(f"  a timing with this decode inside would read {row['label']} as "
                     f"{rec['diluted']['with_decode']:.2f}x instead of its DiT's {row['speedup']:.2f}x ({steps} steps: "
                     f"{serial_job:.1f} s serial, {row_job:.1f} s {row['label']}, + {rec['whole_s']:.0f} s decode each; "
                     f"the DiT here is the scaled-down bench model, the VAE is full size)")
        return rec

    def _model_call_target(self, call_runs: list, inproc: float | None) -> None:
        name = "model call through the runtime at 1 worker <= 5% over in-process"
        if call_runs and inproc is not None:
            over = min(call_runs) / inproc - 1
            self.target(name, over <= TARGET_OVERHEAD,
                        f"call {min(call_runs) * 1e3:.0f} ms vs in-process step {inproc * 1e3:.0f} ms: {over:+.1%}")
        else:
            self.target(name, None, "not measured")

    def _report_targets(self) -> None:
        args, conditions = self.args, []
        # The targets' stated sizes: 4096 image tokens (1024x1024); a video's >= 8,000 tokens (long sequences); the
        # cache's are stated on the trained demo model at any size.
        stated = ">= 8000 video tokens" if self.video else "4096 image tokens"
        if args.cache is None and ((self.image_tokens < 8000) if self.video else (self.image_tokens != 4096)):
            conditions.append(f"{self.image_tokens} {self.tokens_name} tokens, not {stated}")
        if self.kind != "cpu" or args.threads != 1:
            conditions.append("not CPU workers with 1 thread")
        if args.cache is not None:
            stated = "the trained demo model"
            if args.model != TOY:
                conditions.append(f"model {self.model_name.split(' (')[0]}, not the trained demo model (--model toy)")
        else:
            stated = f"the family's bench model, {stated}"
            if args.model not in ("bench", *BENCH_FAMILIES) or args.blocks or args.width:
                blocks = " with --blocks " + args.blocks if args.blocks else ""
                blocks += f" at width {args.width}" if args.width else ""
                conditions.append(f"model {self.model_name.split(' (')[0]}{blocks}, not a family's bench model")
        self.say("")
        self.say("Targets" + (f" (conditions differ from the stated ones: {'; '.join(conditions)})" if conditions else
                              f" (2-core CPU, 1 thread per worker, {stated})") + ":")
        for t in self.targets:
            self.say(f"  [{t['status']:4}] {t['target']}: {t['detail']}")

    def _report_auto(self, auto_pick, auto_reason, record: dict) -> None:
        """Auto's pick against the best measured, then the GPU projection (the released model's shapes after a
        bench model ran; a video family's at its released sizes, with xDiT's published figures beside)."""
        args, say, auto_record = self.args, self.say, record["auto"]
        say("")
        if auto_pick is not None:
            say(f"Auto: {auto_pick.label()} — {auto_reason}")
            if "pick_step_s" in auto_record:
                say(f"  auto's pick measured {auto_record['pick_step_s'] * 1e3:.0f} ms/step "
                    f"({auto_record['pick_speedup']:.2f}x serial)"
                    + (f"; best measured at cfg {args.cfg:g} on {self.max_world} workers: {auto_record['best_label']} "
                       f"({auto_record['best_step_s'] * 1e3:.0f} ms/step)" if "best_label" in auto_record else ""))
        say(f"Cost model inputs measured here: {self.calib.describe()}")
        proj_config, proj_name = RELEASE_SHAPES.get(args.model, (FLUX_DEV, "FLUX.1-dev shapes (width 3072, 19 + 38 blocks)"))
        if args.model not in NAMED_MODELS:
            proj_config, proj_name = self.config, "this model"
        elif args.model in RELEASE_VIDEO_SIZES:
            record["projection"] = video_projection(say, proj_config, proj_name, RELEASE_VIDEO_SIZES[args.model],
                                                    self.seq_text, args.cfg, args.gpu_tflops)
            record["xdit_published"] = xdit_published(say)
            return
        plane = (*self.latent_shape[:2], *latent_plane(self.latent_shape[2:]))  # a video's frames stack their rows
        record["projection"] = gpu_projection(say, proj_config, proj_name, plane, self.seq_text, self.image_tokens,
                                              args.cfg, args.gpu_tflops)

    def _finish(self, record: dict) -> int:
        record["seconds"] = time.perf_counter() - self.t_start
        self.say("")
        self.say(f"bench finished in {record['seconds']:.0f} s")
        if self.args.json:
            text_out = json.dumps(record, indent=1, default=str)
            if self.args.json == "-":
                print(text_out, flush=True)
            else:
                with open(self.args.json, "w") as f:
                    f.write(text_out)
        failed = any(t["status"] == "FAIL" for t in self.targets)
        return 1 if (self.args.strict and failed) else 0
