"""The test hosts the multi-machine tests run on (tests/netns.py): namespaces that reach each other and nothing
else, a scan that sees exactly what a host exposes, a link that can be slowed or unplugged, processes that can be
frozen, and a close() that leaves nothing behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.netns import ETC_NETNS, PREFIX, TestNetwork, netns_unavailable, tbf_unavailable

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")

PORT = 7000  # every host has its own port space, so a fixed port never clashes with another test
PY = sys.executable
WAIT_S = 10.0  # a helper process that has not started listening by then is broken, not slow

# An echo server on argv[1]:argv[2], one thread per connection.
ECHO = r"""
import socket, sys, threading
def echo(c):
    while (data := c.recv(65536)):
        c.sendall(data)
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()
"""

# A client of argv[1]:argv[2] driven by stdin lines: "send TEXT" sends it, "recv SECONDS" prints what came back
# within that time ("got TEXT"), "timeout", or "eof" (the peer closed or reset it).
CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("connected", flush=True)
for line in sys.stdin:
    verb, arg = line.split(" ", 1)
    if verb == "send":
        c.sendall(arg.strip().encode())
        continue
    c.settimeout(float(arg))
    try:
        data = c.recv(65536)
        print(f"got {data.decode()}" if data else "eof", flush=True)
    except socket.timeout:
        print("timeout", flush=True)
    except OSError:
        print("eof", flush=True)
"""

# Receives one stream on argv[1]:argv[2] and prints its length and the seconds from accept to its end.
SINK = r"""
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = s.accept()
start, n = time.monotonic(), 0
while (data := c.recv(1 << 16)):
    n += len(data)
print(n, time.monotonic() - start, flush=True)
"""

# Sends argv[3] bytes to argv[1]:argv[2].
SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(b"x" * int(sys.argv[3]))
c.close()
"""


def wait_listening(net: TestNetwork, i: int, port: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not any(p == port for _, p in net.listening(i)):
        assert time.monotonic() < deadline, f"nothing listens on port {port} in host {i} after {WAIT_S} s"
        time.sleep(0.05)


def start_echo(net: TestNetwork, i: int, address: str) -> subprocess.Popen:
    server = net.popen(i, [PY, "-c", ECHO, address, str(PORT)])
    wait_listening(net, i, PORT)
    return server


class Client:
    """CLIENT running inside a host, one command at a time."""

    def __init__(self, net: TestNetwork, i: int, address: str):
        self.process = net.popen(i, [PY, "-c", CLIENT, address, str(PORT)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.process.stdout.readline().strip() == "connected"

    def send(self, text: str) -> None:
        self.process.stdin.write(f"send {text}\n")

    def recv(self, seconds: float) -> str:
        self.process.stdin.write(f"recv {seconds}\n")
        return self.process.stdout.readline().strip()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=WAIT_S)


def transfer_s(net: TestNetwork, sender: int, receiver: int, size: int) -> float:
    """Seconds for `size` bytes to stream from host `sender` to host `receiver`, timed by the receiver."""
    sink = net.popen(receiver, [PY, "-c", SINK, net.address(receiver), str(PORT)], stdout=subprocess.PIPE, text=True)
    wait_listening(net, receiver, PORT)
    net.run(sender, [PY, "-c", SOURCE, net.address(receiver), str(PORT), str(size)], timeout=30, check=True)
    out, _ = sink.communicate(timeout=30)
    received, seconds = out.split()
    assert int(received) == size
    return float(seconds)


def test_multinode_hosts_reach_each_other_and_only_their_own_segment():
    with TestNetwork(hosts=3) as net:
        assert len(net.names) == 3 and len(set(net.names)) == 3
        assert len({net.address(i) for i in range(3)}) == 3
        start_echo(net, 0, net.address(0))
        for i in (1, 2):
            client = Client(net, i, net.address(0))
            client.send(f"hello from {i}")
            assert client.recv(5) == f"got hello from {i}"
            client.close()
        # The host's only links are loopback and its segment interface, which carries the address the test gave.
        links = net.run(1, ["ip", "-o", "-4", "addr", "show"], timeout=10, capture_output=True, text=True).stdout
        assert sorted(line.split()[1] for line in links.splitlines()) == ["lo", net.interface]
        assert f"inet {net.address(1)}/24" in links
        routes = net.run(1, ["ip", "-4", "route"], timeout=10, capture_output=True, text=True).stdout
        assert "default" not in routes, routes  # no way out of the segment
        # Each host has its own name, and knows the others' (as the launcher's rendezvous needs).
        names = ("import socket\n"
                 "print(socket.gethostname(), *(socket.gethostbyname(f'host{k}') for k in range(3)))")
        for i in range(3):
            seen = net.run(i, [PY, "-c", names], timeout=10, capture_output=True, text=True, check=True).stdout
            assert seen.split() == [net.hostname(i), *(net.address(k) for k in range(3))]


def test_multinode_scan_and_listening_see_exactly_the_segment_listener():
    with TestNetwork(hosts=2) as net:
        listener = ("import socket, time\n"
                    f"a = socket.create_server(({net.address(0)!r}, {PORT}))\n"
                    f"b = socket.create_server(('127.0.0.1', {PORT + 1}))\n"
                    "time.sleep(120)\n")
        net.popen(0, [PY, "-c", listener])
        wait_listening(net, 0, PORT + 1)
        assert (net.address(0), PORT) in net.listening(0)
        assert ("127.0.0.1", PORT + 1) in net.listening(0)
        assert net.listening(1) == []
        start = time.monotonic()
        # The whole port range: the loopback-only listener must not show, nor anything else.
        assert net.scan(1, 0) == [PORT]
        print(f"full scan: {time.monotonic() - start:.2f} s")
        assert net.scan(1, 0, ports=[PORT + 1, PORT, 22]) == [PORT]
        assert net.scan(0, 1) == []


@pytest.mark.skipif(tbf_unavailable() is not None, reason=tbf_unavailable() or "")
def test_multinode_slow_caps_both_directions_of_a_link():
    size = 2_000_000  # 2 MB: 2.0 s at 8 Mbit/s
    with TestNetwork(hosts=2) as net:
        fast = transfer_s(net, 0, 1, size)
        net.slow(1, "8mbit")
        slowed_in = transfer_s(net, 0, 1, size)  # into host 1: the bridge port's egress bucket
        slowed_out = transfer_s(net, 1, 0, size)  # out of host 1: its interface's egress bucket
        net.unslow(1)
        restored = transfer_s(net, 0, 1, size)
        print(f"2 MB: {fast:.3f} s unshaped, {slowed_in:.3f} s in / {slowed_out:.3f} s out at 8mbit, "
              f"{restored:.3f} s after unslow")
    # 2 MB at 8 Mbit/s is 2.0 s; the 64 KiB burst and TCP ramp-up shave or add a little, so 1.5 s is the floor, and
    # 6 s the ceiling of a TCP stream that does reach the rate (a stalling bucket would take far longer).
    for slowed in (slowed_in, slowed_out):
        assert 1.5 <= slowed <= 6.0, (fast, slowed_in, slowed_out)
    # A veth moves 2 MB in milliseconds; 0.5 s leaves room for a loaded 2-core machine, and is still 4x under 8mbit.
    assert fast < 0.5 and restored < 0.5, (fast, restored)
    assert min(slowed_in, slowed_out) / fast >= 3, (fast, slowed_in, slowed_out)


def test_multinode_link_down_silences_a_peer_without_fin_and_link_up_resumes():
    with TestNetwork(hosts=2) as net:
        start_echo(net, 0, net.address(0))
        client = Client(net, 1, net.address(0))
        client.send("before")
        assert client.recv(5) == "got before"
        net.link_down(1)
        client.send("during")
        # No FIN, no RST: the connection stays open and the read just times out (1 s: an echo takes milliseconds).
        assert client.recv(1) == "timeout"
        assert client.recv(1) == "timeout"
        net.link_up(1)
        # TCP retransmits "during" on its backoff (first retries at 0.2, 0.6, 1.4, 3.0 s after the send): within 10 s.
        assert client.recv(10) == "got during"
        client.close()


def test_multinode_sigstop_freezes_a_host_and_sigcont_resumes_it():
    with TestNetwork(hosts=2) as net:
        server = start_echo(net, 0, net.address(0))
        client = Client(net, 1, net.address(0))
        net.signal_all(0, signal.SIGSTOP)
        assert net.pids(0) == [server.pid]
        with open(f"/proc/{server.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "T"  # stopped
        client.send("frozen")
        assert client.recv(1) == "timeout"  # the kernel queues it, the stopped server never echoes
        net.signal_all(0, signal.SIGCONT)
        assert client.recv(5) == "got frozen"
        client.close()


def test_multinode_close_kills_what_is_left_and_deletes_every_namespace():
    # A namespace left by a run that was killed before its cleanup: named after a pid that is now dead.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}-{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    os.makedirs(os.path.join(ETC_NETNS, stale), exist_ok=True)

    net = TestNetwork(hosts=2)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert stale not in namespaces  # the new network removed it
    assert not os.path.exists(os.path.join(ETC_NETNS, stale))
    assert all(os.path.exists(os.path.join(ETC_NETNS, n, "hosts")) for n in net.names)
    sleepers = [net.popen(i, ["sleep", "300"]) for i in range(2)]
    # One that left its parent: close() must find it by namespace, not by Popen.
    orphan = net.run(1, ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], timeout=10, capture_output=True,
                     text=True, check=True)
    orphan_pid = int(orphan.stdout)
    assert orphan_pid in net.pids(1)
    net.close()
    net.close()  # idempotent
    assert net.leftovers == {net.names[0]: [sleepers[0].pid],
                             net.names[1]: sorted([sleepers[1].pid, orphan_pid])}
    assert all(s.poll() == -signal.SIGKILL for s in sleepers)
    assert not os.path.exists(f"/proc/{orphan_pid}") or open(f"/proc/{orphan_pid}/stat").read().split()[2] == "Z"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in [*net.names, net.switch] if n in namespaces]
    assert not [n for n in net.names if os.path.exists(os.path.join(ETC_NETNS, n))]

    with TestNetwork(hosts=2) as clean:
        client_done = clean.run(0, ["true"], timeout=10)
        assert client_done.returncode == 0
    assert clean.leftovers == {}
