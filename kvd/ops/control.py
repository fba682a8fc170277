"""kvctl's connection to the daemon: one blocking socket, one request at a time, the same
protocol as the engines (kvd_protocol's Connection); and where the socket it tried came from,
for the error that says nobody answers there."""

from __future__ import annotations

import argparse
import itertools
import os
import socket
from collections.abc import Mapping
from typing import Any

from kvd_protocol import messages as m
from kvd_protocol.connection import NEED_DATA, Connection, Role
from kvd_protocol.errors import DaemonUnavailableError, ProtocolError

from kvd.config import Config, env_var

RECEIVE_BYTES = 1 << 16
HOW_TO_START = (
    "start one with `kvd serve` (`make run` in a checkout), or point at a running one with "
    f"--socket PATH or {env_var('socket')}"
)


def socket_source(args: argparse.Namespace, environ: Mapping[str, str], config: Config) -> str:
    """Where the socket path kvctl tries came from, as load_config chose it."""
    if getattr(args, "socket", None) is not None:
        return "--socket"
    if environ.get(env_var("socket")) is not None:
        return env_var("socket")
    if config.config_file is not None:
        return f"the default, or {config.config_file}"
    return "the default"


class Control:
    """One blocking connection to the daemon, one request at a time. Every failure of the
    socket (the daemon gone, a reset, a timeout) is a DaemonUnavailableError."""

    def __init__(self, path: str, timeout: float, source: str = "") -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
            self._sock.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            tried = f"{path} (from {source})" if source else path
            raise DaemonUnavailableError(
                f"no kvd answers on {tried}: {reason}; {HOW_TO_START}"
            ) from None
        self._conn = Connection(Role.CLIENT)
        self._ids = itertools.count(1)
        self._timeout = timeout
        try:
            hello = self.call(m.Hello, protocol=m.PROTOCOL_VERSION, client="kvctl", pid=os.getpid())
        except ProtocolError as exc:
            self._sock.close()
            raise DaemonUnavailableError(
                f"what answers on {path} did not take kvctl's hello (not a kvd, or one that "
                f"refuses this connection): {exc}"
            ) from None
        assert isinstance(hello, m.HelloReply)
        self.features = frozenset(hello.features)
        self.limits = hello.limits
        self.tenant = hello.tenant  # "": this user may see every identity

    def wait_longer(self, seconds: float | None) -> None:
        """The next answers may take seconds (None: as long as it takes) on top of the usual
        timeout: a request that waits on purpose."""
        self._sock.settimeout(None if seconds is None else self._timeout + seconds)

    def call(self, request: type[m.Request], **fields: Any) -> m.Reply:
        try:
            event = self._exchange(request(id=next(self._ids), **fields))
        except TimeoutError:
            raise DaemonUnavailableError("the daemon did not answer in time") from None
        except DaemonUnavailableError:  # a ConnectionError too, said as it is
            raise
        except OSError as exc:
            raise DaemonUnavailableError(f"the connection to the daemon failed: {exc}") from None
        if isinstance(event, m.ErrorReply):
            raise ProtocolError(event.code, event.message)
        assert isinstance(event, m.Reply)
        return event

    def _exchange(self, request: m.Request) -> object:
        self._sock.sendall(self._conn.send(request))
        while True:
            event = self._conn.next_event()
            if event is not NEED_DATA:
                return event
            # A reply may carry descriptors (open_entry, open_blocks, the put's files).
            data, fds, _, _ = socket.recv_fds(self._sock, RECEIVE_BYTES, m.MAX_BLOCK_BATCH)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise DaemonUnavailableError("the daemon closed the connection")
            self._conn.receive_data(data, fds)

    def close(self) -> None:
        self._sock.close()
