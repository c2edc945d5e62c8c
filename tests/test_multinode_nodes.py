"""The ComfyUI side of the multi-machine runtime, run without ComfyUI (test_nodes.py's stand-ins): the front door
opens when the plugin's node list loads (from the environment or <user dir>/paradit/cluster.json), a bad setting
is logged without stopping the load and repeated by Load Parallel DiT, and the loader lists every rank with its
host, or refuses a machine that has not joined in cluster.py's sentence.

The agent is the real one (runtime/agent.py's Agent) joining over loopback, in a thread of this process: the
same handshake and hello a remote machine's agent sends, without a second Python starting torch."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import socket
import threading
import types

import pytest

from parallel_runtime.errors import ConfigError
from parallel_runtime.runtime import cluster
from parallel_runtime.runtime.agent import Agent
from parallel_runtime.runtime.auth import new_key_file, read_key_file
from test_nodes import FakeHost, _load_plugin, cond, folder_paths, handle, latent, runtime  # noqa: F401 - the fake
from test_nodes import sampler_mod  # comfy_api, the fixtures and fakes of ComfyUI and of the runtime

from nodes import front_door  # noqa: E402 - after test_nodes put the fake comfy_api in place
from nodes.loader import ParaDiTLoader  # noqa: E402

SETTINGS = ("PARADIT_LISTEN", "PARADIT_KEY_FILE")
NODES = ["ParaDiTStrategy", "ParaDiTLoader", "ParaDiTSampler", "ParaDiTVAEDecode"]
PLUGIN = "paradit_plugin_under_test"  # test_nodes._load_plugin's module name


@pytest.fixture
def user_dir(folder_paths, monkeypatch, tmp_path):  # noqa: F811 - test_nodes' fixture, extended
    """ComfyUI's user folder for folder_paths, no front door open and no settings in the environment before
    the test; the door closed and the settings gone after it."""
    folder = tmp_path / "user"
    (folder / "paradit").mkdir(parents=True)
    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(folder), raising=False)
    monkeypatch.setattr(cluster, "AGENT_SILENCE_S", cluster.AGENT_SILENCE_S)  # restored if a test shortens it
    monkeypatch.setattr(front_door, "_from_file", {})
    saved = {k: os.environ.pop(k) for k in SETTINGS if k in os.environ}
    cluster.close_front_door()
    try:
        yield folder
    finally:
        cluster.close_front_door()
        for k in SETTINGS:
            os.environ.pop(k, None)
        os.environ.update(saved)


@pytest.fixture
def key_file(tmp_path) -> str:
    path = str(tmp_path / "user" / "paradit" / "paradit.key")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    new_key_file(path)
    return path


@pytest.fixture
def loaded(monkeypatch):
    """Load Parallel DiT's MODEL wrapping the handle (the real one needs ComfyUI: tests/test_comfyui_*.py)."""
    from nodes import remote_model

    monkeypatch.setattr(remote_model, "parallel_model", lambda h: types.SimpleNamespace(handle=h))


def load_nodes() -> dict:
    """The plugin as a fresh ComfyUI loads it (its own copy of the node modules, as ComfyUI imports it by path):
    node_id -> node class, with the loader's MODEL wrapping the handle (the real one needs ComfyUI)."""
    import asyncio
    import sys

    for name in [n for n in sys.modules if n.startswith(PLUGIN)]:
        del sys.modules[name]
    plugin = _load_plugin()
    assert plugin.__name__ == PLUGIN
    ext = asyncio.run(plugin.comfy_entrypoint())
    nodes = {n.define_schema().node_id: n for n in asyncio.run(ext.get_node_list())}
    sys.modules[f"{PLUGIN}.nodes.remote_model"].parallel_model = lambda h: types.SimpleNamespace(handle=h)
    return nodes


def join_agent(door: cluster.FrontDoor, key: bytes, name: str, devices: list[str]) -> threading.Thread:
    """The real agent, joined to `door` over loopback from a thread; it ends when the door closes."""
    agent = Agent(door.listen, key, name, devices, folders=[])
    thread = threading.Thread(target=agent.serve, daemon=True, name=f"test-agent-{name}")
    thread.start()
    for _ in range(200):  # joined within 10 s: the handshake and hello take milliseconds on loopback
        if name in {a.name for a in door.live_agents()}:
            return thread
        thread.join(0.05)
    raise AssertionError(f"the agent {name} did not join {door.listen} in 10 s; refusals: {list(door.refusals)}")


def free_port() -> int:
    """A port nothing listens on now (the door then binds it: a test that knows the port needs no front_door()
    call, which would open the door itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(door: cluster.FrontDoor) -> bool:
    with socket.create_connection(("127.0.0.1", door.address[1]), timeout=5):
        return True


# ---------------------------------------------------------------------------------------------
# The front door at load.

def test_multinode_plugin_load_opens_the_front_door_from_the_environment(user_dir, key_file, monkeypatch):
    port = free_port()
    monkeypatch.setenv("PARADIT_LISTEN", f"127.0.0.1:{port}")
    monkeypatch.setenv("PARADIT_KEY_FILE", key_file)
    assert list(load_nodes()) == NODES
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # open at load: nothing asked for it since
        pass
    assert cluster.front_door().address == ("127.0.0.1", port)


def test_multinode_plugin_load_opens_the_front_door_from_cluster_json(user_dir, key_file):
    port = free_port()
    (user_dir / "paradit" / "cluster.json").write_text(json.dumps({"listen": f"127.0.0.1:{port}",
                                                                    "key_file": "paradit.key"}))
    assert list(load_nodes()) == NODES
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # open at load
        pass
    door = cluster.front_door()
    # key_file is relative to cluster.json's folder; the door holds that file's key
    assert os.environ["PARADIT_KEY_FILE"] == key_file and door.key == read_key_file(key_file)
    join_agent(door, door.key, "box-b", ["cpu"])  # and an agent holding it joins before any prompt


def test_multinode_the_environment_wins_over_cluster_json(user_dir, key_file, monkeypatch):
    (user_dir / "paradit" / "cluster.json").write_text(json.dumps({"listen": "127.0.0.2:1", "key_file": "x"}))
    port = free_port()
    monkeypatch.setenv("PARADIT_LISTEN", f"127.0.0.1:{port}")
    monkeypatch.setenv("PARADIT_KEY_FILE", key_file)
    assert list(load_nodes()) == NODES
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # open at load, where the environment says
        pass
    assert os.environ["PARADIT_LISTEN"] == f"127.0.0.1:{port}" and os.environ["PARADIT_KEY_FILE"] == key_file


@pytest.mark.parametrize("config, problem", [
    ("{not json", r"cluster\.json cannot be read \(Expecting property name"),
    (json.dumps({"listen": "127.0.0.1:0"}), r"cluster\.json must hold \{\"listen\": \"ADDRESS:PORT\", \"key_file\""),
    (json.dumps({"listen": "127.0.0.1:0", "key_file": "missing.key"}), r"there is no key file at .*missing\.key"),
    (json.dumps({"listen": "127.0.0.1", "key_file": "paradit.key"}), r"PARADIT_LISTEN='127\.0\.0\.1' is not "
                                                                     r"ADDRESS:PORT"),
    (json.dumps({"listen": "127.0.0.1:99999", "key_file": "paradit.key"}), r"PARADIT_LISTEN=.127.0.0.1:99999. is not ADDRESS:PORT"),
])
def test_multinode_a_bad_cluster_json_is_logged_and_repeated_by_the_loader(user_dir, key_file, caplog, config,
                                                                          problem):
    path = user_dir / "paradit" / "cluster.json"
    path.write_text(config)
    with caplog.at_level(logging.WARNING, logger="paradit"):
        nodes = load_nodes()
    assert list(nodes) == NODES  # ComfyUI still gets every node
    loader = nodes["ParaDiTLoader"]
    said = [r.getMessage() for r in caplog.records if r.name == "paradit"]
    assert len(said) == 1 and said[0].startswith("ParaDiT: other machines cannot join this one: ")
    assert re.search(problem, said[0]) and f"(settings from {path})" in said[0]
    # a prompt that names no other machine does not care
    assert loader.execute("tiny.safetensors", "default", "cpu:1").ui.value.startswith("tiny.safetensors (default) "
                                                                                      "on cpu;")
    with pytest.raises(ConfigError) as info:  # one that does gets the same sentence
        loader.execute("tiny.safetensors", "default", "cpu:1,box-b:cpu:1")
    assert str(info.value).startswith("devices names other machines, but this host's front door did not open: ")
    assert re.search(problem, str(info.value)) and f"(settings from {path})." in str(info.value)


def test_multinode_an_unsafe_key_file_is_refused_at_load_and_the_fix_needs_no_restart(user_dir, key_file, caplog):
    (user_dir / "paradit" / "cluster.json").write_text(json.dumps({"listen": "127.0.0.1:0",
                                                                    "key_file": "paradit.key"}))
    os.chmod(key_file, 0o644)
    with caplog.at_level(logging.WARNING, logger="paradit"):
        loader = load_nodes()["ParaDiTLoader"]
    assert any(f"the key file {key_file} is open to other users (mode 644): chmod 600" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match=r"front door did not open: the key file .* is open to other users"):
        loader.execute("tiny.safetensors", "default", "cpu:1,box-b:cpu:1")
    os.chmod(key_file, 0o600)  # fixed while ComfyUI runs: the next prompt opens the door
    with pytest.raises(ConfigError, match=r"^the host box-b is not connected \(no agent of that name has joined"):
        loader.execute("tiny.safetensors", "default", "cpu:1,box-b:cpu:1")
    assert listening(cluster.front_door())


def test_multinode_no_settings_no_door_and_the_loader_says_how_to_open_one(user_dir):
    loader = load_nodes()["ParaDiTLoader"]
    assert cluster.front_door() is None
    with pytest.raises(ConfigError) as info:
        loader.execute("tiny.safetensors", "default", "cpu:1,box-b:cpu:1")
    where = user_dir / "paradit" / "cluster.json"
    assert str(info.value).startswith(f"devices names other machines, but this host has no front door for their "
                                      f"agents: write {where} as {{\"listen\": \"ADDRESS:PORT\"")


# ---------------------------------------------------------------------------------------------
# Load Parallel DiT with other machines' devices.

def test_multinode_loader_lists_every_rank_with_its_host(user_dir, key_file, loaded, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # 'all' below: this machine's 'auto' is one CPU
    key = read_key_file(key_file)
    door = cluster.open_front_door("127.0.0.1:0", key)
    join_agent(door, key, "box-b", ["cpu", "cpu"])
    join_agent(door, key, "gpu-box-2", ["cuda:0", "cuda:1"])  # its GPUs are its own: none needed here
    out = ParaDiTLoader.execute("tiny.safetensors", "default", " cpu:1, box-b:cpu:2 ")
    assert out.args[0].handle.devices == "cpu:1,box-b:cpu:2"
    assert out.ui.value == ("tiny.safetensors (default) on cpu, box-b cpu, box-b cpu; auto: degrees are chosen at "
                            "sample time")
    shown = ParaDiTLoader.execute("tiny.safetensors", "default", "gpu-box-2:1,0,box-b:cpu").ui.value
    assert shown.startswith("tiny.safetensors (default) on gpu-box-2 cuda:1, gpu-box-2 cuda:0, box-b cpu; ")
    # 'all': this machine's 'auto' (one CPU worker here, with no GPU) and every joined machine's every device
    shown = ParaDiTLoader.execute("tiny.safetensors", "default", "all").ui.value
    assert shown.startswith("tiny.safetensors (default) on cpu, box-b cpu, box-b cpu, gpu-box-2 cuda:0, "
                            "gpu-box-2 cuda:1; ")


def test_multinode_loader_refuses_a_host_that_has_not_joined_in_the_clusters_sentence(user_dir, key_file, loaded):
    key = read_key_file(key_file)
    door = cluster.open_front_door("127.0.0.1:0", key)
    join_agent(door, key, "box-b", ["cpu", "cpu"])
    with pytest.raises(ConfigError) as info:
        ParaDiTLoader.execute("tiny.safetensors", "default", "cpu:1,gpu-box-2:0,1")
    assert str(info.value) == (
        f"the host gpu-box-2 is not connected (no agent of that name has joined; joined: box-b): start `python -m "
        f"parallel_runtime agent --join {door.listen} --key-file KEY --name gpu-box-2` on that machine, or remove "
        f"gpu-box-2 from devices.")
    with pytest.raises(ConfigError, match=r"^devices names box-b:0, but box-b's agent offers cpu, cpu; name one"):
        ParaDiTLoader.execute("tiny.safetensors", "default", "box-b:0")


def test_multinode_only_this_machines_devices_leave_comfyuis_models(user_dir):
    """ComfyUI's models leave the GPUs the workers take on this machine only: another machine's cuda:0 is not
    this one's (what Parallel Sampler frees, and what the per-call MODEL frees through the client)."""
    from nodes import convert

    assert convert.local_devices("cpu:2") == ["cpu", "cpu"]
    assert convert.local_devices("cpu:1,gpu-box-2:0,1") == ["cpu"]
    assert convert.local_devices("gpu-box-2:0,1") == []
    client = types.SimpleNamespace(devices=["cpu", "cuda:0", "cuda:1"], hosts=("local", "gpu-box-2", "gpu-box-2"))
    assert convert.client_devices_here(client) == ["cpu"]


def test_multinode_parallel_sampler_frees_only_this_machines_devices(runtime):  # noqa: F811 - test_nodes' fixture
    """Parallel Sampler on 'cpu:1,box-b:cpu:2' (the runtime faked, as in test_nodes.py): ComfyUI's models leave
    this machine's one CPU device, not box-b's (the parse of the whole string used to refuse it)."""
    host = FakeHost()
    sampler_mod.sample(handle(devices="cpu:1,box-b:cpu:2"), 42, 2, 1.0, "euler", "simple", cond(), cond(pooled=False),
                       latent(), 1.0, node_id="9", host=host)
    assert host.freed == [["cpu"]] and list(runtime.clients) == ["cpu:1,box-b:cpu:2"]


def test_multinode_parallel_vae_decode_refuses_other_machines(user_dir):
    from nodes.vae_decode import band_devices

    with pytest.raises(ConfigError, match=r"^devices 'cpu:1,box-b:cpu:2' names other machines, but Parallel VAE "
                                          r"Decode runs in this ComfyUI process"):
        band_devices("cpu:1,box-b:cpu:2")
    assert [str(d) for d in band_devices("cpu:2")] == ["cpu", "cpu"]


def test_multinode_devices_tooltip_says_the_syntax():
    from nodes import convert

    tooltip = dict((s.id, s) for s in convert.loader_inputs([]))["devices"].options["tooltip"]
    for example in ("auto", "0,1,2,3", "cpu:N", "0,1,gpu-box-2:0,1", "cpu:2,box-b:cpu:2", "all:"):
        assert example in tooltip


# ---------------------------------------------------------------------------------------------
# The frontend panel.

PANEL_CHECK = """
import { samplerLines } from "./ext/paradit/paradit.js";
const payload = JSON.parse(process.argv[2]);
console.log(JSON.stringify(samplerLines(payload).map((l) => l.text)));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed: web/paradit.js is not run")
def test_multinode_panel_shows_each_rank_with_its_host_each_agent_and_the_last_refusal(tmp_path):
    """web/paradit.js's sampler lines for a status with ranks on two machines and a cluster, run by Node.js with
    ComfyUI's app and api modules stubbed (only their import is needed)."""
    for name, text in {"scripts/app.js": "export const app = { registerExtension() {} };",
                       "scripts/api.js": "export const api = {};", "package.json": '{"type": "module"}',
                       "check.mjs": PANEL_CHECK}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    source = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "web", "paradit.js"),
                  encoding="utf-8").read()
    (tmp_path / "ext" / "paradit").mkdir(parents=True)
    (tmp_path / "ext" / "paradit" / "paradit.js").write_text(source + "\nexport { samplerLines };\n")
    status = {"workers": [{"rank": 0, "device": "cpu", "host": "local", "alive": True, "rss_bytes": 2**30,
                           "device_bytes": 0},
                          {"rank": 1, "device": "box-b cpu", "host": "box-b", "alive": True, "rss_bytes": None,
                           "device_bytes": 0},
                          {"rank": 2, "device": "gpu-box-2 cuda:0", "host": "gpu-box-2", "alive": False,
                           "rss_bytes": None, "device_bytes": 2**31}],
              "cluster": {"listen": "192.168.1.10:29600", "refusals": ["older", "refused a connection from x"],
                          "agents": [{"name": "box-b", "peer": "192.168.1.11:41000", "devices": ["cpu"],
                                      "alive": True, "lost": None, "link_mb_s": 112.5},
                                     {"name": "gpu-box-2", "peer": "192.168.1.12:41001", "devices": ["cuda:0"],
                                      "alive": False, "lost": "it stopped answering for 10 s", "link_mb_s": None}]}}
    payload = {"state": "running", "strategy": "cfg2", "step": 2, "total": 4, "status": status}
    out = subprocess.run(["node", "check.mjs", json.dumps(payload)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out) == ["cfg2 · running · 2/4",
                               "rank 0 cpu: up · RAM 1.0 GiB",
                               "rank 1 box-b cpu: up",  # a CPU rank on another machine has no device memory
                               "rank 2 gpu-box-2 cuda:0: DOWN · dev 2.0 GiB",
                               "host box-b (192.168.1.11:41000): joined · 112.5 MB/s",
                               "host gpu-box-2: LOST (it stopped answering for 10 s)",
                               "front door: refused a connection from x"]
