"""UI-format workflows queued headless: scripts/ui_workflow.py (UI format -> the API format ComfyUI's editor queues)
and scripts/paradit_swap.py (queue_workflow.py --parallel), on ComfyUI's own templates.

The templates come from the PyPI package comfyui-workflow-templates-json, pinned in constraints.txt (TEMPLATES_VERSION
below). The node classes come from tests/fixtures/object_info_templates.json: the GET /object_info entries of the
classes those templates and workflows/ use, taken from ComfyUI 0.3.64 with ParaDiT installed (tooltips and
descriptions left out). To write it again from a running server:

    python tests/test_ui_workflow.py --write-fixture 127.0.0.1:8188

- Two templates (Flux dev text-to-image with its subgraph, Flux Canny) are compared with API graphs written here by
  hand from the template files; our own workflows/*.json with their API twins in workflows/api/.
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
import tempfile
import time
import urllib.error

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import paradit_swap  # noqa: E402
import queue_workflow as qw  # noqa: E402
import ui_workflow as uw  # noqa: E402

FIXTURE = os.path.join(REPO, "tests", "fixtures", "object_info_templates.json")
TEMPLATES_VERSION = "0.1.123"
# Templates checked here, each for what it has: subgraphs (proxy widgets, nested), primitives, reroutes, bypassed
# and muted nodes, checkpoint loaders; the last needs a node class the 0.3.64 host lacks (ComfySwitchNode).
TEMPLATES = ("flux_dev_full_text_to_image", "flux_canny_model_example", "flux_fill_inpaint_example",
             "flux_fill_outpaint_example", "flux_kontext_dev_basic", "flux_depth_lora_example", "flux_redux_model_example",
             "flux_schnell", "flux1_dev_uso_reference_image_gen", "sd3.5_simple_example", "sd3.5_large_depth",
             "hidream_e1_1", "hunyuan_video_text_to_video", "image_qwen_image_controlnet_patch")
NEEDS_NEWER_HOST = {"image_qwen_image": "ComfySwitchNode"}


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


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "workflows")) if f.endswith(".json")))
def test_our_ui_workflows_convert_to_their_api_twins(object_info, name):
    graph = convert(_load(os.path.join(REPO, "workflows", name + ".json")), object_info)
    twin = _load(os.path.join(REPO, "workflows", "api", name + ".json"))
    assert {k: (n["class_type"], n["inputs"]) for k, n in graph.items()} == {
        k: (n["class_type"], n["inputs"]) for k, n in twin.items()}


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
            assert name in defs, f"{nid} {n['class_type']} has no input {name}"
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


def test_a_node_class_the_server_lacks_is_one_sentence(object_info):
    name, missing = next(iter(NEEDS_NEWER_HOST.items()))
    with pytest.raises(uw.ConversionError) as e:
        convert(name, object_info)
    text = str(e.value)
    assert missing in text and "/object_info" in text and "install" in text and text.count(". ") == 0


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
    for name in TEMPLATES + tuple(NEEDS_NEWER_HOST):
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
