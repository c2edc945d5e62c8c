"""SD3 ControlNets (ComfyUI's comfy.cldm.mmdit.ControlNet) on the workers, under every strategy.

The reference runs diffusers' own SD3ControlNetModel.forward (its position crop, hint embedding and blocks, with
their stock processors) with the pooled input zeroed as ComfyUI's ControlNet zeroes it, and the DiT's blocks by hand
with the residuals listed as comfy.cldm.mmdit lists them (each ControlNet block's output depth // blocks times, one
fewer for the last; depth = width / 64) and added to every image row after DiT block i, as ComfyUI's MMDiT adds
`control`. A residual on the wrong block, rows or branch is an O(1e-1) error.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_conditioning, rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.models.families import sd3, sd3_controlnet
from parallel_runtime.models.family import Match
from parallel_runtime.models.tiny import (TINY, write_checkpoint, write_controlnet, write_sd3_controlnet,
                                         write_sd35_controlnet)
from parallel_runtime.spec import ControlInput, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.weights.checkpoint import open_checkpoint
from parallel_runtime.weights.mapping import build_from_map

pytestmark = pytest.mark.timeout(600)

# One fp32 forward in another op order than diffusers' stock processors: ~1e-7..1e-6; exact strategies reorder
# float32 sums (~1e-7 per op). A misplaced residual is ~1e-1.
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
H, W = 12, 16  # latent; 6 x 8 = 48 tokens
# 4 heads of 64 (ComfyUI's depth = 256 / 64 = 4 blocks); SD3.5 Medium's image-only attn2 in block 0.
DIT = sd3.SD3Config(hidden_size=256, num_layers=4, pos_embed_max_size=16, context_dim=32, pooled_dim=24,
                    dual_attention_layers=(0,))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sd3-controlnet")
    return {"dit": write_checkpoint(str(d / "sd3.safetensors"), DIT, seed=5),
            # 2 blocks: outputs listed [0, 0, 1] over the DiT's 4 blocks; its block 0 has attn2 too.
            "two": write_sd3_controlnet(d / "two.safetensors", DIT, blocks=2, seed=1, dual_attention_layers=(0,)),
            # 1 block: [0, 0, 0].
            "one": write_sd3_controlnet(d / "one.safetensors", DIT, blocks=1, seed=2),
            # An inpainting ControlNet: the hint latent and its mask (17 channels).
            "inpaint": write_sd3_controlnet(d / "inpaint.safetensors", DIT, blocks=1, seed=3, hint_channels=17),
            # Stability's SD3.5 kind, 2 image-only blocks chained: listed [0, 0, 1, 1]; with the DiT's x embedder.
            "sd35": write_sd35_controlnet(d / "sd35.safetensors", DIT, blocks=2, seed=4),
            # Its "double y" kind, 2 blocks not chained: the DiT's y embedder first, its own x embedder.
            "sd35_double": write_sd35_controlnet(d / "sd35-double.safetensors", DIT, blocks=2, double_y=True,
                                                 seed=6)}


def control(files, kind: str, seed: int, strength: float = 1.0) -> ControlInput:
    """The hint as ComfyUI prepares it: a VAE latent x 1.5305 (the ControlNet's SD3 format, shift 0), and for the
    inpainting ControlNet its mask channel."""
    channels = 17 if kind == "inpaint" else 16
    hint = torch.randn(1, channels, H, W, generator=torch.Generator().manual_seed(seed))
    return ControlInput(files[kind], f"sd3-{kind}-{seed}", strength, hint)


def call_job(files, strategy: S, pos_control=(), neg_control=(), negative: bool = True) -> Job:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 if negative else 1, 16, H, W, generator=g)
    pos = dataclasses.replace(make_conditioning(1, 7, DIT), control=tuple(pos_control))
    neg = dataclasses.replace(make_conditioning(2, 7, DIT), control=tuple(neg_control)) if negative else None
    t = torch.full((x.shape[0],), 700.0)  # SD3's timestep units: 1000 sigma
    return Job(ModelSpec(files["dit"]), strategy, SamplingSpec(steps=1), x, pos, neg, timestep=t)


# -- the reference ---------------------------------------------------------------------------------------


def _comfy_listing(blocks: int, depth: int) -> list[int]:
    """comfy.cldm.mmdit.ControlNet.forward's output list: block i's residual `depth // blocks` times, the last
    block's once fewer."""
    count = depth // blocks
    return [i for i in range(blocks) for _ in range(count - (i == blocks - 1))]


def _load(path: str, controlnet: bool):
    with open_checkpoint(path) as reader:
        if controlnet:
            config = sd3_controlnet.read_config(reader)
            model = build_from_map(sd3_controlnet.meta_model(config), sd3_controlnet.source_map(config), reader,
                                   ("transformer_blocks",), "SD3 ControlNet")
            return model.eval(), config
        config = sd3.infer_config(reader, Match("original", ""), "dit")
        return sd3.SD3.build(config, reader, Match("original", ""), owned=lambda n: True, dtype=torch.float32,
                             device="cpu").eval(), config


def _sincos(dim: int, w: int, h: int) -> torch.Tensor:
    """ComfyUI's get_2d_sincos_pos_embed_torch, written out."""
    def one_axis(d, pos):
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float32) / (d / 2.0))
        out = torch.einsum("m,d->md", pos.reshape(-1), omega)
        return torch.cat([out.sin(), out.cos()], dim=1)

    small = min(h, w)
    gh, gw = torch.meshgrid(torch.linspace(-(h / small) * 7.5 + 7.5, (h / small) * 7.5 + 7.5, h),
                            torch.linspace(-(w / small) * 7.5 + 7.5, (w / small) * 7.5 + 7.5, w), indexing="ij")
    return torch.cat([one_axis(dim // 2, gw), one_axis(dim // 2, gh)], dim=1)


def _linear(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def _dismantled_block(sd: dict, name: str, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """ComfyUI's DismantledBlock (image-only, no q/k norm) from its tensors."""
    F, hidden = torch.nn.functional, x.shape[-1]
    modulation = _linear(sd, f"{name}.adaLN_modulation.1", F.silu(c))
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = modulation.chunk(6, dim=1)
    h = F.layer_norm(x, (hidden,), eps=1e-6) * (1 + scale_a[:, None]) + shift_a[:, None]
    q, k, v = (t.unflatten(-1, (hidden // 64, 64)).transpose(1, 2)
               for t in _linear(sd, f"{name}.attn.qkv", h).chunk(3, dim=-1))
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
    x = x + gate_a[:, None] * _linear(sd, f"{name}.attn.proj", attn)
    h = F.layer_norm(x, (hidden,), eps=1e-6) * (1 + scale_m[:, None]) + shift_m[:, None]
    return x + gate_m[:, None] * _linear(sd, f"{name}.mlp.fc2", F.gelu(_linear(sd, f"{name}.mlp.fc1", h),
                                                                         approximate="tanh"))


def _sd35_samples(path: str, dit, x, hint, t, pooled, strength) -> tuple[list[torch.Tensor], int]:
    """ComfyUI's ControlNetEmbedder.forward after ControlNetSD35.pre_run put the DiT's x (or first y) embedder in:
    (its output list, entries per block)."""
    F, sd = torch.nn.functional, load_file(path)
    hidden = sd["y_embedder.mlp.0.weight"].shape[0]
    double = sd["y_embedder.mlp.0.weight"].shape[1] == hidden
    blocks = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    if double:
        img = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=2).flatten(2).transpose(1, 2)
        y = dit.time_text_embed.text_embedder(pooled)
    else:
        img = dit.pos_embed.proj(x).flatten(2).transpose(1, 2) + _sincos(hidden, x.shape[-1] // 2, x.shape[-2] // 2)
        y = pooled
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(128) / 128)
    args = t[:, None].float() * freqs[None]
    sinusoid = torch.cat([args.cos(), args.sin()], dim=-1)
    c = _linear(sd, "t_embedder.mlp.2", F.silu(_linear(sd, "t_embedder.mlp.0", sinusoid)))
    c = c + _linear(sd, "y_embedder.mlp.2", F.silu(_linear(sd, "y_embedder.mlp.0", y)))
    img = img + F.conv2d(hint, sd["pos_embed_input.proj.weight"], sd["pos_embed_input.proj.bias"],
                         stride=2).flatten(2).transpose(1, 2)
    outs = []
    for i in range(blocks):
        out = _dismantled_block(sd, f"transformer_blocks.{i}", img, c)
        img = img if double else out
        outs.append(_linear(sd, f"controlnet_blocks.{i}", out) * strength)
    return outs, -(-(hidden // 64) // blocks)


@torch.no_grad()
def reference_call(files, job: Job) -> torch.Tensor:
    dit, config = _load(files["dit"], False)
    h, w = job.latent.shape[-2:]
    rows = []
    for k, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        x, t = job.latent[k:k + 1], job.timestep[k:k + 1]
        added = [0] * config.num_layers
        for c in branch.control:
            if "sd35" in c.path:  # the fixture's SD3.5 kind (ControlNetEmbedder): each block's output `repeat` times
                samples, repeat = _sd35_samples(c.path, dit, x, c.hint, t, branch.pooled, c.strength)
                listing = [i for i in range(len(samples)) for _ in range(repeat)]
            else:
                net, net_config = _load(c.path, True)
                samples = net(hidden_states=x, controlnet_cond=c.hint, conditioning_scale=c.strength,
                              encoder_hidden_states=branch.cond, pooled_projections=torch.zeros_like(branch.pooled),
                              timestep=t, return_dict=False)[0]
                listing = _comfy_listing(net_config.outputs, net_config.hidden_size // 64)
            for i, j in enumerate(listing[:config.num_layers]):
                added[i] = added[i] + samples[j]
        img = dit.pos_embed(x)
        temb = dit.time_text_embed(t, branch.pooled)
        txt = dit.context_embedder(branch.cond)
        for i, block in enumerate(dit.transformer_blocks):
            txt, img = block(hidden_states=img, encoder_hidden_states=txt, temb=temb)
            img = img + added[i]
        out = dit.proj_out(dit.norm_out(img, temb))  # tokens of (ph, pw, c)
        out = out.reshape(1, h // 2, w // 2, 2, 2, 16).permute(0, 5, 1, 3, 2, 4).reshape(1, 16, h, w)
        rows.append(out)
    return torch.cat(rows)


# -- tests -----------------------------------------------------------------------------------------------


def test_residual_index_follows_comfyuis_listing():
    two = sd3_controlnet.SD3ControlNetConfig(dataclasses.replace(DIT, num_layers=2), 16)
    assert two.residual_index(4) == {0: 0, 1: 0, 2: 1}  # depth 4, 2 blocks: [0, 0, 1]
    wide = sd3_controlnet.SD3ControlNetConfig(dataclasses.replace(DIT, hidden_size=24 * 64, num_layers=5), 16)
    listing = _comfy_listing(5, 24)  # SD3 Medium's depth over 5 blocks: 4 each, 3 for the last = 23 entries
    assert wide.residual_index(24) == dict(enumerate(listing))
    assert two.residual_index(2) == {0: 0, 1: 0}  # a DiT shorter than the list reads its first entries
    sd35 = sd3_controlnet.SD35ControlNetConfig(38 * 64, 19, False, 2048, 16)  # SD3.5 Large's depth over 19 blocks
    assert sd35.residual_index(38) == {i: i // 2 for i in range(38)}
    sd35 = dataclasses.replace(sd35, num_layers=5)  # ceil(38 / 5) = 8 each: 40 entries, the DiT reads 38
    assert sd35.residual_index(38) == {i: i // 8 for i in range(38)}


@pytest.mark.parametrize("kind", ["two", "one", "inpaint", "sd35", "sd35_double"])
def test_one_worker_equals_the_reference(files, client1, kind):
    job = call_job(files, S(), [control(files, kind, 11)], [control(files, kind, 12)])
    ref = reference_call(files, job)
    assert rel_err(ref, reference_call(files, call_job(files, S()))) > 1e-2  # the ControlNet acts
    assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL


def test_chain_with_strengths_and_per_branch_controls(files, client1):
    """Two chained ControlNets (strength 0.6, then 1.3) on the positive branch, another on the negative."""
    job = call_job(files, S(), [control(files, "two", 11, 0.6), control(files, "one", 12, 1.3)],
                   [control(files, "inpaint", 13)])
    assert rel_err(client1.run(job).latent, reference_call(files, job)) < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2), S(patch_degree=2),
                                      S(tensor_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup", "patch2_warmup", "tp2"])
def test_exact_strategies_equal_one_worker(files, client1, client2, strategy):
    """Chained ControlNets on both branches (the negative's differ; an SD3.5 one there, whose blocks attend over the
    image rows alone); PipeFusion's and displaced patch's first call of a run is exact."""
    pos = [control(files, "two", 11, 0.6), control(files, "one", 12, 1.3)]
    neg = [control(files, "sd35", 14), control(files, "sd35_double", 15, 0.8)]
    serial = client1.run(call_job(files, S(), pos, neg)).latent
    assert rel_err(client2.run(call_job(files, strategy, pos, neg)).latent, serial) < EXACT_RTOL


def test_pipefusion_keeps_the_controlnets_stale_kv(files, client4):
    """PipeFusion x Ulysses on 4 workers: exact warm-up; the next call (another x and t) reads the ControlNets' K/V
    of the other patch as the first call left them, near exact as the DiT alone is."""
    pp = S(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2)
    job = call_job(files, pp, [control(files, "two", 11), control(files, "sd35", 12)], negative=False)
    g = torch.Generator().manual_seed(1)
    later = dataclasses.replace(job, latent=0.9 * job.latent + 0.2 * torch.randn(job.latent.shape, generator=g),
                                timestep=torch.full((1,), 600.0), call_step=1, call_last=True)
    assert rel_err(client4.run(dataclasses.replace(job, call_step=0)).latent, reference_call(files, job)) < EXACT_RTOL
    # Measured 5.8e-3 (the DiT alone on these inputs: 1.3e-2).
    assert rel_err(client4.run(later).latent, reference_call(files, later)) < 0.02


def test_refusals(files, client1, tmp_path):
    flux = write_controlnet(tmp_path / "flux.safetensors", TINY, "xlabs", double=1)
    job = call_job(files, S(), [ControlInput(flux, "sd3-f", 1.0, torch.rand(1, 3, 8 * H, 8 * W))])
    with pytest.raises(ModelFileError, match="is not an SD3 ControlNet"):
        client1.run(job)
    narrow = write_sd3_controlnet(tmp_path / "narrow.safetensors", dataclasses.replace(DIT, hidden_size=128))
    job = call_job(files, S(), [ControlInput(narrow, "sd3-n", 1.0, torch.randn(1, 16, H, W))])
    with pytest.raises(ConfigError, match="ControlNet is 128 wide but this SD3.5 Medium model is 256"):
        client1.run(job)


def test_families_without_controlnets_name_those_with(files):
    """A ControlNet on a family whose ControlNets do not run on the workers: one sentence naming the ones that do."""
    from parallel_runtime.models.families.chroma import ChromaConfig
    from parallel_runtime.validate import validate_control

    chroma = ChromaConfig(hidden_size=64, num_heads=2, head_dim=32, num_layers=2, num_single_layers=2,
                          context_dim=32, approximator_hidden=32, approximator_layers=2)
    job = call_job(files, S(), [control(files, "one", 11)])
    with pytest.raises(ConfigError, match=r"ControlNets for Chroma do not run on the ParaDiT workers yet, only those "
                                          r"for Flux.1 \(dev/schnell\), SD3 / SD3.5 \(Medium, Large\) and Qwen-Image "
                                          r"\(and Edit\); remove"):
        validate_control("positive", job.positive, chroma, job)
