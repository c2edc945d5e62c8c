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
from ..distributed.portability import TIMED_OUT
from .auth import AuthRefused, accept_handshake, connect_handshake
from .protocol import Channel

PROTOCOL = 1  # bumped when agents and hosts stop understanding each other's messages
AGENT_PING_S = 2.0  # how often the host pings each agent, and the agent answers
AGENT_SILENCE_S = 10.0  # silence after which either side calls the other lost (a frozen host, a pulled cable)
HANDSHAKE_S = 10.0  # the longest a connection may take to prove its key and say what it is
PROBE_BYTES = 4 * 2**20  # sent twice per agent to measure the link (the first opens TCP's window)
FIRST_MESSAGE_BYTES = 64 * 2**10  # what a connection says it is: a few names; more is refused unread
AGENT_MESSAGE_BYTES = 2**20  # an agent's messages to the host (replies, output lines, exits) carry no tensors
OUTPUT_LINE_CHARS = 500  # a worker output line as the host logs it
LOCAL = "local"  # the host name of this machine's ranks
RESERVED_NAMES = {"local", "all", "auto", "cpu", "cuda", "gpu", "mps", "xpu"}  # device words, never host names
DEVICE = re.compile(r"cpu|cuda:\d{1,3}")  # what an agent may offer (agent.py: parse_devices)
NAME = re.compile(r"[a-z][a-z0-9.-]{0,62}")
log = logging.getLogger("paradit")
_FROZEN = (f"it stopped taking or finishing messages for {AGENT_SILENCE_S:.0f} s: the machine froze, lost power or "
           f"dropped off the network")


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


_HOST_ENTRY = re.compile(r"([a-z][a-z0-9.-]*):(.+)")  # 'name:rest' (a reserved name, as in 'cpu:2', is not a host)


def _entries(spec: str) -> list[str]:
    return [e.strip() for e in spec.strip().lower().split(",")]


def split_devices(spec: str) -> tuple[str, dict[str, list[str]]]:
    """The local part of a devices string and each named host's entries, in order: '0,1,gpu-box-2:0,1' ->
    ('0,1', {'gpu-box-2': ['0', '1']}). An entry 'name:rest' switches to that host; the entries after it are that
    host's until the next switch; a bare 'name' is that host's every device ('box-b' -> {'box-b': []}). 'all' is
    every joined host's every device (the local ones: 'auto')."""
    local: list[str] = []
    hosts: dict[str, list[str]] = {}
    current = None
    for entry in _entries(spec or "auto"):
        m = _HOST_ENTRY.fullmatch(entry)
        if entry == "all":
            hosts.setdefault("*", [])
            local.append("auto")
            current = None
            continue
        if m and m.group(1) not in RESERVED_NAMES:
            current = m.group(1)
            entry = m.group(2)
        elif NAME.fullmatch(entry) and entry not in RESERVED_NAMES:
            # A host named alone: without this it fell to the local parser, whose sentence knows no hosts.
            current = entry
            hosts.setdefault(current, [])
            continue
        if current is None:
            local.append(entry)
        else:
            hosts.setdefault(current, []).append(entry)
    return ",".join(local), hosts


def names_remote(spec: str) -> bool:
    return bool(split_devices(spec)[1])


def names_a_machine(spec: str) -> bool:
    """Whether a devices string names another machine beyond doubt ('NAME:...' or 'all'), rather than only by a
    bare word, which may as well be a typo of this machine's devices ('atuo')."""
    for entry in _entries(spec or ""):
        m = _HOST_ENTRY.fullmatch(entry)
        if entry == "all" or (m and m.group(1) not in RESERVED_NAMES):
            return True
    return False


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
        # Names both causes: a bare word (a typo of 'auto', say) reads as a machine's name too.
        named = ", ".join(n for n in wanted if n != "*") or "every joined machine"
        raise errors.ConfigError(f"devices {spec!r} names other machines ({named}), but this host has no front door "
                                 f"for their agents: fix devices if that was meant as this machine's ('auto', GPU "
                                 f"indices like 0,1, or cpu:N), else set PARADIT_LISTEN (this machine's private "
                                 f"address and a port, e.g. 192.168.1.10:29600) and PARADIT_KEY_FILE, then restart "
                                 f"ComfyUI.")
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
        if not self.ended.is_set():
            self.agent.send("kill", {"session": self.session, "rank": self.rank})


class AgentLink:
    """One joined agent as the host sees it: its name, devices and measured link; requests to it; its workers."""

    def __init__(self, door: "FrontDoor", chan: Channel, hello: dict, peer: str):
        self.door, self.chan, self.peer = door, chan, peer
        self.name = hello["name"]
        self.devices: list[str] = list(hello["devices"])
        self.address = str(hello.get("address", ""))  # the agent's address on the link to this host
        self.agent_id = str(hello.get("agent_id", ""))
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
        # Every send and every rest of a frame is bounded: a frozen agent (SIGSTOP, a pulled cable) must not hold a
        # request's big send, or the channel's lock and with it the pings that would notice, forever.
        bound_io(self.chan.conn, AGENT_SILENCE_S)
        threading.Thread(target=self._read, daemon=True, name=f"paradit-agent-{self.name}").start()
        threading.Thread(target=self._ping, daemon=True, name=f"paradit-agent-ping-{self.name}").start()

    def send(self, kind: str, meta: dict | None = None, tensors: dict | None = None) -> None:
        if self.alive:
            try:
                self.chan.send(kind, meta, tensors)
            except OSError as exc:
                self.lose(_FROZEN if isinstance(exc, TIMED_OUT) else f"its connection broke ({type(exc).__name__})")

    def request(self, kind: str, meta: dict | None = None, tensors: dict | None = None,
                timeout_s: float = 60.0) -> dict:
        """Send a request and wait for its reply; an agent's error or a lost agent is one sentence naming it."""
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            slot = self._replies[rid] = [threading.Event(), None]
        self.send(kind, dict(meta or {}, id=rid), tensors)
        deadline = time.monotonic() + timeout_s
        while not slot[0].wait(0.1) and self.alive and time.monotonic() < deadline:
            pass
        self._replies.pop(rid, None)
        if slot[1] is None:  # lost (lose() wakes every waiting request) or timed out: no reply to unpack
            why = self.lost_reason or f"it did not answer {kind!r} within {timeout_s:.0f} s"
            raise errors.WorkerError(f"the host {self.name} ({self.peer}) is unreachable: {why}; check that "
                                     f"machine and its agent, then retry.")
        reply_kind, reply = slot[1]
        if reply_kind == "error":
            raise errors.ConfigError(_printable(str(reply.get("message")), 2000))
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
            elif re.fullmatch(r"cpu(:\d+)?", entry) and "cpu" in self.devices:
                # An agent lends only what its --devices names: a GPU box lending its GPUs lends no CPU workers.
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
                kind, meta, tensors = self.chan.recv(maxlength=AGENT_MESSAGE_BYTES)
                self.heard = time.monotonic()
                self._handle(kind, meta)
            except EOFError:
                self.lose("its agent closed the connection")
                return
            except (OSError, errors.ParaDiTError) as exc:
                self.lose(_FROZEN if isinstance(exc, TIMED_OUT) else f"its connection broke ({exc})")
                return
            except Exception as exc:  # noqa: BLE001 - a message this host cannot read must not end the reader
                # silently (the agent would look alive, unheard, for AGENT_SILENCE_S and its replies be lost).
                self.lose(f"it sent a message this host cannot read ({type(exc).__name__}: {exc}): run the same "
                          f"ParaDiT version on both machines")
                return

    def _handle(self, kind: str, meta: dict) -> None:
        if kind in ("reply", "error"):
            # .get: the request may have timed out and dropped its slot since this message was sent.
            slot = self._replies.get(meta.get("id")) if isinstance(meta.get("id"), int) else None
            if slot is not None:
                slot[1] = (kind, meta)
                slot[0].set()
        elif kind == "exited":
            # Popped: a runtime restarted many times must not keep every earlier worker's handle here.
            proc = self.processes.pop((meta["session"], meta["rank"]), None)
            if proc is not None:
                proc.tail.extend(_printable(str(line), OUTPUT_LINE_CHARS) for line in list(meta.get("tail", ()))[-20:])
                proc.end(int(meta["code"]))
        elif kind == "output":
            line = _printable(str(meta["line"]), OUTPUT_LINE_CHARS)
            proc = self.processes.get((meta["session"], meta["rank"]))
            if proc is not None:
                proc.tail.append(line)
            log.info("[%s rank %s] %s", self.name, _printable(str(meta["rank"]), 8), line)

    def spawn(self, session: str, ranks: list[tuple[int, str]], world: int, threads: int) -> dict[int, RemoteProcess]:
        """Start this host's worker ranks for `session`; they connect back through the front door."""
        # Registered before asking: a worker that dies at once can report its exit before the spawn's reply
        # arrives, and an exit nobody waits for left the start waiting STARTUP_TIMEOUT_S for its connection.
        procs = {rank: RemoteProcess(self, session, rank, None) for rank, _ in ranks}
        self.processes.update({(session, rank): proc for rank, proc in procs.items()})
        try:
            reply = self.request("spawn", {"session": session, "world": world, "threads": threads,
                                           "ranks": [[r, d] for r, d in ranks]})
        except errors.ParaDiTError as exc:
            for rank, proc in procs.items():
                self.processes.pop((session, rank), None)
                proc.end(None, str(exc))
            raise
        for rank, pid in reply["pids"]:
            procs[rank].pid = pid
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
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:  # bind() raised OverflowError past 65535
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
        self._joining: set[str] = set()  # names being welcomed: reserved, not yet published in self.agents
        threading.Thread(target=self._accept_loop, daemon=True, name="paradit-front-door").start()

    @property
    def listen(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        self._closed = True
        try:  # shutdown wakes the accept loop: after close() alone, Linux keeps the port listening until one more
            self.sock.shutdown(socket.SHUT_RDWR)  # connection arrives, and admits that one
        except OSError:
            pass
        self.sock.close()
        for agent in list(self.agents.values()):
            agent.lose("this host closed its front door")

    def live_agents(self) -> list[AgentLink]:
        return [a for a in list(self.agents.values()) if a.alive]  # list(): _join may add one meanwhile

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
        session = self.sessions.pop(token, None)
        while session is not None and not session.connections.empty():
            session.connections.get().close()  # workers that connected after their start was given up

    # -- connections ---------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self.sock.accept()
            except OSError:
                return
            if self._closed:
                sock.close()
                return
            threading.Thread(target=self._admit, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True,
                             name="paradit-admit").start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """Authenticate, read the one message that says what the connection is, hand it on (else close it)."""
        try:
            conn = accept_handshake(sock, self.key, timeout_s=HANDSHAKE_S)
        except AuthRefused as exc:
            self.refuse(str(exc))
            sock.close()
            return
        chan = Channel(conn)
        try:
            # The first message too must arrive whole within the bound and be small: poll() alone let a peer that
            # sent half a frame hold this thread forever, and one announcing gigabytes have them allocated.
            bound_io(conn, HANDSHAKE_S)
            if not conn.poll(HANDSHAKE_S):
                raise TimeoutError(f"it said nothing within {HANDSHAKE_S:g} s of its handshake")
            kind, meta, tensors = chan.recv(maxlength=FIRST_MESSAGE_BYTES)
            if not isinstance(meta, dict) or tensors:
                raise ValueError("its first message is not one a ParaDiT agent or worker sends")
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends ends in one refusal, never a dead thread
            if isinstance(exc, TIMED_OUT) and not str(exc).startswith("it said"):  # SO_RCVTIMEO mid-frame
                what = f"it sent only part of its first message within {HANDSHAKE_S:g} s"
            else:
                what = str(exc) if str(exc).startswith("it ") else f"{type(exc).__name__}: {exc}"
            self.refuse(f"dropped a connection from {peer} after its handshake: {what}: run the same ParaDiT version "
                        f"on both machines")
            chan.close()
            return
        if self._closed:
            chan.close()
            return
        try:
            session = self.sessions.get(meta.get("session")) if isinstance(meta.get("session"), str) else None
            if kind == "agent":
                self._join(chan, meta, peer)
            elif kind == "worker" and session is not None:
                session.connections.put(conn)  # the client bounds its sends and reads (client._bound_io)
            elif kind == "store" and session is not None:
                from .relay import splice

                bound_io(conn, None)  # a store connection idles for the whole session: no receive timeout
                store = socket.create_connection(("127.0.0.1", session.store_port), timeout=10)
                store.settimeout(None)
                splice(store, conn)
            else:
                self.refuse(f"refused a {_printable(str(kind), 40)!r} connection from {peer}: it names no session "
                            f"this host runs (a stale worker of an earlier start, or another ParaDiT version)")
                chan.close()
        except Exception as exc:  # noqa: BLE001 - as above
            self.refuse(f"dropped a {_printable(str(kind), 40)!r} connection from {peer}: {type(exc).__name__}: {exc}")
            chan.close()

    def _join(self, chan: Channel, hello: dict, peer: str) -> None:
        """Register an agent, or refuse it in one sentence that reaches both sides' logs."""
        problem, old = None, None
        name = _printable(str(hello.get("name", "")), 63)
        devices = hello.get("devices")
        # Under the lock: two namesakes joining at once both found no live one, and the first's link was orphaned
        # (its threads and connection kept, its agent believing it had joined).
        with self._lock:
            if hello.get("protocol") != PROTOCOL:
                problem = (f"the agent {name!r} at {peer} speaks ParaDiT protocol "
                           f"{_printable(str(hello.get('protocol')), 20)}, this host {PROTOCOL}: run the same ParaDiT "
                           f"version on both machines")
            elif not NAME.fullmatch(name) or name in RESERVED_NAMES:
                # The agent checks its own name; the host must too: 'local' or a name with ':' or spaces would make
                # its devices unnameable or land on this machine's ranks.
                problem = f"the agent at {peer} calls itself {name!r}, which cannot name a host: start it with --name"
            elif not (isinstance(devices, list) and devices and all(isinstance(d, str) and DEVICE.fullmatch(d)
                                                                     for d in devices)):
                problem = (f"the agent {name!r} at {peer} offers no devices this host understands "
                           f"({_printable(str(devices), 80)}): run the same ParaDiT version on both machines")
            else:
                old = self.agents.get(name)
                if name in self._joining or (old is not None and old.alive
                                             and time.monotonic() - old.heard < AGENT_SILENCE_S):
                    where = old.peer if old is not None and old.alive else "another address"
                    problem = (f"a second agent named {name!r} tried to join from {peer} while the one at {where} "
                               f"is connected: give each machine's agent its own --name")
                else:
                    self._joining.add(name)
        if problem:
            self.refuse(problem)
            try:
                chan.send("refused", {"message": problem})
            except OSError:
                pass
            chan.close()
            return
        # Published only once welcomed and read: a request sent to it before its welcome (a prompt starting right
        # then) reached the agent first, which took it for a refusal.
        agent = AgentLink(self, chan, dict(hello, name=name), peer)
        try:
            if old is not None:
                old.lose(f"a new agent of that name joined from {peer}")
            chan.send("welcome", {"host": socket.gethostname(), "listen": self.listen})
            agent.start()
            with self._lock:
                self.agents[name] = agent
        except OSError as exc:
            agent.lose(f"its connection broke as it joined ({exc})")
            return
        finally:
            with self._lock:
                self._joining.discard(name)
        log.info("ParaDiT: the host %s joined from %s with %s.", name, peer, ", ".join(agent.devices))

    def status(self) -> dict:
        return {"listen": self.listen,
                "agents": [{"name": a.name, "peer": a.peer, "devices": a.devices, "alive": a.alive,
                            "lost": a.lost_reason or None,
                            "link_mb_s": round(a.link[1] / 1e6, 1) if a.link else None}
                           for a in list(self.agents.values())],
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


def bound_io(conn, seconds: float | None) -> None:
    """Bound each send and each read on a connection's socket to `seconds` without progress (None: unbounded):
    SO_SNDTIMEO / SO_RCVTIMEO, as client._bound_io does for the workers' channels."""
    from ..distributed.portability import send_small_messages_now, socket_timeout

    value = socket_timeout(seconds) if seconds else (0 if os.name == "nt" else socket_timeout(0))
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        send_small_messages_now(sock)
        sock.setblocking(True)  # a host's socket.setdefaulttimeout() would make the new object non-blocking
    finally:
        sock.detach()


def _printable(text: str, limit: int) -> str:
    """`text` as one log line of at most `limit` characters: an agent's output or message may hold newlines or
    terminal escapes, which must not forge lines in this host's log."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])


def connect_to(address: str, key: bytes, timeout_s: float = HANDSHAKE_S):
    """An authenticated connection to a front door at 'ADDRESS:PORT' (agents and remote workers)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    return connect_handshake(sock, key, timeout_s=timeout_s)
