"""The host's front door and the agent, over loopback (127.0.0.1, no namespaces, no workers): who may join and
who is refused (with the sentence on both sides), strangers and stalling peers dropped within the handshake's bound
while others join, devices strings with other machines' devices, the front door's settings, requests to a lost
agent, remote worker handles, and how an agent finds a model file. A real `Agent` serves on a thread where the
agent's side matters; elsewhere a raw authenticated connection plays the agent."""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from test_multinode_auth import JOIN_S, Background

from parallel_runtime import errors
from parallel_runtime.runtime import agent as agent_mod
from parallel_runtime.runtime import auth, cluster
from parallel_runtime.runtime.agent import Agent, header_digest
from parallel_runtime.runtime.auth import new_key_file
from parallel_runtime.runtime.cluster import (LOCAL, FrontDoor, RankPlace, RemoteProcess, connect_to, place_ranks,
                                              split_devices)
from parallel_runtime.runtime.protocol import Channel
from parallel_runtime.runtime.relay import StoreRelay

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(32))


def wait_for(condition, seconds: float = JOIN_S) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.02)


@pytest.fixture
def door():
    made = FrontDoor("127.0.0.1:0", KEY)
    yield made
    made.close()  # loses every agent: a real Agent's serve() then returns


@pytest.fixture
def raw_agents():
    """A maker of raw joins: (channel, reply kind, reply meta) of an authenticated connection saying 'agent'."""
    made = []

    def join(door, name, devices=("cpu",), protocol=cluster.PROTOCOL):
        chan = Channel(connect_to(door.listen, KEY))
        made.append(chan)
        chan.send("agent", {"name": name, "protocol": protocol, "agent_id": f"raw-{name}", "devices": list(devices),
                            "address": "127.0.0.1"})
        assert chan.poll(JOIN_S)
        kind, meta, _ = chan.recv()
        if kind == "welcome":
            wait_for(lambda: name in door.agents and door.agents[name].agent_id == f"raw-{name}")
        return chan, kind, meta

    yield join
    for chan in made:
        chan.close()


def next_request(chan: Channel) -> tuple[str, dict]:
    """The next message from the host that is not a ping."""
    while True:
        assert chan.poll(JOIN_S)
        kind, meta, _ = chan.recv()
        if kind != "ping":
            return kind, meta


def serving(door, name: str, folders=(), **kwargs) -> tuple[Agent, Background]:
    agent = Agent(door.listen, KEY, name, ["cpu"], list(folders), **kwargs)
    return agent, Background(agent.serve)


def joined(door, name: str, agent: Agent) -> cluster.AgentLink:
    wait_for(lambda: name in door.agents and door.agents[name].agent_id == agent.agent_id and door.agents[name].alive)
    return door.agents[name]


# -- who may join -----------------------------------------------------------------------------------------------


def test_multinode_agent_of_another_protocol_is_refused_with_one_sentence_on_both_sides(door, monkeypatch):
    monkeypatch.setattr(agent_mod, "PROTOCOL", cluster.PROTOCOL + 1)
    agent, serve = serving(door, "box-b")
    why = serve.get()
    sentence = door.refusals[-1][1]
    assert sentence.startswith("the agent 'box-b' at 127.0.0.1:") and sentence.endswith(
        f" speaks ParaDiT protocol {cluster.PROTOCOL + 1}, this host {cluster.PROTOCOL}: run the same ParaDiT version "
        f"on both machines")
    assert why == f"refused: {sentence}"  # the agent's log line carries the host's sentence
    assert "box-b" not in door.agents


def test_multinode_second_agent_of_a_live_name_is_refused_and_a_lost_ones_successor_joins(door):
    first, first_serve = serving(door, "box-b")
    link = joined(door, "box-b", first)
    second, second_serve = serving(door, "box-b")
    why = second_serve.get()
    assert why == f"refused: {door.refusals[-1][1]}"
    assert why.startswith("refused: a second agent named 'box-b' tried to join from 127.0.0.1:") and why.endswith(
        f" while the one at {link.peer} is connected: give each machine's agent its own --name")
    assert door.agent("box-b") is link and link.alive
    # The first one is lost (its cable pulled): a new agent of the name is welcome, and the old link says why.
    link.lose("the test pulled its cable")
    assert first_serve.get().startswith("lost")
    third, third_serve = serving(door, "box-b")
    assert joined(door, "box-b", third) is not link
    # A live link silent past AGENT_SILENCE_S (frozen, not yet noticed) is replaced as well.
    stale = door.agents["box-b"]
    stale.heard -= cluster.AGENT_SILENCE_S + 1
    fourth, fourth_serve = serving(door, "box-b")
    assert joined(door, "box-b", fourth) is not stale
    assert stale.lost_reason.startswith("a new agent of that name joined from 127.0.0.1:")
    door.close()
    assert third_serve.get().startswith("lost") and fourth_serve.get().startswith("lost")


def test_multinode_namesakes_joining_at_once_leave_one_link_and_no_orphan(door, raw_agents):
    joins = [Background(raw_agents, door, "box-b") for _ in range(6)]
    kinds = [j.get()[1] for j in joins]
    # However the six race, one is welcomed and the others refused (before, several could be welcomed: all but the
    # last registered were orphaned, their threads and connections kept, their agents believing they had joined).
    assert sorted(kinds) == ["refused"] * 5 + ["welcome"]
    assert [a.name for a in door.live_agents()] == ["box-b"]


@pytest.mark.parametrize("name, devices, fragment", [
    ("local", ["cpu"], "calls itself 'local', which cannot name a host: start it with --name"),
    ("Box B\n", ["cpu"], "calls itself 'Box B ', which cannot name a host"),
    ("box-b", ["cpu", "rm -rf /"], "offers no devices this host understands"),
    ("box-b", [], "offers no devices this host understands"),
])
def test_multinode_agent_name_and_devices_are_checked_by_the_host(door, raw_agents, name, devices, fragment):
    _, kind, meta = raw_agents(door, name, devices)
    assert kind == "refused" and fragment in meta["message"] and meta["message"] == door.refusals[-1][1]
    assert not door.agents


@pytest.mark.parametrize("kind", ["worker", "store"])
def test_multinode_connection_for_an_unknown_session_is_refused_and_logged(door, kind, caplog):
    door.open_session("live-session", 1)
    chan = Channel(connect_to(door.listen, KEY))
    with caplog.at_level(logging.WARNING, logger="paradit"):
        chan.send(kind, {"session": "no-such-session", "rank": 0})
        assert chan.poll(JOIN_S)
        with pytest.raises(EOFError):
            chan.recv()
        wait_for(lambda: door.refusals)
    sentence = door.refusals[-1][1]
    assert sentence.startswith(f"refused a '{kind}' connection from 127.0.0.1:") and sentence.endswith(
        ": it names no session this host runs (a stale worker of an earlier start, or another ParaDiT version)")
    assert f"ParaDiT: {sentence}" in caplog.messages
    chan.close()


def test_multinode_strangers_and_silent_peers_are_dropped_in_time_while_an_agent_joins(door, monkeypatch):
    monkeypatch.setattr(cluster, "HANDSHAKE_S", 1.5)  # long enough for an agent to join meanwhile on a busy machine
    silent = socket.create_connection(door.address)
    junk = socket.create_connection(door.address)
    junk.sendall(b"GET / HTTP/1.1\r\nHost: paradit\r\n\r\n")
    agent, serve = serving(door, "box-b")
    joined(door, "box-b", agent)
    # Joined while the silent peer still holds its handshake: one waiting connection blocks no other.
    assert not any("did not finish the ParaDiT handshake" in s for _, s in door.refusals)
    with silent, junk:
        for sock in (silent, junk):
            sock.settimeout(JOIN_S)
            received = b""
            try:
                while chunk := sock.recv(4096):  # the host's greeting, then its end of the stream
                    received += chunk
            except ConnectionResetError:  # closed with the junk unread: the kernel answers with a reset
                pass
            assert received.startswith(auth.MAGIC)
    sentences = [s for _, s in door.refusals]
    assert any(s.startswith("dropped a connection from 127.0.0.1:") and s.endswith(
        ": it did not finish the ParaDiT handshake within 1.5 s: point only ParaDiT agents at this port")
        for s in sentences)
    assert any(s.startswith("refused a connection from 127.0.0.1:") and
               ": it is not a ParaDiT agent (it sent b'GET / HTTP/1.1\\r')" in s for s in sentences)
    assert door.agent("box-b").alive
    door.close()
    serve.get()


@pytest.mark.parametrize("announced, sent, fragment", [
    (100, 10, "it sent only part of its first message within 1 s"),  # held the admitting thread forever before
    (2**30, 0, "it announced a message of 1073741824 bytes where at most 65536 are expected"),  # allocated 1 GiB
], ids=["half_a_message", "huge_message"])
def test_multinode_key_holder_stalling_or_flooding_its_first_message_is_dropped(door, monkeypatch, announced, sent,
                                                                               fragment):
    monkeypatch.setattr(cluster, "HANDSHAKE_S", 1.0)
    conn = connect_to(door.listen, KEY)
    with socket.socket(fileno=os.dup(conn.fileno())) as raw:
        raw.sendall(struct.pack("<Q", announced) + b"\0" * auth.MAC_BYTES + b"x" * sent)
        wait_for(lambda: door.refusals, 5)  # the 1 s bound plus 4 s of slack for a loaded 2-core machine
        raw.settimeout(JOIN_S)
        assert raw.recv(1) == b""  # and the host closed the connection
    sentence = door.refusals[-1][1]
    assert sentence.startswith("dropped a connection from 127.0.0.1:")
    assert f" after its handshake: {fragment}" in sentence
    assert sentence.endswith(": run the same ParaDiT version on both machines")
    conn.close()


def test_multinode_closed_front_door_and_relay_stop_listening():
    made = FrontDoor("127.0.0.1:0", KEY)
    relay = StoreRelay(lambda: None)
    addresses = [made.address, ("127.0.0.1", relay.port)]
    made.close()
    relay.close()
    for address in addresses:  # before, Linux kept each port listening until one more connection came (and took it)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=JOIN_S).close()


# -- devices strings with other machines ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec, local, hosts", [
    ("0,1,gpu-box-2:0,1", "0,1", {"gpu-box-2": ["0", "1"]}),
    ("cpu:2,box-b:cpu:2", "cpu:2", {"box-b": ["cpu:2"]}),
    ("box-b", "", {"box-b": []}),
    ("cpu:1,box-b,gpu-box-2:1", "cpu:1", {"box-b": [], "gpu-box-2": ["1"]}),
    ("all", "auto", {"*": []}),
    ("cpu:0,cpu:0,cpu:1", "cpu:0,cpu:0,cpu:1", {}),
    ("auto", "auto", {}),
])
def test_multinode_split_devices(spec, local, hosts):
    assert split_devices(spec) == (local, hosts)


def test_multinode_place_ranks_local_and_remote(door, raw_agents):
    raw_agents(door, "box-b", ["cpu", "cpu"])
    raw_agents(door, "gpu-box-2", ["cuda:0", "cuda:1"])
    assert place_ranks("cpu:2,box-b:cpu:2", door) == [RankPlace(LOCAL, "cpu")] * 2 + [RankPlace("box-b", "cpu")] * 2
    assert place_ranks("box-b", door) == [RankPlace("box-b", "cpu")] * 2
    assert place_ranks("cpu:1,gpu-box-2:0,1", door) == [RankPlace(LOCAL, "cpu"), RankPlace("gpu-box-2", "cuda:0"),
                                                        RankPlace("gpu-box-2", "cuda:1")]
    assert [p.label for p in place_ranks("cpu:1,gpu-box-2:1", door)] == ["cpu", "gpu-box-2 cuda:1"]
    everything = place_ranks("all", door)  # this machine has no GPU: its 'auto' is one CPU rank
    assert everything[0] == RankPlace(LOCAL, "cpu") and sorted(everything[1:], key=lambda p: (p.host, p.device)) == [
        RankPlace("box-b", "cpu"), RankPlace("box-b", "cpu"), RankPlace("gpu-box-2", "cuda:0"),
        RankPlace("gpu-box-2", "cuda:1")]


def test_multinode_place_ranks_sentences(door, raw_agents):
    raw_agents(door, "box-b", ["cpu", "cpu"])
    raw_agents(door, "gpu-box-2", ["cuda:0", "cuda:1"])
    with pytest.raises(errors.ConfigError) as unknown:
        place_ranks("cpu:1,box-z:0", door)  # the local part first: this machine has no GPU 0
    assert str(unknown.value) == (
        f"the host box-z is not connected (no agent of that name has joined; joined: box-b, gpu-box-2): start "
        f"`python -m parallel_runtime agent --join {door.listen} --key-file KEY --name box-z` on that machine, or "
        f"remove box-z from devices.")
    offered = "devices names gpu-box-2:{}, but gpu-box-2's agent offers cuda:0, cuda:1; name one of those (a GPU " \
              "index, 'cpu:N' or 'all')."
    for entry in ("5", "cpu:2"):  # a GPU it has not, and CPU workers on a box that lends only its GPUs
        with pytest.raises(errors.ConfigError) as missing:
            place_ranks(f"gpu-box-2:{entry}", door)
        assert str(missing.value) == offered.format(entry)
    with pytest.raises(errors.ConfigError) as no_door:
        place_ranks("cpu:1,atuo", None)  # a typo of 'auto' reads as a machine's name: the sentence says both
    assert str(no_door.value) == (
        "devices 'cpu:1,atuo' names other machines (atuo), but this host has no front door for their agents: fix "
        "devices if that was meant as this machine's ('auto', GPU indices like 0,1, or cpu:N), else set PARADIT_LISTEN "
        "(this machine's private address and a port, e.g. 192.168.1.10:29600) and PARADIT_KEY_FILE, then restart "
        "ComfyUI.")


# -- the front door's settings -----------------------------------------------------------------------------------


@pytest.fixture
def no_door(monkeypatch):
    cluster.close_front_door()
    monkeypatch.delenv("PARADIT_LISTEN", raising=False)
    monkeypatch.delenv("PARADIT_KEY_FILE", raising=False)
    yield monkeypatch
    cluster.close_front_door()


def test_multinode_front_door_settings_sentences(no_door, tmp_path):
    assert cluster.front_door() is None  # nothing named, nothing listens
    no_door.setenv("PARADIT_LISTEN", "127.0.0.1:0")
    with pytest.raises(errors.ConfigError, match=r"^PARADIT_LISTEN is set but PARADIT_KEY_FILE is not: make a key "):
        cluster.front_door()
    key_file = str(tmp_path / "paradit.key")
    new_key_file(key_file)
    no_door.setenv("PARADIT_KEY_FILE", key_file)
    for listen in ("29600", "box:port", "127.0.0.1:99999", ":29600"):
        no_door.setenv("PARADIT_LISTEN", listen)
        with pytest.raises(errors.ConfigError) as bad:
            cluster.front_door()
        assert str(bad.value) == (f"PARADIT_LISTEN={listen!r} is not ADDRESS:PORT; name this machine's address on "
                                  f"the private network and a port, e.g. 192.168.1.10:29600.")
    no_door.setenv("PARADIT_LISTEN", "192.0.2.1:0")  # TEST-NET-1: an address no machine here has
    with pytest.raises(errors.ConfigError) as absent:
        cluster.front_door()
    assert str(absent.value) == ("cannot listen on 192.0.2.1:0 (Cannot assign requested address): name an address "
                                 "this machine has and a free port in PARADIT_LISTEN.")
    no_door.setenv("PARADIT_LISTEN", "127.0.0.1:0")
    door = cluster.front_door()
    assert door.address[0] == "127.0.0.1" and cluster.front_door() is door


# -- requests and remote workers -------------------------------------------------------------------------------


def test_multinode_request_to_a_lost_agent_is_its_sentence_at_once(door, raw_agents):
    chan, _, _ = raw_agents(door, "box-b")
    link = door.agent("box-b")
    in_flight = Background(link.request, "resolve", {"name": "m.safetensors", "digest": "d"}, timeout_s=60)
    assert next_request(chan)[0] == "resolve"  # asked, never answered
    link.lose("the test pulled its cable")
    sentence = (f"the host box-b ({link.peer}) is unreachable: the test pulled its cable; check that machine and its "
                f"agent, then retry.")
    with pytest.raises(errors.WorkerError) as waiting:
        in_flight.get(5)  # the request in flight ends with the loss (a TypeError before), not after 60 s
    assert str(waiting.value) == sentence
    with pytest.raises(errors.WorkerError) as later:
        Background(link.request, "resolve", {"name": "m.safetensors", "digest": "d"}, timeout_s=60).get(5)
    assert str(later.value) == sentence
    with pytest.raises(errors.ConfigError, match=r"^the host box-b is not connected \(it was lost: the test pulled"):
        door.agent("box-b")


def test_multinode_remote_process_poll_wait_kill(door, raw_agents):
    chan, _, _ = raw_agents(door, "box-b")
    link = door.agent("box-b")
    proc = RemoteProcess(link, "s1", 0, 4242)
    link.processes[("s1", 0)] = proc
    assert proc.poll() is None and proc.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.05)
    proc.kill()
    assert next_request(chan) == ("kill", {"session": "s1", "rank": 0})
    chan.send("output", {"session": "s1", "rank": 0, "line": "dying\x1b[2J\nforged line"})
    chan.send("exited", {"session": "s1", "rank": 0, "code": -9, "tail": ["bye"]})
    assert proc.wait(JOIN_S) == -9 and proc.poll() == -9 and proc.returncode == -9
    # The output's terminal escape and newline cannot forge a line in the host's log.
    assert list(proc.tail) == ["dying [2J forged line", "bye"]
    assert ("s1", 0) not in link.processes  # an ended worker's handle is not kept for ever
    # A worker whose host is lost counts as killed: nothing here can reach it, and its agent ends it.
    other = RemoteProcess(link, "s1", 1, 4343)
    link.processes[("s1", 1)] = other
    link.lose("the test pulled its cable")
    assert other.wait(JOIN_S) == -9 and other.reason == "was lost with its host box-b (the test pulled its cable)"


def test_multinode_worker_exit_before_the_spawn_reply_is_not_lost(door, raw_agents):
    chan, _, _ = raw_agents(door, "box-b")
    link = door.agent("box-b")
    spawn = Background(link.spawn, "s1", [(1, "cpu"), (2, "cpu")], 3, 0)
    kind, meta = next_request(chan)
    assert kind == "spawn" and meta["ranks"] == [[1, "cpu"], [2, "cpu"]]
    # Rank 1 dies at once, before the agent has started rank 2 and replied.
    chan.send("exited", {"session": "s1", "rank": 1, "code": 3, "tail": ["ImportError: no torch"]})
    chan.send("reply", {"id": meta["id"], "pids": [[1, 11], [2, 12]], "relay_port": 5555})
    procs, relay_port = spawn.get()
    assert relay_port == 5555 and [procs[r].pid for r in (1, 2)] == [11, 12]
    assert procs[1].wait(JOIN_S) == 3 and list(procs[1].tail) == ["ImportError: no torch"]
    assert procs[2].poll() is None


def test_multinode_agent_answers_a_failed_request_and_stays_joined(door, tmp_path):
    agent, serve = serving(door, "box-b")
    link = joined(door, "box-b", agent)
    with pytest.raises(errors.ConfigError) as failed:  # a request of another version: no 'world'
        link.request("spawn", {"session": "s1", "threads": 1, "ranks": [[0, "cpu"]]}, timeout_s=JOIN_S)
    assert str(failed.value) == ("the host box-b could not do 'spawn' (KeyError: 'world'): see its agent's log, fix "
                                 "that and retry.")
    assert link.alive and agent.relays == {} and agent.procs == {}  # no relay port left open for it
    door.close()
    assert serve.get().startswith("lost")


# -- model files on the agent's machine ----------------------------------------------------------------------------


def _model(path, seed: int = 0, **extra) -> str:
    torch.manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.randn(64, 64), "b": torch.randn(64), **extra}, str(path))
    return str(path)


def test_multinode_agent_resolves_model_files_by_name_and_digest(door, tmp_path):
    here = _model(tmp_path / "host" / "flux.safetensors")
    models = tmp_path / "agent-models"
    found = _model(models / "diffusion_models" / "sub" / "flux.safetensors")
    different = _model(models / "unet" / "other.safetensors", extra=torch.zeros(3))  # another layout, same name below
    os.rename(different, models / "unet" / "flux-v2.safetensors")
    agent = Agent("127.0.0.1:1", KEY, "box-b", ["cpu"], [str(models)])
    assert agent._resolve("flux.safetensors", header_digest(here)) == found  # in a subfolder
    with pytest.raises(errors.ConfigError) as missing:
        agent._resolve("absent.safetensors", header_digest(here))
    assert str(missing.value) == (f"the host box-b has no file named absent.safetensors in its model folders "
                                  f"({models}): copy it there (the same file as on this host).")
    with pytest.raises(errors.ConfigError) as differs:
        agent._resolve("flux-v2.safetensors", header_digest(here))
    assert str(differs.value) == (f"the host box-b has {models / 'unet' / 'flux-v2.safetensors'}, but it differs "
                                  f"from this host's flux-v2.safetensors (another version or a damaged copy): copy "
                                  f"the same file to box-b.")
    # The same question over the wire, as the client asks it.
    serving_agent, serve = serving(door, "box-b", [str(models)])
    link = joined(door, "box-b", serving_agent)
    assert link.request("resolve", {"name": "flux.safetensors", "digest": header_digest(here)}) == {
        "path": found, "id": 1}
    door.close()
    serve.get()


def test_multinode_same_header_different_weights_is_a_different_file(tmp_path):
    # Two fine-tunes of one model share every header field (names, dtypes, shapes, offsets): the weights differ.
    base = _model(tmp_path / "a" / "flux.safetensors", seed=0)
    tuned = _model(tmp_path / "b" / "flux.safetensors", seed=1)
    with open(base, "rb") as f, open(tuned, "rb") as g:
        n = struct.unpack("<Q", f.read(8))[0]
        assert g.read(8 + n)[8:] == f.read(n)  # the headers are byte for byte the same
    assert header_digest(base) != header_digest(tuned)
    agent = Agent("127.0.0.1:1", KEY, "box-b", ["cpu"], [str(tmp_path / "b")])
    with pytest.raises(errors.ConfigError, match="but it differs from this host's flux.safetensors"):
        agent._resolve("flux.safetensors", header_digest(base))


def _raw_safetensors(path, header: dict, data: bytes) -> str:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def test_multinode_header_digest_ignores_the_key_order_of_the_header(tmp_path):
    data = bytes(range(256)) * 4
    a = {"__metadata__": {"format": "pt", "author": "x"},
         "w": {"dtype": "F32", "shape": [16, 8], "data_offsets": [0, 512]},
         "b": {"dtype": "F32", "shape": [128], "data_offsets": [512, 1024]}}
    b = {"b": {"data_offsets": [512, 1024], "shape": [128], "dtype": "F32"},
         "w": {"shape": [16, 8], "data_offsets": [0, 512], "dtype": "F32"},
         "__metadata__": {"author": "x", "format": "pt"}}
    first = _raw_safetensors(tmp_path / "a.safetensors", a, data)
    second = _raw_safetensors(tmp_path / "b.safetensors", b, data)
    assert open(first, "rb").read() != open(second, "rb").read()
    assert header_digest(first) == header_digest(second)
    c = dict(a, __metadata__={"format": "pt", "author": "y"})  # a different value is a different file
    assert header_digest(_raw_safetensors(tmp_path / "c.safetensors", c, data)) != header_digest(first)
    damaged = tmp_path / "d.safetensors"
    damaged.write_bytes(struct.pack("<Q", 20) + b"{not json at all...}" + data)
    assert header_digest(str(damaged)).endswith(f"-{os.path.getsize(damaged)}")  # a digest, not a ValueError


# -- the agent's command -------------------------------------------------------------------------------------------


def test_multinode_agent_retries_a_host_that_stalls_its_handshake_and_stops_on_a_wrong_key(door, tmp_path,
                                                                                          monkeypatch, caplog):
    key_file = str(tmp_path / "paradit.key")
    new_key_file(key_file)
    monkeypatch.setattr(agent_mod.signal, "signal", lambda *a: None)  # main() must not take pytest's SIGTERM
    monkeypatch.setattr(agent_mod, "connect_to", lambda address, key: connect_to(address, key, timeout_s=0.5))
    with socket.create_server(("127.0.0.1", 0)) as stalling:  # accepts (the kernel does), never says a word
        address = "127.0.0.1:%d" % stalling.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="paradit.agent"):
            code = agent_mod.main(["--join", address, "--key-file", key_file, "--name", "box-b", "--devices", "cpu",
                                   "--once"])
    # A stalled handshake is a host busy or frozen a moment: the agent joins again (without --once), not exit 2.
    assert code == 0
    assert any(f"cannot join {address}: the host {address} did not finish the ParaDiT handshake within 0.5 s" in m
               for m in caplog.messages)
    code = agent_mod.main(["--join", door.listen, "--key-file", key_file, "--name", "box-b", "--devices", "cpu",
                           "--once"])
    assert code == 2  # another key: retrying cannot mend it
    wait_for(lambda: door.refusals)  # the host writes its side after it answered the agent
    assert door.refusals[-1][1].endswith("it does not hold this host's key (wrong --key-file? copy this host's key "
                                         "file there), or it replayed an old handshake")


def test_multinode_agent_ends_when_its_host_stops_reading(monkeypatch):
    """A frozen host (SIGSTOP, a pulled cable) pings no more and reads nothing: the agent's sends fill the socket and
    must fail within the silence bound, ending its service (and its workers), not block the agent for ever."""
    monkeypatch.setattr(agent_mod, "AGENT_SILENCE_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        agent = Agent("127.0.0.1:%d" % listener.getsockname()[1], KEY, "box-b", ["cpu"], [])
        serve = Background(agent.serve)
        sock, _ = listener.accept()
        host = Channel(auth.accept_handshake(sock, KEY))
        assert host.recv()[0] == "agent"
        host.send("welcome", {})
        stop = threading.Event()

        def ping():  # keeps the agent's silence check satisfied: only its sends can notice
            while not stop.wait(0.1):
                try:
                    host.send("ping")
                except OSError:
                    return

        pinger = Background(ping)
        wait_for(lambda: agent.heard > 0 and agent.chan is not None)
        line = "x" * 400_000

        def flood():  # up to 80 MB: far past both sockets' buffers
            for _ in range(200):
                agent._send("output", {"session": "s", "rank": 0, "line": line})
                if not serve.thread.is_alive():
                    return

        flood = Background(flood)
        flood.get()  # each send gives up after 0.5 s without progress (before: blocked for ever)
        assert serve.get().startswith("lost")
        stop.set()
        pinger.get()
        host.close()


def test_multinode_big_request_to_a_frozen_agent_ends_in_its_sentence(door, raw_agents, monkeypatch):
    """An agent that stops reading (SIGSTOP): a request too big for the sockets' buffers must fail within the silence
    bound; before, its send blocked for ever holding the channel, and the pings that would have noticed with it."""
    monkeypatch.setattr(cluster, "AGENT_SILENCE_S", 1.0)
    monkeypatch.setattr(cluster, "AGENT_PING_S", 0.25)
    raw_agents(door, "box-b")  # joins, then reads nothing more
    link = door.agent("box-b")
    probe = Background(link.request, "probe", tensors={"bytes": torch.zeros(64 * 2**20, dtype=torch.uint8)},
                       timeout_s=60)
    with pytest.raises(errors.WorkerError) as frozen:
        probe.get()
    # Whichever notices first, the send's bound or the silence after the pings: the same sentence's two forms.
    assert str(frozen.value).startswith(f"the host box-b ({link.peer}) is unreachable: it stopped ")
    assert str(frozen.value).endswith(": the machine froze, lost power or dropped off the network; check that machine "
                                      "and its agent, then retry.")


def test_multinode_a_broken_link_across_machines_names_the_network_not_the_gpus(monkeypatch):
    """The startup link check's sentence on a runtime spanning machines (PARADIT_MULTIHOST, set by the client and the
    agents) points at the machines' firewalls and the ports page, and names the rank by its machine."""
    import torch

    from parallel_runtime.runtime import links

    monkeypatch.setenv("PARADIT_MULTIHOST", "1")
    sentence = links._broken_link(2, "box-b cuda:0", "nccl", "got no answer within 30 s")
    assert sentence.startswith("at startup, rank 2 (box-b cuda:0) got no answer within 30 s")
    assert "firewalls" in sentence and "docs/multinode.md" in sentence and "P2P" not in sentence
    monkeypatch.delenv("PARADIT_MULTIHOST")
    assert "NCCL_P2P_DISABLE" in links._broken_link(2, torch.device("cuda", 0), "nccl", "got no answer")
