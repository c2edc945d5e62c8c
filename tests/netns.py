"""Test hosts for the multi-machine tests: network namespaces joined into one Ethernet segment.

`TestNetwork(hosts=3)` makes a star: one namespace per test host, each holding one end of a veth pair named
`interface` with an address in a random 10.x.y.0/24, and a switch namespace holding the other ends plugged into a
bridge. Nothing is added to the root namespace: every link is created inside the switch namespace and its host end
moved straight into the host's namespace, so the test hosts reach each other and their own loopback, and nothing
else (no route out, no address the machine's own network can see). Host i is named `host<i>` (its processes'
hostname, from a UTS namespace of their own) and every host resolves every host's name to its address (a hosts
file that `ip netns exec` mounts from /etc/netns/<namespace>/).

Processes run inside a host through `ip netns exec` (`popen`, `run`); faults are made at the switch (`link_down`
unplugs a host's cable: no FIN, its peers' reads just stop) or on the host's processes (`signal_all`); `slow` puts a
token bucket (tc `tbf`; this kernel has no `netem`) on both directions of a host's link. `close` (also run at exit
and when the object is collected) kills whatever is left in the namespaces, records it in `leftovers`, and deletes
them. A namespace's name carries the pid of the process that made it, so a later run deletes the namespaces of a run
that was killed before it could clean up.
"""
from __future__ import annotations

import functools
import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref

PREFIX = "pdn"  # every namespace made here is named pdn-<creator pid>-<instance>-<role>
INTERFACE = "pdn0"  # a host's end of its link, the same name in every host namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"  # inside the switch namespace only
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")  # the pid of the process that made it
_instances = itertools.count()
ETC_NETNS = "/etc/netns"  # `ip netns exec NAME` bind-mounts the files of ETC_NETNS/NAME over /etc's (here: hosts)
IP_TIMEOUT_S = 20.0  # one `ip`/`tc` call; a kernel that takes longer is stuck, and the test should say so
KILL_WAIT_S = 10.0  # SIGKILLed processes leave their namespace within this (they are not allowed to handle it)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _tc(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` in {namespace} failed: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Every process whose network namespace is `namespace`."""
    done = _ip("netns", "pids", namespace, check=False)
    return sorted(int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_and_delete(namespaces: list[str]) -> dict[str, list[int]]:
    """SIGKILL every process in `namespaces`, wait until they are gone, delete the namespaces (a host namespace's
    veth end goes with it, and takes its bridge-side peer along). Returns the processes that were still there."""
    present = set(_namespaces())
    namespaces = [n for n in namespaces if n in present]
    found = {n: namespace_pids(n) for n in namespaces}
    for pids in found.values():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + KILL_WAIT_S
    while any(namespace_pids(n) for n in namespaces) and time.monotonic() < deadline:
        time.sleep(0.05)
    for n in namespaces:
        _ip("netns", "del", n, check=False)
    return {n: pids for n, pids in found.items() if pids}


def _remove_etc(namespaces: list[str]) -> None:
    for n in namespaces:
        shutil.rmtree(os.path.join(ETC_NETNS, n), ignore_errors=True)


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of earlier runs whose creating process is dead (a run killed before its cleanup)."""
    etc = os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []
    stale = sorted({n for n in [*_namespaces(), *etc] if (m := _NAME.match(n)) and not _alive(int(m.group(1)))})
    _kill_and_delete(stale)
    _remove_etc(stale)
    return stale


@functools.cache
def netns_unavailable() -> str | None:
    """Why test hosts cannot be made here (one line, for pytest.skip), or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the multinode tests as root, or in a container with CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` on PATH"
    if shutil.which("unshare") is None:
        return "test hosts need util-linux's `unshare` on PATH (each host gets its own hostname)"
    probe = f"{PREFIX}-{os.getpid()}-probe-sw"
    try:
        remove_stale_namespaces()
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", probe, "link", "add", "name", "probe-a", "type", "veth", "peer", "name", "probe-b")
        _ip("-n", probe, "link", "set", "probe-a", "master", BRIDGE)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make test hosts: {str(e).splitlines()[0]}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@functools.cache
def tbf_unavailable() -> str | None:
    """Why `slow` cannot work here (no `tc`, or no tbf qdisc), or None."""
    if (reason := netns_unavailable()) is not None:
        return reason
    if shutil.which("tc") is None:
        return "slowing a link needs iproute2's `tc` on PATH"
    probe = f"{PREFIX}-{os.getpid()}-probe-tc"
    try:
        _ip("netns", "add", probe)
        _tc(probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot slow a link with tc tbf: {str(e).splitlines()[0]}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class _State:
    """What close() needs, apart from the TestNetwork so that a finalizer can hold it without keeping it alive."""

    def __init__(self, namespaces: list[str]):
        self.namespaces = namespaces
        self.children: list[subprocess.Popen] = []
        self.closed = False
        self.leftovers: dict[str, list[int]] = {}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.leftovers = _kill_and_delete(self.namespaces)
        _remove_etc(self.namespaces)
        for child in self.children:  # reap them, so no zombie outlives the network
            try:
                child.kill()
                child.wait(timeout=KILL_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass


# The scanner `scan` runs inside a host: SLOTS non-blocking connects in flight. A port is open when its connect
# completes, closed when refused (RST). Each port gets a fresh socket: a socket reused after a refused connect was
# seen to report a later open port as refused (a full scan missed a listener a one-port scan found).
_SCANNER = r"""
import errno, select, socket, struct, sys, time
target, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
runs = [tuple(map(int, run.split("-"))) for run in sys.stdin.read().split()]  # "first-last" runs of ports
family = socket.AF_INET6 if ":" in target else socket.AF_INET
SLOTS = 512
ports = (port for first, last in runs for port in range(first, last + 1))
opened, in_flight, poller = [], {}, select.epoll()

def fresh():
    s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    poller.register(s.fileno(), select.EPOLLOUT)
    return s

def finish(s, port):  # a connect that completed: a listener, unless it met itself (own address and port)
    if s.getsockname() != s.getpeername():
        opened.append(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
    poller.unregister(s.fileno())
    s.close()
    return fresh()

def drop(s):
    poller.unregister(s.fileno())
    s.close()
    return fresh()

def next_port(s):
    for port in ports:
        err = s.connect_ex((target, port))
        if err == errno.EINPROGRESS:
            in_flight[s.fileno()] = (s, port)
            return
        s = finish(s, port) if err == 0 else drop(s)
    poller.unregister(s.fileno())
    s.close()

for _ in range(SLOTS):
    next_port(fresh())
while in_flight and time.monotonic() < deadline:
    for fd, _ in poller.poll(0.2):
        s, port = in_flight.pop(fd)
        next_port(finish(s, port) if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 else drop(s))
if in_flight:
    sys.exit(f"ports {sorted(p for _, p in in_flight.values())[:5]}... neither accepted nor refused in time "
             "(is the host's link down?)")
print(" ".join(map(str, sorted(opened))))
"""


class TestNetwork:
    """`hosts` test hosts on one bridged segment, each in its own network namespace. Use as a context manager."""

    __test__ = False  # a harness, not a test class, for pytest's collector

    def __init__(self, hosts: int = 2, subnet: str | None = None):
        if (reason := netns_unavailable()) is not None:
            raise RuntimeError(reason)
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts={hosts}: make between 1 and 200 test hosts")
        network = ipaddress.ip_network(subnet or f"10.{random.randint(1, 254)}.{random.randint(0, 255)}.0/24")
        if network.num_addresses < hosts + 2:
            raise ValueError(f"subnet {network} has too few addresses for {hosts} hosts; pass a larger one")
        remove_stale_namespaces()
        base = f"{PREFIX}-{os.getpid()}-{next(_instances)}"
        self.switch = f"{base}-sw"
        self.names = [f"{base}-h{i}" for i in range(hosts)]
        self.interface = INTERFACE
        self.network = network
        self._addresses = [str(network.network_address + 1 + i) for i in range(hosts)]
        self.hostnames = [f"host{i}" for i in range(hosts)]
        self._state = _State([*self.names, self.switch])
        self._finalizer = weakref.finalize(self, self._state.close)  # also runs at interpreter exit
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            # Made inside the switch, the host end moved straight to its namespace: nothing passes the root one.
            _ip("-n", sw, "link", "add", "name", self._port(i), "type", "veth", "peer", "name", self.interface,
                "netns", name)
            _ip("-n", sw, "link", "set", self._port(i), "master", BRIDGE)
            _ip("-n", sw, "link", "set", self._port(i), "up")
            _ip("-n", name, "addr", "add", f"{self._addresses[i]}/{self.network.prefixlen}", "dev", self.interface)
            _ip("-n", name, "link", "set", self.interface, "up")
            # Every host knows the others by name, as on a LAN with working DNS (and resolves its own name to its
            # segment address, which is what torch.distributed's launcher advertises).
            os.makedirs(os.path.join(ETC_NETNS, name), exist_ok=True)
            with open(os.path.join(ETC_NETNS, name, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n::1 localhost\n")
                f.writelines(f"{a} {h}\n" for a, h in zip(self._addresses, self.hostnames))

    @staticmethod
    def _port(i: int) -> str:
        return f"port{i}"  # the bridge-side end of host i's link, inside the switch namespace

    def __enter__(self) -> "TestNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def address(self, i: int) -> str:
        return self._addresses[i]

    # -- processes --------------------------------------------------------------------------------------------

    def hostname(self, i: int) -> str:
        """Host i's name: what its processes' gethostname() returns, and what every host resolves to its address."""
        return self.hostnames[i]

    def _inside(self, i: int, argv: list[str]) -> list[str]:
        # ip netns exec, unshare and sh each exec the next, so the process started is argv's, under the same pid;
        # its own UTS namespace gives it host i's hostname.
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[i], *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` inside host i; the Popen is the process itself (its pid is in `pids(i)`)."""
        if self._state.closed:
            raise RuntimeError("this TestNetwork is closed; start processes inside the `with` block")
        child = subprocess.Popen(self._inside(i, argv), **kw)
        self._state.children.append(child)
        return child

    def run(self, i: int, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """Run `argv` inside host i to completion (killed after `timeout` seconds: subprocess.TimeoutExpired)."""
        return subprocess.run(self._inside(i, argv), timeout=timeout, **kw)

    def pids(self, i: int) -> list[int]:
        return namespace_pids(self.names[i])

    def signal_all(self, i: int, sig: int) -> None:
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # -- the links --------------------------------------------------------------------------------------------

    def slow(self, i: int, rate: str = "20mbit") -> None:
        """Cap host i's link at `rate` in both directions: a token bucket on the host's egress and on the bridge
        port's egress (which is the host's ingress)."""
        if (reason := tbf_unavailable()) is not None:
            raise RuntimeError(reason)
        bits = _rate_bits(rate)
        # burst: ~10 ms of tokens, at least 64 KiB, so one GSO segment (up to 64 KiB on a veth) always fits and a
        # TCP stream reaches the rate; latency: queue up to 100 ms before dropping, so losses don't stall TCP.
        burst = max(64 * 1024, bits // 8 // 100)
        for namespace, dev in ((self.names[i], self.interface), (self.switch, self._port(i))):
            _tc(namespace, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "100ms")

    def unslow(self, i: int) -> None:
        """Take `slow`'s token buckets off host i's link."""
        for namespace, dev in ((self.names[i], self.interface), (self.switch, self._port(i))):
            _tc(namespace, "qdisc", "del", "dev", dev, "root", check=False)

    def link_down(self, i: int) -> None:
        """Unplug host i at the switch: packets to and from it are dropped, nobody gets a FIN or RST, and its own
        interface keeps its address (it only loses carrier), as when a cable or a switch port dies."""
        _ip("-n", self.switch, "link", "set", self._port(i), "down")

    def link_up(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self._port(i), "up")

    # -- what a host exposes ----------------------------------------------------------------------------------

    def listening(self, i: int) -> list[tuple[str, int]]:
        """Host i's listening TCP sockets as (address, port), read from its /proc/net/tcp and tcp6."""
        done = self.run(i, ["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout=IP_TIMEOUT_S, capture_output=True,
                        text=True, check=True)
        return sorted(set(_parse_listening(done.stdout)))

    def scan(self, from_i: int, to_i: int, ports=range(1, 65536), timeout_s: float = 60) -> list[int]:
        """TCP connect scan of host to_i's address from inside host from_i: the ports that accepted a connection.
        Each open port sees one connection that is reset at once (SO_LINGER 0), as from any port scanner."""
        ports = sorted(set(ports))
        if not ports:
            return []
        runs = [[ports[0], ports[0]]]
        for port in ports[1:]:
            if port == runs[-1][1] + 1:
                runs[-1][1] = port
            else:
                runs.append([port, port])
        done = self.run(from_i, [sys.executable, "-c", _SCANNER, self.address(to_i), str(timeout_s)],
                        input=" ".join(f"{a}-{b}" for a, b in runs), timeout=timeout_s + 10, capture_output=True,
                        text=True)
        if done.returncode != 0:
            raise RuntimeError(f"scan of {self.address(to_i)} from host {from_i} failed "
                               f"(exit {done.returncode}): {done.stderr.strip()[-300:]}")
        return [int(p) for p in done.stdout.split()]

    # -- teardown ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process left in the namespaces, delete them and their links. Idempotent."""
        self._finalizer()

    @property
    def leftovers(self) -> dict[str, list[int]]:
        """After close(): namespace -> pids still running in it when close() started (empty after a clean shutdown)."""
        return self._state.leftovers


def _rate_bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. '20mbit' or '500kbit'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    return int(float(m.group(1)) * scale)


def _parse_listening(text: str) -> list[tuple[str, int]]:
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:  # 0A: TCP_LISTEN
            continue
        hex_address, hex_port = fields[1].split(":")
        raw = bytes.fromhex(hex_address)
        if sys.byteorder == "little":  # the kernel prints the address as 32-bit words in host byte order
            raw = b"".join(raw[k:k + 4][::-1] for k in range(0, len(raw), 4))
        out.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return out
