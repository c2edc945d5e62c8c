"""HiDream O1 on the workers: detection (the vision tower's keys skipped), the two-pass mask and MRoPE ids, the serial
model against a model call written from ComfyUI 2026's source, every strategy, reference images (the vision tower,
their prompt tokens and 32-px patches), and what is refused.

diffusers (0.42.1 here) has no HiDream O1 class, and this host's ComfyUI (late 2025) no comfy/ldm/hidream_o1, so
the reference is `comfy_call` below: HiDreamO1Transformer._forward's cold path (no K/V cache, no reference images)
written from comfy/ldm/hidream_o1/model.py, attention.py's make_two_pass_attention, text_encoders/llama.py's
precompute_freqs_cis / apply_rope / Attention / MLP / TransformerBlock, mmdit's TimestepEmbedder and
utils.get_rope_index_fix_point (the text-to-image branch of conditioning.build_extra_conds), in ComfyUI's own op
order: [B, heads, T, D] tensors, SDPA with enable_gqa, the causal prefix pass and the full pass concatenated.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ConfigError, ModelFileError
from parallel_runtime.models.families.hidream_o1 import (HiDreamO1Config, TMS_TOKEN_ID, position_ids,
                                                         two_pass_allowed)
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config, validate_job

pytestmark = pytest.mark.timeout(600)

# 4 query heads over 2 key/value heads of 32 (GQA groups of 2, MRoPE sections (6, 5, 5)), 32 wide (a 8-wide patch
# bottleneck), 3 layers, the release's vocabulary (the <|tms_token|> id 151673 must exist: 19 MB of fp32 table).
TINY = HiDreamO1Config(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=64,
                       vocab_size=151936)
H, W = 128, 96  # pixels: a 4 x 3 grid of 32x32 patches (4 PipeFusion rows)
PREFIX = "model.diffusion_model."
# One fp32 forward in another op order than ComfyUI's (the same sums, grouped otherwise): ~1e-7 per op.
SERIAL_RTOL = 1e-5
# Exact strategies reorder sums (split K/V merged by log-sum-exp, matmuls over fewer rows): ~1e-7 per op; any
# layout, mask or position bug shows at 1e-2 or more.
EXACT_RTOL = 1e-4
# The same strategies against serial ParaDiT (the same kernels, K/V unrepeated on both sides): only the ring's
# log-sum-exp merge and matmuls over fewer rows reorder fp32 sums, ~1e-7 per op over 3 layers; a kv head paired with
# the wrong q heads shows at 1e-1.
SERIAL_EXACT_RTOL = 1e-5
VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653
# The same decoder with a Qwen3-VL vision tower in the file: 16 heads of 4 (ComfyUI's head count; 2 rotary
# frequencies per axis), 2 blocks, an 8 x 8 position table (48 x 48 at release), Conv3d patches of 2 x 16 x 16.
TINY_REF = dataclasses.replace(TINY, vision_hidden=64, vision_depth=2, vision_intermediate=96, vision_positions=64)
# Two references: 32-px streams of 2 x 2 and 1 x 3 patches; tower grids (t, h, w) of 4 x 4 and 2 x 6 patches, i.e.
# 4 and 3 vision tokens in the prompt after the 2 x 2 merge.
REF_SIZES = ((64, 64), (32, 96))
VIT_GRIDS = ((1, 4, 4), (1, 2, 6))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A tiny O1 in CheckpointLoaderSimple's layout, with a few vision-tower keys ParaDiT must skip."""
    p = str(tmp_path_factory.mktemp("hidream_o1") / "hidream_o1_image_dev_tiny.safetensors")
    write_checkpoint(p, TINY, seed=1, prefix=PREFIX)
    state = load_file(p)
    state[PREFIX + "visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)
    state[PREFIX + "visual.deepstack_merger_list.0.linear_fc1.weight"] = torch.randn(8, 8)
    save_file(state, p)
    return p


@pytest.fixture(scope="module")
def ref_path(tmp_path_factory):
    """A tiny O1 with its vision tower, plus Qwen3-VL deepstack mergers (which ComfyUI's tower never runs)."""
    p = str(tmp_path_factory.mktemp("hidream_o1_refs") / "hidream_o1_image_dev_refs_tiny.safetensors")
    write_checkpoint(p, TINY_REF, seed=4, prefix=PREFIX)
    save_file({**load_file(p), **deepstack_mergers(0)}, p)
    return p


def deepstack_mergers(seed: int) -> dict:
    """Two Qwen3-VL deepstack mergers' tensors (norm, linear_fc1, linear_fc2 over the 4 x 64 merged width)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for j in range(2):
        q = f"{PREFIX}visual.deepstack_merger_list.{j}."
        out.update({q + "norm.weight": torch.randn(256, generator=g), q + "norm.bias": torch.randn(256, generator=g),
                    q + "linear_fc1.weight": torch.randn(256, 256, generator=g) / 16,
                    q + "linear_fc1.bias": torch.randn(256, generator=g),
                    q + "linear_fc2.weight": torch.randn(TINY.hidden_size, 256, generator=g) / 16,
                    q + "linear_fc2.bias": torch.randn(TINY.hidden_size, generator=g)})
    return out


def prompt_ids(seed: int, tokens: int) -> torch.Tensor:
    """A chat-template-like prompt: random ids ending in <|boi|><|tms|>, as HiDreamO1Tokenizer ends every prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151000, (1, tokens), generator=g)
    ids[0, -2:] = torch.tensor([151669, TMS_TOKEN_ID])
    return ids


def conditioning(seed: int, tokens: int) -> Conditioning:
    """The CONDITIONING HiDreamO1TE makes: cross_attn = the ids as float32 [1, L, 1], no pooled vector."""
    return Conditioning(prompt_ids(seed, tokens).unsqueeze(-1).float(), torch.zeros(1, 0))


def reference_inputs(seed: int = 7) -> tuple:
    """What conditioning.prepare_ref_images hands the model for REF_SIZES / VIT_GRIDS (its resampling stays on the
    host): each reference's 32-px image in [-1, 1] [1, 3, h, w], the tower's patches ref_pixel_values [N, 1536] and
    ref_image_grid_thw [K, 3]."""
    g = torch.Generator().manual_seed(seed)
    images = tuple(torch.rand(1, 3, h, w, generator=g) * 2 - 1 for h, w in REF_SIZES)
    grid = torch.tensor(VIT_GRIDS)
    pixels = torch.rand(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=g) * 2 - 1
    return images, pixels, grid


def ref_prompt(seed: int, tokens: int, grid: torch.Tensor) -> torch.Tensor:
    """build_ref_input_ids: [vision_start, image_pad x (t h w / 4), vision_end] per reference after the first 3."""
    ids = prompt_ids(seed, tokens)[0].tolist()
    blocks = []
    for t, h, w in grid.tolist():
        blocks += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
    return torch.tensor([ids[:3] + blocks + ids[3:]])


def ref_conditioning(seed: int, tokens: int) -> Conditioning:
    """The runtime's conditioning of a chunk with HiDreamO1ReferenceImages' two references (what the door makes)."""
    images, pixels, grid = reference_inputs()
    ids = ref_prompt(seed, tokens, grid)
    return Conditioning(ids.unsqueeze(-1).float(), torch.zeros(1, 0), references=images, vision=pixels,
                        vision_grid=grid)


def ref_job(path: str, strategy: S, same_length: bool = False) -> Job:
    """call_job's model call with references on both prompts (the node attaches them to both)."""
    g = torch.Generator().manual_seed(5)
    latent = torch.randn(2, 3, H, W, generator=g)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), latent, ref_conditioning(1, 9),
               ref_conditioning(2, 9 if same_length else 21), timestep=torch.full((2,), 640.0))


def call_job(path: str, strategy: S, same_length: bool = False) -> Job:
    """One model call at sigma 0.71: a 9-token prompt and a 21-token negative (separate forward passes, as
    ComfyUI runs them; the negative's causal prefix of 20 rows crosses the middle of its 33-row sequence, so under
    Ulysses-2 and Ring-2 it spans both shards), or two 9-token prompts batched into one."""
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(2, 3, H, W, generator=g)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), latent, conditioning(1, 9),
               conditioning(2, 9 if same_length else 21), timestep=torch.full((2,), 710.0))


# -- the reference: ComfyUI 2026's model call ------------------------------------------------------------

def comfy_position_ids(text_ids: torch.Tensor, h_p: int, w_p: int) -> torch.Tensor:
    """build_extra_conds' text-to-image position ids [3, L]: input_ids padded with [vision_start, image_pad...],
    then get_rope_index_fix_point's loop for one image with skip_vision_start_token [1] and fix_point 4096."""
    tokens = torch.cat([text_ids[0], torch.full((h_p * w_p,), IMAGE_PAD)])
    tokens[text_ids.shape[1]] = VISION_START
    tokens = tokens.tolist()
    ed = tokens.index(IMAGE_PAD, 0)
    text_len = ed - 0 - 1  # skip_vision_start_token[0] = 1
    st_idx = 0
    pos = [torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx]
    t_index = torch.zeros(h_p * w_p, dtype=torch.long)
    h_index = torch.arange(h_p).view(1, -1, 1).expand(1, -1, w_p).flatten()
    w_index = torch.arange(w_p).view(1, 1, -1).expand(1, h_p, -1).flatten()
    fp = 4096 - st_idx
    pos.append(torch.stack([t_index, h_index, w_index]) + fp + st_idx)
    assert ed + h_p * w_p >= len(tokens)  # nothing after the image
    return torch.cat(pos, dim=1)


def comfy_freqs(position_ids: torch.Tensor, head_dim: int, theta: float = 5_000_000.0):
    """llama.py's precompute_freqs_cis with rope_dims and interleaved_mrope: (cos, sin[:half], -sin[half:])."""
    rope_dims = [head_dim // 2 - 2 * (head_dim * 5 // 32)] + [head_dim * 5 // 32] * 2  # [24, 20, 20] at 128
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv_freq_expanded.float() @ position_ids[:, None, :].float()).transpose(1, 2)
    freqs_inter = freqs[0].clone()
    for axis_idx, offset in ((1, 1), (2, 2)):
        idx = slice(offset, rope_dims[axis_idx] * 3, 3)
        freqs_inter[..., idx] = freqs[axis_idx, ..., idx]
    emb = torch.cat((freqs_inter, freqs_inter), dim=-1)
    cos, sin = emb.cos().unsqueeze(0), emb.sin().unsqueeze(0)
    half = sin.shape[-1] // 2
    return cos, sin[..., :half], -sin[..., half:]


def comfy_apply_rope(x: torch.Tensor, freqs) -> torch.Tensor:
    """rope_matrix's [[cos, -sin], [sin, cos]] on the (x[i], x[i + D/2]) pairs of [B, H, T, D] (split-half)."""
    cos, sin, neg_sin = freqs
    half = sin.shape[-1]
    m = torch.stack((cos[..., :half], neg_sin, sin, cos[..., half:]), dim=-1).reshape(*cos.shape[:-1], half, 2, 2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([m[..., 0, 0] * x1 + m[..., 0, 1] * x2, m[..., 1, 0] * x1 + m[..., 1, 1] * x2], dim=-1)


def comfy_two_pass(q, k, v, ar_len: int) -> torch.Tensor:
    """make_two_pass_attention: SDPA causal over the prefix, the rest over everything; GQA as SDPA's enable_gqa."""
    b, heads, t, d = q.shape
    ar = F.scaled_dot_product_attention(q[:, :, :ar_len], k[:, :, :ar_len], v[:, :, :ar_len], is_causal=True,
                                        enable_gqa=True)
    gen = F.scaled_dot_product_attention(q[:, :, ar_len:], k, v, enable_gqa=True)
    return torch.cat([ar, gen], dim=2).transpose(1, 2).reshape(b, t, heads * d)


def comfy_layer(sd: dict, i: int, x: torch.Tensor, freqs, ar_len: int) -> torch.Tensor:
    """llama.py's TransformerBlock (llama type, gemma3 q/k norms) with the two-pass attention."""
    p = f"language_model.layers.{i}."
    eps, d = 1e-6, TINY.head_dim
    b, t, _ = x.shape
    h = F.rms_norm(x, (x.shape[-1],), sd[p + "input_layernorm.weight"], eps)
    xq = F.linear(h, sd[p + "self_attn.q_proj.weight"]).view(b, t, -1, d).transpose(1, 2)
    xk = F.linear(h, sd[p + "self_attn.k_proj.weight"]).view(b, t, -1, d).transpose(1, 2)
    xv = F.linear(h, sd[p + "self_attn.v_proj.weight"]).view(b, t, -1, d).transpose(1, 2)
    xq = F.rms_norm(xq, (d,), sd[p + "self_attn.q_norm.weight"], eps)
    xk = F.rms_norm(xk, (d,), sd[p + "self_attn.k_norm.weight"], eps)
    xq, xk = comfy_apply_rope(xq, freqs), comfy_apply_rope(xk, freqs)
    x = x + F.linear(comfy_two_pass(xq, xk, xv, ar_len), sd[p + "self_attn.o_proj.weight"])
    h = F.rms_norm(x, (x.shape[-1],), sd[p + "post_attention_layernorm.weight"], eps)
    mlp = F.silu(F.linear(h, sd[p + "mlp.gate_proj.weight"])) * F.linear(h, sd[p + "mlp.up_proj.weight"])
    return x + F.linear(mlp, sd[p + "mlp.down_proj.weight"])


def comfy_sequence(sd: dict, embeds: torch.Tensor, input_ids: torch.Tensor, patches: torch.Tensor,
                   timesteps: torch.Tensor) -> torch.Tensor:
    """HiDreamO1Transformer._forward's input rows: the prompt's embeddings with the timestep embedding (at
    (1 - sigma) x 1000) written over the <|tms_token|> row, then the patches through x_embedder."""
    sigma = timesteps.float() / 1000.0
    t_emb = comfy_t_embedder(sd, (1.0 - sigma) * 1000)
    tms = (input_ids == TMS_TOKEN_ID).unsqueeze(-1).expand_as(embeds)
    embeds = torch.where(tms, t_emb.unsqueeze(1).expand_as(embeds), embeds)
    vin = F.linear(F.linear(patches, sd["x_embedder.proj1.weight"]), sd["x_embedder.proj2.weight"],
                   sd["x_embedder.proj2.bias"])
    return torch.cat([embeds, vin], dim=1)


def comfy_t_embedder(sd: dict, t: torch.Tensor) -> torch.Tensor:
    """mmdit's TimestepEmbedder over diffusionmodules.util.timestep_embedding (cos first, max_period 1e4)."""
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    h = F.silu(F.linear(emb, sd["t_embedder1.mlp.0.weight"], sd["t_embedder1.mlp.0.bias"]))
    return F.linear(h, sd["t_embedder1.mlp.2.weight"], sd["t_embedder1.mlp.2.bias"])


def comfy_forward(sd: dict, x: torch.Tensor, timesteps: torch.Tensor, input_ids: torch.Tensor,
                  two_pass: bool = True) -> torch.Tensor:
    """HiDreamO1Transformer._forward (cold path, no references) for one batch of rows sharing input_ids;
    `two_pass=False` (ar_len 0: every row attends everything) only to show the mask matters."""
    b, _, hh, ww = x.shape
    h_p, w_p, p = hh // 32, ww // 32, 32
    z = x.reshape(b, 3, h_p, p, w_p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, h_p * w_p, 3 * p * p)
    embeds = F.embedding(input_ids, sd["language_model.embed_tokens.weight"]).to(x.dtype)
    hidden = comfy_sequence(sd, embeds, input_ids, z, timesteps)
    txt_len = input_ids.shape[1]
    freqs = comfy_freqs(comfy_position_ids(input_ids[:1], h_p, w_p), TINY.head_dim)
    for i in range(TINY.num_layers):
        hidden = comfy_layer(sd, i, hidden, freqs, ar_len=txt_len - 1 if two_pass else 0)
    hidden = F.rms_norm(hidden, (hidden.shape[-1],), sd["language_model.norm.weight"], 1e-6)
    vmask = torch.zeros(b, hidden.shape[1], dtype=torch.bool)
    vmask[:, txt_len:] = True
    target = hidden[vmask].view(b, -1, hidden.shape[-1])[:, :h_p * w_p]
    x_pred = F.linear(target, sd["final_layer2.linear.weight"], sd["final_layer2.linear.bias"])
    x_pred = x_pred.reshape(b, h_p, w_p, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, 3, hh, ww)
    return (x.float() - x_pred.float()) / (timesteps.float() / 1000.0).view(b, 1, 1, 1).clamp_min(1e-3)


# -- the reference with reference images: conditioning.build_extra_conds' edit branch, Qwen35VisionModel --------

def comfy_rope_index(tokens: list, grids: list, skips: list, fix_point: int = 4096) -> torch.Tensor:
    """utils.get_rope_index_fix_point for one row (spatial_merge_size 1): [3, L] ids."""
    starts = [i for i, t in enumerate(tokens) if t == VISION_START]
    image_nums = sum(1 for i in starts if i + 1 < len(tokens) and tokens[i + 1] == IMAGE_PAD)
    fp, st, pos = fix_point, 0, []
    for k in range(image_nums):
        ed = tokens.index(IMAGE_PAD, st)
        t, h, w = grids[k]
        text_len = max(0, ed - st - skips[k])
        st_idx = int(pos[-1].max()) + 1 if pos else 0
        pos.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
        t_index = torch.arange(t).view(-1, 1).expand(-1, h * w).flatten()
        h_index = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
        w_index = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
        if skips[k]:
            if fp > 0:
                fp = fp - st_idx
            pos.append(torch.stack([t_index, h_index, w_index]) + fp + st_idx)
            fp = 0
        else:
            pos.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st = ed + t * h * w
    if st < len(tokens):
        st_idx = int(pos[-1].max()) + 1 if pos else 0
        pos.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + st_idx)
    return torch.cat(pos, dim=1)


def comfy_edit_positions(input_ids: torch.Tensor, h_p: int, w_p: int, vit_grid: torch.Tensor,
                         ref_grids: list) -> torch.Tensor:
    """build_extra_conds' edit branch: input_ids (vision blocks spliced) padded with a [vision_start, pad...] block
    for the target and one per reference's patches, ViT grids halved (post-merge), skips [0] K + [1] + [1] K."""
    tokens = input_ids[0].tolist()
    for n in [h_p * w_p] + [h * w for h, w in ref_grids]:
        tokens += [VISION_START] + [IMAGE_PAD] * (n - 1)
    grids = [(t, h // 2, w // 2) for t, h, w in vit_grid.tolist()] + [(1, h_p, w_p)] + [(1, h, w) for h, w in ref_grids]
    k = len(ref_grids)
    return comfy_rope_index(tokens, grids, [0] * k + [1] + [1] * k)


def comfy_vision_rope(x: torch.Tensor, cos, sin, nsin) -> torch.Tensor:
    """llama.apply_rope's addcmul form: x cos, then the halves' cross terms added."""
    out = x * cos
    half = out.shape[-1] // 2
    out[..., :half].addcmul_(x[..., half:], nsin)
    out[..., half:].addcmul_(x[..., :half], sin)
    return out.to(x.dtype)


def comfy_vision(sd: dict, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Qwen35VisionModel.forward (deepstack_merger_list None: the mergers never run) on [N, 1536] patches."""
    v, heads, merge = "visual.", 16, 2
    width = sd[v + "pos_embed.weight"].shape[1]
    x = F.conv3d(pixels.view(-1, 3, 2, 16, 16), sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"],
                 stride=(2, 16, 16)).view(-1, width)
    # fast_pos_embed_interpolate
    table = sd[v + "pos_embed.weight"]
    side = int(table.shape[0] ** 0.5)
    idx_list, weight_list = [[] for _ in range(4)], [[] for _ in range(4)]
    for t, h, w in grid.tolist():
        h_idxs, w_idxs = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
        h_floor, w_floor = h_idxs.int(), w_idxs.int()
        h_ceil, w_ceil = (h_floor + 1).clip(max=side - 1), (w_floor + 1).clip(max=side - 1)
        dh, dw = h_idxs - h_floor, w_idxs - w_floor
        base_h, base_h_ceil = h_floor * side, h_ceil * side
        indices = [(base_h[None].T + w_floor[None]).flatten(), (base_h[None].T + w_ceil[None]).flatten(),
                   (base_h_ceil[None].T + w_floor[None]).flatten(), (base_h_ceil[None].T + w_ceil[None]).flatten()]
        weights = [((1 - dh)[None].T * (1 - dw)[None]).flatten(), ((1 - dh)[None].T * dw[None]).flatten(),
                   (dh[None].T * (1 - dw)[None]).flatten(), (dh[None].T * dw[None]).flatten()]
        for j in range(4):
            idx_list[j].extend(indices[j].tolist())
            weight_list[j].extend(weights[j].tolist())
    pos = F.embedding(torch.tensor(idx_list), table) * torch.tensor(weight_list, dtype=table.dtype)[:, :, None]
    pos = (pos[0] + pos[1] + pos[2] + pos[3]).split([h * w for _, h, w in grid.tolist()])
    permuted = []
    for p, (t, h, w) in zip(pos, grid.tolist()):
        p = p.repeat(t, 1).view(t, h // merge, merge, w // merge, merge, -1).permute(0, 1, 3, 2, 4, 5).flatten(0, 4)
        permuted.append(p)
    x = x + torch.cat(permuted)
    # rot_pos_emb
    dim = width // heads // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freq_table = torch.outer(torch.arange(max(max(h, w) for _, h, w in grid.tolist()), dtype=torch.float), inv_freq)
    coords = []
    for t, h, w in grid.tolist():
        rows = torch.arange(h // merge)[:, None, None, None] * merge + torch.arange(merge)[None, None, :, None]
        cols = torch.arange(w // merge)[None, :, None, None] * merge + torch.arange(merge)[None, None, None, :]
        rows = rows.expand(h // merge, w // merge, merge, merge).reshape(-1)
        cols = cols.expand(h // merge, w // merge, merge, merge).reshape(-1)
        coords.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    emb = freq_table[torch.cat(coords)].flatten(1)
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos().unsqueeze(-2), emb.sin().unsqueeze(-2)
    half = sin.shape[-1] // 2
    sin_half, nsin = sin[..., :half], -sin[..., half:]
    lengths = [t * h * w for t, h, w in grid.tolist()]
    for i in range(TINY_REF.vision_depth):
        b = f"{v}blocks.{i}."
        h = F.layer_norm(x, (width,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], 1e-6)
        q, k, val = F.linear(h, sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]).reshape(
            x.shape[0], 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = comfy_vision_rope(q, cos, sin_half, nsin), comfy_vision_rope(k, cos, sin_half, nsin)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None]).transpose(1, 2).reshape(1, qs.shape[0], -1)
                for qs, ks, vs in zip(q.split(lengths), k.split(lengths), val.split(lengths))]
        x = x + F.linear(torch.cat(outs, dim=1).reshape(x.shape[0], -1), sd[b + "attn.proj.weight"],
                         sd[b + "attn.proj.bias"])
        h = F.layer_norm(x, (width,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], 1e-6)
        h = F.gelu(F.linear(h, sd[b + "mlp.linear_fc1.weight"], sd[b + "mlp.linear_fc1.bias"]), approximate="tanh")
        x = x + F.linear(h, sd[b + "mlp.linear_fc2.weight"], sd[b + "mlp.linear_fc2.bias"])
    m = v + "merger."
    x = F.layer_norm(x, (width,), sd[m + "norm.weight"], sd[m + "norm.bias"], 1e-6).view(-1, width * merge * merge)
    x = F.gelu(F.linear(x, sd[m + "linear_fc1.weight"], sd[m + "linear_fc1.bias"]))
    return F.linear(x, sd[m + "linear_fc2.weight"], sd[m + "linear_fc2.bias"])


def comfy_forward_refs(sd: dict, x: torch.Tensor, timesteps: torch.Tensor, c: Conditioning, vision: bool = True,
                       ref_positions: bool = True) -> torch.Tensor:
    """HiDreamO1Transformer._forward (cold path) with references for one chunk's rows: the tower's tokens scattered
    into the <|image_pad|> rows of input_ids[0], the references' 32-px patches after the target's through x_embedder,
    build_extra_conds' positions and ar_len. `vision=False` leaves the pads' own embeddings and
    `ref_positions=False` gives the reference patches the target's ids, only to show each matters."""
    b, _, hh, ww = x.shape
    h_p, w_p, p = hh // 32, ww // 32, 32
    input_ids = c.cond[..., 0].long().expand(b, -1)
    z = x.reshape(b, 3, h_p, p, w_p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, h_p * w_p, 3 * p * p)
    ref_grids = [(r.shape[-2] // p, r.shape[-1] // p) for r in c.references]
    ref_patches = torch.cat([r[0].reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
                             for r, (gh, gw) in zip(c.references, ref_grids)])
    vinputs = torch.cat([z, ref_patches[None].expand(b, -1, -1)], dim=1)
    embeds = F.embedding(input_ids, sd["language_model.embed_tokens.weight"]).to(x.dtype)
    if vision:
        image_embeds = comfy_vision(sd, c.vision, c.vision_grid).to(embeds.dtype)
        image_idx = (input_ids[0] == IMAGE_PAD).nonzero(as_tuple=True)[0]
        assert image_idx.shape[0] == image_embeds.shape[0]
        embeds[:, image_idx] = image_embeds.unsqueeze(0).expand(b, -1, -1)
    hidden = comfy_sequence(sd, embeds, input_ids, vinputs, timesteps)
    txt_len = input_ids.shape[1]
    pos = comfy_edit_positions(input_ids[:1], h_p, w_p, c.vision_grid, ref_grids)
    if not ref_positions:
        pos[:, txt_len + h_p * w_p:] = pos[:, txt_len:txt_len + ref_patches.shape[0]]
    freqs = comfy_freqs(pos, TINY.head_dim)
    for i in range(TINY.num_layers):
        hidden = comfy_layer(sd, i, hidden, freqs, ar_len=txt_len - 1)
    hidden = F.rms_norm(hidden, (hidden.shape[-1],), sd["language_model.norm.weight"], 1e-6)
    target = hidden[:, txt_len:txt_len + h_p * w_p]
    x_pred = F.linear(target, sd["final_layer2.linear.weight"], sd["final_layer2.linear.bias"])
    x_pred = x_pred.reshape(b, h_p, w_p, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, 3, hh, ww)
    return (x.float() - x_pred.float()) / (timesteps.float() / 1000.0).view(b, 1, 1, 1).clamp_min(1e-3)


@torch.no_grad()
def comfy_call(path: str, job: Job, two_pass: bool = True, **defects) -> torch.Tensor:
    """The call's rows through comfy_forward (comfy_forward_refs for a chunk with references), each chunk with its
    own prompt (ComfyUI's cond/uncond chunks); `defects`: comfy_forward_refs' switches."""
    sd = {k.removeprefix(PREFIX): v for k, v in load_file(path).items()}
    chunks = [c for c in (job.positive, job.negative) if c is not None]
    batch = job.latent.shape[0] // len(chunks)
    out = []
    for k, c in enumerate(chunks):
        rows = slice(k * batch, (k + 1) * batch)
        if c.vision is not None:
            out.append(comfy_forward_refs(sd, job.latent[rows], job.timestep[rows], c, **defects))
            continue
        ids = c.cond[..., 0].long().expand(batch, -1)
        out.append(comfy_forward(sd, job.latent[rows], job.timestep[rows], ids, two_pass))
    return torch.cat(out)


# -- detection, config, positions, mask ------------------------------------------------------------------

def test_o1_files_are_detected_with_the_vision_tower_skipped(path, tmp_path):
    from parallel_runtime.weights.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        family, match = detect_family(reader.keys())
    assert (family.name, match.layout, match.prefix) == ("hidream_o1", "comfy", PREFIX)
    assert model_config(path) == TINY
    assert (TINY.num_blocks, TINY.mlp_hidden, TINY.latent_channels, TINY.sections) == (3, 64, 3, (6, 5, 5))
    assert HiDreamO1Config(4096, 36, 32, 8, 128, 12288, 151936).sections == (24, 20, 20)  # Qwen3-VL-8B's
    # A decoder without its per-head q norm is no O1 (nor any family): one sentence naming what ParaDiT runs.
    keys = [k for k in load_file(path) if "q_norm" not in k]
    with pytest.raises(ModelFileError, match="is not a DiT checkpoint ParaDiT runs.*HiDream O1"):
        detect_family(keys, "broken.safetensors")
    # A patch embedding of other than 32x32 RGB patches is a damaged file, refused before any work.
    state = load_file(path)
    state[PREFIX + "x_embedder.proj1.weight"] = torch.zeros(8, 1000)
    damaged = str(tmp_path / "damaged.safetensors")
    save_file(state, damaged)
    with pytest.raises(ModelFileError, match="no HiDream O1 shape; the file is damaged, so re-download it"):
        model_config(damaged)


def test_position_ids_equal_comfyui_fix_point():
    """Prompt token i at (i, i, i), patch (r, c) at (4096, 4096 + r, 4096 + c), as build_extra_conds makes them."""
    ids = prompt_ids(1, 9)
    assert torch.equal(position_ids(9, 4, 3).T, comfy_position_ids(ids, 4, 3))
    assert position_ids(2, 1, 2).tolist() == [[0, 0, 0], [1, 1, 1], [4096, 4096, 4096], [4096, 4096, 4097]]


def test_two_pass_mask_is_causal_on_the_prefix_only():
    """ar_len = 3 of a 4-token prompt (its last token, <|tms|>, is generated), then 2 image rows: vLLM-Omni's
    build_packed_attention_metadata convention (token_types 0 causal, > 0 full)."""
    assert two_pass_allowed(4, 6).int().tolist() == [[1, 0, 0, 0, 0, 0],
                                                     [1, 1, 0, 0, 0, 0],
                                                     [1, 1, 1, 0, 0, 0],
                                                     [1, 1, 1, 1, 1, 1],
                                                     [1, 1, 1, 1, 1, 1],
                                                     [1, 1, 1, 1, 1, 1]]


# -- the model and the strategies -----------------------------------------------------------------------

def test_o1_one_worker_equals_comfyui(path, client1):
    job = call_job(path, S())
    out = client1.run(job).latent
    assert out.shape == (2, 3, H, W)
    want = comfy_call(path, job)
    err = rel_err(out, want)
    print(f"\nHiDream O1 serial rel. error vs ComfyUI's model call {err:.2e}")
    assert err < SERIAL_RTOL
    assert rel_err(comfy_call(path, job, two_pass=False), want) > 1e-3  # the causal prefix changes the output


def test_o1_sampling_is_comfyuis_with_noise_scale_8():
    """ModelSamplingDiscreteFlow at shift 3, multiplier 1000; CONST.noise_scaling with noise_scale 8."""
    from parallel_runtime.models.families.hidream_o1 import HiDreamO1Adapter

    ms = HiDreamO1Adapter.model_sampling.func(None)
    t = torch.arange(1, 1001) / 1000
    assert torch.equal(ms.sigmas, 3.0 * t / (1 + 2.0 * t))
    noise, latent, sigma = torch.randn(1, 3, 4, 4), torch.rand(1, 3, 4, 4), torch.tensor(0.6)
    assert torch.equal(ms.noise_scaling(sigma, noise, latent), sigma * (8.0 * noise) + (1.0 - sigma) * latent)


@pytest.fixture(scope="module")
def serial_calls(path, client1) -> dict:
    """Serial ParaDiT's output of call_job, by same_length."""
    return {same: client1.run(call_job(path, S(), same_length=same)).latent for same in (False, True)}


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2),
                                      S(ulysses_degree=2, device_weights=(1.0, 3.0))],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "pp2_warmup", "ulysses2_uneven_heads"])
def test_o1_exact_strategies_equal_comfyui(path, client1, client2, serial_calls, strategy):
    """The two-pass mask cut per shard, per ring key block (global offsets) and per stale buffer; GQA's 2 kv heads
    unrepeated through Ulysses' all-to-all (one per member), Ring's blocks and the stale buffers, and split with their
    q heads under tensor parallelism: ComfyUI's numbers, and serial's to fp32 round-off. Device weights' unequal q
    head slices (1 + 3 of 4) take K/V repeated to the q heads (UlyssesAttention's fallback)."""
    same = strategy.cfg_degree == 2
    job = call_job(path, strategy, same_length=same)
    result = client2.run(job)
    out = result.latent
    err, serial_err = rel_err(out, comfy_call(path, job)), rel_err(out, serial_calls[same])
    print(f"\nHiDream O1 {strategy.label()} rel. error vs ComfyUI's model call {err:.2e}, vs serial {serial_err:.2e}")
    assert err < EXACT_RTOL
    assert serial_err < SERIAL_EXACT_RTOL
    if strategy.tensor_degree == 2:
        # The 151,936-row vocabulary split with the layers (whole on every rank, each held 0.99 of the tiny model).
        whole = client1.run(dataclasses.replace(job, strategy=S())).stats[0]["param_bytes"]
        assert max(st["param_bytes"] for st in result.stats) <= 0.6 * whole


def test_o1_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(path, client1, client2):
    """A 4-step run of a batch of 2 at cfg 3 (Parallel Sampler's path, noise_scale 8): exact strategies (batch
    parallel too) equal serial; PipeFusion after one warm-up step reads stale K/V of the image and lands nearer serial
    than naive patch parallelism."""
    job = Job(ModelSpec(path), S(), SamplingSpec(steps=4, cfg=3.0, seed=1), torch.zeros(2, 3, H, W),
              conditioning(1, 9), conditioning(2, 9))
    check_denoise_loop(job, client1, client2, "HiDream O1", EXACT_RTOL)
    serial = client1.run(job).latent
    err = rel_err(client2.run(dataclasses.replace(job, strategy=S(batch_degree=2))).latent, serial)
    print(f"\nHiDream O1, 4 steps, batch2: rel. error {err:.2e} vs serial")
    assert err < EXACT_RTOL
    assert rel_err(serial[0], serial[1]) > 0.1  # each image of the batch has its own noise


def test_o1_refuses_reference_images_odd_sizes_and_split_kv_heads(path, ref_path):
    job = call_job(path, S())
    refs = (torch.rand(1, 3, 64, 64),)
    with pytest.raises(ConfigError, match="reference patches without their vision-tower inputs; attach the images "
                                          "with HiDreamO1ReferenceImages"):
        validate_job(dataclasses.replace(job, positive=dataclasses.replace(job.positive, references=refs)), 1)
    # A file without the tower (its visual.* keys incomplete) cannot run references: one sentence naming the file.
    with pytest.raises(ConfigError, match="this file has no vision tower \\(visual.\\*\\); load the complete"):
        validate_job(dataclasses.replace(ref_job(path, S()), negative=None, timestep=torch.full((1,), 640.0),
                                         latent=torch.zeros(1, 3, H, W)), 1)
    # The prompt's <|image_pad|> rows must be as many as the tower's tokens (build_ref_input_ids made them so).
    one = ref_conditioning(1, 9)
    short = dataclasses.replace(one, cond=torch.cat([one.cond[:, :4], one.cond[:, 5:]], dim=1))
    with pytest.raises(ConfigError, match="prompt has 6 <\\|image_pad\\|> tokens for 7 vision tokens"):
        validate_job(Job(ModelSpec(ref_path), S(), SamplingSpec(steps=1), torch.zeros(1, 3, H, W), short), 1)
    nan = dataclasses.replace(one, vision=one.vision.clone().index_fill_(0, torch.tensor([3]), float("nan")))
    with pytest.raises(ConfigError, match="reference images hold NaN or infinite values"):
        validate_job(Job(ModelSpec(ref_path), S(), SamplingSpec(steps=1), torch.zeros(1, 3, H, W), nan), 1)
    odd = dataclasses.replace(one, references=(torch.zeros(1, 3, 40, 64), one.references[1]))
    with pytest.raises(ConfigError, match="reference image 1 of the positive conditioning has shape \\(1, 3, 40, 64\\)"):
        validate_job(Job(ModelSpec(ref_path), S(), SamplingSpec(steps=1), torch.zeros(1, 3, H, W), odd), 1)
    with pytest.raises(ConfigError, match="is 80x128 px, not a multiple of its 32 px patches; use EmptyHiDreamO1"):
        validate_job(dataclasses.replace(job, latent=torch.zeros(2, 3, 128, 80), timestep=None), 1)
    # Another encoder's rows (any width-1 prompt that is not this vocabulary's ids) would index the table wrongly.
    other = dataclasses.replace(job.positive, cond=torch.randn(1, 9, 1))
    with pytest.raises(ConfigError, match="is not HiDream O1 token ids \\(whole numbers below 151936\\); encode"):
        validate_job(dataclasses.replace(job, positive=other), 1)
    with pytest.raises(ConfigError, match="HiDream O1 overflows in fp16.*choose weight_dtype bf16 or fp32"):
        validate_job(dataclasses.replace(job, model=ModelSpec(path, weight_dtype="fp16")), 1)
    # 4 q heads split 4 ways would cut GQA's 2 kv heads in halves: refused, naming the degrees that work.
    with pytest.raises(ConfigError, match="tensor_degree=4 does not divide HiDream O1's 2 key/value heads"):
        validate_job(dataclasses.replace(job, strategy=S(tensor_degree=4)), 4)


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ring_degree=2)],
                         ids=["ulysses2xring2", "cfg2xring2"])
def test_o1_hybrids_on_four_equal_comfyui(path, client4, serial_calls, strategy):
    same = strategy.cfg_degree == 2
    job = call_job(path, strategy, same_length=same)
    out = client4.run(job).latent
    err, serial_err = rel_err(out, comfy_call(path, job)), rel_err(out, serial_calls[same])
    print(f"\nHiDream O1 {strategy.label()} rel. error vs ComfyUI's model call {err:.2e}, vs serial {serial_err:.2e}")
    assert err < EXACT_RTOL
    assert serial_err < SERIAL_EXACT_RTOL


def test_o1_conditioning_reaches_the_worker_loop():
    """Parallel Sampler's path: CLIPTextEncode's CONDITIONING on the O1 CLIP (cross_attn = ids as float32, beside
    text_input_ids) runs in the worker loop (text_input_ids adds nothing the cross_attn lacks), and becomes a
    Conditioning whose cond holds the exact ids; other ids beside it route the graph to ComfyUI's sampler."""
    from nodes import convert, route

    ids = prompt_ids(1, 9)
    value = [[ids.unsqueeze(-1).float(), {"text_input_ids": ids}]]
    assert route._conditioning_gap(value, "positive") is None
    c = convert.conditioning(value)
    assert torch.equal(c.cond[..., 0].long(), ids) and c.pooled.shape == (1, 0)
    other = [[ids.unsqueeze(-1).float(), {"text_input_ids": prompt_ids(2, 9)}]]
    assert route._conditioning_gap(other, "positive") == "'text_input_ids' in the positive conditioning"
    # HiDreamO1ReferenceImages' images (reference_latents beside the O1 ids, or its older key) are prepared by the
    # host's extra_conds: the graph runs one job per model call, where the door carries them (test_hidream_o1_door).
    for key in ("reference_latents", "hidream_o1_ref_images"):
        edit = [[ids.unsqueeze(-1).float(), {"text_input_ids": ids, key: [torch.rand(1, 64, 64, 3)]}]]
        assert route._conditioning_gap(edit, "positive") == ("HiDream O1 reference images "
                                                             "(HiDreamO1ReferenceImages) in the positive conditioning")


@pytest.mark.parametrize("kind", ["fp8_scaled", "comfy_quant_float8"])
def test_o1_fp8_files_equal_their_fp32_twins(client1, tmp_path, kind):
    """The dev template's kind of file (hidream_o1_image_dev_fp8_scaled), in the scaled-fp8 layout (every matrix, the
    embedding table too, in fp8 over a per-layer scale) and in ComfyUI's mixed `comfy_quant` layout (two of every
    three matrices in fp8, the rest bf16): at 1 worker the model equals its fp32 twin holding the values the file
    means."""
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins

    quant, meant = (fp8_twins(tmp_path, "hidream_o1", torch.float8_e4m3fn, True, config=TINY) if kind == "fp8_scaled"
                    else comfy_quant_twins(tmp_path, "hidream_o1", "float8_e4m3fn", config=TINY))
    assert model_config(quant) == TINY
    got, ref = client1.run(call_job(quant, S())), client1.run(call_job(meant, S()))
    err = rel_err(got.latent, ref.latent)
    print(f"\nHiDream O1 {kind}: rel. error vs its fp32 twin {err:.2e}, param bytes "
          f"{got.stats[0]['param_bytes']} vs {ref.stats[0]['param_bytes']}")
    assert err <= SERIAL_RTOL  # equal operands: only BLAS blocking differs


def test_o1_runs_in_bf16_within_bf16_round_off(path, client1, client2):
    """The release's compute dtype: bf16 weights and activations (the ids, the velocity and the sampler state stay
    exact / float32) against ComfyUI's fp32 call, and Ulysses-2 in bf16 against serial bf16."""
    job = dataclasses.replace(call_job(path, S()), model=ModelSpec(path, weight_dtype="bf16"))
    serial = client1.run(job).latent
    err = rel_err(serial, comfy_call(path, job))
    split = rel_err(client2.run(dataclasses.replace(job, strategy=S(ulysses_degree=2))).latent, serial)
    print(f"\nHiDream O1 bf16: rel. error {err:.2e} vs ComfyUI's fp32 call, Ulysses-2 {split:.2e} vs serial bf16")
    # bf16 keeps 8 significant bits (4e-3 relative per rounding) over 3 layers: a few 1e-3; a dtype bug shows as
    # an error of order 1 or NaN.
    assert torch.isfinite(serial).all() and err < 3e-2
    assert split < 3e-2  # the same bf16 roundings in another order


# A model whose heads span its width (4 x 8 = 32, as the release's 32 x 128 = 4096), which traffic.py's counts assume.
TINY_WIDE_HEADS = dataclasses.replace(TINY, num_layers=2, head_dim=8)


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2, warmup_steps=1)],
                         ids=lambda s: s.label())
def test_o1_measured_bytes_match_analytic(client2, tmp_path, strategy):
    """The runtime's byte counters against traffic.py, per op and exactly: K and V travel with their own 2 heads, not
    repeated to the 4 q heads (Ulysses-2: one kv head per member beside its 2 q heads; Ring and PipeFusion's ring-less
    stages: 2-head blocks), the prompt's rows with the image's; Ulysses and Ring send fewer bytes than the repeated
    figure (Ulysses-2: 2 + 2 x 1 heads out and 2 back per row instead of 3 x 2 and 2, 3/4 at an even split; Ring-2:
    1/2)."""
    from parallel_runtime.planning.traffic import job_traffic, shapes_of

    p = write_checkpoint(str(tmp_path / "o1_wide_heads.safetensors"), TINY_WIDE_HEADS, seed=2, prefix=PREFIX)
    job = Job(ModelSpec(p), strategy, SamplingSpec(steps=3, cfg=2.0, seed=1), torch.zeros(2, 3, H, W),
              conditioning(1, 7), conditioning(2, 7))
    measured = [st["traffic"] for st in client2.run(job).stats]
    shapes = shapes_of(TINY_WIDE_HEADS, image_tokens=(H // 32) * (W // 32), text_tokens=7,
                       pipefusion=strategy.pipefusion_degree, batch=2)
    assert shapes.kv_heads == 2
    for got, want in zip(measured, job_traffic(strategy, shapes, steps=3, cfg=2.0)):
        assert {op: tuple(v) for op, v in got["by_op"].items()} == {op: tuple(v) for op, v in want.by_op().items()}
    repeated = job_traffic(strategy, dataclasses.replace(shapes, kv_heads=0), steps=3, cfg=2.0)
    # Ulysses' head rows sent per layer, (GQA, repeated): rank 0 holds 10 of the 19 rows (4 prompt + 6 image), so it
    # sends 4 x 10 + 2 x 9 instead of 6 x 10 + 2 x 9; rank 1 (9 rows) 4 x 9 + 2 x 10 instead of 6 x 9 + 2 x 10.
    uly_rows = [(58, 78), (56, 74)]
    for rank, (got, rep) in enumerate(zip(measured, repeated)):
        if "ring" in rep.ops:
            assert 2 * got["by_op"]["ring"][0] == rep.ops["ring"][0]
        if "ulysses" in rep.ops:
            gqa_rows, repeated_rows = uly_rows[rank]
            assert got["by_op"]["ulysses"][0] * repeated_rows == rep.ops["ulysses"][0] * gqa_rows


# -- reference images (HiDreamO1ReferenceImages) ------------------------------------------------------------

def test_o1_reads_the_vision_tower_shapes_and_places_the_reference_positions():
    """The tower's dims come from the file; the positions of [prompt with vision blocks, target, reference patches]
    equal build_extra_conds' edit branch (get_rope_index_fix_point with skips [0, 0, 1, 1, 1])."""
    from parallel_runtime.models.families.hidream_o1 import HiDreamO1Adapter

    images, pixels, grid = reference_inputs()
    ids = ref_prompt(1, 9, grid)
    assert ids.shape[1] == 9 + (4 + 2) + (3 + 2)
    ref_grids = [(h // 32, w // 32) for h, w in REF_SIZES]
    want = comfy_edit_positions(ids, H // 32, W // 32, grid, ref_grids)
    got = position_ids(ids.shape[1], H // 32, W // 32, ((1, 2, 2), (1, 1, 3)), tuple(ref_grids))
    assert torch.equal(got.T, want)
    adapter = HiDreamO1Adapter.__new__(HiDreamO1Adapter)
    adapter.config, adapter.device = TINY_REF, torch.device("cpu")
    cos, _ = adapter.rope(ids.shape[1], H, W, REF_SIZES, None, VIT_GRIDS)
    assert cos.shape == (ids.shape[1] + 12 + 4 + 3, TINY.head_dim)


def test_o1_reference_files_are_detected_with_their_tower(ref_path):
    assert model_config(ref_path) == TINY_REF
    assert (TINY_REF.vision_pixels, TINY_REF.vision_merge, TINY_REF.vision_positions) == (1536, 2, 64)


def test_o1_references_one_worker_equals_comfyui(ref_path, client1, tmp_path):
    """The tower's tokens in the prompt, the references' patches after the target's, their positions and the
    two-pass mask over the longer prefix: 1 worker against ComfyUI's model call. Each piece matters: leaving the
    pads' own embeddings in place of the tower's tokens, or giving the patches the target's positions, moves the
    output by far more than the bound. The Qwen3-VL deepstack mergers are never read (ComfyUI's tower runs none:
    its deepstack_merger_list is None): other values there change nothing."""
    job = ref_job(ref_path, S())
    out = client1.run(job).latent
    want = comfy_call(ref_path, job)
    err = rel_err(out, want)
    no_vision = rel_err(comfy_call(ref_path, job, vision=False), want)
    no_positions = rel_err(comfy_call(ref_path, job, ref_positions=False), want)
    other = str(tmp_path / "hidream_o1_other_deepstack.safetensors")
    save_file({**load_file(ref_path), **deepstack_mergers(1)}, other)
    deepstack = rel_err(client1.run(dataclasses.replace(job, model=ModelSpec(other))).latent, out)
    print(f"\nHiDream O1 with references, serial vs ComfyUI's model call {err:.2e}; without the tower's tokens "
          f"{no_vision:.2e}, reference patches at the target's ids {no_positions:.2e}, other deepstack mergers "
          f"{deepstack:.1e}")
    assert err < SERIAL_RTOL
    assert no_vision > 1e-3 and no_positions > 1e-3
    assert deepstack == 0.0  # the same tensors read, the same ops: bit for bit


def serial_refs(path: str, client1, strategy: S) -> torch.Tensor:
    job = ref_job(path, S(), same_length=strategy.cfg_degree == 2)
    return client1.run(job).latent


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tensor2", "pp2_warmup"])
def test_o1_references_strategies_equal_serial(ref_path, client1, client2, strategy):
    """The references' rows are sequence rows like any (the vision tokens inside the prompt's causal prefix, the
    patches behind the image's), so every strategy splits them as it splits the rest; the tower's tokens are a
    per-job constant each rank that embeds the prompt computes once. One model call: PipeFusion in its warm-up step
    (fresh K/V) is exact too."""
    job = ref_job(ref_path, strategy, same_length=strategy.cfg_degree == 2)
    err = rel_err(client2.run(job).latent, serial_refs(ref_path, client1, strategy))
    print(f"\nHiDream O1 with references, {strategy.label()} vs serial {err:.2e}")
    # The same sums in another order (shards' log-sum-exp merges, matmuls over fewer rows): ~1e-7 per op.
    assert err < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ring_degree=2),
                                      S(tensor_degree=2, ulysses_degree=2),
                                      S(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2)],
                         ids=["ulysses2xring2", "cfg2xring2", "tensor2xulysses2", "pp2xulysses2"])
def test_o1_references_hybrids_on_four_equal_serial(ref_path, client1, client4, strategy):
    job = ref_job(ref_path, strategy, same_length=strategy.cfg_degree == 2)
    err = rel_err(client4.run(job).latent, serial_refs(ref_path, client1, strategy))
    print(f"\nHiDream O1 with references, {strategy.label()} vs serial {err:.2e}")
    assert err < SERIAL_RTOL  # as above: reordered sums only


def test_o1_references_denoise_loop_strategies_equal_serial(ref_path, client1, client2):
    """A 3-step run with references on both prompts at cfg 3 (the worker loop: one job, the tower run once per
    job and rank): exact strategies equal serial; PipeFusion after its warm-up reads stale K/V of the image and
    reference rows and lands nearer serial than naive patch parallelism."""
    job = Job(ModelSpec(ref_path), S(), SamplingSpec(steps=3, cfg=3.0, seed=2), torch.zeros(1, 3, H, W),
              ref_conditioning(1, 9), ref_conditioning(2, 9))
    check_denoise_loop(job, client1, client2, "HiDream O1 with references", EXACT_RTOL)


def test_o1_vision_tokens_are_computed_once_per_job():
    """Branches runs the tower on first use and keeps the rows for the job's every step."""
    from parallel_runtime.strategies.denoise import Branches

    class Counting:
        device, patch, latent_format, default_guidance = torch.device("cpu"), 32, None, 0.0
        calls = 0

        def embed_vision(self, pixels, grid):
            Counting.calls += 1
            return torch.ones(7, 4)

    c = ref_conditioning(1, 9)
    branches = Branches([dataclasses.replace(c, references=())], 1, Counting())
    rows = [branches.vision_rows(Counting()) for _ in range(4)]
    assert Counting.calls == 1 and all(r is rows[0] for r in rows)
    assert branches.vision_grid == VIT_GRIDS


def test_o1_references_from_an_fp8_scaled_file_equal_its_fp32_twin(client1, tmp_path):
    """The dev template's kind of file (scaled fp8: every matrix, the tower's too, in fp8 over a per-layer scale): the
    tower reads it dequantized, and the call with references equals the fp32 twin holding the values the file means."""
    from test_fp8 import fp8_twins

    quant, meant = fp8_twins(tmp_path, "hidream_o1", torch.float8_e4m3fn, True, config=TINY_REF)
    assert model_config(quant) == TINY_REF
    err = rel_err(client1.run(ref_job(quant, S())).latent, client1.run(ref_job(meant, S())).latent)
    print(f"\nHiDream O1 with references, scaled fp8 vs its fp32 twin: {err:.2e}")
    assert err <= SERIAL_RTOL  # equal operands: only BLAS blocking differs


def test_o1_vision_tower_is_held_only_once_references_come(ref_path, client1, tmp_path):
    """A text-to-image job on a file with a tower holds the DiT alone; the first job with references loads the tower
    (fp32 here: its parameters' bytes) beside it, and it stays for the next calls of the run."""
    from parallel_runtime.models.families.hidream_o1 import checkpoint_shapes

    copy = str(tmp_path / "hidream_o1_image_dev_refs_copy.safetensors")
    save_file(load_file(ref_path), copy)  # its own file: a fresh load on the worker
    plain = client1.run(call_job(copy, S())).stats[0]["param_bytes"]
    with_refs = client1.run(ref_job(copy, S())).stats[0]["param_bytes"]
    again = client1.run(ref_job(copy, S())).stats[0]["param_bytes"]
    tower = sum(4 * math.prod(shape) for key, (shape, _) in checkpoint_shapes(TINY_REF).items()
                if key.startswith("visual."))
    print(f"\nHiDream O1 parameter bytes: text-to-image {plain}, with references {with_refs} (tower {tower})")
    assert with_refs - plain == tower and again == with_refs
