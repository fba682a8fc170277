"""Reads and writes on a connected Unix stream socket, with descriptors.

Straight to the kernel when it can take them now, waiting (through anyio) only when it
cannot: a request and its reply cost one trip round the event loop, not the three that a
checkpoint before every stream read and write adds, and a reply that goes out whole takes no
lock.
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


def ancillary_bytes(maxfds: int) -> int:
    """The room recvmsg needs for maxfds descriptors (computed once per reader, not per read)."""
    return socket.CMSG_SPACE(maxfds * _FD_BYTES)


async def receive(sock: socket.socket, nbytes: int, ancillary: int) -> tuple[bytes, list[int]]:
    """Some bytes and the descriptors that came with them (never a silently dropped one), in
    ancillary bytes of room (ancillary_bytes())."""
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(nbytes, ancillary)
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        except (ConnectionResetError, OSError) as exc:
            raise PeerGone(str(exc)) from exc
        break
    if not ancdata and not flags & _CTRUNC:  # the usual read: bytes alone
        if not data:
            raise PeerGone("end of stream")
        return data, []
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


async def send(sock: socket.socket, data: bytes, fds: Sequence[int], lock: anyio.Lock) -> None:
    """All of data, the descriptors going with its first byte. Several tasks send on one socket
    and their frames never mix: a frame goes straight out while no other is part-way out (the
    usual case, no lock taken), and one the kernel cannot take whole holds lock until it is."""
    view = memoryview(data)
    locked = False
    try:
        if lock.locked():
            await lock.acquire()
            locked = True
        while True:
            try:
                view = _send_now(sock, view, fds)
                fds = ()
            except BlockingIOError:
                pass
            if not view:
                return
            if not locked:  # free: nothing was awaited since it was seen free
                lock.acquire_nowait()
                locked = True
            await anyio.wait_writable(sock)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerGone(str(exc)) from exc
    finally:
        if locked:
            lock.release()


def _send_now(sock: socket.socket, view: memoryview, fds: Sequence[int]) -> memoryview:
    """What the kernel does not take of view now; the descriptors go with its first byte.
    BlockingIOError when it took nothing (the descriptors were not sent either)."""
    if fds:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        view = view[sock.sendmsg([view], rights) :]
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            break
    return view
