"""The write-behind queue: puts accepted but not yet durable, capped in bytes.

A pure state machine: the server does the waiting and the file work. A put's item is
enqueued at commit (its engine gets an answer at once), the writer takes items one at a time
in enqueue order with next(), and reports each with done(). Every item leaves exactly once,
with one Outcome, and its ticket can then be answered.

The overflow policies (OVERFLOW_RULES, keyed by the setting's names, kvd.config.Overflow),
applied when an enqueue would take pending bytes (in flight included) over the cap:

- drop-oldest (default): accept the new item, then drop the oldest queued items until under
  the cap. The item in flight and the one just enqueued are never dropped, so the cap is soft:
  one item larger than the cap is still written rather than never. shed() makes room the same
  way for bytes about to come (a put begun, not yet committed).
- block: the putter waits until room_for() says yes, then enqueues. There is always room in
  an empty queue, so one oversized item passes. An enqueue without room (the wait timed out)
  is refused.
- refuse: an enqueue without room is refused, unless the queue is empty.

Nothing here waits or wakes anyone. Bytes leave the queue only in done(), cancel() and the
drops of enqueue(); after each, the server re-checks room_for() for its blocked putters and
Barrier.satisfied for its flushes.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from kvd.config import Overflow

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class OverflowRule:
    """What a put does over the cap under one overflow policy."""

    waits_for_room: bool  # a putter waits (up to the block timeout) for room before it writes
    drops_oldest: bool  # the oldest queued items make room; otherwise a put without room fails


# The overflow policies by setting value (the writeback_policy setting chooses one).
OVERFLOW_RULES: Final[Mapping[Overflow, OverflowRule]] = {
    Overflow.DROP_OLDEST: OverflowRule(waits_for_room=False, drops_oldest=True),
    Overflow.BLOCK: OverflowRule(waits_for_room=True, drops_oldest=False),
    Overflow.REFUSE: OverflowRule(waits_for_room=False, drops_oldest=False),
}


class Outcome(enum.Enum):
    STORED = "stored"
    FAILED = "failed"
    DROPPED = "dropped"  # by drop-oldest, before it was written
    CANCELLED = "cancelled"  # superseded while pending


@dataclass(frozen=True, slots=True)
class WriteItem(Generic[P]):
    ticket: int
    nbytes: int
    payload: P


@dataclass(frozen=True, slots=True)
class Admission(Generic[P]):
    """The answer to an enqueue: whether the item joined, and the items dropped for it."""

    accepted: bool
    dropped: tuple[WriteItem[P], ...] = ()


@dataclass(eq=False, slots=True)
class Barrier:
    """Satisfied once every item pending when it was made has left the queue.

    durable: satisfied, and none of those items was dropped or failed.
    """

    waiting: set[int]
    lost: int = 0

    @property
    def satisfied(self) -> bool:
        return not self.waiting

    @property
    def durable(self) -> bool:
        return self.satisfied and self.lost == 0


class WritebackQueue(Generic[P]):
    """Items waiting to be written, in enqueue order, one in flight at a time."""

    def __init__(self, cap_bytes: int, overflow: Overflow = Overflow.DROP_OLDEST) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, not {cap_bytes}")
        self.cap_bytes = cap_bytes
        self.overflow = overflow
        self._queued: OrderedDict[int, WriteItem[P]] = OrderedDict()
        self._in_flight: WriteItem[P] | None = None
        self._pending_bytes = 0
        self._left = dict.fromkeys(Outcome, 0)  # items that left the queue, by outcome
        self._refused = 0
        self._barriers: list[Barrier] = []

    @property
    def pending_bytes(self) -> int:
        """Bytes of the items queued and in flight."""
        return self._pending_bytes

    @property
    def pending_count(self) -> int:
        return len(self._queued) + (self._in_flight is not None)

    @property
    def in_flight(self) -> WriteItem[P] | None:
        return self._in_flight

    @property
    def stored(self) -> int:
        return self._left[Outcome.STORED]

    @property
    def failed(self) -> int:
        return self._left[Outcome.FAILED]

    @property
    def dropped(self) -> int:
        return self._left[Outcome.DROPPED]

    @property
    def cancelled(self) -> int:
        return self._left[Outcome.CANCELLED]

    @property
    def refused(self) -> int:
        return self._refused

    def is_pending(self, ticket: int) -> bool:
        in_flight = self._in_flight is not None and self._in_flight.ticket == ticket
        return in_flight or ticket in self._queued

    def room_for(self, nbytes: int) -> bool:
        """Whether an item of nbytes fits under the cap now; always in an empty queue."""
        return not self.pending_count or self._pending_bytes + nbytes <= self.cap_bytes

    def enqueue(self, item: WriteItem[P]) -> Admission[P]:
        """Add item behind the others, as the overflow policy allows."""
        if item.nbytes < 0:
            raise ValueError(f"ticket {item.ticket}: nbytes must be >= 0, not {item.nbytes}")
        if self.is_pending(item.ticket):
            raise ValueError(f"ticket {item.ticket} is already pending")
        if not OVERFLOW_RULES[self.overflow].drops_oldest and not self.room_for(item.nbytes):
            self._refused += 1
            return Admission(accepted=False)
        self._queued[item.ticket] = item
        self._pending_bytes += item.nbytes
        dropped: list[WriteItem[P]] = []
        while self._pending_bytes > self.cap_bytes:
            oldest = next(iter(self._queued.values()))
            if oldest is item:
                break  # only the new item is left to drop, and it never is
            del self._queued[oldest.ticket]
            self._leave(oldest, Outcome.DROPPED)
            dropped.append(oldest)
        return Admission(accepted=True, dropped=tuple(dropped))

    def shed(self, nbytes: int) -> tuple[WriteItem[P], ...]:
        """Drop the oldest queued items (never the one in flight) until nbytes more would fit
        under the cap, or none is left to drop; the items dropped."""
        dropped = []
        while self._queued and self._pending_bytes + nbytes > self.cap_bytes:
            _, oldest = self._queued.popitem(last=False)
            self._leave(oldest, Outcome.DROPPED)
            dropped.append(oldest)
        return tuple(dropped)

    def next(self) -> WriteItem[P] | None:
        """The oldest queued item, now in flight; None if the queue is empty or busy."""
        if self._in_flight is not None or not self._queued:
            return None
        _, self._in_flight = self._queued.popitem(last=False)
        return self._in_flight

    def done(self, item: WriteItem[P], outcome: Outcome) -> None:
        """The writer is finished with the item in flight: STORED or FAILED."""
        if item is not self._in_flight:
            raise ValueError(f"ticket {item.ticket} is not in flight")
        if outcome not in (Outcome.STORED, Outcome.FAILED):
            raise ValueError(f"a write ends stored or failed, not {outcome.value}")
        self._in_flight = None
        self._leave(item, outcome)

    def cancel(self, ticket: int, successor: int | None = None) -> WriteItem[P] | None:
        """Take out a queued item whose entry was superseded; None if it is not queued.

        The item in flight cannot be taken back: its write is under way. The superseding entry
        keeps the cancelled item's tokens, so barriers do not count the item as lost; if that
        entry is still pending, pass its ticket as successor, and barriers wait for it instead.
        """
        item = self._queued.pop(ticket, None)
        if item is None:
            return None
        if successor is not None and self.is_pending(successor):
            for barrier in self._barriers:
                if ticket in barrier.waiting:
                    barrier.waiting.add(successor)
        self._leave(item, Outcome.CANCELLED)
        return item

    def barrier(self) -> Barrier:
        """A barrier for every item pending now (satisfied at once if there is none)."""
        waiting = set(self._queued)
        if self._in_flight is not None:
            waiting.add(self._in_flight.ticket)
        barrier = Barrier(waiting)
        if waiting:
            self._barriers.append(barrier)
        return barrier

    def _leave(self, item: WriteItem[P], outcome: Outcome) -> None:
        self._pending_bytes -= item.nbytes
        self._left[outcome] += 1
        lost = outcome in (Outcome.DROPPED, Outcome.FAILED)
        for barrier in self._barriers:
            if item.ticket in barrier.waiting:
                barrier.waiting.discard(item.ticket)
                barrier.lost += lost
        self._barriers = [b for b in self._barriers if b.waiting]
