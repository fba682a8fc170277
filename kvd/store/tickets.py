"""Tickets: the later answer to a committed put (stored, dropped or failed), and its waiters.

A ticket is issued pending at commit and settled once, when its entry leaves the write-behind
queue. Pending tickets are as many as the queue's entries. Settled answers are kept for late
waits, at most KEPT of them and none older than KEPT_SECONDS, the oldest forgotten first: a
wait for one forgotten is told not_found.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from kvd_protocol.errors import ErrorCode, ProtocolError

KEPT = 16384  # settled answers kept for late ticket waits (~200 B each: ~3.3 MB at most)
KEPT_SECONDS = 600.0  # and for ten minutes at most: an engine waits for its tickets at once


@dataclass(slots=True)
class TicketAnswer:
    """What a ticket wait answers: the state (pending, stored, dropped or failed) and why.

    settled: what waiters of a pending ticket wait on; None once settled, as nobody waits
    then (an event is most of a kept answer's memory, and KEPT answers are kept).
    """

    state: str
    reason: str | None = None
    settled: anyio.Event | None = field(default_factory=anyio.Event)
    settled_at: float = 0.0  # by the Tickets' clock


class Tickets:
    """Every ticket not yet forgotten: the pending ones, and the settled ones oldest first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # seconds, for the answers' age
        self._pending: dict[int, TicketAnswer] = {}
        self._settled: OrderedDict[int, TicketAnswer] = OrderedDict()
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pending) + len(self._settled)

    def issue(self) -> int:
        """A new ticket number; it is known once marked pending or settled."""
        return next(self._ids)

    def mark_pending(self, ticket: int) -> None:
        self._pending[ticket] = TicketAnswer("pending")

    def settle(self, ticket: int, state: str, reason: str | None) -> None:
        answer = self._pending.pop(ticket, None) or TicketAnswer(state)
        answer.state, answer.reason = state, reason
        if answer.settled is not None:
            answer.settled.set()
            answer.settled = None
        answer.settled_at = self._clock()
        self._settled[ticket] = answer
        self._forget(answer.settled_at)

    def _forget(self, now: float) -> None:
        settled, oldest = self._settled, now - KEPT_SECONDS
        while settled and (len(settled) > KEPT or next(iter(settled.values())).settled_at < oldest):
            settled.popitem(last=False)

    async def wait(self, ticket: int, timeout: float | None) -> TicketAnswer:
        """The ticket's answer, once settled or after timeout seconds (none: at once)."""
        answer = self._pending.get(ticket)
        if answer is None:
            self._forget(self._clock())
            answer = self._settled.get(ticket)
            if answer is None:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no ticket {ticket} (or long forgotten)")
            return answer
        if answer.settled is not None and timeout:
            with anyio.move_on_after(timeout):
                await answer.settled.wait()
        return answer
