"""Qwen-Image ControlNets (ComfyUI's QwenImageControlNetModel, InstantX's) on the workers, under every strategy.

The reference runs diffusers' Qwen-Image blocks with their stock attention processor and RoPE rotation, fed
ComfyUI's ids (the text on the diagonal after the image's half-extent, the image and Edit's references centred on
themselves) as complex frequencies; the ControlNet as ComfyUI's forward does (img_in(x) + controlnet_x_embedder(hint),
a projection after each block) and its residuals listed as ComfyUI lists them (each block's ceil(60 / blocks) times),
added to the DiT's image rows after each block, never to the reference rows. A residual on the wrong block, rows or
branch is an O(1e-1) error.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import rel_err
from parallel_runtime.errors import ConfigError
from parallel_runtime.models.families import qwen_image, qwen_image_controlnet
from parallel_runtime.models.family import Match
from parallel_runtime.models.tiny import write_checkpoint, write_qwen_image_controlnet
from parallel_runtime.sampling import WAN21_LATENT
from parallel_runtime.spec import Conditioning, ControlInput, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.weights.checkpoint import open_checkpoint
from parallel_runtime.weights.mapping import build_from_map
from parallel_runtime.weights.keymap import same_names

pytestmark = pytest.mark.timeout(600)

# One fp32 forward in another op order than diffusers' stock processor: ~1e-7..1e-6; exact strategies reorder
# float32 sums (~1e-7 per op). A misplaced residual is ~1e-1.
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
H, W = 12, 16  # latent; 6 x 8 = 48 tokens
DIT = qwen_image.QwenImageConfig(hidden_size=128, num_heads=2, head_dim=64, num_layers=4, context_dim=32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-controlnet")
    return {"dit": write_checkpoint(str(d / "qwen.safetensors"), DIT, seed=5),
            # 2 blocks: each residual 30 times, so blocks 0-3 all read the first.
            "two": write_qwen_image_controlnet(d / "two.safetensors", DIT, blocks=2, seed=1),
            # An inpainting ControlNet: the hint latent and its mask (68 packed channels).
            "inpaint": write_qwen_image_controlnet(d / "inpaint.safetensors", DIT, blocks=1, seed=2,
                                                   hint_channels=68)}


def control(files, kind: str, seed: int, strength: float = 1.0) -> ControlInput:
    """The hint as ComfyUI prepares it: a Wan VAE latent of one frame after process_in ([1, C, 1, H, W]), and for the
    inpainting ControlNet its mask channel."""
    channels = 17 if kind == "inpaint" else 16
    hint = torch.randn(1, channels, 1, H, W, generator=torch.Generator().manual_seed(seed))
    return ControlInput(files[kind], f"qwen-{kind}-{seed}", strength, hint)


def conditioning(seed: int, references=()) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(1, 7, DIT.context_dim, generator=g), torch.zeros(1, 0), references=references)


def call_job(files, strategy: S, pos_control=(), neg_control=(), negative: bool = True, edit: bool = False) -> Job:
    """A model call; `edit`: the positive carries an 8 x 10 reference latent (Qwen-Image Edit), the negative none."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 if negative else 1, 16, H, W, generator=g)
    refs = (torch.randn(1, 16, 8, 10, generator=g),) if edit else ()
    pos = dataclasses.replace(conditioning(1, refs), control=tuple(pos_control))
    neg = dataclasses.replace(conditioning(2), control=tuple(neg_control)) if negative else None
    t = torch.full((x.shape[0],), 0.7)
    return Job(ModelSpec(files["dit"]), strategy, SamplingSpec(steps=1), x, pos, neg, timestep=t)


# -- the reference ---------------------------------------------------------------------------------------


def _grid(rows: int, cols: int, index: int = 0) -> torch.Tensor:
    """ComfyUI's process_img ids: [index, row - rows // 2, col - cols // 2], row-major."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(rows)[:, None] - rows // 2
    ids[..., 2] = torch.arange(cols)[None, :] - cols // 2
    return ids.reshape(-1, 3)


def _frequencies(ids: torch.Tensor) -> torch.Tensor:
    """ComfyUI's EmbedND angles (float64 frequencies of float32 ids) as complex rotations [S, head_dim / 2]."""
    parts = []
    for k, dim in enumerate(DIT.axes_dims_rope):
        omega = 1.0 / 10000 ** torch.linspace(0, (dim - 2) / dim, dim // 2, dtype=torch.float64)
        angles = ids[:, k].double()[:, None] * omega
        parts.append(torch.complex(angles.cos().float(), angles.sin().float()))
    return torch.cat(parts, dim=1)


def _load(path: str, controlnet: bool):
    with open_checkpoint(path) as reader:
        if controlnet:
            config = qwen_image_controlnet.read_config(reader)
            meta = qwen_image_controlnet.meta_model(config)
            return build_from_map(meta, same_names(n for n, _ in meta.named_parameters()), reader,
                                  ("transformer_blocks",), "ControlNet").eval(), config
        config = qwen_image.infer_config(reader, Match("diffusers", ""), "dit")
        return qwen_image.QWEN_IMAGE.build(config, reader, Match("diffusers", ""), owned=lambda n: True,
                                           dtype=torch.float32, device="cpu").eval(), config


def _blocks(model, img, txt, temb, img_freqs, txt_freqs, after=lambda i, img: img):
    for i, block in enumerate(model.transformer_blocks):
        txt, img = block(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=None, temb=temb,
                         image_rotary_emb=(img_freqs, txt_freqs))
        img = after(i, img)
    return img


@torch.no_grad()
def reference_call(files, job: Job) -> torch.Tensor:
    dit, config = _load(files["dit"], False)
    pack = qwen_image.QwenImageAdapter.pack
    rows = []
    for k, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        x, t = job.latent[k:k + 1], job.timestep[k:k + 1]
        start = max(W // 2 // 2, H // 2 // 2)
        txt_freqs = _frequencies(torch.arange(start, start + 7).float()[:, None].expand(7, 3))
        img_freqs = _frequencies(_grid(H // 2, W // 2))
        added = [0] * config.num_layers
        for c in branch.control:
            net, net_config = _load(c.path, True)
            outs = []
            img = net.img_in(pack(x)) + net.controlnet_x_embedder(pack(c.hint[:, :, 0]))
            txt = net.txt_in(net.txt_norm(branch.cond))
            temb = net.time_text_embed(t, img)
            _blocks(net, img, txt, temb, img_freqs, txt_freqs,
                    after=lambda i, img, net=net, outs=outs: outs.append(net.controlnet_blocks[i](img)) or img)
            repeat = math.ceil(60 / len(outs))
            listing = [j for j in range(len(outs)) for _ in range(repeat)][:60]
            for i, j in enumerate(listing[:config.num_layers]):
                added[i] = added[i] + outs[j] * c.strength
        img = dit.img_in(pack(x))
        n = img.shape[1]
        for ref in branch.references:  # Edit's reference: index 1, centred on itself, after the image rows
            img = torch.cat([img, dit.img_in(pack(WAN21_LATENT.process_in(ref)))], dim=1)
            img_freqs = torch.cat([img_freqs, _frequencies(_grid(ref.shape[-2] // 2, ref.shape[-1] // 2, 1))])
        txt = dit.txt_in(dit.txt_norm(branch.cond))
        temb = dit.time_text_embed(t, img)
        img = _blocks(dit, img, txt, temb, img_freqs, txt_freqs,
                      after=lambda i, img: torch.cat([img[:, :n] + added[i], img[:, n:]], dim=1))
        out = dit.proj_out(dit.norm_out(img[:, :n], temb))
        rows.append(qwen_image.QwenImageAdapter.unpack(out, H, W))
    return torch.cat(rows)


# -- tests -----------------------------------------------------------------------------------------------


def test_residual_index_follows_comfyuis_listing():
    config = qwen_image_controlnet.QwenImageControlNetConfig(dataclasses.replace(DIT, num_layers=5), 64)
    assert config.residual_index(60) == {i: i // 12 for i in range(60)}  # InstantX's 5 blocks over Qwen-Image's 60
    seven = dataclasses.replace(config, qwen=dataclasses.replace(DIT, num_layers=7))
    assert seven.residual_index(60) == {i: i // 9 for i in range(60)}  # 63 listed, cut at 60
    assert seven.residual_index(4) == {0: 0, 1: 0, 2: 0, 3: 0}


@pytest.mark.parametrize("kind", ["two", "inpaint"])
def test_one_worker_equals_the_reference(files, client1, kind):
    job = call_job(files, S(), [control(files, kind, 11)], [control(files, kind, 12)])
    ref = reference_call(files, job)
    assert rel_err(ref, reference_call(files, call_job(files, S()))) > 1e-2  # the ControlNet acts
    assert rel_err(client1.run(job).latent, ref) < SERIAL_RTOL


def test_edit_reference_and_chain_one_worker_equals_the_reference(files, client1):
    """Qwen-Image Edit with two chained ControlNets (strength 0.6, then 1.3) on the positive, one on the negative."""
    job = call_job(files, S(), [control(files, "two", 11, 0.6), control(files, "inpaint", 12, 1.3)],
                   [control(files, "two", 13)], edit=True)
    assert rel_err(client1.run(job).latent, reference_call(files, job)) < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2), S(patch_degree=2),
                                      S(tensor_degree=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup", "patch2_warmup", "tp2"])
@pytest.mark.parametrize("edit", [False, True], ids=["t2i", "edit"])
def test_exact_strategies_equal_one_worker(files, client1, client2, strategy, edit):
    """Chained ControlNets on both branches; with an Edit reference on the positive, its rows split over the ranks
    after their image rows (PipeFusion: two lanes). PipeFusion's and displaced patch's first call is exact."""
    pos = [control(files, "two", 11, 0.6), control(files, "inpaint", 12, 1.3)]
    neg = [control(files, "two", 14)]
    serial = client1.run(call_job(files, S(), pos, neg, edit=edit)).latent
    assert rel_err(client2.run(call_job(files, strategy, pos, neg, edit=edit)).latent, serial) < EXACT_RTOL


def test_refusals(files, client1, tmp_path):
    from parallel_runtime.errors import ModelFileError
    from parallel_runtime.models.tiny import TINY, write_controlnet

    flux = write_controlnet(tmp_path / "flux.safetensors", TINY, "xlabs", double=1)
    with pytest.raises(ModelFileError, match="is not a Qwen-Image ControlNet"):
        client1.run(call_job(files, S(), [ControlInput(flux, "qwen-f", 1.0, torch.rand(1, 3, 8 * H, 8 * W))]))
    wide = write_qwen_image_controlnet(tmp_path / "wide.safetensors", dataclasses.replace(DIT, hidden_size=256,
                                                                                           num_heads=4))
    with pytest.raises(ConfigError, match="ControlNet is 256 wide but this Qwen-Image model is 128"):
        client1.run(call_job(files, S(), [ControlInput(wide, "qwen-w", 1.0, torch.randn(1, 16, 1, H, W))]))


def test_pipefusion_keeps_the_controlnets_stale_kv(files, client4):
    """PipeFusion x Ring on 4 workers with an Edit reference (the ControlNet's own lane, without the reference
    rows): exact warm-up; the next call (another x and t) reads the ControlNet's stale K/V of the other patch."""
    pp = S(pipefusion_degree=2, ring_degree=2, num_pipeline_patch=2)
    job = call_job(files, pp, [control(files, "two", 11), control(files, "inpaint", 12)], negative=False, edit=True)
    g = torch.Generator().manual_seed(1)
    later = dataclasses.replace(job, latent=0.9 * job.latent + 0.2 * torch.randn(job.latent.shape, generator=g),
                                timestep=torch.full((1,), 0.6), call_step=1, call_last=True)
    assert rel_err(client4.run(dataclasses.replace(job, call_step=0)).latent, reference_call(files, job)) < EXACT_RTOL
    # Measured 6.0e-3 (the DiT alone on these inputs: 2.0e-2).
    assert rel_err(client4.run(later).latent, reference_call(files, later)) < 0.015
