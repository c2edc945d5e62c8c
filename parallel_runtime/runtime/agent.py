"""`python -m parallel_runtime agent`: lends this machine's devices to a ComfyUI host's ParaDiT runtime.

The agent joins the host's front door (cluster.py) with the shared key, says its name and devices, and stays
connected: it answers the host's pings, starts worker ranks when the host's runtime asks (each connects back to the
host through the same front door, and to the session's rendezvous store through this agent's loopback relay),
finds model files by name in this machine's own ComfyUI model folders (weights never cross the network), and
reports its workers' output and exits. When the host goes silent or the connection drops it ends its workers (none
is left behind) and joins again, so a restarted host or a mended cable needs nothing done here.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from .. import errors
from ..distributed.devices import parse_devices, worker_threads
from ..distributed.portability import interface_of, module_command, worker_environment
from .auth import AuthRefused, new_key_file, read_key_file
from .cluster import AGENT_SILENCE_S, PROBE_BYTES, PROTOCOL, bound_io, check_agent_name, connect_to
from .protocol import Channel

RETRY_S = 2.0  # between attempts to reach the host
MODEL_FOLDERS = ("diffusion_models", "unet", "checkpoints", "controlnet")  # ComfyUI's, under its models/ folder
HOST_MESSAGE_BYTES = PROBE_BYTES + 2**20  # the host's largest message to an agent: a link probe
DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES = 16, 2**16  # the weights read to tell two files of one header apart
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
log = logging.getLogger("paradit.agent")


def header_digest(path: str) -> str:
    """What identifies a model file without reading all its weights: SHA-256 of a safetensors file's header (every
    tensor's name, dtype, shape and offset), else of a file's first MiB (a GGUF's header and tensor table), then of
    DIGEST_SAMPLES slices spread over the rest, with its size. The samples: two fine-tunes of one model (the same
    name on two machines, say) share every header field, and only their weights tell them apart."""
    import json

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        body = None
        if path.endswith(".safetensors") and 0 < n < 100 * 2**20:
            try:  # parsed and re-dumped with sorted keys: a writer's key order (metadata is a dict) is not content
                body, start = json.dumps(json.loads(f.read(n)), sort_keys=True).encode(), 8 + n
            except ValueError:  # a damaged header: identified by its bytes like any other file, not an exception
                f.seek(8)
        if body is None:
            body, start = head + f.read(2**20 - 8), min(size, 2**20)
        digest = hashlib.sha256(body)
        for i in range(DIGEST_SAMPLES):
            f.seek(start + (size - start) * i // DIGEST_SAMPLES)
            digest.update(f.read(DIGEST_SAMPLE_BYTES))
    return digest.hexdigest()[:32] + f"-{size}"


class Agent:
    """One connection to the host: serves it until it is lost, then ends every worker it started."""

    def __init__(self, join: str, key: bytes, name: str, devices: list[str], folders: list[str], threads: int = 0):
        self.join, self.key, self.name, self.devices, self.folders = join, key, name, devices, folders
        self.threads = threads  # torch threads per worker; 0: this machine's cores shared among a session's workers
        self.agent_id = secrets.token_hex(8)
        self.chan: Channel | None = None
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.relays: dict[str, object] = {}
        self.heard = time.monotonic()

    # -- the connection ------------------------------------------------------------------------------

    def serve(self) -> str:
        """Join and serve; returns why it ended ('lost', 'refused: ...')."""
        conn = connect_to(self.join, self.key)
        self.chan = Channel(conn)
        # Every send and every rest of a frame bounded: a frozen host (SIGSTOP, a pulled cable) fills the socket's
        # buffer, and an unbounded send from a worker's output thread held the channel's lock, the pongs behind it
        # and this loop's silence check forever, the workers with it.
        bound_io(conn, AGENT_SILENCE_S)
        try:
            address = _local_address(conn)
            self.chan.send("agent", {"name": self.name, "protocol": PROTOCOL, "agent_id": self.agent_id,
                                     "devices": self.devices, "address": address})
            if not conn.poll(AGENT_SILENCE_S):
                return "lost: the host did not answer the join"
            kind, meta, _ = self.chan.recv(maxlength=HOST_MESSAGE_BYTES)
            if kind != "welcome":
                return f"refused: {meta.get('message', kind)}"
            log.warning("ParaDiT agent %s: joined %s with %s.", self.name, self.join, ", ".join(self.devices))
            self.heard = time.monotonic()
            while True:
                if time.monotonic() - self.heard > AGENT_SILENCE_S:
                    return f"lost: the host sent nothing for {AGENT_SILENCE_S:.0f} s"
                if not conn.poll(0.5):
                    continue
                kind, meta, tensors = self.chan.recv(maxlength=HOST_MESSAGE_BYTES)
                self.heard = time.monotonic()
                self._handle(kind, meta, tensors, address)
        except (EOFError, OSError, errors.ParaDiTError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # ValueError and the rest: a message this agent cannot read (another version): the connection is over,
            # never this process (it would leave its workers to their parent watch and stop rejoining).
            return f"lost: {type(exc).__name__}: {exc}" if str(exc) else "lost: the host closed the connection"
        finally:
            self.end_all()
            self.chan.close()  # on every path (a refusal too): no socket waits for the garbage collector

    def _send(self, kind: str, meta: dict) -> None:
        try:
            self.chan.send(kind, meta)
        except OSError:
            # A send that timed out may have left half a frame: the stream is unusable. Shutting it down makes
            # serve() read the end at once (its next poll), end the workers and join again.
            self.chan.conn.shutdown()

    def _handle(self, kind: str, meta: dict, tensors: dict, address: str) -> None:
        if kind == "ping":
            self._send("pong", {})
            return
        try:
            if kind == "spawn":
                reply = self._spawn(meta, address)
            elif kind == "kill":
                self._kill(meta)
                return
            elif kind == "resolve":
                reply = {"path": self._resolve(str(meta["name"]), str(meta["digest"]))}
            elif kind == "probe":
                reply = {"bytes": sum(t.numel() for t in tensors.values())}
            else:
                raise errors.ConfigError(f"the agent {self.name} does not know the request {kind!r}: run the same "
                                         f"ParaDiT version on both machines.")
            self._send("reply", dict(reply, id=meta.get("id")))
        except errors.ParaDiTError as exc:
            self._send("error", {"id": meta.get("id"), "message": str(exc)})
        except (OSError, KeyError, TypeError, ValueError) as exc:
            # A request that fails here (a spawn the OS refuses, a request of another version) is an answer
            # naming this machine, not a lost connection: that ended every worker and rejoined.
            self._send("error", {"id": meta.get("id"), "message": f"the host {self.name} could not do {kind!r} "
                                 f"({type(exc).__name__}: {exc}): see its agent's log, fix that and retry."})

    # -- workers -------------------------------------------------------------------------------------

    def _spawn(self, meta: dict, address: str) -> dict:
        from .relay import StoreRelay

        session = str(meta["session"])
        threads = self.threads or meta["threads"] or worker_threads([d for _, d in meta["ranks"]],
                                                                    [None] * len(meta["ranks"]))
        env = _worker_env(address, threads)
        relay = self.relays.get(session) or StoreRelay(lambda: self._store_connection(session))
        self.relays[session] = relay
        pids = []
        try:
            for rank, device in meta["ranks"]:
                proc = subprocess.Popen(
                    module_command("parallel_runtime.runtime.worker", _PACKAGE_ROOT)
                    + ["--rank", str(int(rank)), "--world", str(int(meta["world"])), "--device", str(device),
                       "--join", self.join, "--session", str(session), "--threads", str(threads),
                       "--parent-pid", str(os.getpid()), "--host", self.name],
                    stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=_PACKAGE_ROOT)
                self.procs[(session, rank)] = proc
                threading.Thread(target=self._watch, args=(session, rank, proc), daemon=True).start()
                proc.stdin.write(self.key.hex().encode() + b"\n")
                proc.stdin.close()
                pids.append([rank, proc.pid])
        except BaseException:
            # The ranks started before the failure would wait for a start the host has given up: end them now
            # (their last exit closes the relay; with none started, close it here).
            self._kill({"session": session})
            if not any(s == session for s, _ in list(self.procs)):
                self.relays.pop(session, relay).close()
            raise
        return {"pids": pids, "relay_port": relay.port}

    def _store_connection(self, session: str):
        conn = connect_to(self.join, self.key)
        Channel(conn).send("store", {"session": session})
        return conn

    def _watch(self, session: str, rank: int, proc: subprocess.Popen) -> None:
        """Forward a worker's output to the host (and this console), then its exit."""
        tail: collections.deque = collections.deque(maxlen=20)
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            sys.stderr.write(f"[rank {rank}] {line}\n")
            self._send("output", {"session": session, "rank": rank, "line": line[:500]})
        code = proc.wait()
        self.procs.pop((session, rank), None)
        if not any(s == session for s, _ in list(self.procs)):
            # The session's last worker here ended: its relay's port would otherwise stay open (and its thread
            # run) until the host is lost, one more for every start of the runtime.
            relay = self.relays.pop(session, None)
            if relay is not None:
                relay.close()
        self._send("exited", {"session": session, "rank": rank, "code": code, "tail": list(tail)})

    def _kill(self, meta: dict) -> None:
        for (session, rank), proc in list(self.procs.items()):
            if session == meta["session"] and meta.get("rank") in (None, rank):
                proc.kill()

    def end_all(self) -> None:
        """End every worker this agent started (the host that asked for them is gone) and wait for them."""
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for session in list(self.relays):
            relay = self.relays.pop(session, None)
            if relay is not None:  # a worker's _watch may have closed it meanwhile
                relay.close()

    # -- model files ---------------------------------------------------------------------------------

    def _resolve(self, name: str, digest: str) -> str:
        """The path of the file called `name` in this machine's model folders whose header matches the host's."""
        found = [os.path.join(root, name) for folder in self.folders for root, _, files in os.walk(folder)
                 if name in files]
        unreadable = []
        for path in found:
            try:
                if header_digest(path) == digest:
                    return path
            except OSError as exc:  # one unreadable copy must not hide a good one elsewhere
                unreadable.append(f"{path} ({exc.strerror or exc})")
        if unreadable and len(unreadable) == len(found):
            raise errors.ConfigError(f"the host {self.name} cannot read {', '.join(unreadable)}: let its agent's user "
                                     f"read the file there.")
        if found:
            raise errors.ConfigError(f"the host {self.name} has {found[0]}, but it differs from this host's {name} "
                                     f"(another version or a damaged copy): copy the same file to {self.name}.")
        where = ", ".join(self.folders) or "no model folder (start its agent with --comfyui or --models)"
        raise errors.ConfigError(f"the host {self.name} has no file named {name} in its model folders ({where}): copy "
                                 f"it there (the same file as on this host).")


def _local_address(conn) -> str:
    """This machine's address on the connection to the host: the interface the workers' transfers bind to."""
    import socket

    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        return sock.getsockname()[0]
    finally:
        sock.close()


def _worker_env(address: str, threads: int) -> dict:
    env = dict(os.environ, PARADIT_MULTIHOST="1")  # a broken link is then the machines' network (runtime/links.py)
    # The process group's transfers bind to the link towards the host, nowhere else.
    return worker_environment(env, _PACKAGE_ROOT, threads, interface_of(address), pin_interface=True)


def model_folders(comfyui: str | None, extra: list[str]) -> list[str]:
    folders = [os.path.join(comfyui, "models", f) for f in MODEL_FOLDERS] if comfyui else []
    return [os.path.abspath(f) for f in folders + list(extra) if os.path.isdir(f)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime agent",
                                 description="Lend this machine's devices to a ComfyUI host's ParaDiT runtime.")
    ap.add_argument("--join", help="the host's PARADIT_LISTEN address, ADDRESS:PORT")
    ap.add_argument("--key-file", help="the key file, the same bytes as the host's PARADIT_KEY_FILE")
    ap.add_argument("--new-key", metavar="FILE", help="write a new random key to FILE (mode 0600) and exit")
    ap.add_argument("--name", default=None, help="this machine's name in a devices list (default: its hostname)")
    ap.add_argument("--devices", default="auto", help="the devices it lends: auto, GPU indices like 0,1, or cpu:N")
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR"), help="this machine's ComfyUI folder")
    ap.add_argument("--models", action="append", default=[], help="another folder to find model files in")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: the cores shared)")
    ap.add_argument("--once", action="store_true", help="exit when the host is lost instead of joining again")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.new_key:
        new_key_file(args.new_key)
        print(f"wrote a new key to {args.new_key}; copy it (mode 0600) to every machine of the runtime.")
        return 0
    if not args.join or not args.key_file:
        ap.error("--join and --key-file are required")
    try:
        import socket

        key = read_key_file(args.key_file)
        name = check_agent_name(args.name or socket.gethostname().split(".")[0])
        devices = parse_devices(args.devices)
    except errors.ParaDiTError as exc:
        print(f"ParaDiT agent: {exc}", file=sys.stderr)
        return 2
    folders = model_folders(args.comfyui, args.models)
    # A stop request (a service manager's SIGTERM) unwinds through serve(), which ends this agent's workers first.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        agent = Agent(args.join, key, name, devices, folders, args.threads)
        try:
            why = agent.serve()
        except AuthRefused as exc:
            if exc.reason in ("wrong_key", "replayed_or_forged", "not_paradit"):  # retrying cannot mend these
                log.error("ParaDiT agent %s: %s", name, exc)
                return 2
            # A handshake that timed out or was cut (a host busy, restarting or frozen a moment): the agent exited
            # for good here, so an agent "that comes back" needed a person after every host hiccup.
            why = f"cannot join {args.join}: {exc}"
        except (OSError, EOFError) as exc:
            why = f"cannot reach {args.join} ({type(exc).__name__}: {exc})"
        # Refused (a namesake still connected, or another protocol): the host's sentence is in both logs; a
        # namesake that was this agent's own earlier run is forgotten after AGENT_SILENCE_S, so try again then.
        wait = AGENT_SILENCE_S if why.startswith("refused") else RETRY_S
        log.warning("ParaDiT agent %s: %s; joining again in %.0f s.", name, why, wait)
        if args.once:
            return 3 if why.startswith("refused") else 0
        time.sleep(wait)


if __name__ == "__main__":
    sys.exit(main())
