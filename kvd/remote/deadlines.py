"""A blocking bucket call's deadline on its whole duration, and its end from another thread.

A socket timeout bounds each read, not a call: a bucket that sends its answer a byte at a time,
each within the timeout, would hold the call for ever. So each call has an Interrupt: the
calling thread tells it which socket it uses (watch), and interrupt() shuts that socket down
from any thread, which makes the blocking connect, send or read return at once; the call then
opens no other. One watchdog thread for the process interrupts every call still under way at
its deadline (expired); the daemon's event loop interrupts a call it stopped waiting for.
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field


class Interrupt:
    """The end of one call (or of the calls a caller makes under it), from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self.interrupted = False
        self.expired = False  # interrupted by its deadline

    def interrupt(self, *, expired: bool = False) -> None:
        """End the call: its socket shut down, no other opened. Once; later calls no-ops."""
        with self._lock:
            if self.interrupted:
                return
            self.interrupted, self.expired = True, expired
            sock = self._socket
        if sock is not None:
            _shut_down(sock)

    def watch(self, sock: socket.socket | None) -> bool:
        """The calling thread uses sock from now on (None: none any more); False if the call
        is interrupted already (sock is then not to be used)."""
        with self._lock:
            if self.interrupted:
                self._socket = None
                return False
            self._socket = sock
            return True


def _shut_down(sock: socket.socket) -> None:
    # socket.socket's own shutdown, not SSLSocket's (which drops its TLS state under the
    # thread still reading through it).
    with suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


@dataclass(frozen=True)
class Bound:
    """A call's deadline (monotonic seconds), the seconds it was given, and its Interrupt."""

    deadline: float
    seconds: float
    interrupt: Interrupt = field(default_factory=Interrupt)

    @classmethod
    def until(cls, deadline: float, interrupt: Interrupt | None = None) -> Bound:
        """A call that must end by deadline, watched by the watchdog from now."""
        bound = cls(deadline, deadline - time.monotonic(), interrupt or Interrupt())
        WATCHDOG.watch(bound)
        return bound

    def left(self) -> float:
        """Seconds left; TimeoutError when none are (a socket timeout of 0 would not block)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        return left

    def overdue(self) -> str:
        return f"not done within {round(self.seconds, 1):g} s"


class _Watchdog:
    """One thread for the process: interrupts each watched call at its deadline (a call done
    by then has no socket watched: the interrupt shuts nothing down)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: list[tuple[float, int, Interrupt]] = []  # a heap by deadline
        self._order = itertools.count()  # ties broken without comparing Interrupts
        self._thread: threading.Thread | None = None

    def watch(self, bound: Bound) -> None:
        with self._changed:
            heapq.heappush(self._due, (bound.deadline, next(self._order), bound.interrupt))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvd-deadlines", daemon=True)
                self._thread.start()
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, interrupt = heapq.heappop(self._due)
            interrupt.interrupt(expired=True)


WATCHDOG = _Watchdog()
