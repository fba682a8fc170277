"""Reads and writes on a connected Unix stream socket, with descriptors.

Straight to the kernel when it can take them now, waiting (through anyio) only when it
cannot: a request and its reply cost one trip round the event loop, not the three that a
checkpoint before every stream read and write adds.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Sequence

import anyio

_FD_BYTES = array.array("i").itemsize
_CTRUNC = int(socket.MSG_CTRUNC)  # the IntFlag's own `&` is a Python call, on every read


class PeerGone(Exception):  # noqa: N818 - an event, not a failure
    """The peer closed its end, or the connection broke."""


class BadAncillary(Exception):  # noqa: N818
    """Ancillary data other than descriptors, or descriptors the kernel had to truncate."""


async def receive(sock: socket.socket, nbytes: int, maxfds: int) -> tuple[bytes, list[int]]:
    """Some bytes and the descriptors that came with them (never a silently dropped one)."""
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(nbytes, socket.CMSG_SPACE(maxfds * _FD_BYTES))
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        except (ConnectionResetError, OSError) as exc:
            raise PeerGone(str(exc)) from exc
        break
    fds = array.array("i")
    foreign = False
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_BYTES])
        else:
            foreign = True
    if foreign or flags & _CTRUNC:
        for fd in fds:
            os.close(fd)
        raise BadAncillary("ancillary data other than whole descriptors")
    if not data and not fds:
        raise PeerGone("end of stream")
    return data, list(fds)


async def send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """All of data, the descriptors going with its first byte."""
    view = memoryview(data)
    try:
        if fds:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            while True:
                try:
                    view = view[sock.sendmsg([view], rights) :]
                    break
                except BlockingIOError:
                    await anyio.wait_writable(sock)
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                await anyio.wait_writable(sock)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerGone(str(exc)) from exc
