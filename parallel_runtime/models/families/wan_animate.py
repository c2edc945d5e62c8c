"""Wan 2.2 Animate (Wan2.2-Animate-14B; ComfyUI's AnimateWanModel): the Wan 2.1 image-to-video DiT plus a pose
stream added to the video's tokens and a face-motion stream cross-attended frame by frame.

What WanAnimateToVideo hands the model, and how each part splits:
- `pose_latents` [B, 16, P, H, W]: the pose video's latent. `pose_patch_embedding` (a 1x2x2 patch conv, like the
  video's) turns pose frame j into rows added to video frame j + 1 (frame 0 is the reference image's latent). A
  pose token lies exactly where the video token it joins lies, so it splits with the video's tokens under every
  strategy: a rank embeds only its own rows' pose patches (`pose_rows`), once per job.
- `face_pixel_values` [B, 3, F, 512, 512]: the face crop of every pixel frame. A StyleGAN-style motion encoder
  (`motion_encoder`) reduces each frame to 512 numbers; `face_encoder`'s causal 1-D convolutions (stride 2, twice)
  make them one row of 4 motion tokens (plus a learned padding token) per latent frame. ComfyUI runs both on every
  model call; here they run once per sampling run and face input (`face_motion`, cached by the input's key on the
  workers), since neither reads the timestep, and the ranks that split the video's tokens split the motion
  encoder's frames (~45 GFLOP each) and gather their codes. The result is small (latent frames x 5 x width) and
  every rank holds it whole; the 512x512 pixels cross the control channel once per run (a kept input, like a
  camera embedding).
- `face_adapter.fuser_blocks[n]` runs after main block 5n: each video token attends to the 5 motion tokens of its
  own latent frame (`face_attention`), so a rank runs it on its own rows with no communication, and a pipeline
  stage owns the face blocks of its main blocks. Tensor parallelism splits its q and kv projections by heads and
  all-reduces its output projection.

Every module keeps ComfyUI's parameter names (comfy/ldm/wan/model_animate.py), so ComfyUI-layout files (blur kernels
included) load one to one; each forward does ComfyUI's arithmetic in its order and dtypes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FACE_EVERY = 5  # a face block after main blocks 0, 5, 10, ... (AnimateWanModel: num_adapter_layers = layers // 5)
FACE_HEADS = 4  # motion tokens per latent frame before the padding token (FaceEncoder's num_heads)
FACE_WIDTH = 1024  # FaceEncoder's channels per motion token
MOTION_DIM = 20  # the motion code's directions (Generator's motion_dim)
STYLE_DIM = 512  # the appearance encoder's output width, which is also the face encoder's input
FACE_SIZE = 512  # WanAnimateToVideo resizes every face frame to 512 x 512
ENCODE_BATCH = 8  # frames per motion-encoder pass, as ComfyUI batches them (memory: 32 channels at 512 x 512)
EPS = 1e-6
BLUR_TAPS = (1.0, 3.0, 3.0, 1.0)  # the antialiasing kernel before each stride-2 convolution (outer product, sum 1)
_ENCODER_WIDTHS = (32, 64, 128, 256, 512, 512, 512, 512)  # EncoderApp: 3 -> 32, then a ResBlock per pair


def blur_kernel() -> torch.Tensor:
    taps = torch.tensor(BLUR_TAPS)
    kernel = taps[None, :] * taps[:, None]
    return kernel / kernel.sum()


# -- the motion encoder (Generator: enc.net_app, enc.fc, dec.direction) --------------------------------------

class EqualConv2d(nn.Module):
    """A conv whose weight is scaled by 1/sqrt(fan-in) at run time (StyleGAN's equalized learning rate)."""

    def __init__(self, n_in: int, n_out: int, kernel: int, stride: int = 1, padding: int = 0, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, kernel, kernel))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.scale, self.stride, self.padding = 1 / math.sqrt(n_in * kernel ** 2), stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv2d(x, self.weight.to(x.dtype) * self.scale, bias, stride=self.stride, padding=self.padding)


class EqualLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(n_out, n_in)), nn.Parameter(torch.empty(n_out))
        self.scale = 1 / math.sqrt(n_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype) * self.scale, self.bias.to(x.dtype))


class FusedLeakyReLU(nn.Module):
    """A per-channel bias, then leaky ReLU (slope 0.2) times sqrt(2)."""

    def __init__(self, channels: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x + self.bias.to(x.dtype), 0.2) * 2 ** 0.5


class Blur(nn.Module):
    """The 4x4 antialiasing filter on every channel after padding (upfirdn2d at up = down = 1). The kernel is a
    buffer because ComfyUI's files store it."""

    def __init__(self, pad: tuple[int, int]):
        super().__init__()
        self.register_buffer("kernel", blur_kernel())
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        kernel = torch.flip(self.kernel.to(x.dtype), (0, 1)).expand(channels, 1, *self.kernel.shape)
        return F.conv2d(F.pad(x, (self.pad[0], self.pad[1]) * 2), kernel, groups=channels)


def conv_layer(n_in: int, n_out: int, kernel: int, downsample: bool = False, activate: bool = True,
               bias: bool = True) -> nn.Sequential:
    """ConvLayer: [blur,] equalized conv, [bias + leaky ReLU]; the Sequential's indices are the file's names."""
    layers = []
    if downsample:
        p = len(BLUR_TAPS) - 2 + kernel - 1
        layers.append(Blur(((p + 1) // 2, p // 2)))
    layers.append(EqualConv2d(n_in, n_out, kernel, stride=2 if downsample else 1,
                              padding=0 if downsample else kernel // 2, bias=bias and not activate))
    if activate:
        layers.append(FusedLeakyReLU(n_out) if bias else nn.LeakyReLU(0.2))
    return nn.Sequential(*layers)


class ResBlock(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.conv1 = conv_layer(n_in, n_in, 3)
        self.conv2 = conv_layer(n_in, n_out, 3, downsample=True)
        self.skip = conv_layer(n_in, n_out, 1, downsample=True, activate=False, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv2(self.conv1(x)) + self.skip(x)) / math.sqrt(2)


class MotionEncoder(nn.Module):
    """ComfyUI's Generator as the model uses it (get_motion): a 512x512 face -> a 512-wide motion vector."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Module()
        widths = _ENCODER_WIDTHS
        self.enc.net_app = nn.Module()
        self.enc.net_app.convs = nn.ModuleList(
            [conv_layer(3, widths[0], 1)] + [ResBlock(a, b) for a, b in zip(widths, widths[1:])]
            + [EqualConv2d(widths[-1], STYLE_DIM, 4, bias=False)])
        self.enc.fc = nn.Sequential(*[EqualLinear(STYLE_DIM, STYLE_DIM) for _ in range(4)],
                                    EqualLinear(STYLE_DIM, MOTION_DIM))
        self.dec = nn.Module()
        self.dec.direction = nn.Module()
        self.dec.direction.weight = nn.Parameter(torch.empty(STYLE_DIM, MOTION_DIM))

    def forward(self, faces: torch.Tensor) -> torch.Tensor:
        """[N, 3, 512, 512] in [-1, 1] -> [N, 512]: the motion code on the orthonormal directions (a QR in float32
        of the stored ones, nudged off singular by 1e-8 x I as ComfyUI's Direction does)."""
        h = faces
        for conv in self.enc.net_app.convs:
            h = conv(h)
        code = self.enc.fc(h.squeeze(-1).squeeze(-1))
        weight = self.dec.direction.weight.to(faces.dtype)
        q, _ = torch.linalg.qr((weight + 1e-8 * torch.eye(*weight.shape, device=weight.device,
                                                              dtype=weight.dtype)).float())
        return torch.sum(code.unsqueeze(-1) * q.T.to(code.dtype), dim=1)


class _CausalConv1d(nn.Module):
    def __init__(self, n_in: int, n_out: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(n_in, n_out, 3, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (2, 0), mode="replicate"))


class FaceEncoder(nn.Module):
    """Motion vectors per pixel frame [B, F, 512] -> motion tokens per latent frame [B, ~F/4, 5, width]: causal
    convolutions over time (the second and third at stride 2), each token of 4 from its own 1024 channels."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1_local = _CausalConv1d(STYLE_DIM, FACE_WIDTH * FACE_HEADS)
        self.conv2 = _CausalConv1d(FACE_WIDTH, FACE_WIDTH, stride=2)
        self.conv3 = _CausalConv1d(FACE_WIDTH, FACE_WIDTH, stride=2)
        self.out_proj = nn.Linear(FACE_WIDTH, dim)
        self.padding_tokens = nn.Parameter(torch.empty(1, 1, 1, dim))

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        b = motion.shape[0]
        x = self.conv1_local(motion.transpose(1, 2))  # [B, 4 x 1024, F]
        x = x.unflatten(1, (FACE_HEADS, FACE_WIDTH)).flatten(0, 1).transpose(1, 2)  # [B x 4, F, 1024]
        for conv in (None, self.conv2, self.conv3):
            if conv is not None:
                x = conv(x.transpose(1, 2)).transpose(1, 2)
            x = F.silu(F.layer_norm(x, (FACE_WIDTH,), eps=EPS))
        x = self.out_proj(x).unflatten(0, (b, FACE_HEADS)).transpose(1, 2)  # [B, frames, 4, dim]
        padding = self.padding_tokens.to(x.dtype).expand(b, x.shape[1], 1, -1)
        return torch.cat([x, padding], dim=2)


class FaceBlock(nn.Module):
    """FaceBlock's parameters: video rows' queries, motion tokens' keys and values (one fused projection, keys
    first), per-head RMS norms on q and k, and the output projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads  # a tensor-parallel rank's share after the split (heads / N)
        self.linear1_kv, self.linear1_q, self.linear2 = nn.Linear(dim, 2 * dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        head_dim = dim // heads
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim, eps=EPS), nn.RMSNorm(head_dim, eps=EPS)


def add_animate_parts(model: nn.Module, dim: int, heads: int, layers: int) -> None:
    """What AnimateWanModel adds to WanModel, under its names, on WanTransformer's tree."""
    model.pose_patch_embedding = nn.Conv3d(16, dim, (1, 2, 2), (1, 2, 2))
    model.motion_encoder = MotionEncoder()
    model.face_adapter = nn.Module()
    model.face_adapter.fuser_blocks = nn.ModuleList(FaceBlock(dim, heads) for _ in range(layers // FACE_EVERY))
    model.face_encoder = FaceEncoder(dim)


def face_block_after(layers: int) -> dict[int, int]:
    """Main block -> the face block that runs after it."""
    return {n * FACE_EVERY: n for n in range(layers // FACE_EVERY)}


def tensor_plan() -> dict[str, str | tuple]:
    """Face blocks split by heads: q and the fused kv column-wise (kv as its two halves), the output row-wise. Their
    RMS norms are per head, so every rank's copy serves its own heads."""
    blocks = "face_adapter.fuser_blocks.*"
    return {f"{blocks}.linear1_q": "colwise", f"{blocks}.linear1_kv": ("colwise", (1, 1)),
            f"{blocks}.linear2": "rowwise"}


# -- the forward pieces -----------------------------------------------------------------------------------

def face_motion(model: nn.Module, pixels: torch.Tensor, frames: int, dtype: torch.dtype, share=None) -> torch.Tensor:
    """AnimateWanModel.after_patch_embedding's face half: [B, 3, F, 512, 512] -> motion tokens [B, frames, 5, dim],
    a zero frame first (the reference image's latent frame has no face), then zero-padded or cut to the video's
    `frames`. The motion encoder runs on ENCODE_BATCH frames at a time, each frame alone (no frame reads another),
    so `share` = (index, count, all_gather) splits the frames over the ranks that hold these rows: each encodes its
    run of them and the 512-wide codes are gathered (the face encoder's convolutions over time then run on all)."""
    device = model.face_encoder.out_proj.weight.device
    b, _, f = pixels.shape[:3]
    faces = pixels.transpose(1, 2).flatten(0, 1)  # [(B F), 3, 512, 512]
    index, count, gather = share or (0, 1, None)
    per_rank = -(-faces.shape[0] // count)
    mine = faces[index * per_rank:(index + 1) * per_rank]
    codes = [model.motion_encoder(mine[i:i + ENCODE_BATCH].to(device, dtype)) for i in range(0, len(mine), ENCODE_BATCH)]
    codes = torch.cat(codes) if codes else torch.zeros(0, STYLE_DIM, device=device, dtype=dtype)
    if gather is not None:  # equal parts for the collective: the last rank's run may be short or empty
        padded = torch.cat([codes, codes.new_zeros(per_rank - len(codes), STYLE_DIM)])
        codes = torch.cat(gather(padded))[:faces.shape[0]]
    tokens = model.face_encoder(codes.unflatten(0, (b, f)))
    tokens = torch.cat([tokens.new_zeros(b, 1, *tokens.shape[2:]), tokens], dim=1)
    if tokens.shape[1] < frames:
        tokens = torch.cat([tokens, tokens.new_zeros(b, frames - tokens.shape[1], *tokens.shape[2:])], dim=1)
    return tokens[:, :frames]


def frame_runs(frames: torch.Tensor) -> list[tuple[int, int, int]]:
    """(frame, first row, rows) of each run of rows in one latent frame, for rows whose frames are `frames` [n] (rows
    are frame-major, so a rank's rows make few runs). Reads the frames back: callers keep it per rows (one read per
    job, not per block on a GPU)."""
    runs, counts = torch.unique_consecutive(frames, return_counts=True)
    return list(zip(runs.tolist(), (counts.cumsum(0) - counts).tolist(), counts.tolist()))


def face_attention(block: FaceBlock, x: torch.Tensor, motion: torch.Tensor, runs) -> torch.Tensor:
    """FaceBlock.forward for the rows `x` [B, n, dim] in `runs` (frame_runs): each row attends to its frame's motion
    tokens (motion [B, T, 5, dim]), run by run; returns the residual linear2 adds."""
    heads = block.heads
    dim = block.linear1_q.weight.shape[0]  # this rank's share of the width under tensor parallelism
    kv = block.linear1_kv(F.layer_norm(motion, motion.shape[-1:], eps=EPS))
    k, v = kv.unflatten(-1, (2, heads, dim // heads)).unbind(-3)  # [B, T, 5, heads, d] each
    k = block.k_norm(k).to(v.dtype)
    q = block.q_norm(block.linear1_q(F.layer_norm(x, x.shape[-1:], eps=EPS)).unflatten(-1, (heads, -1))).to(v.dtype)
    out = torch.empty(*q.shape[:2], dim, dtype=v.dtype, device=q.device)
    for frame, start, count in runs:
        rows = slice(start, start + count)
        attended = F.scaled_dot_product_attention(q[:, rows].transpose(1, 2), k[:, frame].transpose(1, 2),
                                                  v[:, frame].transpose(1, 2))
        out[:, rows] = attended.transpose(1, 2).flatten(2)
    return block.linear2(out)


def pose_rows(conv: nn.Conv3d, pose: torch.Tensor, index: torch.Tensor, thw, dtype: torch.dtype) -> torch.Tensor:
    """The pose embedding added to video rows `index`: pose frame j's patch (pose [B, P x rows, 16 x 4], packed
    like the latent) joins video frame j + 1; rows in frame 0 or past the pose's frames get nothing (ComfyUI adds
    pose_patch_embedding to x[:, :, 1:P + 1]). In the model's dtype, as ComfyUI's conv runs on the pose latent."""
    t, h, w = thw
    per_frame = (h // 2) * (w // 2)
    source = index.to(pose.device) - per_frame
    inside = (source >= 0) & (source < pose.shape[1])
    rows = torch.zeros(pose.shape[0], len(index), conv.weight.shape[0], dtype=dtype, device=conv.weight.device)
    if bool(inside.any()):
        picked = pose[:, source[inside]].to(conv.weight.device, dtype)
        rows[:, inside.to(rows.device)] = F.linear(picked, conv.weight.to(dtype).flatten(1), conv.bias.to(dtype))
    return rows
