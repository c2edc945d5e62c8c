"""The shipped example workflows and the headless client script, checked without a ComfyUI host.

- every file in workflows/ (UI format, drag-and-drop / template menu) and workflows/api/
  (API format, for POST /prompt and scripts/queue_workflow.py) parses;
- API graphs use only ParaDiT's nodes, with exactly the inputs nodes/convert.py declares, and the core
  nodes listed below, with links of the right types;
- each UI workflow and its API twin agree node by node, widget by widget, link by link;
- each workflow loads its model family's files (Flux dev/schnell, Fill, Kontext, Chroma, SD3.5, Qwen-Image,
  PixArt, Wan 2.1 / 2.2 video) and ControlNet with the right text encoders and guidance, and its strategy fits its
  devices, that model and its image (or video) size;
- the Wan workflows keep the shape of ComfyUI's own Wan templates (latent size and frames, sampling, shift, fps),
  and the Wan 2.2 14B pair of experts splits one schedule between two KSamplerAdvanced;
- the newer families' workflows (Lumina 2, Z-Image Turbo, FLUX.2 dev and klein, Qwen-Image 2.1, HunyuanVideo 1.5)
  and the audio-video ones (LTX-2.3 text- and image-to-video and first-last-frame, MiniMax-H3 text-to-video) are
  their ComfyUI templates node by node with the loader swapped, and cfg-1 models never split CFG;
- scripts/queue_workflow.py: overrides, format detection and its websocket client (against a tiny
  in-process server on 127.0.0.1).
"""
from __future__ import annotations

import ast
import base64
import hashlib
import json
import math
import operator
import os
import socket
import struct
import threading
import uuid

import pytest

from conftest import load_queue_script

from nodes import convert
from parallel_runtime.models.families.wan import HEAD_DIM as WAN_HEAD_DIM
from parallel_runtime.spec import StrategySpec
from parallel_runtime.distributed.topology import latent_plane, validate_strategy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WF_DIR = os.path.join(REPO, "workflows")
API_DIR = os.path.join(WF_DIR, "api")
WORKFLOWS = ("flux_dev_auto", "flux_dev_ulysses", "flux_dev_ring", "flux_dev_pipefusion", "flux_dev_cfg_parallel",
             "flux_dev_hybrid", "flux_schnell", "chroma_ulysses", "sd35_large_cfg_parallel", "kontext_dev_ulysses",
             "qwen_image_hybrid", "pixart_sigma_hybrid", "flux_dev_ksampler", "flux_dev_controlnet",
             "flux_fill_inpaint", "wan21_t2v_ulysses", "wan21_i2v_cfg_parallel", "wan22_14b_t2v_two_experts",
             "wan22_5b_ti2v", "lumina2_cfg_parallel", "z_image_turbo_ulysses", "flux2_dev_ulysses", "flux2_klein_4b_ring",
             "qwen_image21_ulysses", "hunyuan_video15_t2v_cfg_parallel", "ltx23_t2v_ulysses", "ltx23_i2v_ulysses",
             "ltx23_flf2v_ulysses", "minimax_h3_t2v_ulysses", "wan22_fun_inpaint_5b_ulysses",
             "hidream_i1_full_cfg_parallel", "flux3_klein_base_cfg_parallel", "kandinsky5_lite_t2i_hybrid",
             "wan21_vace_14b_t2v_ulysses", "hidream_o1_cfg_parallel")
FLUX_HEADS, FLUX_BLOCKS = 24, 19 + 38  # FLUX.1 dev/schnell: 19 double + 38 single blocks
FLUX_UNETS = ("flux1-dev.safetensors", "flux1-schnell.safetensors")
STRATEGY_WORDS = ("auto", "ulysses", "ring", "pipefusion", "cfg_parallel", "hybrid")  # the end of a workflow's name

# The non-Flux models: what their workflows load, and each model's shape for validate_strategy. Both run true
# CFG (no guidance distillation): cfg > 1, a real negative prompt, no FluxGuidance.
MODELS = {
    "chroma_": dict(  # Chroma1-HD: Flux's blocks, one T5-XXL (CLIPLoader type chroma), Flux's VAE
        unet="Chroma1-HD.safetensors", heads=24, blocks=19 + 38, vae="ae.safetensors",
        clip=("CLIPLoader", {"clip_name": "t5xxl_fp16.safetensors", "type": "chroma", "device": "default"})),
    "sd35_large_": dict(  # SD3.5 Large: 38 joint blocks of 38 heads (hidden 2432 / 64), CLIP-L + CLIP-G + T5-XXL
        unet="sd3.5_large.safetensors", heads=38, blocks=38, vae="sd35_vae.safetensors",
        clip=("TripleCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "clip_g.safetensors",
                                   "clip_name3": "t5xxl_fp16.safetensors"})),
    "qwen_image_": dict(  # Qwen-Image: 60 joint blocks of 24 heads, Qwen2.5-VL text encoder, the Wan 2.1 VAE at 1328 px
        unet="qwen_image_bf16.safetensors", heads=24, blocks=60, vae="qwen_image_vae.safetensors", size=1328,
        clip=("CLIPLoader", {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "type": "qwen_image",
                             "device": "default"})),
    "pixart_sigma_": dict(  # PixArt-Σ: 28 blocks of 16 heads (1152 / 72), T5-XXL, the SDXL VAE, 4-channel latents
        unet="PixArt-Sigma-XL-2-1024-MS.safetensors", heads=16, blocks=28, vae="sdxl_vae.safetensors",
        latent="EmptyLatentImage",
        clip=("CLIPLoader", {"clip_name": "t5xxl_fp16.safetensors", "type": "pixart", "device": "default"})),
}
# Flux Kontext dev edits a picture: Flux's blocks and encoders, the picture as a ReferenceLatent.
KONTEXT = dict(unet="flux1-kontext-dev.safetensors", heads=FLUX_HEADS, blocks=FLUX_BLOCKS)
# Flux.1 Fill dev inpaints a picture: Flux's blocks and encoders, picture and mask as extra input channels
# (InpaintModelConditioning), guidance 30.
FILL = dict(unet="flux1-fill-dev.safetensors", heads=FLUX_HEADS, blocks=FLUX_BLOCKS, guidance=30.0)
# Flux ControlNets the workflows load (models/controlnet): XLabs' canny v3, which wants an edge map as its hint.
CONTROLNETS = ("flux-canny-controlnet-v3.safetensors",)
# Wan video workflows, each shaped like one of ComfyUI's Wan templates (comfyui-workflow-templates-json): its files,
# latent node and size (width, height, frames), sampling, ModelSamplingSD3 shift and Create Video fps, with
# UNETLoader swapped for Load Parallel DiT. Heads from the width (every Wan: heads of WAN_HEAD_DIM = 128).
# `unets` in the order they denoise: Wan 2.2 14B's high-noise expert takes steps 0..split, its low-noise one the rest.
WAN = {
    "wan21_t2v_": dict(  # text_to_video_wan: Wan 2.1 T2V 1.3B, 30 blocks 1536 wide
        unets=("wan2.1_t2v_1.3B_fp16.safetensors",), heads=1536 // WAN_HEAD_DIM, blocks=30,
        vae="wan_2.1_vae.safetensors", latent=("EmptyHunyuanLatentVideo", 832, 480, 33),
        sampling=dict(steps=30, cfg=6.0, sampler_name="uni_pc", scheduler="simple"), shift=8.0, fps=16.0),
    "wan21_i2v_": dict(  # image_to_video_wan: Wan 2.1 I2V 480p 14B, 40 blocks 5120 wide, CLIP-vision H of the picture
        unets=("wan2.1_i2v_480p_14B_fp16.safetensors",), heads=5120 // WAN_HEAD_DIM, blocks=40,
        vae="wan_2.1_vae.safetensors", latent=("WanImageToVideo", 512, 512, 33),
        clip_vision="clip_vision_h.safetensors",
        sampling=dict(steps=20, cfg=6.0, sampler_name="uni_pc", scheduler="simple"), shift=8.0, fps=16.0),
    "wan22_14b_t2v_": dict(  # video_wan2_2_14B_t2v (its subgraph, LightX2V LoRA switch off): two 14B experts
        unets=("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"),
        heads=5120 // WAN_HEAD_DIM, blocks=40, vae="wan_2.1_vae.safetensors",
        latent=("EmptyHunyuanLatentVideo", 640, 640, 81),  # 5 s at 16 fps: floor(5 * 16) + 1 frames
        sampling=dict(steps=20, cfg=3.5, sampler_name="euler", scheduler="simple"), split=10, shift=5.0, fps=16.0),
    "wan22_5b_": dict(  # video_wan2_2_5B_ti2v: Wan 2.2 TI2V 5B, 30 blocks 3072 wide, its own VAE; Load Image bypassed
        unets=("wan2.2_ti2v_5B_fp16.safetensors",), heads=3072 // WAN_HEAD_DIM, blocks=30,
        vae="wan2.2_vae.safetensors", latent=("Wan22ImageToVideoLatent", 1280, 704, 121),
        sampling=dict(steps=20, cfg=5.0, sampler_name="uni_pc", scheduler="simple"), shift=8.0, fps=24.0),
    # video_wan2_2_5B_fun_inpaint: the 5B's Fun inpaint file (in_dim 100), start and end frames through
    # WanFunInpaintToVideo on the 5B's VAE
    "wan22_fun_inpaint_5b_": dict(
        unets=("wan2.2_fun_inpaint_5B_bf16.safetensors",), heads=3072 // WAN_HEAD_DIM, blocks=30,
        vae="wan2.2_vae.safetensors", latent=("WanFunInpaintToVideo", 640, 640, 81),
        sampling=dict(steps=20, cfg=6.0, sampler_name="uni_pc", scheduler="simple"), shift=8.0, fps=24.0),
    # video_wan_vace_14B_t2v: Wan 2.1 VACE 14B (40 VACE-hinted blocks 5120 wide) at 720p through WanVaceToVideo (no
    # control video, mask or reference connected) and TrimVideoLatent, with the template's CausVid LoRA at 0.7 on the
    # model and the encoder, whence 4 steps at cfg 1 (the template's setting for it); umT5 fp16
    "wan21_vace_14b_t2v_": dict(
        unets=("wan2.1_vace_14B_fp16.safetensors",), heads=5120 // WAN_HEAD_DIM, blocks=40,
        vae="wan_2.1_vae.safetensors", latent=("WanVaceToVideo", 1280, 720, 81),
        clip={"clip_name": "umt5_xxl_fp16.safetensors", "type": "wan", "device": "default"},
        lora=("Wan21_CausVid_14B_T2V_lora_rank32.safetensors", 0.7),  # on the model; 1.0 on the encoder
        sampling=dict(steps=4, cfg=1, sampler_name="uni_pc", scheduler="simple"), shift=8.0, fps=16.0),
}
WAN_CLIP = {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}
# (latent channels, pixels per latent pixel): what each Wan VAE encodes to and each latent node makes
# (comfy_extras/nodes_hunyuan.py, nodes_wan.py); frames are 4 to a latent frame, plus the first.
WAN_VAES = {"wan_2.1_vae.safetensors": (16, 8), "wan2.2_vae.safetensors": (48, 16)}
WAN_LATENTS = {"EmptyHunyuanLatentVideo": (16, 8), "WanImageToVideo": (16, 8), "Wan22ImageToVideoLatent": (48, 16),
               "WanFunInpaintToVideo": (48, 16),  # the VAE it is given: the 5B's in our one Fun workflow
               "WanVaceToVideo": (16, 8)}
# Newer families, each workflow shaped like one ComfyUI template (comfyui-workflow-templates-json 0.1.123, read by
# test_family_workflow_is_its_template_on_load_parallel_dit): `instances`, the subgraph instances flattened into the
# workflow (their inner node ids kept); `loader`, the template's diffusion-model loader our Load Parallel DiT stands
# for (a CheckpointLoaderSimple keeps giving CLIP and VAE, and Load Parallel DiT reads the same file under a new id);
# `left_out`, the template's nodes the workflow does without (switches set off, primitives whose values the widgets
# hold, model patches and bypassed stages; each workflow's Read me says why); `replaced`, a template node of
# another class under the same id. Model shapes for validate_strategy: heads, and blocks as the pipeline splits them.
# Every family here has 16 px tokens (a 2x2 patch of an 8x latent, or one latent pixel of a 16x one); `latent` gives
# (node, width, height[, frames]); `sampling` the sampler's settings (KSampler, or for SamplerCustomAdvanced the
# scheduler's steps, its sampler and the guider's cfg); cfg 1 (the distilled ones) never splits CFG.
FAMILIES = {
    "lumina2_": dict(  # image_netayume_lumina_t2i: NetaYume Lumina 3.5, a Lumina Image 2.0 NextDiT (2304 wide)
        template="image_netayume_lumina_t2i", instances=(48,), loader=34,
        unet="NetaYumev35_pretrained_all_in_one.safetensors", heads=24, blocks=2 + 26,  # noise refiner + layers
        clip=("CheckpointLoaderSimple", {"ckpt_name": "NetaYumev35_pretrained_all_in_one.safetensors"}), vae=None,
        latent=("EmptySD3LatentImage", 1024, 1024),
        sampling=dict(steps=30, cfg=4.0, sampler_name="res_multistep", scheduler="simple"),
        shift=("ModelSamplingAuraFlow", 4.0),
        left_out={49, 51, 52, 40, 41, 42}),  # the prompts' concatenation: its text is in the two encoders
    "z_image_turbo_": dict(  # image_z_image_turbo: 6B single-stream, 30 heads of 128 (3840 wide), distilled to 8 steps
        template="image_z_image_turbo", instances=(57,), loader=28,
        unet="z_image_turbo_bf16.safetensors", heads=30, blocks=2 + 30,
        clip=("CLIPLoader", {"clip_name": "qwen_3_4b.safetensors", "type": "lumina2", "device": "default"}),
        vae="ae.safetensors", latent=("EmptySD3LatentImage", 1024, 1024),
        sampling=dict(steps=8, cfg=1.0, sampler_name="res_multistep", scheduler="simple"),
        shift=("ModelSamplingAuraFlow", 3.0), left_out=set()),
    "flux2_dev_": dict(  # image_flux2_text_to_image (Turbo LoRA switch off): 32B, 48 heads, 8 double + 48 single
        template="image_flux2_text_to_image", instances=(98,), loader=12,
        unet="flux2_dev_fp8mixed.safetensors", heads=48, blocks=8 + 48,
        clip=("CLIPLoader", {"clip_name": "mistral_3_small_flux2_bf16.safetensors", "type": "flux2",
                             "device": "default"}),
        vae="full_encoder_small_decoder.safetensors", latent=("EmptyFlux2LatentImage", 1024, 1024),
        sampling=dict(steps=20, cfg=1.0, sampler_name="euler"), guidance=4.0, shift=None,
        left_out={99, 100, 101, 102, 103, 104}),  # the Turbo LoRA and its switches
    "flux2_klein_4b_": dict(  # image_flux2_klein_text_to_image, its (bypassed) distilled subgraph: 24 heads, 5 + 20
        template="image_flux2_klein_text_to_image", instances=(77,), loader=70,
        unet="flux-2-klein-4b.safetensors", heads=24, blocks=5 + 20,
        clip=("CLIPLoader", {"clip_name": "qwen_3_4b.safetensors", "type": "flux2", "device": "default"}),
        vae="flux2-vae.safetensors", latent=("EmptyFlux2LatentImage", 1024, 1024),
        sampling=dict(steps=4, cfg=1.0, sampler_name="euler"), shift=None,
        left_out={75, 9, -76, 68, 69}),  # the base model's subgraph and Save Image; the prompt and size primitives
    "qwen_image21_": dict(  # image_qwen_image_2_1_t2i (prompt enhancer off): 32 heads of 128, 32 blocks
        template="image_qwen_image_2_1_t2i", instances=(459,), loader=451, replaced={461: "SaveImageAdvanced"},
        unet="qwen_image_2.1_int8_convrot.safetensors", heads=32, blocks=32,
        clip=("CLIPLoader", {"clip_name": "qwen3vl_8b_int8_convrot.safetensors", "type": "qwen_image",
                             "device": "default"}),
        vae="qwen_image_2.1_vae_bf16.safetensors", latent=("EmptyLatentImage", 1024, 1024),
        sampling=dict(steps=25, cfg=1.0, sampler_name="euler", scheduler="simple"), shift=None,
        # the resolution selector, the KV-cache patch, and the prompt enhancer with its switch
        left_out={13, 480, 471, 472, 473, 474, 475}),
    "hunyuan_video15_t2v_": dict(  # video_hunyuan_video_1.5_720p_t2v: 8.3B, 16 heads of 128, 54 blocks
        template="video_hunyuan_video_1.5_720p_t2v", instances=(), loader=12,
        unet="hunyuanvideo1.5_720p_t2v_fp16.safetensors", heads=16, blocks=54,
        clip=("DualCLIPLoader", {"clip_name1": "qwen_2.5_vl_7b_fp8_scaled.safetensors",
                                 "clip_name2": "byt5_small_glyphxl_fp16.safetensors", "type": "hunyuan_video_15",
                                 "device": "default"}),
        vae="hunyuanvideo15_vae_fp16.safetensors", latent=("EmptyHunyuanVideo15Latent", 1280, 720, 121),
        sampling=dict(steps=20, cfg=6.0, sampler_name="euler", scheduler="simple"), shift=("ModelSamplingSD3", 7.0),
        fps=24.0, codec="h264", left_out=set()),  # its bypassed EasyCache and 1080p stage are left out as bypassed
    "hidream_i1_full_": dict(  # hidream_i1_full: 17B, 20 heads of 128, 16 double + 32 single blocks (MoE MLPs)
        template="hidream_i1_full", instances=(), loader=94,
        unet="hidream_i1_full_fp8.safetensors", heads=20, blocks=16 + 32,
        clip=("QuadrupleCLIPLoader", {"clip_name1": "clip_l_hidream.safetensors",
                                      "clip_name2": "clip_g_hidream.safetensors",
                                      "clip_name3": "t5xxl_fp8_e4m3fn_scaled.safetensors",
                                      "clip_name4": "llama_3.1_8b_instruct_fp8_scaled.safetensors"}),
        vae="ae.safetensors", latent=("EmptySD3LatentImage", 1024, 1024),
        sampling=dict(steps=50, cfg=5.0, sampler_name="uni_pc", scheduler="simple"), shift=("ModelSamplingSD3", 3.0),
        left_out=set()),
    "flux3_klein_base_": dict(  # image_flux3_klein_t2i: FLUX.3 image klein base, 24 heads of 128, 5 mode + 28 single
        template="image_flux3_klein_t2i", instances=(18,), loader=1,
        unet="flux3-image-klein-base-int8-convrot.safetensors", heads=24, blocks=5 + 28,
        clip=("CLIPLoader", {"clip_name": "qwen3vl_4b_int8_convrot.safetensors", "type": "flux3", "device": "default"}),
        vae="flux2-vae.safetensors", latent=("EmptyFlux2LatentImage", 1024, 1024),
        sampling=dict(steps=50, cfg=3.5, sampler_name="euler", scheduler="simple"), shift=None,
        # the prompt upsampler switched off (its switch, TextGenerate on a Qwen3.5 9B, the system prompt, the prompt
        # primitive and the preview), the resolution selector, and the bounding-box layout prompt nodes
        switches={16: False}, left_out={11, 12, 13, 14, 16, 17, 19, 25, 26, 27}),
    "kandinsky5_lite_t2i_": dict(  # image_kandinsky5_t2i: Kandinsky 5 Image Lite, 50 blocks 2560 wide, 20 heads of 128
        template="image_kandinsky5_t2i", instances=(12,), loader=4,
        unet="kandinsky5lite_t2i.safetensors", heads=20, blocks=50,
        clip=("DualCLIPLoader", {"clip_name1": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "clip_name2": "clip_l.safetensors",
                                 "type": "kandinsky5_image", "device": "default"}),
        vae="ae.safetensors", latent=("EmptyLatentImage", 1024, 1024),
        sampling=dict(steps=50, cfg=3.5, sampler_name="euler", scheduler="simple"), shift=("ModelSamplingSD3", 3.0),
        left_out=set()),
    "hidream_o1_": dict(  # image_hidream_o1: HiDream O1 (Qwen3-VL 8B's 36 decoder layers, 32 query / 8 key-value heads)
        # in pixel space: 32 px patches of RGB, no VAE (the checkpoint's pass-through one decodes)
        template="image_hidream_o1", instances=(), loader=6, unet="hidream_o1_image_bf16.safetensors", heads=8,
        blocks=36, token_px=32, clip=("CheckpointLoaderSimple", {"ckpt_name": "hidream_o1_image_bf16.safetensors"}),
        vae=None, latent=("EmptyHiDreamO1LatentImage", 2048, 2048),
        sampling=dict(steps=40, cfg=5.0, sampler_name="dpmpp_2m_sde_gpu", scheduler="normal"), shift=None,
        # the MODEL's patches on Load Parallel DiT, last first: seam smoothing (a DIFFUSION_MODEL wrapper: each of its
        # passes is a parallel model call) over the noise scale
        patches=(("HiDreamO1PatchSeamSmoothing", {"start_percent": 0.8, "end_percent": 1.0, "pattern": "single_shift",
                                                  "passes": "ramp_2_4", "blend": "median", "strength": 1.0}),
                 ("ModelNoiseScale", {"noise_scale": 8.0})),
        # the reference-image branch its switches leave off (HiDreamO1ReferenceImages runs on ParaDiT too, through
        # the per-call path: docs/families.md), the prompt
        # enhancer (a subgraph on Gemma 4) its switch leaves off, the switches, their primitives, the prompt primitive
        # and its preview
        left_out={104, 213, 157, 218, 219, 172, 175, 152, 153, 154, 155, 171, 176, 177, 221}),
}
# Audio-video families, each workflow one ComfyUI template (read as FAMILIES' are) with the diffusion model on Load
# Parallel DiT. `left_out`: value nodes whose values the widgets hold (primitives, math expressions, switches, a
# resolution selector, a reroute) and the branches the template's switches leave off. `stages`: each
# SamplerCustomAdvanced in denoising order as (sigma steps, video latent (frames, rows, columns) in tokens); `length`:
# frames; `fps`: the video's frame rate. LTX-2.3: one token per latent pixel of its 32x / 8x VAE (frames
# (length - 1) // 8 + 1), 48 blocks of two streams, 32 heads (ltx2.py); its text- and image-to-video templates sample
# at cfg 1 with the distilled LoRA at 0.5, at half size and then, after the x2 latent upsampler, at full size; its
# first-last-frame template samples the distilled file once at full size, each picture guide (LTXVAddGuide:
# `guides` as (frame_idx, strength)) one more latent frame after the video's. MiniMax-H3: 1x2x2 patches of its
# 16x latent, 17k+5 frames (five latent frames per 17 from the fifth: nodes_minimax_h3.py), 56 heads, 50 blocks,
# BasicGuider (one call a step).
LTX23 = dict(heads=32, blocks=48, text_encoder="gemma_3_12B_it_fp4_mixed.safetensors", length=126, fps=25.0)
LTX23_DEV = dict(LTX23, unet="ltx-2.3-22b-dev-fp8.safetensors",
                 lora=("ltx_2.3_22b_distilled_1.1_lora_dynamic_fro09_avg_rank_111_bf16.safetensors", 0.5),
                 latent=("EmptyLTXVLatentVideo", 640, 360), stages=((8, (16, 11, 20)), (3, (16, 22, 40))))
AV_FAMILIES = {
    "ltx23_t2v_": dict(  # video_ltx2_3_t2v: prompt enhancer on, the first frame an empty image with its stages bypassed
        LTX23_DEV, template="video_ltx2_3_t2v", instances=(267,), loader=236, first_frame=None,
        left_out={201, 225, 257, 258, 260, 266, 330, 256, 259, 261, 277, 329, 255}),
    "ltx23_i2v_": dict(  # video_ltx2_3_i2v: its prompt enhancer switched off, the picture as the first frame
        LTX23_DEV, template="video_ltx2_3_i2v", instances=(320,), loader=316, first_frame="example.png",
        left_out={299, 300, 301, 302, 312, 319, 328, 292, 294, 298, 323, 327, 293, 324, 325, 326}),
    "ltx23_flf2v_": dict(  # video_ltx2_3_flf2v: the distilled file, no LoRA, one stage; the two pictures as guides
        LTX23, template="video_ltx2_3_flf2v", instances=(129,), loader=127,
        unet="ltx-2.3-22b-distilled-fp8.safetensors", latent=("EmptyLTXVLatentVideo", 1280, 720),
        stages=((8, (16 + 2, 22, 40)),), first_frame="example.png", last_frame="example.png",
        guides=((0, 0.7), (-1, 0.7)), left_out={98, 102, 113, 114, 123, 130}),
    "minimax_h3_t2v_": dict(  # video_minimax_h3_t2v: the Lightning LoRA switched off, no first or last frame
        template="video_minimax_h3_t2v", instances=(140,), loader=127,
        unet="minimax_h3_fl2va_pruned_int8_convrot.safetensors", heads=56, blocks=50,
        latent=("MiniMaxH3ImageToVideo", 864, 480), length=124, stages=((20, (37, 30 // 2, 54 // 2)),), fps=24.0,
        left_out={115, 132, 133, 134, 135, 136, 137, 138, 139}),
}

# Core ComfyUI nodes the workflows may use (as of ComfyUI a125cd8): widget inputs in order, socket inputs
# in order, output types. UI-only nodes (notes) have no API twin.
CORE = {
    "DualCLIPLoader": (["clip_name1", "clip_name2", "type", "device"], {}, ["CLIP"]),
    "CLIPLoader": (["clip_name", "type", "device"], {}, ["CLIP"]),
    "TripleCLIPLoader": (["clip_name1", "clip_name2", "clip_name3"], {}, ["CLIP"]),  # comfy_extras/nodes_sd3.py
    "QuadrupleCLIPLoader": (["clip_name1", "clip_name2", "clip_name3", "clip_name4"], {}, ["CLIP"]),  # nodes_hidream.py
    "CLIPTextEncode": (["text"], {"clip": "CLIP"}, ["CONDITIONING"]),
    "FluxGuidance": (["guidance"], {"conditioning": "CONDITIONING"}, ["CONDITIONING"]),
    "ConditioningZeroOut": ([], {"conditioning": "CONDITIONING"}, ["CONDITIONING"]),
    "EmptySD3LatentImage": (["width", "height", "batch_size"], {}, ["LATENT"]),
    "EmptyLatentImage": (["width", "height", "batch_size"], {}, ["LATENT"]),
    "LoadImage": (["image"], {}, ["IMAGE", "MASK"]),
    "FluxKontextImageScale": ([], {"image": "IMAGE"}, ["IMAGE"]),  # comfy_extras/nodes_flux.py
    "VAEEncode": ([], {"pixels": "IMAGE", "vae": "VAE"}, ["LATENT"]),
    "Canny": (["low_threshold", "high_threshold"], {"image": "IMAGE"}, ["IMAGE"]),  # comfy_extras/nodes_canny.py
    "ControlNetLoader": (["control_net_name"], {}, ["CONTROL_NET"]),
    "ControlNetApplyAdvanced": (["strength", "start_percent", "end_percent"],
                                {"positive": "CONDITIONING", "negative": "CONDITIONING", "control_net": "CONTROL_NET",
                                 "image": "IMAGE", "vae": "VAE"}, ["CONDITIONING", "CONDITIONING"]),
    "InpaintModelConditioning": (["noise_mask"], {"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE",
                                                  "pixels": "IMAGE", "mask": "MASK"},
                                 ["CONDITIONING", "CONDITIONING", "LATENT"]),
    # comfy_extras/nodes_differential_diffusion.py: the MODEL blends the noise mask's soft edges
    "DifferentialDiffusion": (["strength"], {"model": "MODEL"}, ["MODEL"]),
    "ReferenceLatent": ([], {"conditioning": "CONDITIONING", "latent": "LATENT"}, ["CONDITIONING"]),  # nodes_edit_model.py
    # Wan video: latents (comfy_extras/nodes_hunyuan.py, nodes_wan.py), CLIP vision (nodes.py), the model's shift
    # (nodes_model_advanced.py), frames to a video and its file (nodes_video.py)
    "EmptyHunyuanLatentVideo": (["width", "height", "length", "batch_size"], {}, ["LATENT"]),
    "WanImageToVideo": (["width", "height", "length", "batch_size"],
                        {"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE",
                         "clip_vision_output": "CLIP_VISION_OUTPUT", "start_image": "IMAGE"},
                        ["CONDITIONING", "CONDITIONING", "LATENT"]),
    "WanFunInpaintToVideo": (["width", "height", "length", "batch_size"],
                             {"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE",
                              "clip_vision_output": "CLIP_VISION_OUTPUT", "start_image": "IMAGE", "end_image": "IMAGE"},
                             ["CONDITIONING", "CONDITIONING", "LATENT"]),
    "Wan22ImageToVideoLatent": (["width", "height", "length", "batch_size"], {"vae": "VAE", "start_image": "IMAGE"},
                                ["LATENT"]),
    "WanVaceToVideo": (["width", "height", "length", "batch_size", "strength"],
                       {"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE", "control_video": "IMAGE",
                        "control_masks": "MASK", "reference_image": "IMAGE"},
                       ["CONDITIONING", "CONDITIONING", "LATENT", "INT"]),
    "TrimVideoLatent": (["trim_amount"], {"samples": "LATENT"}, ["LATENT"]),
    "CLIPVisionLoader": (["clip_name"], {}, ["CLIP_VISION"]),
    "CLIPVisionEncode": (["crop"], {"clip_vision": "CLIP_VISION", "image": "IMAGE"}, ["CLIP_VISION_OUTPUT"]),
    "ModelSamplingSD3": (["shift"], {"model": "MODEL"}, ["MODEL"]),
    "CreateVideo": (["fps", "bit_depth", "color_space"], {"images": "IMAGE", "audio": "AUDIO"}, ["VIDEO"]),
    "SaveVideo": (["filename_prefix", "format", "codec"], {"video": "VIDEO"}, []),
    "VAELoader": (["vae_name"], {}, ["VAE"]),
    "CheckpointLoaderSimple": (["ckpt_name"], {}, ["MODEL", "CLIP", "VAE"]),  # nodes.py (Lumina's all-in-one file)
    # The newer families' templates (ComfyUI 2026): AuraFlow's shift (nodes_model_advanced.py), FLUX.2's latent and
    # schedule (nodes_flux.py), HunyuanVideo 1.5's latent (nodes_hunyuan.py), Qwen-Image 2.1's prompt encoder
    # (nodes_qwen.py; its autogrow reference images left unconnected), and the custom-sampling nodes
    # (nodes_custom_sampler.py) the FLUX.2 and HunyuanVideo templates sample with.
    "ModelSamplingAuraFlow": (["shift"], {"model": "MODEL"}, ["MODEL"]),
    "EmptyFlux2LatentImage": (["width", "height", "batch_size"], {}, ["LATENT"]),
    "Flux2Scheduler": (["steps", "width", "height"], {}, ["SIGMAS"]),
    "EmptyHunyuanVideo15Latent": (["width", "height", "length", "batch_size"], {}, ["LATENT"]),
    "TextEncodeQwenImage21": (["prompt", "negative_prompt", "resolution"], {"clip": "CLIP", "vae": "VAE"},
                              ["CONDITIONING", "CONDITIONING", "LATENT"]),
    "RandomNoise": (["noise_seed"], {}, ["NOISE"]),
    "KSamplerSelect": (["sampler_name"], {}, ["SAMPLER"]),
    "BasicScheduler": (["scheduler", "steps", "denoise"], {"model": "MODEL"}, ["SIGMAS"]),
    "BasicGuider": ([], {"model": "MODEL", "conditioning": "CONDITIONING"}, ["GUIDER"]),
    "CFGGuider": (["cfg"], {"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING"}, ["GUIDER"]),
    "SamplerCustomAdvanced": ([], {"noise": "NOISE", "guider": "GUIDER", "sampler": "SAMPLER", "sigmas": "SIGMAS",
                                   "latent_image": "LATENT"}, ["LATENT", "LATENT"]),
    "VAEDecode": ([], {"samples": "LATENT", "vae": "VAE"}, ["IMAGE"]),
    "SaveImage": (["filename_prefix"], {"images": "IMAGE"}, []),
    # ComfyUI's own sampler on Load Parallel DiT's MODEL (the stock-KSampler workflow)
    "KSampler": (["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
                 {"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING", "latent_image": "LATENT"},
                 ["LATENT"]),
    # ... and its advanced one, which runs a range of the steps (Wan 2.2 14B's two experts)
    "KSamplerAdvanced": (["add_noise", "noise_seed", "steps", "cfg", "sampler_name", "scheduler", "start_at_step",
                          "end_at_step", "return_with_leftover_noise"],
                         {"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING",
                          "latent_image": "LATENT"}, ["LATENT"]),
    # The audio-video templates (ComfyUI 2026, as the templates' 0.16.3 saves them; tests/fixtures/object_info_2026.json):
    # LTX-2's latents, conditioning, audio VAE and text encoder (comfy_extras/nodes_lt.py, nodes_lt_audio.py), its
    # latent upsampler, ManualSigmas, the prompt enhancer (nodes_textgen.py) with its LoRA on the Gemma CLIP, image
    # resizing, MiniMax-H3's prompt + AV latent node (nodes_minimax_h3.py) and its audio decode (nodes_audio.py).
    "EmptyLTXVLatentVideo": (["width", "height", "length", "batch_size"], {}, ["LATENT"]),
    "LTXVImgToVideoInplace": (["strength", "bypass"], {"vae": "VAE", "image": "IMAGE", "latent": "LATENT"},
                              ["LATENT"]),
    "LTXVCropGuides": ([], {"positive": "CONDITIONING", "negative": "CONDITIONING", "latent": "LATENT"},
                       ["CONDITIONING", "CONDITIONING", "LATENT"]),
    # LTX-2's picture guides (nodes_lt.py, ComfyUI 2026: its optional attention mask and IC-LoRA parameters), the
    # size of the resized first frame (nodes_images.py) and the first-last-frame template's sampler
    # (nodes_custom_sampler.py)
    "LTXVAddGuide": (["frame_idx", "strength"],
                     {"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE", "latent": "LATENT",
                      "image": "IMAGE", "attention_mask": "MASK", "iclora_parameters": "IC_LORA_PARAMETERS"},
                     ["CONDITIONING", "CONDITIONING", "LATENT"]),
    "GetImageSize": ([], {"image": "IMAGE"}, ["INT", "INT", "INT"]),
    "SamplerEulerAncestral": (["eta", "s_noise"], {}, ["SAMPLER"]),
    "LTXVConditioning": (["frame_rate"], {"positive": "CONDITIONING", "negative": "CONDITIONING"},
                         ["CONDITIONING", "CONDITIONING"]),
    "LTXVPreprocess": (["img_compression"], {"image": "IMAGE"}, ["IMAGE"]),
    "LTXVConcatAVLatent": ([], {"video_latent": "LATENT", "audio_latent": "LATENT"}, ["LATENT"]),
    "LTXVSeparateAVLatent": ([], {"av_latent": "LATENT"}, ["LATENT", "LATENT"]),
    "LTXVLatentUpsampler": ([], {"samples": "LATENT", "upscale_model": "LATENT_UPSCALE_MODEL", "vae": "VAE"},
                            ["LATENT"]),
    "LatentUpscaleModelLoader": (["model_name"], {}, ["LATENT_UPSCALE_MODEL"]),
    "LTXVAudioVAELoader": (["ckpt_name"], {}, ["VAE"]),
    "LTXVAudioVAEDecode": ([], {"samples": "LATENT", "audio_vae": "VAE"}, ["AUDIO"]),
    "LTXVEmptyLatentAudio": (["frames_number", "frame_rate", "batch_size"], {"audio_vae": "VAE"}, ["LATENT"]),
    "LTXAVTextEncoderLoader": (["text_encoder", "ckpt_name", "device"], {}, ["CLIP"]),
    "ManualSigmas": (["sigmas"], {}, ["SIGMAS"]),
    "LoraLoaderModelOnly": (["lora_name", "strength_model"], {"model": "MODEL"}, ["MODEL"]),
    "LoraLoader": (["lora_name", "strength_model", "strength_clip"], {"model": "MODEL", "clip": "CLIP"},
                   ["MODEL", "CLIP"]),
    "VAEDecodeTiled": (["tile_size", "overlap", "temporal_size", "temporal_overlap"], {"samples": "LATENT", "vae": "VAE"},
                       ["IMAGE"]),
    "EmptyImage": (["width", "height", "batch_size", "color"], {}, ["IMAGE"]),
    "ResizeImageMaskNode": (["resize_type", "scale_method"], {"input": "IMAGE,MASK"}, ["IMAGE"]),
    "TextGenerateLTX2Prompt": (["prompt", "max_length", "sampling_mode", "thinking", "use_default_template"],
                               {"clip": "CLIP", "image": "IMAGE", "video": "IMAGE", "audio": "AUDIO"}, ["STRING"]),
    "PreviewAny": ([], {"source": "*"}, ["STRING"]),
    "MiniMaxH3ImageToVideo": (["prompt", "width", "height", "length"],
                              {"clip": "CLIP", "vae": "VAE", "first_frame": "IMAGE", "last_frame": "IMAGE"},
                              ["CONDITIONING", "LATENT"]),
    "VAEDecodeAudio": ([], {"samples": "LATENT", "vae": "VAE"}, ["AUDIO"]),
    # HiDream O1's template (ComfyUI 2026): its pixel-space latent and seam smoothing (comfy_extras/nodes_hidream_o1.py),
    # the noise scale on its MODEL (nodes_model_advanced.py) and SamplerCustom (nodes_custom_sampler.py).
    "EmptyHiDreamO1LatentImage": (["width", "height", "batch_size"], {}, ["LATENT"]),
    "ModelNoiseScale": (["noise_scale"], {"model": "MODEL"}, ["MODEL"]),
    "HiDreamO1PatchSeamSmoothing": (["start_percent", "end_percent", "pattern", "passes", "blend", "strength"],
                                    {"model": "MODEL"}, ["MODEL"]),
    "SamplerCustom": (["add_noise", "noise_seed", "cfg"],
                      {"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING", "sampler": "SAMPLER",
                       "sigmas": "SIGMAS", "latent_image": "LATENT"}, ["LATENT", "LATENT"]),
}
# Dynamic combos (V3): each choice brings widgets of its own, saved after the combo's value and sent as "combo.widget".
DYNAMIC_CORE = {
    ("ResizeImageMaskNode", "resize_type"): {"scale dimensions": ("width", "height", "crop"),
                                             "scale longer dimension": ("longer_size",)},
    ("TextGenerateLTX2Prompt", "sampling_mode"): {"on": ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                         "seed", "presence_penalty"), "off": ()},
}
# Optional widgets newer ComfyUI added after a class's older widgets, with the default a file that predates them runs.
OPTIONAL_WIDGET_DEFAULTS = {("CreateVideo", "bit_depth"): "auto", ("CreateVideo", "color_space"): "sRGB"}
VALUE_TYPES = {"STRING", "INT", "FLOAT", "BOOLEAN"}  # what a widget fed by a link may take
UI_ONLY = {"MarkdownNote", "Note"}
BYPASSED = 4  # a UI node's mode: left out of the prompt (ComfyUI's templates ship optional pictures so)
OPTIONAL_CORE = {("DualCLIPLoader", "device"), ("CLIPLoader", "device"), ("ReferenceLatent", "latent"),
                 ("ControlNetApplyAdvanced", "vae"), ("DifferentialDiffusion", "strength"),
                 ("WanImageToVideo", "clip_vision_output"), ("WanImageToVideo", "start_image"),
                 ("Wan22ImageToVideoLatent", "start_image"), ("WanFunInpaintToVideo", "clip_vision_output"),
                 ("WanFunInpaintToVideo", "start_image"), ("WanFunInpaintToVideo", "end_image"), ("CreateVideo", "audio"), ("TextEncodeQwenImage21", "vae"),
                 *OPTIONAL_WIDGET_DEFAULTS, ("TextGenerateLTX2Prompt", "image"), ("TextGenerateLTX2Prompt", "video"),
                 ("TextGenerateLTX2Prompt", "audio"), ("TextGenerateLTX2Prompt", "thinking"),
                 ("TextGenerateLTX2Prompt", "use_default_template"), ("MiniMaxH3ImageToVideo", "first_frame"),
                 ("MiniMaxH3ImageToVideo", "last_frame"), ("WanVaceToVideo", "control_video"),
                 ("WanVaceToVideo", "control_masks"), ("WanVaceToVideo", "reference_image"),
                 ("LTXVAddGuide", "attention_mask"), ("LTXVAddGuide", "iclora_parameters")}
# Widget values the frontend stores after a widget but the API format leaves out: LoadImage's upload button, and
# the samplers' (and RandomNoise's) control_after_generate after their seed.
UI_EXTRA_WIDGETS = {("LoadImage", "image"): 1, ("KSampler", "seed"): 1, ("SamplerCustom", "noise_seed"): 1,
                    ("KSamplerAdvanced", "noise_seed"): 1,
                    ("RandomNoise", "noise_seed"): 1}


def _ours():
    """class -> (InputSpec rows, output types), straight from nodes/convert.py."""
    return {
        "ParaDiTStrategy": (convert.STRATEGY_INPUTS, [convert.STRATEGY_TYPE]),
        "ParaDiTLoader": (convert.loader_inputs([*FLUX_UNETS, KONTEXT["unet"], FILL["unet"],
                                                       *(m["unet"] for m in MODELS.values()),
                                                       *(u for m in WAN.values() for u in m["unets"]),
                                                       *(m["unet"] for m in FAMILIES.values()),
                                                       *(m["unet"] for m in AV_FAMILIES.values())]),
                          [convert.MODEL_TYPE]),
        "ParaDiTSampler": (convert.sampler_inputs(convert.sampler_names(), convert.scheduler_names()), ["LATENT"]),
    }


OURS = _ours()
WIDGET_KINDS = {"int", "float", "string", "combo"}


def node_interface(cls: str):
    """(widget names in order, {socket: type}, required names, output types, {widget: InputSpec or None})."""
    if cls in OURS:
        specs, outputs = OURS[cls]
        widgets = [s.id for s in specs if s.kind in WIDGET_KINDS]
        sockets = {s.id: s.kind for s in specs if s.kind not in WIDGET_KINDS}
        required = {s.id for s in specs if not s.optional}
        return widgets, sockets, required, outputs, {s.id: s for s in specs}
    widgets, sockets, outputs = CORE[cls]
    required = {n for n in widgets + list(sockets) if (cls, n) not in OPTIONAL_CORE}
    return widgets, sockets, required, outputs, {}


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def ui_files():
    return sorted(f for f in os.listdir(WF_DIR) if f.endswith(".json"))


def api_files():
    return sorted(f for f in os.listdir(API_DIR) if f.endswith(".json"))


def _model_of(name: str):
    """The MODELS, WAN or FAMILIES entry a workflow file is for, or None for Flux."""
    found = [m for prefix, m in (*MODELS.items(), *WAN.items(), *FAMILIES.items(), *AV_FAMILIES.items())
             if name.startswith(prefix)]
    flux = name.startswith(("flux_", "kontext_"))
    assert len(found) == (0 if flux else 1), f"{name}: which model is this workflow for?"
    return found[0] if found else None


FLUX_API = [f for f in api_files() if f.startswith("flux_") and not f.startswith("flux_fill_")]
FILL_API = [f for f in api_files() if f.startswith("flux_fill_")]
KONTEXT_API = [f for f in api_files() if f.startswith("kontext_")]
OTHER_API = [f for f in api_files() if not f.startswith(("flux_", "kontext_", "wan", *FAMILIES, *AV_FAMILIES))]
FAMILY_API = [f for f in api_files() if f.startswith(tuple(FAMILIES))]
AV_API = [f for f in api_files() if f.startswith(tuple(AV_FAMILIES))]
WAN_API = [f for f in api_files() if f.startswith("wan")]


# ---------------------------------------------------------------------------------------------------

def test_every_family_has_a_ui_workflow_and_an_api_twin():
    assert ui_files() == api_files()
    assert sorted(os.path.splitext(f)[0] for f in ui_files()) == sorted(WORKFLOWS)
    for name in WORKFLOWS:
        _model_of(name)  # every workflow is Flux or one of MODELS
    for sub in os.listdir(WF_DIR):  # ComfyUI lists top-level *.json only; keep api/ the only folder
        assert sub.endswith(".json") or sub == "api", sub


@pytest.mark.parametrize("name", ui_files())
def test_ui_workflow_is_a_consistent_graph(name):
    wf = _load(os.path.join(WF_DIR, name))
    assert wf["version"] == 0.4 and isinstance(wf["nodes"], list) and isinstance(wf["links"], list)
    # The fields the frontend's workflow schema (zComfyWorkflow, version 0.4) requires of a graph and a node.
    uuid.UUID(wf["id"])
    assert isinstance(wf["last_link_id"], int) and isinstance(wf["extra"]["ds"]["scale"], (int, float))
    for n in wf["nodes"]:
        assert isinstance(n["id"], int) and isinstance(n["type"], str), n
        assert all(len(n[k]) == 2 and all(isinstance(v, (int, float)) for v in n[k]) for k in ("pos", "size"))
        assert isinstance(n["flags"], dict) and isinstance(n["order"], int) and n["mode"] in (0, BYPASSED)
        assert isinstance(n["properties"], dict) and isinstance(n["widgets_values"], list)
        for model in n["properties"].get("models", []):
            assert set(model) == {"name", "url", "directory"} and model["url"].startswith("https://")
            assert model["name"] in n["widgets_values"]
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert len(nodes) == len(wf["nodes"]), "duplicate node ids"
    assert wf["last_node_id"] >= max(nodes) and wf["last_link_id"] >= max(l[0] for l in wf["links"])
    assert sorted(n["order"] for n in wf["nodes"]) == list(range(len(nodes)))
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"] and inp["link"] == link_id, link_id
        assert out["type"] == typ and (typ in inp["type"].split(",") or inp["type"] == "*"), link_id  # or any type
        assert nodes[src]["order"] < nodes[dst]["order"], "order must be a topological order"
    linked = {l[0]: l for l in wf["links"]}
    bypassed = {n["id"] for n in wf["nodes"] if n["mode"] == BYPASSED}
    for n in wf["nodes"]:
        for inp in n.get("inputs", []):
            assert inp["link"] is None or inp["link"] in linked
        for out in n.get("outputs", []):
            assert set(out["links"] or []) <= set(linked)
        if n["type"] in UI_ONLY:
            continue
        widgets, sockets, required, outputs, _ = node_interface(n["type"])
        # sockets in order, then widgets a link feeds (the editor lists such a widget among the inputs)
        assert [i["name"] for i in n["inputs"] if not i.get("widget")] == list(sockets), n["type"]
        assert [o["type"] for o in n["outputs"]] == outputs, n["type"]
        for i in n["inputs"]:
            if i.get("widget"):
                assert i["name"] == i["widget"]["name"] in widgets and i["link"] is not None, (n["type"], i["name"])
                assert i["type"] in VALUE_TYPES, (n["type"], i["name"])
                continue
            assert i["type"] == sockets[i["name"]]
            assert i["link"] is not None or i["name"] not in required, f"{n['type']}.{i['name']} is unconnected"
            if i["link"] is not None and linked[i["link"]][1] in bypassed:  # the graph must run without it
                assert i["name"] not in required, f"{n['type']}.{i['name']} needs a bypassed node"
        if n["id"] in bypassed:  # it passes nothing on in the prompt: no input of its type to pass through
            assert not any(i["link"] for i in n["inputs"]), f"bypassed {n['type']} has linked inputs"


@pytest.mark.parametrize("name", api_files())
def test_api_workflow_uses_known_nodes_and_inputs(name):
    graph = _load(os.path.join(API_DIR, name))
    assert graph and all(isinstance(k, str) and k.isdigit() for k in graph)
    for nid, node in graph.items():
        cls = node["class_type"]
        assert cls in OURS or cls in CORE, f"node {nid}: unexpected class {cls}"
        widgets, sockets, required, _, specs = node_interface(cls)
        inputs = node["inputs"]
        dynamic = {f"{w}.{sub}" for (c, w), choices in DYNAMIC_CORE.items() if c == cls
                   for sub in choices.get(inputs.get(w), ())}
        known = set(widgets) | set(sockets) | dynamic
        assert set(inputs) <= known, f"{cls}: unknown inputs {set(inputs) - known}"
        assert required <= set(inputs), f"{cls}: missing {required - set(inputs)}"
        for key, value in inputs.items():
            if key in sockets or isinstance(value, list):  # a socket, or a widget a link feeds
                assert isinstance(value, list) and len(value) == 2, f"{cls}.{key} must be a link"
                src, slot = value
                assert src in graph, f"{cls}.{key} links to missing node {src}"
                src_outputs = node_interface(graph[src]["class_type"])[3]
                wanted = sockets[key].split(",") if key in sockets else VALUE_TYPES
                assert slot < len(src_outputs) and (src_outputs[slot] in wanted or wanted == ["*"]), \
                    f"{cls}.{key}: wrong type"
                continue
            spec = specs.get(key)
            if spec is None:
                continue
            opts = spec.options
            if spec.kind == "int":
                assert isinstance(value, int) and opts["min"] <= value <= opts["max"], (cls, key, value)
            elif spec.kind == "float":
                assert isinstance(value, (int, float)) and opts["min"] <= value <= opts["max"], (cls, key, value)
            elif spec.kind == "string":
                assert isinstance(value, str), (cls, key, value)
            elif spec.kind == "combo":
                assert value in opts["options"], (cls, key, value)
        if cls == "ParaDiTStrategy":
            convert.strategy_choice(**inputs)  # the node's own range checks


@pytest.mark.parametrize("name", ui_files())
def test_ui_and_api_twins_agree(name):
    ui = _load(os.path.join(WF_DIR, name))
    api = _load(os.path.join(API_DIR, name))
    nodes = {str(n["id"]): n for n in ui["nodes"] if n["type"] not in UI_ONLY and n["mode"] != BYPASSED}
    assert set(nodes) == set(api)
    links = {l[0]: l for l in ui["links"]}
    for nid, n in nodes.items():
        a = api[nid]
        assert a["class_type"] == n["type"]
        assert a.get("_meta", {}).get("title") == n.get("title", n["type"])
        linked = {i["name"] for i in n["inputs"] if i.get("widget") and i["link"] is not None}
        saved = dict(_saved_widgets(n["type"], n["widgets_values"], f"{name} node {nid}"))
        for w, value in saved.items():
            if w not in linked:  # a linked one is sent as the link, checked below
                assert a["inputs"][w] == value, f"{name} node {nid}.{w}"
        for w in node_interface(n["type"])[0]:  # a file that predates a widget sends none
            if (n["type"], w) in OPTIONAL_WIDGET_DEFAULTS and w not in saved:
                assert w not in a["inputs"]
        sent = set()
        for slot, inp in enumerate(n["inputs"]):
            if inp["link"] is None or str(links[inp["link"]][1]) not in nodes:  # unconnected, or from a bypassed node
                assert inp["name"] not in a["inputs"]
                continue
            _, src, src_slot, dst, dst_slot, _ = links[inp["link"]]
            assert (str(dst), dst_slot) == (nid, slot)
            assert a["inputs"][inp["name"]] == [str(src), src_slot], f"{name} node {nid}.{inp['name']}"
            sent.add(inp["name"])
        assert {k for k, v in a["inputs"].items() if isinstance(v, list)} == sent


def _saved_widgets(cls, values, where=""):
    """[(widget name, value)] of a UI node's `widgets_values`, in the editor's order: each widget, then what the editor
    stores after it for itself (control_after_generate, the upload button; not sent), then a dynamic combo's widgets
    for its choice ("combo.widget"). A file saved before a class gained its trailing optional widgets lacks them."""
    widgets, _, _, _, specs = node_interface(cls)
    values, out = list(values), []
    for w in widgets:
        if not values and (cls, w) in OPTIONAL_WIDGET_DEFAULTS:
            continue
        assert values, f"{where}: too few widgets_values"
        value = values.pop(0)
        out.append((w, value))
        spec = specs.get(w)
        if spec is not None and spec.options.get("control_after_generate"):
            assert values.pop(0) in ("fixed", "increment", "decrement", "randomize"), where
        del values[:UI_EXTRA_WIDGETS.get((cls, w), 0)]
        for sub in DYNAMIC_CORE.get((cls, w), {}).get(value, ()):
            out.append((f"{w}.{sub}", values.pop(0)))
    assert not values, f"{where}: extra widgets_values {values}"
    return out


def _by_class(graph):
    out = {}
    for nid, node in graph.items():
        out.setdefault(node["class_type"], []).append(node)
    return out


def _text_to_image(name, graph, latent_class="EmptySD3LatentImage", size=1024):
    """The parts every workflow has, checked for the wiring they share: strategy -> loader -> sampler -> decode ->
    save, a square latent of the model's size, and a save prefix named after the workflow."""
    c = _by_class(graph)
    (loader,), (strategy,) = c["ParaDiTLoader"], c["ParaDiTStrategy"]
    (sampler,) = c.get("ParaDiTSampler") or c["KSampler"]  # Parallel Sampler, or ComfyUI's own on the MODEL
    (latent,), (vae,), (decode,), (save,) = (c[k] for k in (latent_class, "VAELoader", "VAEDecode", "SaveImage"))
    assert (latent["inputs"]["width"], latent["inputs"]["height"]) == (size, size)
    assert graph[decode["inputs"]["samples"][0]] is sampler and graph[save["inputs"]["images"][0]] is decode
    assert graph[decode["inputs"]["vae"][0]] is vae and graph[sampler["inputs"]["latent_image"][0]] is latent
    assert graph[loader["inputs"]["strategy"][0]] is strategy and graph[sampler["inputs"]["model"][0]] is loader
    assert save["inputs"]["filename_prefix"] == f"ParaDiT/{name[:-len('.json')]}"
    return c, loader, strategy, sampler, latent, vae


def _check_strategy(name, graph, heads, num_blocks, latent_hw=None):
    """The strategy fits the loader's devices and the model; a workflow named for one strategy family uses it alone.
    `latent_hw`: the latent's pixel size where no Empty*LatentImage node sets it (an edited picture's)."""
    c = _by_class(graph)
    (loader,), (strategy,) = (c[k] for k in ("ParaDiTLoader", "ParaDiTStrategy"))
    (sampler,) = c.get("ParaDiTSampler") or c["KSampler"]
    if latent_hw is None:
        latent = graph[sampler["inputs"]["latent_image"][0]]["inputs"]
        latent_hw = (latent["height"], latent["width"])
    _check_fit(name, graph, loader, strategy, sampler["inputs"], heads, num_blocks,
               (latent_hw[0] // 8, latent_hw[1] // 8))


def _check_fit(name, graph, loader, strategy, s, heads, num_blocks, latent, empty_negative=False):
    """One sampler's strategy (its inputs `s`, the loader and Strategy Selector behind its MODEL) for the latent's
    (rows, columns) of latent pixels as the strategies cut it (a video's frames stack their rows).
    `empty_negative`: the template's negative prompt is empty text, a branch of its own all the same."""
    st = strategy["inputs"]
    devices = loader["inputs"]["devices"]
    if st["mode"] == "auto":
        assert devices == "auto"
        return
    n_devices = len(devices.split(","))
    spec = StrategySpec(cfg_degree=st["cfg_degree"], pipefusion_degree=st["pipefusion_degree"],
                        ulysses_degree=st["ulysses_degree"], ring_degree=st["ring_degree"],
                        num_pipeline_patch=st["num_pipeline_patch"], warmup_steps=st["warmup_steps"])
    validate_strategy(spec, world_size=n_devices, heads=heads, num_blocks=num_blocks, latent_hw=latent,
                      cfg_scale=s["cfg"], steps=s["steps"])
    family = next((w for w in STRATEGY_WORDS if name[:-len(".json")].endswith("_" + w)), None)
    degrees = {"ulysses": spec.ulysses_degree, "ring": spec.ring_degree, "pipefusion": spec.pipefusion_degree,
               "cfg_parallel": spec.cfg_degree}
    if family == "cfg_parallel":  # two branches at most: on more devices a sequence split shares each branch
        assert spec.cfg_degree == 2 and spec.pipefusion_degree == 1, "a CFG-parallel workflow splits cond and uncond"
    elif family in degrees:
        assert degrees[family] == n_devices > 1, "a single-family workflow uses that family alone"
    if family == "hybrid":
        assert sum(d > 1 for d in degrees.values()) >= 2
    if spec.cfg_degree == 2:  # needs true CFG with a real negative prompt
        negative = graph[s["negative"][0]]
        while "negative" in negative["inputs"]:  # through nodes that pass the prompts on (WanImageToVideo)
            negative = graph[negative["inputs"]["negative"][0]]
        assert s["cfg"] > 1 and negative["class_type"] == "CLIPTextEncode"
        assert empty_negative or negative["inputs"]["text"].strip()


@pytest.mark.parametrize("name", FLUX_API)
def test_workflow_is_flux_text_to_image_and_its_strategy_fits(name):
    graph = _load(os.path.join(API_DIR, name))
    c, loader, strategy, sampler, latent, vae = _text_to_image(name, graph)
    (clip,) = c["DualCLIPLoader"]
    schnell = name.startswith("flux_schnell")
    assert loader["inputs"]["unet_name"] == ("flux1-schnell.safetensors" if schnell else "flux1-dev.safetensors")
    assert clip["inputs"] == {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                              "type": "flux", "device": "default"}
    assert vae["inputs"]["vae_name"] == "ae.safetensors"
    assert ("FluxGuidance" in c) == (not schnell)
    positive = graph[sampler["inputs"]["positive"][0]]
    if "ControlNetApplyAdvanced" in c:  # the prompts pass through Apply ControlNet on their way to the sampler
        positive = graph[_check_controlnet(graph, sampler, vae)["inputs"]["positive"][0]]
    assert positive["class_type"] == ("CLIPTextEncode" if schnell else "FluxGuidance")
    s = sampler["inputs"]
    if schnell:
        assert (s["steps"], s["cfg"]) == (4, 1.0)
    _check_strategy(name, graph, FLUX_HEADS, FLUX_BLOCKS)


def _check_controlnet(graph, sampler, vae):
    """Apply ControlNet feeds both of the sampler's prompts (its positive and negative outputs), with a ControlNet this
    project lists, the Flux VAE, a hint traced from a picture, and a strength and step range ComfyUI accepts. The
    MODEL stays Load Parallel DiT's own: the ControlNet rides in the conditioning. Returns the Apply node."""
    s = sampler["inputs"]
    apply = graph[s["positive"][0]]
    assert apply["class_type"] == "ControlNetApplyAdvanced"
    assert s["positive"][1] == 0 and s["negative"] == [s["positive"][0], 1], "positive and negative from one Apply"
    a = apply["inputs"]
    loader = graph[a["control_net"][0]]
    assert loader["class_type"] == "ControlNetLoader" and loader["inputs"]["control_net_name"] in CONTROLNETS
    assert graph[a["vae"][0]] is vae
    hint = graph[a["image"][0]]
    if "canny" in loader["inputs"]["control_net_name"]:  # a canny ControlNet sees edges: Canny traces the picture
        assert hint["class_type"] == "Canny"
        assert 0 < hint["inputs"]["low_threshold"] < hint["inputs"]["high_threshold"] < 1
        hint = graph[hint["inputs"]["image"][0]]
    assert hint["class_type"] == "LoadImage" and hint["inputs"]["image"] == "example.png"  # ComfyUI's input/example.png
    assert 0 < a["strength"] <= 10 and 0 <= a["start_percent"] < a["end_percent"] <= 1
    assert graph[s["model"][0]]["class_type"] == "ParaDiTLoader"
    return apply


@pytest.mark.parametrize("name", FILL_API)
def test_fill_workflow_inpaints_a_picture_and_its_strategy_fits(name):
    """Flux Fill: InpaintModelConditioning encodes the picture and its mask (both from one Load Image) into the
    conditioning and hands the sampler the picture's latent (the output keeps the picture's size); Differential
    Diffusion on Load Parallel DiT's MODEL; guidance-distilled: FluxGuidance 30, cfg 1, full denoise."""
    graph = _load(os.path.join(API_DIR, name))
    c = _by_class(graph)
    (loader,), (sampler,), (clip,), (vae,) = c["ParaDiTLoader"], c["KSampler"], c["DualCLIPLoader"], c["VAELoader"]
    assert "ParaDiTSampler" not in c and "EmptySD3LatentImage" not in c
    assert loader["inputs"]["unet_name"] == FILL["unet"] and vae["inputs"]["vae_name"] == "ae.safetensors"
    assert clip["inputs"] == {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                              "type": "flux", "device": "default"}
    s = sampler["inputs"]
    assert (s["cfg"], s["denoise"]) == (1.0, 1.0)
    diffusion = graph[s["model"][0]]
    assert diffusion["class_type"] == "DifferentialDiffusion" and graph[diffusion["inputs"]["model"][0]] is loader
    inpaint_id = s["positive"][0]
    inpaint = graph[inpaint_id]
    assert inpaint["class_type"] == "InpaintModelConditioning"
    assert (s["positive"], s["negative"], s["latent_image"]) == ([inpaint_id, 0], [inpaint_id, 1], [inpaint_id, 2])
    i = inpaint["inputs"]
    assert i["noise_mask"] is True and graph[i["vae"][0]] is vae
    guidance = graph[i["positive"][0]]
    assert guidance["class_type"] == "FluxGuidance" and guidance["inputs"]["guidance"] == FILL["guidance"]
    positive, negative = graph[guidance["inputs"]["conditioning"][0]], graph[i["negative"][0]]
    assert positive["class_type"] == "CLIPTextEncode" and positive["inputs"]["text"].strip()
    assert negative["class_type"] in ("CLIPTextEncode", "ConditioningZeroOut") and negative is not positive
    for encode in (positive, negative):
        if encode["class_type"] == "CLIPTextEncode":
            assert graph[encode["inputs"]["clip"][0]] is clip
    image_id = i["pixels"][0]
    assert i["pixels"] == [image_id, 0] and i["mask"] == [image_id, 1], "picture and mask from one Load Image"
    assert graph[image_id]["class_type"] == "LoadImage" and graph[image_id]["inputs"]["image"] == "example.png"
    (decode,), (save,) = c["VAEDecode"], c["SaveImage"]
    assert graph[decode["inputs"]["samples"][0]] is sampler and graph[decode["inputs"]["vae"][0]] is vae
    assert graph[save["inputs"]["images"][0]] is decode
    assert save["inputs"]["filename_prefix"] == f"ParaDiT/{name[:-len('.json')]}"
    # The output has the picture's size: ComfyUI's example.png (768 px), a square megapixel, and wide/tall ones.
    for hw in ((768, 768), (1024, 1024), (768, 1360), (1360, 768)):
        _check_strategy(name, graph, FILL["heads"], FILL["blocks"], latent_hw=hw)


@pytest.mark.parametrize("name", OTHER_API)
def test_workflow_is_true_cfg_text_to_image_for_its_model_and_its_strategy_fits(name):
    """Chroma and SD3.5: their own text encoder node, unet and VAE; true CFG from two prompts, no FluxGuidance."""
    model = _model_of(name)
    graph = _load(os.path.join(API_DIR, name))
    c, loader, strategy, sampler, latent, vae = _text_to_image(name, graph, model.get("latent", "EmptySD3LatentImage"),
                                                               model.get("size", 1024))
    clip_cls, clip_inputs = model["clip"]
    (clip,) = c[clip_cls]
    assert clip["inputs"] == clip_inputs
    assert not ({"DualCLIPLoader", "CLIPLoader", "TripleCLIPLoader"} - {clip_cls}) & set(c), "one text encoder loader"
    assert loader["inputs"]["unet_name"] == model["unet"]
    assert vae["inputs"]["vae_name"] == model["vae"]
    assert "FluxGuidance" not in c and "ConditioningZeroOut" not in c
    s = sampler["inputs"]
    positive, negative = graph[s["positive"][0]], graph[s["negative"][0]]
    assert positive["class_type"] == negative["class_type"] == "CLIPTextEncode" and positive is not negative
    assert graph[positive["inputs"]["clip"][0]] is clip and graph[negative["inputs"]["clip"][0]] is clip
    assert positive["inputs"]["text"].strip() and negative["inputs"]["text"].strip()
    assert s["cfg"] > 1, "true CFG: cfg 1 would drop the negative prompt"
    _check_strategy(name, graph, model["heads"], model["blocks"])


@pytest.mark.parametrize("name", KONTEXT_API)
def test_kontext_workflow_edits_a_picture_and_its_strategy_fits(name):
    """Flux Kontext: the picture is loaded, scaled to a Kontext size, VAE-encoded and attached to the prompt by
    ReferenceLatent; the same latent is what the sampler denoises (the output keeps the picture's size);
    guidance-distilled like Flux dev (FluxGuidance, cfg 1, zeroed negative)."""
    graph = _load(os.path.join(API_DIR, name))
    c = _by_class(graph)
    (loader,), (sampler,), (clip,), (vae,) = c["ParaDiTLoader"], c["ParaDiTSampler"], c["DualCLIPLoader"], c["VAELoader"]
    assert loader["inputs"]["unet_name"] == KONTEXT["unet"] and vae["inputs"]["vae_name"] == "ae.safetensors"
    assert clip["inputs"] == {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                              "type": "flux", "device": "default"}
    s = sampler["inputs"]
    guidance = graph[s["positive"][0]]
    assert guidance["class_type"] == "FluxGuidance" and s["cfg"] == 1.0
    reference = graph[guidance["inputs"]["conditioning"][0]]
    assert reference["class_type"] == "ReferenceLatent"
    encoded = graph[reference["inputs"]["latent"][0]]
    assert encoded["class_type"] == "VAEEncode" and graph[s["latent_image"][0]] is encoded
    scale = graph[encoded["inputs"]["pixels"][0]]
    assert scale["class_type"] == "FluxKontextImageScale"
    assert graph[scale["inputs"]["image"][0]]["inputs"]["image"] == "example.png"  # ComfyUI ships input/example.png
    assert graph[encoded["inputs"]["vae"][0]] is vae
    assert graph[s["negative"][0]]["class_type"] == "ConditioningZeroOut"
    (decode,), (save,) = c["VAEDecode"], c["SaveImage"]
    assert graph[decode["inputs"]["samples"][0]] is sampler and graph[decode["inputs"]["vae"][0]] is vae
    assert save["inputs"]["filename_prefix"] == f"ParaDiT/{name[:-len('.json')]}"
    # FluxKontextImageScale picks ~1 megapixel sizes (multiples of 16); the widest is 1568 x 672.
    for hw in ((1024, 1024), (672, 1568), (1568, 672)):
        _check_strategy(name, graph, KONTEXT["heads"], KONTEXT["blocks"], latent_hw=hw)


@pytest.mark.parametrize("name", WAN_API)
def test_wan_workflow_is_its_template_on_load_parallel_dit_and_its_strategy_fits(name):
    """Wan video as ComfyUI's template graphs it: umT5 (Load CLIP type wan), the model's VAE and latent node at the
    template's width, height and frames, each sampler on ModelSamplingSD3 (the template's shift) over a Load Parallel
    DiT of the model's file, true CFG from two prompts, VAE Decode -> Create Video (the template's fps) -> Save Video.
    Wan 2.1 I2V: WanImageToVideo carries the prompts, the first frame and its CLIP-vision encoding (one picture).
    Wan 2.2 14B: the high-noise expert's KSamplerAdvanced adds the noise and returns the leftover noise after steps
    0..split, the low-noise one adds none and runs the rest: one schedule, contiguous ranges covering every step.
    Each sampler's strategy fits its devices, the model's heads and blocks and the video's tokens."""
    m = _model_of(name)
    stem = name[:-len(".json")]
    graph = _load(os.path.join(API_DIR, name))
    c = _by_class(graph)
    assert not {"UNETLoader", "ParaDiTSampler", "DualCLIPLoader", "TripleCLIPLoader"} & set(c)
    (clip,), (vae,), (decode,), (create,), (save,) = (c[k] for k in ("CLIPLoader", "VAELoader", "VAEDecode",
                                                                      "CreateVideo", "SaveVideo"))
    assert clip["inputs"] == m.get("clip", WAN_CLIP) and vae["inputs"]["vae_name"] == m["vae"]
    # The samplers in denoising order: back from VAE Decode (VACE: through TrimVideoLatent, which cuts the reference
    # frames WanVaceToVideo put in front), each takes its predecessor's latent.
    chain, node = [], graph[decode["inputs"]["samples"][0]]
    trim = node if node["class_type"] == "TrimVideoLatent" else None
    if trim is not None:
        node = graph[trim["inputs"]["samples"][0]]
    while node["class_type"] in ("KSampler", "KSamplerAdvanced"):
        chain.insert(0, node)
        node = graph[node["inputs"]["latent_image"][0]]
    latent = node
    assert len(chain) == len(m["unets"]) == len(c.get("KSampler", [])) + len(c.get("KSamplerAdvanced", []))
    assert {s["class_type"] for s in chain} == {"KSampler" if len(chain) == 1 else "KSamplerAdvanced"}
    # The latent: the template's node and size, the model's VAE (channels, pixels per latent pixel), whole patches.
    latent_cls, width, height, length = m["latent"]
    li = latent["inputs"]
    assert latent["class_type"] == latent_cls and WAN_LATENTS[latent_cls] == WAN_VAES[m["vae"]]
    assert (li["width"], li["height"], li["length"], li["batch_size"]) == (width, height, length, 1)
    if "vae" in li:
        assert graph[li["vae"][0]] is vae
    assert (trim is not None) == (latent_cls == "WanVaceToVideo")
    if trim is not None:  # its amount: the reference frames WanVaceToVideo added (its 4th output)
        latent_id = chain[0]["inputs"]["latent_image"][0]
        assert trim["inputs"]["trim_amount"] == [latent_id, 3] and graph[latent_id] is latent
    stride = WAN_VAES[m["vae"]][1]
    frames, rows, cols = (length - 1) // 4 + 1, height // stride, width // stride
    assert rows * stride == height and cols * stride == width and rows % 2 == cols % 2 == 0, "Wan's 1x2x2 patches"
    # The prompts, straight or through WanImageToVideo with the picture.
    first = chain[0]["inputs"]
    if latent_cls == "WanImageToVideo":
        lid = first["latent_image"][0]
        assert first["latent_image"] == [lid, 2]
        assert all(s["inputs"]["positive"] == [lid, 0] and s["inputs"]["negative"] == [lid, 1] for s in chain)
        positive, negative = graph[li["positive"][0]], graph[li["negative"][0]]
        encode = graph[li["clip_vision_output"][0]]
        vision = graph[encode["inputs"]["clip_vision"][0]]
        assert encode["class_type"] == "CLIPVisionEncode" and vision["class_type"] == "CLIPVisionLoader"
        assert vision["inputs"]["clip_name"] == m["clip_vision"]
        assert encode["inputs"]["image"] == li["start_image"], "the first frame is the picture CLIP vision sees"
        picture = graph[li["start_image"][0]]
        assert picture["class_type"] == "LoadImage" and picture["inputs"]["image"] == "example.png"
    elif latent_cls == "WanVaceToVideo":  # the prompts through it; text to video: no control video, mask or reference
        lid = first["latent_image"][0]
        assert first["latent_image"] == [lid, 2] and first["positive"] == [lid, 0] and first["negative"] == [lid, 1]
        positive, negative = graph[li["positive"][0]], graph[li["negative"][0]]
        assert not {"control_video", "control_masks", "reference_image"} & set(li) and "LoadImage" not in c
        assert li["strength"] == 1.0
    elif latent_cls == "WanFunInpaintToVideo":  # the prompts through it, with the first and last frames (no CLIP vision)
        lid = first["latent_image"][0]
        assert first["latent_image"] == [lid, 2] and first["positive"] == [lid, 0] and first["negative"] == [lid, 1]
        positive, negative = graph[li["positive"][0]], graph[li["negative"][0]]
        assert "clip_vision" not in m and "CLIPVisionEncode" not in c and graph[li["vae"][0]] is vae
        for frame in ("start_image", "end_image"):
            picture = graph[li[frame][0]]
            assert picture["class_type"] == "LoadImage" and picture["inputs"]["image"] == "example.png"
    else:
        assert "clip_vision" not in m and "CLIPVisionEncode" not in c
        assert "start_image" not in li and "LoadImage" not in c  # text-to-video (5B: the template's picture bypassed)
        positive, negative = graph[first["positive"][0]], graph[first["negative"][0]]
        assert all(s["inputs"]["positive"] == first["positive"] and s["inputs"]["negative"] == first["negative"]
                   for s in chain)
    assert positive["class_type"] == negative["class_type"] == "CLIPTextEncode" and positive is not negative
    # The encoder, or the LoRA's CLIP over it (the template patches both with one LoraLoader).
    lora = graph[positive["inputs"]["clip"][0]] if m.get("lora") else None
    encoder = graph[lora["inputs"]["clip"][0]] if lora else graph[positive["inputs"]["clip"][0]]
    assert encoder is clip and negative["inputs"]["clip"] == positive["inputs"]["clip"]
    if lora:
        assert lora["class_type"] == "LoraLoader" and positive["inputs"]["clip"][1] == 1
        assert lora["inputs"]["lora_name"] == m["lora"][0]
        assert (lora["inputs"]["strength_model"], lora["inputs"]["strength_clip"]) == pytest.approx((m["lora"][1], 1.0))
    assert positive["inputs"]["text"].strip() and negative["inputs"]["text"].strip()
    # Each sampler: the template's settings, on ModelSamplingSD3 over a Load Parallel DiT of its expert's file.
    loaders = []
    for sampler, unet in zip(chain, m["unets"]):
        s = sampler["inputs"]
        assert {k: s[k] for k in m["sampling"]} == m["sampling"], "the template's sampling"
        assert s["cfg"] > 1 or m.get("lora"), "true CFG, but under a step-distillation LoRA (CausVid: cfg 1)"
        shift = graph[s["model"][0]]
        assert shift["class_type"] == "ModelSamplingSD3" and shift["inputs"]["shift"] == pytest.approx(m["shift"])
        loader = graph[shift["inputs"]["model"][0]]
        if m.get("lora"):  # the LoRA patches Load Parallel DiT's MODEL, as it patched UNETLoader's
            assert loader is lora and shift["inputs"]["model"][1] == 0
            loader = graph[lora["inputs"]["model"][0]]
        assert loader["class_type"] == "ParaDiTLoader" and loader["inputs"]["unet_name"] == unet
        strategy = graph[loader["inputs"]["strategy"][0]]
        assert strategy["class_type"] == "ParaDiTStrategy"
        loaders.append(loader)
        _check_fit(name, graph, loader, strategy, s, m["heads"], m["blocks"], latent_plane((frames, rows, cols)))
    assert len({l["inputs"]["devices"] for l in loaders}) == 1, "one device set serves every expert"
    if len(chain) == 1:
        assert first["denoise"] == 1.0
    else:  # two experts splitting one schedule
        ks = [s["inputs"] for s in chain]
        steps = m["sampling"]["steps"]
        ranges = [(k["start_at_step"], k["end_at_step"]) for k in ks]
        assert ranges[0] == (0, m["split"]) and ranges[-1][1] >= steps, ranges
        assert all(a < b for a, b in ranges) and all(r[1] == n[0] for r, n in zip(ranges, ranges[1:])), ranges
        assert [k["add_noise"] for k in ks] == ["enable"] + ["disable"] * (len(ks) - 1)
        assert [k["return_with_leftover_noise"] for k in ks] == ["enable"] * (len(ks) - 1) + ["disable"]
    # Decode, the video and its file.
    assert graph[decode["inputs"]["vae"][0]] is vae
    assert graph[create["inputs"]["images"][0]] is decode and create["inputs"]["fps"] == m["fps"]
    assert "audio" not in create["inputs"] and graph[save["inputs"]["video"][0]] is create
    assert save["inputs"] == {"video": save["inputs"]["video"], "filename_prefix": f"ParaDiT/{stem}",
                              "format": "auto", "codec": "auto"}


# ---------------------------------------------------------------------------------------------------
# The newer families' workflows against the ComfyUI templates they are built on (FAMILIES).

def _templates_dir():
    package = pytest.importorskip("comfyui_workflow_templates_json",
                                  reason="comfyui-workflow-templates-json is not installed (make venv installs it)")
    return os.path.join(os.path.dirname(package.__file__), "templates")


class _Scope:
    """One graph of a template: the top level, or a subgraph definition inlined through its `instance` node."""

    def __init__(self, graph, definitions, instance=None, parent=None, switches=None):
        self.definitions, self.instance, self.parent = definitions, instance, parent
        # switches our workflow sets otherwise than the template (by node id): the branch it runs instead
        self.switches = parent.switches if parent is not None else (switches or {})
        self.inputs = graph.get("inputs", [])  # a subgraph's own inputs (-10 slots)
        self.links = {}
        for l in graph["links"]:
            l = l if isinstance(l, list) else [l[k] for k in ("id", "origin_id", "origin_slot", "target_id",
                                                             "target_slot", "type")]
            self.links[l[0]] = l
        self.nodes = {n["id"]: n for n in graph["nodes"]}

    def link_into(self, node, name):
        """The link feeding `node`'s input `name`, or None."""
        for i in node.get("inputs", []):
            if i["name"] == name and i.get("link") is not None:
                return self.links[i["link"]]
        return None


# Template nodes that pass a value on: the input each one's output is. Switches pass the branch their switch picks.
_PASS_ON = {"QwenImage21Cache": "model", "PreviewAny": "source", "Reroute": ""}
_PRIMITIVES = {"PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "PrimitiveString", "PrimitiveStringMultiline"}


def _template_view(template, instances, switches=None):
    """{node id: (scope, node)} of a template with the named subgraph instances (and those nested in them) inlined;
    an instance not named stays a node. An inlined node keeps its id; a top-level node it shadows is under -id.
    `switches`: {switch node id: value} our workflow runs instead of the template's setting."""
    with open(os.path.join(_templates_dir(), template + ".json"), encoding="utf-8") as f:
        workflow = json.load(f)
    definitions = {d["id"]: d for d in workflow.get("definitions", {}).get("subgraphs", [])}
    found = []

    def walk(scope, top):
        for n in scope.nodes.values():
            if n["type"] in definitions and (not top or n["id"] in instances):
                walk(_Scope(definitions[n["type"]], definitions, n, scope), False)
            else:
                found.append((scope, n))

    top = _Scope(workflow, definitions, switches=switches)
    walk(top, True)
    view = {}
    for scope, n in sorted(found, key=lambda f: f[0] is top):  # inlined nodes first
        nid = n["id"]
        if nid in view:
            assert scope is top, f"{template}: node id {nid} twice among the inlined nodes"
            nid = -nid
        view[nid] = (scope, n)
    return view


def _origin(scope, link):
    """The (scope, node, slot) a link's value comes from, through subgraph boundaries, pass-on nodes, switches and
    bypassed nodes; (scope, None, k) for a subgraph input k that nothing outside feeds."""
    _, origin, slot = link[:3]
    if origin == -10:
        name = scope.inputs[slot]["name"]
        outer = scope.parent.link_into(scope.instance, name)
        return _origin(scope.parent, outer) if outer else (scope, None, slot)
    node = scope.nodes[origin]
    if node["type"] in scope.definitions:  # a nested subgraph's output
        inner = _Scope(scope.definitions[node["type"]], scope.definitions, node, scope)
        return _origin(inner, next(l for l in inner.links.values() if l[3] == -20 and l[4] == slot))
    if node["type"] == "ComfySwitchNode":
        on = scope.switches.get(node["id"], _value_of(scope, node, "switch"))
        return _origin(scope, scope.link_into(node, "on_true" if on else "on_false"))
    if node["type"] in _PASS_ON:
        return _origin(scope, scope.link_into(node, _PASS_ON[node["type"]]))
    if node.get("mode") == BYPASSED:  # the editor passes the input of the output's type on
        out_type = node["outputs"][slot]["type"]
        return _origin(scope, next(scope.links[i["link"]] for i in node["inputs"]
                                   if i["type"] == out_type and i.get("link") is not None))
    return scope, node, slot


def _value_of(scope, node, name, saved=None):
    """A widget's value as the template runs it: from what feeds the widget's input (a subgraph input the instance
    sets, a primitive, a switch, a string concatenation), else the value saved on the node (`saved`)."""
    link = scope.link_into(node, name)
    if link is None:
        return saved if saved is not None else node["widgets_values"][0]
    src_scope, src, slot = _origin(scope, link)
    if src is None:  # a subgraph input nothing feeds: the instance's own value for it, else the inner widget's
        value = _instance_value(src_scope, slot)
        return saved if value is None else value
    value = _produced(src_scope, src, slot)
    if value is None:  # fed by a node this check does not evaluate: the instance's value
        value = _instance_value(scope, next(k for k, i in enumerate(scope.inputs) if i["name"] == name)) \
            if link[1] == -10 else None
        value = saved if value is None else value
    return value


def _instance_value(scope, k):
    """The value subgraph instance `scope.instance` holds for its input k: by name where the editor saved names
    (a widget-less input, an image socket, has none), else by position where there is one value per input."""
    named = scope.instance.get("widgets_values_named")
    if isinstance(named, dict):
        return named.get(scope.inputs[k]["name"])
    values = scope.instance.get("widgets_values")
    return values[k] if isinstance(values, list) and len(values) == len(scope.inputs) else None


_MATH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
         ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MATH_FUNCTIONS = {"max": max, "min": min, "round": round, "abs": abs, "int": int, "float": float,
                   "floor": math.floor, "ceil": math.ceil, "sqrt": math.sqrt}


def _math_expression(text, names):
    """ComfyMathExpression's value (nodes_math.py: simpleeval over Python arithmetic), for the operators the
    templates use; anything else stops the check."""
    def value(n):
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            return names[n.id]
        if isinstance(n, ast.BinOp):
            return _MATH[type(n.op)](value(n.left), value(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -value(n.operand)
        if isinstance(n, ast.Call) and not n.keywords:
            return _MATH_FUNCTIONS[n.func.id](*map(value, n.args))
        raise AssertionError(f"math expression {text!r}: {ast.dump(n)} is not evaluated here")
    return value(ast.parse(text, mode="eval").body)


def _produced(scope, node, slot=0):
    """The value output `slot` of a value-making template node gives, or None for other nodes."""
    kind = node["type"]
    if kind in _PRIMITIVES:
        return _value_of(scope, node, "value", node["widgets_values"][0])
    if kind == "StringConcatenate":  # string_a, string_b, delimiter
        a, b, delimiter = node["widgets_values"]
        return _value_of(scope, node, "string_a", a) + delimiter + _value_of(scope, node, "string_b", b)
    if kind == "ComfyMathExpression":  # outputs FLOAT, INT, BOOL of one result
        names = {i["name"].split(".", 1)[1]: _value_of(scope, node, i["name"]) for i in node["inputs"]
                 if i["name"].startswith("values.") and i.get("link") is not None}
        result = _math_expression(_value_of(scope, node, "expression", node["widgets_values"][0]), names)
        return (float, int, bool)[slot](result)
    if kind == "ResolutionSelector":  # nodes_resolution.py: the aspect ratio's sides scaled to the megapixels
        aspect, megapixels, multiple = node["widgets_values"][:3]
        w_ratio, h_ratio = (int(v) for v in aspect.split(" ")[0].split(":"))
        scale = math.sqrt(megapixels * 1024 * 1024 / (w_ratio * h_ratio))
        sides = [round(r * scale / multiple) * multiple for r in (w_ratio, h_ratio)]
        assert min(sides) >= 256, "below the node's minimum side: it rescales (not evaluated here)"
        return sides[slot]
    return None


def _template_inputs(scope, node, cls):
    """The API inputs of a template node as the template runs it: widgets by name (a widget a value-making node
    feeds takes that value; one another node feeds is that link), sockets as (scope, node, slot). The values are
    read by name where the template saved names (a dynamic combo's widgets; the newest widgets of a class the
    template predates take their default), else by position."""
    widgets, sockets, _, _, _ = node_interface(cls)
    named = node.get("widgets_values_named")
    if isinstance(named, dict) and {w for w in widgets if (cls, w) not in OPTIONAL_WIDGET_DEFAULTS} <= set(named):
        saved = [(w, named[w]) for w in widgets if w in named]
        saved += [(f"{w}.{sub}", named[f"{w}.{sub}"]) for (c, w), choices in DYNAMIC_CORE.items() if c == cls
                  for sub in choices[named[w]]]
    else:
        saved = _saved_widgets(cls, node.get("widgets_values") or [])
    saved = dict(saved)
    inputs = {}
    for w, value in saved.items():
        link = scope.link_into(node, w)
        origin = _origin(scope, link) if link else None
        if origin is not None and origin[1] is not None and _produced(*origin) is None:
            inputs[w] = origin
        else:
            inputs[w] = _value_of(scope, node, w, value)
    for w in widgets:
        if w not in inputs and (cls, w) in OPTIONAL_WIDGET_DEFAULTS:
            inputs[w] = OPTIONAL_WIDGET_DEFAULTS[cls, w]
    for name in sockets:
        link = scope.link_into(node, name)
        inputs[name] = _origin(scope, link) if link else None
    return inputs


@pytest.mark.parametrize("name", FAMILY_API + AV_API)
def test_family_workflow_is_its_template_on_load_parallel_dit(name):
    """Node by node, our workflow is its ComfyUI template (subgraphs flattened, inner node ids kept) with the diffusion
    model's loader as Load Parallel DiT: the same classes under the same ids, every widget value the template runs
    with (what its subgraph inputs, primitives and switches set) but a fixed seed and our file prefix, and every
    link from the node the template's value comes from. The template's nodes we leave out are the table's, bypassed
    ones and notes."""
    m = _model_of(name)
    stem = name[:-len(".json")]
    view = _template_view(m["template"], m["instances"], m.get("switches"))
    ui = _load(os.path.join(WF_DIR, name))
    graph = _load(os.path.join(API_DIR, name))
    c = _by_class(graph)
    (loader,), (strategy,) = c["ParaDiTLoader"], c["ParaDiTStrategy"]
    loader_id = int(next(k for k, n in graph.items() if n is loader))
    scope, template_loader = view[m["loader"]]
    # Load Parallel DiT takes the loader's id, or (beside a checkpoint loader that stays for CLIP and VAE) a new one
    # that gives what the checkpoint's MODEL gave.
    file_widget = "ckpt_name" if template_loader["type"] == "CheckpointLoaderSimple" else "unet_name"
    assert (loader_id == m["loader"]) == (file_widget == "unet_name")
    assert loader["inputs"]["unet_name"] == _value_of(scope, template_loader, file_widget,
                                                      template_loader["widgets_values"][0]) == m["unet"]
    assert loader["inputs"]["weight_dtype"] == ("default" if file_widget == "ckpt_name"
                                                else template_loader["widgets_values"][1])

    def ours_of(src, slot):
        return loader_id if (src, slot) == (m["loader"], 0) else src

    added = {int(k) for k, n in graph.items() if n is strategy or n is loader}
    added |= {n["id"] for n in ui["nodes"] if n["type"] in UI_ONLY}
    for n in ui["nodes"]:
        if n["id"] in added:
            continue
        assert n["id"] in view, f"{name}: node {n['id']} ({n['type']}) is not in {m['template']}"
        scope, t = view[n["id"]]
        assert n["type"] == t["type"] or m.get("replaced", {}).get(n["id"]) == t["type"], (name, n["id"], t["type"])
        ours = graph[str(n["id"])]["inputs"]
        if n["type"] == t["type"]:
            expected = _template_inputs(scope, t, n["type"])
        else:  # another class in its place: the same links
            expected = {k: _origin(scope, scope.link_into(t, k)) for k, v in ours.items() if isinstance(v, list)}
        for key, value in ours.items():
            if key in ("seed", "noise_seed"):
                assert value == 42, "a fixed seed: runs that repeat"
            elif key == "filename_prefix":
                assert value == f"ParaDiT/{stem}"
            elif (n["type"], key) == ("LoadImage", "image"):
                assert value == "example.png", "ComfyUI ships input/example.png; the template's picture comes with it"
            elif isinstance(value, list):  # a link: from the node the template's input comes from
                _, src, slot = expected[key]
                assert [str(ours_of(src["id"], slot)), slot] == value, (name, n["id"], key)
            elif n["type"] == t["type"]:
                assert value == pytest.approx(expected[key]) if isinstance(value, float) else value == expected[key], \
                    (name, n["id"], key, value, expected[key])
        for key, origin in expected.items():  # what the template feeds that ours leaves unconnected
            if key not in ours and isinstance(origin, tuple) and origin[1] is not None:
                assert origin[1]["id"] in m["left_out"], (name, n["id"], key)
            elif key not in ours and not isinstance(origin, tuple) and origin is not None:  # a widget ours predates
                assert OPTIONAL_WIDGET_DEFAULTS[n["type"], key] == origin, (name, n["id"], key)
    ours_ids = {n["id"] for n in ui["nodes"]} | {m["loader"]}
    missing = {tid for tid, (_, t) in view.items() if tid not in ours_ids and t["type"] not in UI_ONLY
               and t.get("mode") != BYPASSED}
    assert missing == m["left_out"], (name, missing ^ m["left_out"])


@pytest.mark.parametrize("name", FAMILY_API)
def test_family_workflow_loads_its_model_and_its_strategy_fits(name):
    """The table's files, encoder, VAE, latent node and size, sampling, shift and guidance; the prompts on the
    sampler (two of them under true CFG); the strategy fits its devices, the model's heads and blocks and the
    image's (or video's) tokens, and a cfg-1 model never splits CFG."""
    m = _model_of(name)
    graph = _load(os.path.join(API_DIR, name))
    c = _by_class(graph)
    assert not {"UNETLoader", "ParaDiTSampler"} & set(c)
    (loader,), (strategy,), (decode,) = c["ParaDiTLoader"], c["ParaDiTStrategy"], c["VAEDecode"]
    assert loader["inputs"]["unet_name"] == m["unet"] and graph[loader["inputs"]["strategy"][0]] is strategy
    clip_cls, clip_inputs = m["clip"]
    (clip,) = c[clip_cls]
    assert clip["inputs"] == clip_inputs
    vae = graph[decode["inputs"]["vae"][0]]
    assert vae["inputs"] == ({"vae_name": m["vae"]} if m["vae"] else clip["inputs"])  # a checkpoint's own VAE
    sampler = graph[decode["inputs"]["samples"][0]]
    s = sampler["inputs"]
    if sampler["class_type"] == "KSampler":
        settings = {k: s[k] for k in ("steps", "cfg", "sampler_name", "scheduler")}
        model, positive, negative, latent = s["model"], s["positive"], s["negative"], s["latent_image"]
        assert s["denoise"] == 1.0
    elif sampler["class_type"] == "SamplerCustom":  # its own cfg and prompts, a sampler and sigmas
        sigmas = graph[s["sigmas"][0]]
        settings = {"steps": sigmas["inputs"]["steps"], "cfg": s["cfg"], "scheduler": sigmas["inputs"]["scheduler"],
                    "sampler_name": graph[s["sampler"][0]]["inputs"]["sampler_name"]}
        assert sigmas["class_type"] == "BasicScheduler" and sigmas["inputs"]["denoise"] == 1.0 and s["add_noise"]
        model, positive, negative, latent = s["model"], s["positive"], s["negative"], s["latent_image"]
    else:  # SamplerCustomAdvanced: noise, guider, sampler, sigmas
        assert sampler["class_type"] == "SamplerCustomAdvanced"
        guider, sigmas = graph[s["guider"][0]], graph[s["sigmas"][0]]
        g = guider["inputs"]
        settings = {"steps": sigmas["inputs"]["steps"], "cfg": g.get("cfg", 1.0),
                    "sampler_name": graph[s["sampler"][0]]["inputs"]["sampler_name"]}
        if sigmas["class_type"] == "BasicScheduler":
            settings["scheduler"] = sigmas["inputs"]["scheduler"]
            assert sigmas["inputs"]["denoise"] == 1.0
        else:  # Flux2Scheduler shapes its schedule for the image's size
            assert sigmas["class_type"] == "Flux2Scheduler"
            assert (sigmas["inputs"]["width"], sigmas["inputs"]["height"]) == m["latent"][1:3]
        assert graph[s["noise"][0]]["class_type"] == "RandomNoise"
        model, latent = g["model"], s["latent_image"]
        positive, negative = g.get("positive", g.get("conditioning")), g.get("negative")
        assert (guider["class_type"] == "BasicGuider") == (negative is None)
    assert settings == m["sampling"], (settings, m["sampling"])
    # The latent: the template's node and size.
    latent_node = graph[latent[0]]
    latent_cls, width, height, *frames = m["latent"]
    li = latent_node["inputs"]
    assert latent_node["class_type"] == latent_cls and (li["width"], li["height"], li["batch_size"]) == (width, height, 1)
    assert li.get("length") == (frames[0] if frames else None)
    # The MODEL: the model patches over Load Parallel DiT (a shift node, or the table's), or Load Parallel DiT itself.
    shift = graph[model[0]]
    for patch, inputs in m.get("patches", ()):
        assert shift["class_type"] == patch and {k: v for k, v in shift["inputs"].items() if k != "model"} == inputs
        shift = graph[shift["inputs"]["model"][0]]
    if m["shift"]:
        assert shift["class_type"] == m["shift"][0] and shift["inputs"]["shift"] == pytest.approx(m["shift"][1])
        shift = graph[shift["inputs"]["model"][0]]
    assert shift is loader
    # The prompts.
    positive = graph[positive[0]]
    if m.get("guidance"):
        assert positive["class_type"] == "FluxGuidance" and positive["inputs"]["guidance"] == m["guidance"]
        positive = graph[positive["inputs"]["conditioning"][0]]
    assert positive["class_type"] in ("CLIPTextEncode", "TextEncodeQwenImage21")
    assert graph[positive["inputs"]["clip"][0]] is clip
    assert (positive["inputs"].get("text") or positive["inputs"].get("prompt")).strip()
    cfg = settings["cfg"]
    if negative is not None:
        negative_node = graph[negative[0]]
        if cfg == 1:  # distilled: the negative is never evaluated (ComfyUI skips it at cfg 1)
            assert negative_node["class_type"] in ("ConditioningZeroOut", "TextEncodeQwenImage21")
        else:
            assert negative_node["class_type"] == "CLIPTextEncode" and negative_node is not positive
    # The strategy: the latent in 8 px units as validate_strategy's 2x2 patches count them (16 px tokens; HiDream O1's
    # 32 px ones count as a 2x2 patch of 16 px).
    px = m.get("token_px", 16) // 2
    latent_8px = ((frames[0] - 1) // 4 + 1, height // px, width // px) if frames else (height // px, width // px)
    st = strategy["inputs"]
    assert st["mode"] == "manual" and (cfg > 1 or st["cfg_degree"] == 1), "cfg 1 has no second branch to split"
    fit = {"cfg": cfg, "steps": settings["steps"], "negative": negative}
    _check_fit(name, graph, loader, strategy, fit, m["heads"], m["blocks"], latent_plane(latent_8px),
               empty_negative=True)
    # The output: Save Image, or Create Video -> Save Video for a video.
    if frames:
        (create,), (save,) = c["CreateVideo"], c["SaveVideo"]
        assert graph[create["inputs"]["images"][0]] is decode and create["inputs"]["fps"] == m["fps"]
        assert graph[save["inputs"]["video"][0]] is create
        assert (save["inputs"]["format"], save["inputs"]["codec"]) == ("auto", m["codec"])
    else:
        (save,) = c["SaveImage"]
        assert graph[save["inputs"]["images"][0]] is decode
    assert save["inputs"]["filename_prefix"] == f"ParaDiT/{name[:-len('.json')]}"


def _side_of(graph, value):
    """An LTX latent's width or height: the widget's value, or the side Get Image Size reads off a picture that
    Resize Image/Mask scaled to its "scale dimensions" (both sides set: exactly that size)."""
    if not isinstance(value, list):
        return value
    size = graph[value[0]]
    assert size["class_type"] == "GetImageSize" and value[1] in (0, 1)
    resize = graph[size["inputs"]["image"][0]]
    r = resize["inputs"]
    assert resize["class_type"] == "ResizeImageMaskNode" and r["resize_type"] == "scale dimensions"
    assert r["resize_type.width"] > 0 and r["resize_type.height"] > 0
    return r[("resize_type.width", "resize_type.height")[value[1]]]


@pytest.mark.parametrize("name", AV_API)
def test_av_workflow_loads_its_model_and_its_strategy_fits(name):
    """The audio-video workflows: every sampler's guider on Load Parallel DiT's MODEL (LTX-2.3 dev: through the
    distilled LoRA), the table's steps and video tokens per stage (picture guides included), one call per step (cfg 1
    or BasicGuider: no CFG split), the audio latent made for the video's frames and rate, the pictures as first frame
    or as guides taken off before decoding, and the decoded video with its sound saved under our prefix. The strategy
    fits its devices, the model's heads and blocks and every stage's tokens."""
    m = _model_of(name)
    graph = _load(os.path.join(API_DIR, name))
    c = _by_class(graph)
    assert not {"UNETLoader", "ParaDiTSampler", "KSampler"} & set(c)
    (loader,), (strategy,) = c["ParaDiTLoader"], c["ParaDiTStrategy"]
    assert loader["inputs"]["unet_name"] == m["unet"] and graph[loader["inputs"]["strategy"][0]] is strategy
    (create,), (save,) = c["CreateVideo"], c["SaveVideo"]
    assert graph[save["inputs"]["video"][0]] is create and save["inputs"]["filename_prefix"] == f"ParaDiT/{name[:-5]}"
    assert create["inputs"]["fps"] == m["fps"]
    # The samplers in denoising order: back from the decoded video, each takes its predecessor's latent.
    decode = graph[create["inputs"]["images"][0]]
    audio_decode = graph[create["inputs"]["audio"][0]]
    upstream = {"SamplerCustomAdvanced": "latent_image", "LTXVSeparateAVLatent": "av_latent",  # video first
                "LTXVConcatAVLatent": "video_latent", "LTXVImgToVideoInplace": "latent", "LTXVLatentUpsampler": "samples",
                "LTXVCropGuides": "latent", "LTXVAddGuide": "latent"}
    chain, node = [], graph[decode["inputs"]["samples"][0]]
    while node["class_type"] in upstream:
        if node["class_type"] == "SamplerCustomAdvanced":
            chain.insert(0, node)
        node = graph[node["inputs"][upstream[node["class_type"]]][0]]
    steps = []
    for sampler in chain:
        sigmas = graph[sampler["inputs"]["sigmas"][0]]["inputs"]
        steps.append(sigmas["steps"] if "steps" in sigmas else len(sigmas["sigmas"].split(",")) - 1)
        guider = graph[sampler["inputs"]["guider"][0]]
        assert guider["class_type"] in ("CFGGuider", "BasicGuider") and guider["inputs"].get("cfg", 1) == 1
        model = graph[guider["inputs"]["model"][0]]
        if "lora" in m:  # the distilled LoRA on Load Parallel DiT's MODEL
            assert model["class_type"] == "LoraLoaderModelOnly"
            assert (model["inputs"]["lora_name"], model["inputs"]["strength_model"]) == m["lora"]
            model = graph[model["inputs"]["model"][0]]
        assert model is loader
    assert steps == [k for k, _ in m["stages"]], steps
    # The video: its latent node and size, frames on the model's grid, and the audio for those frames.
    latent_cls, width, height = m["latent"]
    (video,) = c[latent_cls]
    assert node is video, "the first stage denoises the template's latent"
    v = video["inputs"]
    assert (_side_of(graph, v["width"]), _side_of(graph, v["height"]), v["length"]) == (width, height, m["length"])
    if latent_cls == "EmptyLTXVLatentVideo":  # 32x / 8x: the first stage's tokens; the upsampler doubles the sides
        # one file: Load Parallel DiT's DiT, the checkpoint's video VAE, the audio VAE, the text projection
        (checkpoint,), (text,), (audio_vae,) = (c[k] for k in ("CheckpointLoaderSimple", "LTXAVTextEncoderLoader",
                                                                "LTXVAudioVAELoader"))
        assert checkpoint["inputs"]["ckpt_name"] == audio_vae["inputs"]["ckpt_name"] == m["unet"]
        assert text["inputs"] == {"text_encoder": m["text_encoder"], "ckpt_name": m["unet"], "device": "default"}
        assert decode["inputs"]["vae"] == [next(k for k, n in graph.items() if n is checkpoint), 2]
        frames = (m["length"] - 1) // 8 + 1
        guides = c.get("LTXVAddGuide", [])  # each picture guide: one latent frame after the video's, sampled with it
        assert m["stages"][0][1] == (frames + len(guides), height // 32, width // 32) and len(chain) == len(m["stages"])
        if len(chain) == 2:  # the x2 latent upsampler doubles the sides
            assert m["stages"][1][1] == (frames, 2 * (height // 32), 2 * (width // 32))
        (audio,), (conditioning,) = c["LTXVEmptyLatentAudio"], c["LTXVConditioning"]
        a = audio["inputs"]
        assert (a["frames_number"], a["frame_rate"], a["batch_size"]) == (m["length"], m["fps"], 1)
        assert conditioning["inputs"]["frame_rate"] == m["fps"]
        assert audio_decode["class_type"] == "LTXVAudioVAEDecode"
        assert graph[audio_decode["inputs"]["audio_vae"][0]] is graph[a["audio_vae"][0]]
        pictures = c.get("LoadImage", [])
        assert [p["inputs"]["image"] for p in pictures] == [f for f in (m["first_frame"], m.get("last_frame")) if f]
        if "guides" in m:  # first-last-frame: each picture a guide the sampler's conditioning carries, then cropped off
            assert "LTXVImgToVideoInplace" not in c
            assert sorted((g["inputs"]["frame_idx"], g["inputs"]["strength"]) for g in guides) == sorted(m["guides"])
            loaded = set()
            for g in guides:  # LTXV Preprocess <- Resize Image/Mask <- its own Load Image
                resize = graph[graph[g["inputs"]["image"][0]]["inputs"]["image"][0]]
                assert graph[resize["inputs"]["input"][0]]["class_type"] == "LoadImage"
                loaded.add(resize["inputs"]["input"][0])
            assert len(loaded) == len(pictures) == len(guides)
            positive = graph[chain[0]["inputs"]["guider"][0]]["inputs"]["positive"]
            cond, chained = graph[positive[0]], 0
            while cond["class_type"] == "LTXVAddGuide":
                cond, chained = graph[cond["inputs"]["positive"][0]], chained + 1
            assert chained == len(guides) and cond["class_type"] == "LTXVConditioning"
            crop = graph[decode["inputs"]["samples"][0]]
            assert crop["class_type"] == "LTXVCropGuides" and crop["inputs"]["positive"] == positive
        else:  # the picture (or, bypassed, none) as the first frame at both stages
            frame = [n for n in c["LTXVImgToVideoInplace"]]
            assert len(frame) == 2 and all(f["inputs"]["bypass"] == (m["first_frame"] is None) for f in frame)
    else:  # MiniMax-H3: 16x latent in 1x2x2 patches; 17k+5 frames, five latent frames per 17 after the second
        assert m["length"] % 17 == 5 and "first_frame" not in v and "last_frame" not in v
        frames = (m["length"] - 5) // 17 * 5 + 2
        assert m["stages"][0][1] == (frames, height // 32, width // 32) and len(chain) == 1
        assert audio_decode["class_type"] == "VAEDecodeAudio" and graph[chain[0]["inputs"]["latent_image"][0]] is video
    # The strategy, at every stage: tokens as validate_strategy's 2x2 patches of 8 px latent pixels count them.
    st = strategy["inputs"]
    assert st["mode"] == "manual" and st["cfg_degree"] == 1, "one model call a step: no second branch to split"
    for (k, tokens), sampler in zip(m["stages"], chain):
        rows, cols = latent_plane(tokens)
        _check_fit(name, graph, loader, strategy, {"cfg": 1.0, "steps": k, "negative": None}, m["heads"],
                   m["blocks"], (2 * rows, 2 * cols))


# ---------------------------------------------------------------------------------------------------
# scripts/queue_workflow.py without a server.

qw = load_queue_script()


@pytest.mark.parametrize("name", api_files())
def test_script_loads_every_api_workflow_and_refuses_ui_ones(name):
    assert qw.load_workflow(os.path.join(API_DIR, name)) == _load(os.path.join(API_DIR, name))
    with pytest.raises(qw.WorkflowError, match="UI-format"):
        qw.load_workflow(os.path.join(WF_DIR, name))


def test_script_overrides():
    graph = _load(os.path.join(API_DIR, "flux_dev_ulysses.json"))
    out = qw.apply_overrides(graph, ["ParaDiTSampler.seed=7", "Load Parallel DiT.devices=cpu:2", "7.width=512",
                                     'ParaDiTSampler.cfg=2.5', 'Strategy Selector.mode="auto"'])
    by = {n["class_type"]: n["inputs"] for n in out.values()}
    assert by["ParaDiTSampler"]["seed"] == 7 and by["ParaDiTSampler"]["cfg"] == 2.5
    assert by["ParaDiTLoader"]["devices"] == "cpu:2" and by["ParaDiTStrategy"]["mode"] == "auto"
    assert out["7"]["inputs"]["width"] == 512
    assert graph["7"]["inputs"]["width"] == 1024, "the loaded graph is left as it was"
    for bad, text in [("ParaDiTSampler.seed", "NODE.INPUT=VALUE"), ("Nope.seed=1", "no node with that id"),
                      ("ParaDiTSampler.sed=1", "has no input 'sed'")]:
        with pytest.raises(qw.WorkflowError, match=text):
            qw.apply_overrides(graph, [bad])
    two_prompts = _load(os.path.join(API_DIR, "flux_dev_cfg_parallel.json"))
    with pytest.raises(qw.WorkflowError, match="matches nodes 4, 6"):
        qw.apply_overrides(two_prompts, ["CLIPTextEncode.text=x"])
    assert qw.base_url("127.0.0.1:8188") == "http://127.0.0.1:8188"
    assert qw.base_url("https://host:1/") == "https://host:1"
    assert qw.parse_value("0,1") == "0,1" and qw.parse_value("[\"4\", 0]") == ["4", 0]


def test_output_files_lists_every_file_entry():
    outputs = {"9": {"images": [{"filename": "a.png", "subfolder": "x", "type": "output"}]},
               "13": {"latents": [{"filename": "b.latent", "subfolder": "latents", "type": "output"}],
                      "text": ["not a file"]}}
    assert [(f["node"], f["kind"], f["filename"]) for f in qw.output_files(outputs)] == [
        ("9", "images", "a.png"), ("13", "latents", "b.latent")]


def _frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([n])
    elif n < 1 << 16:
        head += bytes([126]) + struct.pack(">H", n)
    else:
        head += bytes([127]) + struct.pack(">Q", n)
    return head + payload


def test_websocket_client_against_a_local_server():
    """Handshake, text/binary/fragmented/large frames, ping -> pong, masked client frames, close."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    seen = {}

    def serve():
        conn, _ = srv.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            request = data.decode()
            seen["path"] = request.split(" ")[1]
            key = [l.split(":", 1)[1].strip() for l in request.split("\r\n") if l.lower().startswith("sec-websocket-key")][0]
            accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
                         + _frame(1, b'{"type": "status"}')  # arrives with the handshake's last packet
                         + _frame(9, b"hi")
                         + _frame(1, b'{"type": "prog', fin=False) + _frame(0, b'ress"}')
                         + _frame(2, struct.pack(">I", 3) + struct.pack(">I", 1) + b"8hello")
                         + _frame(1, json.dumps({"type": "big", "data": "x" * 70000}).encode()))
            # read the client's pong (masked)
            b0, b1 = conn.recv(2)
            mask = conn.recv(4)
            payload = bytes(c ^ mask[i % 4] for i, c in enumerate(conn.recv(b1 & 0x7F)))
            seen["pong"] = (b0 & 0x0F, bool(b1 & 0x80), payload)
            conn.sendall(_frame(8, struct.pack(">H", 1000)))
            conn.recv(64)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ws = qw.WebSocket(f"ws://127.0.0.1:{port}/ws?clientId=abc", timeout=10)
    try:
        assert ws.recv(5) == (1, b'{"type": "status"}')
        assert ws.recv(5) == (1, b'{"type": "progress"}')
        opcode, payload = ws.recv(5)
        assert opcode == 2 and payload.endswith(b"8hello")
        opcode, payload = ws.recv(5)
        assert opcode == 1 and len(json.loads(payload)["data"]) == 70000
        with pytest.raises(qw.WebSocketClosed):
            ws.recv(5)
    finally:
        ws.close()
        thread.join(10)
        srv.close()
    assert seen["path"] == "/ws?clientId=abc"
    assert seen["pong"] == (0xA, True, b"hi")
