"""Reads and writes on a connected Unix stream socket, with descriptors.

Straight to the kernel when it can take them now, waiting (through anyio) only when it
cannot. A connection is read from a callback of the event loop (on_readable), which runs as
soon as bytes arrive: a request and its reply cost no task switch and no registration with
the loop per read. A reply that goes out whole waits for nothing.
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import os
import socket
import sys
import termios
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import anyio

_FD_BYTES = array.array("i").itemsize
_CTRUNC = int(socket.MSG_CTRUNC)  # the IntFlag's own `&` is a Python call, on every read


class PeerGone(Exception):  # noqa: N818 - an event, not a failure
    """The peer closed its end, or the connection broke."""


class DescriptorsRefused(Exception):  # noqa: N818 - an event, not a failure
    """The kernel would not pass the descriptors (none of the frame went): too many are in
    flight (ETOOMANYREFS: they count against the sender's open-file limit) or no room."""


_NO_ROOM_FOR_DESCRIPTORS: Final = frozenset(
    {errno.ETOOMANYREFS, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
)


class BadAncillary(Exception):  # noqa: N818
    """Ancillary data other than descriptors, or descriptors the kernel had to truncate."""


def ancillary_bytes(maxfds: int) -> int:
    """The room recvmsg needs for maxfds descriptors (computed once per reader, not per read)."""
    return socket.CMSG_SPACE(maxfds * _FD_BYTES)


def on_readable(sock: socket.socket, callback: Callable[[], None]) -> None:
    """Call callback from the event loop whenever sock is readable, until stop_reading(sock).
    Needs anyio's asyncio backend (the one the daemon runs on)."""
    asyncio.get_running_loop().add_reader(sock.fileno(), callback)


def stop_reading(sock: socket.socket) -> None:
    asyncio.get_running_loop().remove_reader(sock.fileno())


def receive_now(sock: socket.socket, nbytes: int, ancillary: int) -> tuple[bytes, list[int]]:
    """Some bytes and the descriptors that came with them (never a silently dropped one), in
    ancillary bytes of room (ancillary_bytes()); BlockingIOError when nothing is there."""
    try:
        data, ancdata, flags, _ = sock.recvmsg(nbytes, ancillary)
    except BlockingIOError:
        raise  # nothing there yet: the caller waits for the next callback
    except OSError as exc:  # ConnectionResetError and the like
        raise PeerGone(str(exc)) from exc
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


def send_now(
    sock: socket.socket, data: bytes | memoryview, fds: Sequence[int]
) -> tuple[memoryview, Sequence[int]]:
    """What the kernel does not take of data now, and the descriptors still to go with it: all
    of them while it took nothing, none once it took a byte (they go with the first)."""
    view = memoryview(data)
    try:
        if fds:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = sock.sendmsg([view], rights)
            fds = ()
        else:
            sent = sock.send(view)
        if sent == len(view):  # the usual: the kernel took it whole
            return _SENT, ()
        view = view[sent:]
        while view:
            view = view[sock.send(view) :]
    except BlockingIOError:
        pass
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerGone(str(exc)) from exc
    except OSError as exc:
        if fds and exc.errno in _NO_ROOM_FOR_DESCRIPTORS:  # fds: the sendmsg that failed
            raise DescriptorsRefused(exc.strerror or str(exc)) from exc
        raise
    return view, fds


_SENT = memoryview(b"")


def sending_gate() -> anyio.Semaphore:
    """What a frame part-way out holds, so that frames never mix: a semaphore of one, not a
    lock, since a reader callback (which runs in no task) takes it too."""
    return anyio.Semaphore(1, max_value=1, fast_acquire=True)


@dataclass
class Unsent:
    """What start() could not send of a frame at once: the rest, the descriptors still to go
    with it, and whether it holds the gate (part of it went out), or waits for it."""

    rest: bytes | memoryview
    fds: Sequence[int]
    holds_gate: bool


@dataclass
class Outgoing:
    """A reply's frame that the kernel did not take at once, and the descriptors to close
    once it is out (or never will be)."""

    unsent: Unsent
    close_after: tuple[int, ...]

    def close(self) -> None:
        for fd in self.close_after:
            os.close(fd)
        self.close_after = ()


def start(
    sock: socket.socket, data: bytes | memoryview, fds: Sequence[int], gate: anyio.Semaphore
) -> Unsent | None:
    """Send data (the descriptors going with its first byte) as far as the kernel takes it
    now, without waiting; None when it all went (the usual), else what finish() must send.
    Several senders share one socket and their frames never mix: a frame goes straight out
    while no other is part-way out (gate free), and one the kernel cannot take whole takes
    gate until it is."""
    if not gate.value:  # another frame is part-way out: this one after it
        return Unsent(data, fds, holds_gate=False)
    rest, fds = send_now(sock, data, fds)
    if not rest:
        return None
    gate.acquire_nowait()  # free: nothing was awaited since it was seen free
    return Unsent(rest, fds, holds_gate=True)


async def finish(sock: socket.socket, unsent: Unsent, gate: anyio.Semaphore) -> None:
    """Send what start() left of a frame as the kernel takes it, holding gate (taken first
    if start() did not); given back at the end, sent or not."""
    if not unsent.holds_gate:
        await gate.acquire()
    rest, fds = unsent.rest, unsent.fds
    try:
        while True:
            rest, fds = send_now(sock, rest, fds)
            if not rest:
                return
            await anyio.wait_writable(sock)
    finally:
        gate.release()


async def send(
    sock: socket.socket, data: bytes | memoryview, fds: Sequence[int], gate: anyio.Semaphore
) -> None:
    """All of data, the descriptors going with its first byte (start(), then finish())."""
    unsent = start(sock, data, fds, gate)
    if unsent is not None:
        await finish(sock, unsent, gate)


# What the peer has yet to read of what was sent to it. Linux: SIOCOUTQ (TIOCOUTQ), the
# memory of the messages it has not read yet. macOS: SO_NWRITE, the bytes in the send buffer;
# a Unix socket there hands its bytes straight to the peer's receive buffer, so this may stay
# 0 (then a connection's unread descriptors are bounded by its socket buffer alone): only a
# Mac can say.
_SO_NWRITE: Final = 0x1024


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on sock that the peer has not read yet (0: it read everything)."""
    if sys.platform == "darwin":
        return sock.getsockopt(socket.SOL_SOCKET, _SO_NWRITE)
    queued = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)
    return queued[0]
