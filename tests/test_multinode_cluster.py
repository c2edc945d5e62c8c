"""Several machines, made of network namespaces (tests/netns.py): host 0 runs the ComfyUI side (tests/multinode_driver.py
opens the front door on its address), hosts 1 and 2 each run `python -m parallel_runtime agent`. Every address is one
the test assigned on its own bridged segment; nothing touches the root namespace's network.

What is checked: a job across machines equals the same job on one (CFG, batch and PipeFusion across hosts, Ulysses
inside one); a wrong key and a replayed handshake are refused before any message is read; a host killed, frozen or cut
off mid-job fails the prompt within 30 s naming it, the next prompt runs on what is left or names the missing host,
and the agent rejoins by itself; a slowed link keeps all-to-all inside a host under auto; what a port scan sees; no
process is left in any namespace.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from multinode_lab import ROOT, Cluster, cmdline
from netns import TestNetwork, netns_unavailable, tbf_unavailable
from parallel_runtime.models.tiny import TINY, write_checkpoint
from parallel_runtime.runtime.auth import new_key_file

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

# A job across machines runs the arithmetic of the same plan on one machine; only the order gloo sums partial results
# in could differ (measured: 0.0 for every plan below).
EXACT_RTOL = 1e-4
FAULT_DEADLINE_S = 30.0  # the bound for a lost host to fail the prompt
LONG_JOB_STEPS = 600  # long enough (~10+ s here) for a fault to strike mid-job


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("multinode"))
    with TestNetwork(hosts=3) as net:
        c = Cluster(net, folder)
        try:
            c.start_agent(1, "box-b")
            c.start_agent(2, "box-c")
            c.wait_joined("box-b", "box-c")
            yield c
        finally:
            c.host0.exit()
            time.sleep(0.5)
        # The driver shut its runtimes down: no worker may be left on any machine (the agents are still there).
        for i in (0, 1, 2):
            assert all("worker" not in cmdline(pid) for pid in net.pids(i)), f"a worker was left in host {i}"
        for agent in c.agents.values():
            agent.terminate()
            agent.wait(30)
    assert not net.leftovers, net.leftovers


# -- parity --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices,strategy,images", [
    ("cpu:2,box-b:cpu:2", dict(cfg_degree=2, ulysses_degree=2), 1),
    ("cpu:2,box-b:cpu:2", dict(batch_degree=2, ulysses_degree=2), 2),
    ("cpu:2,box-b:cpu:2", dict(pipefusion_degree=2, ulysses_degree=2, num_pipeline_patch=2), 1),
    ("cpu:2,box-b:cpu:1,box-c:cpu:1", dict(cfg_degree=2, pipefusion_degree=2, num_pipeline_patch=2), 1),
], ids=["cfg-across-ulysses-inside", "batch-across-ulysses-inside", "pipefusion-across-ulysses-inside",
        "three-hosts-cfg-and-pipefusion-across"])
def test_multinode_job_across_hosts_equals_the_same_job_on_one_host(cluster, devices, strategy, images):
    answer = cluster.host0.ask("run", devices=devices, strategy=strategy, steps=4, images=images, reference="cpu:4")
    assert answer["ok"], answer
    assert answer["err"] <= EXACT_RTOL, answer
    print(f"{devices} {strategy}: err {answer['err']:.2e}, {answer['job_seconds']:.2f} s across hosts vs "
          f"{answer['reference_seconds']:.2f} s on one")


def test_multinode_status_names_every_rank_with_its_host(cluster):
    status = cluster.host0.ask("status")
    workers = status["clients"]["cpu:2,box-b:cpu:2"]["workers"]
    assert [(w["host"], w["device"]) for w in workers] == [
        ("local", "cpu"), ("local", "cpu"), ("box-b", "box-b cpu"), ("box-b", "box-b cpu")]
    assert {a["name"] for a in status["status"]["agents"] if a["alive"]} == {"box-b", "box-c"}


def test_multinode_a_missing_or_different_model_file_names_the_host(cluster):
    """Weights never cross the network: each machine reads its own copy, found by name and checked by header."""
    folder = os.path.join(cluster.folder, "host0")
    missing = write_checkpoint(os.path.join(folder, "only-here.safetensors"), TINY, seed=0)
    different = write_checkpoint(os.path.join(folder, "retrained.safetensors"), TINY, seed=0)
    write_checkpoint(os.path.join(cluster.folder, "box-c", "models", "retrained.safetensors"), TINY, seed=1)
    for model, words in ((missing, "the host box-c has no file named only-here.safetensors"),
                         (different, "but it differs from this host's retrained.safetensors")):
        answer = cluster.host0.ask("run", devices="cpu:1,box-c:cpu:1", strategy=dict(cfg_degree=2), steps=2,
                                   model=model)
        assert not answer["ok"] and answer["type"] == "ConfigError", answer
        assert words in answer["error"] and "copy" in answer["error"] and "box-c" in answer["error"], answer


# -- security ------------------------------------------------------------------------------------------------------

def test_multinode_an_agent_with_a_wrong_key_is_refused_with_a_sentence_on_both_sides(cluster):
    wrong = os.path.join(cluster.folder, "wrong-key")
    new_key_file(wrong)
    refused_before = len(cluster.host0.ask("status")["status"]["refusals"])
    agent = cluster.start_agent(2, "box-x", key=wrong)
    assert agent.wait(30) == 2  # the agent gives up at once: a key never becomes right by retrying
    with open(os.path.join(cluster.folder, f"box-x-{len(cluster.agents) - 1}.log")) as f:
        agent_log = f.read()
    assert "refused this agent's key" in agent_log, agent_log
    refusals = cluster.host0.ask("status")["status"]["refusals"]
    assert len(refusals) == refused_before + 1 and "does not hold this host's key" in refusals[-1], refusals
    assert "box-x" not in {a["name"] for a in cluster.host0.ask("status")["status"]["agents"]}


def test_multinode_a_replayed_handshake_is_refused_before_any_message_is_read(cluster):
    """From host 1: a real agent's handshake bytes, recorded, then replayed on a new connection, followed by an agent
    message. The host's fresh nonce makes the replayed proof wrong: it refuses, and never registers the agent."""
    refused_before = len(cluster.host0.ask("status")["status"]["refusals"])
    result = cluster.net.run(1, [sys.executable, os.path.join(ROOT, "tests", "multinode_replay.py"),
                                 cluster.host0.listen, cluster.key], timeout=60, capture_output=True, text=True,
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"first": "welcome", "replay": "refused"}
    status = cluster.host0.ask("status")["status"]
    assert len(status["refusals"]) == refused_before + 1, status["refusals"]
    assert "replayer" not in {a["name"] for a in status["agents"] if a["alive"]}


def test_multinode_a_port_scan_sees_only_the_front_door(cluster):
    """Idle (no runtime started), host 0 shows one open port to the network, the front door; an agent's machine
    shows none (its store relay listens on its own loopback only). While a job's workers live, the process group's
    transfer ports are open on the chosen interface too (stated in README)."""
    assert cluster.host0.ask("shutdown")["ok"]
    port = int(cluster.host0.listen.rpartition(":")[2])
    assert cluster.net.scan(1, 0) == [port]
    assert cluster.net.scan(2, 1) == []
    assert all(address in ("127.0.0.1", "::1") for address, _ in cluster.net.listening(1))
    answer = cluster.host0.ask("run", devices="cpu:1,box-b:cpu:1", strategy=dict(cfg_degree=2), steps=2)
    assert answer["ok"], answer
    live, agent_live = cluster.net.scan(2, 0), cluster.net.scan(2, 1)
    print(f"port scan while a job's workers live: host 0 {len(live)} open ports ({live}), the agent's machine "
          f"{len(agent_live)} ({agent_live})")
    assert port in live
    # The agent's machine shows only its worker's process-group listeners, which end with the workers (below).
    assert agent_live and port not in agent_live
    assert cluster.host0.ask("shutdown")["ok"]
    assert cluster.net.scan(2, 1) == []


# -- placement -----------------------------------------------------------------------------------------------------

@pytest.mark.skipif(tbf_unavailable() is not None, reason=str(tbf_unavailable()))
def test_multinode_auto_keeps_all_to_all_inside_a_host_over_a_slowed_link(cluster):
    from parallel_runtime.distributed.topology import Topology
    from parallel_runtime.planning.placement import HEAVY_DIMS, crossing_groups
    from parallel_runtime.spec import StrategySpec

    cluster.net.slow(1, "20mbit")
    try:
        answer = cluster.host0.ask("plan", devices="cpu:2,box-b:cpu:2", cfg=3.5)
        manual = cluster.host0.ask("plan", devices="cpu:2,box-b:cpu:2", cfg=3.5, mode="manual",
                                   strategy=dict(ulysses_degree=4))
    finally:
        cluster.net.unslow(1)
    assert answer["ok"], answer
    strategy = StrategySpec(**answer["strategy"])
    hosts = ("local", "local", "box-b", "box-b")
    assert not [g for g in crossing_groups(Topology.from_strategy(strategy), hosts) if g[0] in HEAVY_DIMS], answer
    # The measured link (20 Mbit/s = 2.5 MB/s less TCP's overhead) is named.
    assert "box-b↔local link measured 2." in answer["reason"] and "MB/s" in answer["reason"], answer["reason"]
    print(f"auto over a 20 Mbit/s link: {answer['label']}: {answer['reason']}")
    # A manual plan that puts Ulysses' all-to-all on that link runs as asked, with the warning in its reason.
    assert manual["label"] == "ulysses4" and "ulysses" in manual["reason"] and "MB/s" in manual["reason"], manual
    print(f"manual ulysses4 over it: {manual['reason']}")


# -- faults --------------------------------------------------------------------------------------------------------

def _strike_mid_job(cluster, strike) -> dict:
    """Start a long job on host 0 + box-b, strike once it runs, and return the answer with the seconds it took
    from the strike to the failure."""
    cluster.host0.events.clear()
    cluster.host0.send("run", devices="cpu:1,box-b:cpu:1", strategy=dict(cfg_degree=2), steps=LONG_JOB_STEPS)
    cluster.host0.first_progress(120)
    t0 = time.monotonic()
    strike()
    answer = cluster.host0.answer(FAULT_DEADLINE_S + 30)
    answer["after_strike_s"] = time.monotonic() - t0
    print(f"fault: failed {answer['after_strike_s']:.1f} s after the strike: {answer.get('error')}")
    return answer


def _recover(cluster, i: int, name: str) -> None:
    """The agent (restarted, or the same one) joins again; the next job runs across both machines."""
    cluster.wait_joined(name, timeout=60)
    answer = cluster.host0.ask("run", devices="cpu:1,box-b:cpu:1", strategy=dict(cfg_degree=2), steps=2)
    assert answer["ok"], answer
    # The failed job's workers have ended there: what is left is the agent and this job's one worker.
    deadline = time.monotonic() + 20
    while len(cluster.net.pids(i)) > 2:
        assert time.monotonic() < deadline, [cmdline(p) for p in cluster.net.pids(i)]
        time.sleep(0.2)


def test_multinode_a_killed_host_fails_the_prompt_in_time_and_the_next_runs_on_what_is_left(cluster):
    answer = _strike_mid_job(cluster, lambda: cluster.net.signal_all(1, signal.SIGKILL))
    assert not answer["ok"] and "box-b" in answer["error"] and answer["after_strike_s"] < FAULT_DEADLINE_S, answer
    assert cluster.net.pids(1) == []
    # Named explicitly, the missing machine is one sentence naming it; 'all' runs on the devices that are left.
    missing = cluster.host0.ask("run", devices="cpu:1,box-b:cpu:1", strategy=dict(cfg_degree=2), steps=2)
    assert not missing["ok"] and "the host box-b is not connected" in missing["error"], missing
    assert "--name box-b" in missing["error"]
    left = cluster.host0.ask("run", devices="all", strategy=dict(ring_degree=3), steps=2)
    assert left["ok"], left  # this machine's CPU worker and box-c's two
    cluster.start_agent(1, "box-b")
    _recover(cluster, 1, "box-b")


def test_multinode_a_frozen_host_fails_the_prompt_in_time_and_rejoins_when_it_thaws(cluster):
    answer = _strike_mid_job(cluster, lambda: cluster.net.signal_all(1, signal.SIGSTOP))
    try:
        assert not answer["ok"] and "box-b" in answer["error"] and answer["after_strike_s"] < FAULT_DEADLINE_S, answer
    finally:
        cluster.net.signal_all(1, signal.SIGCONT)
    _recover(cluster, 1, "box-b")


def test_multinode_a_host_cut_off_the_network_fails_the_prompt_in_time_and_rejoins(cluster):
    answer = _strike_mid_job(cluster, lambda: cluster.net.link_down(1))
    try:
        assert not answer["ok"] and "box-b" in answer["error"] and answer["after_strike_s"] < FAULT_DEADLINE_S, answer
    finally:
        cluster.net.link_up(1)
    _recover(cluster, 1, "box-b")
