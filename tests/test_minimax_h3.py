"""MiniMax-H3 on the workers' family seam: detection and refusals, the packed sequence against diffusers' own layout
builder, the serial model against diffusers' MiniMaxH3Transformer3DModel on the same file (both layouts), and the
exact sequence splits (Ulysses, Ring, their hybrid) of the packed [text | conditioning | audio | video] sequence on
loopback ranks, with the audio and the video rows split together.

The reference is diffusers' own model, loaded through diffusers' own single-file converter
(convert_minimax_h3_transformer_checkpoint_to_diffusers), and fed the layout diffusers' modular pipeline builds
(MiniMaxH3PrepareLayoutStep.build_packed_sequence, MiniMaxH3SetTimestepsStep.build_row_timesteps), so it shares nothing with the family module
but the file.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import types

import numpy
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rel_err
from loopback import Fabric, loopback_comm, on_ranks
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families import minimax_h3 as h3
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.strategies.attention.processor import AttentionContext
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

# 4 heads of 128 (every H3's head size; 4 x 128 wider than the residual's 96, as the real 56 x 128 over 5376), 2
# blocks, the refiner's 2, 16 rotary frequencies per axis (96 of the 128 head channels rotate, as in the real one).
TINY = h3.MiniMaxH3Config(hidden_size=96, num_layers=2, num_heads=4, head_dim=128, ffn_dim=160, text_dim=48,
                          freq_dim=32, time_embed_hidden=64, time_embed_dim=48)
T, H, W = 3, 4, 6  # latent frames x height x width: 3 x 2 x 3 = 18 video rows
AUDIO_T = 5  # audio latent frames: 10 audio rows (two channels)
TEXT_LEN = 7
SIGMA = 0.7
# One fp32 forward in another op order than the reference: ~1e-7 measured; exact strategies reorder sums the same way.
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def h3_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("h3") / "minimax_h3_tiny.safetensors"), TINY, seed=1,
                            layout="minimax")


@pytest.fixture(scope="module")
def diffusers_path(h3_path, tmp_path_factory):
    """The same numbers in diffusers' names, written by diffusers' own converter."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    sd = convert_minimax_h3_transformer_checkpoint_to_diffusers(load_file(h3_path), TINY.diffusers_kwargs())
    path = str(tmp_path_factory.mktemp("h3-diffusers") / "transformer.safetensors")
    save_file({"transformer." + k: v.contiguous() for k, v in sd.items()}, path)
    return path


def inputs(seed: int = 0, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, TEXT_LEN, TINY.text_dim, generator=g), torch.randn(batch, 24, T, H, W, generator=g),
            torch.randn(batch, 32, 2, AUDIO_T, generator=g), torch.randn(1, 24, 1, H, W, generator=g))


# -- the reference: diffusers' model on diffusers' layout -------------------------------------------------------


@functools.lru_cache(maxsize=1)
def diffusers_layout() -> types.SimpleNamespace:
    """diffusers' own layout code (modular_pipelines/minimax_h3/before_denoise.py: the module-level grid helpers and
    the two static builders), read from its source: the package imports transformers' pipeline pieces this venv
    lacks, the builders themselves only numpy and torch."""
    import diffusers

    path = pathlib.Path(diffusers.__file__).parent / "modular_pipelines" / "minimax_h3" / "before_denoise.py"
    tree = ast.parse(path.read_text())
    keep = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(getattr(t, "id", "").startswith("_ROPE_") for t in node.targets):
            keep.append(node)
        elif isinstance(node, ast.FunctionDef):
            keep.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in ("MiniMaxH3PrepareLayoutStep",
                                                             "MiniMaxH3SetTimestepsStep"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in ("build_packed_sequence", "build_row_timesteps"):
                    item.decorator_list = []
                    keep.append(item)
    namespace = {"np": numpy, "torch": torch}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 - diffusers' code
    assert {"build_packed_sequence", "build_row_timesteps", "patchify_video_latents"} <= set(namespace)
    return types.SimpleNamespace(**namespace)



@torch.no_grad()
def diffusers_call(path: str, cond, video, audio, keyframe=None, text_tags=None, sigma: float = SIGMA,
                   model=None) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    layout = diffusers_layout()
    if model is None:
        model = MiniMaxH3Transformer3DModel(**TINY.diffusers_kwargs()).eval()
        sd = convert_minimax_h3_transformer_checkpoint_to_diffusers(load_file(path), TINY.diffusers_kwargs())
        model.load_state_dict(sd, strict=True)
    tags = torch.ones(TEXT_LEN, dtype=torch.long) if text_tags is None else text_tags
    anchors = ("first",) if keyframe is not None else ()
    pos, token_tags, vid_idx, aud_idx, txt_idx, cond_rows, _ = layout.build_packed_sequence(
        tags, T, H, W, audio.shape[-1], (1, 2, 2), 2, 2, 0, keyframe_anchors=anchors)
    t_v, t_a = 1.0 - sigma, 1.0 - float(h3.time_shift(torch.tensor(sigma, dtype=torch.float64), 12.0, 3.0))
    timestep, t_idx = layout.build_row_timesteps(
        vid_idx, aud_idx, cond_rows, 0, TEXT_LEN, t_v, t_a, max(t_v, 0.999), 1.0)
    rows = layout.patchify_video_latents(video, (1, 2, 2)).reshape(video.shape[0], -1, 96)
    if keyframe is not None:
        rows = torch.cat([layout.patchify_video_latents(keyframe, (1, 2, 2))[None].expand(video.shape[0], -1, -1), rows], 1)
    audio_rows = audio.permute(0, 2, 3, 1).reshape(audio.shape[0], -1, 32)  # channel-major stereo rows
    out = model(hidden_states=rows, audio_hidden_states=audio_rows, encoder_hidden_states=cond, timestep=timestep,
                timestep_indices=t_idx, token_tags=token_tags, position_ids=pos, video_indices=vid_idx,
                audio_indices=aud_idx, text_indices=txt_idx)
    return {"video": out.sample[:, cond_rows:], "audio": out.audio_sample}


def build_adapter(path: str, context: AttentionContext | None = None, tensor=None, shard=None):
    """The family's adapter over the whole model as a worker builds it: `tensor` a tensor rank's TensorSplit, `shard`
    (index, degree) of shard_weights."""
    from parallel_runtime.strategies.sharded_weights import parallelize_sharded
    from parallel_runtime.strategies.tensor import parallelize_tensor
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
        config = family.infer_config(reader, match, "h3")
        model = family.build(config, reader, match, lambda name: True, torch.float32, torch.device("cpu"),
                             tensor=tensor, shard=shard)
    if shard is not None:
        parallelize_sharded(model)
    if tensor is not None:
        parallelize_tensor(model, tensor)
    return family.adapter(config, model, [range(config.num_layers)], context or AttentionContext())


def sequence(keyframe=None, text_tags=None) -> h3.PackedSequence:
    keyframes = (h3.Keyframe(keyframe, 0),) if keyframe is not None else ()
    return h3.pack_sequence(TEXT_LEN, (T, H, W), AUDIO_T, keyframes=keyframes, text_tags=text_tags)


@torch.no_grad()
def serial_call(adapter, seq, cond, video, audio) -> dict:
    out = adapter.forward_rows(seq, torch.arange(seq.seq_len), cond, video, audio, h3.call_timesteps(SIGMA))
    assert torch.equal(out["video_index"], torch.arange(T * 6)) and torch.equal(out["audio_index"], torch.arange(10))
    return out


# -- detection and refusals ------------------------------------------------------------------------------------


def test_files_are_detected_in_both_layouts(h3_path, diffusers_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    for path, layout, prefix in ((h3_path, "minimax", ""), (diffusers_path, "diffusers", "transformer.")):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("minimax_h3", layout, prefix)
        assert model_config(path) == TINY
    assert TINY.title == "MiniMax-H3 96-wide" and TINY.video_patch_dim == 96


def test_pdd_files_are_refused_in_one_sentence(h3_path, tmp_path):
    sd = load_file(h3_path)
    pdd = dict(sd)
    pdd["final_layer.video_out.weight"] = torch.zeros(4 * 96, 96)
    save_file(pdd, str(tmp_path / "fasth3_pdd.safetensors"))
    with pytest.raises(ModelFileError, match=r"PDD head bank \(4 stacked output heads"):
        model_config(str(tmp_path / "fasth3_pdd.safetensors"))


# -- the packed sequence ------------------------------------------------------------------------------------------


def test_packed_sequence_equals_diffusers_layout_builder():
    """Positions, tags and timesteps per row as diffusers' modular pipeline builds them (t2va and fl2va)."""
    layout = diffusers_layout()
    keyframe = torch.zeros(1, 24, 1, H, W)
    tags = torch.tensor([1, 1, 0, 0, 1, 1, 1])  # a keyframe's vision tokens in the prompt carry the video's tag
    for kf, anchors in ((None, ()), (keyframe, ("first",))):
        seq = sequence(kf, text_tags=tags)
        pos, token_tags, vid_idx, aud_idx, _, cond_rows, _ = layout.build_packed_sequence(
            tags, T, H, W, AUDIO_T, (1, 2, 2), 2, 2, 0, keyframe_anchors=anchors)
        # ComfyUI's grid (followed here) is arange * (ratio / n) + left, diffusers' numpy's linspace: 1 ulp apart
        # at some w (4e-15), gone in the float32 RoPE angles both compute.
        assert torch.allclose(seq.positions, pos, rtol=0, atol=1e-13) and torch.equal(seq.modality, token_tags)
        assert torch.equal(seq.target["audio"], aud_idx) and torch.equal(seq.target["video"], vid_idx[cond_rows:])
        class_t = h3.call_timesteps(SIGMA)
        distinct, mod_rows, t_index = h3.modulation_rows(seq, class_t)
        theirs, their_index = layout.build_row_timesteps(
            vid_idx, aud_idx, cond_rows, 0, TEXT_LEN, *class_t[:3].tolist(), 1.0)
        assert torch.allclose(distinct.float(), theirs) and torch.equal(t_index, their_index)
        assert torch.equal(mod_rows, their_index * 3 + token_tags)


# -- one worker = diffusers --------------------------------------------------------------------------------------


def test_one_worker_equals_diffusers_in_both_layouts(h3_path, diffusers_path):
    cond, video, audio, _ = inputs()
    reference = diffusers_call(h3_path, cond, video, audio)
    assert torch.isfinite(reference["video"]).all() and reference["video"].abs().mean() > 0.1
    for path in (h3_path, diffusers_path):
        out = serial_call(build_adapter(path), sequence(), cond, video, audio)
        for stream in ("video", "audio"):
            err = rel_err(out[stream], reference[stream])
            print(f"\n{path.rsplit('/', 1)[1]} {stream}: rel L2 {err:.1e}")
            assert err < SERIAL_RTOL, (path, stream)


# A curve-form (pruned) file: a 33-row time table 8 wide in place of the time MLP.
CURVE = dataclasses.replace(TINY, curve_grid=33, time_embed_dim=8, time_embed_hidden=0, freq_dim=0)


@torch.no_grad()
def curve_reference(path: str, cond, video, audio, sigma: float = SIGMA) -> dict:
    """diffusers' model run as ComfyUI runs a curve-form file (comfy/ldm/minimax/model.py with adaln_curve_grid):
    the time embedding is the table interpolated at each timestep, and the modulation projections read it without
    SiLU; diffusers' converter (which refuses the table) maps every other tensor."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    sd = load_file(path)
    table = sd.pop("adaln_t_table")
    model = MiniMaxH3Transformer3DModel(**CURVE.diffusers_kwargs()).eval()
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(sd, CURVE.diffusers_kwargs())
    missing = model.load_state_dict(converted, strict=False).missing_keys
    assert missing and all(k.startswith("time_embedder.") for k in missing)

    def curve(t):  # ComfyUI: pos = t.clamp(0, 1) * (grid - 1); lerp of the rows around it
        pos = t.float().clamp(0, 1) * (table.shape[0] - 1)
        low = pos.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[low], table[low + 1], (pos - low)[:, None])

    model.time_proj, model.time_embedder.forward = torch.nn.Identity(), curve
    for block in model.transformer_blocks:
        block.adaln_proj.forward = (lambda temb, m=block.adaln_proj:
                                    m.linear(temb).view(-1, 6 * m.hidden_size).chunk(6, dim=-1))
    norm_out = model.norm_out

    def final(hidden, temb, index):
        shift, scale = norm_out.linear(temb).chunk(2, dim=-1)
        return norm_out.norm(hidden) * (1 + scale.index_select(0, index)) + shift.index_select(0, index)

    norm_out.forward = final
    return diffusers_call(path, cond, video, audio, sigma=sigma, model=model)


def test_curve_form_file_equals_comfyui_reading(tmp_path):
    path = write_checkpoint(str(tmp_path / "minimax_h3_t2va_pruned.safetensors"), CURVE, seed=3, layout="minimax")
    assert model_config(path) == CURVE
    cond, video, audio, _ = inputs(seed=9)
    for sigma in (SIGMA, 1.0, 0.0):  # t = 1 reads the table's last interval
        reference = curve_reference(path, cond, video, audio, sigma=sigma)
        seq = sequence()
        with torch.no_grad():
            out = build_adapter(path).forward_rows(seq, torch.arange(seq.seq_len), cond, video, audio,
                                                   h3.call_timesteps(sigma))
        for stream in ("video", "audio"):
            err = rel_err(out[stream], reference[stream])
            print(f"\ncurve form, sigma {sigma}, {stream}: rel L2 {err:.1e}")
            assert err < SERIAL_RTOL, (sigma, stream)


def test_first_frame_keyframe_and_mixed_text_tags_equal_diffusers(h3_path):
    """fl2va: the keyframe's rows before the audio at the conditioning timestep, read by no head; the prompt's
    vision-token rows modulated as video."""
    cond, video, audio, keyframe = inputs(seed=2)
    tags = torch.tensor([1, 1, 0, 0, 1, 1, 1])
    reference = diffusers_call(h3_path, cond, video, audio, keyframe=keyframe, text_tags=tags)
    out = serial_call(build_adapter(h3_path), sequence(keyframe, tags), cond, video, audio)
    plain = serial_call(build_adapter(h3_path), sequence(), cond, video, audio)
    for stream in ("video", "audio"):
        assert rel_err(out[stream], reference[stream]) < SERIAL_RTOL, stream
        assert rel_err(out[stream], plain[stream]) > 1e-2  # the keyframe and the tags matter


# -- the exact sequence splits ------------------------------------------------------------------------------------

# 40 audio rows beside 18 video rows in a 71-row sequence: 2 shards cut the audio rows, 4 the audio and the video rows.
LONG_AUDIO_T = 20


def split_call(path: str, topology, seq, cond, video, audio) -> dict:
    """Every rank of `topology` (Ulysses x Ring, on loopback ranks over the real Comm) runs the model on its contiguous
    shard of the packed sequence, as the Denoiser orders shards (ring-major, then Ulysses); the target rows gathered."""
    from parallel_runtime.strategies.attention import LocalAttention, RingAttention, UlyssesAttention

    from parallel_runtime.runtime.worker import weight_shard
    from parallel_runtime.strategies.sharded_weights import bind_weight_gatherer
    from parallel_runtime.strategies.tensor import TensorSplit, bind_tensor_group

    shards = torch.arange(seq.seq_len).tensor_split(topology.sp)
    lengths = [len(s) for s in shards]
    tensor = [TensorSplit(topology.coords(r)["tensor"], topology.tensor) if topology.tensor > 1 else None
              for r in range(topology.world_size)]
    adapters = [build_adapter(path, tensor=tensor[r], shard=weight_shard(topology, r))
                for r in range(topology.world_size)]
    block = adapters[0].model.transformer_blocks[0]
    assert block.attn.to_q.out_features == TINY.num_heads * TINY.head_dim // topology.tensor  # heads really split
    assert block.ff.net[0].proj.out_features == 2 * TINY.ffn_dim // topology.tensor  # [value; gate] halves split
    assert block.adaln_proj.linear.out_features == 18 * TINY.hidden_size // topology.tensor  # modulation gathered
    assert hasattr(adapters[0].model, "sharded_blocks") == (weight_shard(topology, 0) is not None)
    fabric = Fabric(topology.world_size)

    def rank(r: int) -> dict:
        comm = loopback_comm(fabric, topology, r, "cpu")
        bind_tensor_group(adapters[r].model, comm)
        gatherer = bind_weight_gatherer(adapters[r].model, comm)
        coords, u = topology.coords(r), topology.ulysses
        ring_members = [sum(lengths[k * u:(k + 1) * u]) for k in range(topology.ring)]
        attention = RingAttention(comm, comm.group("ring"), ring_members) if topology.ring > 1 else LocalAttention()
        if u > 1:
            mine = lengths[coords["ring"] * u:(coords["ring"] + 1) * u]
            attention = UlyssesAttention(comm, comm.group("ulysses"), mine, attention)
        adapters[r].context.attention = attention
        with torch.no_grad():
            out = adapters[r].forward_rows(seq, shards[coords["ring"] * u + coords["ulysses"]], cond, video, audio,
                                           h3.call_timesteps(SIGMA))
        if gatherer is not None:
            gatherer.finish()
        return out

    try:
        parts = on_ranks(fabric, rank)
    finally:
        fabric.close()
    out = {}
    for stream, n in (("video", T * 6), ("audio", 2 * seq.audio_frames)):
        whole = torch.full((video.shape[0], n, parts[0][stream].shape[-1]), float("nan"))
        held = torch.zeros(n, dtype=torch.long)
        for part in parts[::topology.tensor]:  # a tensor group's ranks hold the same rows
            whole[:, part[f"{stream}_index"]] = part[stream]
            held[part[f"{stream}_index"]] += 1
        assert torch.equal(held, torch.ones(n, dtype=torch.long)), stream  # every row on one rank: none replicated
        holders = sum(len(part[f"{stream}_index"]) > 0 for part in parts[::topology.tensor])
        assert holders >= -(-n // max(lengths)), stream  # a stream longer than a shard is cut
        out[stream] = whole
    return out


@pytest.mark.parametrize("degrees", [dict(ulysses=2), dict(ring=2), dict(ulysses=2, ring=2), dict(tensor=2),
                                     dict(ulysses=2, shard_weights=True), dict(ring=2, tensor=2)],
                         ids=["ulysses2", "ring2", "ulysses2xring2", "tensor2", "ulysses2_sharded", "ring2xtensor2"])
def test_exact_strategies_equal_serial(h3_path, degrees, one_thread_per_rank):
    """The packed sequence cut in contiguous shards (uneven: 71 rows), a stream longer than a shard over several; each shard's rows read their own RoPE and modulation rows; fl2va's keyframe rows and video-tagged
    prompt rows included."""
    from parallel_runtime.distributed.topology import Topology

    g = torch.Generator().manual_seed(4)
    cond, video, _, keyframe = inputs(seed=3)
    audio = torch.randn(1, 32, 2, LONG_AUDIO_T, generator=g)
    seq = h3.pack_sequence(TEXT_LEN, (T, H, W), LONG_AUDIO_T, keyframes=(h3.Keyframe(keyframe, 0),),
                           text_tags=torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    serial = build_adapter(h3_path)
    with torch.no_grad():
        reference = serial.forward_rows(seq, torch.arange(seq.seq_len), cond, video, audio, h3.call_timesteps(SIGMA))
    out = split_call(h3_path, Topology(**degrees), seq, cond, video, audio)
    for stream in ("video", "audio"):
        err = rel_err(out[stream], reference[stream])
        print(f"\n{degrees} {stream}: rel L2 {err:.1e}")
        assert err < EXACT_RTOL, stream


# -- a multi-step run: stale K/V (displaced patch) against naive patch -------------------------------------------

STEPS = 6


def sample(path: str, world: int, how: str, warmup: int = 1) -> dict:
    """A 6-step Euler run of fl2va (the video on a shift-12 schedule, the audio on its own shift-3 one, ComfyUI's
    velocity sign) with every rank computing its contiguous shard of the packed sequence each step: `how` "exact"
    (one rank), "stale" (displaced patch: the other shard's K/V as the previous step left them, after `warmup` exact
    steps; PipeFusion's stale K/V without its stages) or "naive" (each shard attends to its own rows only)."""
    from parallel_runtime.distributed.topology import Topology
    from parallel_runtime.strategies.attention import LocalAttention
    from parallel_runtime.strategies.displaced import DisplacedPatchAttention
    from parallel_runtime.strategies.pipefusion import StaleKVCache

    g = torch.Generator().manual_seed(5)
    cond, _, _, keyframe = inputs(seed=6)
    seq = h3.pack_sequence(TEXT_LEN, (T, H, W), LONG_AUDIO_T, keyframes=(h3.Keyframe(keyframe, 0),))
    noise_v, noise_a = torch.randn(1, 24, T, H, W, generator=g), torch.randn(1, 32, 2, LONG_AUDIO_T, generator=g)
    base = torch.linspace(1.0, 0.0, STEPS + 1, dtype=torch.float64)
    sigma_v = h3.time_shift(base, 1.0, h3.SIGMA_SHIFT_VIDEO)
    sigma_a = h3.time_shift(sigma_v, h3.SIGMA_SHIFT_VIDEO, h3.SIGMA_SHIFT_AUDIO)
    topology = Topology(patch=world) if how == "stale" else Topology(naive_patch=world)
    shards = torch.arange(seq.seq_len).tensor_split(world)
    adapters = [build_adapter(path) for _ in range(world)]
    fabric = Fabric(world)

    def rank(r: int) -> dict:
        comm = loopback_comm(fabric, topology, r, "cpu")
        group = comm.group("patch" if how == "stale" else "naive_patch")
        attention = LocalAttention()
        if how == "stale":
            attention = DisplacedPatchAttention(StaleKVCache(seq.seq_len), comm, group, list(shards), LocalAttention())
        adapters[r].context.attention = attention
        video, audio = noise_v.clone(), noise_a.clone()
        for i in range(STEPS):
            attention.sync = i < warmup
            with torch.no_grad():
                out = h3.comfy_output(adapters[r].forward_rows(seq, shards[r], cond, video, audio,
                                                               h3.call_timesteps(float(sigma_v[i]))))
            if how == "stale":
                attention.land()
            v = torch.zeros(1, T * 6, 96).index_copy_(1, out["video_index"], out["video"])
            a = torch.zeros(1, 2 * LONG_AUDIO_T, 32).index_copy_(1, out["audio_index"], out["audio"])
            if world > 1:  # each row's velocity comes from the one rank that holds it
                v, a = comm.all_reduce(v, group, op="patch"), comm.all_reduce(a, group, op="patch")
            video = video + float(sigma_v[i + 1] - sigma_v[i]) * h3.unpatchify_video(v, T, H // 2, W // 2)
            audio = audio + float(sigma_a[i + 1] - sigma_a[i]) * h3.unpack_audio(a)
        return {"video": video, "audio": audio}

    try:
        return on_ranks(fabric, rank)[0]
    finally:
        fabric.close()


def test_stale_kv_is_exact_in_warmup_and_beats_naive_patch_on_a_multistep_run(h3_path, one_thread_per_rank):
    """All-warm-up displaced patch equals serial; after one warm-up step it reads stale K/V (off by more than
    round-off) yet stays far nearer serial than naive patch, whose shards never see each other's rows (here the
    video, on the second shard, never sees the prompt or the keyframe, on the first)."""
    serial = sample(h3_path, 1, "naive")
    warm = sample(h3_path, 2, "stale", warmup=STEPS)
    stale = sample(h3_path, 2, "stale")
    naive = sample(h3_path, 2, "naive")
    for stream in ("video", "audio"):
        errors = [rel_err(run[stream], serial[stream]) for run in (warm, stale, naive)]
        print(f"\n{stream}, {STEPS} steps: all warm-up {errors[0]:.1e}, stale K/V {errors[1]:.1e}, "
              f"naive patch {errors[2]:.1e}")
        assert errors[0] < EXACT_RTOL
        assert errors[1] > 10 * EXACT_RTOL  # the stale K/V really was read
        assert errors[1] < errors[2] / 2


def test_jobs_are_refused_in_one_sentence_until_a_door_carries_the_audio(h3_path):
    """ComfyUI's latent for H3 is a NestedTensor (video, audio): neither node door carries the audio yet, so a
    Parallel Sampler job (and Load Parallel DiT, which calls the same check) stops before any work, naming the nodes
    and the fix; a runtime model call carries it (Job.audio), in its shape, without batch parallelism."""
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec, StrategySpec
    from parallel_runtime.validate import validate_job

    cond, video, _, _ = inputs()
    job = Job(ModelSpec(h3_path), StrategySpec(), SamplingSpec(steps=2), video, Conditioning(cond, torch.zeros(1, 0)))
    with pytest.raises(ConfigError, match=r"^minimax_h3_tiny.safetensors is a MiniMax-H3 audio-video model, whose "
                                          r"\(video, audio\) latent from EmptyMiniMaxH3LatentAV .* load it with "
                                          r"UNETLoader\.$") as refused:
        validate_job(job, 1)
    assert ". " not in str(refused.value)
    call = call_job(h3_path, StrategySpec())
    for bad, sentence in ((dataclasses.replace(call, audio=call.audio[:, :, :1]), r"audio latent has shape \(2, 32, 1, "
                           r"20\) but this MiniMax-H3 96-wide model needs \[2, 32, 2, frames\]"),
                          (dataclasses.replace(call, strategy=StrategySpec(batch_degree=2)),
                           r"batch parallelism does not cut MiniMax-H3 96-wide's audio latent yet"),
                          (dataclasses.replace(call, audio=None), r"is a MiniMax-H3 audio-video model")):
        with pytest.raises(ConfigError, match=sentence):
            validate_job(bad, 2)


# -- the runtime: one model call with its audio latent, every strategy -------------------------------------------


def call_job(path: str, strategy, seed: int = 7, audio_frames: int = LONG_AUDIO_T):
    """One stock-sampler call of cond and uncond (prompts of 7 tokens each): the video x and the audio x of both
    chunks, at the video's sigma 0.7 (t = 700, as ComfyUI's model_base passes it)."""
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec

    g = torch.Generator().manual_seed(seed)
    pos, neg = (Conditioning(torch.randn(1, TEXT_LEN, TINY.text_dim, generator=g), torch.zeros(1, 0)) for _ in "pn")
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(2, 24, T, H, W, generator=g), pos, neg,
               timestep=torch.full((2,), SIGMA * 1000), audio=torch.randn(2, 32, 2, audio_frames, generator=g))


def diffusers_model_call(path: str, job) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk through diffusers' model, in ComfyUI's output convention (MiniMaxH3Model returns the negated
    prediction) and the call's shapes."""
    videos, audios = [], []
    for k, branch in enumerate((job.positive, job.negative)):
        out = diffusers_call(path, branch.cond, job.latent[k:k + 1], job.audio[k:k + 1],
                             sigma=float(job.timestep[k]) / 1000)
        videos.append(-h3.unpatchify_video(out["video"], T, H // 2, W // 2))
        audios.append(-h3.unpack_audio(out["audio"]))
    return torch.cat(videos), torch.cat(audios)


def test_model_call_one_worker_equals_diffusers(h3_path, diffusers_path, client1):
    from parallel_runtime.spec import StrategySpec

    for path in (h3_path, diffusers_path):
        job = call_job(path, StrategySpec())
        video, audio = diffusers_model_call(h3_path, job)
        result = client1.run(job)
        assert result.latent.shape == (2, 24, T, H, W) and result.audio.shape == (2, 32, 2, LONG_AUDIO_T)
        errors = rel_err(result.latent, video), rel_err(result.audio, audio)
        print(f"\n{path.rsplit('/', 1)[1]} model call, 1 worker: video {errors[0]:.1e}, audio {errors[1]:.1e}")
        assert max(errors) < SERIAL_RTOL


def _assert_call_equals(client, path: str, strategy, reference=None) -> tuple[float, float]:
    from parallel_runtime.spec import StrategySpec

    job = call_job(path, strategy)
    video, audio = reference if reference is not None else diffusers_model_call(path, job)
    result = client.run(job)
    errors = rel_err(result.latent, video), rel_err(result.audio, audio)
    print(f"\n{StrategySpec.label(strategy)} model call: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < EXACT_RTOL
    return errors


@pytest.mark.parametrize("strategy", [
    dict(cfg_degree=2), dict(ulysses_degree=2), dict(ring_degree=2), dict(tensor_degree=2),
    dict(ulysses_degree=2, shard_weights=True), dict(pipefusion_degree=2, num_pipeline_patch=3),
], ids=["cfg2", "ulysses2", "ring2", "tensor2", "ulysses2_sharded", "pp2_warmup"])
def test_model_call_exact_strategies_equal_diffusers(h3_path, client2, strategy):
    """The call's [prompt | audio | video] rows (7 + 40 + 18) split by every exact strategy: the audio and video
    rows cut as one image stream (contiguous runs: Ulysses and Ring give each rank part of the audio rows); the
    tensor split runs the released [gate; value] MLP halves; PipeFusion's 3 patches of [audio | video] rows (a call
    with no schedule step is its warm-up: exact)."""
    from parallel_runtime.spec import StrategySpec

    _assert_call_equals(client2, h3_path, StrategySpec(**strategy))


@pytest.mark.parametrize("strategy", [dict(ulysses_degree=2, ring_degree=2), dict(cfg_degree=2, ulysses_degree=2),
                                      dict(ring_degree=2, tensor_degree=2)],
                         ids=["ulysses2xring2", "cfg2xulysses2", "ring2xtensor2"])
def test_model_call_hybrids_on_four_equal_diffusers(h3_path, client4, strategy):
    from parallel_runtime.spec import StrategySpec

    _assert_call_equals(client4, h3_path, StrategySpec(**strategy))


def host_loop(client, path: str, strategy, cfg: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A stock sampler on the host: euler over the shift-12 video schedule, one runtime call per step carrying
    [cond; uncond] of the video and the audio x (the audio stepped on the video's sigmas, as ComfyUI's sampler
    does with audio_scale 1), CFG on the host."""
    import dataclasses

    job = call_job(path, strategy, seed=8)
    x_v, x_a = job.latent[:1].clone(), job.audio[:1].clone()
    sigmas = h3.time_shift(torch.linspace(1.0, 0.0, STEPS + 1, dtype=torch.float64), 1.0, h3.SIGMA_SHIFT_VIDEO)
    for i in range(STEPS):
        call = dataclasses.replace(job, latent=x_v.repeat(2, 1, 1, 1, 1), audio=x_a.repeat(2, 1, 1, 1),
                                   timestep=torch.full((2,), float(sigmas[i]) * 1000), call_step=i)
        result = client.run(call)
        dt = float(sigmas[i + 1] - sigmas[i])
        for out, name in ((result.latent, "v"), (result.audio, "a")):
            cond, uncond = out.chunk(2)
            step = -(uncond + cfg * (cond - uncond)) * dt  # denoised = x - sigma * out (CONST)
            if name == "v":
                x_v = x_v + step
            else:
                x_a = x_a + step
    return x_v, x_a


def test_model_call_loop_pipefusion_is_exact_in_warmup_and_beats_naive_patch(h3_path, client1, client2):
    """6 stock-sampler steps at cfg 3: PipeFusion (2 stages, its patches runs of [audio | video] rows, the prompt
    with the first) all warm-up equals serial; after one warm-up call each call reads the stale K/V its previous
    call left, nearer serial than naive patch, whose halves never see each other."""
    from parallel_runtime.spec import StrategySpec as S

    serial = host_loop(client1, h3_path, S())
    runs = {"warm": host_loop(client2, h3_path, S(pipefusion_degree=2, warmup_steps=STEPS)),
            "stale": host_loop(client2, h3_path, S(pipefusion_degree=2, warmup_steps=1)),
            "naive": host_loop(client2, h3_path, S(naive_patch_degree=2))}
    errors = {}
    for k, stream in enumerate(("video", "audio")):
        err = errors[stream] = {name: rel_err(run[k], serial[k]) for name, run in runs.items()}
        print(f"\n{stream}, {STEPS} calls: pp2 all warm-up {err['warm']:.1e}, pp2 1 warm-up call {err['stale']:.1e}, "
              f"naive patch 2 {err['naive']:.1e}")
    for stream, err in errors.items():
        assert err["warm"] < EXACT_RTOL
        assert err["stale"] < err["naive"] / 2
    # The stale K/V really was read: by the first patch (the audio rows), whose second patch ran a call earlier; the
    # second (the video) reads the first's K/V of this call, so its error is only what the audio passes on.
    assert errors["audio"]["stale"] > 10 * EXACT_RTOL and errors["video"]["stale"] > EXACT_RTOL


# -- the templates' file kind: pruned (curve-form) int8 ConvRot ------------------------------------------------------

# The quantized file and its fp32 twin hold the same numbers (the twin the values the file means): equal up to BLAS
# blocking of equal operands, as in tests/test_comfy_quant.py.
STORAGE_RTOL = 1e-5


def test_pruned_int8_convrot_file_equals_its_fp32_twin_split_or_not(tmp_path, client1, client2):
    """ComfyUI's int8 ConvRot layers (per-output-channel scales) on a curve-form file, as the templates'
    minimax_h3_*_pruned_int8_convrot files are: the fused q/k/v cut into rows and the [gate; value] MLP swapped,
    scales with them, at 1 worker and split by tensor parallelism (each rank's halves of both) and by Ulysses."""
    from test_comfy_quant import comfy_quant_twins
    from parallel_runtime.spec import StrategySpec

    quant, meant = comfy_quant_twins(tmp_path, "minimax_h3", "int8_convrot", config=CURVE)
    assert model_config(quant) == CURVE
    got, ref = client1.run(call_job(quant, StrategySpec())), client1.run(call_job(meant, StrategySpec()))
    errors = [rel_err(got.latent, ref.latent), rel_err(got.audio, ref.audio)]
    held = got.stats[0]["param_bytes"] / ref.stats[0]["param_bytes"]
    for strategy in (StrategySpec(tensor_degree=2), StrategySpec(ulysses_degree=2)):
        split = client2.run(call_job(quant, strategy))
        errors.append(max(rel_err(split.latent, got.latent), rel_err(split.audio, got.audio)))
    print(f"\npruned int8 ConvRot: {errors[0]:.1e} / {errors[1]:.1e} vs fp32 twin, {held:.2f} of its bytes; "
          f"tp2 {errors[2]:.1e}, ulysses2 {errors[3]:.1e}")
    assert max(errors[:2]) <= STORAGE_RTOL and max(errors[2:]) <= EXACT_RTOL
    assert held < 0.6  # 1-byte matrices


def test_a_prompt_refined_on_the_host_is_read_as_it_is(h3_path):
    """ComfyUI 2026's extra_conds may run the token refiner on the host (preprocess_text_embeds): a prompt as wide as
    the residual is used unrefined, giving what the raw prompt gives."""
    cond, video, audio, _ = inputs(seed=11)
    adapter = build_adapter(h3_path)
    with torch.no_grad():
        raw = serial_call(adapter, sequence(), cond, video, audio)
        refined = serial_call(adapter, sequence(), adapter.embed_text(cond), video, audio)
    assert rel_err(refined["video"], raw["video"]) == 0 and rel_err(refined["audio"], raw["audio"]) == 0
