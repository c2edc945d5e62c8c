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
from ..distributed.portability import interface_of, module_command
from .auth import AuthRefused, new_key_file, read_key_file
from .cluster import AGENT_SILENCE_S, PROTOCOL, check_agent_name, connect_to
from .protocol import Channel

RETRY_S = 2.0  # between attempts to reach the host
MODEL_FOLDERS = ("diffusion_models", "unet", "checkpoints", "controlnet")  # ComfyUI's, under its models/ folder
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
log = logging.getLogger("paradit.agent")


def header_digest(path: str) -> str:
    """What identifies a model file without reading its weights: SHA-256 of a safetensors file's header (every tensor's
    name, dtype, shape and offset), else of a file's first MiB (a GGUF's header and tensor table), with its size."""
    import json

    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if path.endswith(".safetensors") and 0 < n < 100 * 2**20:
            # Parsed and re-dumped with sorted keys: a writer's key order (metadata is a dict) is not the content.
            body = json.dumps(json.loads(f.read(n)), sort_keys=True).encode()
        else:
            body = head + f.read(2**20 - 8)
    return hashlib.sha256(body).hexdigest()[:32] + f"-{os.path.getsize(path)}"


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
        address = _local_address(conn)
        self.chan.send("agent", {"name": self.name, "protocol": PROTOCOL, "agent_id": self.agent_id,
                                 "devices": self.devices, "address": address})
        if not conn.poll(AGENT_SILENCE_S):
            return "lost: the host did not answer the join"
        kind, meta, _ = self.chan.recv()
        if kind != "welcome":
            return f"refused: {meta.get('message', kind)}"
        log.warning("ParaDiT agent %s: joined %s with %s.", self.name, self.join, ", ".join(self.devices))
        self.heard = time.monotonic()
        try:
            while True:
                if time.monotonic() - self.heard > AGENT_SILENCE_S:
                    return f"lost: the host sent nothing for {AGENT_SILENCE_S:.0f} s"
                if not conn.poll(0.5):
                    continue
                kind, meta, tensors = self.chan.recv()
                self.heard = time.monotonic()
                self._handle(kind, meta, tensors, address)
        except (EOFError, OSError, errors.ParaDiTError) as exc:
            return f"lost: {type(exc).__name__}: {exc}" if str(exc) else "lost: the host closed the connection"
        finally:
            self.end_all()
            self.chan.close()

    def _send(self, kind: str, meta: dict) -> None:
        try:
            self.chan.send(kind, meta)
        except OSError:
            pass  # the host is gone: serve() notices on its next read

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
                reply = {"path": self._resolve(meta["name"], meta["digest"])}
            elif kind == "probe":
                reply = {"bytes": sum(t.numel() for t in tensors.values())}
            else:
                raise errors.ConfigError(f"the agent {self.name} does not know the request {kind!r}: run the same "
                                         f"ParaDiT version on both machines.")
            self._send("reply", dict(reply, id=meta.get("id")))
        except errors.ParaDiTError as exc:
            self._send("error", {"id": meta.get("id"), "message": str(exc)})

    # -- workers -------------------------------------------------------------------------------------

    def _spawn(self, meta: dict, address: str) -> dict:
        from .relay import StoreRelay

        session = meta["session"]
        relay = self.relays.get(session) or StoreRelay(lambda: self._store_connection(session))
        self.relays[session] = relay
        threads = self.threads or meta["threads"] or worker_threads([d for _, d in meta["ranks"]],
                                                                    [None] * len(meta["ranks"]))
        env = _worker_env(address, threads)
        pids = []
        for rank, device in meta["ranks"]:
            proc = subprocess.Popen(
                module_command("parallel_runtime.runtime.worker", _PACKAGE_ROOT)
                + ["--rank", str(rank), "--world", str(meta["world"]), "--device", device, "--join", self.join,
                   "--session", session, "--threads", str(threads), "--parent-pid", str(os.getpid())],
                stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=_PACKAGE_ROOT)
            proc.stdin.write(self.key.hex().encode() + b"\n")
            proc.stdin.close()
            self.procs[(session, rank)] = proc
            threading.Thread(target=self._watch, args=(session, rank, proc), daemon=True).start()
            pids.append([rank, proc.pid])
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
        for relay in self.relays.values():
            relay.close()
        self.relays.clear()

    # -- model files ---------------------------------------------------------------------------------

    def _resolve(self, name: str, digest: str) -> str:
        """The path of the file called `name` in this machine's model folders whose header matches the host's."""
        found = [os.path.join(root, name) for folder in self.folders for root, _, files in os.walk(folder)
                 if name in files]
        for path in found:
            if header_digest(path) == digest:
                return path
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
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    interface = interface_of(address)
    if interface:  # the process group's transfers bind to the link towards the host, nowhere else
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = interface
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


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
            log.error("ParaDiT agent %s: %s", name, exc)
            return 2
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
