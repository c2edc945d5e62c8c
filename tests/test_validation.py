"""Every bad input fails before work starts, with one sentence that names the fix."""
from __future__ import annotations

import pytest
import torch

from conftest import make_job
from parallel_runtime.runtime.client import RuntimeClient
from parallel_runtime.distributed.devices import parse_devices
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.runtime.protocol import decode, encode
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.distributed.topology import Topology, stage_speeds, validate_strategy
from parallel_runtime.distributed.stages import balanced_stages, split_stages
from parallel_runtime.validate import validate_job
from parallel_runtime.strategies.layout import TokenLayout, split_range, weighted_counts


def one_sentence(msg: str) -> bool:
    return msg.endswith(".") and msg.count(". ") == 0 and "\n" not in msg


@pytest.mark.parametrize("strategy,world,kw,pattern", [
    (S(ulysses_degree=2, ring_degree=2), 2, {}, r"= 4 ranks, but the loader has 2 device\(s\); choose degrees whose product is 2"),
    (S(ulysses_degree=3), 3, {"heads": 4}, r"ulysses_degree=3 does not divide the model's 4 attention heads; pick a divisor of 4"),
    (S(pipefusion_degree=2, num_pipeline_patch=80), 2, {"latent_hw": (16, 16)}, r"num_pipeline_patch=80 exceeds the latent's 64 image tokens"),
    (S(tensor_degree=5), 5, {"heads": 24}, r"tensor_degree=5 does not divide the model's 24 attention heads"),
    (S(tensor_degree=2, ulysses_degree=4), 8, {"heads": 12}, r"ulysses_degree=4 does not divide the 6 heads each tensor-parallel rank holds"),
    (S(tensor_degree=4), 4, {"heads": 24, "mlp_hidden": 90}, r"does not divide the model's MLP width of 90"),
    (S(patch_degree=2, ulysses_degree=2), 4, {}, r"displaced patch parallel .* combines with cfg and tensor"),
    (S(patch_degree=2, warmup_steps=0), 2, {}, r"Displaced patch parallel needs warmup_steps >= 1"),
    (S(ring_degree=3, device_weights=(1, 2)), 3, {}, r"device_weights lists 2 weight\(s\) for 3 device"),
    (S(ring_degree=2, device_weights=(1, float("nan"))), 2, {}, r"must all be positive numbers"),
    (S(ulysses_degree=4), 4, {"latent_hw": (2, 2)}, r"1 image tokens \(16x16 px\) are fewer than the 4 ranks splitting them"),
    (S(pipefusion_degree=2, ulysses_degree=4, num_pipeline_patch=2), 8, {"latent_hw": (4, 4)},
     r"2 image tokens per pipeline patch \(32x32 px\) are fewer than the 4 ranks"),
    (S(), 1, {"latent_hw": (15, 16)}, r"multiples of 16 pixels"),
    (S(cfg_degree=2), 2, {"cfg_scale": 1.0}, r"cfg_degree=2 needs cfg > 1 .*set cfg_degree=1"),
    (S(pipefusion_degree=2, warmup_steps=0), 2, {}, r"set warmup_steps to 1 or more"),
    (S(pipefusion_degree=8), 8, {"num_blocks": 4}, r"exceeds the model's 4 transformer blocks"),
    (S(cfg_degree=3), 3, {}, r"set cfg_degree to 1 or 2"),
    (S(naive_patch_degree=2, ulysses_degree=2), 4, {}, r"cannot be combined"),
    (S(ulysses_degree=0), 0, {}, r"ulysses_degree=0 is not a positive integer"),
])
def test_strategy_errors_name_the_fix(strategy, world, kw, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        validate_strategy(strategy, world_size=world, **kw)
    assert one_sentence(str(info.value)), str(info.value)


def test_job_errors_are_raised_by_the_client_before_any_worker_starts(tiny_path, tmp_path):
    client = RuntimeClient("cpu:2", threads_per_worker=1)
    cases = [
        (make_job(tiny_path, S(ulysses_degree=3)), ConfigError, "loader has 2 device"),
        (make_job(tiny_path, S(ulysses_degree=2), sampler="lms"), ConfigError, "choose one of euler"),
        (make_job(tiny_path, S(ulysses_degree=2), scheduler="karras"), ConfigError, "choose one of simple"),
        (make_job(str(tmp_path / "nope.safetensors"), S(ulysses_degree=2)), ModelFileError, "does not exist"),
    ]
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(open(tiny_path, "rb").read()[:200])
    cases.append((make_job(str(corrupt), S(ulysses_degree=2)), ModelFileError, "not a valid safetensors"))
    wrong_channels = make_job(tiny_path, S(ulysses_degree=2), latent=torch.zeros(1, 4, 16, 16))
    cases.append((wrong_channels, ConfigError, "EmptySD3LatentImage"))
    try:
        for job, exc, text in cases:
            with pytest.raises(exc, match=text) as info:
                client.run(job)
            assert one_sentence(str(info.value)) or exc is ModelFileError, str(info.value)
        assert not client.procs, "validation must fail before workers are started"
    finally:
        client.shutdown()


def test_pickle_checkpoints_are_refused(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"not really")
    job = make_job(str(path))
    with pytest.raises(ModelFileError, match="safetensors"):
        validate_job(job, 1)


def test_devices_parse_and_errors():
    assert parse_devices("cpu:3") == ["cpu"] * 3
    for bad, text in (("gpu", "not understood"), ("cpu:0", "use cpu:1 to cpu:64"), ("0,0", "lists a GPU twice"),
                      ("7", "only 0 GPU")):
        with pytest.raises(ConfigError, match=text):
            parse_devices(bad)


def test_topology_layout_is_ulysses_innermost():
    t = Topology(cfg=2, pipefusion=2, ulysses=2)
    assert [t.coords(r)["ulysses"] for r in range(8)] == [0, 1] * 4
    assert [t.coords(r)["pipefusion"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [t.coords(r)["cfg"] for r in range(8)] == [0] * 4 + [1] * 4
    assert t.groups("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.groups("pipefusion") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert all(t.rank_of(**t.coords(r)) == r for r in range(8))


def test_token_layout_uneven_text_and_patch_shards():
    layout = TokenLayout(text_len=7, image_len=64, patches=4, shards=2, split_text=True)
    assert [len(layout.text_rows(i)) for i in range(2)] == [4, 3]
    assert layout.image_slice(1, 2) == slice(40, 48)
    pos = layout.positions(1, [0, 3])
    assert pos.tolist() == [4, 5, 6] + [7 + i for i in range(8, 16)] + [7 + i for i in range(56, 64)]
    # Every canonical row is owned exactly once across shards.
    rows = torch.cat([layout.positions(i, list(range(4)))[len(layout.text_rows(i)):] for i in range(2)])
    assert sorted(rows.tolist()) == list(range(7, 71))


def test_weighted_layout_gives_each_shard_its_share():
    # Weights 1:1:2 (two workers sharing a core beside one alone): the fast shard takes half of every cut.
    layout = TokenLayout(text_len=9, image_len=100, patches=1, shards=3, split_text=True, weights=(1.0, 1.0, 2.0))
    assert [len(range(*layout.image_slice(i, 0).indices(100))) for i in range(3)] == [25, 25, 50]
    assert [len(layout.text_rows(i)) for i in range(3)] == [2, 2, 5]  # cuts at round(9 x 1/4, 9 x 2/4)
    rows = torch.cat([layout.positions(i, [0]) for i in range(3)])
    assert sorted(rows.tolist()) == list(range(109))  # every row owned once, in shard order
    assert rows.tolist() == [0, 1] + list(range(9, 34)) + [2, 3] + list(range(34, 59)) + \
        [4, 5, 6, 7, 8] + list(range(59, 109))
    # A tiny weight still keeps one row (a ring hop with no keys would have nothing to attend).
    assert [len(split_range(10, 3, k, (1.0, 0.001, 1.0))) for k in range(3)] == [5, 1, 4]
    assert weighted_counts(24, (3.0, 2.0)) == [14, 10]  # heads by speed
    assert weighted_counts(6, (1.0, 1.0, 2.0)) == [2, 1, 3]  # cuts at round(1.5) = 2 and 3: near 1.5, 1.5, 3


def test_pipeline_patches_need_not_divide_the_token_rows():
    # ComfyUI's Flux dev template at 256x160: 10 token rows of 16, 160 tokens; 4 patches of 40 tokens each, 3 of
    # 54/53/53: near-equal token runs (no row rule), every token in exactly one patch and shard.
    for patches, sizes in ((4, [40] * 4), (3, [54, 53, 53]), (7, [23] * 6 + [22])):
        layout = TokenLayout(text_len=5, image_len=160, patches=patches, shards=2, split_text=True)
        assert [len(layout.patch_range(p)) for p in range(patches)] == sizes
        image = torch.cat([layout.image_index(i, [p]) for p in range(patches) for i in range(2)])
        assert image.tolist() == list(range(160))
    validate_strategy(S(pipefusion_degree=2, num_pipeline_patch=4), world_size=2, latent_hw=(20, 32))


def test_protocol_carries_tensors_shared_between_branches():
    shared = torch.randn(1, 16, 4, 4)  # one ReferenceLatent feeding both the positive and the negative
    _, _, tensors = decode(encode("job", {}, {"positive.reference.0": shared, "negative.reference.0": shared}))
    assert torch.equal(tensors["positive.reference.0"], shared) and torch.equal(tensors["negative.reference.0"], shared)


def test_protocol_carries_tensors_without_pickle():
    blob = encode("job", {"a": [1, 2]}, {"x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)})
    assert b"pickle" not in blob and b"\x80\x04" not in blob[:16]
    kind, meta, tensors = decode(blob)
    assert (kind, meta["a"], tensors["x"].dtype, tensors["x"].shape) == ("job", [1, 2], torch.bfloat16, (2, 3))


def test_pipeline_stages_balance_work_within_the_memory_cap():
    from parallel_runtime.distributed.stages import split_stages

    # Real Flux-dev: 19 double blocks (36 h^2 of weights) then 38 single (15 h^2); equal work per block.
    memory = [36] * 19 + [15] * 38
    for n in (2, 4, 8):
        stages = split_stages([1.0] * 57, n, memory)
        assert [r.start for r in stages][0] == 0 and stages[-1].stop == 57
        assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
        per_stage = [sum(memory[i] for i in r) for r in stages]
        assert max(per_stage) <= 1.15 * sum(memory) / n + 1e-9
    # Two stages: the fewest blocks the slowest stage can have under the 1.15x cap is 36 (of 57).
    assert max(len(r) for r in split_stages([1.0] * 57, 2, memory)) == 36
    # An infeasible cap falls back to the smallest achievable byte share.
    assert split_stages([1.0] * 3, 3, [10, 1, 1]) == [range(0, 1), range(1, 2), range(2, 3)]


def test_flux_pipeline_ranks_hold_two_interleaved_chunks_when_that_balances_work_and_weights():
    from parallel_runtime.models.families.flux import FluxConfig
    from parallel_runtime.models.families.flux_adapter import block_costs, pipeline_stages

    dev = FluxConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=19, num_single_layers=38)
    weights = block_costs(dev)
    for n in (2, 4):
        ranks = pipeline_stages(dev, n)
        blocks = sorted(i for chunks in ranks for r in chunks for i in r)
        assert blocks == list(range(57))  # every block exactly once
        per_rank_weights = [sum(weights[i] for r in chunks for i in r) for chunks in ranks]
        per_rank_work = [sum(len(r) for r in chunks) for chunks in ranks]
        assert max(per_rank_weights) <= 1.15 * sum(weights) / n
        # One contiguous chunk per rank could not do better than 36 of 57 blocks on one of two ranks.
        assert max(per_rank_work) <= -(-57 // n) + 1, per_rank_work
    # Equal blocks need no interleaving: one chunk per rank, fewest hops.
    equal = FluxConfig(hidden_size=128, num_heads=4, head_dim=32, num_layers=0, num_single_layers=8,
                       context_dim=64, pooled_dim=32)
    assert [len(chunks) for chunks in pipeline_stages(equal, 2)] == [1, 1]


def test_conditioning_mismatches_fail_before_any_worker_loads(tiny_path):
    import dataclasses

    from conftest import make_conditioning

    job = make_job(tiny_path, S(ulysses_degree=2))
    cases = [
        (dataclasses.replace(job, negative=None), "needs a negative conditioning"),
        (dataclasses.replace(job, extra={"batch_index": [0, 1]}), "batch_index lists 2 entries for 1 image"),
    ]
    for bad, text in cases:
        with pytest.raises(ConfigError, match=text):
            validate_job(bad, 2)
    # Prompts of different lengths run as separate forward passes (PipeFusion: one pipeline lane each).
    for strategy in (S(cfg_degree=2), S(pipefusion_degree=2)):
        validate_job(dataclasses.replace(job, strategy=strategy, negative=make_conditioning(2, text_len=9)), 2)


def _nan_cases(tiny_path):
    import dataclasses

    job = make_job(tiny_path, S(ulysses_degree=2))
    nan, inf = float("nan"), float("inf")

    def with_branch(name, **kw):
        return dataclasses.replace(job, **{name: dataclasses.replace(getattr(job, name), **kw)})

    bad_latent = torch.zeros(1, 16, 16, 16)
    bad_latent[0, 3, 2, 2] = nan
    bad_cond = job.positive.cond.clone()
    bad_cond[0, 1, 5] = inf
    bad_pooled = job.negative.pooled.clone()
    bad_pooled[0, 0] = nan
    return [
        (with_branch("sampling", cfg=nan), r"^cfg=nan is not a finite number; set cfg to a number"),
        (with_branch("sampling", cfg=inf), r"^cfg=inf is not a finite number"),
        (with_branch("sampling", denoise=nan), r"^denoise=nan is not a finite number; set denoise between 0 and 1"),
        (dataclasses.replace(job, latent=bad_latent), r"^the latent holds 1 NaN/Inf value\(s\) of 4096; re-create it"),
        (with_branch("positive", cond=bad_cond), r"^the positive conditioning holds 1 NaN/Inf value\(s\).*re-encode"),
        (with_branch("negative", pooled=bad_pooled), r"^the negative pooled vector holds 1 NaN/Inf"),
        (with_branch("positive", guidance=nan), r"^the positive conditioning's guidance=nan is not a finite number"),
    ]


def test_nan_and_inf_inputs_are_refused_before_any_worker_starts(tiny_path):
    client = RuntimeClient("cpu:2", threads_per_worker=1)
    try:
        for job, pattern in _nan_cases(tiny_path):
            with pytest.raises(ConfigError, match=pattern) as info:
                client.run(job)
            assert one_sentence(str(info.value)), str(info.value)
        assert not client.procs, "validation must fail before workers are started"
    finally:
        client.shutdown()


def test_a_job_that_does_not_fit_a_worker_is_refused_before_allocation_with_the_figures(tiny_path, monkeypatch,
                                                                                        client2):
    from parallel_runtime.planning import memory

    client = client2  # the session's 2 workers, holding no model (released), as a fresh client's would
    client.release()
    reports = client.ping()  # the workers' own figures, before any job
    assert all(r["held_bytes"] == 0 and r["host_available"] > 0 for r in reports)
    job = make_job(tiny_path, S(ulysses_degree=2), size=64)
    need = memory.job_rank_memory(job, "cpu")["total"]
    # A machine where each CPU worker may use half of what this job needs.
    monkeypatch.setattr(memory, "CPU_USABLE",
                        0.5 * (need + memory.CPU_WORKER_OVERHEAD) * 2 / reports[0]["host_available"])
    with pytest.raises(ConfigError, match=r"^this job needs about .* per worker \(weights .*, activations .*\) "
                                          r"but worker \d \(cpu\) has .* available; per worker, (PipeFusion over 2 "
                                          r"devices about \d+\.\d GB, )?an fp8 file about \d+\.\d GB, a GGUF Q4_K file "
                                          r"about \d+\.\d GB would need; or lower the resolution") as info:
        client.run(job)
    assert one_sentence(str(info.value)), str(info.value)
    # The figures are the estimates of those plans: fp8 holds a quarter of the fp32 weights.
    fp32, fp8 = (memory.job_rank_memory(job, "cpu", bytes_per_parameter=b)["params"] for b in (4.0, 1.0))
    assert fp8 == fp32 // 4
    monkeypatch.undo()
    assert client.run(job).latent.isfinite().all()  # with the real budget it fits and runs


def test_memory_budget_counts_what_a_worker_already_holds():
    from parallel_runtime.planning.memory import CPU_USABLE, CUDA_USABLE, rank_budgets

    gib = 2**30
    cuda = rank_budgets(["cuda:0", "cuda:1"], [{"held_bytes": 10 * gib, "host_available": 0, "device_free": 20 * gib},
                                                {"held_bytes": 0, "host_available": 0, "device_free": 30 * gib}])
    assert cuda == [int(20 * gib * CUDA_USABLE) + 10 * gib, int(30 * gib * CUDA_USABLE)]
    cpu = rank_budgets(["cpu", "cpu"], [{"held_bytes": gib, "host_available": 8 * gib}] * 2)
    assert cpu == [int(8 * gib * CPU_USABLE / 2) + gib] * 2


def test_devices_auto_without_a_gpu_says_so_in_one_sentence_before_loading():
    from parallel_runtime.distributed.devices import auto_notice

    notice = auto_notice("auto", ["cpu"])
    assert notice.startswith("no GPU is visible") and "48 GB" in notice and one_sentence(notice)
    assert auto_notice("cpu:1", ["cpu"]) is None and auto_notice("auto", ["cuda:0"]) is None
    assert RuntimeClient("auto").notice == (notice if not torch.cuda.is_available() else None)


def test_sd35_medium_pipeline_ranks_fit_the_memory_cap_with_the_position_table_counted():
    from parallel_runtime.bench.models import BENCH_FAMILIES, RELEASE_SHAPES
    from parallel_runtime.models.registry import family_of

    for config in (BENCH_FAMILIES["sd35_medium"], RELEASE_SHAPES["sd35_medium"][0]):
        family = family_of(config)
        per_block, always, first, last = family.parameter_counts(config)
        # The stored position table is a loaded buffer of the first stage: (max size)^2 rows of the width.
        table = config.pos_embed_max_size ** 2 * config.hidden_size
        assert first >= table
        total = sum(per_block) + always + first + last
        ranks = family.pipeline_stages(config, 2)
        held = [always + sum(per_block[i] for chunk in rank for i in chunk) + (first if r == 0 else 0)
                + (last if r == 1 else 0) for r, rank in enumerate(ranks)]
        # The bench's PipeFusion target: no rank holds more than 1.15x its fair share of the weights.
        assert max(held) <= 1.15 * total / 2, (config.title, held, total)
        assert sorted(i for rank in ranks for chunk in rank for i in chunk) == list(range(config.num_layers))


def test_pipeline_stages_follow_stage_speed():
    # 12 equal blocks over stages at speeds 1 : 1 : 2 (two workers sharing a core beside one alone): 3, 3, 6 blocks,
    # every stage busy for 3 units of time, where the equal 4, 4, 4 keeps the slow stages busy for 8.
    assert [len(r) for r in split_stages([1.0] * 12, 3, speeds=(1.0, 1.0, 2.0))] == [3, 3, 6]
    # The fast stage may hold more weights than an equal share, up to the slack times its speed's share (1/2 here).
    counts = ((10,) * 12, 0, 0, 0)
    assert [len(c[0]) for c in balanced_stages(counts, 3, (1.0, 1.0, 2.0))] == [3, 3, 6]
    # Equal speeds keep today's plan.
    assert balanced_stages(counts, 3, (2.0, 2.0, 2.0)) == balanced_stages(counts, 3)
    # A stage speed from device weights: the devices of a stage add up, and the slower CFG branch counts.
    assert stage_speeds(S(pipefusion_degree=3, device_weights=(1, 1, 2))) == (1.0, 1.0, 2.0)
    assert stage_speeds(S(cfg_degree=2, pipefusion_degree=2, device_weights=(1, 3, 2, 2))) == (1.0, 2.0)
    assert stage_speeds(S(pipefusion_degree=2)) == ()
