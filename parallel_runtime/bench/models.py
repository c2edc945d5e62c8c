"""The models the bench runs: random models with each family's block structure at a width a 2-core CPU runs in
seconds per step, and the released models' shapes the GPU projection uses."""
from __future__ import annotations

import dataclasses

from ..errors import ConfigError, ModelFileError
from ..models.families.chroma import ChromaConfig
from ..models.families.flux import FluxConfig
from ..models.families.flux2 import Flux2Config
from ..models.families.hidream import HiDreamConfig
from ..models.families.hidream_o1 import HiDreamO1Config
from ..models.families.flux3 import Flux3Config
from ..models.families.hunyuan_video15 import HunyuanVideo15Config
from ..models.families.kandinsky5 import Kandinsky5Config
from ..models.families.kandinsky6 import Kandinsky6Config
from ..models.families.ltx2 import LTX2Config
from ..models.families.minimax_h3 import MiniMaxH3Config
from ..models.families.pixart import PixArtConfig
from ..models.families.qwen_image import QwenImageConfig
from ..models.families.qwen_image21 import QwenImage21Config
from ..models.families.sd3 import SD3Config
from ..models.families.wan import WanConfig
from ..models.families.z_image import ZImageConfig
from ..models.tiny import TINY

# Flux-shaped bench model: Flux.1's block mix (1 double-stream block per 2 single-stream ones, as 19/38)
# at a width a 2-core CPU runs in seconds per step. Attention is ~2/3 of a block here (4096 tokens at
# width 256), against ~1/4 for Flux.1-dev at width 3072.
BENCH_FLUX = FluxConfig(hidden_size=256, num_heads=4, head_dim=64, num_layers=2, num_single_layers=4,
                        in_channels=64, context_dim=64, pooled_dim=32, guidance_embeds=True, mlp_ratio=4.0)
# FLUX.1-dev shapes, for the GPU projection when the bench ran a small model.
FLUX_DEV = FluxConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=19, num_single_layers=38,
                      in_channels=64, context_dim=4096, pooled_dim=768, guidance_embeds=True, mlp_ratio=4.0)
# Random models with each family's block structure, at the bench's width (256: 4 heads of 64).
BENCH_FAMILIES = {
    "flux": BENCH_FLUX,
    # Chroma: Flux's 1:2 block mix, the modulation table from a small approximator instead of per-block layers.
    "chroma": ChromaConfig(hidden_size=256, num_heads=4, head_dim=64, num_layers=2, num_single_layers=4,
                           context_dim=64, approximator_hidden=64, approximator_layers=2),
    # SD3.5 Large's block (q/k norms, joint attention, last block text pre-only); a 64-patch table covers 1024 px.
    "sd35": SD3Config(hidden_size=256, num_layers=6, pos_embed_max_size=64, context_dim=64, pooled_dim=32),
    # SD3.5 Medium: the image-only second attention in the first half of the blocks.
    "sd35_medium": SD3Config(hidden_size=256, num_layers=6, pos_embed_max_size=64, context_dim=64, pooled_dim=32,
                             dual_attention_layers=(0, 1, 2)),
    # Qwen-Image: joint double-stream blocks only (60 in the release), its own RoPE; 4 heads of 64 here.
    "qwen_image": QwenImageConfig(hidden_size=256, num_heads=4, head_dim=64, num_layers=6, context_dim=64),
    # Qwen-Image 2.1: single-stream block-causal blocks (32 in the release) over 64-channel latents, one token per
    # latent pixel of its 16x VAE; 4 heads of 64 here.
    "qwen_image21": QwenImage21Config(hidden_size=256, num_heads=4, head_dim=64, num_layers=6, context_dim=64),
    # FLUX.2 dev: shared modulations, SwiGLU 3x, 4-axis RoPE, one token per pixel of the 128-channel 16x latent; its
    # 1:6 double/single block mix (8 + 48) as 1 + 6, 4 heads of 64. Prompts are padded to 512 tokens as ComfyUI does.
    "flux2": Flux2Config(hidden_size=256, num_heads=4, head_dim=64, num_layers=1, num_single_layers=6, mlp_hidden=768,
                         context_dim=64),
    # FLUX.2 klein: no guidance input, klein 9B's 1:3 mix (8 + 24) as 1 + 3.
    "flux2_klein": Flux2Config(hidden_size=256, num_heads=4, head_dim=64, num_layers=1, num_single_layers=3,
                               mlp_hidden=768, context_dim=64, guidance_embeds=False),
    # FLUX.3 image klein: per-mode blocks (the image's over the image, the prompt's once per job), then single blocks
    # over [prompt, image]; diffusers' 5 + 28 as 1 + 6, 4 heads of 64, the 128-channel 16x latent of FLUX.2.
    "flux3": Flux3Config(hidden_size=256, num_heads=4, head_dim=64, num_layers=1, num_single_layers=6, mlp_hidden=768,
                         context_dim=64),
    # PixArt-Σ: image-only self-attention plus cross-attention to the prompt; PixArt's 72-wide heads, 4 of them.
    "pixart": PixArtConfig(hidden_size=288, num_layers=6, micro_condition=False, caption_channels=64),
    # Wan 2.1 1.3B's block (self-attention over the video, cross-attention to the umT5 prompt, MLP of the 1.3B's
    # 8960/1536 x width) at width 256: Wan's heads are 128 wide, so 2 of them (Ulysses-2 divides them). Two blocks
    # keep a step at a few seconds on a 2-core CPU at the bench's 8,400 video tokens, where attention is 80% of a
    # block's FLOPs (the 1.3B's at 480p x 81 frames: 71%).
    "wan": WanConfig(hidden_size=256, num_layers=2, ffn_dim=round(256 * 8960 / 1536), text_dim=64),
    # Wan 2.2 Animate 14B's mix: the I2V block (CLIP-vision keys beside the prompt's), the 14B's MLP ratio (13824 /
    # 5120 x 256, rounded even so tensor-2 splits it) and one face block per 5 blocks (the release: 8 after 40), at
    # Wan's bench width; the job carries a pose latent and a face video (WanConfig.random_inputs).
    "wan_animate": WanConfig(hidden_size=256, num_layers=5, ffn_dim=692, text_dim=64,
                             in_channels=36, image_to_video=True, animate=True),
    # HunyuanVideo 1.5: double-stream blocks only (54 in the release) over the 32-channel latent of its 16x VAE, one
    # token per latent pixel (the bench's 320x320 x 81 frames: 21 x 20 x 20 = 8,400 tokens, as Wan's), the prompt
    # refined again every step; 2 heads of 128 (its head size).
    "hunyuan_video15": HunyuanVideo15Config(hidden_size=256, num_layers=2, text_dim=64),
    # Z-Image: NextDiT's 2 noise-refiner blocks (image over image) before the joint layers, its 8/3 SwiGLU, the
    # prompt and image padded with learned tokens to multiples of 32; 4 heads of 64 (the release: 30 of 128).
    "z_image": ZImageConfig(hidden_size=256, num_heads=4, num_kv_heads=4, num_layers=4, num_refiner_layers=2,
                            ffn_dim=int(256 / 3 * 8), cap_feat_dim=64, time_hidden=256),
    # LTX-2.3: two streams per block (video self-attention, video -> prompt, audio self, audio -> prompt, a2v, v2a,
    # two MLPs), gated heads, modulated prompt cross-attention; its head sizes (video 128, audio 64), 2 heads each,
    # the audio stream half the video's width as in the release (2048 / 4096). Read as ComfyUI reads a file in
    # Lightricks' layout (the one the bench writes).
    "ltx2": LTX2Config(hidden_size=256, audio_hidden_size=128, num_layers=2, cross_attention_dim=256,
                       audio_cross_attention_dim=128, num_heads=2, audio_heads=2, gated_attn=True, cross_attn_mod=True,
                       prompt_adaln=True, rope_type="split", cross_timestep=True, reading="comfyui",
                       av_timestep_multiplier=1.0),
    # HiDream I1: joint double-stream blocks then single-stream ones (16 + 32 in the release) whose MLPs are a
    # mixture of 4 routed experts (top 2) and a shared one; every block also reads a Llama layer of the prompt. Its
    # 128-wide heads, 2 of them, 1 + 2 blocks (the release's 1:2 mix).
    "hidream": HiDreamConfig(hidden_size=256, num_layers=1, num_single_layers=2, t5_dim=64, llama_dim=64,
                             pooled_dim=32),
    # HiDream O1: Qwen3-VL 8B's decoder over [prompt ids, 32 px RGB patches]; 4 query heads of 64 over 2 key/value
    # heads (grouped as the release's 32 over 8; tensor-2 splits the kv heads), its SwiGLU ratio (12288 / 4096 x
    # 256), 3 layers. The vocabulary must hold <|tms_token|> (151673): a 151,936-row table, read once per job.
    "hidream_o1": HiDreamO1Config(hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                                  intermediate_size=768, vocab_size=151936),
    # Kandinsky 5 Lite video: one visual stream of 2x2 patches (beside 17 zero condition channels in text-to-video),
    # self-attention then cross-attention to the Qwen2.5-VL prompt its 2 text blocks refine every pass; its 64-wide
    # heads (Lite: 1792 / 64 = 28), 4 of them, and Lite's MLP ratio (7168 / 1792 = 4).
    "kandinsky5": Kandinsky5Config(hidden_size=256, num_layers=2, head_dim=64, ff_dim=1024, time_dim=128,
                                   context_dim=64, pooled_dim=32),
    # Kandinsky 6: video and audio streams side by side in every fused block (self-attention, cross-attention to each
    # stream's refinement of the prompt, video <-> audio attention, an MLP each); its 128-wide heads, 2 per stream
    # (Ulysses-2 splits both), the audio as wide as the video (the release's half would leave it one head), 2 text
    # blocks per stream recomputed every call (they read the timestep).
    "kandinsky6": Kandinsky6Config(hidden_size=256, audio_hidden_size=256, num_layers=2, head_dim=128, ff_dim=1024,
                                   audio_ff_dim=1024, time_dim=128, audio_time_dim=128, text_blocks=2,
                                   context_dim=64, pooled_dim=32),
    # MiniMax-H3: one packed [prompt | audio | video] sequence through identical single-stream blocks; its 128-wide
    # heads, 2 of them, and the release's SwiGLU ratio (14336 / 5376 x 256, rounded to an even count).
    "minimax_h3": MiniMaxH3Config(hidden_size=256, num_layers=2, num_heads=2, head_dim=128, ffn_dim=682, text_dim=64,
                                  time_embed_hidden=256, time_embed_dim=128),
}
# Config fields that grow with the width (the stream widths, their MLPs, the blocks' own attention widths, the
# head counts of families whose heads keep their size): `widened` scales them together. Prompt and latent widths stay.
_WIDTH_FIELDS = ("hidden_size", "audio_hidden_size", "ffn_dim", "ff_dim", "audio_ff_dim", "mlp_hidden",
                 "intermediate_size", "cross_attention_dim", "audio_cross_attention_dim", "num_heads", "num_kv_heads",
                 "audio_heads", "time_hidden", "time_embed_hidden")


def widened(config, width: int):
    """`config` at model width `width` (a whole multiple of its own): every width-like field scaled by the same
    factor, head sizes kept, so the block's mix of matmuls, attention and per-token work is the release's at a width
    nearer to it (tensor parallelism splits the matmuls, not the per-token work)."""
    factor, rest = divmod(width, config.hidden_size)
    if rest or factor < 1:
        raise SystemExit(f"--width {width}: give a whole multiple of the bench model's width {config.hidden_size}")
    if factor == 1:
        return config
    names = {f.name for f in dataclasses.fields(config)}
    try:
        return dataclasses.replace(config, **{n: getattr(config, n) * factor for n in _WIDTH_FIELDS
                                              if n in names and isinstance(getattr(config, n), int)
                                              and getattr(config, n) > 0})
    except (ValueError, ModelFileError, ConfigError) as e:  # a family whose widths follow another rule
        raise SystemExit(f"--width {width}: the {config.family} bench model does not scale to that width ({e})")


# The bench's video size for video families: Wan's default 81 frames (21 latent frames) of 320x320 px, so
# 21 x 20 x 20 = 8,400 video tokens (>= 8,000: sequences long enough that compute hides the traffic, as at
# 480p); 20 token rows per frame split evenly into 2 or 4 PipeFusion patches. Prompts are umT5's 512 tokens.
VIDEO_SIZE = dict(resolution="320x320", frames=81, text_tokens=512)
# The released models' shapes, for the GPU projection after a bench model ran.
RELEASE_SHAPES = {
    "chroma": (ChromaConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=19, num_single_layers=38),
               "Chroma1-HD shapes (width 3072, 19 + 38 blocks)"),
    "sd35": (SD3Config(hidden_size=2432, num_layers=38, pos_embed_max_size=192), "SD3.5 Large shapes (width 2432, 38 blocks)"),
    "sd35_medium": (SD3Config(hidden_size=1536, num_layers=24, pos_embed_max_size=384,
                              dual_attention_layers=tuple(range(13))), "SD3.5 Medium shapes (width 1536, 24 blocks)"),
    "qwen_image": (QwenImageConfig(hidden_size=3072, num_heads=24, head_dim=128, num_layers=60),
                   "Qwen-Image shapes (width 3072, 60 blocks)"),
    "qwen_image21": (QwenImage21Config(hidden_size=4096, num_heads=32, head_dim=128, num_layers=32),
                     "Qwen-Image 2.1 shapes (width 4096, 32 heads, 32 blocks, MLP 3x)"),
    "flux2": (Flux2Config(hidden_size=6144, num_heads=48, head_dim=128, num_layers=8, num_single_layers=48,
                          mlp_hidden=18432, context_dim=15360),
              "FLUX.2 dev 32B shapes (width 6144, 48 heads, 8 + 48 blocks, SwiGLU 18432)"),
    "flux2_klein": (Flux2Config(hidden_size=4096, num_heads=32, head_dim=128, num_layers=8, num_single_layers=24,
                                mlp_hidden=12288, context_dim=12288, guidance_embeds=False),
                    "FLUX.2 klein 9B shapes (width 4096, 32 heads, 8 + 24 blocks, SwiGLU 12288)"),
    "flux3": (Flux3Config(hidden_size=3072, num_heads=24, head_dim=128, num_layers=5, num_single_layers=28,
                          mlp_hidden=9216, context_dim=20480),
              "FLUX.3 image klein shapes (diffusers' defaults: width 3072, 24 heads, 5 + 28 blocks, SwiGLU 9216)"),
    "pixart": (PixArtConfig(hidden_size=1152, num_layers=28, micro_condition=False),
               "PixArt-Σ shapes (width 1152, 28 blocks)"),
    "wan": (WanConfig(hidden_size=5120, num_layers=40, ffn_dim=13824),
            "Wan 2.1 T2V 14B shapes (width 5120, 40 heads, 40 blocks, ffn 13824)"),
    "hunyuan_video15": (HunyuanVideo15Config(hidden_size=2048, num_layers=54),
                        "HunyuanVideo 1.5 8.3B shapes (width 2048, 16 heads, 54 double blocks)"),
    # LTX-2.3 22B: 48 blocks of video width 4096 (32 x 128) and audio width 2048 (32 x 64); diffusers'
    # LTX2VideoTransformer3DModel with LTX-2.3's switches (gated attention, modulated prompt cross-attention). The
    # DiT holds 18.99 B parameters; the rest of the "22B" file is the text connectors (1.16 B) and the VAEs.
    "ltx2": (LTX2Config(hidden_size=4096, audio_hidden_size=2048, num_layers=48, gated_attn=True, cross_attn_mod=True,
                        prompt_adaln=True, rope_type="split", cross_timestep=True),
             "LTX-2.3 22B shapes (video width 4096, audio 2048, 32 heads each, 48 blocks)"),
    # MiniMax-H3: diffusers' MiniMaxH3Transformer3DModel defaults (the released model).
    "minimax_h3": (MiniMaxH3Config(hidden_size=5376, num_layers=50, num_heads=56, head_dim=128, ffn_dim=14336,
                                   text_dim=5120),
                   "MiniMax-H3 shapes (width 5376, 56 heads x 128, 50 blocks, SwiGLU 14336)"),
    "hidream": (HiDreamConfig(hidden_size=2560, num_layers=16, num_single_layers=32),
                "HiDream I1 17B shapes (width 2560, 20 heads, 16 + 32 blocks, 4 experts top 2 + shared)"),
    "hidream_o1": (HiDreamO1Config(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                                   intermediate_size=12288, vocab_size=151936),
                   "HiDream O1 shapes (Qwen3-VL 8B's decoder: width 4096, 32 q / 8 kv heads, 36 layers)"),
    "kandinsky5": (Kandinsky5Config(hidden_size=1792, num_layers=32, head_dim=64, ff_dim=7168),
                   "Kandinsky 5 Lite video shapes (width 1792, 28 heads x 64, 32 blocks, MLP 7168)"),
    "kandinsky6": (Kandinsky6Config(hidden_size=4096, audio_hidden_size=2048, num_layers=60),
                   "Kandinsky 6 Pro shapes (video 4096 wide, 32 heads; audio 2048, 16 heads; 60 fused blocks)"),
    "z_image": (ZImageConfig(hidden_size=3840, num_heads=30, num_kv_heads=30, num_layers=30, num_refiner_layers=2,
                             ffn_dim=10240, cap_feat_dim=2560),
                "Z-Image Turbo / base 6B shapes (width 3840, 30 heads, 2 refiner + 30 blocks, ffn 10240)"),
}
# The released video models' sizes the projection runs at instead of the bench's: (name, latent frames, rows,
# columns). Wan 2.1 14B at its two released sizes and default 81 frames: 832x480 -> 21 x 30 x 52 = 32,760
# tokens; 1280x720 -> 21 x 45 x 80 = 75,600 tokens.
RELEASE_VIDEO_SIZES = {"wan": (("480p (832x480) x 81 frames", 21, 60, 104),
                               ("720p (1280x720) x 81 frames", 21, 90, 160)),
                       # HunyuanVideo 1.5's 121 frames (31 latent frames) of its 16x latent, 1x1 patches: 848x480 ->
                       # 31 x 30 x 53 = 49,290 tokens; 1280x720 -> 31 x 45 x 80 = 111,600 tokens.
                       "hunyuan_video15": (("480p (848x480) x 121 frames", 31, 30, 53),
                                           ("720p (1280x720) x 121 frames", 31, 45, 80))}
# The audio-video families' released sizes: (name, latent frames, token rows, token columns, audio tokens).
# LTX-2.3's text-to-video template (video_ltx2_3_t2v): 1280x720 (EmptyLTXVLatentVideo keeps 720 // 32 = 22 rows) x
# 121 frames at 25 fps, sampled at half size, then upscaled 2x and sampled again: 16 x 11 x 20 = 3,520 and 16 x 22 x
# 40 = 14,080 video tokens, 121 audio tokens each. MiniMax-H3 at 1344x768 (2 x 2 patches of its 16x latent: 24 x
# 42 per frame) for its t2v template's 73 frames (22 latent frames: 22,176 rows, 122 audio latents = 244 rows) and
# its default 124 (37: 37,296 rows, 207 audio latents = 414 rows).
RELEASE_AV_SIZES = {"ltx2": (("stage 1: 640x352 x 121 frames", 16, 11, 20, 121),
                             ("stage 2: 1280x704 x 121 frames", 16, 22, 40, 121)),
                    "minimax_h3": (("1344x768 x 73 frames", 22, 24, 42, 244),
                                   ("1344x768 x 124 frames", 37, 24, 42, 414)),
                    # Kandinsky 6: 121 frames at 24 fps (31 latent frames) of 864x480 (30 x 54 patches), 217 audio
                    "kandinsky6": (("864x480 x 121 frames", 31, 30, 54, 217),)}
# Prompt rows at release: LTX-2's Gemma prompt padded to 1,024 (ComfyUI's LTXAV tokenizer); a long MiniMax-H3 prompt; a
# Kandinsky 6 prompt of 256 Qwen2.5-VL rows.
RELEASE_AV_TEXT = {"ltx2": 1024, "minimax_h3": 512, "kandinsky6": 256}
NAMED_MODELS = {"bench": BENCH_FLUX, "tiny": TINY, **{k: v for k, v in BENCH_FAMILIES.items() if k != "flux"}}
TOY = "toy"  # the trained demo model (parallel_runtime/toy): its shipped file, the demo's prompt, 512x512


def runs_today(config, strategy) -> bool:
    """Whether the family's audio-video model call runs `strategy` (LTX2Config.strategy_problem: its two-stream
    call's PipeFusion stands alone, displaced patch not yet); every other family's runs every plan the grid makes."""
    problem = getattr(config, "strategy_problem", None)
    return problem is None or problem(strategy, "the model call") is None
