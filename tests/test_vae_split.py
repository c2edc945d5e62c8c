"""The exact row split of VAE decoders (parallel_runtime/vae), on small torch modules of each kind a decoder has,
without ComfyUI: 2 and 3 bands in threads against the same modules run whole.

The blocks below are this test's own small stand-ins for ComfyUI's decoder blocks, of the same duck types
(registered with `plan_split(known=...)` as ComfyUI's are by path): an LDM-style decoder (GroupNorm, 3x3 convs,
nearest upsampling, the mid-block's q/k/v/proj_out attention) and a Wan-style causal video decoder (RMS norm over
channels, CausalConv3d with `_padding` called with the previous frames' cached rows, per-frame to_qkv attention,
one latent frame per decoder call).
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import rel_err
from parallel_runtime.vae import bands, exchange
from parallel_runtime.vae.decode import replica_for, run_bands
from parallel_runtime.vae.split_modules import install, plan_split

pytestmark = pytest.mark.timeout(600)

KNOWN = {__name__: {"Decoder", "ResnetBlock", "Upsample", "AttnBlock", "WanDecoder", "WanBlock", "AttentionBlock",
                    "RMSNorm", "CausalConv3d"}}
# fp32: the split sums GroupNorm statistics, attention and the halo rows' convolutions in another order than the
# whole-image ops (~1e-7 per op); a few dozen ops deep.
SPLIT_RTOL = 1e-5


# -- an LDM-style decoder -------------------------------------------------------------------------------------

class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, cin, eps=1e-6), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout, eps=1e-6), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x):
        h = self.conv1(self.act(self.norm1(x)))
        return self.skip(x) + self.conv2(self.act(self.norm2(h)))


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(8, c, eps=1e-6)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        b, c, hh, ww = x.shape
        q, k, v = (t.reshape(b, c, -1) for t in (self.q(h), self.k(h), self.v(h)))
        weights = torch.softmax(q.transpose(1, 2) @ k / c ** 0.5, dim=-1)  # [b, hw, hw]
        return x + self.proj_out((v @ weights.transpose(1, 2)).reshape(b, c, hh, ww))


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(nn.Module):
    def __init__(self, z=4, c=32):
        super().__init__()
        self.conv_in = nn.Conv2d(z, 2 * c, 3, padding=1)
        self.mid = nn.Sequential(ResnetBlock(2 * c, 2 * c), AttnBlock(2 * c), ResnetBlock(2 * c, 2 * c))
        self.up = nn.Sequential(Upsample(2 * c), ResnetBlock(2 * c, c), Upsample(c), ResnetBlock(c, c))
        self.norm_out, self.conv_out = nn.GroupNorm(8, c, eps=1e-6), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, z):
        return self.conv_out(F.silu(self.norm_out(self.up(self.mid(self.conv_in(z))))))

    def decode(self, z):
        return self(z)


# -- a Wan-style causal video decoder ---------------------------------------------------------------------------

class CausalConv3d(nn.Conv3d):
    """Pads itself: (W, W, H, H, 2 T, 0) zeros, less the cached frames it is handed."""

    def __init__(self, cin, cout, kernel, padding=0):
        super().__init__(cin, cout, kernel, padding=padding)
        t, h, w = self.padding
        self._padding, self.padding = (w, w, h, h, 2 * t, 0), (0, 0, 0)

    def forward(self, x, cache_x=None, cache_list=None, cache_idx=None):
        if cache_list is not None:
            cache_x, cache_list[cache_idx] = cache_list[cache_idx], None
        pad = list(self._padding)
        if cache_x is not None and pad[4] > 0:
            x = torch.cat([cache_x, x], 2)
            pad[4] -= cache_x.shape[2]
        return super().forward(F.pad(x, pad))


class RMSNorm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(c, 1, 1, 1))

    def forward(self, x):
        return F.normalize(x, dim=1) * x.shape[1] ** 0.5 * self.gamma.view(-1, *(1,) * (x.ndim - 2))


class WanBlock(nn.Module):
    """RMS norm, SiLU, causal 3x3x3 conv, twice; each conv gets the last 2 frames of its input from the previous
    call through the cache list."""

    def __init__(self, c):
        super().__init__()
        self.residual = nn.Sequential(RMSNorm(c), nn.SiLU(), CausalConv3d(c, c, 3, padding=1),
                                      RMSNorm(c), nn.SiLU(), CausalConv3d(c, c, 3, padding=1))

    def forward(self, x, cache, index):
        h = x
        for layer in self.residual:
            if isinstance(layer, CausalConv3d):
                keep = h[:, :, -2:].clone()
                if keep.shape[2] < 2 and cache[index[0]] is not None:
                    keep = torch.cat([cache[index[0]][:, :, -1:], keep], 2)
                h = layer(h, cache_list=cache, cache_idx=index[0])
                cache[index[0]] = keep
                index[0] += 1
            else:
                h = layer(h)
        return x + h


class AttentionBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm, self.to_qkv, self.proj = RMSNorm(c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        q, k, v = self.to_qkv(self.norm(frames)).chunk(3, dim=1)
        q, k, v = (m.reshape(b * t, 1, c, -1).transpose(2, 3) for m in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b * t, c, h, w)
        return self.proj(out).reshape(b, t, c, h, w).transpose(1, 2) + x


class WanDecoder(nn.Module):
    def __init__(self, z=4, c=32):
        super().__init__()
        self.conv_in = CausalConv3d(z, c, 3, padding=1)
        self.blocks = nn.ModuleList([WanBlock(c), WanBlock(c)])
        self.attn = AttentionBlock(c)
        self.time_conv = CausalConv3d(c, c, (3, 1, 1), padding=(1, 0, 0))  # reaches over frames only: row-local
        self.up = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                nn.Conv2d(c, c, 3, padding=1))
        self.head = CausalConv3d(c, 3, 3, padding=1)

    def decode(self, z):
        """One latent frame per call through the whole decoder, as Wan's VAE decodes, with a cache over calls."""
        cache, frames = [None] * 8, []
        for i in range(z.shape[2]):
            index = [0]
            x = z[:, :, i:i + 1]
            keep = x[:, :, -2:].clone()
            x = self.conv_in(x, cache[0])
            cache[0], index[0] = keep, 1
            x = self.attn(self.blocks[0](x, cache, index))
            x = self.time_conv(self.blocks[1](x, cache, index))
            b, c, t, h, w = x.shape
            x = self.up(x.transpose(1, 2).reshape(b * t, c, h, w))
            x = x.reshape(b, t, c, 2 * h, 2 * w).transpose(1, 2)
            frames.append(self.head(x))
        return torch.cat(frames, 2)


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():  # biases and gains away from their zero / one init, so each shows
            p.add_(0.1 * torch.randn_like(p))
    return module.eval()


@pytest.fixture(scope="module")
def decoders():
    return {"ldm": _seeded(Decoder(), 0), "wan": _seeded(WanDecoder(), 1)}


def split_decode(model, z, n):
    plan = plan_split(model, known=KNOWN)
    assert plan.exact, plan.refusals
    install(plan)
    return run_bands(z, [(replica_for(model, "cpu"), "cpu") for _ in range(n)], lambda m, band: m.decode(band),
                     cpu_threads=1)


@pytest.mark.parametrize("n", [2, 3])
def test_vae_split_ldm_decoder_equals_whole(decoders, n):
    """GroupNorm statistics, conv halos at three resolutions, the mid-block's gathered keys; 13 rows (uneven
    bands), 10 columns."""
    z = torch.randn(2, 4, 13, 10, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole = decoders["ldm"].decode(z)
    split = split_decode(decoders["ldm"], z, n)
    err = rel_err(split, whole)
    print(f"\nLDM-style decoder, {n} bands vs whole: rel. L2 {err:.2e}")
    assert split.shape == whole.shape == (2, 3, 52, 40)
    assert err < SPLIT_RTOL


@pytest.mark.parametrize("n", [2, 3])
def test_vae_split_wan_decoder_with_causal_cache_equals_whole(decoders, n):
    """5 latent frames, one per decoder call: every causal conv's cached rows of the previous frames get their
    halo too."""
    z = torch.randn(1, 4, 5, 12, 7, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = decoders["wan"].decode(z)
    split = split_decode(decoders["wan"], z, n)
    err = rel_err(split, whole)
    print(f"\nWan-style causal decoder, {n} bands vs whole: rel. L2 {err:.2e}")
    assert split.shape == whole.shape == (1, 3, 5, 24, 14)
    assert err < SPLIT_RTOL


def test_vae_split_forwards_are_inert_outside_a_band(decoders):
    """Installed split forwards run the original in a thread that joined no band (ComfyUI's own VAEDecode on
    the same module): bit-identical."""
    model = _seeded(Decoder(), 4)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        before = model.decode(z)
        install(plan_split(model, known=KNOWN))
        assert model.conv_in._paradit_split == "conv"
        after = model.decode(z)
    assert torch.equal(before, after)


def test_vae_split_replica_shares_weights_on_the_same_device(decoders):
    replica = replica_for(decoders["ldm"], "cpu")
    assert replica is not decoders["ldm"]
    assert replica.conv_in.weight is decoders["ldm"].conv_in.weight


def test_vae_split_group_norm_statistics_of_uneven_bands():
    """GroupNorm alone on bands of 1, 5 and 2 rows (Chan's combination of unequal counts)."""
    norm = _seeded(nn.GroupNorm(4, 16), 6)
    install(plan_split(norm))
    x = torch.randn(2, 16, 8, 5, generator=torch.Generator().manual_seed(7)) * 3 + 1
    group = exchange.BandGroup(3)
    cuts = [(0, 1), (1, 6), (6, 8)]
    out = [None] * 3

    def band(k):
        with torch.inference_mode(), exchange.joined(group.member(k, "cpu")):
            out[k] = norm(x[..., cuts[k][0]:cuts[k][1], :])

    workers = [threading.Thread(target=band, args=(k,)) for k in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    with torch.no_grad():
        err = rel_err(torch.cat(out, -2), F.group_norm(x, 4, norm.weight, norm.bias, norm.eps))
    assert err < 1e-6  # a single norm: float32 round-off of the statistics only


class Mystery(nn.Module):
    def forward(self, x):
        return x.flip(-2)


@pytest.mark.parametrize("module, why", [
    (nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1)), "stride"),
    (nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate")), "replicate padding"),
    (nn.Sequential(nn.ConvTranspose2d(4, 4, 3)), "transposed"),
    (nn.Sequential(nn.Upsample(scale_factor=2.0, mode="bilinear")), "mixes rows"),
    (nn.Sequential(Mystery()), "does not know"),
    (nn.Sequential(type("OddConv", (nn.Conv2d,), {})(4, 4, 3, padding=1)), "does not know"),  # forward unread
    (nn.Sequential(nn.LayerNorm(4)), "torch layer"),
])
def test_vae_split_refuses_modules_that_reach_across_rows(module, why):
    plan = plan_split(module, known=KNOWN)
    assert not plan.exact
    assert len(plan.refusals) == 1 and why in plan.refusals[0], plan.refusals


def test_vae_split_band_layout():
    assert bands.band_rows(13, 3) == [(0, 5), (5, 9), (9, 13)]
    assert bands.band_count(13, 4) == 3  # at least MIN_BAND_ROWS latent rows per band
    assert bands.band_count(3, 2) == 1


def test_vae_split_error_in_one_band_raises_it_not_a_broken_barrier(decoders):
    """A band that fails frees the others from the barrier; the caller sees the band's own error."""
    def decode(model, z):
        if exchange.current().rank == 1:
            raise ValueError("band 1 failed")
        return model.decode(z)

    z = torch.randn(1, 4, 8, 8)
    replicas = [(replica_for(decoders["ldm"], "cpu"), "cpu") for _ in range(2)]
    with pytest.raises(ValueError, match="band 1 failed"):
        run_bands(z, replicas, decode, cpu_threads=1)
