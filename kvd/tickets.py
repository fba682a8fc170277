"""Tickets: the later answer to a committed put (stored, dropped or failed), and its waiters.

A ticket is issued pending at commit and settled once, when its entry leaves the write-behind
queue. Settled answers are kept for late waits, the oldest forgotten past KEPT.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import anyio
from kvd_protocol.errors import ErrorCode, ProtocolError

KEPT = 65536  # settled answers kept for late ticket waits; older ones are forgotten


@dataclass(slots=True)
class TicketAnswer:
    """What a ticket wait answers: the state (pending, stored, dropped or failed) and why.

    settled: what waiters of a pending ticket wait on; None once settled, as nobody waits
    then (an event is most of a kept answer's memory, and KEPT answers are kept).
    """

    state: str
    reason: str | None = None
    settled: anyio.Event | None = field(default_factory=anyio.Event)


class Tickets:
    """Every ticket not yet forgotten, oldest settled first."""

    def __init__(self) -> None:
        self._answers: OrderedDict[int, TicketAnswer] = OrderedDict()
        self._ids = itertools.count(1)

    def issue(self) -> int:
        """A new ticket number; it is known once marked pending or settled."""
        return next(self._ids)

    def mark_pending(self, ticket: int) -> None:
        self._answers[ticket] = TicketAnswer("pending")

    def settle(self, ticket: int, state: str, reason: str | None) -> None:
        answer = self._answers.get(ticket)
        if answer is None:
            answer = self._answers[ticket] = TicketAnswer(state)
        answer.state, answer.reason = state, reason
        if answer.settled is not None:
            answer.settled.set()
            answer.settled = None
        self._answers.move_to_end(ticket)
        while len(self._answers) > KEPT:
            oldest, first = next(iter(self._answers.items()))
            if first.state == "pending":
                break
            del self._answers[oldest]

    async def wait(self, ticket: int, timeout: float | None) -> TicketAnswer:
        """The ticket's answer, once settled or after timeout seconds (none: at once)."""
        answer = self._answers.get(ticket)
        if answer is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no ticket {ticket} (or long forgotten)")
        if answer.settled is not None and timeout:
            with anyio.move_on_after(timeout):
                await answer.settled.wait()
        return answer
