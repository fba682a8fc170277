"""Blocking Unix-socket I/O with descriptor passing: the only socket code of the sync client."""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Sequence

RECV_BYTES = 1 << 16
MAX_FDS_PER_READ = 8  # replies carry at most one descriptor; room for several per read


class TransportClosed(ConnectionError):
    """The daemon closed the connection, or it broke."""


class BlockingTransport:
    """A connected stream socket that sends frames with descriptors and receives both."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(cls, path: str, timeout: float | None) -> BlockingTransport:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        try:
            if fds:
                sent = socket.send_fds(self._sock, [data], list(fds))
                data = data[sent:]
            self._sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TransportClosed(str(exc)) from exc

    def receive(self) -> tuple[bytes, list[int]]:
        """One read: some bytes and the descriptors that came with them (never a dropped one)."""
        fds = array.array("i")
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(
                RECV_BYTES, socket.CMSG_SPACE(MAX_FDS_PER_READ * fds.itemsize)
            )
        except ConnectionResetError as exc:
            raise TransportClosed(str(exc)) from exc
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        received = list(fds)
        if flags & socket.MSG_CTRUNC:
            for fd in received:
                os.close(fd)
            raise TransportClosed("descriptors were truncated by the kernel")
        if not data and not received:
            raise TransportClosed("the daemon closed the connection")
        return data, received

    def close(self) -> None:
        self._sock.close()
