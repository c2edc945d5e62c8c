"""The machines beyond this one: the front door other hosts' agents join, and what the client asks of them.

On the ComfyUI host, a `FrontDoor` listens on the one address the user names (PARADIT_LISTEN, never every
interface). Every connection to it is authenticated with the shared key (auth.py) before any message is read,
then says what it is:

- an agent (`python -m parallel_runtime agent --join ...` on another machine) registering its name and devices; it
  stays connected, answers a ping every AGENT_PING_S, starts worker ranks when a client asks, finds model files by
  name in its own ComfyUI folders, and reports its workers' exits and output;
- a remote worker's control channel (what an AF_UNIX socket is to a local worker), for the session that started it;
- a rendezvous relay: the c10d TCPStore of a session listens on this host's loopback only, and a remote worker
  reaches it through its agent's loopback relay and this authenticated connection — the store itself is never
  exposed.

torch.distributed's own transports (gloo's or NCCL's sockets, opened by the process group between the workers) are
the only other listeners: bound to the interface that carries the chosen address (GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME), open only while a job's workers live. README's multi-machine section states the exposure.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import re
import socket
import threading
import time

import torch

from .. import errors
from .auth import AuthRefused, accept_handshake, connect_handshake
from .protocol import Channel

PROTOCOL = 1  # bumped when agents and hosts stop understanding each other's messages
AGENT_PING_S = 2.0  # how often the host pings each agent, and the agent answers
AGENT_SILENCE_S = 10.0  # silence after which either side calls the other lost (a frozen host, a pulled cable)
HANDSHAKE_S = 10.0  # the longest a connection may take to prove its key and say what it is
PROBE_BYTES = 4 * 2**20  # sent twice per agent to measure the link (the first opens TCP's window)
LOCAL = "local"  # the host name of this machine's ranks
RESERVED_NAMES = {"local", "all", "auto", "cpu", "cuda"}
NAME = re.compile(r"[a-z][a-z0-9.-]{0,62}")
log = logging.getLogger("paradit")


def check_agent_name(name: str) -> str:
    name = name.strip().lower()
    if not NAME.fullmatch(name) or name in RESERVED_NAMES:
        raise errors.ConfigError(f"agent name {name!r} cannot name a host in a devices list; use letters, digits, '.' "
                                 f"and '-', starting with a letter, and not one of {', '.join(sorted(RESERVED_NAMES))}.")
    return name


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: the host (LOCAL or an agent's name) and the device name on that host."""

    host: str
    device: str

    @property
    def label(self) -> str:
        return self.device if self.host == LOCAL else f"{self.host} {self.device}"


def split_devices(spec: str) -> tuple[str, dict[str, list[str]]]:
    """The local part of a devices string and each named host's entries, in order: '0,1,gpu-box-2:0,1' ->
    ('0,1', {'gpu-box-2': ['0', '1']}). An entry 'name:rest' switches to that host; the entries after it are that
    host's until the next switch. 'all' is every joined host's every device (the local ones: 'auto')."""
    local: list[str] = []
    hosts: dict[str, list[str]] = {}
    current = None
    for entry in [e.strip() for e in (spec or "auto").strip().lower().split(",")]:
        m = re.fullmatch(r"([a-z][a-z0-9.-]*):(.+)", entry)
        if entry == "all":
            hosts.setdefault("*", [])
            local.append("auto")
            current = None
            continue
        if m and m.group(1) not in RESERVED_NAMES:
            current = m.group(1)
            entry = m.group(2)
        if current is None:
            local.append(entry)
        else:
            hosts.setdefault(current, []).append(entry)
    return ",".join(local), hosts


def names_remote(spec: str) -> bool:
    return bool(split_devices(spec)[1])


def place_ranks(spec: str, door: "FrontDoor | None") -> list[RankPlace]:
    """Every rank's place for a devices string: the local devices first (as the local runtime parses them), then
    each named host's, from what its agent reported when it joined. A host that has not joined is one sentence."""
    from ..distributed.devices import runtime_devices

    local_spec, wanted = split_devices(spec)
    places = []
    if local_spec:
        places = [RankPlace(LOCAL, d) for d in runtime_devices(local_spec)[0]]
    if not wanted:
        return places
    if door is None:
        raise errors.ConfigError(f"devices {spec!r} names other machines, but this host has no front door for their "
                                 f"agents: set PARADIT_LISTEN (this machine's private address and a port, e.g. "
                                 f"192.168.1.10:29600) and PARADIT_KEY_FILE, then restart ComfyUI.")
    if "*" in wanted:
        return places + [RankPlace(a.name, d) for a in door.live_agents() for d in a.devices]
    for name, entries in wanted.items():
        agent = door.agent(name)
        places += [RankPlace(name, d) for d in agent.pick_devices(entries)]
    return places


class RemoteProcess:
    """A worker on another host, seen through its agent: the few things RuntimeClient asks of a subprocess.Popen
    (poll, wait, kill, returncode, pid). It ends when the agent reports the exit, or when the agent is lost."""

    def __init__(self, agent: "AgentLink", session: str, rank: int, pid: int):
        self.agent, self.session, self.rank, self.pid = agent, session, rank, pid
        self.returncode: int | None = None
        self.ended = threading.Event()
        self.reason = ""  # why it ended, in words, where the exit code says nothing (a lost host)
        self.tail: collections.deque = collections.deque(maxlen=20)  # its last output lines

    def end(self, code: int | None, reason: str = "") -> None:
        if not self.ended.is_set():
            self.returncode, self.reason = code, reason
            self.ended.set()

    def poll(self) -> int | None:
        # A lost host's worker counts as ended (-9): nothing here can reach it any more, and its agent kills it.
        return (-9 if self.returncode is None else self.returncode) if self.ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"{self.agent.name} rank {self.rank}", timeout)
        return self.poll()

    def kill(self) -> None:
        self.agent.send("kill", {"session": self.session, "rank": self.rank})


class AgentLink:
    """One joined agent as the host sees it: its name, devices and measured link; requests to it; its workers."""

    def __init__(self, door: "FrontDoor", chan: Channel, hello: dict, peer: str):
        self.door, self.chan, self.peer = door, chan, peer
        self.name = hello["name"]
        self.devices: list[str] = list(hello["devices"])
        self.address = hello["address"]  # the agent's own address on the link to this host (its transfers bind there)
        self.agent_id = hello["agent_id"]
        self.joined = time.monotonic()
        self.heard = time.monotonic()
        self.lost_reason = ""
        self.link: tuple[float, float] | None = None  # (latency s, bandwidth bytes/s) to this host, measured once
        self.processes: dict[tuple[str, int], RemoteProcess] = {}
        self._replies: dict[int, list] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return not self.lost_reason

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name=f"paradit-agent-{self.name}").start()
        threading.Thread(target=self._ping, daemon=True, name=f"paradit-agent-ping-{self.name}").start()

    def send(self, kind: str, meta: dict | None = None, tensors: dict | None = None) -> None:
        if self.alive:
            try:
                self.chan.send(kind, meta, tensors)
            except OSError as exc:
                self.lose(f"its connection broke ({type(exc).__name__})")

    def request(self, kind: str, meta: dict | None = None, tensors: dict | None = None,
                timeout_s: float = 60.0) -> dict:
        """Send a request and wait for its reply; an agent's error or a lost agent is one sentence naming it."""
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            slot = self._replies[rid] = [threading.Event(), None]
        self.send(kind, dict(meta or {}, id=rid), tensors)
        deadline = time.monotonic() + timeout_s
        while not slot[0].wait(0.1):
            if not self.alive or time.monotonic() > deadline:
                self._replies.pop(rid, None)
                why = self.lost_reason or f"it did not answer {kind!r} within {timeout_s:.0f} s"
                raise errors.WorkerError(f"the host {self.name} ({self.peer}) is unreachable: {why}; check that "
                                         f"machine and its agent, then retry.")
        self._replies.pop(rid, None)
        reply_kind, reply = slot[1]
        if reply_kind == "error":
            raise errors.ConfigError(reply["message"])
        return reply

    def pick_devices(self, entries: list[str]) -> list[str]:
        """This agent's devices that a devices string's entries for it name: 'all' (or nothing), GPU indices,
        'cpu' or 'cpu:N'."""
        picked = []
        for entry in entries or ["all"]:
            if entry in ("all", "auto"):
                picked += self.devices
            elif entry.isdigit() and f"cuda:{entry}" in self.devices:
                picked.append(f"cuda:{entry}")
            elif re.fullmatch(r"cpu(:\d+)?", entry):
                picked += ["cpu"] * int(entry.partition(":")[2] or 1)
            else:
                raise errors.ConfigError(f"devices names {self.name}:{entry}, but {self.name}'s agent offers "
                                         f"{', '.join(self.devices)}; name one of those (a GPU index, 'cpu:N' or "
                                         f"'all').")
        return picked

    def lose(self, reason: str) -> None:
        """The agent is gone (closed, silent, or broke the protocol): end its workers here and tell the log."""
        with self._lock:
            if self.lost_reason:
                return
            self.lost_reason = reason
        log.warning("ParaDiT: lost the host %s (%s): %s.", self.name, self.peer, reason)
        self.chan.close()
        for proc in list(self.processes.values()):
            proc.end(None, f"was lost with its host {self.name} ({reason})")
        for slot in list(self._replies.values()):
            slot[0].set()

    def _ping(self) -> None:
        while self.alive:
            self.send("ping")
            time.sleep(AGENT_PING_S)
            if time.monotonic() - self.heard > AGENT_SILENCE_S:
                self.lose(f"it stopped answering for {AGENT_SILENCE_S:.0f} s: the machine froze, lost power or "
                          f"dropped off the network")

    def _read(self) -> None:
        while self.alive:
            try:
                if not self.chan.poll(0.5):
                    continue
                kind, meta, tensors = self.chan.recv()
            except (EOFError, OSError, errors.ParaDiTError) as exc:
                self.lose("its agent closed the connection" if isinstance(exc, EOFError)
                          else f"its connection broke ({exc})")
                return
            self.heard = time.monotonic()
            self._handle(kind, meta)

    def _handle(self, kind: str, meta: dict) -> None:
        if kind in ("reply", "error") and meta.get("id") in self._replies:
            slot = self._replies[meta["id"]]
            slot[1] = (kind, meta)
            slot[0].set()
        elif kind == "exited":
            proc = self.processes.get((meta["session"], meta["rank"]))
            if proc is not None:
                proc.tail.extend(meta.get("tail", ()))
                proc.end(meta["code"])
        elif kind == "output":
            proc = self.processes.get((meta["session"], meta["rank"]))
            if proc is not None:
                proc.tail.append(meta["line"])
            log.info("[%s rank %s] %s", self.name, meta["rank"], meta["line"])

    def spawn(self, session: str, ranks: list[tuple[int, str]], world: int, threads: int) -> dict[int, RemoteProcess]:
        """Start this host's worker ranks for `session`; they connect back through the front door."""
        reply = self.request("spawn", {"session": session, "world": world, "threads": threads,
                                       "ranks": [[r, d] for r, d in ranks]})
        procs = {}
        for rank, pid in reply["pids"]:
            procs[rank] = self.processes[(session, rank)] = RemoteProcess(self, session, rank, pid)
        return procs, reply["relay_port"]

    def measure_link(self) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of this host's link to the agent's, measured once over the authenticated
        connection: a small round trip, then PROBE_BYTES (twice: the first opens TCP's window)."""
        if self.link is None:
            t0 = time.perf_counter()
            self.request("probe", timeout_s=30)
            latency = time.perf_counter() - t0
            payload = {"bytes": torch.zeros(PROBE_BYTES, dtype=torch.uint8)}
            seconds = []
            for _ in range(2):
                t0 = time.perf_counter()
                self.request("probe", tensors=payload, timeout_s=120)
                seconds.append(time.perf_counter() - t0)
            self.link = (latency, PROBE_BYTES / max(seconds[-1] - latency, 1e-6))
        return self.link


class Session:
    """One runtime start's worker connections arriving through the front door, and its rendezvous store's port."""

    def __init__(self, token: str, store_port: int):
        self.token, self.store_port = token, store_port
        self.connections: queue.Queue = queue.Queue()


class FrontDoor:
    """The authenticated listener other machines' agents and workers connect to (see the module's docstring)."""

    def __init__(self, listen: str, key: bytes):
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise errors.ConfigError(f"PARADIT_LISTEN={listen!r} is not ADDRESS:PORT; name this machine's address on "
                                     f"the private network and a port, e.g. 192.168.1.10:29600.")
        self.key = key
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, int(port)))
        except OSError as exc:
            self.sock.close()
            raise errors.ConfigError(f"cannot listen on {listen} ({exc.strerror}): name an address this machine has "
                                     f"and a free port in PARADIT_LISTEN.") from exc
        self.sock.listen(64)
        self.address = self.sock.getsockname()[:2]
        self.agents: dict[str, AgentLink] = {}
        self.sessions: dict[str, Session] = {}
        self.refusals: collections.deque = collections.deque(maxlen=20)  # (time, sentence), newest last
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, daemon=True, name="paradit-front-door").start()

    @property
    def listen(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        for agent in list(self.agents.values()):
            agent.lose("this host closed its front door")

    def live_agents(self) -> list[AgentLink]:
        return [a for a in self.agents.values() if a.alive]

    def agent(self, name: str) -> AgentLink:
        """The joined agent `name`, or one sentence saying it has not joined (and what was last refused)."""
        agent = self.agents.get(name)
        if agent is not None and agent.alive:
            return agent
        joined = ", ".join(a.name for a in self.live_agents()) or "none"
        why = f"it was lost: {agent.lost_reason}" if agent is not None else "no agent of that name has joined"
        refused = f"; the last refused connection: {self.refusals[-1][1]}" if self.refusals else ""
        raise errors.ConfigError(f"the host {name} is not connected ({why}; joined: {joined}){refused}: start "
                                 f"`python -m parallel_runtime agent --join {self.listen} --key-file KEY --name {name}` "
                                 f"on that machine, or remove {name} from devices.")

    def refuse(self, sentence: str) -> None:
        self.refusals.append((time.time(), sentence))
        log.warning("ParaDiT: %s", sentence)

    def open_session(self, token: str, store_port: int) -> Session:
        session = self.sessions[token] = Session(token, store_port)
        return session

    def close_session(self, token: str) -> None:
        self.sessions.pop(token, None)

    # -- connections ---------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True,
                             name="paradit-admit").start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """Authenticate, read the one message that says what the connection is, hand it on (else close it)."""
        try:
            conn = accept_handshake(sock, self.key, timeout_s=HANDSHAKE_S)
            chan = Channel(conn)
            if not conn.poll(HANDSHAKE_S):
                raise EOFError("said nothing after the handshake")
            kind, meta, _ = chan.recv()
        except AuthRefused as exc:
            self.refuse(str(exc))
            sock.close()
            return
        except (EOFError, OSError, ValueError, KeyError) as exc:
            self.refuse(f"dropped a connection from {peer}: {type(exc).__name__} during its handshake")
            sock.close()
            return
        try:
            if kind == "agent":
                self._join(chan, meta, peer)
            elif kind == "worker" and meta.get("session") in self.sessions:
                self.sessions[meta["session"]].connections.put(conn)
            elif kind == "store" and meta.get("session") in self.sessions:
                from .relay import splice

                store = socket.create_connection(("127.0.0.1", self.sessions[meta["session"]].store_port), timeout=10)
                store.settimeout(None)
                splice(store, conn)
            else:
                self.refuse(f"refused a {kind!r} connection from {peer}: it names no session this host runs (a stale "
                            f"worker of an earlier start)")
                chan.close()
        except (OSError, KeyError, TypeError) as exc:
            self.refuse(f"dropped a {kind!r} connection from {peer}: {type(exc).__name__}: {exc}")
            chan.close()

    def _join(self, chan: Channel, hello: dict, peer: str) -> None:
        """Register an agent, or refuse it in one sentence that reaches both sides' logs."""
        problem = None
        name = str(hello.get("name", ""))
        if hello.get("protocol") != PROTOCOL:
            problem = (f"the agent {name!r} at {peer} speaks ParaDiT protocol {hello.get('protocol')}, this host "
                       f"{PROTOCOL}: run the same ParaDiT version on both machines")
        else:
            old = self.agents.get(name)
            if old is not None and old.alive and time.monotonic() - old.heard < AGENT_SILENCE_S:
                problem = (f"a second agent named {name!r} tried to join from {peer} while the one at {old.peer} is "
                           f"connected: give each machine's agent its own --name")
            elif old is not None:
                old.lose(f"a new agent of that name joined from {peer}")
        if problem:
            self.refuse(problem)
            try:
                chan.send("refused", {"message": problem})
            except OSError:
                pass
            chan.close()
            return
        agent = AgentLink(self, chan, hello, peer)
        chan.send("welcome", {"host": socket.gethostname(), "listen": self.listen})
        with self._lock:
            self.agents[name] = agent
        agent.start()
        log.info("ParaDiT: the host %s joined from %s with %s.", name, peer, ", ".join(agent.devices))

    def status(self) -> dict:
        return {"listen": self.listen,
                "agents": [{"name": a.name, "peer": a.peer, "devices": a.devices, "alive": a.alive,
                            "lost": a.lost_reason or None,
                            "link_mb_s": round(a.link[1] / 1e6, 1) if a.link else None} for a in self.agents.values()],
                "refusals": [sentence for _, sentence in list(self.refusals)[-5:]]}


_DOOR: FrontDoor | None = None
_DOOR_LOCK = threading.Lock()


def front_door() -> FrontDoor | None:
    """This process's front door, opened on first use from PARADIT_LISTEN and PARADIT_KEY_FILE (None if unset)."""
    global _DOOR
    with _DOOR_LOCK:
        if _DOOR is None and os.environ.get("PARADIT_LISTEN"):
            from .auth import read_key_file

            key_file = os.environ.get("PARADIT_KEY_FILE", "")
            if not key_file:
                raise errors.ConfigError("PARADIT_LISTEN is set but PARADIT_KEY_FILE is not: make a key with `python -m "
                                         "parallel_runtime agent --new-key FILE`, copy it to every machine, and point "
                                         "PARADIT_KEY_FILE at it.")
            _DOOR = FrontDoor(os.environ["PARADIT_LISTEN"], read_key_file(key_file))
            log.info("ParaDiT: agents of other machines may join at %s.", _DOOR.listen)
        return _DOOR


def open_front_door(listen: str, key: bytes) -> FrontDoor:
    """Open this process's front door explicitly (tests, the bench); replaces one opened before."""
    global _DOOR
    with _DOOR_LOCK:
        if _DOOR is not None:
            _DOOR.close()
        _DOOR = FrontDoor(listen, key)
        return _DOOR


def close_front_door() -> None:
    global _DOOR
    with _DOOR_LOCK:
        if _DOOR is not None:
            _DOOR.close()
        _DOOR = None


def connect_to(address: str, key: bytes, timeout_s: float = HANDSHAKE_S):
    """An authenticated connection to a front door at 'ADDRESS:PORT' (agents and remote workers)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    return connect_handshake(sock, key, timeout_s=timeout_s)
