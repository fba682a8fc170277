"""WritebackQueue: order, each overflow policy, byte accounting, cancel and barriers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.config import Overflow
from kvd.store.writeback import Outcome, WritebackQueue, WriteItem


def item(ticket: int, nbytes: int = 10) -> WriteItem[str]:
    return WriteItem(ticket, nbytes, f"put-{ticket}")


def queue_of(
    *items: WriteItem[str], cap: int = 100, overflow: Overflow = Overflow.DROP_OLDEST
) -> WritebackQueue[str]:
    queue: WritebackQueue[str] = WritebackQueue(cap, overflow)
    for each in items:
        assert queue.enqueue(each).accepted
    return queue


def start(queue: WritebackQueue[str]) -> WriteItem[str]:
    taken = queue.next()
    assert taken is not None
    return taken


def write(queue: WritebackQueue[str], outcome: Outcome = Outcome.STORED) -> WriteItem[str]:
    taken = start(queue)
    queue.done(taken, outcome)
    return taken


# Order and the writer's side.


def test_items_are_written_in_enqueue_order() -> None:
    queue = queue_of(item(1), item(2), item(3))
    assert [write(queue).ticket for _ in range(3)] == [1, 2, 3]
    assert queue.next() is None


def test_one_item_in_flight_at_a_time() -> None:
    queue = queue_of(item(1), item(2))
    first = start(queue)
    assert queue.in_flight is first
    assert queue.next() is None
    queue.done(first, Outcome.STORED)
    assert start(queue).ticket == 2


def test_done_needs_the_item_in_flight() -> None:
    queue = queue_of(item(1), item(2))
    queue.next()
    with pytest.raises(ValueError, match="not in flight"):
        queue.done(item(2), Outcome.STORED)


def test_a_write_ends_stored_or_failed_only() -> None:
    queue = queue_of(item(1))
    with pytest.raises(ValueError, match="stored or failed"):
        queue.done(start(queue), Outcome.DROPPED)


def test_counters_follow_outcomes() -> None:
    queue = queue_of(item(1, 30), item(2, 20))
    assert (queue.pending_bytes, queue.pending_count) == (50, 2)
    write(queue, Outcome.STORED)
    assert (queue.pending_bytes, queue.pending_count, queue.stored) == (20, 1, 1)
    write(queue, Outcome.FAILED)
    assert (queue.pending_bytes, queue.pending_count, queue.failed) == (0, 0, 1)


def test_in_flight_bytes_stay_pending_until_done() -> None:
    queue = queue_of(item(1, 30))
    taken = start(queue)
    assert (queue.pending_bytes, queue.pending_count) == (30, 1)
    queue.done(taken, Outcome.STORED)
    assert (queue.pending_bytes, queue.pending_count) == (0, 0)


def test_a_ticket_pending_twice_is_refused() -> None:
    queue = queue_of(item(1))
    with pytest.raises(ValueError, match="already pending"):
        queue.enqueue(item(1))


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        WritebackQueue[str](-1)
    with pytest.raises(ValueError, match="nbytes"):
        queue_of().enqueue(item(1, -1))


# drop-oldest


def test_drop_oldest_drops_from_the_front_until_under_the_cap() -> None:
    queue = queue_of(item(1, 40), item(2, 40), cap=100)
    admission = queue.enqueue(item(3, 60))
    assert admission.accepted
    assert [d.ticket for d in admission.dropped] == [1]
    assert (queue.pending_bytes, queue.dropped) == (100, 1)


def test_drop_oldest_never_drops_the_item_in_flight() -> None:
    queue = queue_of(item(1, 40), item(2, 40), cap=100)
    queue.next()  # 1 is in flight
    admission = queue.enqueue(item(3, 60))
    assert [d.ticket for d in admission.dropped] == [2]
    assert queue.pending_bytes == 100


def test_drop_oldest_never_drops_the_newest() -> None:
    queue = queue_of(item(1, 40), cap=100)
    queue.next()
    admission = queue.enqueue(item(2, 500))
    assert admission.accepted
    assert admission.dropped == ()
    assert (queue.pending_bytes, queue.pending_count) == (540, 2)


def test_drop_oldest_with_a_zero_cap_keeps_only_the_newest_and_in_flight() -> None:
    queue = queue_of(item(1), cap=0)
    queue.next()
    queue.enqueue(item(2))
    admission = queue.enqueue(item(3))
    assert [d.ticket for d in admission.dropped] == [2]
    assert queue.pending_count == 2


# block


def test_block_has_room_under_the_cap_only() -> None:
    queue = queue_of(item(1, 60), cap=100, overflow=Overflow.BLOCK)
    assert queue.room_for(40)
    assert not queue.room_for(41)


def test_block_always_has_room_in_an_empty_queue() -> None:
    queue = queue_of(cap=100, overflow=Overflow.BLOCK)
    assert queue.room_for(10_000)
    assert queue.enqueue(item(1, 10_000)).accepted


def test_block_room_appears_when_an_item_is_done() -> None:
    queue = queue_of(item(1, 60), item(2, 30), cap=100, overflow=Overflow.BLOCK)
    assert not queue.room_for(50)
    write(queue)
    assert queue.room_for(50)


def test_block_refuses_an_enqueue_without_room() -> None:
    queue = queue_of(item(1, 60), cap=100, overflow=Overflow.BLOCK)
    assert not queue.enqueue(item(2, 50)).accepted
    assert (queue.refused, queue.pending_bytes, queue.pending_count) == (1, 60, 1)


# refuse


def test_refuse_rejects_what_does_not_fit() -> None:
    queue = queue_of(item(1, 60), cap=100, overflow=Overflow.REFUSE)
    admission = queue.enqueue(item(2, 50))
    assert not admission.accepted
    assert admission.dropped == ()
    assert (queue.refused, queue.pending_bytes) == (1, 60)
    assert queue.enqueue(item(3, 40)).accepted


def test_refuse_accepts_an_oversized_item_into_an_empty_queue() -> None:
    queue = queue_of(cap=100, overflow=Overflow.REFUSE)
    assert queue.enqueue(item(1, 500)).accepted
    assert not queue.enqueue(item(2, 1)).accepted


# cancel


def test_cancel_takes_out_a_queued_item() -> None:
    queue = queue_of(item(1, 30), item(2, 20))
    cancelled = queue.cancel(2)
    assert cancelled is not None
    assert cancelled.ticket == 2
    assert (queue.pending_bytes, queue.pending_count, queue.cancelled) == (30, 1, 1)
    assert not queue.is_pending(2)


def test_cancel_cannot_take_back_the_item_in_flight() -> None:
    queue = queue_of(item(1))
    queue.next()
    assert queue.cancel(1) is None
    assert queue.pending_count == 1


def test_cancel_of_an_unknown_ticket_is_none() -> None:
    assert queue_of(item(1)).cancel(7) is None


# barrier


def test_barrier_on_an_empty_queue_is_satisfied_and_durable() -> None:
    barrier = queue_of().barrier()
    assert barrier.satisfied
    assert barrier.durable


def test_barrier_waits_for_items_before_it_only() -> None:
    queue = queue_of(item(1), item(2))
    first = start(queue)  # in flight: still waited for
    barrier = queue.barrier()
    queue.enqueue(item(3))
    queue.done(first, Outcome.STORED)
    assert not barrier.satisfied
    write(queue)
    assert barrier.satisfied
    assert barrier.durable
    assert queue.pending_count == 1


def test_barrier_is_not_durable_if_an_item_failed() -> None:
    queue = queue_of(item(1), item(2))
    barrier = queue.barrier()
    write(queue, Outcome.FAILED)
    write(queue)
    assert barrier.satisfied
    assert not barrier.durable


def test_barrier_is_not_durable_if_an_item_was_dropped() -> None:
    queue = queue_of(item(1, 60), cap=100)
    barrier = queue.barrier()
    queue.enqueue(item(2, 60))  # drops 1
    assert barrier.satisfied
    assert not barrier.durable


def test_barrier_counts_a_cancelled_item_as_kept() -> None:
    queue = queue_of(item(1), item(2))
    first = start(queue)
    barrier = queue.barrier()
    queue.cancel(2)
    queue.done(first, Outcome.STORED)
    assert barrier.durable


def test_barrier_waits_for_the_successor_of_a_cancelled_item() -> None:
    queue = queue_of(item(1))
    barrier = queue.barrier()
    queue.enqueue(item(2))  # supersedes 1, still pending
    queue.cancel(1, successor=2)
    assert not barrier.satisfied
    write(queue, Outcome.FAILED)
    assert barrier.satisfied
    assert not barrier.durable


# Byte accounting under every policy, against a plain model.

_step = st.one_of(
    st.tuples(st.just("enqueue"), st.integers(0, 80)),
    st.tuples(st.just("start"), st.just(0)),
    st.tuples(st.just("stored"), st.just(0)),
    st.tuples(st.just("failed"), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
)


@pytest.mark.parametrize("overflow", list(Overflow))
@settings(max_examples=200, deadline=None)
@given(cap=st.integers(0, 150), steps=st.lists(_step, max_size=60))
def test_byte_accounting_is_exact(
    overflow: Overflow, cap: int, steps: list[tuple[str, int]]
) -> None:
    queue: WritebackQueue[str] = WritebackQueue(cap, overflow)
    pending: dict[int, int] = {}  # ticket -> nbytes, what the queue should hold
    accepted = 0
    for ticket, (kind, value) in enumerate(steps):
        if kind == "enqueue":
            admission = queue.enqueue(item(ticket, value))
            if admission.accepted:
                accepted += 1
                pending[ticket] = value
            for dropped in admission.dropped:
                assert dropped.ticket != ticket
                assert queue.in_flight is None or dropped.ticket != queue.in_flight.ticket
                del pending[dropped.ticket]
            if overflow is Overflow.DROP_OLDEST:
                # Over the cap only with nothing left to drop: in flight and newest at most.
                assert queue.pending_bytes <= cap or queue.pending_count <= 1 + (
                    queue.in_flight is not None
                )
            else:
                assert queue.pending_bytes <= cap or queue.pending_count == 1
        elif kind == "start":
            queue.next()
        elif kind in ("stored", "failed") and queue.in_flight is not None:
            done = queue.in_flight
            queue.done(done, Outcome.STORED if kind == "stored" else Outcome.FAILED)
            del pending[done.ticket]
        elif kind == "cancel" and queue.cancel(value) is not None:
            del pending[value]
        assert queue.pending_bytes == sum(pending.values())
        assert queue.pending_count == len(pending)
        left = queue.stored + queue.failed + queue.dropped + queue.cancelled
        assert left + queue.pending_count == accepted
        assert queue.refused + accepted == sum(kind == "enqueue" for kind, _ in steps[: ticket + 1])
