"""An emulated network link for the remote benchmarks: a network namespace joined to the host
by a veth pair, shaped by `tc`, so that a store run inside the namespace is reached from the
host as another machine on a 1 or 10 Gbit/s link would be.

The rate is shaped on both ends (requests out, objects back) and the delay on the
namespace's end, so the round trip gains it once: `netem rate R delay D` where the kernel has
sch_netem, else `tbf rate R` without the delay (said in `Link.shaping`, and so in the
benchmark's output). Making a namespace needs root (CAP_NET_ADMIN) on Linux;
`link_unavailable()` says why it cannot be made, and the benchmarks fall back to loopback.

Names carry the pid (kvdb<pid>); the link is removed on exit, on SIGTERM, and, after a
crash that left one behind (SIGKILL), by the next run, which removes every kvdb<pid> whose
process is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType

NAME_PREFIX = "kvdb"
TBF_LATENCY = "10ms"  # the queue tbf keeps before dropping: a switch's buffer, not a bloat
NO_DELAY = "the kernel has no sch_netem: rate by tbf, no added delay"


@dataclass(frozen=True)
class LinkSpec:
    """A link to emulate: its rate in bits per second and the delay added to a round trip."""

    label: str
    rate_bits: int
    delay_ms: float

    def describe(self) -> str:
        return f"{self.rate_bits / 1e9:g} Gbit/s, {self.delay_ms:g} ms"


GBIT_1 = LinkSpec("1 Gbit/s", 1_000_000_000, 0.2)
GBIT_10 = LinkSpec("10 Gbit/s", 10_000_000_000, 0.2)


@dataclass(frozen=True)
class Link:
    """Where the store listens and how its traffic is shaped. namespace None: loopback."""

    label: str
    peer_address: str
    namespace: str | None
    shaping: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv run on the far end of the link (inside the namespace)."""
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]


LOOPBACK = Link("loopback", "127.0.0.1", None, "loopback")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    listed = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _remove(namespace: str) -> None:
    """Ends whatever still runs in the namespace, then the namespace (its veth end goes with
    it, and so the pair)."""
    pids = _run("ip", "netns", "pids", namespace, check=False)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "del", namespace, check=False)
    _run("ip", "link", "del", namespace + "h", check=False)


def remove_stale() -> list[str]:
    """Removes the links of runs that ended without removing theirs; returns their names."""
    stale = []
    for namespace in _namespaces():
        digits = namespace.removeprefix(NAME_PREFIX)
        if namespace.startswith(NAME_PREFIX) and digits.isdigit() and not _pid_alive(int(digits)):
            _remove(namespace)
            stale.append(namespace)
    return stale


def link_unavailable() -> str | None:
    """Why no emulated link can be made here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return f"no network namespaces on {sys.platform}"
    probe = f"{NAME_PREFIX}{os.getpid()}"  # removed at once; a crash leaves it stale
    try:
        made = _run("ip", "netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if made.returncode != 0:
        return f"cannot make a network namespace (needs CAP_NET_ADMIN): {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _addresses(pid: int) -> tuple[str, str]:
    """A /30 of 10.213.0.0/16 per pid, so that concurrent runs never share one."""
    base = (pid % 16384) * 4
    net = f"10.213.{base // 256}"
    return f"{net}.{base % 256 + 1}", f"{net}.{base % 256 + 2}"


def _shape(device: str, namespace: str | None, spec: LinkSpec, delay: bool) -> str:
    """Shapes device's egress; returns what was applied."""
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    rate = str(spec.rate_bits)
    netem = ["netem", "rate", f"{rate}bit", "limit", "10000"]
    if delay:
        netem += ["delay", f"{spec.delay_ms}ms"]
    tc = [*prefix, "tc", "qdisc", "add", "dev", device, "root"]
    applied = _run(*tc, *netem, check=False)
    if applied.returncode == 0:
        return "netem"
    burst = max(spec.rate_bits // 8 // 250, 65536)  # a tick's worth at HZ=250
    _run(*tc, "tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", TBF_LATENCY)
    return "tbf"


def raise_exit(signum: int, frame: FrameType | None) -> None:
    """A signal handler that ends the process as an exception does, running every finally."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def emulated_link(spec: LinkSpec) -> Iterator[Link]:
    """A namespace reached from the host through spec's link; removed when the block ends,
    however it ends (SIGTERM included)."""
    remove_stale()
    pid = os.getpid()
    namespace = f"{NAME_PREFIX}{pid}"
    host_device, peer_device = namespace + "h", namespace + "n"
    host_address, peer_address = _addresses(pid)
    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        _run("ip", "netns", "add", namespace)
        _run("ip", "link", "add", host_device, "type", "veth", "peer", "name", peer_device)
        _run("ip", "link", "set", peer_device, "netns", namespace)
        _run("ip", "addr", "add", f"{host_address}/30", "dev", host_device)
        _run("ip", "link", "set", host_device, "up")
        inside = ("ip", "-n", namespace)
        _run(*inside, "addr", "add", f"{peer_address}/30", "dev", peer_device)
        _run(*inside, "link", "set", peer_device, "up")
        _run(*inside, "link", "set", "lo", "up")
        kinds = {_shape(host_device, None, spec, False), _shape(peer_device, namespace, spec, True)}
        shaping = (
            f"netem {spec.describe()}"
            if kinds == {"netem"}
            else f"tbf {spec.rate_bits / 1e9:g} Gbit/s ({NO_DELAY})"
        )
        yield Link(spec.label, peer_address, namespace, shaping)
    finally:
        _remove(namespace)
        signal.signal(signal.SIGTERM, previous)


_SENDER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[2])):
    connection.sendall(chunk)
connection.close()
"""


def measure_rate(link: Link, mebibytes: int) -> float:
    """Gbit/s of one TCP stream from the far end to the host: what the link really allows."""
    sender = subprocess.Popen(
        link.command([sys.executable, "-c", _SENDER, link.peer_address, str(mebibytes)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout is not None
        port = int(sender.stdout.readline())
        buffer = bytearray(1 << 20)
        received = 0
        with socket.create_connection((link.peer_address, port)) as connection:
            start = time.perf_counter()
            while n := connection.recv_into(buffer):
                received += n
            elapsed = time.perf_counter() - start
        if received != mebibytes << 20:
            raise OSError(f"received {received} of {mebibytes << 20} bytes through {link.label}")
        return received * 8 / elapsed / 1e9
    finally:
        sender.kill()
        sender.wait()
