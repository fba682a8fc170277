"""Eviction: how many bytes must go, and which entries LruPolicy gives up for them."""

from __future__ import annotations

import itertools

import pytest
from kvd_protocol.tokens import pack_tokens

from kvd.eviction import EvictionPolicy, LruPolicy, bytes_over
from kvd.records import EntryRecord

_ids = itertools.count()


def entry(nbytes: int, *, durable: bool = True, leases: int = 0) -> EntryRecord:
    n = next(_ids)
    return EntryRecord(
        id=f"e{n}",
        identity="id",
        tokens=pack_tokens([n]),
        nbytes=nbytes,
        trimmable=True,
        durable=durable,
        leases=leases,
    )


def policy_of(*records: EntryRecord) -> EvictionPolicy:
    policy = LruPolicy()
    for record in records:
        policy.add(record)
    return policy


# bytes_over


def test_nothing_over_when_under_cap_and_above_floor() -> None:
    assert bytes_over(total_bytes=90, max_bytes=100, disk_free=500, min_free=100) == 0


def test_over_the_cap() -> None:
    assert bytes_over(total_bytes=130, max_bytes=100, disk_free=500, min_free=100) == 30


def test_under_the_floor() -> None:
    assert bytes_over(total_bytes=90, max_bytes=100, disk_free=60, min_free=100) == 40


def test_both_take_the_larger_shortfall() -> None:
    assert bytes_over(total_bytes=130, max_bytes=100, disk_free=60, min_free=100) == 40
    assert bytes_over(total_bytes=150, max_bytes=100, disk_free=60, min_free=100) == 50


def test_no_cap_leaves_only_the_floor() -> None:
    assert bytes_over(total_bytes=10**15, max_bytes=None, disk_free=500, min_free=100) == 0
    assert bytes_over(total_bytes=10**15, max_bytes=None, disk_free=50, min_free=100) == 50


# LruPolicy


def test_least_recently_added_goes_first() -> None:
    a, b, c = entry(10), entry(10), entry(10)
    assert policy_of(a, b, c).select_victims(1) == [a]


def test_touch_makes_an_entry_the_most_recent() -> None:
    a, b, c = entry(10), entry(10), entry(10)
    policy = policy_of(a, b, c)
    policy.touch(a)
    assert policy.select_victims(25) == [b, c, a]


def test_victims_add_up_to_the_bytes_over() -> None:
    a, b, c = entry(10), entry(20), entry(30)
    policy = policy_of(a, b, c)
    assert policy.select_victims(10) == [a]
    assert policy.select_victims(11) == [a, b]
    assert policy.select_victims(30) == [a, b]
    assert policy.select_victims(31) == [a, b, c]


def test_nothing_over_selects_nothing() -> None:
    assert policy_of(entry(10)).select_victims(0) == []


def test_not_enough_selects_every_evictable_entry() -> None:
    a, b = entry(10), entry(10)
    assert policy_of(a, b).select_victims(1000) == [a, b]


def test_pending_entry_is_never_a_victim() -> None:
    pending, durable = entry(10, durable=False), entry(10)
    assert policy_of(pending, durable).select_victims(20) == [durable]


def test_leased_entry_is_skipped_and_others_cover_its_bytes() -> None:
    leased, b, c = entry(50, leases=1), entry(10), entry(10)
    assert policy_of(leased, b, c).select_victims(20) == [b, c]


def test_released_lease_makes_the_entry_a_victim_again() -> None:
    record, other = entry(10, leases=1), entry(10)
    policy = policy_of(record, other)
    record.leases = 0
    assert policy.select_victims(10) == [record]


def test_selection_changes_nothing_until_remove() -> None:
    a, b = entry(10), entry(10)
    policy = policy_of(a, b)
    assert policy.select_victims(10) == [a]
    assert policy.select_victims(10) == [a]
    policy.remove(a)
    assert policy.select_victims(10) == [b]


def test_add_twice_is_refused() -> None:
    a = entry(10)
    policy = policy_of(a)
    with pytest.raises(ValueError, match="already tracked"):
        policy.add(a)


def test_remove_or_touch_of_an_untracked_entry_is_a_key_error() -> None:
    policy = policy_of(entry(10))
    with pytest.raises(KeyError):
        policy.remove(entry(10))
    with pytest.raises(KeyError):
        policy.touch(entry(10))
