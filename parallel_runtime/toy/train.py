"""`python -m parallel_runtime.toy.train --out DIR`: train the demo model on this CPU, deterministically.

Rectified flow exactly as the runtime samples it (sampling/flow.py, models/flux_adapter.py): the model sees
x = sigma * noise + (1 - sigma) * x0 in model latent space (process_latent_in space, which the codec's
channels are) and predicts the velocity v = noise - x0, so that denoised = x - sigma * v; the
timestep goes in as sigma * 1000 and sigma is drawn through the same shift (1.15) as the "dev" sigma table
the sampler's schedules pick from. The forward pass is the runtime's own: FluxAdapter's pack, embeddings,
RoPE ids, blocks and head.

Steps are 8 images of 256x256, and from half-way on every other step is 2 images of 512x512 (the demo's
size), with the size in the pooled vector (text.py). A scene is fixed by its words (no jitter), so from
pure noise the right answer is one picture, not a blur of many: that, a quarter of the draws near pure
noise, and the codec's position channels (codec.py) are what make "top left" learnable in minutes. One
prompt in ten becomes the empty prompt, the negative prompt of cfg > 1. About 15 minutes on 2 cores.

Deterministic: fixed seeds, a fixed torch thread count and data drawn from a seeded generator, so the same
command on the same machine and torch build writes the same file. Writes DIR/toy-flux.safetensors (BFL keys,
fp16, the exact command in its metadata) and DIR/toy-text.safetensors (the word embeddings).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

import numpy as np
import torch
from safetensors.torch import save_file

from ..models.families.flux import FluxConfig
from ..models.families.flux_adapter import FluxAdapter
from ..sampling.flow import flux_time_shift, model_sampling_for
from ..strategies.attention.processor import AttentionContext
from . import CODEC_FILE, MODEL_FILE, TOY_FLUX, WEIGHTS_DIR, scenes
from .codec import ColourGrid
from .export import save_bfl
from .text import ToyTextEncoder, make_embeddings

# Most steps are 8 images of 256x256 (256 tokens each), where what the words mean is learnt cheaply; from
# LARGE_FROM on, every other step is 2 images of 512x512, the demo's size, so that where things go on the
# larger canvas is seen, not extrapolated to (the pooled vector tells the model the size, see text.py).
SMALL = (256, 8)  # (side in pixels, images)
LARGE = (512, 2)
LARGE_FROM = 0.5  # fraction of the steps
DROP_PROMPT = 0.10  # whole prompt -> empty prompt (the unconditional branch of cfg)
DROP_ATTRIBUTE = 0.0  # each attribute left unsaid on its own
GUIDANCE_RANGE = (1.0, 6.0)
HIGH_NOISE_SHARE = 0.25


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime.toy.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=WEIGHTS_DIR, help=f"output folder (default {WEIGHTS_DIR})")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (fixed: results depend on it)")
    ap.add_argument("--log-every", type=int, default=100)
    return ap.parse_args(argv)


# -------------------------------------------------------------------------------------------------
# Model


def init_model(config: FluxConfig, seed: int):
    """diffusers' Flux with adaLN-zero: every block starts as the identity and the output at zero (as DiT),
    and a guidance embedding that stays exactly zero: the toy model is not guidance-distilled, cfg guides."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**config.diffusers_kwargs())
    zero = [m for n, m in model.named_modules() if n.endswith(("norm1.linear", "norm1_context.linear", "norm.linear"))]
    zero += [model.norm_out.linear, model.proj_out]
    if config.guidance_embeds:
        zero.append(model.time_text_embed.guidance_embedder.linear_2)
    for module in zero:
        torch.nn.init.zeros_(module.weight)
        torch.nn.init.zeros_(module.bias)
    if config.guidance_embeds:
        model.time_text_embed.guidance_embedder.requires_grad_(False)
    return model


def velocity(adapter: FluxAdapter, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, pooled: torch.Tensor,
             guidance: torch.Tensor) -> torch.Tensor:
    """The runtime's serial forward (Denoiser._run_sequence_parallel) on a batch: v as packed tokens."""
    _, _, h, w = x.shape
    temb = adapter.timestep_embedding(sigma, pooled, guidance)
    tokens = adapter.pack(x)
    image = adapter.embed_image(tokens, torch.arange(tokens.shape[1]), (h, w))
    image, _ = adapter.run_blocks(image, adapter.embed_text(cond), temb, adapter.rope(cond.shape[1], h, w))
    return adapter.head(image, temb)


# -------------------------------------------------------------------------------------------------
# Data


def draw_batch(rng: np.random.Generator, codec: ColourGrid, text: ToyTextEncoder, size: int, count: int):
    """`count` seeded random scenes of size x size pixels: (x0 in model latent space, cond, pooled)."""
    images, words = [], []
    for _ in range(count):
        scene = scenes.random_scene(rng)
        images.append(torch.from_numpy(scenes.render(scene, size, size)).permute(2, 0, 1))
        if rng.random() < DROP_PROMPT:
            words.append([])
        else:
            words.append(scene.words({a: rng.random() >= DROP_ATTRIBUTE for a in scenes.ATTRIBUTES}))
    cond, pooled = text.encode_words(words, size, size)
    return codec.encode(torch.stack(images)), cond, pooled


def micro_batch(step: int, steps: int) -> tuple[int, int]:
    return LARGE if step >= LARGE_FROM * steps and step % 2 else SMALL


def draw_sigmas(rng: np.random.Generator, n: int, shift: float) -> torch.Tensor:
    """sigma = flux_time_shift(shift, t) with t uniform (the distribution of the dev sigma table, and so of
    the sigmas the "simple" schedule visits), except that a quarter of the draws are near pure noise: that is
    where what the words say has to be learnt (from noise alone), and it is learnt last."""
    t = rng.uniform(1e-4, 1.0, size=n)
    sigma = [flux_time_shift(shift, 1.0, float(v)) for v in t]
    high = rng.random(n) < HIGH_NOISE_SHARE
    return torch.tensor([float(rng.uniform(0.9, 1.0)) if h else s for h, s in zip(high, sigma)], dtype=torch.float32)


# -------------------------------------------------------------------------------------------------
# Training


def flow_loss(adapter: FluxAdapter, x0: torch.Tensor, cond: torch.Tensor, pooled: torch.Tensor,
              rng: np.random.Generator, gen: torch.Generator, shift: float) -> torch.Tensor:
    """Rectified-flow velocity loss on one micro-batch at sigmas drawn as the sampler visits them."""
    n = x0.shape[0]
    sigma = draw_sigmas(rng, n, shift)
    guidance = torch.tensor(rng.uniform(*GUIDANCE_RANGE, size=n), dtype=torch.float32)
    noise = torch.randn(x0.shape, generator=gen)
    s = sigma.view(n, 1, 1, 1)
    x = s * noise + (1 - s) * x0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls: ~2x the fp32 speed on AVX-512 CPUs
        v = velocity(adapter, x, sigma, cond, pooled, guidance)
    return torch.nn.functional.mse_loss(v.float(), FluxAdapter.pack(noise - x0))


def learning_rate(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(config: FluxConfig, steps: int, lr: float, seed: int, codec: ColourGrid, text: ToyTextEncoder,
          log_every: int = 100, log=print, snapshot=None):
    """Returns the EMA model; `snapshot(step, ema)` (optional) is called at each log line."""
    model = init_model(config, seed)
    adapter = FluxAdapter(config, model, [range(config.num_layers + config.num_single_layers)], AttentionContext())
    ema = copy.deepcopy(model).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    shift = model_sampling_for(config.variant).shift
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    t0, running = time.perf_counter(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        opt.zero_grad(set_to_none=True)
        size, count = micro_batch(step, steps)
        loss = flow_loss(adapter, *draw_batch(rng, codec, text, size, count), rng, gen, shift)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - decay)
        running.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            log(f"step {step + 1}/{steps}  loss {np.mean(running):.4f}  lr {learning_rate(step, steps, lr):.2e}  "
                f"{time.perf_counter() - t0:.0f} s")
            running = []
            if snapshot is not None:
                snapshot(step + 1, ema)
    return ema


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    # Under bf16 autocast RMSNorm's weight stays fp32, which only costs the fused kernel; say it once, not per op.
    warnings.filterwarnings("once", message="Mismatch dtype between input and weight")
    command = " ".join(["python -m parallel_runtime.toy.train", *argv])
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()

    embeddings = make_embeddings(TOY_FLUX.context_dim, TOY_FLUX.pooled_dim)
    codec_path = os.path.join(args.out, CODEC_FILE)
    save_file(embeddings, codec_path, metadata={"paradit_toy_train_command": command})
    print(f"word embeddings -> {codec_path}", flush=True)

    model = train(TOY_FLUX, args.steps, args.lr, args.seed, ColourGrid(), ToyTextEncoder(embeddings),
                  log_every=args.log_every, log=lambda s: print(s, flush=True))
    path = save_bfl(os.path.join(args.out, MODEL_FILE), TOY_FLUX, model.state_dict(),
                    {"paradit_toy_train_command": command, "paradit_toy_codec": CODEC_FILE})
    check_round_trip(path, model)
    print(f"model -> {path}; trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def check_round_trip(path: str, model) -> None:
    """The written file, read back through the runtime's loader, holds the trained weights (to fp16)."""
    from ..models.families.flux_adapter import load_flux

    config, loaded = load_flux(path)
    if config != TOY_FLUX:
        raise RuntimeError(f"{path} reads back as {config}, not {TOY_FLUX}")
    trained = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        if not torch.equal(tensor, trained[name].half().float()):
            raise RuntimeError(f"{path}: {name} does not read back as written")


if __name__ == "__main__":
    sys.exit(main())
