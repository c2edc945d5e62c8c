"""The nodes' words match the family registry: no sentence a user reads in nodes/ says ParaDiT samples only images
(or one family's files) while the registry runs video and many families, every family a sentence lists as a video
model is one the registry runs as video, and README's opening paragraph names every registered family."""
from __future__ import annotations

import ast
import os
import re

import pytest

from parallel_runtime.models.registry import families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def node_sentences() -> list[tuple[str, int, str]]:
    """(file, line, text) of every string in nodes/*.py; an f-string's placeholders read as "{}"."""
    found = []
    folder = os.path.join(ROOT, "nodes")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                found.append((name, node.lineno, text))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append((name, node.lineno, node.value))
    return found


def short_names(title: str) -> list[str]:
    """What a sentence may call a family: "Wan 2.1 / 2.2 (text- and image-to-video)" -> Wan 2.1 / 2.2, Wan 2.1,
    Wan; "PixArt-α / PixArt-Σ" -> PixArt-α, PixArt-Σ, PixArt."""
    name = title.split(" (")[0]
    names = [name, *name.split(" / ")]
    return names + [n.split("-α")[0].split("-Σ")[0].split(" ")[0] for n in names]


VIDEO = [f for f in families() if "video" in f.title.lower()]
IMAGE = [f for f in families() if f not in VIDEO]


def test_the_registry_runs_video_and_many_families():
    """The premise of the checks below (were it false, their claims would be true, not contradictions)."""
    assert [f.name for f in VIDEO] == ["ltx2", "wan", "hunyuan_video15", "minimax_h3", "kandinsky6",
                                      "kandinsky5"] and len(IMAGE) >= 9


# Claims that contradict a registry with video families and many image families.
ONLY_IMAGES = re.compile(r"ParaDiT (samples|runs|takes|supports) (only )?images|samples images only|"
                         r"only image (models|latents)", re.I)
ONE_FAMILY_FILE = re.compile(r"\bAn? (Flux|SD3|Chroma|Wan|PixArt|Qwen-Image)(\.1)? (checkpoint|file|model)\b")


def test_no_node_sentence_says_paradit_samples_only_images_or_one_family():
    wrong = [(f, line, text) for f, line, text in node_sentences()
             if ONLY_IMAGES.search(text) or ONE_FAMILY_FILE.search(text)]
    assert wrong == []


def test_every_family_a_sentence_lists_as_video_is_a_registered_video_family():
    video_names = {n for f in VIDEO for n in short_names(f.title)}
    listed = []
    for _, _, text in node_sentences():
        for group in re.findall(r"video models? \(([^)]*)\)", text):
            listed += [item.strip() for item in group.split(",")]
    assert listed, "the check found no video list to check: the frames sentence names the video families"
    assert [n for n in listed if n not in video_names] == []


def test_readme_opening_names_every_registered_family():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    opening = text.split("\n## ")[0]
    missing = [f.title for f in families() if not any(n in opening for n in short_names(f.title))]
    assert missing == []
    assert "video" in opening


@pytest.mark.parametrize("sentence", ["ParaDiT samples images, so use EmptySD3LatentImage.",
                                      "A Flux checkpoint in models/diffusion_models."])
def test_the_checks_catch_the_old_sentences(sentence):
    assert ONLY_IMAGES.search(sentence) or ONE_FAMILY_FILE.search(sentence)
