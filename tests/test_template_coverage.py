"""scripts/template_coverage.py on the pinned template package: every file a template loads is classified, every
family it says ParaDiT runs is one the registry registers, and the counts are the ones the closing notes quote."""
import json
import os
import subprocess
import sys

import pytest

from parallel_runtime.models.registry import families

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import template_coverage as tc  # noqa: E402

pytest.importorskip("comfyui_workflow_templates_json")  # the Makefile installs the pinned package (0.1.123)


@pytest.fixture(scope="module")
def report():
    return tc.coverage(tc.default_templates())


def test_every_family_marked_as_run_is_registered():
    registered = {f.name for f in families()}
    marked = {ours for *_, ours in tc.FILES if ours}
    assert marked <= registered, marked - registered


def test_every_template_file_is_classified_and_the_counts_hold(report):
    # coverage() raises on a file no row matches, so reaching here means every file the package names is classified.
    t = report["totals"]
    # The pinned package (comfyui-workflow-templates-json 0.1.123): 248 templates load a local model, 211 of them an
    # image or video DiT. Covered: 120 whose DiT files the families before FLUX.3 run, less 12 that use a feature they
    # refuse (REFUSED_NODES then: 7 with LTX-2 guides, 1 reference audio, 1 H3 Fun ControlNet, 3 Qwen-Image 2.1 encoder
    # images), plus FLUX.3's base t2i template (its edit template uses references), Wan VACE's 6, HiDream I1 / E1's 5
    # and Kandinsky 5's 3 (text-to-image, text-to-video, image-to-video), Wan 2.1 FLF2V's 1, HiDream O1's 2 (both
    # carry HiDreamO1ReferenceImages, which runs), Wan ATI's, WanMove's and ChronoEdit's 3, and Wan 2.2 Bernini's 2
    # (BerniniConditioning's in-context latents), and the 7 LTX-2 templates with guide frames (LTXVAddGuide: first-last
    # frame, IC-LoRA control, style transition) and the 3 Qwen-Image 2.1 edit templates whose TextEncodeQwenImage21
    # places the images inside the prompt (image slots), and LTX-2.3's ID-LoRA template (LTXVReferenceAudio's reference
    # audio). A new family raises it; a lost one lowers it: update with
    # docs/families.md.
    assert (t["templates_loading_a_local_model"], t["templates_loading_a_dit"]) == (248, 211)
    assert (t["covered"], t["files_run_but_a_feature_refused"]) == (142, 2)


def test_a_template_with_a_refused_variant_beside_a_run_one_is_not_covered(report):
    templates = report["templates"]
    # video_wan2_2_14B_s2v loads the S2V file, which Wan's family refuses (one sentence naming it): not covered.
    s2v = templates["video_wan2_2_14B_s2v"]
    assert any(f.startswith("wan2.2_s2v_") for f in s2v["files"]) and not s2v["covered"]
    # The Fun control template (two 14B experts, both Fun control files) is, and Wan 2.1's first-last-frame one.
    assert templates["video_wan2_2_14B_fun_control"]["covered"] and templates["wan2.1_flf2v_720_f16"]["covered"]
    # A file ParaDiT runs with a feature its family refuses: FLUX.3 edit (ReferenceMultiLatent) is not covered;
    # LTX-2.3 first-last-frame (LTXVAddGuide's guide frames), ID-LoRA (LTXVReferenceAudio) and text-to-video are.
    assert templates["image_flux3_klein_image_edit"]["refused"] == ["FLUX.3 reference images"]
    assert templates["video_ltx2_3_id_lora"]["covered"] and not templates["video_ltx2_3_id_lora"]["refused"]
    # HiDream O1's two templates carry HiDreamO1ReferenceImages, which runs on the workers (its vision tower).
    assert all(templates[n]["covered"] and not templates[n]["refused"] for n in ("image_hidream_o1",
                                                                                  "image_hidream_o1_dev"))
    # Wan 2.1 ATI (WanTrackToVideo's concat), WanMove (each branch's own concat) and ChronoEdit (ScaleROPE on a Wan
    # 2.1 I2V file) run.
    assert all(templates[n]["covered"] for n in ("video_wan_ati", "video_wanmove_480p", "image_chrono_edit_14B"))
    # Wan 2.2 Bernini's two editing templates (the experts read BerniniConditioning's in-context latents) run; Wan
    # Dancer's does not (its audio and global motion streams are refused).
    assert all(templates[n]["covered"] for n in ("video_bernini_r_image_editing", "video_bernini_r_video_editing"))
    assert not templates["video_wan_dancer"]["covered"]
    # Kandinsky 5: all three templates (image-to-video's start image is written over the start frames at the door).
    assert all(templates[n]["covered"] for n in ("image_kandinsky5_t2i", "video_kandinsky5_t2v",
                                                  "video_kandinsky5_i2v"))
    assert all(templates[n]["covered"] for n in ("video_ltx2_3_flf2v", "video_ltx2_5_flf2v", "video_ltx2_3_ic_lora",
                                                  "video_ltx2_canny_to_video", "video_ltx2_3_t2v",
                                                  "image_qwen_image_2_1_image_edit",
                                                  "image_qwen_image_2_1_turbo_image_edit"))
    # A template of UNets only does not load a DiT at all.
    sdxl = [n for n, t in templates.items() if t["files"] == ["sd_xl_base_1.0.safetensors"]]
    assert sdxl and not any(templates[n]["loads_dit"] for n in sdxl)


def test_an_unknown_file_name_is_one_sentence():
    with pytest.raises(ValueError, match="no row of scripts/template_coverage.py's FILES matches it; add one"):
        tc.classify("mystery_model_v9.safetensors")


def test_the_command_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "coverage.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "template_coverage.py"), "--json", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "ParaDiT's families run 142 of them, every DiT file and feature" in run.stdout
    assert json.loads(out.read_text())["totals"]["covered"] == 142
