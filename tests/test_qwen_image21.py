"""Qwen-Image 2.1 on the workers: detection (and the look-alikes it must not take), the serial model against
diffusers' QwenImage21Transformer2DModel on the same file, the strategies, the file kinds users download and LoRAs.

The reference is diffusers' own model (pinned 0.42) fed as its pipeline feeds it: packed latents, the reference
image's tokens before the image's, `img_mask` marking each image's 2x2 slots after the prompt, the whole joint
sequence out, of which the image's rows are the prediction. Where this runtime follows ComfyUI instead (float64
RoPE angles, t rounded through the compute dtype, a reference of another parity half a token off) the two agree to
fp32 round-off here: the reference image has the image's parity and everything runs in fp32.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import check_denoise_loop, rel_err
from parallel_runtime.errors import ModelFileError
from parallel_runtime.models.families.qwen_image21 import QWEN_IMAGE21_LATENT, QwenImage21Config
from parallel_runtime.models.registry import detect_family
from parallel_runtime.models.tiny import write_checkpoint
from parallel_runtime.spec import Conditioning, Job, ModelSpec, SamplingSpec
from parallel_runtime.spec import StrategySpec as S
from parallel_runtime.validate import model_config

pytestmark = pytest.mark.timeout(600)

# 4 heads of 32 (RoPE axes 4, 14, 14), 3 blocks, the release's 64 latent channels, a 32-wide prompt (4096).
TINY = QwenImage21Config(hidden_size=128, num_heads=4, head_dim=32, num_layers=3, context_dim=32)
H, W = 8, 6  # latent pixels = tokens: 48 image tokens (4 PipeFusion rows of 2x2 patches each, as validation counts)
REF = (4, 6)  # a reference latent of the image's parity (diffusers' RoPE has no half-token offsets)
REF2 = (2, 4)  # a second one, placed by image slots
# One fp32 forward in another op order than diffusers: ~1e-6; exact strategies reorder sums (~1e-7 per op).
SERIAL_RTOL, EXACT_RTOL = 1e-5, 1e-4
# A quantized file and its fp32 twin hold the same numbers: equal up to BLAS blocking of equal operands.
STORAGE_RTOL = 1e-5


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """(ComfyUI's fused layout under model.diffusion_model., diffusers' split layout under transformer.) of one
    model: the same numbers."""
    folder = tmp_path_factory.mktemp("qwen_image21")
    return (write_checkpoint(str(folder / "qwen_image_2.1_tiny.safetensors"), TINY, seed=1,
                             prefix="model.diffusion_model."),
            write_checkpoint(str(folder / "qwen_image_2.1_tiny_diffusers.safetensors"), TINY, seed=1,
                             layout="diffusers", prefix="transformer."))


def conditioning(seed: int, tokens: int = 9, reference: bool = False, slots: tuple[int, ...] = ()) -> Conditioning:
    """A prompt of `tokens` rows; with `reference` a reference image, and with `slots` a second, smaller one too,
    placed inside the prompt at those rows (TextEncodeQwenImage21's image slots)."""
    g = torch.Generator().manual_seed(seed)
    refs = (torch.randn(1, TINY.out_channels, *REF, generator=g) * 3,) if reference else ()
    if slots:
        refs += (torch.randn(1, TINY.out_channels, *REF2, generator=g) * 3,)
    return Conditioning(torch.randn(1, tokens, TINY.context_dim, generator=g), torch.zeros(1, 0), references=refs,
                        reference_slots=slots)


def call_job(path: str, strategy: S, reference: bool = False, slots: tuple[int, ...] = ()) -> Job:
    """One model call at t = 0.87: a 9-token prompt (with a reference image where asked, and two placed inside the
    prompt by `slots`) and an 11-token negative without one, so the branches run as separate forward passes, as
    ComfyUI runs them."""
    g = torch.Generator().manual_seed(3)
    return Job(ModelSpec(path), strategy, SamplingSpec(steps=1), torch.randn(2, TINY.out_channels, H, W, generator=g),
               conditioning(1, reference=reference or bool(slots), slots=slots), conditioning(2, tokens=11),
               timestep=torch.full((2,), 0.87))


@torch.no_grad()
def diffusers_call(diffusers_path: str, job: Job) -> torch.Tensor:
    """diffusers' QwenImage21Transformer2DModel on each branch's row, loaded from the diffusers-layout twin."""
    from diffusers import QwenImage21Transformer2DModel

    model = QwenImage21Transformer2DModel(**TINY.diffusers_kwargs()).eval()
    state = {k.removeprefix("transformer."): v for k, v in load_file(diffusers_path).items()}
    model.load_state_dict(state, strict=True)
    out = []
    for row, branch in enumerate(b for b in (job.positive, job.negative) if b is not None):
        refs = [QWEN_IMAGE21_LATENT.process_in(r) for r in branch.references]
        images = refs + [job.latent[row:row + 1]]
        tokens = torch.cat([im.flatten(2).transpose(1, 2) for im in images], dim=1)
        # The encoder's sequence holds a placeholder row per 2x2 latent tokens of each reference (the pipeline's vision
        # tokens), where the prompt's image slot puts it (after the prompt without one); the image's follow.
        length = branch.cond.shape[1]
        at = (list(branch.reference_slots) + [length] * len(refs))[:len(refs)]
        pieces, slots, start = [], [], 0
        for slot, r in zip(at, refs):
            placeholders = r.shape[-2] * r.shape[-1] // 4
            pieces += [branch.cond[:, start:slot], branch.cond.new_zeros(1, placeholders, TINY.context_dim)]
            slots += [False] * (slot - start) + [True] * placeholders
            start = slot
        pieces.append(branch.cond[:, start:])
        slots += [False] * (length - start) + [True] * (H * W // 4)
        prompt = torch.cat(pieces, dim=1)
        result = model(tokens, prompt, job.timestep[row:row + 1], img_shapes=[[(1, *im.shape[-2:])
                                                                                    for im in images]],
                       img_mask=torch.tensor([slots])).sample
        out.append(result[:, -H * W:].transpose(1, 2).reshape(1, TINY.out_channels, H, W))
    return torch.cat(out)


# -- detection ------------------------------------------------------------------------------------------


def test_qwen_image21_files_are_detected_and_look_alikes_are_not(paths, tmp_path):
    from parallel_runtime.models.families.qwen_image import QwenImageConfig
    from parallel_runtime.weights.checkpoint import open_checkpoint

    comfy, diffusers = paths
    for path, layout, prefix in ((comfy, "comfy", "model.diffusion_model."), (diffusers, "diffusers", "transformer.")):
        with open_checkpoint(path) as reader:
            family, match = detect_family(reader.keys())
        assert (family.name, match.layout, match.prefix) == ("qwen_image21", layout, prefix)
        assert model_config(path) == TINY
    assert (TINY.mlp_hidden, TINY.num_blocks, TINY.latent_channels, TINY.axes_dims_rope) == (384, 3, 64, (4, 14, 14))
    # A Qwen-Image (1.x) file stays Qwen-Image: 2.1 is claimed by its own signature, not by shared names.
    qwen = write_checkpoint(str(tmp_path / "qwen_image.safetensors"),
                            QwenImageConfig(hidden_size=128, num_heads=4, head_dim=32, num_layers=1, context_dim=32))
    assert detect_family(load_file(qwen).keys())[0].name == "qwen_image"
    # A 2.1 file that lost its shared modulation is neither family: refused in one sentence naming the families.
    keys = [k for k in load_file(comfy) if not k.endswith("modulation.1.weight")]
    with pytest.raises(ModelFileError, match="is not a DiT checkpoint ParaDiT runs.*Qwen-Image 2.1"):
        detect_family(keys, "broken.safetensors")
    # A damaged MLP width is refused before any work, naming the fix.
    state = load_file(comfy)
    state["model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight"] = torch.zeros(2 * 200, 128)
    damaged = str(tmp_path / "damaged.safetensors")
    save_file(state, damaged)
    with pytest.raises(ModelFileError, match="no Qwen-Image 2.1 shape; the file is damaged, so re-download it"):
        model_config(damaged)


def test_block_causal_mask_follows_comfyui_order():
    """Prompt causal, a reference sees the prompt and itself, the image sees everything; prompt and references never
    see the image (canonical order [prompt 3, image 2, reference 2])."""
    from parallel_runtime.models.families.qwen_image21 import sequence_mask

    allowed = sequence_mask(3, 2, (2,)).int()
    assert allowed.tolist() == [[1, 0, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0, 0],
                                [1, 1, 1, 0, 0, 0, 0],
                                [1, 1, 1, 1, 1, 1, 1],
                                [1, 1, 1, 1, 1, 1, 1],
                                [1, 1, 1, 0, 0, 1, 1],
                                [1, 1, 1, 0, 0, 1, 1]]


# -- the model and the strategies -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", [0, 1], ids=["comfy_fused", "diffusers_split"])
def test_qwen_image21_one_worker_equals_diffusers(paths, client1, layout):
    job = call_job(paths[layout], S(), reference=True)
    out = client1.run(job).latent
    assert out.shape == (2, TINY.out_channels, H, W)
    err = rel_err(out, diffusers_call(paths[1], job))
    print(f"\nQwen-Image 2.1 serial ({['comfy', 'diffusers'][layout]} layout) rel. error vs diffusers {err:.2e}")
    assert err < SERIAL_RTOL


@pytest.mark.parametrize("strategy", [S(cfg_degree=2), S(ulysses_degree=2), S(ring_degree=2),
                                      S(pipefusion_degree=2, num_pipeline_patch=2)],
                         ids=["cfg2", "ulysses2", "ring2", "pp2_warmup"])
def test_qwen_image21_exact_strategies_equal_diffusers(paths, client2, strategy):
    """With a reference image: the block-causal mask is cut per shard, ring block and stale buffer."""
    job = call_job(paths[0], strategy, reference=True)
    err = rel_err(client2.run(job).latent, diffusers_call(paths[1], job))
    print(f"\nQwen-Image 2.1 {strategy} rel. error vs diffusers {err:.2e}")
    assert err < EXACT_RTOL


def test_image_slots_place_references_inside_the_prompt_as_comfyui_does():
    """ComfyUI's build_sequence with image slots: [prompt rows 0-1, reference (2 tokens), prompt row 2, reference
    (1 token), image (2 tokens)]. In the canonical order [prompt 3, image 2, references 2 + 1] the mask lets a prompt
    row see earlier rows and the references before it, a reference the rows before it and itself, the image all;
    RoPE frames run on through each reference's longer side."""
    from parallel_runtime.models.families.qwen_image21 import sequence_ids, sequence_mask

    allowed = sequence_mask(3, 2, (2, 1), slots=(2, 3)).int()
    assert allowed.tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0, 0, 0],
                                [1, 1, 1, 0, 0, 1, 1, 0],
                                [1, 1, 1, 1, 1, 1, 1, 1],
                                [1, 1, 1, 1, 1, 1, 1, 1],
                                [1, 1, 0, 0, 0, 1, 1, 0],
                                [1, 1, 0, 0, 0, 1, 1, 0],
                                [1, 1, 1, 0, 0, 1, 1, 1]]
    ids = sequence_ids(3, 1, 2, ((1, 2), (1, 1)), slots=(2, 3))
    frames = ids[:, 0].tolist()  # prompt 0, 1, then the 1x2 reference at 2 (+2), prompt row 2 at 4, the 1x1 at 5
    assert frames == [0, 1, 4, 6, 6, 2, 2, 5]  # ... and the 1x2 image at 6
    assert torch.equal(sequence_mask(3, 2, (2,)), sequence_mask(3, 2, (2,), slots=(3,)))  # a slot at the end


@pytest.mark.parametrize("strategy", [S(), S(ulysses_degree=2), S(ring_degree=2), S(tensor_degree=2)],
                         ids=["serial", "ulysses2", "ring2", "tensor2"])
def test_qwen_image21_image_slots_equal_diffusers(paths, client1, client2, strategy):
    """Two references placed inside a 9-row prompt (before rows 3 and 6, as TextEncodeQwenImage21 marks them):
    diffusers' model with each reference's placeholder rows at its slot (img_mask) is the reference; the same job
    with the references after the prompt is not (so the slots are read)."""
    job = call_job(paths[0], strategy, slots=(3, 6))
    want = diffusers_call(paths[1], job)
    out = (client1 if strategy.world_size == 1 else client2).run(job).latent
    err = rel_err(out, want)
    print(f"\nQwen-Image 2.1 image slots, {strategy.label()}: rel. error vs diffusers {err:.2e}")
    assert err < (SERIAL_RTOL if strategy.world_size == 1 else EXACT_RTOL)
    if strategy.world_size == 1:
        after = call_job(paths[0], strategy, slots=(9, 9))  # both after the prompt
        assert rel_err(client1.run(after).latent, want) > 1e-3


@pytest.mark.parametrize("strategy", [S(ulysses_degree=2, ring_degree=2), S(cfg_degree=2, ulysses_degree=2)],
                         ids=["ulysses2xring2", "cfg2xulysses2"])
def test_qwen_image21_hybrids_on_four(paths, client4, strategy):
    job = call_job(paths[0], strategy, reference=True)
    err = rel_err(client4.run(job).latent, diffusers_call(paths[1], job))
    print(f"\nQwen-Image 2.1 {strategy} rel. error vs diffusers {err:.2e}")
    assert err < EXACT_RTOL


def test_qwen_image21_denoise_loop_strategies_equal_serial_and_pipefusion_beats_naive_patch(paths, client1,
                                                                                          client2):
    """A whole 6-step run at cfg 4 (Parallel Sampler's path): exact strategies equal serial; PipeFusion after one
    warm-up step reads stale K/V of the image (the prompt's own rows are fresh: they never see the image) and lands
    nearer serial than naive patch parallelism, which never sees the other half of the image."""
    job = Job(ModelSpec(paths[0]), S(), SamplingSpec(steps=6, cfg=4.0, seed=1), torch.zeros(1, TINY.out_channels, H, W),
              conditioning(1), conditioning(2))  # one length: the denoise loop's PipeFusion pipelines both prompts
    check_denoise_loop(job, client1, client2, "Qwen-Image 2.1", EXACT_RTOL)


# -- file kinds and LoRAs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def storage_twins(tmp_path_factory):
    """(kind, quantized file, fp32 twin): ComfyUI's int8 ConvRot (the qwen_image_2.1_int8_convrot release's kind),
    scaled fp8, GGUF."""
    from test_comfy_quant import comfy_quant_twins
    from test_fp8 import fp8_twins
    from test_gguf import gguf_twins

    folder = tmp_path_factory.mktemp("qwen_image21-storage")
    return [("comfy_quant_int8_convrot", *comfy_quant_twins(folder, "qwen_image21", "int8_convrot", config=TINY)),
            ("fp8_scaled", *fp8_twins(folder, "qwen_image21", torch.float8_e4m3fn, True, config=TINY)),
            ("gguf", *gguf_twins(folder, "qwen_image21", config=TINY, arch="qwen_image21"))]


def test_qwen_image21_quantized_files_equal_their_fp32_twins_and_stay_compact(storage_twins, client1, client2):
    """Each kind at 1 worker equals its twin; under Ulysses-2 too; each rank holds the compact weights."""
    for kind, quant, meant in storage_twins:
        assert model_config(quant) == TINY, kind
        got, ref = client1.run(call_job(quant, S(), True)), client1.run(call_job(meant, S(), True))
        err = rel_err(got.latent, ref.latent)
        print(f"\nQwen-Image 2.1 {kind}: rel. error vs its fp32 twin {err:.2e}, param bytes "
              f"{got.stats[0]['param_bytes']} vs {ref.stats[0]['param_bytes']}")
        assert err <= STORAGE_RTOL, kind
        assert got.stats[0]["param_bytes"] < 0.6 * ref.stats[0]["param_bytes"], kind  # 1-byte (or less) matrices
        split = client2.run(call_job(quant, S(ulysses_degree=2), True))
        assert rel_err(split.latent, got.latent) <= EXACT_RTOL, kind
    client1.release()
    client2.release()


def test_qwen_image21_lora_lands(paths, client1, client2, tmp_path):
    """A LoRA on ComfyUI's names (a whole to_q, and the up half of a fused gate_up as ComfyUI places a
    diffusers-named LoRA: offset rows) equals the file with those weights changed, at 1 worker and Ring-2."""
    from parallel_runtime.spec import WeightPatch, WeightPatches

    g = torch.Generator().manual_seed(21)
    m, h = TINY.mlp_hidden, TINY.hidden_size
    q_up, q_down = torch.randn(h, 4, generator=g) * 0.1, torch.randn(4, h, generator=g) * 0.1
    mlp_up, mlp_down = torch.randn(m, 4, generator=g) * 0.1, torch.randn(4, h, generator=g) * 0.1
    patches = WeightPatches("lora-21", {
        "transformer_blocks.1.attn.to_q.weight": [WeightPatch("lora", {"up": q_up, "down": q_down}, alpha=4.0)],
        "transformer_blocks.0.img_mlp.gate_up.weight": [WeightPatch("lora", {"up": mlp_up, "down": mlp_down},
                                                                    strength=0.8, alpha=2.0, offset=(0, m, m))]})
    state = load_file(paths[0])
    pre = "model.diffusion_model.transformer_blocks."
    state[pre + "1.attn.to_q.weight"] += q_up @ q_down
    state[pre + "0.img_mlp.gate_up.weight"][m:] += 0.8 * 0.5 * (mlp_up @ mlp_down)
    merged = str(tmp_path / "merged.safetensors")
    save_file(state, merged)
    want = client1.run(call_job(merged, S())).latent
    for client, strategy in ((client1, S()), (client2, S(ring_degree=2))):
        got = client.run(dataclasses.replace(call_job(paths[0], strategy), weight_patches=patches)).latent
        err = rel_err(got, want)
        print(f"\nQwen-Image 2.1 LoRA {strategy}: rel. error vs the merged file {err:.2e}")
        assert err < EXACT_RTOL
    assert rel_err(client1.run(call_job(paths[0], S())).latent, want) > 1e-3  # the LoRA mattered
