"""systemd's service protocols in pure Python: readiness notification and socket activation.

Notification (sd_notify(3)): one datagram of newline-separated VAR=value lines to the
AF_UNIX socket named by $NOTIFY_SOCKET, a path or, with a leading '@', an abstract name.
Without the variable (not under systemd) every call does nothing.

Activation (sd_listen_fds(3)): systemd passes the listening sockets as descriptors 3, 4, ...
with LISTEN_FDS (how many), LISTEN_PID (for which process) and LISTEN_FDNAMES (their names,
':'-separated). They are read once: the variables are removed so children do not take the
sockets for theirs, and the descriptors are made close-on-exec.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START


def _own_pid(environ: Mapping[str, str], name: str) -> bool | None:
    """Whether $name is this process's pid; None when it is unset or empty."""
    value = environ.get(name, "")
    if not value:
        return None
    try:
        return int(value) == os.getpid()
    except ValueError:
        raise ValueError(f"${name} is not a pid: {value!r}") from None


class Notifier:
    """Sends notifications to the service manager, if there is one."""

    def __init__(self, address: str | None) -> None:
        """`address` is $NOTIFY_SOCKET's value: a path, '@name' (abstract), or None."""
        self.address: str | None
        if address is None or address.startswith("/"):
            self.address = address
        elif address.startswith("@"):
            self.address = "\0" + address[1:]  # the abstract namespace
        else:
            raise ValueError(f"unsupported $NOTIFY_SOCKET: {address!r}")
        self._sock: socket.socket | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send `VAR=value` assignments as one datagram; False when there is no manager."""
        for line in assignments:
            if "=" not in line or "\n" in line:
                raise ValueError(f"not a single VAR=value line: {line!r}")
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.sendto("\n".join(assignments).encode(), self.address)
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=, as sd_watchdog_enabled(3)
    advises), or None when the watchdog is off or meant for another process."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec or _own_pid(environ, "WATCHDOG_PID") is False:
        return None
    try:
        interval = int(usec)
    except ValueError:
        raise ValueError(f"$WATCHDOG_USEC is not a number of microseconds: {usec!r}") from None
    if interval <= 0:
        raise ValueError(f"$WATCHDOG_USEC must be positive: {usec!r}")
    return interval / 2e6


@dataclass(frozen=True)
class ListenFd:
    fd: int
    name: str  # from FileDescriptorName= in the socket unit; "unknown" when not given


def listen_fds(environ: MutableMapping[str, str] = os.environ) -> list[ListenFd]:
    """The sockets systemd passed to this process, once; [] when none were."""
    try:
        if not _own_pid(environ, "LISTEN_PID"):
            return []
        count_text = environ.get("LISTEN_FDS", "0")
        try:
            count = int(count_text)
        except ValueError:
            raise ValueError(f"$LISTEN_FDS is not a number: {count_text!r}") from None
        names = environ.get("LISTEN_FDNAMES", "").split(":")
    finally:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            environ.pop(name, None)
    received = []
    for index in range(count):
        fd = LISTEN_FDS_START + index
        os.set_inheritable(fd, False)  # sets FD_CLOEXEC
        name = names[index] if index < len(names) and names[index] else "unknown"
        received.append(ListenFd(fd=fd, name=name))
    return received
