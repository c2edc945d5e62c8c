"""Single-device attention kernels in the [batch, seq, heads, head_dim] layout Flux uses.

`attention_with_lse` also returns the log-sum-exp of each query's scores, which Ring attention needs to
merge partial results exactly. It calls the fused kernel that exposes the LSE for the inputs (`lse_kernel`)
and falls back to plain math where none fits.

Every kernel takes an optional additive `bias` [B, 1, Sq, Sk] (ComfyUI's attention_mask, cut to the rows and
columns of the call; see bias.py), added to the scores before the softmax as ComfyUI's attention adds it.

K and V may have fewer heads than q (grouped-query attention, see gqa.py): they are expanded to the q heads only
here, at the kernel, and not at all where the kernel reads the groups itself (`reads_kv_groups`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .bias import RowGroups
from .gqa import expand_kv

# Compute capabilities torch's CUDA flash-attention kernels are built for (torch 2.13: sm80 to sm121).
FLASH_CUDA_CAPABILITIES = ((8, 0), (12, 1))
# The kernels that read fewer kv heads than q heads themselves (SDPA's enable_gqa, torch 2.5 on): CPU's flash kernel
# and CUDA's flash kernel. CUDA's memory-efficient kernel does not (SDPA with enable_gqa silently falls back to the
# math kernel there, materialising every score), nor does our float32 math, so K/V are expanded before those.
GQA_KERNELS = ("flash_cpu", "flash")
TORCH_READS_KV_GROUPS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def reads_kv_groups(kernel: str) -> bool:
    """Whether `kernel` (lse_kernel's name) takes k/v with fewer heads than q as they are."""
    return TORCH_READS_KV_GROUPS and kernel in GQA_KERNELS


def _kernel_of(q: torch.Tensor, biased: bool) -> str:
    return lse_kernel(q.device.type, q.dtype, _capability(q.device), biased=biased)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias=None) -> torch.Tensor:
    """SDPA over [B, S, H, D] q and [B, S, G, D] k/v (G divides H); `bias` a tensor, None or bias.RowGroups."""
    if isinstance(bias, RowGroups):
        out = None
        for rows, part in bias.groups:
            got = attention(q[:, rows], k, v, part)
            out = got.new_empty(q.shape[:3] + got.shape[3:]) if out is None else out
            out[:, rows] = got
        return out
    mask = None if bias is None else bias.to(q.dtype)
    gqa = {}
    if k.shape[2] != q.shape[2]:
        if reads_kv_groups(_kernel_of(q, bias is not None)):
            gqa = {"enable_gqa": True}
        else:
            k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         **gqa)
    return out.transpose(1, 2)


def lse_kernel(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None,
               biased: bool = False) -> str:
    """The kernel that gives attention with its log-sum-exp for these inputs.

    'flash_cpu' on CPU; on CUDA 'flash' for half precision where the flash kernels exist (sm80+) and no bias is
    added (they take none), else the memory-efficient kernel (every dtype from sm50; bf16 only from sm80, below
    which there is no bf16 kernel and 'math' remains); 'math' on anything else.
    """
    if device_type == "cpu":
        return "flash_cpu"
    if device_type != "cuda" or capability is None:
        return "math"
    capability = tuple(capability)
    lo, hi = FLASH_CUDA_CAPABILITIES
    if dtype in (torch.float16, torch.bfloat16) and lo <= capability <= hi and not biased:
        return "flash"
    if dtype == torch.bfloat16 and capability < (8, 0):
        return "math"
    return "efficient"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str | None = None,
                       bias=None, dead: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [B, S, H, D] and lse [B, H, S] (float32) of q [B, S, H, D] over k, v [B, Sk, G, D] (G divides H).
    `kernel` overrides `lse_kernel`'s choice.

    A query whose every key `bias` masks out (-inf) gets output 0 and lse -inf, so merging it with other key
    blocks gives their result, and a query masked everywhere ends at 0, as torch's SDPA (ComfyUI's) returns.
    `dead`: `dead_queries(bias)`, where the caller reuses one bias for many calls (Ring: every layer). A
    bias.RowGroups bias runs each group of query rows apart, with its own bias (and kernel)."""
    if isinstance(bias, RowGroups):
        out = lse = None
        for rows, part in bias.groups:
            got, got_lse = attention_with_lse(q[:, rows], k, v, kernel if part is None else None, part)
            if out is None:
                out = got.new_empty(q.shape[:3] + got.shape[3:])
                lse = got_lse.new_empty(got_lse.shape[:2] + (q.shape[1],))
            out[:, rows], lse[:, :, rows] = got, got_lse
        return out, lse
    kernel = kernel or _kernel_of(q, bias is not None)
    if k.shape[2] != q.shape[2] and not reads_kv_groups(kernel):
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    mask = None if bias is None else bias.to(q.dtype)
    if kernel == "flash_cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, attn_mask=mask)
    elif kernel == "flash":
        if mask is not None:
            raise ValueError("the flash kernel takes no attention bias; use 'efficient'")
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    elif kernel == "efficient":
        mask = None if mask is None else _efficient_bias(mask, qt, kt)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, mask, True)[:2]
        lse = lse[..., : q.shape[1]]  # the kernel pads the LSE's sequence dimension
    elif kernel == "math":
        out, lse = _math_attention_with_lse(qt, kt, vt, mask)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    out, lse = out.transpose(1, 2), lse.float()
    if bias is not None:
        # Always applied (no .any() test): a host-side test would sync the device once per block.
        dead = dead_queries(bias) if dead is None else dead
        lse = lse.masked_fill(dead, float("-inf"))
        out = out.masked_fill(dead.transpose(1, 2).unsqueeze(-1), 0.0)
    return out, lse


def dead_queries(bias) -> torch.Tensor | None:
    """[B, 1, Sq]: the queries an attention bias block gives no key (every column -inf); None for bias.RowGroups,
    whose groups attention_with_lse finds apart."""
    if isinstance(bias, RowGroups):
        return None
    return torch.isneginf(bias).all(dim=-1)


def _efficient_bias(mask: torch.Tensor, qt: torch.Tensor, kt: torch.Tensor) -> torch.Tensor:
    """The bias as the memory-efficient kernel reads it (what torch's SDPA does before calling it): rows
    aligned to 8 elements (padded, then viewed back to the key length) and expanded to [B, H, Sq, Sk]."""
    align = 8
    if any(stride % align for stride in mask.stride()[:-1]):
        length = mask.shape[-1]
        mask = F.pad(mask, (0, (-length) % align or align))[..., :length]
    return mask.expand(qt.shape[0], qt.shape[1], qt.shape[2], kt.shape[2])


def _math_attention_with_lse(qt, kt, vt, mask=None):
    """Plain attention in float32 on [B, H, S, D] inputs: out in that layout, and lse."""
    scores = torch.einsum("bhsd,bhtd->bhst", qt.float(), kt.float()) / math.sqrt(qt.shape[-1])
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhst,bhtd->bhsd", torch.softmax(scores, dim=-1), vt.float())
    return out.to(qt.dtype), lse


def merge_partials(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets: exact, since softmax weights rescale by exp(lse)."""
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    # Queries no key has reached yet (an attention bias masked both blocks) keep weight 0 instead of exp(nan).
    scale = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
    # lse is [B, H, S]; outputs are [B, S, H, D].
    w_old = torch.exp(lse - scale).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - scale).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


class LocalAttention:
    """Attention over exactly the keys this rank holds; `bias`: the attention mask's block for these queries
    and keys (None: unmasked). `masked=False` (a ControlNet's layers, which ComfyUI runs without the mask)
    leaves it out."""

    def __init__(self, bias: torch.Tensor | None = None):
        self.bias = bias

    def __call__(self, q, k, v, layer: int, masked: bool = True) -> torch.Tensor:
        return attention(q, k, v, self.bias if masked else None)
