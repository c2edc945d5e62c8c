"""The authenticated channel every cross-host connection uses: a mutual HMAC-SHA256 handshake over a shared key,
then frames that each carry an HMAC tag.

What it protects against: a peer without the key (refused after reading only the handshake's fixed-size fields,
before any message), a replayed handshake (both sides draw a fresh nonce), a host that fakes being ours (it must
prove the key too), and, after the handshake, a frame tampered with, replayed, reordered, dropped or reflected back
to its sender (every frame's tag covers its direction and its sequence number under a key of this session only).
What it does not: nothing is encrypted, so anyone on the wire reads prompts, latents and weights as they pass;
it does not hide that a ParaDiT host listens; it does not survive a leaked key file. Keep the network private
(a LAN, a VPN, a tunnel) and the key file 0600.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import select
import socket
import struct
import time

from ..errors import ConfigError

KEY_BYTES = 32
MAGIC = b"PARADIT-AUTH-1\n"  # both sides open with it: a stranger on the port is told apart from a wrong key
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
VERDICT_OK, VERDICT_REFUSED = b"OK", b"NO"
MAX_FRAME_BYTES = 8 << 30  # refused before allocating: no honest message comes near it
_LENGTH = struct.Struct("<Q")  # a frame's payload length; the payload and its tag follow
_CHUNK_BYTES = 4 << 20  # a large payload is hashed and sent chunk by chunk
_SEQ = struct.Struct("<Q")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_FROM_CLIENT, _FROM_SERVER = b"client->server", b"server->client"


class AuthRefused(ConfigError):
    """A connection refused by the handshake or dropped for a frame that failed its tag. `reason` is one of
    "wrong_key", "replayed_or_forged", "not_paradit", "timeout", "closed"; `peer` is "host:port"."""

    def __init__(self, reason: str, peer: str, sentence: str):
        super().__init__(sentence)
        self.reason, self.peer = reason, peer


def new_key_file(path: str) -> None:
    """Write a fresh random key to `path` as hex, readable by its owner only; never over an existing file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"the key file {path} already exists: use it as it is, or delete it first to make a new "
                          f"key (every agent then needs a copy of the new one)") from None
    except FileNotFoundError:
        raise ConfigError(f"the folder of the key file {path} does not exist: create it first") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")


def read_key_file(path: str) -> bytes:
    """The key in `path`, checked: present, private to its owner (POSIX) and at least KEY_BYTES of hex."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ConfigError(f"there is no key file at {path}: make one on the host and copy it here "
                          f"(same bytes), or fix the --key-file path") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if os.name == "posix" and mode & 0o077:
            raise ConfigError(f"the key file {path} is open to other users (mode {mode & 0o777:o}): "
                              f"chmod 600 {path}")
        text = f.read(4097)
    try:
        key = bytes.fromhex(text.decode("ascii").strip()) if len(text) <= 4096 else b""
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) < KEY_BYTES:
        raise ConfigError(f"the key file {path} does not hold a key of at least {KEY_BYTES} bytes written as hex: "
                          f"copy the host's key file here again (same bytes)")
    return key


def accept_handshake(sock: socket.socket, key: bytes, *, timeout_s: float = 10.0) -> "SecureConnection":
    """The host's side: prove the peer holds `key` before reading anything else from it. On AuthRefused the socket
    stays open and is the caller's to close (the bytes the peer sent after its handshake fields are unread)."""
    hs = _Handshake(sock, key, timeout_s, server=True)
    peer = hs.peer
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    hs.send(MAGIC + server_nonce)
    hs.expect_magic()
    client_nonce, client_proof = hs.recv(NONCE_BYTES), hs.recv(MAC_BYTES)
    if not hmac.compare_digest(client_proof, _mac(key, b"client", server_nonce, client_nonce)):
        try:  # tell the agent why, so its user reads "refused" rather than "closed"
            hs.send(VERDICT_REFUSED)
        except AuthRefused:
            pass
        raise AuthRefused("wrong_key", peer, f"refused a connection from {peer}: it does not hold this host's key "
                          f"(wrong --key-file? copy this host's key file there), or it replayed an old handshake")
    hs.send(VERDICT_OK + _mac(key, b"server", client_nonce, server_nonce))
    return SecureConnection(sock, peer, _mac(key, b"session", server_nonce, client_nonce), server=True)


def connect_handshake(sock: socket.socket, key: bytes, *, timeout_s: float = 10.0) -> "SecureConnection":
    """The agent's side: prove `key` to the host and have the host prove it back."""
    hs = _Handshake(sock, key, timeout_s, server=False)
    peer = hs.peer
    hs.expect_magic()
    server_nonce = hs.recv(NONCE_BYTES)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    hs.send(MAGIC + client_nonce + _mac(key, b"client", server_nonce, client_nonce))
    verdict = hs.recv(len(VERDICT_OK))
    if verdict == VERDICT_REFUSED:
        raise AuthRefused("wrong_key", peer, f"the host {peer} refused this agent's key: copy the host's key file "
                          f"here (same bytes) and retry")
    if verdict != VERDICT_OK or not hmac.compare_digest(hs.recv(MAC_BYTES),
                                                        _mac(key, b"server", client_nonce, server_nonce)):
        raise AuthRefused("replayed_or_forged", peer, f"the host {peer} could not prove it holds this agent's key "
                          f"(a different key file there, or a forged answer): copy the host's key file here "
                          f"(same bytes) and check the address")
    return SecureConnection(sock, peer, _mac(key, b"session", server_nonce, client_nonce), server=False)


class SecureConnection:
    """A handshaken socket with multiprocessing Connection's byte API. Frame: length (u64), payload, then its tag:
    HMAC-SHA256 of (direction, sequence number, payload) under the session key. The tag trails so that the sender
    hashes a large payload while its first chunks are on the wire; a payload is returned only once its tag checks.
    Nothing is buffered past the frame being read, so poll() and multiprocessing.connection.wait() stay truthful.
    Callers serialize sends; one thread reads."""

    def __init__(self, sock: socket.socket, peer: str, session_key: bytes, *, server: bool):
        sock.settimeout(None)  # blocking, no Python timeout: the runtime's SO_SNDTIMEO/SO_RCVTIMEO bound each call
        self._sock, self.peer, self._key = sock, peer, session_key
        self._send_label, self._recv_label = (_FROM_SERVER, _FROM_CLIENT) if server else (_FROM_CLIENT, _FROM_SERVER)
        self._send_seq = self._recv_seq = 0

    def send_bytes(self, data) -> None:
        payload = memoryview(data).cast("B")
        if payload.nbytes > MAX_FRAME_BYTES:
            raise ConfigError(f"a message of {payload.nbytes} bytes is over the channel's {MAX_FRAME_BYTES >> 30} GiB "
                              f"frame limit: send it in parts")
        mac = self._frame_mac(self._send_label, self._send_seq)
        self._send_seq += 1
        if payload.nbytes <= _CHUNK_BYTES // 64:  # one write: a small message never waits on Nagle behind its length
            mac.update(payload)
            self._sock.sendall(_LENGTH.pack(payload.nbytes) + payload + mac.digest())
            return
        self._sock.sendall(_LENGTH.pack(payload.nbytes))
        for start in range(0, payload.nbytes, _CHUNK_BYTES):
            chunk = payload[start:start + _CHUNK_BYTES]
            mac.update(chunk)
            self._sock.sendall(chunk)
        self._sock.sendall(mac.digest())

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """The next frame's payload. `maxlength` (as multiprocessing's Connection): a frame announcing more is
        refused before anything is allocated and the connection closed, so a peer that holds the key still cannot
        make a reader that expects small messages allocate gigabytes."""
        (n,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if n > MAX_FRAME_BYTES:
            self._drop(f"it announced a frame of {n} bytes")
        if maxlength is not None and n > maxlength:
            self.close()
            raise OSError(f"it announced a message of {n} bytes where at most {maxlength} are expected")
        mac = self._frame_mac(self._recv_label, self._recv_seq)
        payload = self._read(n, mac)
        if not hmac.compare_digest(mac.digest(), self._read(MAC_BYTES)):
            self._drop("a frame failed its authentication tag (tampered, replayed, reordered or reflected)")
        self._recv_seq += 1
        return payload

    def poll(self, timeout: float = 0.0) -> bool:
        if hasattr(select, "poll"):  # no FD_SETSIZE limit
            poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLIN)
            return bool(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))
        return bool(select.select([self._sock], [], [], None if timeout is None else max(0.0, timeout))[0])

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self) -> None:
        """End the connection both ways, waking a thread blocked on it, without closing the descriptor (which another
        thread may still be using; a closed one's number could be reused)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never connected, already shut down, or closed

    def close(self) -> None:
        # shutdown first: on Linux close() alone leaves another thread's blocked recv or sendall waiting forever
        # (and the connection open); shutdown wakes it with end-of-stream or an error.
        self.shutdown()
        self._sock.close()

    def _frame_mac(self, label: bytes, seq: int):
        return hmac.new(self._key, label + _SEQ.pack(seq), hashlib.sha256)

    def _read(self, n: int, mac=None) -> bytes:
        # Straight into one bytes object of the frame's size (MSG_WAITALL): no zeroed buffer, no copy after; a read
        # cut short (a signal, the runtime's SO_RCVTIMEO, a platform without MSG_WAITALL) continues or raises.
        parts, got = [], 0
        while got < n:
            part = self._sock.recv(n - got, _WAITALL)
            if not part:
                raise EOFError(f"{self.peer} closed the connection" + (" mid-message" if got or mac else ""))
            if mac is not None:
                mac.update(part)
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _drop(self, what: str):
        self.close()
        raise AuthRefused("replayed_or_forged", self.peer, f"dropped the connection with {self.peer}: {what}, so "
                          f"something between the hosts alters traffic: keep the ParaDiT network private and reconnect")


class _Handshake:
    """Fixed-size reads and writes of one handshake, all under one deadline."""

    def __init__(self, sock: socket.socket, key: bytes, timeout_s: float, *, server: bool):
        if not isinstance(key, bytes) or len(key) < KEY_BYTES:
            raise ConfigError(f"the channel key must be at least {KEY_BYTES} bytes: read it with read_key_file")
        self.sock, self.peer, self.server = sock, peer_name(sock), server
        self.deadline, self.timeout_s = time.monotonic() + timeout_s, timeout_s

    def send(self, data: bytes) -> None:
        self._bounded(lambda: self.sock.sendall(data))

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self._bounded(lambda: self.sock.recv_into(view[got:]))
            if k == 0:
                self._refuse("closed")
            got += k
        return bytes(buf)

    def expect_magic(self) -> None:
        got = self.recv(len(MAGIC))
        if got != MAGIC:
            self._refuse("not_paradit", got)

    def _bounded(self, io):
        try:
            self.sock.settimeout(max(1e-3, self.deadline - time.monotonic()))
            return io()
        except TimeoutError:  # socket.timeout is this class since Python 3.10
            self._refuse("timeout")
        except OSError as e:
            self._refuse("closed", detail=e)

    def _refuse(self, reason: str, got: bytes = b"", detail: OSError | None = None):
        p, t = self.peer, f"{self.timeout_s:g} s"
        sentences = {  # (host's side, agent's side)
            "not_paradit": (f"refused a connection from {p}: it is not a ParaDiT agent (it sent {got!r}): point "
                            f"only ParaDiT agents at this port", f"{p} is not a ParaDiT host (it sent {got!r}): check "
                            f"the --join address and port"),
            "timeout": (f"dropped a connection from {p}: it did not finish the ParaDiT handshake within {t}: point "
                        f"only ParaDiT agents at this port", f"the host {p} did not finish the ParaDiT handshake "
                        f"within {t}: check the --join address and port and that ParaDiT runs there"),
            "closed": (f"a connection from {p} closed during the handshake ({detail or 'end of stream'}): if an agent "
                       f"fails to join, check its log", f"the host {p} closed the connection during the handshake "
                       f"({detail or 'end of stream'}): check the host's log for why it refused this agent"),
        }
        raise AuthRefused(reason, p, sentences[reason][0 if self.server else 1])


def _mac(key: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(key, label + b"".join(nonces), hashlib.sha256).digest()


def peer_name(sock: socket.socket) -> str:
    """'host:port' ('[host]:port' for IPv6) of the other end, or 'a local socket' for AF_UNIX."""
    try:
        address = sock.getpeername()
    except OSError:
        return "an unconnected socket"
    if isinstance(address, tuple):
        host, port = address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return "a local socket"
