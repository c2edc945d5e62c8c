"""Another machine in a real ComfyUI host (skipped without COMFYUI_DIR): ComfyUI started with
<user dir>/paradit/cluster.json opens the front door as it loads the plugin, so a real agent (`python -m
parallel_runtime agent`, here on loopback) joins before any prompt and shows in /paradit/status; Load Parallel DiT
on `cpu:1,box-b:cpu:1` lists each rank with its host, and its CFG-parallel job across the two equals UNETLoader; a
prompt naming a machine that has not joined fails in cluster.py's sentence, and ComfyUI keeps serving.

The namespace tests (test_multinode_cluster.py) take the runtime across real links; this one takes the ComfyUI side:
the plugin's load, the loader's text, the status route.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from comfy_host import COMFYUI_DIR

if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: no ComfyUI host to test against", allow_module_level=True)

import torch  # noqa: E402

import comfy_host  # noqa: E402
from comfy_host import COMFYUI_PYTHON, REPO, explain, serve  # noqa: E402
from conftest import rel_err  # noqa: E402
from parallel_runtime.models.tiny import write_checkpoint  # noqa: E402
from parallel_runtime.runtime.auth import new_key_file  # noqa: E402

pytestmark = pytest.mark.timeout(900)

DIT = comfy_host.FLUX_MINI_FILE
# fp32 on CPU: UNETLoader's model and the workers' run the same float32 maths in another op order (~1e-7 per op
# over 2 blocks and 3 steps); CFG parallel only moves each branch's output between the ranks (exact).
EXACT_RTOL = 1e-4
JOIN_S = 60  # the agent's Python imports torch before it joins: seconds on a loaded 2-core machine


class Setup:
    port = 0  # the front door's, chosen when the server's folders are written


def write_root(root: str) -> None:
    """The server's model, and its user folder's paradit/cluster.json with the key file beside it."""
    write_checkpoint(os.path.join(root, "models", "diffusion_models", DIT), comfy_host.FLUX_MINI, seed=1,
                     prefix="model.diffusion_model.", dtype=torch.float32)
    folder = os.path.join(root, "user", "paradit")
    os.makedirs(folder)
    new_key_file(os.path.join(folder, "paradit.key"))
    Setup.port = comfy_host._free_port()
    with open(os.path.join(folder, "cluster.json"), "w") as f:
        json.dump({"listen": f"127.0.0.1:{Setup.port}", "key_file": "paradit.key"}, f)


@pytest.fixture(scope="module")
def server():
    yield from serve("paradit-comfyui-multinode-", write_root)


@pytest.fixture(scope="module")
def agent(server):
    """The agent `box-b` lending one CPU worker, started only after ComfyUI answers (nothing else opened the door:
    no prompt has run), with ComfyUI's Python, as on a second machine with the same ParaDiT; stopped after."""
    log = open(os.path.join(server.root, "agent.log"), "w")
    proc = subprocess.Popen(
        [COMFYUI_PYTHON, "-m", "parallel_runtime", "agent", "--join", f"127.0.0.1:{Setup.port}", "--key-file",
         os.path.join(server.root, "user", "paradit", "paradit.key"), "--name", "box-b", "--devices", "cpu:1",
         "--models", os.path.join(server.root, "models", "diffusion_models"), "--threads", "1", "--once"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join((comfy_host.CPU_SHIM, REPO))))  # as ComfyUI's own workers
    log.close()
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)  # the agent ends its workers first
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        comfy_host.stop_group(proc)


def cluster_status(server) -> dict:
    return server.get("/paradit/status")["cluster"]


def graph(devices: str, reference: bool = True) -> dict:
    """Seeded prompts, a 64x64 latent, CFG 2 split over two ranks (manual), the same KSampler chain on Load
    Parallel DiT (11 -> 12 -> 13) and, with `reference`, on UNETLoader (20 -> 21 -> 22)."""
    sampling = {"seed": 5, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": ["1", 0], "negative": ["2", 0], "latent_image": ["4", 0]}
    g = {"1": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 1, "tokens": 8, "guidance": 3.5}},
         "2": {"class_type": "ParaDiTTestConditioning", "inputs": {"seed": 2, "tokens": 8, "guidance": 3.5}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "10": comfy_host.strategy(cfg=2, warmup=3),
         "11": {"class_type": "ParaDiTLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default",
                                                          "devices": devices, "strategy": ["10", 0]}},
         "20": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT, "weight_dtype": "default"}}}
    for loader, sampler, save in (("11", "12", "13"), ("20", "21", "22"))[:2 if reference else 1]:
        g[sampler] = {"class_type": "KSampler", "inputs": dict(sampling, model=[loader, 0])}
        g[save] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"m/{save}"}}
    return g


def wait_joined(server, agent) -> dict:
    deadline = time.monotonic() + JOIN_S
    while True:
        joined = [a for a in cluster_status(server)["agents"] if a["name"] == "box-b" and a["alive"]]
        if joined:
            return joined[0]
        assert agent.poll() is None, open(os.path.join(server.root, "agent.log")).read()
        assert time.monotonic() < deadline, f"box-b did not join in {JOIN_S} s: {cluster_status(server)}"
        time.sleep(0.5)


def test_multinode_comfyui_opens_the_front_door_at_load_and_an_agent_joins_before_any_prompt(server, agent):
    status = cluster_status(server)  # before any prompt, and before the agent's Python has started torch
    assert status["listen"] == f"127.0.0.1:{Setup.port}" and status["refusals"] == []
    assert f"agents of other machines may join at 127.0.0.1:{Setup.port}" in server.log_tail(400)
    joined = wait_joined(server, agent)
    assert joined["devices"] == ["cpu"] and joined["peer"].startswith("127.0.0.1:")


def test_multinode_comfyui_job_across_two_hosts_equals_unetloader(server, agent):
    wait_joined(server, agent)
    result = server.run(graph("cpu:1,box-b:cpu:1"))
    assert result["status"] == "success", explain(result)
    assert result["outputs"]["11"]["text"][0].startswith(f"{DIT} (default) on cpu, box-b cpu; ")
    par, ref = server.latent(result, "13"), server.latent(result, "22")
    err = rel_err(par, ref)
    print(f"\ncfg2 across this host and box-b: rel. L2 {err:.2e} vs UNETLoader")
    assert par.shape == ref.shape == (1, 16, 8, 8) and err <= EXACT_RTOL
    [client] = server.get("/paradit/status")["clients"]
    assert [(w["rank"], w["host"], w["device"]) for w in client["workers"]] == [(0, "local", "cpu"),
                                                                               (1, "box-b", "box-b cpu")]
    assert [a["name"] for a in client["cluster"]["agents"]] == ["box-b"]


def test_multinode_comfyui_refuses_a_host_that_has_not_joined(server, agent):
    wait_joined(server, agent)
    result = server.run(graph("cpu:1,gpu-box-2:0", reference=False))
    assert result["status"] == "error", explain(result)
    assert result["error"]["exception_message"].startswith(
        "the host gpu-box-2 is not connected (no agent of that name has joined; joined: box-b): start `python -m "
        f"parallel_runtime agent --join 127.0.0.1:{Setup.port} --key-file KEY --name gpu-box-2`")
    assert server.get("/system_stats")  # ComfyUI keeps serving
