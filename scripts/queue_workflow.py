#!/usr/bin/env python3
"""Queue a ComfyUI workflow, follow it over the websocket, fetch what it made.

Standard library only (a minimal websocket client is included; scripts/ui_workflow.py and
scripts/paradit_swap.py beside it), so it runs with any Python 3.10+, on the ComfyUI machine or beside it.
Typical use, with ComfyUI running on port 8188:

    python scripts/queue_workflow.py --workflow workflows/api/flux_dev_ulysses.json \\
        --set ParaDiTLoader.devices=0,1 --set ParaDiTStrategy.ulysses_degree=2 \\
        --set 4.text="a lighthouse at dusk" --set ParaDiTSampler.seed=7 --out ./outputs

    # one of ComfyUI's own templates (UI format), its model loader swapped for Load Parallel DiT
    python scripts/queue_workflow.py --workflow flux_dev_full_text_to_image.json \\
        --parallel ulysses=2 --devices 0,1 --set KSampler.steps=20 --out ./outputs

What it does:
  1. reads the workflow: API format (ComfyUI's "Export (API)" menu item, or workflows/api/) as it is; UI format
     (what the editor saves, ComfyUI's templates, workflows/) is converted to the API format the editor would
     queue, with the server's node classes from GET /object_info (see ui_workflow.py: subgraphs inlined as
     ids "outer:inner", reroutes, primitive nodes, muted and bypassed nodes handled as the editor does);
  2. with ``--parallel STRATEGY`` (auto, ulysses=2, cfg=2,ulysses=2, pipefusion=2, ...) puts Load Parallel
     DiT with that strategy in place of every UNETLoader (and of a CheckpointLoaderSimple's MODEL), on
     ``--devices`` (default auto), see paradit_swap.py;
  3. applies each ``--set NODE.INPUT=VALUE``: NODE is a node id ("8", "194:50" inside a subgraph), a class
     type ("ParaDiTSampler") or a node title ("Parallel Sampler") naming exactly one node; VALUE is read as
     JSON when it parses (42, 3.5, true, ["4", 0]) and as a plain string otherwise (cpu:2, a prompt text);
  4. opens ws://SERVER/ws, POSTs the graph to /prompt, prints the nodes as they run, the sampler's
     progress and ParaDiT's status lines (``--dry-run`` stops before this and prints the graph instead;
     ``--save-api FILE`` keeps a copy of it);
  5. reads /history and downloads every output file (images from Save Image, latents from Save Latent)
     through /view into --out.

Ctrl-C asks the server to interrupt the prompt. Exit status: 0 done, 1 execution error, 2 the server
rejected the graph (validation), 3 timed out, 130 interrupted.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import select
import socket
import ssl
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paradit_swap  # noqa: E402 - beside this script
import ui_workflow  # noqa: E402

EXIT_OK, EXIT_ERROR, EXIT_REJECTED, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class WorkflowError(Exception):
    """A problem with the workflow file or an override, reported as one line."""


# ---------------------------------------------------------------------------------------------------
# The server address and plain HTTP.

def base_url(server: str) -> str:
    """'127.0.0.1:8188', 'localhost:8188' or 'http(s)://host:port' -> 'http(s)://host:port'."""
    server = server.strip().rstrip("/")
    if "://" not in server:
        server = "http://" + server
    parts = urllib.parse.urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WorkflowError(f"--server {server!r} is not host:port or http://host:port.")
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def http_json(url: str, data: dict | None = None, timeout: float = 30.0):
    body = None if data is None else json.dumps(data).encode("utf-8")
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else None


def http_bytes(url: str, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


# ---------------------------------------------------------------------------------------------------
# A minimal websocket client (RFC 6455): text/binary frames, fragmentation, ping/pong, close.

_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class WebSocketClosed(Exception):
    pass


class WebSocket:
    """Just enough of a websocket client to read ComfyUI's /ws messages."""

    def __init__(self, url: str, timeout: float = 30.0):
        parts = urllib.parse.urlsplit(url)
        secure = parts.scheme in ("wss", "https")
        host, port = parts.hostname, parts.port or (443 if secure else 80)
        sock = socket.create_connection((host, port), timeout=timeout)
        if secure:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        self.sock, self.timeout, self._buf = sock, timeout, b""
        key = base64.b64encode(os.urandom(16)).decode()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(request.encode())
        while b"\r\n\r\n" not in self._buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise WebSocketClosed("the server closed the connection during the websocket handshake")
            self._buf += chunk
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        if " 101 " not in lines[0] + " ":
            self.sock.close()
            raise WebSocketClosed(f"websocket handshake refused: {lines[0]}")
        headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
        accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()
        if headers.get("sec-websocket-accept") != accept:
            self.sock.close()
            raise WebSocketClosed("websocket handshake failed: bad Sec-WebSocket-Accept")

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                raise WebSocketClosed("the server closed the websocket")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = self._read(2)
        fin, opcode, masked, length = b0 & 0x80, b0 & 0x0F, b1 & 0x80, b1 & 0x7F
        if length == 126:
            (length,) = struct.unpack(">H", self._read(2))
        elif length == 127:
            (length,) = struct.unpack(">Q", self._read(8))
        mask = self._read(4) if masked else None
        payload = self._read(length)
        if mask:
            payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
        return bool(fin), opcode, payload

    def send(self, payload: bytes, opcode: int = 0x1) -> None:
        """Send one frame; client frames are always masked."""
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            header = struct.pack(">BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            header = struct.pack(">BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            header = struct.pack(">BBQ", 0x80 | opcode, 0x80 | 127, n)
        self.sock.sendall(header + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))

    def recv(self, timeout: float | None = None) -> tuple[int, bytes] | None:
        """The next whole message as (opcode, payload): 1 text, 2 binary. None if nothing came in `timeout` s."""
        pending = self.sock.pending() if isinstance(self.sock, ssl.SSLSocket) else 0
        if not self._buf and not pending:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
        message, first_opcode = b"", None
        while True:
            fin, opcode, payload = self._frame()
            if opcode == 0x8:  # close: answer and stop
                try:
                    self.send(payload[:2], 0x8)
                except OSError:
                    pass
                raise WebSocketClosed("the server closed the websocket")
            if opcode == 0x9:  # ping
                self.send(payload, 0xA)
                continue
            if opcode == 0xA:  # pong
                continue
            if opcode != 0x0:
                first_opcode = opcode
            message += payload
            if fin:
                return first_opcode or 0x1, message

    def close(self) -> None:
        try:
            self.send(struct.pack(">H", 1000), 0x8)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------
# The workflow and its overrides.

def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise WorkflowError(f"cannot read {path}: {e.strerror}.") from None
    except json.JSONDecodeError as e:
        raise WorkflowError(f"{path} is not JSON ({e}).") from None


def load_workflow(path: str, object_info: dict | None = None, notes: list | None = None) -> dict:
    """The API-format graph in `path`; a UI-format file is converted with the server's /object_info."""
    return workflow_graph(read_json(path), path, object_info, notes)


def workflow_graph(data, path: str, object_info: dict | None = None, notes: list | None = None) -> dict:
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
        data = data["prompt"]  # a saved POST /prompt body
    if ui_workflow.is_ui_workflow(data):
        if object_info is None:
            raise WorkflowError(f"{path} is a UI-format workflow; converting it to the API format needs the "
                                f"server's node classes (GET /object_info): give --server, or --object-info FILE.")
        try:
            graph, left_out = ui_workflow.convert(data, object_info)
        except ui_workflow.ConversionError as e:
            raise WorkflowError(f"{path}: {e}") from None
        if notes is not None:
            notes.append(f"{os.path.basename(path)} is a UI-format workflow: converted to the {len(graph)} API nodes "
                         f"the editor would queue")
            notes.extend(left_out)
        return graph
    if not isinstance(data, dict) or not data or not all(
            isinstance(n, dict) and "class_type" in n for n in data.values()):
        raise WorkflowError(f"{path} is not an API-format workflow (a JSON object of node id -> "
                            f"{{class_type, inputs}}).")
    return data


def parse_value(text: str):
    """JSON if it parses (numbers, booleans, lists, quoted strings), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def find_node(graph: dict, ref: str, option: str = "--set") -> str:
    if ref in graph:
        return ref
    matches = [nid for nid, node in graph.items()
               if node.get("class_type") == ref or node.get("_meta", {}).get("title") == ref]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise WorkflowError(f"{option} names node {ref!r}, but the workflow has no node with that id, class type "
                            f"or title; ids are {', '.join(sorted(graph, key=_id_key))}.")
    raise WorkflowError(f"{option} names node {ref!r}, which matches nodes {', '.join(sorted(matches, key=_id_key))}; "
                        f"use one of those ids instead.")


def _id_key(nid: str):
    return (0, int(nid), "") if nid.isdigit() else (1, 0, nid)


def apply_overrides(graph: dict, overrides: list[str]) -> dict:
    """Apply 'NODE.INPUT=VALUE' overrides to a copy of the graph."""
    graph = json.loads(json.dumps(graph))
    for item in overrides or []:
        target, sep, value = item.partition("=")
        ref, dot, name = target.rpartition(".")
        if not sep or not dot or not ref or not name:
            raise WorkflowError(f"--set {item!r} is not NODE.INPUT=VALUE (e.g. ParaDiTSampler.seed=42).")
        nid = find_node(graph, ref)
        inputs = graph[nid].setdefault("inputs", {})
        if name not in inputs:
            raise WorkflowError(f"--set {item!r}: node {nid} ({graph[nid]['class_type']}) has no input {name!r} in "
                                f"this workflow; its inputs are {', '.join(inputs) or 'none'}.")
        inputs[name] = parse_value(value)
    return graph


# ---------------------------------------------------------------------------------------------------
# Queue, follow, fetch.

def _print(*args):
    print(*args, flush=True)


def describe_message(msg: dict, graph: dict) -> str | None:
    """One console line for a websocket message of our prompt, or None to stay quiet."""
    kind, data = msg.get("type"), msg.get("data") or {}
    if kind == "executing" and data.get("node") is not None:
        node = graph.get(str(data["node"]), {})
        title = node.get("_meta", {}).get("title") or node.get("class_type", "?")
        return f"running node {data['node']} ({title})"
    if kind == "execution_cached" and data.get("nodes"):
        return f"cached: nodes {', '.join(map(str, data['nodes']))}"
    if kind == "progress":
        return f"  step {data.get('value')}/{data.get('max')} (node {data.get('node')})"
    if kind == "paradit.status":
        parts = [f"ParaDiT {data.get('state')}"]
        if data.get("strategy"):
            parts.append(f"{data['strategy']} on {data.get('world_size')} worker(s)")
        status = data.get("status") or {}
        if status.get("sec_per_step"):
            parts.append(f"{status['sec_per_step']:.2f} s/step")
        if data.get("message"):
            parts.append(data["message"])
        return "  " + ", ".join(parts)
    return None


def follow(ws: WebSocket, prompt_id: str, graph: dict, deadline: float | None, on_message=None,
           verbose: bool = True) -> tuple[str, dict]:
    """Read the websocket until our prompt ends: ('success'|'error'|'interrupted'|'timeout', last message data)."""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if wait is not None and wait <= 0:
            return "timeout", {}
        got = ws.recv(timeout=min(wait, 1.0) if wait is not None else 1.0)
        if got is None:
            continue
        opcode, payload = got
        if opcode == 0x2:  # binary: previews, and progress text (event 3: node id + text)
            if len(payload) >= 8 and struct.unpack(">I", payload[:4])[0] == 3:
                (n,) = struct.unpack(">I", payload[4:8])
                node, text = payload[8:8 + n].decode(errors="replace"), payload[8 + n:].decode(errors="replace")
                if on_message:
                    on_message({"type": "progress_text", "data": {"node": node, "text": text}})
                if verbose and node in graph:
                    _print(f"  [{node}] {text.strip()}")
            continue
        try:
            msg = json.loads(payload)
        except ValueError:
            continue
        data = msg.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            continue  # someone else's prompt
        if on_message:
            on_message(msg)
        if verbose:
            line = describe_message(msg, graph)
            if line:
                _print(line)
        kind = msg.get("type")
        if kind == "execution_success":
            return "success", data
        if kind == "execution_error":
            return "error", data
        if kind == "execution_interrupted":
            return "interrupted", data
        if kind == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
            return "success", data  # older servers end with this alone


def output_files(outputs: dict) -> list[dict]:
    """Every file entry in /history outputs: {node, filename, subfolder, type, kind}."""
    files = []
    for node, out in (outputs or {}).items():
        for kind, items in (out or {}).items():
            if not isinstance(items, list):
                continue
            for item in items:
                if isinstance(item, dict) and "filename" in item and "type" in item:
                    files.append({"node": node, "kind": kind, **item})
    return files


def download(base: str, files: list[dict], out_dir: str, include_temp: bool = False) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for f in files:
        if f["type"] != "output" and not include_temp:
            continue
        query = urllib.parse.urlencode({"filename": f["filename"], "subfolder": f.get("subfolder", ""),
                                        "type": f["type"]})
        data = http_bytes(f"{base}/view?{query}")
        path = os.path.join(out_dir, os.path.basename(f["filename"]))
        with open(path, "wb") as fh:
            fh.write(data)
        paths.append(path)
    return paths


def run(server: str, graph: dict, *, out_dir: str | None = None, timeout: float | None = None,
        client_id: str | None = None, verbose: bool = True, on_message=None, include_temp: bool = False) -> dict:
    """Queue `graph`, follow it, fetch its outputs. Returns a dict:
    status ('success' | 'error' | 'interrupted' | 'rejected' | 'timeout'), prompt_id, error (the
    execution_error data or the /prompt rejection), outputs (/history outputs), files (downloaded paths)."""
    base = base_url(server)
    client_id = client_id or uuid.uuid4().hex
    ws_url = base.replace("http", "ws", 1) + "/ws?" + urllib.parse.urlencode({"clientId": client_id})
    ws = WebSocket(ws_url)  # before queueing, so no message of ours is missed
    result = {"status": None, "prompt_id": None, "error": None, "outputs": {}, "files": []}
    try:
        try:
            reply = http_json(f"{base}/prompt", {"prompt": graph, "client_id": client_id})
        except urllib.error.HTTPError as e:
            body = e.read().decode("utf-8", "replace")
            try:
                result["error"] = json.loads(body)
            except ValueError:
                result["error"] = {"error": {"message": body}}
            result["status"] = "rejected"
            if verbose:
                _print(f"the server rejected the workflow (HTTP {e.code}): {format_rejection(result['error'])}")
            return result
        prompt_id = result["prompt_id"] = reply["prompt_id"]
        if verbose:
            _print(f"queued prompt {prompt_id} (queue position {reply.get('number')})")
        deadline = None if not timeout else time.monotonic() + timeout
        try:
            status, data = follow(ws, prompt_id, graph, deadline, on_message, verbose)
        except KeyboardInterrupt:
            if verbose:
                _print("interrupting the prompt ...")
            http_json(f"{base}/interrupt", {"prompt_id": prompt_id})
            status, data = follow(ws, prompt_id, graph, time.monotonic() + 60, on_message, verbose)
            if status == "timeout":
                status = "interrupted"
        result["status"] = status
        if status == "error":
            result["error"] = data
            if verbose:
                _print(f"error in node {data.get('node_id')} ({data.get('node_type')}): "
                       f"{data.get('exception_message', '').strip()}")
        elif status == "interrupted" and verbose:
            _print(f"interrupted in node {data.get('node_id')} ({data.get('node_type')})")
        elif status == "timeout":
            if verbose:
                _print(f"no result within {timeout} s; the prompt is still queued or running")
            return result
        result["outputs"] = wait_for_history(base, prompt_id).get("outputs", {})
        if out_dir and status == "success":
            result["files"] = download(base, output_files(result["outputs"]), out_dir, include_temp)
            if verbose:
                for path in result["files"]:
                    _print(f"saved {path}")
        return result
    finally:
        ws.close()


def wait_for_history(base: str, prompt_id: str, timeout: float = 30.0) -> dict:
    """The /history entry of a prompt. The server sends its last websocket message a moment before it
    files the prompt in the history, so poll briefly."""
    deadline = time.monotonic() + timeout
    while True:
        entry = (http_json(f"{base}/history/{prompt_id}") or {}).get(prompt_id)
        if entry is not None or time.monotonic() > deadline:
            return entry or {}
        time.sleep(0.1)


def format_rejection(error: dict) -> str:
    parts = [str((error.get("error") or {}).get("message", "")).strip()]
    for nid, node_error in (error.get("node_errors") or {}).items():
        for e in node_error.get("errors", []):
            parts.append(f"node {nid} ({node_error.get('class_type')}): {e.get('message')}: {e.get('details')}")
    return "; ".join(p for p in parts if p)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        description="Queue a ComfyUI workflow (API or UI format), follow its progress, download its outputs.",
        epilog="Examples: %(prog)s --workflow workflows/api/flux_dev_ulysses.json "
               "--set ParaDiTLoader.devices=0,1 --set ParaDiTStrategy.ulysses_degree=2 "
               "--set ParaDiTSampler.seed=7 --out outputs; "
               "%(prog)s --workflow flux_dev_full_text_to_image.json --parallel ulysses=2 --devices 0,1 --out outputs")
    parser.add_argument("--server", default="127.0.0.1:8188", help="ComfyUI address (default 127.0.0.1:8188)")
    parser.add_argument("--workflow", required=True,
                        help="workflow JSON: API format, or UI format (saved by the editor, ComfyUI's templates)")
    parser.add_argument("--parallel", metavar="STRATEGY",
                        help="put Load Parallel DiT with this strategy in place of the workflow's UNETLoader / "
                             "CheckpointLoaderSimple model: auto, ulysses=2, cfg=2,ulysses=2, pipefusion=2, ring=2 "
                             "(plus patches=N, warmup=N)")
    parser.add_argument("--devices", help="with --parallel: Load Parallel DiT's devices (auto, 0,1, cpu:2; default auto)")
    parser.add_argument("--keep-loader", action="append", default=[], metavar="NODE",
                        help="with --parallel: leave this loader (id, class type or title) as it is; repeatable")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="override an input; NODE is an id, class type or title; repeatable")
    parser.add_argument("--object-info", metavar="FILE",
                        help="node classes (a saved GET /object_info) for a UI-format workflow, instead of the server's")
    parser.add_argument("--save-api", metavar="FILE", help="write the API-format graph that is queued to FILE")
    parser.add_argument("--dry-run", action="store_true",
                        help="stop before queueing; print the API-format graph (unless --save-api)")
    parser.add_argument("--out", help="download the output files (images, latents) into this folder")
    parser.add_argument("--include-temp", action="store_true", help="also download previews (type temp)")
    parser.add_argument("--timeout", type=float, default=0, help="give up after this many seconds (0: never)")
    parser.add_argument("--quiet", action="store_true", help="print only errors and saved files")
    parser.add_argument("--json", action="store_true", help="print the result (status, prompt_id, outputs, files) as JSON")
    return parser.parse_args(argv)


def prepare_graph(args, notes: list) -> dict:
    """The API-format graph to queue: read (converted when UI format), swapped (--parallel), overridden (--set)."""
    data = read_json(args.workflow)
    if (args.devices is not None or args.keep_loader) and not args.parallel:
        raise WorkflowError("--devices and --keep-loader go with --parallel; to change the devices of a Load Parallel "
                            "DiT already in the workflow use --set ParaDiTLoader.devices=...")
    object_info = None
    if args.object_info:
        object_info = read_json(args.object_info)
    elif args.parallel or ui_workflow.is_ui_workflow(data):
        object_info = http_json(f"{base_url(args.server)}/object_info", timeout=120)
    graph = workflow_graph(data, args.workflow, object_info, notes)
    if args.parallel:
        try:
            strategy = paradit_swap.parse_strategy(args.parallel)
            keep = tuple(find_node(graph, ref, "--keep-loader") for ref in args.keep_loader)
            graph, swapped = paradit_swap.swap_loaders(graph, strategy, args.devices or "auto", object_info, keep)
        except paradit_swap.SwapError as e:
            raise WorkflowError(str(e)) from None
        notes.extend(swapped)
    return apply_overrides(graph, args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes: list[str] = []
    try:
        graph = prepare_graph(args, notes)
        if not args.quiet:
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
        if args.save_api:
            with open(args.save_api, "w", encoding="utf-8") as f:
                json.dump(graph, f, indent=2)
        if args.dry_run:
            if not args.save_api:
                print(json.dumps(graph, indent=2))
            return EXIT_OK
        result = run(args.server, graph, out_dir=args.out, timeout=args.timeout or None, verbose=not args.quiet,
                     include_temp=args.include_temp)
    except WorkflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REJECTED
    except (urllib.error.URLError, ConnectionError, WebSocketClosed, OSError) as e:
        print(f"error: cannot talk to ComfyUI at {args.server}: {e}; is ComfyUI running and listening there?",
              file=sys.stderr)
        return EXIT_ERROR
    if args.quiet:
        if result["status"] == "error":
            print(f"error: {result['error'].get('exception_message', '').strip()}", file=sys.stderr)
        elif result["status"] == "rejected":
            print(f"error: {format_rejection(result['error'])}", file=sys.stderr)
        for path in result["files"]:
            print(path)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return {"success": EXIT_OK, "error": EXIT_ERROR, "rejected": EXIT_REJECTED, "timeout": EXIT_TIMEOUT,
            "interrupted": EXIT_INTERRUPTED}[result["status"]]


if __name__ == "__main__":
    sys.exit(main())
