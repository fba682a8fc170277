"""Unix-socket I/O with descriptor passing: the only socket code of both clients.

Every read goes through recvmsg with room for descriptors, never a plain recv: a recv would
silently drop the descriptors a reply carries.
"""

from __future__ import annotations

import array
import asyncio
import math
import os
import socket
import struct
from collections.abc import Sequence

from kvd_protocol.messages import MAX_BLOCK_BATCH

RECV_BYTES = 1 << 16
# A reply carries at most MAX_BLOCK_BATCH descriptors (put_blocks, open_blocks): room for one
# such reply and a few more per read.
MAX_FDS_PER_READ = MAX_BLOCK_BATCH + 8
_CTRUNC = int(socket.MSG_CTRUNC)  # the IntFlag's own `&` is a Python call, on every read
_FD_BYTES = array.array("i").itemsize
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_READ * _FD_BYTES)
# struct timeval as SO_RCVTIMEO takes it: two longs on 64-bit Linux; on macOS a long and an
# int, padded to the same 16 bytes (the int first, as both are little-endian).
_TIMEVAL = struct.Struct("@ll")


class TransportClosed(ConnectionError):  # noqa: N818 - reads as the state it reports
    """The daemon closed the connection, or it broke."""


def receive_from(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One recvmsg: some bytes and the descriptors that came with them (never a dropped one).
    On a non-blocking socket with nothing to read, raises BlockingIOError."""
    try:
        data, ancdata, flags, _ = sock.recvmsg(RECV_BYTES, _ANCILLARY_BYTES)
    except ConnectionResetError as exc:
        raise TransportClosed(str(exc)) from exc
    return _received(data, ancdata, flags)


def _received(
    data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int
) -> tuple[bytes, list[int]]:
    """What a recvmsg returned, as receive_from returns it."""
    received: list[int] = []
    if ancdata:  # most replies carry no descriptor
        fds = array.array("i")
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % _FD_BYTES])
        received = list(fds)
    if flags & _CTRUNC:
        for fd in received:
            os.close(fd)
        raise TransportClosed("descriptors were truncated by the kernel")
    if not data and not received:
        raise TransportClosed("the daemon closed the connection")
    return data, received


class BlockingTransport:
    """A connected stream socket that sends frames with descriptors and receives both.

    The socket blocks, and the kernel times its reads and writes out (SO_RCVTIMEO,
    SO_SNDTIMEO): a socket with a Python timeout polls before each one, a system call more
    per read and per write. A timeout raises TimeoutError, as the Python timeout does."""

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self._sock = sock
        self.timeout: float | None = None  # as set last: blocking, until settimeout
        sock.settimeout(None)
        self.settimeout(timeout)

    @classmethod
    def connect(cls, path: str, timeout: float | None) -> BlockingTransport:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return cls(sock, timeout)
        except BaseException:
            sock.close()
            raise

    def settimeout(self, timeout: float | None) -> None:
        """Reads and writes time out after timeout seconds (None: never). Each change costs
        system calls: a caller that keeps the timeout checks self.timeout first."""
        micros = 0 if timeout is None else max(1, math.ceil(timeout * 1e6))  # 0: never
        timeval = _TIMEVAL.pack(*divmod(micros, 1_000_000))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self.timeout = timeout

    def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        try:
            if fds:
                sent = socket.send_fds(self._sock, [data], list(fds))
                data = data[sent:]
            self._sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TransportClosed(str(exc)) from exc
        except BlockingIOError:  # the kernel's timeout
            raise TimeoutError("timed out") from None

    def receive(self) -> tuple[bytes, list[int]]:
        """As receive_from, in one call fewer for the usual read (bytes alone)."""
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(RECV_BYTES, _ANCILLARY_BYTES)
        except ConnectionResetError as exc:
            raise TransportClosed(str(exc)) from exc
        except BlockingIOError:  # the kernel's timeout
            raise TimeoutError("timed out") from None
        if data and not ancdata and not flags & _CTRUNC:
            return data, []
        return _received(data, ancdata, flags)

    def close(self) -> None:
        self._sock.close()


class AsyncTransport:
    """The same on a non-blocking socket, for the running asyncio loop. Clients send no
    descriptors, so sending is plain; receiving waits for readability, then recvmsg."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    async def connect(cls, path: str) -> AsyncTransport:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, path)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, data: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TransportClosed(str(exc)) from exc

    async def receive(self) -> tuple[bytes, list[int]]:
        while True:
            try:
                return receive_from(self._sock)
            except BlockingIOError:
                await self._readable()

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(self._sock.fileno(), wake)
        try:
            await ready
        finally:
            loop.remove_reader(self._sock.fileno())

    def close(self) -> None:
        self._sock.close()
