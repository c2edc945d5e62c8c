"""UI-format workflows queued headless: scripts/ui_workflow.py (UI format -> the API format ComfyUI's editor queues)
and scripts/paradit_swap.py (queue_workflow.py --parallel), on ComfyUI's own templates.

The templates come from the PyPI package comfyui-workflow-templates-json, pinned in constraints.txt (TEMPLATES_VERSION
below). The node classes come from tests/fixtures/object_info_templates.json: the GET /object_info entries of the
classes those templates and workflows/ use, taken from ComfyUI 0.3.64 with ParaDiT installed (tooltips and
descriptions left out). To write it again from a running server:

    python tests/test_ui_workflow.py --write-fixture 127.0.0.1:8188

- Two templates (Flux dev text-to-image with its subgraph, Flux Canny) are compared with API graphs written here by
  hand from the template files; our own workflows/*.json with their API twins in workflows/api/; our Wan workflows
  with the Wan templates they are built on, their UNETLoader swapped for Load Parallel DiT.
- Every template below: each link points at an emitted node and an output that node class has, every required
  input is there, widget values sit under the class's widget names, nothing frontend-only is left, and the
  positional widget values agree with the `widgets_values_named` map the newer editor saves beside them.
- Per feature, on the templates that have it: subgraphs (ids "outer:inner", nested "a:b:c"), Reroute, PrimitiveNode,
  bypassed nodes (and subgraph instances) wired through, muted nodes dropped, a node class the server lacks; then
  small hand-made graphs for the editor's rules one at a time (bypass type matching, promoted subgraph widgets,
  proxy widgets, value wrapping).
- --parallel: strategy text, UNETLoader and CheckpointLoaderSimple swaps, device counts, the script's --dry-run.
- With COMFYUI_DIR set: a real ComfyUI's live /object_info converts the templates, and /prompt accepts the
  converted, swapped graph up to the model files it does not have.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import urllib.error

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import paradit_swap  # noqa: E402
import queue_workflow as qw  # noqa: E402
import ui_workflow as uw  # noqa: E402
import template_coverage as tc  # noqa: E402

FIXTURE = os.path.join(REPO, "tests", "fixtures", "object_info_templates.json")
# Node classes of ComfyUI 2026 that our workflows for the newer families use and the 0.3.64 host lacks (FLUX.2's
# latent and schedule, HunyuanVideo 1.5's latent, Qwen-Image 2.1's prompt encoder) plus CFGGuider, written by hand
# from their 2026 sources (comfy_extras/nodes_flux.py, nodes_hunyuan.py, nodes_qwen.py, nodes_custom_sampler.py);
# and the LTX-2.3 / MiniMax-H3 templates' classes (nodes_lt.py, nodes_lt_audio.py, nodes_lt_upsampler.py,
# nodes_minimax_h3.py, nodes_textgen.py, nodes_post_processing.py, nodes_video.py, ...) with the inputs those
# templates (ComfyUI 0.16.3) save, where the newest source has moved on (Create Video's codec, TextGenerate's images);
# and the LTX-2.3 first-last-frame template's LTXVAddGuide (with its optional attention mask and IC-LoRA parameters),
# SamplerEulerAncestral and Get Image Size as their 2026 sources (nodes_lt.py, nodes_custom_sampler.py,
# nodes_images.py) define them.
# Kept apart from FIXTURE, which the live test compares class by class with the host's /object_info.
FIXTURE_2026 = os.path.join(REPO, "tests", "fixtures", "object_info_2026.json")
TEMPLATES_VERSION = "0.1.123"
# Templates checked here, each for what it has: subgraphs (proxy widgets, nested), primitives, reroutes, bypassed
# and muted nodes, checkpoint loaders; the last needs a node class the 0.3.64 host lacks (ComfySwitchNode).
TEMPLATES = ("flux_dev_full_text_to_image", "flux_canny_model_example", "flux_fill_inpaint_example",
             "flux_fill_outpaint_example", "flux_kontext_dev_basic", "flux_depth_lora_example", "flux_redux_model_example",
             "flux_schnell", "flux1_dev_uso_reference_image_gen", "sd3.5_simple_example", "sd3.5_large_depth",
             "hidream_e1_1", "hunyuan_video_text_to_video", "image_qwen_image_controlnet_patch")
NEEDS_NEWER_HOST = {"image_qwen_image": "ComfySwitchNode"}
# Issue 48's families, every template of theirs in the pinned package: the ones whose node classes the 0.3.64 host
# has (FAMILY_TEMPLATES) convert, take Load Parallel DiT in place of each diffusion-model loader and (live) pass
# /prompt's validation but for the model and image files; the others name a class that host lacks (ComfyUI 2026's).
FAMILY_TEMPLATES = ("wan2.1_fun_control", "wan2.1_fun_inp", "video_wan2.1_fun_camera_v1.1_1.3B",
                    "video_wan2.1_fun_camera_v1.1_14B", "video_wan2_2_14B_fun_camera", "video_wan2_2_14B_fun_control",
                    "video_wan2_2_14B_fun_inpaint", "video_wan2_2_5B_fun_control", "video_wan2_2_5B_fun_inpaint",
                    "video_wan_vace_14B_t2v", "video_wan_vace_14B_ref2v", "video_wan_vace_14B_v2v",
                    "video_wan_vace_outpainting", "hidream_i1_full", "hidream_i1_dev",
                    "hidream_i1_fast", "hidream_e1_full", "hidream_e1_1", "image_kandinsky5_t2i",
                    "wan2.1_flf2v_720_f16", "video_wan_ati")
# A choice the 0.3.64 host's class lacks: DualCLIPLoader's type "kandinsky5" (ComfyUI 2026's Kandinsky 5 encoders).
NEWER_CHOICES = {"image_kandinsky5_t2i": {"type"}}
FAMILY_TEMPLATES_NEWER = ("video_wan_vace_flf2v", "video_wan_vace_inpainting", "video_wan_animate2",
                          "video_wan_animate2_distilled", "video_wan2_2_14B_s2v", "image_hidream_o1",
                          "image_hidream_o1_dev", "image_flux3_klein_t2i", "image_flux3_klein_image_edit",
                          "image_flux3_klein_distilled_t2i", "image_flux3_klein_distilled_image_edit",
                          "video_kandinsky5_t2v", "video_kandinsky5_i2v", "image_chrono_edit_14B",
                          "video_wanmove_480p", "video_bernini_r_image_editing", "video_bernini_r_video_editing")


def templates_dir() -> str:
    package = pytest.importorskip("comfyui_workflow_templates_json",
                                  reason="comfyui-workflow-templates-json is not installed (make venv installs it)")
    return os.path.join(os.path.dirname(package.__file__), "templates")


def template(name: str) -> dict:
    with open(os.path.join(templates_dir(), name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def _load(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def object_info() -> dict:
    return _load(FIXTURE)


def convert(name_or_workflow, object_info) -> dict:
    workflow = template(name_or_workflow) if isinstance(name_or_workflow, str) else name_or_workflow
    graph, _ = uw.convert(workflow, object_info)
    return graph


def node(class_type: str, title: str, **inputs) -> dict:
    return {"inputs": inputs, "class_type": class_type, "_meta": {"title": title}}


# ---------------------------------------------------------------------------------------------------
# Whole templates against API graphs written by hand from the template files.

FLUX_DEV_PROMPT = ("A fairy tale scene of a young girl with silver curly hair wearing a delicate white dress, standing "
                   "among crystal butterflies and glowing glass roses. The scene is filled with soft magical light, "
                   "like a dream from a fantasy world.")
# flux_dev_full_text_to_image: SaveImage 9 outside; everything else in subgraph instance 194, whose inputs (prompt,
# sizes, seed, file names) are unconnected and take the inner widgets' values (legacy proxyWidgets, no values of
# the instance's own). KSampler's "randomize" after the seed is the editor's and is not sent.
FLUX_DEV_API = {
    "9": node("SaveImage", "Save Image", filename_prefix="ComfyUI", images=["194:51", 0]),
    "194:45": node("VAELoader", "Load VAE", vae_name="ae.safetensors"),
    "194:46": node("UNETLoader", "Load Diffusion Model", unet_name="flux1-dev.safetensors", weight_dtype="default"),
    "194:47": node("DualCLIPLoader", "DualCLIPLoader", clip_name1="clip_l.safetensors",
                   clip_name2="t5xxl_fp16.safetensors", type="flux", device="default"),
    "194:48": node("EmptySD3LatentImage", "EmptySD3LatentImage", width=1024, height=1024, batch_size=1),
    "194:49": node("CLIPTextEncode", "CLIP Text Encode (Prompt)", text=FLUX_DEV_PROMPT, clip=["194:47", 0]),
    "194:50": node("KSampler", "KSampler", seed=0, steps=20, cfg=1, sampler_name="euler", scheduler="simple",
                   denoise=1, model=["194:46", 0], positive=["194:49", 0], negative=["194:52", 0],
                   latent_image=["194:48", 0]),
    "194:51": node("VAEDecode", "VAE Decode", samples=["194:50", 0], vae=["194:45", 0]),
    "194:52": node("ConditioningZeroOut", "ConditioningZeroOut", conditioning=["194:49", 0]),
}
CANNY_PROMPT = ("A vibrant red ladybug rests on a blooming deep purple rose with lush, velvety petals. The background "
                "is a soft pink, filled with subtly blurred roses of the same pink shade, creating a dreamy and "
                "romantic atmosphere.")
# flux_canny_model_example: flat; its MarkdownNote is left out, LoadImage's upload-button value ("image") is not sent.
CANNY_API = {
    "34": node("DualCLIPLoader", "DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="t5xxl_fp16.safetensors",
               type="flux", device="default"),
    "37": node("ConditioningZeroOut", "ConditioningZeroOut", conditioning=["23", 0]),
    "31": node("UNETLoader", "Load Diffusion Model", unet_name="flux1-canny-dev.safetensors", weight_dtype="default"),
    "32": node("VAELoader", "Load VAE", vae_name="ae.safetensors"),
    "26": node("FluxGuidance", "FluxGuidance", guidance=30, conditioning=["23", 0]),
    "18": node("Canny", "Canny", low_threshold=0.15, high_threshold=0.3, image=["17", 0]),
    "17": node("LoadImage", "Load Image", image="flux_canny_model_example_input_image.png"),
    "9": node("SaveImage", "Save Image", filename_prefix="ComfyUI", images=["8", 0]),
    "8": node("VAEDecode", "VAE Decode", samples=["3", 0], vae=["32", 0]),
    "3": node("KSampler", "KSampler", seed=1125476660951871, steps=20, cfg=1, sampler_name="euler",
              scheduler="normal", denoise=1, model=["31", 0], positive=["35", 0], negative=["35", 1],
              latent_image=["35", 2]),
    "35": node("InstructPixToPixConditioning", "InstructPixToPixConditioning", positive=["26", 0],
               negative=["37", 0], vae=["32", 0], pixels=["18", 0]),
    "19": node("PreviewImage", "Preview Image", images=["18", 0]),
    "23": node("CLIPTextEncode", "CLIP Text Encode (Positive Prompt)", text=CANNY_PROMPT, clip=["34", 0]),
}


def test_templates_package_is_the_pinned_version():
    templates_dir()
    from importlib.metadata import version

    assert version("comfyui-workflow-templates-json") == TEMPLATES_VERSION
    with open(os.path.join(REPO, "constraints.txt")) as f:
        assert f"comfyui-workflow-templates-json=={TEMPLATES_VERSION}" in f.read().split()


@pytest.mark.parametrize("name, expected", [("flux_dev_full_text_to_image", FLUX_DEV_API),
                                            ("flux_canny_model_example", CANNY_API)])
def test_template_converts_to_what_the_editor_queues(object_info, name, expected):
    assert convert(name, object_info) == expected


# Our workflows built on templates a ComfyUI of 2026 saved (0.16.3 on: LTX-2.3, MiniMax-H3) take FIXTURE_2026's classes
# where they differ from the 0.3.64 host's (Create Video's bit depth and color space); the others are converted with
# the classes they were made for.
NEWER_TEMPLATE_WORKFLOWS = ("ltx23_t2v_ulysses", "ltx23_i2v_ulysses", "ltx23_flf2v_ulysses", "minimax_h3_t2v_ulysses")


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "workflows")) if f.endswith(".json")))
def test_our_ui_workflows_convert_to_their_api_twins(object_info, name):
    newer = _load(FIXTURE_2026)
    classes = {**object_info, **newer} if name in NEWER_TEMPLATE_WORKFLOWS else {**newer, **object_info}
    graph = convert(_load(os.path.join(REPO, "workflows", name + ".json")), classes)
    twin = _load(os.path.join(REPO, "workflows", "api", name + ".json"))
    assert {k: (n["class_type"], n["inputs"]) for k, n in graph.items()} == {
        k: (n["class_type"], n["inputs"]) for k, n in twin.items()}


# Our Wan workflows keep the node ids, nodes, links and widget values of the ComfyUI template each is built on; the
# template with its UNETLoader swapped for Load Parallel DiT as --parallel swaps it (our Strategy Selector and devices;
# the selector takes the next free id) is our API twin but for what ours change on purpose: a fixed seed (runs that
# repeat), the file prefix, the picture (ComfyUI's own input/example.png; the template's comes with the template)
# and Load Parallel DiT's optional quantized_matmul at its default (saved by the editor). Ours add a Read me note.
# video_wan2_2_14B_t2v (wan22_14b_t2v_two_experts) needs Switch nodes the 0.3.64 host lacks: test_workflows.py checks
# that one against the template's values.
WAN_TEMPLATES = {"wan21_t2v_ulysses": "text_to_video_wan", "wan21_i2v_cfg_parallel": "image_to_video_wan",
                 "wan22_5b_ti2v": "video_wan2_2_5B_ti2v", "wan22_fun_inpaint_5b_ulysses": "video_wan2_2_5B_fun_inpaint",
                 "wan21_vace_14b_t2v_ulysses": "video_wan_vace_14B_t2v"}


@pytest.mark.parametrize("name, template_name", sorted(WAN_TEMPLATES.items()))
def test_wan_workflow_is_its_template_on_load_parallel_dit(object_info, name, template_name):
    ours = _load(os.path.join(REPO, "workflows", "api", name + ".json"))
    (strategy,) = [n for n in ours.values() if n["class_type"] == "ParaDiTStrategy"]
    devices = {n["inputs"]["devices"] for n in ours.values() if n["class_type"] == "ParaDiTLoader"}
    assert len(devices) == 1
    expected, notes = paradit_swap.swap_loaders(convert(template_name, object_info), strategy["inputs"],
                                                devices.pop(), object_info)
    assert len(notes) == 1 and "is now Load Parallel DiT" in notes[0]
    changed = {"KSampler": {"seed": 42}, "SaveVideo": {"filename_prefix": f"ParaDiT/{name}"},
               "LoadImage": {"image": "example.png"}, "ParaDiTLoader": {"quantized_matmul": "auto"}}
    for n in expected.values():
        n["inputs"].update(changed.get(n["class_type"], {}))
    assert {k: (n["class_type"], n["inputs"]) for k, n in ours.items()} == {
        k: (n["class_type"], n["inputs"]) for k, n in expected.items()}
    ui = _load(os.path.join(REPO, "workflows", name + ".json"))
    assert {n["type"] for n in ui["nodes"] if str(n["id"]) not in ours} <= {"MarkdownNote", "LoadImage"}


# ---------------------------------------------------------------------------------------------------
# Every template: structure.

def check_structure(graph: dict, object_info: dict) -> None:
    """Links point at emitted nodes and existing outputs; required inputs are there; widget values are named as the
    class names its widgets; nothing frontend-only is left."""
    assert graph
    for nid, n in graph.items():
        spec = object_info[n["class_type"]]
        assert n["class_type"] not in uw.FRONTEND_ONLY
        defs = {d.name: d for d in uw.ordered_inputs(spec)}
        for name, value in n["inputs"].items():
            assert name in defs or getattr(defs.get(name.split(".")[0]), "kind", None) == uw.DYNAMIC_COMBO, \
                f"{nid} {n['class_type']} has no input {name}"
            if name not in defs:
                continue
            if isinstance(value, list):
                assert value[0] in graph, f"{nid}.{name} -> {value}"
                outputs = object_info[graph[value[0]]["class_type"]]["output"]
                assert isinstance(value[1], int) and 0 <= value[1] < len(outputs), f"{nid}.{name} -> {value}"
            else:
                assert uw.is_widget(defs[name]), f"{nid}.{name} = {value!r} is not a widget"
        missing = [d.name for d in defs.values() if not d.optional and d.name not in n["inputs"]]
        assert not missing, f"{nid} {n['class_type']} lacks {missing}"


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_converts_to_a_complete_graph(object_info, name):
    graph = convert(name, object_info)
    check_structure(graph, object_info)
    workflow = template(name)
    # Positional widget values, named from /object_info, equal the names the editor saved beside them.
    for scope in [workflow, *uw.subgraph_definitions(workflow).values()]:
        for n in scope["nodes"]:
            spec = object_info.get(n["type"])
            if spec and isinstance(n.get("widgets_values_named"), dict) and isinstance(n.get("widgets_values"), list):
                assert uw.saved_widget_values({"widgets_values": n["widgets_values"]}, spec) == \
                    uw.saved_widget_values({"widgets_values_named": n["widgets_values_named"]}, spec)


def swapped_family_template(name: str, object_info: dict) -> dict:
    """A FAMILY_TEMPLATES template converted and with Load Parallel DiT (Ulysses 2 on two devices) in place of each
    diffusion-model loader, as `queue_workflow.py --parallel ulysses=2` queues it."""
    strategy = paradit_swap.parse_strategy("ulysses=2")
    graph, notes = paradit_swap.swap_loaders(convert(name, object_info), strategy, "cpu:2", object_info)
    assert notes and all("is now Load Parallel DiT" in n for n in notes), notes
    return graph


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_family_template_converts_and_takes_load_parallel_dit(object_info, name):
    """Each template of issue 48's families converts to a complete graph with Load Parallel DiT on every diffusion
    model it loads; scripts/template_coverage.py says which of those files ParaDiT's families run (its count)."""
    graph = swapped_family_template(name, object_info)
    check_structure(graph, object_info)
    loaders = [n for n in graph.values() if n["class_type"] == "ParaDiTLoader"]
    assert loaders and not any(n["class_type"] == "UNETLoader" for n in graph.values())
    assert {tc.classify(n["inputs"]["unet_name"])[0] for n in loaders} == {tc.DIT}


@pytest.mark.parametrize("name", FAMILY_TEMPLATES_NEWER)
def test_family_template_of_a_newer_comfyui_names_a_class_it_needs(object_info, name):
    lacking = classes_used(template(name)) - set(object_info)
    assert lacking, f"{name} converts on the 0.3.64 host's classes: move it to FAMILY_TEMPLATES"
    with pytest.raises(uw.ConversionError, match="is not a node class this ComfyUI server knows") as e:
        convert(name, object_info)
    assert any(f"'{c}'" in str(e.value) for c in lacking), str(e.value)


def test_a_node_class_the_server_lacks_is_one_sentence(object_info):
    name, missing = next(iter(NEEDS_NEWER_HOST.items()))
    with pytest.raises(uw.ConversionError) as e:
        convert(name, object_info)
    text = str(e.value)
    assert missing in text and "/object_info" in text and "install" in text and text.count(". ") == 0


# ---------------------------------------------------------------------------------------------------
# Per feature, on the templates that have it.

def ui_node_of(workflow: dict, node_id: int, scope: dict | None = None) -> dict:
    return next(n for n in (scope or workflow)["nodes"] if n["id"] == node_id)


def test_reroute_and_primitive_nodes(object_info):
    """hidream_e1_1: a Reroute (48) carries CFGNorm's MODEL to two nodes; PrimitiveNodes "CFG" (56) and "Image CFG"
    (57) feed DualCFGGuider's two cfg widgets."""
    graph = convert("hidream_e1_1", object_info)
    assert not {"48", "56", "57"} & set(graph)
    assert graph["49"]["inputs"]["model"] == ["55", 0] and graph["53"]["inputs"]["model"] == ["55", 0]
    assert graph["53"]["inputs"]["cfg_conds"] == 3 and graph["53"]["inputs"]["cfg_cond2_negative"] == 1.5
    workflow = template("hidream_e1_1")
    ui_node_of(workflow, 56)["widgets_values"][0] = 4.5  # the primitive's value beats the one saved on the node
    assert convert(workflow, object_info)["53"]["inputs"]["cfg_conds"] == 4.5


def test_a_primitive_feeding_two_nodes(object_info):
    """flux_redux_model_example: PrimitiveNodes "width" (34) and "height" (35) each feed EmptySD3LatentImage 27 and
    ModelSamplingFlux 30."""
    workflow = template("flux_redux_model_example")
    ui_node_of(workflow, 34)["widgets_values"][0] = 768
    graph = convert(workflow, object_info)
    assert [graph[n]["inputs"][w] for n in ("27", "30") for w in ("width", "height")] == [768, 1024, 768, 1024]
    assert ui_node_of(workflow, 27)["widgets_values"][:2] == [1024, 1024]  # its own saved values lost
    assert "34" not in graph and "35" not in graph


def test_bypassed_node_passes_its_input_through(object_info):
    """image_qwen_image_controlnet_patch: LoraLoaderModelOnly 80 is bypassed; ModelSamplingAuraFlow 66 gets the
    UNETLoader's MODEL instead."""
    graph = convert("image_qwen_image_controlnet_patch", object_info)
    assert "80" not in graph
    assert graph["66"]["inputs"]["model"] == ["37", 0] and graph["37"]["class_type"] == "UNETLoader"


def test_bypassed_node_without_a_matching_input(object_info):
    """flux_kontext_dev_basic: the second LoadImage (191) is bypassed and has no input, so ImageStitch's optional
    image2 (inside subgraph 192, via its input "image2") is left unconnected."""
    graph = convert("flux_kontext_dev_basic", object_info)
    stitch = graph["192:146"]["inputs"]
    assert "191" not in graph and stitch["image1"] == ["190", 0] and "image2" not in stitch
    assert graph["192:6"]["inputs"]["text"].startswith("Using this elegant style, create a portrait of a swan")
    assert graph["136"]["inputs"]["images"] == ["192:8", 0]


def test_nested_subgraphs(object_info):
    """flux_depth_lora_example: subgraph 150 holds subgraph 41 (Lotus depth), whose nodes get ids "150:41:N"; its
    pixels input comes through 150's ImageScaleToTotalPixels from the outer LoadImage; PreviewImage 43 in 150 is
    bypassed."""
    graph = convert("flux_depth_lora_example", object_info)
    assert graph["150:41:87"]["class_type"] == "UNETLoader"
    assert graph["150:41:97"]["inputs"]["pixels"] == ["150:107", 0]
    assert graph["150:107"]["inputs"]["image"] == ["17", 0]
    assert graph["150:35"]["inputs"]["pixels"] == ["150:41:99", 0]
    assert graph["9"]["inputs"]["images"] == ["150:8", 0]
    assert "150:43" not in graph and "150" not in graph and "150:41" not in graph


def test_muted_node_and_bypassed_subgraph_instance_are_left_out(object_info):
    """hunyuan_video_text_to_video: VAEDecode 8 is muted. flux1_dev_uso_reference_image_gen: subgraph instance 113
    and SaveImage 73 are bypassed, so nothing inside 113 is sent."""
    graph = convert("hunyuan_video_text_to_video", object_info)
    assert "8" not in graph
    assert all(v[0] != "8" for n in graph.values() for v in n["inputs"].values() if isinstance(v, list))
    graph = convert("flux1_dev_uso_reference_image_gen", object_info)
    assert "73" not in graph and not [k for k in graph if k.startswith("113:")]


# ---------------------------------------------------------------------------------------------------
# The editor's rules one at a time, on small hand-made graphs.

TOY = {
    "Load": {"input": {"required": {"name": [["a.bin", "b.bin"]]}}, "output": ["MODEL"], "display_name": "Load"},
    "Latent": {"input": {"required": {"width": ["INT", {"default": 512}]}}, "output": ["LATENT"],
               "display_name": "Latent"},
    "Patch": {"input": {"required": {"latent": ["LATENT"], "model": ["MODEL"], "strength": ["FLOAT"]}},
              "output": ["MODEL"], "display_name": "Patch"},
    "Pair": {"input": {"required": {"a": ["MODEL"], "b": ["MODEL"]}}, "output": ["MODEL", "MODEL"],
             "display_name": "Pair"},
    "Sample": {"input": {"required": {"model": ["MODEL"], "seed": ["INT", {"control_after_generate": True}],
                                      "sampler": [["euler", "heun"]], "latent": ["LATENT"]},
                         "optional": {"steps": ["INT", {"default": 7}]}},
               "input_order": {"required": ["model", "seed", "sampler", "latent"], "optional": ["steps"]},
               "output": ["LATENT"], "display_name": "Sample"},
    "Save": {"input": {"required": {"latent": ["LATENT"], "prefix": ["STRING", {"default": "x"}]}}, "output": [],
             "display_name": "Save"},
}


def ui(node_id, type_, inputs=(), outputs=(), widgets=None, mode=0, **extra) -> dict:
    node = {"id": node_id, "type": type_, "mode": mode, "inputs": list(inputs), "outputs": list(outputs), **extra}
    if widgets is not None:
        node["widgets_values"] = widgets
    return node


def socket(name, type_, link=None, widget=False) -> dict:
    return {"name": name, "type": type_, "link": link, **({"widget": {"name": name}} if widget else {})}


def out(type_, *links) -> dict:
    return {"name": type_, "type": type_, "links": list(links)}


def test_bypass_picks_the_matching_input_and_muted_sources_are_dropped():
    """Patch (bypassed) has inputs LATENT, MODEL: its MODEL output passes the MODEL input on. Pair (bypassed) has two
    MODEL inputs: output 1 passes input 1 (the same slot), not the first MODEL. Latent 5 is muted: Sample's latent is
    left out. Sample's saved seed is followed by the editor's "fixed" (not sent); its optional steps takes its
    default."""
    workflow = {"nodes": [
        ui(1, "Load", outputs=[out("MODEL", 1, 6)], widgets=["b.bin"]),
        ui(7, "Load", outputs=[out("MODEL", 7)], widgets=["a.bin"]),
        ui(2, "Latent", outputs=[out("LATENT", 2)], widgets=[640]),
        ui(3, "Patch", [socket("latent", "LATENT", 2), socket("model", "MODEL", 1)], [out("MODEL", 3)], [0.5], mode=4),
        ui(8, "Pair", [socket("a", "MODEL", 6), socket("b", "MODEL", 7)], [out("MODEL"), out("MODEL", 8)], mode=4),
        ui(5, "Latent", outputs=[out("LATENT", 4)], widgets=[320], mode=2),
        ui(4, "Sample", [socket("model", "MODEL", 3), socket("latent", "LATENT", 4)], [out("LATENT", 5)],
           [5, "fixed", "heun"]),
        ui(9, "Sample", [socket("model", "MODEL", 8), socket("latent", "LATENT", 9)], [out("LATENT")],
           [6, "fixed", "euler", 3]),
        ui(6, "Save", [socket("latent", "LATENT", 5)], widgets={"prefix": ["p", "q"]}),
    ], "links": [[1, 1, 0, 3, 1, "MODEL"], [2, 2, 0, 3, 0, "LATENT"], [3, 3, 0, 4, 0, "MODEL"], [4, 5, 0, 4, 1, "LATENT"],
                 [5, 4, 0, 6, 0, "LATENT"], [6, 1, 0, 8, 0, "MODEL"], [7, 7, 0, 8, 1, "MODEL"], [8, 8, 1, 9, 0, "MODEL"],
                 [9, 2, 0, 9, 1, "LATENT"]]}
    graph, notes = uw.convert(workflow, TOY)
    assert graph == {
        "1": node("Load", "Load", name="b.bin"),
        "7": node("Load", "Load", name="a.bin"),
        "2": node("Latent", "Latent", width=640),
        "4": node("Sample", "Sample", seed=5, sampler="heun", steps=7, model=["1", 0]),
        "9": node("Sample", "Sample", seed=6, sampler="euler", steps=3, model=["7", 0], latent=["2", 0]),
        "6": node("Save", "Save", prefix={"__value__": ["p", "q"]}, latent=["4", 0]),
    }
    assert notes == []


SUB_ID = "5a3f2c44-0000-4000-8000-000000000001"


def toy_subgraph() -> dict:
    """Inputs model (MODEL), seed and sampler (promoted widgets of Sample 10); Latent 11 inside; output LATENT."""
    return {
        "id": SUB_ID, "name": "Toy sampling",
        "inputs": [{"name": "model", "type": "MODEL", "linkIds": [101]}, {"name": "seed", "type": "INT", "linkIds": [102]},
                   {"name": "sampler", "type": "COMBO", "linkIds": [103]}],
        "outputs": [{"name": "LATENT", "type": "LATENT", "linkIds": [105]}],
        "nodes": [ui(10, "Sample", [socket("model", "MODEL", 101), socket("latent", "LATENT", 104),
                                    socket("seed", "INT", 102, True), socket("sampler", "COMBO", 103, True)],
                     [out("LATENT", 105)], [9, "fixed", "heun", 2]),
                  ui(11, "Latent", outputs=[out("LATENT", 104)], widgets=[640])],
        "links": [{"id": 101, "origin_id": -10, "origin_slot": 0, "target_id": 10, "target_slot": 0, "type": "MODEL"},
                  {"id": 102, "origin_id": -10, "origin_slot": 1, "target_id": 10, "target_slot": 2, "type": "INT"},
                  {"id": 103, "origin_id": -10, "origin_slot": 2, "target_id": 10, "target_slot": 3, "type": "COMBO"},
                  {"id": 104, "origin_id": 11, "origin_slot": 0, "target_id": 10, "target_slot": 1, "type": "LATENT"},
                  {"id": 105, "origin_id": 10, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "LATENT"}],
    }


def toy_with_instance(widgets, properties=None, nest: bool = False) -> dict:
    instance = ui(20, SUB_ID, [socket("model", "MODEL", 1)], [out("LATENT", 2)], widgets,
                  properties=properties or {})
    nodes = [ui(1, "Load", outputs=[out("MODEL", 1)], widgets=["a.bin"]), instance,
             ui(30, "Save", [socket("latent", "LATENT", 2)], widgets=["out"])]
    links = [[1, 1, 0, 20, 0, "MODEL"], [2, 20, 0, 30, 0, "LATENT"]]
    if not nest:
        return {"nodes": nodes, "links": links, "definitions": {"subgraphs": [toy_subgraph()]}}
    outer = {"id": "outer-0000", "name": "Outer", "inputs": [], "outputs": [], "nodes": nodes,
             "links": [{"id": i, "origin_id": o, "origin_slot": os_, "target_id": t, "target_slot": ts, "type": ty}
                       for i, o, os_, t, ts, ty in links]}
    return {"nodes": [ui(40, "outer-0000")], "links": [], "definitions": {"subgraphs": [outer, toy_subgraph()]}}


@pytest.mark.parametrize("widgets, properties, seed, sampler, width", [
    ([42, "euler"], None, 42, "euler", 640),  # one value per promoted input (the current editor)
    ([42, "randomize", "euler"], None, 42, "euler", 640),  # older files: the seed's control value too
    ([], None, 9, "heun", 640),  # no values of its own: the inner widgets'
    ([77, 800], {"proxyWidgets": [["10", "seed"], ["11", "width"]]}, 77, "heun", 800),  # legacy proxy widgets
    ({"seed": 5, "sampler": "euler"}, None, 5, "euler", 640),  # values by name
])
def test_subgraph_instance_widget_values(widgets, properties, seed, sampler, width):
    graph, _ = uw.convert(toy_with_instance(widgets, properties), TOY)
    assert graph == {
        "1": node("Load", "Load", name="a.bin"),
        "20:10": node("Sample", "Sample", seed=seed, sampler=sampler, steps=2, model=["1", 0], latent=["20:11", 0]),
        "20:11": node("Latent", "Latent", width=width),
        "30": node("Save", "Save", prefix="out", latent=["20:10", 0]),
    }


def test_nested_subgraph_ids_and_a_primitive_through_a_reroute():
    workflow = toy_with_instance([42, "euler"], nest=True)
    graph, _ = uw.convert(workflow, TOY)
    assert sorted(graph) == ["40:1", "40:20:10", "40:20:11", "40:30"]
    assert graph["40:20:10"]["inputs"]["model"] == ["40:1", 0] and graph["40:30"]["inputs"]["latent"] == ["40:20:10", 0]
    # A PrimitiveNode -> Reroute -> the instance's seed input: the primitive's value reaches Sample 10.
    workflow = toy_with_instance([42, "euler"])
    workflow["nodes"][1]["inputs"].append(socket("seed", "INT", 3, True))
    workflow["nodes"] += [ui(50, "PrimitiveNode", outputs=[out("INT", 4)], widgets=[123, "fixed"]),
                          ui(51, "Reroute", [socket("", "*", 4)], [out("INT", 3)])]
    workflow["links"] += [[3, 51, 0, 20, 1, "INT"], [4, 50, 0, 51, 0, "*"]]
    graph, _ = uw.convert(workflow, TOY)
    assert graph["20:10"]["inputs"]["seed"] == 123 and not {"50", "51"} & set(graph)


def test_two_instances_of_one_subgraph_keep_their_own_values():
    workflow = toy_with_instance([42, "euler"])
    second = copy.deepcopy(workflow["nodes"][1])
    second.update(id=21, widgets_values=[43, "heun"], inputs=[socket("model", "MODEL", 1)],
                  outputs=[out("LATENT")])
    workflow["nodes"].append(second)
    graph, _ = uw.convert(workflow, TOY)
    assert (graph["20:10"]["inputs"]["seed"], graph["21:10"]["inputs"]["seed"]) == (42, 43)
    assert (graph["20:10"]["inputs"]["sampler"], graph["21:10"]["inputs"]["sampler"]) == ("euler", "heun")


def test_upload_button_value_without_input_order():
    """An image_upload combo gets the editor's upload button after the required inputs: after all inputs when the
    class lists an input_order (the button is not in it), before the optional ones when it does not."""
    spec = {"input": {"required": {"image": [["a.png"], {"image_upload": True}]},
                      "optional": {"strength": ["FLOAT", {"default": 1.0}]}}, "output": ["IMAGE"]}
    assert uw.widget_slots(spec) == ["image", None, "strength"]
    assert uw.saved_widget_values({"widgets_values": ["a.png", "image", 0.5]}, spec) == {"image": "a.png",
                                                                                        "strength": 0.5}
    spec["input_order"] = {"required": ["image"], "optional": ["strength"]}
    assert uw.widget_slots(spec) == ["image", "strength", None]


def test_dynamic_combo_values_are_read_by_name():
    """A V3 dynamic combo's chosen option brings widgets sent as "choice.widget"; they are read from the name map the
    editor saves (here SaveVideo's from api_clarity_ai_crystal_video_upscale), never guessed by position."""
    spec = {"input": {"required": {"video": ["VIDEO"], "filename_prefix": ["STRING", {"default": "video/ComfyUI"}],
                                   "format": ["COMFY_DYNAMICCOMBO_V3", {"options": [
                                       {"key": "auto", "inputs": {}},
                                       {"key": "mp4", "inputs": {"required": {"codec": [["auto", "h264"]]}}}]}]}},
            "output": [], "display_name": "Save Video"}
    saved = ui(5, "SaveVideo", [socket("video", "VIDEO")], widgets=["video/ComfyUI", "mp4", "auto"],
               widgets_values_named={"filename_prefix": "video/ComfyUI", "format": "mp4", "format.codec": "auto",
                                     "upload": "image"})
    graph, _ = uw.convert({"nodes": [saved], "links": []}, {"SaveVideo": spec})
    assert graph["5"]["inputs"] == {"filename_prefix": "video/ComfyUI", "format": "mp4", "format.codec": "auto"}
    del saved["widgets_values_named"]
    with pytest.raises(uw.ConversionError, match=r"node 5 \(SaveVideo\): .*dynamic widgets \(format\).*current "):
        uw.convert({"nodes": [saved], "links": []}, {"SaveVideo": spec})


def test_nodes_the_server_lacks_and_other_refusals():
    base = toy_with_instance([42, "euler"])
    lonely = copy.deepcopy(base)
    lonely["nodes"].append(ui(60, "Label (rgthree)", widgets=["a note"]))
    graph, notes = uw.convert(lonely, TOY)
    assert "60" not in graph and len(notes) == 1 and "node 60 (Label (rgthree))" in notes[0]
    linked = copy.deepcopy(base)
    linked["nodes"][2]["type"] = "SaveFancy"
    with pytest.raises(uw.ConversionError, match=r"node 30 \(SaveFancy\) is not a node class this ComfyUI server "
                                                 r"knows \(it is not in /object_info\): install"):
        uw.convert(linked, TOY)
    group = copy.deepcopy(base)
    group["nodes"].append(ui(61, "workflow>my group"))
    with pytest.raises(uw.ConversionError, match="group node.*Convert to Subgraph"):
        uw.convert(group, TOY)
    loop = {"nodes": [ui(1, "Reroute", [socket("", "*", 2)], [out("MODEL", 1)]),
                      ui(2, "Reroute", [socket("", "*", 1)], [out("MODEL", 2, 3)]),
                      ui(3, "Sample", [socket("model", "MODEL", 3)], widgets=[1, "fixed", "euler"])],
            "links": [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 1, 0, "MODEL"], [3, 2, 0, 3, 0, "MODEL"]]}
    with pytest.raises(uw.ConversionError, match="circle"):
        uw.convert(loop, TOY)
    with pytest.raises(uw.ConversionError, match="not a UI-format"):
        uw.convert({"1": {"class_type": "Load", "inputs": {}}}, TOY)


# ---------------------------------------------------------------------------------------------------
# --parallel

STRATEGY = {"mode": "manual", "cfg_degree": 1, "pipefusion_degree": 1, "ulysses_degree": 1, "ring_degree": 1,
            "num_pipeline_patch": 0, "warmup_steps": 1}


@pytest.mark.parametrize("text, changes", [
    ("ulysses=2", dict(ulysses_degree=2)),
    ("cfg=2, ulysses=2", dict(cfg_degree=2, ulysses_degree=2)),
    ("pipefusion=2,patches=4,warmup=2", dict(pipefusion_degree=2, num_pipeline_patch=4, warmup_steps=2)),
    ("ring_degree=4", dict(ring_degree=4)),
    ("auto", dict(mode="auto")),
    ("auto,warmup=3", dict(mode="auto", warmup_steps=3)),
])
def test_parse_strategy(text, changes):
    assert paradit_swap.parse_strategy(text) == {**STRATEGY, **changes}


@pytest.mark.parametrize("text, words", [("", "needs a strategy"), ("ulysses", "NAME=N"), ("tp=2", "NAME=N"),
                                         ("ulysses=two", "whole number"), ("cfg=3", "1 or 2"),
                                         ("ulysses=0", "at least 1"), ("auto,ulysses=2", "not both")])
def test_parse_strategy_refusals(text, words):
    with pytest.raises(paradit_swap.SwapError, match=words):
        paradit_swap.parse_strategy(text)


def test_parallel_swaps_the_unet_loader(object_info):
    graph = convert("flux_dev_full_text_to_image", object_info)
    swapped, notes = paradit_swap.swap_loaders(graph, paradit_swap.parse_strategy("cfg=2,ulysses=2"), "cpu:4",
                                               object_info)
    assert set(swapped) == set(graph) | {"195"}
    assert swapped["195"] == node("ParaDiTStrategy", "Strategy Selector", **{**STRATEGY, "cfg_degree": 2,
                                                                              "ulysses_degree": 2})
    assert swapped["194:46"] == node("ParaDiTLoader", "Load Parallel DiT", unet_name="flux1-dev.safetensors",
                                     weight_dtype="default", devices="cpu:4", strategy=["195", 0])
    assert swapped["194:50"] == graph["194:50"] and swapped["194:50"]["inputs"]["model"] == ["194:46", 0]
    assert graph["194:46"]["class_type"] == "UNETLoader", "the graph given is left as it was"
    assert notes == ["UNETLoader 194:46 (flux1-dev.safetensors) is now Load Parallel DiT 194:46"]
    check_structure(swapped, object_info)
    # hidream_e1_1 loads in fp8_e4m3fn_fast, which Load Parallel DiT calls fp8_e4m3fn.
    swapped, _ = paradit_swap.swap_loaders(convert("hidream_e1_1", object_info), paradit_swap.parse_strategy("auto"))
    assert swapped["41"]["inputs"]["weight_dtype"] == "fp8_e4m3fn" and swapped["41"]["inputs"]["devices"] == "auto"
    with pytest.raises(paradit_swap.SwapError, match="asks for 2 worker.*names 4.*--devices cpu:2"):
        paradit_swap.swap_loaders(graph, paradit_swap.parse_strategy("ulysses=2"), "0,1,2,3")
    bad = copy.deepcopy(graph)
    bad["194:46"]["inputs"]["weight_dtype"] = "int4"
    with pytest.raises(paradit_swap.SwapError, match="194:46 has weight_dtype 'int4'"):
        paradit_swap.swap_loaders(bad, paradit_swap.parse_strategy("auto"))


def test_parallel_with_a_checkpoint_loader(object_info):
    """sd3.5_simple_example loads sd3.5_large_fp8_scaled.safetensors with CheckpointLoaderSimple 4. Its MODEL goes to
    a new Load Parallel DiT only where the server lists that file among its diffusion models; CLIP and VAE stay."""
    graph = convert("sd3.5_simple_example", object_info)
    ckpt = graph["4"]["inputs"]["ckpt_name"]
    with pytest.raises(paradit_swap.SwapError, match=f"loads '{ckpt}' from models/checkpoints.*models/diffusion_models"):
        paradit_swap.swap_loaders(graph, paradit_swap.parse_strategy("ulysses=2"), "auto", object_info)
    listed = copy.deepcopy(object_info)
    listed["ParaDiTLoader"]["input"]["required"]["unet_name"][1]["options"] = [ckpt]
    swapped, notes = paradit_swap.swap_loaders(graph, paradit_swap.parse_strategy("ulysses=2"), "auto", listed)
    strategy_id, loader_id = "54", "55"  # after the template's highest id, 53
    assert swapped[loader_id] == node("ParaDiTLoader", "Load Parallel DiT", unet_name=ckpt, weight_dtype="default",
                                      devices="auto", strategy=[strategy_id, 0])
    sampler = next(n for n in swapped.values() if n["class_type"] == "KSampler")
    assert sampler["inputs"]["model"] == [loader_id, 0]
    assert swapped["4"] == graph["4"]
    assert sorted(v for n in swapped.values() for v in n["inputs"].values() if isinstance(v, list) and v[0] == "4") == [
        ["4", 1], ["4", 1], ["4", 2]]  # two CLIPTextEncodes and VAEDecode
    assert "still loads the file for its CLIP and VAE" in notes[0]
    no_model = {k: v for k, v in graph.items() if v["class_type"] not in ("KSampler", "VAEDecode", "SaveImage")}
    with pytest.raises(paradit_swap.SwapError, match="nothing to run in parallel"):
        paradit_swap.swap_loaders(no_model, paradit_swap.parse_strategy("auto"), "auto", listed)
    ours = _load(os.path.join(REPO, "workflows", "api", "flux_dev_ulysses.json"))
    with pytest.raises(paradit_swap.SwapError, match="already uses Load Parallel DiT: change its strategy with --set"):
        paradit_swap.swap_loaders(ours, paradit_swap.parse_strategy("auto"))
    with pytest.raises(paradit_swap.SwapError, match="no Load Parallel DiT node"):
        paradit_swap.swap_loaders(graph, paradit_swap.parse_strategy("auto"), "auto", {"KSampler": {}})


def test_keep_loader(object_info, capsys):
    """flux_depth_lora_example also loads Lotus (an SD UNet estimating depth) with UNETLoader 150:41:87; kept, only
    the Flux loader 150:31 is swapped."""
    path = os.path.join(templates_dir(), "flux_depth_lora_example.json")
    args = ["--workflow", path, "--object-info", FIXTURE, "--parallel", "auto", "--dry-run"]
    assert qw.main(args + ["--keep-loader", "150:41:87"]) == qw.EXIT_OK
    graph = json.loads(capsys.readouterr().out)
    assert graph["150:41:87"]["class_type"] == "UNETLoader" and graph["150:31"]["class_type"] == "ParaDiTLoader"
    assert qw.main(args + ["--keep-loader", "UNETLoader"]) == qw.EXIT_REJECTED
    assert "--keep-loader names node 'UNETLoader', which matches nodes 150:31, 150:41:87" in capsys.readouterr().err
    assert qw.main(args) == qw.EXIT_OK
    assert {n["class_type"] for k, n in json.loads(capsys.readouterr().out).items()
            if k in ("150:31", "150:41:87")} == {"ParaDiTLoader"}


def test_script_dry_run_converts_swaps_and_overrides(tmp_path, capsys):
    path = os.path.join(templates_dir(), "flux_dev_full_text_to_image.json")
    saved = tmp_path / "api.json"
    code = qw.main(["--workflow", path, "--object-info", FIXTURE, "--parallel", "ulysses=2", "--devices", "cpu:2",
                    "--set", "KSampler.steps=4", "--set", "194:49.text=a lighthouse", "--set",
                    "ParaDiTStrategy.warmup_steps=2", "--save-api", str(saved), "--dry-run"])
    err = capsys.readouterr().err
    assert code == qw.EXIT_OK, err
    graph = json.loads(saved.read_text())
    assert graph["194:50"]["inputs"]["steps"] == 4 and graph["194:49"]["inputs"]["text"] == "a lighthouse"
    assert graph["194:46"]["class_type"] == "ParaDiTLoader" and graph["195"]["inputs"]["warmup_steps"] == 2
    assert "UI-format workflow: converted to the 9 API nodes" in err and "is now Load Parallel DiT" in err
    assert qw.main(["--workflow", path, "--object-info", FIXTURE, "--devices", "cpu:2", "--dry-run"]) == qw.EXIT_REJECTED
    assert "--devices and --keep-loader go with --parallel" in capsys.readouterr().err
    qwen = os.path.join(templates_dir(), "image_qwen_image.json")
    assert qw.main(["--workflow", qwen, "--object-info", FIXTURE, "--dry-run"]) == qw.EXIT_REJECTED
    assert "ComfySwitchNode" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# A real ComfyUI (COMFYUI_DIR): its live /object_info, and /prompt's validation of a converted, swapped template.

@pytest.fixture(scope="module")
def live_server():
    """ComfyUI with ParaDiT and no model files (tests/comfy_host.py), stopped with its workers."""
    if not os.environ.get("COMFYUI_DIR"):
        pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against")
    from comfy_host import serve

    yield from serve("paradit-ui-workflow-")


FILE_WIDGETS = {"unet_name", "ckpt_name", "vae_name", "clip_name", "clip_name1", "clip_name2", "clip_name3",
                "clip_name4", "lora_name", "style_model_name", "control_net_name", "name", "image",
                "file"}  # LoadVideo's video file


def validation_errors(server, graph: dict) -> set:
    """POST /prompt: {(error type, input name)} of the server's refusal (these graphs all need files it lacks)."""
    try:
        qw.http_json(f"{server.url}/prompt", {"prompt": graph})
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        return {(err["type"], err["extra_info"].get("input_name")) for n in body["node_errors"].values()
                for err in n["errors"]}
    pytest.fail("the server queued a graph that needs model files it does not have")


@pytest.mark.timeout(400)
def test_live_object_info_converts_the_templates(live_server, object_info):
    """Each template converts with the live /object_info, and /prompt refuses it only for the model and image
    files this server does not have (no missing input, no link of a wrong type, no unknown widget value)."""
    live = live_server.get("/object_info")
    for name in TEMPLATES:
        graph = convert(name, live)
        check_structure(graph, live)
        errors = validation_errors(live_server, graph)
        assert errors and {t for t, _ in errors} <= {"value_not_in_list", "custom_validation_failed"}, (name, errors)
        assert {i for _, i in errors} <= FILE_WIDGETS, (name, errors)
    for name in FAMILY_TEMPLATES:  # with Load Parallel DiT in place of their loaders, as --parallel queues them
        errors = validation_errors(live_server, swapped_family_template(name, live))
        assert errors and {t for t, _ in errors} <= {"value_not_in_list", "custom_validation_failed"}, (name, errors)
        assert {i for _, i in errors} <= FILE_WIDGETS | NEWER_CHOICES.get(name, set()), (name, errors)
    for name, missing in NEEDS_NEWER_HOST.items():
        if missing in live:
            check_structure(convert(name, live), live)
        else:
            with pytest.raises(uw.ConversionError, match=missing):
                convert(name, live)
    # The fixture is this server's: same widgets by position and outputs for every class in it.
    assert {c: (uw.widget_slots(object_info[c]), object_info[c]["output"]) for c in object_info} == {
        c: (uw.widget_slots(live[c]), live[c]["output"]) for c in object_info}


@pytest.mark.timeout(400)
def test_live_prompt_accepts_a_converted_swapped_template(live_server):
    """The server validates the converted graph with Load Parallel DiT 194:46 and the added Strategy Selector 195 and
    misses only the model files (it has none)."""
    cmd = [sys.executable, os.path.join(REPO, "scripts", "queue_workflow.py"), "--server", live_server.address,
           "--workflow", os.path.join(templates_dir(), "flux_dev_full_text_to_image.json"), "--parallel",
           "ulysses=2", "--devices", "cpu:2", "--set", "KSampler.steps=4", "--quiet", "--json", "--timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == qw.EXIT_REJECTED, proc.stdout + proc.stderr
    errors = json.loads(proc.stdout)["error"]["node_errors"]
    seen = {(nid, e["class_type"], err["type"], err["extra_info"]["input_name"])
            for nid, e in errors.items() for err in e["errors"]}
    # (This ComfyUI checks the choices of list-typed combos only, not those of V3 nodes like Load Parallel DiT.)
    assert seen == {("194:47", "DualCLIPLoader", "value_not_in_list", "clip_name1"),
                    ("194:47", "DualCLIPLoader", "value_not_in_list", "clip_name2"),
                    ("194:45", "VAELoader", "value_not_in_list", "vae_name")}, proc.stdout


# ---------------------------------------------------------------------------------------------------
# Writing the fixture (python tests/test_ui_workflow.py --write-fixture HOST:PORT).

def classes_used(workflow: dict) -> set[str]:
    definitions = uw.subgraph_definitions(workflow)
    scopes = [workflow, *definitions.values()]
    return {n.get("type") for s in scopes for n in s.get("nodes") or []} - set(definitions) - uw.FRONTEND_ONLY


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in ("tooltip", "description", "output_tooltips")}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def write_fixture(server: str) -> None:
    live = qw.http_json(f"{qw.base_url(server)}/object_info", timeout=120)
    wanted = {"ParaDiTLoader", "ParaDiTStrategy", "ParaDiTSampler"}
    for name in TEMPLATES + tuple(NEEDS_NEWER_HOST) + FAMILY_TEMPLATES + FAMILY_TEMPLATES_NEWER:
        wanted |= classes_used(template(name))
    for name in os.listdir(os.path.join(REPO, "workflows")):
        if name.endswith(".json"):
            wanted |= classes_used(_load(os.path.join(REPO, "workflows", name)))
    keep = ("input", "input_order", "output", "output_is_list", "output_name", "name", "display_name")
    fixture = {c: _strip({k: live[c][k] for k in keep if k in live[c]}) for c in sorted(wanted) if c in live}
    with open(FIXTURE, "w", encoding="utf-8") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {len(fixture)} classes to {FIXTURE}; not on the server: {sorted(wanted - set(live))}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-fixture":
        write_fixture(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_ui_workflow.py --write-fixture HOST:PORT")
