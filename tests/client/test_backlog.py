"""The cold tier's backlog rules on snapshots described by their tokens, kind and bytes:
what covers what, what goes first over the byte bound, and what is shared counted once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from kvd_client.backlog import Backlog, Kind, covers, memory_bytes


@dataclass(eq=False)
class Item:
    tokens: list[int]
    nbytes: int
    kind: Kind = Kind.TURN
    trimmable: bool = True
    shared: dict[object, int] = field(default_factory=dict)

    def bytes_by_owner(self) -> Mapping[object, int]:
        return {self: self.nbytes, **self.shared}


def _filled(backlog: Backlog[Item], *items: Item) -> None:
    for item in items:
        assert backlog.admit(item).taken
        backlog.append(item)


def test_an_entry_covers_its_prefixes_when_it_trims_and_its_own_tokens_always() -> None:
    long, short = Item([1, 2, 3], 1), Item([1, 2], 1)
    assert covers(long, short)
    assert not covers(short, long)
    assert not covers(Item([1, 2, 3], 1, trimmable=False), short)
    assert covers(Item([1, 2], 1, trimmable=False), short)
    assert not covers(long, Item([1, 9], 1))


def test_a_longer_turn_supersedes_what_it_covers_and_a_covered_one_is_not_taken() -> None:
    backlog: Backlog[Item] = Backlog(100)
    segment, other = Item([1, 2], 10, kind=Kind.SEGMENT), Item([7, 8], 10)
    _filled(backlog, segment, other)
    admission = backlog.admit(Item([1, 2, 3], 10))
    assert admission.taken
    assert admission.superseded == [segment]
    assert not admission.dropped
    backlog.append(Item([1, 2, 3], 10))
    covered = backlog.admit(Item([1, 2], 10, kind=Kind.SEGMENT))
    assert covered.covered
    assert not covered.taken
    assert len(backlog) == 2


def test_over_the_bound_segments_go_first_then_the_oldest_turn() -> None:
    backlog: Backlog[Item] = Backlog(30)
    old, segment, newer = Item([1], 10), Item([2], 10, kind=Kind.SEGMENT), Item([3], 10)
    _filled(backlog, old, segment, newer)
    admission = backlog.admit(Item([4], 10))
    assert admission.taken
    assert admission.dropped == [segment]
    backlog.append(Item([4], 10))
    admission = backlog.admit(Item([5], 10))
    assert admission.taken
    assert admission.dropped == [old]
    backlog.append(Item([5], 10))
    late = backlog.admit(Item([6], 10, kind=Kind.SEGMENT))  # a segment is worth the least
    assert not late.taken
    assert not late.covered
    assert not late.dropped
    assert backlog.nbytes == 30


def test_one_larger_than_the_bound_is_taken_only_when_nothing_else_waits() -> None:
    backlog: Backlog[Item] = Backlog(10)
    _filled(backlog, Item([1], 50))
    admission = backlog.admit(Item([2], 50))
    assert admission.taken
    assert len(admission.dropped) == 1
    with pytest.raises(ValueError, match="holds nothing"):
        Backlog(0)


def test_bytes_shared_by_several_snapshots_count_once() -> None:
    block = object()
    a, b = Item([1], 5, shared={block: 20}), Item([2], 5, shared={block: 20})
    assert memory_bytes([a, b]) == 30
    backlog: Backlog[Item] = Backlog(30)
    _filled(backlog, a)
    assert backlog.admit(b).taken
    assert backlog.nbytes == 25


def test_prefill_checkpoints_go_before_segments_and_never_cover_shorter_ones() -> None:
    backlog: Backlog[Item] = Backlog(30)
    checkpoint = Item([1, 2], 10, kind=Kind.PREFILL_CHECKPOINT, trimmable=False)
    segment, turn = Item([3], 10, kind=Kind.SEGMENT), Item([4], 10)
    _filled(backlog, segment, checkpoint, turn)
    admission = backlog.admit(Item([5], 10))
    assert admission.dropped == [checkpoint]  # newer than the segment, worth less
    backlog.append(Item([5], 10))
    longer = Item([1, 2, 3], 10, kind=Kind.PREFILL_CHECKPOINT, trimmable=False)
    assert not covers(longer, checkpoint)
