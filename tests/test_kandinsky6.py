"""Kandinsky 6 (video-audio) on the workers: detection in ComfyUI's and diffusers' layouts, config from shapes, the
serial model against diffusers' Kandinsky6Transformer3DModel and against a model call written from ComfyUI 2026's
comfy/ldm/kandinsky6/model.py (Kandinsky6NativeAVDiT: its K5 modules, fp32 helpers, EmbedND RoPE and fused block,
re-typed here over the file's own tensors), the runtime's model call at one worker and on every strategy at two,
and PipeFusion's error next to naive patch's on a multi-step run.

The tiny file has both streams at different widths (video 64, audio 32: 4 and 2 heads of 16), time embeddings of
different widths, and 7 audio frames beside 18 video tokens (uneven shards over two ranks).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.models.families.kandinsky6 import Kandinsky6Adapter, Kandinsky6Config, original_name
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(300)

TINY = Kandinsky6Config(hidden_size=64, audio_hidden_size=32, num_layers=2, head_dim=16, ff_dim=96, audio_ff_dim=48,
                        time_dim=32, audio_time_dim=24, text_blocks=1, latent_dim=4, audio_dim=6, context_dim=24,
                        pooled_dim=12)
T, H, W = 3, 4, 6  # latent frames x height x width: 3 x 2 x 3 = 18 tokens of 2x2 patches per sample
AUDIO_FRAMES, PROMPT = 7, 5
PREFIX = "model.diffusion_model."
SIGMA = 0.7
# One fp32 forward in another op order than the reference (~1e-7 measured); exact strategies reorder sums likewise.
RTOL = 1e-5


@pytest.fixture(scope="module")
def k6_path(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("k6") / "kandinsky6.safetensors"), TINY, seed=3, prefix=PREFIX)


def call_job(path: str, strategy, seed: int = 11, sigma: float = SIGMA):
    """cond and uncond chunks of one call as Kandinsky6NativeAVDiT receives them: video [2, 4, T, H, W], audio
    [2, frames, 6], t = sigma x 1000 (ModelSamplingDiscreteFlow), Qwen rows and the pooled CLIP-L vector."""
    from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec

    g = torch.Generator().manual_seed(seed)
    pos, neg = (Conditioning(torch.randn(1, PROMPT, TINY.context_dim, generator=g),
                             torch.randn(1, TINY.pooled_dim, generator=g)) for _ in "pn")
    video = torch.randn(2, TINY.latent_dim, T, H, W, generator=g)
    audio = torch.randn(2, AUDIO_FRAMES, TINY.audio_dim, generator=g)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), video, pos, neg,
               timestep=torch.full((2,), sigma * 1000.0), audio=audio)


def call_inputs(job) -> tuple:
    """(video [B, C, T, H, W], audio, timestep, context, pooled) of a call's two chunks."""
    return (job.latent, job.audio, job.timestep, torch.cat([job.positive.cond, job.negative.cond]),
            torch.cat([job.positive.pooled, job.negative.pooled]))


# -- the references -----------------------------------------------------------------------------------------

@torch.no_grad()
def diffusers_call(path: str, video, audio, timestep, context, pooled, prefix: str = PREFIX):
    """diffusers' own model on the file (ComfyUI's names taken back by diffusers' own class's names), in ComfyUI's
    [B, C, T, H, W] video convention; the visual condition and mask are zeros (text-to-video-and-audio)."""
    from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6Transformer3DModel

    model = Kandinsky6Transformer3DModel(**TINY.diffusers_kwargs()).eval()
    names = {original_name(n): n for n in model.state_dict()}
    model.load_state_dict({names[k[len(prefix):]]: v for k, v in load_file(path).items()}, strict=True)
    x = torch.cat([video, torch.zeros_like(video), torch.zeros_like(video[:, :1])], dim=1).permute(0, 2, 3, 4, 1)
    v, a = model(x, context, pooled, timestep, audio_hidden_states=audio, return_dict=False)
    return v.permute(0, 4, 1, 2, 3), a


def _linear(sd, name, x):
    return F.linear(x.float(), sd[name + ".weight"], sd.get(name + ".bias"))


def _embed_nd(ids: torch.Tensor, axes: list[int]) -> torch.Tensor:
    """comfy.ldm.flux.layers.EmbedND with flux.math.rope (float64 frequencies): [L, 1, d/2, 2, 2]."""
    tables = []
    for i, d in enumerate(axes):
        omega = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        out = torch.einsum("n,d->nd", ids[:, i].double(), omega)
        tables.append(torch.stack([out.cos(), -out.sin(), out.sin(), out.cos()], dim=-1).view(-1, d // 2, 2, 2))
    return torch.cat(tables, dim=-3).float().unsqueeze(1)


def _rope1(x, freqs):  # comfy.ldm.flux.math.apply_rope1
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]).reshape(*x.shape)


def _attention(sd, name, x, context, head_dim, rope_q=None, rope_kv=None):
    """K5's SelfAttention / CrossAttention and K6's AsymCrossAttention: norms, then RoPE, then SDPA."""
    q = _linear(sd, name + ".to_query", x).unflatten(-1, (-1, head_dim))
    k = _linear(sd, name + ".to_key", context).unflatten(-1, (-1, head_dim))
    v = _linear(sd, name + ".to_value", context).unflatten(-1, (-1, head_dim))
    q = F.rms_norm(q, (head_dim,), sd[name + ".query_norm.weight"])
    k = F.rms_norm(k, (head_dim,), sd[name + ".key_norm.weight"])
    q, k = (q if rope_q is None else _rope1(q, rope_q)), (k if rope_kv is None else _rope1(k, rope_kv))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return _linear(sd, name + ".out_layer", out.flatten(-2))


def _norm(x):
    return F.layer_norm(x.float(), x.shape[-1:])


def _ssg(params):  # get_shift_scale_gate
    return tuple(p.unsqueeze(1) for p in params.chunk(3, dim=-1))


def _ff(sd, name, x):
    return _linear(sd, name + ".out_layer", F.gelu(_linear(sd, name + ".in_layer", x)))


def _modulation(sd, name, t):
    return _linear(sd, name + ".out_layer", F.silu(t.float()))


def _fused_block(sd, b, vis, aud, ctx_v, ctx_a, tev, tea, rope_v, rope_a, hd):
    """FusedTransformerDecoderBlock.forward (cross_gates, fix_modulation and ca_rope on, as released)."""
    v_self, v_cross, v_ff = _modulation(sd, b + "videoT.visual_modulation", tev).chunk(3, dim=-1)
    shift, scale, gate = _ssg(v_self)
    vis = vis + gate * _attention(sd, b + "videoT.self_attention", _norm(vis) * (scale + 1) + shift,
                                  _norm(vis) * (scale + 1) + shift, hd, rope_v, rope_v)
    shift, scale, gate_v = _ssg(v_cross)
    visual_before = _norm(vis) * (scale + 1) + shift
    visual_out_t = _attention(sd, b + "videoT.cross_attention", visual_before, ctx_v, hd)
    a_self, a_cross, a_ff = _modulation(sd, b + "audioT.visual_modulation", tea).chunk(3, dim=-1)
    shift, scale, gate = _ssg(a_self)
    aud_in = _norm(aud) * (scale + 1) + shift
    aud = aud + gate * _attention(sd, b + "audioT.self_attention", aud_in, aud_in, hd, rope_a, rope_a)
    shift, scale, gate_a = _ssg(a_cross)
    audio_before = _norm(aud) * (scale + 1) + shift
    aud = aud + gate_a * _attention(sd, b + "audioT.cross_attention", audio_before, ctx_a, hd)
    md, md_a = vis.shape[-1], aud.shape[-1]
    va_shift, va_scale, va_gate = (p.unsqueeze(1) for p in _modulation(sd, b + "va_modulation", tev).split(
        [md, md, md_a], dim=-1))
    av_shift, av_scale, av_gate = (p.unsqueeze(1) for p in _modulation(sd, b + "av_modulation", tea).split(
        [md_a, md_a, md], dim=-1))
    vis = vis + gate_v * visual_out_t
    visual_out_a = _attention(sd, b + "va_cross_attention", _norm(vis) * (va_scale + 1) + va_shift, audio_before,
                              hd, rope_v, rope_a)
    audio_out_v = _attention(sd, b + "av_cross_attention", _norm(aud) * (av_scale + 1) + av_shift, visual_before,
                             hd, rope_a, rope_v)
    vis, aud = vis + av_gate * visual_out_a, aud + va_gate * audio_out_v  # cross_gates: each the other's gate
    shift, scale, gate = _ssg(v_ff)
    vis = vis + gate * _ff(sd, b + "videoT.feed_forward", _norm(vis) * (scale + 1) + shift)
    shift, scale, gate = _ssg(a_ff)
    return vis, aud + gate * _ff(sd, b + "audioT.feed_forward", _norm(aud) * (scale + 1) + shift)


@torch.no_grad()
def comfyui_call(path: str, video, audio, timestep, context, pooled):
    """Kandinsky6NativeAVDiT._forward then Kandinsky6._forward (ComfyUI 2026) on the file's tensors, in fp32."""
    sd = {k[len(PREFIX):]: v.float() for k, v in load_file(path).items()}
    hd, c = TINY.head_dim, TINY

    def text_embed(name, x):
        return F.layer_norm(_linear(sd, name + ".in_layer", x), (sd[name + ".norm.weight"].shape[0],),
                            sd[name + ".norm.weight"], sd[name + ".norm.bias"])

    def time_embed(name, width):  # _time_embeddings_fp32
        freqs = torch.exp(-math.log(10000.0) * torch.arange(width // 2, dtype=torch.float32) / (width // 2))
        args = torch.outer(timestep.float(), freqs)
        return _linear(sd, name + ".out_layer", F.silu(_linear(sd, name + ".in_layer",
                                                                torch.cat([args.cos(), args.sin()], dim=-1))))

    tev = time_embed("video_time_embeddings", c.hidden_size) + text_embed("video_pooled_text_embeddings", pooled)
    tea = time_embed("audio_time_embeddings", c.audio_hidden_size) + text_embed("audio_pooled_text_embeddings", pooled)
    x = torch.cat([video, torch.zeros_like(video), torch.zeros_like(video[:, :1])], dim=1).movedim(1, -1)
    b, t, h, w, ch = x.shape
    x = x.view(b, t, h // 2, 2, w // 2, 2, ch).permute(0, 1, 2, 4, 3, 5, 6).flatten(4, 6)
    visual = _linear(sd, "visual_embeddings.in_layer", x)
    shape = visual.shape[:-1]
    visual = visual.flatten(1, -2)
    steps = (t, h // 2, w // 2)  # rope_encode_3d: linspace(0, (n - 1) / scale, n) per axis
    grid = torch.meshgrid(*[torch.linspace(0, (n - 1) / s, n) for n, s in zip(steps, (1.0, 2.0, 2.0))], indexing="ij")
    rope_v = _embed_nd(torch.stack([g.flatten() for g in grid], dim=-1), list(c.axes_dims))
    aud = text_embed("audio_embeddings", audio)
    rope_a = _embed_nd((torch.arange(audio.shape[1], dtype=torch.float32) * 0.144)[:, None], [hd])
    rope_text = _embed_nd(torch.arange(context.shape[1], dtype=torch.float32)[:, None], [hd])
    prompts = []
    for stream, temb in (("video", tev), ("audio", tea)):  # _encoder_block_fp32
        ctx = text_embed(f"{stream}_text_embeddings", context)
        for i in range(c.text_blocks):
            n = f"{stream}_text_transformer_blocks.{i}."
            sa, ff = _modulation(sd, n + "text_modulation", temb).chunk(2, dim=-1)
            shift, scale, gate = _ssg(sa)
            y = _norm(ctx) * (scale + 1) + shift
            ctx = ctx + gate * _attention(sd, n + "self_attention", y, y, hd, rope_text, rope_text)
            shift, scale, gate = _ssg(ff)
            ctx = ctx + gate * _ff(sd, n + "feed_forward", _norm(ctx) * (scale + 1) + shift)
        prompts.append(ctx)
    for i in range(c.num_layers):
        visual, aud = _fused_block(sd, f"visual_blocks.{i}.", visual, aud, *prompts, tev, tea, rope_v, rope_a, hd)
    shift, scale = _modulation(sd, "out_layer.modulation", tev).chunk(2, dim=-1)
    out = _norm(visual.reshape(*shape, -1)) * (scale[:, None, None, None] + 1) + shift[:, None, None, None]
    out = _linear(sd, "out_layer.out_layer", out)
    v_out = out.view(*out.shape[:4], -1, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(2, 3).flatten(3, 4)
    shift, scale = _modulation(sd, "audio_outLayer.modulation", tea).chunk(2, dim=-1)
    a_out = _norm(_norm(aud) * (scale.unsqueeze(1) + 1) + shift.unsqueeze(1))
    return v_out.flatten(4, 5), _linear(sd, "audio_outLayer.out_layer", a_out)


@functools.lru_cache(maxsize=4)
def built(path: str):
    """(family, config, model) of a file, built once per process (each adapter points it at its own strategies)."""
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
        config = family.infer_config(reader, match, "k6")
        return family, config, family.build(config, reader, match, lambda n: True, torch.float32, "cpu").eval()


def serial_call(path: str, video, audio, timestep, context, pooled, video_rows=None, audio_rows=None, attention=None):
    """The family on one rank over the rows given (all by default), in the call's shapes where all are given."""
    from parallel_runtime.strategies.attention.processor import AttentionContext

    family, config, model = built(path)
    adapter = family.adapter(config, model, [range(config.num_blocks)], attention or AttentionContext())
    tokens = adapter.pack(video)
    v = torch.arange(tokens.shape[1]) if video_rows is None else video_rows
    a = torch.arange(audio.shape[1]) if audio_rows is None else audio_rows
    video_t, audio_t = adapter.call_timesteps(timestep, None, (T, H, W), audio.shape[1])
    with torch.no_grad():
        out_v, out_a = adapter.forward_rows(tokens[:, v], audio[:, a], context, pooled, video_t[:, v], audio_t[:, a],
                                            timestep, timestep, adapter.rope((T, H, W), v, audio.shape[1], a))
    return (adapter.unpack(out_v, T, H, W), out_a) if video_rows is None and audio_rows is None else (out_v, out_a)


# -- detection and parity ---------------------------------------------------------------------------------------

def _diffusers_twin(path: str, folder) -> str:
    names = {original_name(n): n for n in source_names()}
    out = str(folder / "diffusers-kandinsky6.safetensors")
    save_file({"transformer." + names[k[len(PREFIX):]]: v for k, v in load_file(path).items()}, out)
    return out


def source_names():
    from parallel_runtime.models.families.kandinsky6 import _meta_model

    return list(_meta_model(TINY).state_dict())


def test_files_are_detected_in_both_layouts_and_distilled_files_refused(k6_path, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    twin = _diffusers_twin(k6_path, tmp_path)
    for path, layout, prefix in ((k6_path, "original", PREFIX), (twin, "diffusers", "transformer.")):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("kandinsky6", layout, prefix)
        assert model_config(path) == TINY, layout
    sd = load_file(k6_path)  # a PiFlow file: its heads predict 2 DX grids
    for key in ("out_layer.out_layer.weight", "out_layer.out_layer.bias"):
        sd[PREFIX + key] = torch.cat([sd[PREFIX + key]] * 2)
    piflow = str(tmp_path / "k6-piflow.safetensors")
    save_file(sd, piflow)
    with pytest.raises(ModelFileError, match=r"distilled Kandinsky 6 file \(PiFlow, 2 DX grids\).*UNETLoader"):
        model_config(piflow)


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_serial_matches_diffusers_and_comfyuis_model_call(k6_path, layout, tmp_path):
    """The family on one rank equals diffusers' Kandinsky6Transformer3DModel and ComfyUI 2026's model call (written
    here from its source) on the same file, in either layout. Measured: 0.0 against diffusers (its own modules),
    ~2e-7 against ComfyUI's (float64 RoPE frequencies, another op order)."""
    x = call_inputs(call_job(k6_path, None))
    path = k6_path if layout == "original" else _diffusers_twin(k6_path, tmp_path)
    got_v, got_a = serial_call(path, *x)
    for name, (want_v, want_a) in (("diffusers", diffusers_call(k6_path, *x)), ("comfyui", comfyui_call(k6_path, *x))):
        assert want_v.abs().mean() > 0.1 and want_a.abs().mean() > 0.1  # outputs of O(1): a real comparison
        errors = rel_err(got_v, want_v), rel_err(got_a, want_a)
        print(f"\n{layout} file vs {name}: video {errors[0]:.1e}, audio {errors[1]:.1e}")
        assert max(errors) < RTOL, (name, errors)


# -- the runtime's model call ---------------------------------------------------------------------------------

def test_model_call_one_worker_equals_the_serial_forward(k6_path, client1):
    from parallel_runtime.spec import StrategySpec

    job = call_job(k6_path, StrategySpec())
    want_v, want_a = serial_call(k6_path, *call_inputs(job))
    result = client1.run(job)
    assert result.latent.shape == job.latent.shape and result.audio.shape == job.audio.shape
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\nmodel call, 1 worker: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < RTOL, errors


@pytest.mark.parametrize("strategy", [dict(cfg_degree=2), dict(ulysses_degree=2), dict(ring_degree=2),
                                      dict(tensor_degree=2), dict(ulysses_degree=2, shard_weights=True),
                                      dict(pipefusion_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "ulysses2_sharded", "pipefusion2"])
def test_model_call_exact_strategies_equal_the_serial_forward(k6_path, client2, strategy):
    """Both streams split over two ranks (18 video rows: 9 + 9, 7 audio rows: 4 + 3), the chunks over the CFG
    pair, the heads and MLP units of all six attentions and both MLPs over the tensor pair, each fused block's
    bytes sharded over the pair and gathered as it runs (the text blocks stay whole), and PipeFusion's two
    stages of one block each on a call of its warm-up (the whole call as one token set: exact)."""
    from parallel_runtime.spec import StrategySpec

    job = call_job(k6_path, StrategySpec(**strategy))
    want_v, want_a = serial_call(k6_path, *call_inputs(job))
    result = client2.run(job)
    errors = rel_err(result.latent, want_v), rel_err(result.audio, want_a)
    print(f"\n{StrategySpec.label(StrategySpec(**strategy))}: video {errors[0]:.1e}, audio {errors[1]:.1e}")
    assert max(errors) < RTOL, errors  # exact strategies reorder sums: fp32 round-off
    if strategy == dict(tensor_degree=2):
        # The text blocks and every modulation split with the fused blocks (whole, they left each rank 0.74 of the
        # file's weights): only the embedders and heads stay whole.
        from safetensors import safe_open

        with safe_open(k6_path, "pt") as f:
            whole = 4 * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # fp32 bytes
        held = max(st["param_bytes"] for st in result.stats) / whole
        print(f"tensor2: {held:.2f} of the weights per rank")
        assert held <= 0.6


def test_model_call_inputs_it_cannot_run_are_refused_in_one_sentence(k6_path):
    from parallel_runtime.spec import StrategySpec
    from parallel_runtime.validate import validate_job

    job = call_job(k6_path, StrategySpec())
    validate_job(job, 1)  # the call itself is accepted
    cases = {r"audio latent has shape \(2, 7, 5\).*Kandinsky6EmptyLatent": dict(audio=job.audio[..., :5]),
             r"reads one timestep for both streams": dict(audio_timestep=torch.full((2,), 100.0)),
             r"not on displaced patch parallelism yet; set patch_degree to 1\.$": dict(
                 strategy=StrategySpec(patch_degree=2)),
             r"splits Kandinsky 6 64-wide x 2's 2 audio heads by ulysses_degree.*divisor of 2\.$": dict(
                 strategy=StrategySpec(ulysses_degree=4)),
             r"PipeFusion on whole stages \(beside CFG\), not inside Ulysses.*or pipefusion_degree to 1\.$": dict(
                 strategy=StrategySpec(pipefusion_degree=2, ulysses_degree=2))}
    for message, change in cases.items():
        with pytest.raises(ConfigError, match=message) as refused:
            validate_job(dataclasses.replace(job, **change), change["strategy"].world_size if "strategy" in change
                         else 1)
        assert str(refused.value).count(". ") == 0  # one sentence


# -- PipeFusion's and naive patch's error on a multi-step run ---------------------------------------------------

def test_pipefusion_and_naive_patch_errors_on_a_multistep_run(k6_path):
    """A 6-step Euler run over 2 video patches: PipeFusion (stale K/V per stream attention, the audio rows with
    patch 0, 1 warm-up step; the runtime's StaleKVAttention, which gives the pipeline's numbers whatever the stage
    count) stays near the serial run; naive patch (each patch alone with its share of the audio rows) drifts
    further. Measured (video, audio relative L2): PipeFusion 0.018, 0.034; naive 0.19, 0.11. Bounds: PipeFusion
    under 0.07 (2x its largest) and under half of naive's smallest."""
    from parallel_runtime.strategies.attention import LocalAttention
    from parallel_runtime.strategies.attention.processor import AttentionContext
    from parallel_runtime.strategies.pipefusion import StaleKVAttention, StaleKVCache
    from test_ltx2 import shards

    video, audio, _, context, pooled = call_inputs(call_job(k6_path, None))
    nv, na = T * (H // 2) * (W // 2), AUDIO_FRAMES
    sigmas = torch.linspace(1.0, 0.0, 7)

    def run(passes):
        v, a = Kandinsky6Adapter.pack(video), audio.clone()
        for i in range(6):
            out_v, out_a = passes(i, v, a, torch.full((2,), float(sigmas[i]) * 1000.0))
            v, a = v + (sigmas[i + 1] - sigmas[i]) * out_v, a + (sigmas[i + 1] - sigmas[i]) * out_a
        return v, a

    def serial(step, v, a, t):
        return serial_call(k6_path, Kandinsky6Adapter.unpack(v, T, H, W), a, t, context, pooled,
                           torch.arange(nv), torch.arange(na))

    def patched(stale):
        caches = {k: StaleKVAttention(StaleKVCache(n), LocalAttention()) for k, n in
                  (("video", nv), ("audio", na), ("a2v", na), ("v2a", nv))}
        attention = AttentionContext(attention=caches["video"], streams={k: caches[k] for k in ("audio", "a2v", "v2a")})

        def one(v, a, t, video_rows, audio_rows):
            for key, cache in caches.items():
                cache.positions = video_rows if key in ("video", "v2a") else audio_rows
            return serial_call(k6_path, Kandinsky6Adapter.unpack(v, T, H, W), a, t, context, pooled, video_rows,
                               audio_rows, attention if stale else None)

        def passes(step, v, a, t):
            if stale and step == 0:
                return one(v, a, t, torch.arange(nv), torch.arange(na))
            out_v, out_a = torch.empty_like(v), torch.empty_like(a)
            for p, rows in enumerate(shards(nv, 2)):
                audio_rows = (torch.arange(na) if p == 0 else torch.arange(0)) if stale else shards(na, 2)[p]
                out_v[:, rows], out_a[:, audio_rows] = one(v, a, t, rows, audio_rows)
            return out_v, out_a

        return passes

    want = run(serial)
    errors = {kind: tuple(rel_err(g, w) for g, w in zip(run(patched(stale)), want))
              for kind, stale in (("pipefusion", True), ("naive", False))}
    print(f"\nPipeFusion-2 {errors['pipefusion']}, naive patch-2 {errors['naive']}")
    assert max(errors["pipefusion"]) < min(0.07, 0.5 * min(errors["naive"])), errors


# -- Parallel Sampler's loop on the joint latent ------------------------------------------------------------------

STEPS, CFG, SEED = 4, 3.0, 42


def sampler_job(path: str, strategy) -> "Job":  # noqa: F821 - the runtime's Job
    """Kandinsky6EmptyLatent's joint latent (zeros) through Parallel Sampler: euler, simple, cfg 3."""
    from parallel_runtime.spec import SamplingSpec

    job = call_job(path, strategy)
    return dataclasses.replace(job, latent=torch.zeros_like(job.latent[:1]), audio=torch.zeros_like(job.audio[:1]),
                               timestep=None, sampling=SamplingSpec(seed=SEED, steps=STEPS, cfg=CFG,
                                                                    sampler_name="euler", scheduler="simple"))


def ksampler_reference(path: str, job) -> tuple[torch.Tensor, torch.Tensor]:
    """KSampler's euler as ComfyUI samples Kandinsky 6's joint latent: comfy.sample.prepare_noise over the
    NestedTensor (one generator, video then audio), the "simple" schedule of ModelSamplingDiscreteFlow (shift 5,
    1000-entry float32 table at t = 1, 3/4, 1/2, 1/4, then 0), [cond; uncond] through ComfyUI's model call at
    t = sigma x 1000, CONST's denoised, CFG, and process_latent_out of the video (HunyuanVideo: / 0.476986)."""
    g = torch.Generator().manual_seed(SEED)
    noise_v, noise_a = torch.randn(job.latent.shape, generator=g), torch.randn(job.audio.shape, generator=g)
    t = torch.tensor([1.0 - k / STEPS for k in range(STEPS)], dtype=torch.float32)
    sigmas = torch.cat([5.0 * t / (1 + 4.0 * t), torch.zeros(1)])
    x_v, x_a = sigmas[0] * noise_v, sigmas[0] * noise_a
    context = torch.cat([job.positive.cond, job.negative.cond])
    pooled = torch.cat([job.positive.pooled, job.negative.pooled])
    for i in range(STEPS):
        s = sigmas[i]
        out_v, out_a = comfyui_call(path, x_v.repeat(2, 1, 1, 1, 1), x_a.repeat(2, 1, 1), (s * 1000).expand(2),
                                    context, pooled)
        (cv, uv), (ca, ua) = (x_v.repeat(2, 1, 1, 1, 1) - out_v * s).chunk(2), (x_a.repeat(2, 1, 1) - out_a * s).chunk(2)
        den_v, den_a = uv + (cv - uv) * CFG, ua + (ca - ua) * CFG
        x_v = x_v + (x_v - den_v) / s * (sigmas[i + 1] - s)
        x_a = x_a + (x_a - den_a) / s * (sigmas[i + 1] - s)
    return x_v / 0.476986, x_a


def test_parallel_sampler_equals_ksamplers_loop_and_splits_exactly(k6_path, client1, client2):
    """Parallel Sampler's loop on the joint latent at 1 worker equals KSampler's loop over ComfyUI's model call;
    Ulysses-2 (both streams split every step) and CFG-2 equal the 1-worker run."""
    from parallel_runtime.spec import StrategySpec

    want_v, want_a = ksampler_reference(k6_path, sampler_job(k6_path, StrategySpec()))
    serial = client1.run(sampler_job(k6_path, StrategySpec()))
    assert want_a.abs().mean() > 0.1  # the audio really was sampled
    errors = {"1 worker vs KSampler": (rel_err(serial.latent, want_v), rel_err(serial.audio, want_a))}
    for label, degrees in (("ulysses2", dict(ulysses_degree=2)), ("cfg2", dict(cfg_degree=2))):
        out = client2.run(sampler_job(k6_path, StrategySpec(**degrees)))
        errors[label] = rel_err(out.latent, serial.latent), rel_err(out.audio, serial.audio)
    print("\n" + ", ".join(f"{k}: video {v:.1e} audio {a:.1e}" for k, (v, a) in errors.items()))
    assert max(max(e) for e in errors.values()) < RTOL, errors  # fp32 loops, another op order: ~1e-7 per call
