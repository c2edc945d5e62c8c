"""Which of ComfyUI's own templates ParaDiT's families run, counted by the model files each template loads.

Standard library only. Reads every UI-format template of the pinned `comfyui-workflow-templates-json` package
(or a folder given with --templates), collects the files its model loaders name (UNETLoader, Load Checkpoint and
the image-only one, inside subgraphs too), classifies each file by its name (the table below) and prints one row per
model kind, then the totals; --json writes the same as JSON.

A template counts as *covered* when it loads at least one image or video diffusion transformer, every such file
belongs to a family ParaDiT runs, and it uses none of the features those families refuse in one sentence
(REFUSED_NODES: FLUX.3's references, MiniMax-H3's Fun ControlNet); a template that also loads a file of a family ParaDiT
refuses (Wan S2V beside Wan 2.2, say) is not covered. The table is by file name because the templates ship names, not tensors; the tests
check that every file the pinned package names is classified and that each family marked as run is registered in
`parallel_runtime.models.registry`, so the count cannot claim a family the runtime lacks.

    python scripts/template_coverage.py [--templates DIR] [--json out.json] [--list]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

LOADERS = ("UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader", "UnetLoaderGGUF")

# Kinds of model a template loads. Only "dit" (image or video diffusion transformers, ParaDiT's subject) counts.
DIT, AUDIO, THREE_D, UNET, OTHER = "dit", "audio", "3d", "unet", "not a generator"

# (file-name pattern, kind, family, ParaDiT family name when it runs the file, else None). First match wins, so a
# variant ParaDiT refuses comes before its family's general pattern. Family names are registry titles' `name`s.
FILES = (
    # Wan's variants ParaDiT does not run yet come before Wan's general pattern.
    (r"wan2\.1_vace_", DIT, "Wan 2.1 VACE", "wan"),
    (r"wan2\.2_s2v_", DIT, "Wan 2.2 S2V", None),
    (r"wan_animate_2_", DIT, "Wan Animate 2", None),
    # Wan 2.2 Animate (WanAnimateToVideo's pose and face video): no template of the pinned package loads it yet.
    (r"(?i)wan2[._]2[-_]animate[-_]14B", DIT, "Wan 2.2 Animate (pose and face video)", "wan"),
    (r"wan2\.1_14B_SCAIL", DIT, "Wan 2.1 SCAIL", None),
    # ATI: a Wan 2.1 I2V 14B file; WanTrackToVideo moves the start latent along the tracks (concat channels).
    (r"Wan2_1-I2V-ATI-", DIT, "Wan 2.1 ATI (trajectories)", "wan"),
    # WanMove: a Wan 2.1 I2V 14B file; WanMoveTrackToVideo writes track features into the positive's concat only.
    (r"Wan21-WanMove", DIT, "Wan 2.1 WanMove", "wan"),
    (r"wan2\.1_flf2v_", DIT, "Wan 2.1 first-last-frame (FLF2V)", "wan"),
    # Bernini: the Wan 2.2 A14B text-to-video experts fine-tuned to read BerniniConditioning's context_latents (the
    # Wan family's in-context streams). Dancer needs its audio and global motion streams, which Wan refuses.
    (r"wan2\.2_bernini_", DIT, "Wan 2.2 Bernini (in-context latents)", "wan"),
    (r"wan2\.2_dancer_", DIT, "Wan 2.2 Dancer (audio-driven), unverified", None),
    (r"humo_", DIT, "HuMo (Wan-based, audio-driven)", None),
    # ChronoEdit: a Wan 2.1 I2V 14B file whose template puts the edited frame at time 7 with ScaleROPE (scale_t).
    (r"chrono_edit_", DIT, "ChronoEdit (Wan 2.1 I2V + ScaleROPE)", "wan"),
    (r"wan2\.[12]_fun_", DIT, "Wan Fun control / inpaint / camera", "wan"),
    (r"(?i)wan2[._]?[12][-_](t2v|i2v|ti2v)", DIT, "Wan 2.1 / 2.2", "wan"),
    # Flux.1 and its relatives.
    (r"pid_flux1_", DIT, "PID (Flux.1-based pixel upscaler)", None),
    (r"^flux1-|^flux\.1-", DIT, "Flux.1 (dev, schnell, Kontext, Fill, Canny, Krea)", "flux"),
    (r"^Chroma1-", DIT, "Chroma", "chroma"),
    (r"^chroma-radiance", DIT, "Chroma Radiance (pixel space)", None),
    (r"^flux-2-|^flux2_", DIT, "FLUX.2 (dev, klein)", "flux2"),
    (r"^flux3-image-klein-base-", DIT, "FLUX.3 image klein (base)", "flux3"),
    (r"^flux3-", DIT, "FLUX.3 step-distilled (flow-map)", None),
    (r"^hidream_o1_", DIT, "HiDream O1", "hidream_o1"),
    (r"^hidream_[ie]1", DIT, "HiDream I1 / E1", "hidream"),
    (r"^hunyuanvideo1\.5_1080p_sr", DIT, "HunyuanVideo 1.5 super-resolution", None),
    (r"^hunyuanvideo1\.5_", DIT, "HunyuanVideo 1.5", "hunyuan_video15"),
    (r"^hunyuan_video_", DIT, "HunyuanVideo 1", None),
    (r"^kandinsky5", DIT, "Kandinsky 5", "kandinsky5"),
    (r"^ltx-video-", DIT, "LTX-Video 0.9", None),
    (r"^ltx-2", DIT, "LTX-2 / 2.3 / 2.5", "ltx2"),
    (r"^(minimax_h3_|fasth3_|fastvideo_fasth3_)", DIT, "MiniMax-H3 (FastH3 unverified on real files)", "minimax_h3"),
    (r"^NetaYume", DIT, "Lumina 2 (NetaYume)", "lumina2"),
    (r"^qwen_image_2\.1_", DIT, "Qwen-Image 2.1", "qwen_image21"),
    (r"^qwen_image_layered", DIT, "Qwen-Image Layered", None),
    (r"^qwen_image_", DIT, "Qwen-Image (incl. Edit 2509 / 2511, 2512)", "qwen_image"),
    (r"^sd3\.5_", DIT, "SD3 / 3.5", "sd3"),
    (r"^z_image_", DIT, "Z-Image", "z_image"),
    (r"^(anima-|boogu_|capybara_|causal_forcing|ernie-image|fibo2_|FireRed-Image|ideogram4_|joyai_|krea2_|lens_"
     r"|longcat_image|mage_flow|ming_image|moss_image|NewBie-Image|omnigen2_|ovis_image|pixeldit_|void_pass)",
     DIT, "other image / video DiTs (no ParaDiT family)", None),
    (r"^seedvr2_", DIT, "SeedVR2 (video restoration)", None),
    (r"^(ace_step|acestep|stable-audio|stable_audio|minimax_music3|yue2_)", AUDIO, "audio / music", None),
    (r"^(hunyuan3d|hunyuan_3d|trellis|triposplat|pixal3d)", THREE_D, "3D shape", None),
    (r"^(sd_xl|svd_xt|lotus-depth|sdpose)", UNET, "SD / SDXL / SVD UNets", None),
    (r"^(rt_detr|sam3)", OTHER, "detector / segmenter", None),
)


# Nodes whose input the family of the file they feed refuses in one sentence (a file ParaDiT runs, a feature it does
# not run yet): (node class, the input that must be linked for the refusal, or None for the node alone, what).
# A template with one of these, not bypassed or muted, is not covered.
REFUSED_NODES = (
    ("MiniMaxH3FunControlNetApply", None, "MiniMax-H3 Fun ControlNet union"),
    ("ReferenceMultiLatent", None, "FLUX.3 reference images"),
)
ACTIVE = 0  # a node's mode: 0 runs, 2 muted, 4 bypassed


def template_nodes(graph: dict) -> list[dict]:
    nodes = list(graph["nodes"])
    for sub in graph.get("definitions", {}).get("subgraphs", []):
        nodes += sub.get("nodes", [])
    return nodes


def refused_features(graph: dict) -> set[str]:
    """What of REFUSED_NODES a UI-format template uses."""
    found = set()
    for node in template_nodes(graph):
        if node.get("mode", ACTIVE) != ACTIVE:
            continue
        for cls, linked, what in REFUSED_NODES:
            if node.get("type") == cls and (linked is None or any(
                    i.get("name", "").startswith(linked) and i.get("link") is not None
                    for i in node.get("inputs", []))):
                found.add(what)
    return found


def template_files(path: str) -> set[str] | None:
    """The model files a UI-format template's loaders name, or None for what is not a UI workflow."""
    graph = _read(path)
    if graph is None:
        return None
    files = set()
    for node in template_nodes(graph):
        values = node.get("widgets_values")
        if node.get("type") in LOADERS and isinstance(values, list) and values and isinstance(values[0], str):
            files.add(values[0])
    return files


def _read(path: str) -> dict | None:
    with open(path, encoding="utf-8") as f:
        graph = json.load(f)
    return graph if isinstance(graph, dict) and "nodes" in graph else None


def classify(file: str) -> tuple[str, str, str | None]:
    """(kind, family, ParaDiT family name or None) of a model file, or ValueError for a name the table lacks."""
    for pattern, kind, family, ours in FILES:
        if re.search(pattern, file):
            return kind, family, ours
    raise ValueError(f"{file}: no row of scripts/template_coverage.py's FILES matches it; add one")


def default_templates() -> str:
    import comfyui_workflow_templates_json  # the pinned package (Makefile installs it)
    return os.path.join(os.path.dirname(comfyui_workflow_templates_json.__file__), "templates")


def coverage(folder: str) -> dict:
    """Per template its files and verdict; per family the templates loading it; and the totals."""
    templates, families = {}, {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        name = os.path.basename(path)[:-len(".json")]
        if name.startswith(("index", "api_")):
            continue
        files = template_files(path)
        if not files:
            continue
        kinds = {f: classify(f) for f in sorted(files)}
        dits = [k for k in kinds.values() if k[0] == DIT]
        refused = sorted(refused_features(_read(path))) if dits else []
        covered = bool(dits) and all(ours for _, _, ours in dits) and not refused
        templates[name] = {"files": sorted(files), "loads_dit": bool(dits), "covered": covered, "refused": refused}
        for kind, family, ours in set(kinds.values()):
            row = families.setdefault(family, {"kind": kind, "paradit": ours, "templates": []})
            row["templates"].append(name)
    dit_templates = [t for t in templates.values() if t["loads_dit"]]
    totals = {"templates_loading_a_local_model": len(templates), "templates_loading_a_dit": len(dit_templates),
              "covered": sum(t["covered"] for t in dit_templates),
              "files_run_but_a_feature_refused": sum(bool(t["refused"]) and all(
                  classify(f)[2] for f in t["files"] if classify(f)[0] == DIT) for t in dit_templates)}
    return {"folder": folder, "totals": totals, "families": families, "templates": templates}


def print_table(report: dict, show_templates: bool = False) -> None:
    rows = sorted(report["families"].items(), key=lambda kv: (kv[1]["kind"] != DIT, kv[1]["paradit"] is None,
                                                               -len(kv[1]["templates"]), kv[0]))
    print(f"{'model kind / family':58} {'kind':16} {'ParaDiT':14} templates")
    for family, row in rows:
        print(f"{family[:58]:58} {row['kind']:16} {row['paradit'] or '-':14} {len(row['templates'])}")
        if show_templates:
            for t in sorted(row["templates"]):
                print(f"    {t}")
    t = report["totals"]
    print(f"\n{t['templates_loading_a_local_model']} templates load a local model, {t['templates_loading_a_dit']} an "
          f"image or video DiT; ParaDiT's families run {t['covered']} of them, every DiT file and feature "
          f"({100 * t['covered'] / max(t['templates_loading_a_dit'], 1):.0f}%); {t['files_run_but_a_feature_refused']} "
          f"more load files ParaDiT runs but use a feature it refuses (REFUSED_NODES).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--templates", help="folder of UI-format templates (default: the pinned package's)")
    parser.add_argument("--json", help="write the report here as JSON")
    parser.add_argument("--list", action="store_true", help="name the templates under each family")
    args = parser.parse_args(argv)
    try:
        report = coverage(args.templates or default_templates())
    except (ValueError, ImportError, OSError) as e:
        print(f"template_coverage: {e}", file=sys.stderr)
        return 2
    print_table(report, args.list)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
