"""Run inside a test host by test_multinode_cluster: join the front door once as a real agent while recording every byte
this side sends, leave, then replay those bytes verbatim on a new connection. Prints {"first": ..., "replay": ...}."""
from __future__ import annotations

import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_runtime.runtime.auth import MAGIC, NONCE_BYTES, VERDICT_OK, connect_handshake, read_key_file  # noqa: E402
from parallel_runtime.runtime.cluster import PROTOCOL  # noqa: E402
from parallel_runtime.runtime.protocol import Channel  # noqa: E402


class RecordingSocket(socket.socket):
    """A socket that keeps a copy of everything it sends."""

    sent = b""

    def sendall(self, data, *args):
        self.sent += bytes(data)
        return super().sendall(data, *args)


def main(listen: str, key_file: str) -> None:
    host, _, port = listen.rpartition(":")
    sock = RecordingSocket(socket.AF_INET, socket.SOCK_STREAM)
    sock.connect((host, int(port)))
    chan = Channel(connect_handshake(sock, read_key_file(key_file)))
    chan.send("agent", {"name": "replayer", "protocol": PROTOCOL, "agent_id": "r", "devices": ["cpu"], "address": host})
    first, _, _ = chan.recv()
    recorded = sock.sent
    chan.close()

    replay = socket.create_connection((host, int(port)), timeout=10)
    greeting = b""
    while len(greeting) < len(MAGIC) + NONCE_BYTES:  # the host's fresh nonce: the recording answers an old one
        greeting += replay.recv(len(MAGIC) + NONCE_BYTES - len(greeting))
    replay.sendall(recorded)  # the old proof, then the old agent message behind it
    verdict = b""
    try:
        while len(verdict) < len(VERDICT_OK):
            chunk = replay.recv(len(VERDICT_OK) - len(verdict))
            if not chunk:
                break
            verdict += chunk
    except OSError:
        pass
    replay.close()
    print(json.dumps({"first": first, "replay": "accepted" if verdict == VERDICT_OK else "refused"}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
