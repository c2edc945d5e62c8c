"""Every model family under every strategy: tiny random checkpoints in ComfyUI's key layout, CPU/gloo workers.

Test ids carry the family (`chroma`, `sd3`, ...), so `pytest -k chroma` runs one family alone. What each
family's numbers are checked against:
  * world 1 vs ComfyUI's own model class: tests/test_comfyui_integration.py (KSampler parity in a real host);
  * exact strategies at 2 and 4 workers vs 1 worker: here (EXACT_RTOL);
  * PipeFusion's stale K/V vs naive patch parallel: here.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_err
from parallel_runtime.models.families.chroma import ChromaConfig
from parallel_runtime.models.registry import read_model
from parallel_runtime.models.families.flux import FluxConfig
from parallel_runtime.weights.checkpoint import CheckpointReader
from parallel_runtime.models.families.pixart import PixArtConfig
from parallel_runtime.models.families.qwen_image import QwenImageConfig
from parallel_runtime.models.families.sd3 import SD3Config
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.planning.traffic import job_traffic, shapes_of
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S

pytestmark = pytest.mark.timeout(600)

# fp32 parity bound, as in tests/test_parallel.py: exact strategies change only summation order (attention
# over split K/V merged by log-sum-exp, matmuls over fewer rows), ~1e-7 relative per op; any layout,
# position or modulation-row bug shows up at 1e-2 or more.
EXACT_RTOL = 1e-4

# One small config per family: 2 heads (Ulysses-2 needs heads divisible by 2), widths that keep a CPU
# step in milliseconds, block counts that give PipeFusion-2 and -4 something to split.
FAMILIES = {
    "chroma": ChromaConfig(hidden_size=64, num_heads=2, head_dim=32, num_layers=2, num_single_layers=2,
                           context_dim=32, approximator_hidden=32, approximator_layers=2),
    # SD3.5 Large-like (q/k norms, no second attention); 2 heads of 64.
    "sd3": SD3Config(hidden_size=128, num_layers=4, pos_embed_max_size=16, context_dim=32, pooled_dim=24),
    # SD3.5 Medium-like: the image-only second attention on the first blocks (a pre-only block last).
    "sd3_medium_dual": SD3Config(hidden_size=128, num_layers=4, pos_embed_max_size=16, context_dim=32, pooled_dim=24,
                                 dual_attention_layers=(0, 1, 2)),
    # Flux Kontext: a Flux.1 dev file whose conditioning carries ReferenceLatent latents.
    "kontext": FluxConfig(hidden_size=64, num_heads=2, head_dim=32, num_layers=2, num_single_layers=2,
                          context_dim=32, pooled_dim=24),
    # Qwen-Image Edit: double blocks only, centred RoPE, the Wan latent (5D in ComfyUI), two references.
    "qwen_image": QwenImageConfig(hidden_size=64, num_heads=2, head_dim=32, num_layers=4, context_dim=32),
    # PixArt-α-like: cross-attention to the prompt, size/aspect micro-conditions, eps prediction with a learned
    # variance, 4-channel SD1.5 latent; 2 heads of 72. No stored position table, so pe_interpolation follows
    # the image as in a diffusers-layout file (a table pins it: checked against ComfyUI in the host tests).
    "pixart": PixArtConfig(hidden_size=144, num_layers=4, micro_condition=True, caption_channels=32),
}

# Reference latents per family that reads them: two of other sizes than the 16 x 24 latent, the second with
# odd sides (ComfyUI pads it circularly to the patch size): 30 + 35 reference tokens beside 96 image tokens.
REFERENCE_SHAPES = {"kontext": ((1, 16, 12, 10), (1, 16, 9, 14)), "qwen_image": ((1, 16, 12, 10), (1, 16, 9, 14))}

BATCH, HEIGHT, WIDTH = 2, 16, 24  # batch 2 and a non-square latent (8 x 12 patches)
# PixArt's position grid scales to a base size of (h + w) / 2 rounded to 64 latent px: below 32 that base is 0
# and every position row is the same (as in ComfyUI), so PixArt runs where positions differ: 16 x 24 patches.
LATENT_SIZE = {"pixart": (32, 48)}


def latent_shape(name: str) -> tuple[int, ...]:
    return (BATCH, FAMILIES[name].latent_channels, *LATENT_SIZE.get(name, (HEIGHT, WIDTH)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = str(tmp_path_factory.mktemp(name) / f"tiny-{name}.safetensors")
    write_checkpoint(path, FAMILIES[name], seed=11, prefix="model.diffusion_model.")
    return name, path


def conditioning(config, seed: int, text_len: int = 7, guidance: float | None = None, references=(),
                 method: str | None = None) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, text_len, config.context_dim, generator=g),
                        torch.randn(1, config.pooled_dim, generator=g), guidance=guidance,
                        references=tuple(torch.randn(*shape, generator=g) for shape in references),
                        reference_method=method)


def job(family, strategy=None, steps: int = 6, cfg: float = 2.0, **sampling) -> Job:
    name, path = family
    config = FAMILIES[name]
    sp = dict(seed=3, steps=steps, cfg=cfg, sampler_name="euler", scheduler="simple", denoise=1.0) | sampling
    # text_len 7 is odd: text shards are uneven under every sequence-parallel degree. The positive sets a
    # guidance (FluxGuidance), the negative leaves the family's default. Both carry the same references
    # (ReferenceLatent before the negative's encode), so PipeFusion can batch them.
    refs = REFERENCE_SHAPES.get(name, ())
    positive = conditioning(config, 1, guidance=2.5, references=refs)
    negative = dataclasses.replace(conditioning(config, 2), references=positive.references)
    return Job(ModelSpec(path), strategy or S(), SamplingSpec(**sp), torch.zeros(latent_shape(name)),
               positive, negative)


def assert_two_workers_equal_one(client1, client2, name: str, path: str, strategy, stage_bytes) -> None:
    """`path` under `strategy` on 2 workers equals 1 worker within EXACT_RTOL; under PipeFusion each stage holds
    its blocks: within 5% of `stage_bytes(path, stage, stages)`."""
    serial = client1.run(job((name, path))).latent
    result = client2.run(job((name, path), strategy))
    assert rel_err(result.latent, serial) <= EXACT_RTOL
    if strategy.pipefusion_degree > 1:
        for rank, st in enumerate(result.stats):
            assert abs(st["param_bytes"] / stage_bytes(path, rank, 2) - 1) <= 0.05


@pytest.fixture(scope="module")
def serial(family, client1):
    return client1.run(job(family)).latent


def test_detected_from_its_keys(family):
    name, path = family
    with CheckpointReader(path) as reader:
        found, match, config = read_model(reader)
    assert (found.name, match.prefix, config) == (FAMILIES[name].family, "model.diffusion_model.", FAMILIES[name])


def test_serial_result_is_a_real_sample(family, serial):
    # As KSampler returns it: a video VAE's latent format (Qwen-Image's Wan 2.1) keeps a frame axis.
    frames = (1,) if getattr(FAMILIES[family[0]], "latent_dimensions", 2) == 3 else ()
    b, c, h, w = latent_shape(family[0])
    assert serial.shape == (b, c, *frames, h, w) and torch.isfinite(serial).all()
    assert rel_err(serial[0], serial[1]) > 0.1  # batch items get their own noise


@pytest.mark.parametrize("strategy", [
    S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(pipefusion_degree=2, warmup_steps=6),
], ids=lambda s: s.label())
def test_two_rank_strategies_match_serial(family, serial, client2, strategy):
    assert rel_err(client2.run(job(family, strategy)).latent, serial) <= EXACT_RTOL


@pytest.mark.parametrize("strategy", [
    S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ulysses_degree=2), S(cfg_degree=2, ring_degree=2),
    S(pipefusion_degree=2, ulysses_degree=2, warmup_steps=6), S(pipefusion_degree=4, warmup_steps=6),
], ids=lambda s: s.label())
def test_four_rank_strategies_match_serial(family, serial, client4, strategy):
    assert rel_err(client4.run(job(family, strategy)).latent, serial) <= EXACT_RTOL


def test_stale_kv_is_closer_than_naive_patch(family, serial, client4):
    stale = client4.run(job(family, S(pipefusion_degree=4, num_pipeline_patch=4, warmup_steps=1))).latent
    naive = client4.run(job(family, S(naive_patch_degree=4))).latent
    e_stale, e_naive = rel_err(stale, serial), rel_err(naive, serial)
    print(f"\n{family[0]}: stale K/V {e_stale:.2e}, naive patch {e_naive:.2e}")
    assert e_stale > EXACT_RTOL, "patched steps should be approximate, else the test measures nothing"
    assert e_stale < e_naive, (e_stale, e_naive)


@pytest.mark.parametrize("strategy", [
    S(ulysses_degree=2), S(ring_degree=2), S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1),
], ids=lambda s: s.label())
def test_measured_bytes_match_analytic(family, client2, strategy):
    """The runtime's byte counters against traffic.py per family: SD3.5 Medium's image-only attn2 moves image
    rows only, PixArt's cross-attended prompt never travels. Reference tokens (Kontext, Qwen-Image Edit) are
    not in the formulas, so those families run without them here."""
    name, _ = family
    config = FAMILIES[name]
    j = dataclasses.replace(job(family, strategy, steps=3), positive=conditioning(config, 1),
                            negative=conditioning(config, 2))
    measured = [st["traffic"] for st in client2.run(j).stats]
    h, w = LATENT_SIZE.get(name, (HEIGHT, WIDTH))
    shapes = shapes_of(config, image_tokens=(h // 2) * (w // 2), text_tokens=7,
                       pipefusion=strategy.pipefusion_degree, batch=BATCH)
    analytic = job_traffic(strategy, shapes, steps=3, cfg=2.0)
    for got, want in zip(measured, analytic):  # per op, exactly: every row and layer is counted
        assert {op: tuple(v) for op, v in got["by_op"].items()} == \
            {op: tuple(v) for op, v in want.by_op().items()}, (name, strategy.label())


@pytest.fixture(scope="module")
def serial_unequal(family, client1):
    """cfg 2 with a negative prompt of another length (T5-only encoders do not pad): two forward passes."""
    return client1.run(unequal(family, S())).latent


def unequal(family, strategy) -> Job:
    j = job(family, strategy)
    return dataclasses.replace(j, negative=conditioning(FAMILIES[family[0]], 2, text_len=4))


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2)],
                         ids=lambda s: s.label())
def test_prompts_of_different_lengths_match_serial(family, serial, serial_unequal, client2, strategy):
    assert rel_err(client2.run(unequal(family, strategy)).latent, serial_unequal) <= EXACT_RTOL
    assert rel_err(serial_unequal, serial) > 1e-3  # the shorter negative really is another prompt


def test_diffusers_layout_gives_the_same_latent(family, serial, client2, tmp_path):
    name, _ = family
    path = write_checkpoint(str(tmp_path / "diffusers.safetensors"), FAMILIES[name], seed=11, layout="diffusers",
                            prefix="transformer.")
    out = client2.run(dataclasses.replace(job(family, S(ulysses_degree=2)), model=ModelSpec(path))).latent
    assert rel_err(out, serial) <= EXACT_RTOL


# ---------------------------------------------------------------------------------------------------
# Kontext: reference latents placed as ComfyUI places them, and a negative without them.

@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kontext") / "tiny-kontext.safetensors")
    write_checkpoint(path, FAMILIES["kontext"], seed=11, prefix="model.diffusion_model.")
    return "kontext", path


def kontext_job(kontext, strategy=None, method=None, negative_refs=True) -> Job:
    j = job(kontext, strategy)
    positive = dataclasses.replace(j.positive, reference_method=method)
    negative = dataclasses.replace(j.negative, references=j.negative.references if negative_refs else (),
                                   reference_method=method if negative_refs else None)
    return dataclasses.replace(j, positive=positive, negative=negative)


@pytest.fixture(scope="module")
def kontext_serial(kontext, client1):
    return {(method, neg): client1.run(kontext_job(kontext, method=method, negative_refs=neg)).latent
            for method in (None, "index", "uxo") for neg in (True, False)}


def test_kontext_reference_methods_and_refless_negative_change_the_result(kontext_serial):
    base = kontext_serial[(None, True)]
    for key, latent in kontext_serial.items():
        if key != (None, True):
            assert rel_err(latent, base) > 1e-3, key  # each placement (and dropping them) really is another input


@pytest.mark.parametrize("method", [None, "index", "uxo"])
@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2), S(cfg_degree=2)],
                         ids=lambda s: s.label())
def test_kontext_negative_without_references_matches_serial(kontext, kontext_serial, client2, strategy, method):
    out = client2.run(kontext_job(kontext, strategy, method=method, negative_refs=False)).latent
    assert rel_err(out, kontext_serial[(method, False)]) <= EXACT_RTOL


def test_kontext_pipefusion_runs_a_negative_without_references_in_its_own_lane(kontext, kontext_serial, client2):
    """Two token layouts, two pipeline lanes through the same stages (tests/test_pipefusion_lanes.py has more)."""
    out = client2.run(kontext_job(kontext, S(pipefusion_degree=2, warmup_steps=6), negative_refs=False)).latent
    assert rel_err(out, kontext_serial[(None, False)]) <= EXACT_RTOL


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in REFERENCE_SHAPES])
def test_references_are_refused_by_families_that_do_not_read_them(name, tmp_path):
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.validate import validate_job

    path = write_checkpoint(str(tmp_path / f"{name}.safetensors"), FAMILIES[name], seed=1)
    j = job((name, path))
    refs = (torch.randn(1, 16, 8, 8),)
    with pytest.raises(ConfigError, match="carries reference latents.*does not read; remove the ReferenceLatent"):
        validate_job(dataclasses.replace(j, positive=dataclasses.replace(j.positive, references=refs)), 1)


def test_pixart_size_conditioning_reaches_every_strategy(client1, client2, tmp_path):
    """PixArt-α embeds the (height, width, aspect) a text encode node attached (CLIPTextEncodePixArtAlpha) per
    branch; it survives the control channel and every strategy, and it changes the sample."""
    path = write_checkpoint(str(tmp_path / "pixart.safetensors"), FAMILIES["pixart"], seed=1)
    plain = job(("pixart", path), steps=3)
    sized = dataclasses.replace(plain, positive=dataclasses.replace(plain.positive, image_size=(768.0, 1024.0, 0.75)))
    ref, ref_plain = client1.run(sized).latent, client1.run(plain).latent
    assert rel_err(ref, ref_plain) > 1e-3
    for strategy in (S(cfg_degree=2), S(ulysses_degree=2), S(pipefusion_degree=2, warmup_steps=3)):
        assert rel_err(client2.run(dataclasses.replace(sized, strategy=strategy)).latent, ref) <= EXACT_RTOL


def test_pixart_refuses_images_too_small_for_its_positions(tmp_path):
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.validate import validate_job

    path = write_checkpoint(str(tmp_path / "pixart.safetensors"), FAMILIES["pixart"], seed=1)
    j = job(("pixart", path))
    validate_job(dataclasses.replace(j, latent=torch.zeros(1, 4, 32, 34)), 1)  # average side 33: base 64 px
    # 256 x 256 px: ComfyUI's base size rounds to 0 and its PixArt divides by it; ours says so first.
    with pytest.raises(ConfigError, match="256x256 px but PixArt-α has no positions below an average side of 264 px"):
        validate_job(dataclasses.replace(j, latent=torch.zeros(1, 4, 32, 32)), 1)


@pytest.mark.parametrize("bad, message", [
    (dict(references=(torch.randn(1, 4, 8, 8),)), r"shape \(1, 4, 8, 8\), not \[batch, 16, height/8"),
    (dict(references=(torch.full((1, 16, 8, 8), float("nan")),)), "NaN/Inf"),
    (dict(reference_method="sideways"), "method 'sideways' is unknown; choose one of offset, index, uxo"),
])
def test_bad_reference_latents_fail_with_one_sentence(kontext, bad, message):
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.validate import validate_job

    j = job(kontext)
    with pytest.raises(ConfigError, match=message):
        validate_job(dataclasses.replace(j, positive=dataclasses.replace(j.positive, **bad)), 1)
