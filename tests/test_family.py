"""The model-family seam: detection by keys, one sentence for files no family claims, planning through the
family, and strategy code that never imports a family module."""
from __future__ import annotations

import ast
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel_runtime.planning import costmodel
from parallel_runtime.errors import ModelFileError
from parallel_runtime.weights.checkpoint import CheckpointReader
from parallel_runtime.models.family import Match
from parallel_runtime.models.registry import detect_family, family_of, families, read_model
from parallel_runtime.models.families.flux_adapter import FLUX
from parallel_runtime.models.families.flux_adapter import parameter_counts, pipeline_stages
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.validate import model_config

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel_runtime")


@pytest.mark.parametrize("layout, prefix", [("bfl", ""), ("bfl", "model.diffusion_model."), ("diffusers", "")])
def test_flux_is_detected_in_each_layout_and_prefix(tmp_path, layout, prefix):
    path = write_checkpoint(str(tmp_path / "f.safetensors"), TINY, seed=0, layout=layout, prefix=prefix)
    with CheckpointReader(path) as reader:
        family, match, config = read_model(reader)
    assert family is FLUX and match == Match(layout, prefix) and config == TINY
    assert family_of(config) is FLUX and model_config(path) == TINY


@pytest.mark.parametrize("keys, what", [
    (["model.diffusion_model.input_blocks.0.0.weight", "model.diffusion_model.middle_block.0.in_layers.0.weight"],
     "its keys look like a UNet (SD1.x/SDXL)"),
    (["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"], "its keys look like an SD3 MMDiT"),
    (["distilled_guidance_layer.in_proj.weight", "double_blocks.0.img_attn.qkv.weight"], "its keys look like Chroma"),
    (["transformer_blocks.0.img_mod.1.weight", "img_in.weight"], "its keys look like Qwen-Image"),
    (["blocks.0.cross_attn.q_linear.weight", "y_embedder.y_proj.fc1.weight"], "its keys look like PixArt"),
    ([], "it holds no tensors"),
])
def test_a_file_no_family_claims_gets_one_sentence_naming_what_it_looks_like(keys, what):
    with pytest.raises(ModelFileError) as ei:
        detect_family(keys, "x.safetensors")
    assert str(ei.value) == (f"x.safetensors is not a DiT checkpoint ParaDiT runs ({what}); ParaDiT runs "
                             f"{', '.join(f.title for f in families())}: choose one of those from "
                             f"models/diffusion_models.")


def test_a_damaged_flux_file_is_refused_by_the_family_with_its_own_sentence(tmp_path):
    path = str(tmp_path / "cut.safetensors")
    write_checkpoint(path, TINY, seed=0)
    with CheckpointReader(path) as reader:
        tensors = {k: torch.zeros(reader.shape(k)) for k in reader.keys() if not k.startswith("txt_in.")}
    save_file(tensors, path)
    with pytest.raises(ModelFileError, match=r"has no tensor 'txt_in.weight'.*re-download"):
        model_config(path)


def test_planning_asks_the_family():
    assert costmodel.param_layout(TINY).blocks == list(parameter_counts(TINY)[0])
    assert FLUX.pipeline_stages(TINY, 2) == pipeline_stages(TINY, 2)
    expected = [{kind: n for kind, n in (("double", sum(i < TINY.num_layers for c in chunks for i in c)),
                                          ("single", sum(i >= TINY.num_layers for c in chunks for i in c))) if n}
                for chunks in pipeline_stages(TINY, 2)]
    assert costmodel.stage_block_kinds(TINY, 2) == expected


STRATEGY_MODULES = [os.path.join("distributed", "topology.py"), os.path.join("distributed", "comm.py"),
                    os.path.join("planning", "traffic.py"),
                    *(os.path.relpath(os.path.join(d, f), ROOT)
                      for d, _, fs in os.walk(os.path.join(ROOT, "strategies")) for f in fs if f.endswith(".py"))]


@pytest.mark.parametrize("module", STRATEGY_MODULES)
def test_strategy_code_never_imports_a_family_module(module):
    """A new family is a module plus its entry in FAMILIES: no strategy may depend on one family."""
    tree = ast.parse(open(os.path.join(ROOT, module)).read())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    family_modules = [m for m in imported if m.split(".")[-1] in ("flux", "flux_adapter", "chroma", "sd3", "tiny")]
    assert not family_modules, f"{module} imports {family_modules}"


@pytest.mark.parametrize("layout, prefix, extra, what", [
    # A distilled guidance layer without its input projection: Chroma-like, yet not a complete Chroma file.
    ("diffusers", "", "distilled_guidance_layer.layers.0.linear_1.weight",
     r"is not a DiT checkpoint ParaDiT runs \(its keys look like Chroma\)"),
    # FLUX.2's shared modulation on Flux.1's biased blocks: FLUX.2's detection names it (tests/test_flux2.py).
    ("bfl", "", "double_stream_modulation_img.lin.weight",
     r"has FLUX.2's shared modulation but also 'img_in.bias'.*choose a FLUX.2 dev or klein file"),
])
def test_flux_look_alikes_are_named_not_loaded_as_broken_flux_files(tmp_path, layout, prefix, extra, what):
    """Chroma and FLUX.2 reuse Flux.1's block names: Flux must not claim them (it would call them damaged).
    (A complete Chroma file is Chroma's: tests/test_families.py.)"""
    path = write_checkpoint(str(tmp_path / "f.safetensors"), TINY, seed=0, layout=layout, prefix=prefix)
    save_file({**load_file(path), prefix + extra: torch.zeros(4)}, path)
    with pytest.raises(ModelFileError, match=what):
        model_config(path)
