"""The authenticated channel between hosts (runtime/auth.py): the handshake admits only a peer holding the key and
reads nothing past its fixed-size fields before that; every frame after it is checked for tampering, replay,
reordering and reflection; strangers and silent peers are refused within the handshake's time bound; key files
are private and well formed. Over socketpair() and loopback TCP, each peer on a thread whose join is bounded."""
from __future__ import annotations

import multiprocessing.connection
import os
import socket
import stat
import threading
import time

import pytest

from parallel_runtime.distributed.portability import TIMED_OUT, socket_timeout
from parallel_runtime.errors import ConfigError
from parallel_runtime.runtime import auth
from parallel_runtime.runtime.auth import (AuthRefused, accept_handshake, connect_handshake, new_key_file,
                                           read_key_file)

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
GREETING = len(auth.MAGIC) + auth.NONCE_BYTES  # what the host sends first
RESPONSE = len(auth.MAGIC) + auth.NONCE_BYTES + auth.MAC_BYTES  # what the agent answers
VERDICT = len(auth.VERDICT_OK) + auth.MAC_BYTES  # the host's OK and its proof
FRAME_BYTES = 8 + auth.MAC_BYTES  # length and tag around the payload
JOIN_S = 10  # a thread still running after this is a hang, which is the failure


class Background:
    """fn(*args) on a daemon thread; get() re-raises its exception and fails (instead of hanging) if it runs on."""

    def __init__(self, fn, *args, **kwargs):
        self.result = self.error = None

        def run():
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread by get()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def get(self, seconds: float = JOIN_S):
        self.thread.join(seconds)
        assert not self.thread.is_alive(), f"still running after {seconds} s"
        if self.error is not None:
            raise self.error
        return self.result


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


@pytest.fixture(params=["socketpair", "tcp"])
def pair(request):
    """(host end, agent end) of one fresh connection."""
    server, client = socket.socketpair() if request.param == "socketpair" else _tcp_pair()
    yield server, client
    server.close()
    client.close()


@pytest.fixture
def relay():
    """A maker of host-agent connections whose traffic passes through the test: each call gives (host end, host's
    relay socket, agent's relay socket, agent end); all are closed at the end."""
    made = []

    def make():
        host, host_relay = socket.socketpair()
        agent_relay, agent = socket.socketpair()
        made.append((host, host_relay, agent_relay, agent))
        return made[-1]

    yield make
    for s in (s for four in made for s in four):
        s.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return out


def relay_handshake(host_relay, agent_relay) -> bytes:
    agent_relay.sendall(recv_exactly(host_relay, GREETING))
    response = recv_exactly(agent_relay, RESPONSE)
    host_relay.sendall(response)
    agent_relay.sendall(recv_exactly(host_relay, VERDICT))
    return response


def handshaken(relayed) -> tuple[auth.SecureConnection, auth.SecureConnection]:
    """(host's, agent's) SecureConnection over the relayed connection `relayed`."""
    host, host_relay, agent_relay, agent = relayed
    server = Background(accept_handshake, host, KEY)
    client = Background(connect_handshake, agent, KEY)
    relay_handshake(host_relay, agent_relay)
    return server.get(), client.get()


def test_multinode_auth_messages_round_trip_and_poll_is_truthful(pair):
    server = Background(accept_handshake, pair[0], KEY)
    client = connect_handshake(pair[1], KEY)
    host = server.get()
    # Left blocking with no Python timeout: the runtime's SO_RCVTIMEO / SO_SNDTIMEO on the descriptor bound each call.
    assert [(s.gettimeout(), s.getblocking()) for s in pair] == [(None, True)] * 2
    big = os.urandom(20 << 20)  # past any socket buffer: the receive loop must gather it
    for message in (b"", b"hello", big):
        assert not host.poll(0.0)
        sender = Background(client.send_bytes, message)
        assert host.poll(JOIN_S)
        assert multiprocessing.connection.wait([host], timeout=JOIN_S) == [host]
        assert host.recv_bytes() == message
        sender.get()
        assert not host.poll(0.0)  # nothing buffered past the frame
    replier = Background(host.send_bytes, big[::-1])  # and the other way
    assert client.recv_bytes() == big[::-1]
    replier.get()
    assert host.peer == auth.peer_name(pair[0]) and client.peer == auth.peer_name(pair[1])
    host.close()
    with pytest.raises(EOFError):
        client.recv_bytes()


def test_multinode_auth_wrong_key_is_refused_before_reading_past_the_handshake(pair):
    host, agent = pair
    server = Background(accept_handshake, host, KEY)
    greeting = recv_exactly(agent, GREETING)
    nonce = os.urandom(auth.NONCE_BYTES)
    response = auth.MAGIC + nonce + auth._mac(OTHER_KEY, b"client", greeting[len(auth.MAGIC):], nonce)
    would_be_message = b"\x05" + b"\0" * 7 + b"T" * auth.MAC_BYTES + b"hello"
    agent.sendall(response + would_be_message)
    with pytest.raises(AuthRefused) as refused:
        server.get()
    assert refused.value.reason == "wrong_key" and "does not hold this host's key" in str(refused.value)
    assert recv_exactly(agent, len(auth.VERDICT_REFUSED)) == auth.VERDICT_REFUSED
    host.setblocking(False)  # the host read exactly the handshake's fields: all of the message is still queued
    assert host.recv(1 << 16) == would_be_message


def test_multinode_auth_wrong_key_says_refused_on_both_sides(pair):
    server = Background(accept_handshake, pair[0], KEY)
    with pytest.raises(AuthRefused) as agent_side:
        connect_handshake(pair[1], OTHER_KEY)
    with pytest.raises(AuthRefused) as host_side:
        server.get()
    assert (agent_side.value.reason, host_side.value.reason) == ("wrong_key", "wrong_key")
    assert str(agent_side.value) == (f"the host {auth.peer_name(pair[1])} refused this agent's key: copy the host's "
                                     f"key file here (same bytes) and retry")


def test_multinode_auth_a_host_without_the_key_is_refused_by_the_agent(pair):
    host, agent = pair
    client = Background(connect_handshake, agent, KEY)
    host.sendall(auth.MAGIC + os.urandom(auth.NONCE_BYTES))
    recv_exactly(host, RESPONSE)
    host.sendall(auth.VERDICT_OK + os.urandom(auth.MAC_BYTES))  # claims OK, cannot prove the key
    with pytest.raises(AuthRefused) as refused:
        client.get()
    assert refused.value.reason == "replayed_or_forged" and "could not prove" in str(refused.value)


def test_multinode_auth_replayed_handshake_is_refused(relay):
    host, host_relay, agent_relay, agent = relay()
    server = Background(accept_handshake, host, KEY)
    client = Background(connect_handshake, agent, KEY)
    recorded = relay_handshake(host_relay, agent_relay)
    server.get(), client.get()  # the recorded handshake was a good one
    fresh_host, attacker, _, _ = relay()  # a new connection to the host; the attacker plays the agent
    second = Background(accept_handshake, fresh_host, KEY)
    recv_exactly(attacker, GREETING)
    attacker.sendall(recorded)
    with pytest.raises(AuthRefused) as refused:
        second.get()
    assert refused.value.reason == "wrong_key"


def test_multinode_auth_tampered_frame_is_dropped(relay):
    relayed = relay()
    server, client = handshaken(relayed)
    client.send_bytes(b"hello")
    frame = bytearray(recv_exactly(relayed[2], FRAME_BYTES + 5))
    frame[8] ^= 1  # the payload's first byte
    relayed[1].sendall(frame)
    with pytest.raises(AuthRefused) as refused:
        server.recv_bytes()
    assert refused.value.reason == "replayed_or_forged" and server.fileno() == -1  # closed, never read again


@pytest.mark.parametrize("order", [(0, 0), (1, 0)], ids=["replayed", "reordered"])
def test_multinode_auth_replayed_and_reordered_frames_are_dropped(relay, order):
    relayed = relay()
    server, client = handshaken(relayed)
    client.send_bytes(b"first")
    client.send_bytes(b"second")
    frames = recv_exactly(relayed[2], FRAME_BYTES + 5), recv_exactly(relayed[2], FRAME_BYTES + 6)
    relayed[1].sendall(frames[order[0]] + frames[order[1]])
    if order == (0, 0):
        assert server.recv_bytes() == b"first"
    with pytest.raises(AuthRefused) as refused:
        server.recv_bytes()
    assert refused.value.reason == "replayed_or_forged"


def test_multinode_auth_reflected_frame_is_dropped(relay):
    relayed = relay()
    server, client = handshaken(relayed)
    client.send_bytes(b"hello")
    relayed[2].sendall(recv_exactly(relayed[2], FRAME_BYTES + 5))  # back to the agent, which expects seq 0 as well
    with pytest.raises(AuthRefused) as refused:
        client.recv_bytes()
    assert refused.value.reason == "replayed_or_forged"


def test_multinode_auth_absurd_frame_length_is_refused_before_allocating(relay):
    relayed = relay()
    server, client = handshaken(relayed)
    relayed[1].sendall((1 << 62).to_bytes(8, "little") + b"\0" * auth.MAC_BYTES)
    with pytest.raises(AuthRefused) as refused:
        server.recv_bytes()
    assert refused.value.reason == "replayed_or_forged" and str(1 << 62) in str(refused.value)


@pytest.mark.parametrize("cut", [4, 10, -2], ids=["in_length", "in_payload", "in_tag"])
def test_multinode_auth_peer_closing_mid_frame_is_eof_and_socket_timeouts_pass_through(relay, cut):
    relayed = relay()
    server, client = handshaken(relayed)
    client.send_bytes(b"hello")
    relayed[1].sendall(recv_exactly(relayed[2], FRAME_BYTES + 5)[:cut])
    relayed[1].shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        server.recv_bytes()
    # The runtime bounds each call with SO_RCVTIMEO on the descriptor; its error must reach the caller as it is.
    with socket.socket(fileno=client.fileno()) as view:
        view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, socket_timeout(0.2))
        view.detach()
    with pytest.raises(TIMED_OUT):
        client.recv_bytes()


def test_multinode_auth_strangers_are_refused_in_one_sentence(pair):
    host, agent = pair
    server = Background(accept_handshake, host, KEY)
    agent.sendall(b"GET / HTTP/1.1\r\nHost: paradit\r\n\r\n")
    with pytest.raises(AuthRefused) as refused:
        server.get()
    assert refused.value.reason == "not_paradit"
    assert str(refused.value).startswith(f"refused a connection from {auth.peer_name(host)}: it is not a ParaDiT agent")

    web_server, agent = socket.socketpair()
    with web_server, agent:
        web_server.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        with pytest.raises(AuthRefused) as refused:
            connect_handshake(agent, KEY)
    assert refused.value.reason == "not_paradit" and "is not a ParaDiT host" in str(refused.value)


@pytest.mark.parametrize("sent", [b"", auth.MAGIC + b"half a nonce"], ids=["nothing", "half_a_field"])
def test_multinode_auth_silent_peers_time_out_within_the_bound(pair, sent):
    host, agent = pair
    host.sendall(sent)
    started = time.monotonic()
    with pytest.raises(AuthRefused) as refused:
        connect_handshake(agent, KEY, timeout_s=0.3)
    # 0.5 s of slack: thread scheduling on a loaded 2-core machine; the bound is what is tested, not speed.
    assert refused.value.reason == "timeout" and time.monotonic() - started < 0.8
    assert "did not finish the ParaDiT handshake within 0.3 s" in str(refused.value)


def test_multinode_auth_trickling_peer_cannot_stretch_the_bound(pair):
    host, agent = pair
    refused_already = threading.Event()

    def trickle():  # one byte per 0.1 s: each read would meet a per-read timeout, only the whole-handshake one ends it
        for byte in auth.MAGIC:
            agent.sendall(bytes([byte]))
            if refused_already.wait(0.1):
                return

    sender = Background(trickle)
    started = time.monotonic()
    with pytest.raises(AuthRefused) as refused:
        accept_handshake(host, KEY, timeout_s=0.4)
    assert refused.value.reason == "timeout" and time.monotonic() - started < 0.9  # 0.5 s slack: as above
    refused_already.set()
    sender.get()


def test_multinode_auth_peer_that_hangs_up_is_closed_not_timeout(pair):
    host, agent = pair
    agent.close()
    with pytest.raises(AuthRefused) as refused:
        accept_handshake(host, KEY, timeout_s=5)
    assert refused.value.reason == "closed"


def test_multinode_auth_key_file_round_trip_and_mode(tmp_path):
    path = str(tmp_path / "paradit.key")
    new_key_file(path)
    key = read_key_file(path)
    assert len(key) == auth.KEY_BYTES and key != read_key_file(_new(tmp_path / "second.key"))
    if os.name == "posix":
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(ConfigError, match="already exists"):
        new_key_file(path)
    assert read_key_file(path) == key  # not overwritten


def _new(path) -> str:
    new_key_file(str(path))
    return str(path)


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_multinode_auth_key_file_readable_by_others_is_refused(tmp_path, mode):
    path = _new(tmp_path / "paradit.key")
    os.chmod(path, mode)
    with pytest.raises(ConfigError) as refused:
        read_key_file(path)
    assert str(refused.value) == f"the key file {path} is open to other users (mode {mode:o}): chmod 600 {path}"


@pytest.mark.parametrize("text", ["ab" * 31, "zz" * 32, "", "ab" * 3000], ids=["short", "not_hex", "empty", "huge"])
def test_multinode_auth_key_file_that_is_not_a_key_is_refused(tmp_path, text):
    path = tmp_path / "paradit.key"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="does not hold a key of at least 32 bytes"):
        read_key_file(str(path))
    with pytest.raises(ConfigError, match="there is no key file"):
        read_key_file(str(tmp_path / "missing.key"))
