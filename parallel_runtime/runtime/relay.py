"""The rendezvous relay: how a worker on another machine reaches a session's c10d TCPStore, which listens on the
ComfyUI host's loopback only.

The agent listens on its own loopback (`StoreRelay`); each connection a worker's TCPStore client makes there is
carried over a fresh authenticated connection to the host's front door (auth.py), which splices it onto the store.
The store's own protocol is unauthenticated; this way nothing reaches it without the key.
"""
from __future__ import annotations

import socket
import threading

CHUNK = 1 << 16


def splice(plain: socket.socket, secure) -> None:
    """Copy bytes both ways between a plain socket and an authenticated connection until either side closes; returns
    at once (two daemon threads do the copying)."""
    def close_both():
        # shutdown before close: the other direction's thread may be blocked in recv or sendall on either end, and
        # Linux wakes it only for a shutdown (secure.close() shuts down too), so no relay thread outlives its pair.
        try:
            plain.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for end in (plain, secure):
            try:
                end.close()
            except OSError:
                pass

    def plain_to_secure():
        try:
            while True:
                data = plain.recv(CHUNK)
                if not data:
                    break
                secure.send_bytes(data)
        except (OSError, EOFError):
            pass
        close_both()

    def secure_to_plain():
        try:
            while True:
                # Both ends' relays send at most CHUNK per frame: a longer one is refused unread (the key's holder
                # still cannot make this side allocate gigabytes).
                plain.sendall(secure.recv_bytes(CHUNK))
        except (OSError, EOFError, ValueError, RuntimeError):
            pass  # a closed end, or a frame that failed its check (AuthRefused): either way the relay ends
        close_both()

    threading.Thread(target=plain_to_secure, daemon=True, name="paradit-relay-out").start()
    threading.Thread(target=secure_to_plain, daemon=True, name="paradit-relay-in").start()


class StoreRelay:
    """An agent's loopback listener for one session's workers: each connection goes on to the host's store."""

    def __init__(self, connect):
        """`connect()`: a new authenticated connection to the front door, already past its 'store' message."""
        self.connect = connect
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._loop, daemon=True, name="paradit-store-relay").start()

    def _loop(self) -> None:
        while not self._closed:
            try:
                local, _ = self.sock.accept()
            except OSError:
                return
            if self._closed:
                local.close()
                return
            try:
                splice(local, self.connect())
            except (OSError, EOFError, RuntimeError, ValueError):
                local.close()  # the worker's store client fails, and says so; its agent reports the exit

    def close(self) -> None:
        self._closed = True
        try:  # shutdown wakes the accept loop; close() alone left the port listening until one more connection
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
