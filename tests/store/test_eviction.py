"""Eviction: how many bytes must go, and which entries LruPolicy gives up for them."""

from __future__ import annotations

import itertools

import pytest
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

from kvd.store.eviction import CostPolicy, EvictionPolicy, LruPolicy, bytes_over
from kvd.store.records import EntryRecord
from kvd.store.telemetry import DEFAULT_PREFILL_COST, Telemetry

_ids = itertools.count()


def entry(
    nbytes: int,
    *,
    durable: bool = True,
    leases: int = 0,
    tokens: int | None = None,
    used_at: float = 0.0,
    identity: str = "id",
) -> EntryRecord:
    """A record of nbytes; tokens: how many (default one, distinct per record); used_at: its
    last use, and its creation."""
    n = next(_ids)
    return EntryRecord(
        id=f"e{n}",
        digest=identity,
        tokens=pack_tokens([n] if tokens is None else range(tokens)),
        nbytes=nbytes,
        trimmable=True,
        durable=durable,
        leases=leases,
        created=used_at,
        used_at=used_at,
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


# CostPolicy


def _cost_policy(*records: EntryRecord, now: float = 1000.0) -> CostPolicy:
    policy = CostPolicy(clock=lambda: now, seed=1)
    for record in records:
        policy.add(record)
    return policy


def test_cost_evicts_the_least_prefill_saved_per_byte_first() -> None:
    dense = entry(100, tokens=1000)  # 10 tokens a byte: a quantized cache, say
    sparse = entry(100, tokens=10)
    middling = entry(100, tokens=100)
    policy = _cost_policy(dense, sparse, middling)
    assert policy.select_victims(100) == [sparse]
    assert policy.select_victims(200) == [sparse, middling]


def test_cost_ages_an_unused_entry_below_a_recent_one() -> None:
    """Worth halves with each HALF_LIFE of disuse: ten times the tokens a byte do not keep an
    entry unused for a day against one used just now."""
    day_old = entry(100, tokens=1000, used_at=0.0)
    fresh = entry(100, tokens=100, used_at=86_400.0)
    policy = _cost_policy(day_old, fresh, now=86_400.0)
    assert policy.select_victims(1) == [day_old]
    assert policy.worth(day_old, 3600.0) == pytest.approx(policy.worth(day_old, 0.0) / 2)


def test_cost_weighs_each_identitys_tokens_by_its_prefill_cost() -> None:
    """A token of a model that prefills slowly saves more: with ten times the cost per token,
    a tenth of the tokens per byte is worth as much; less than that goes first."""
    costs = {"big-model": 0.010, "small-model": 0.001}
    big = entry(100, tokens=50, identity="big-model")
    small = entry(100, tokens=400, identity="small-model")
    policy = CostPolicy(costs.__getitem__, clock=lambda: 1000.0, seed=1)
    for record in (big, small):
        policy.add(record)
    assert policy.select_victims(1) == [small]
    assert policy.worth(big, 1000.0) == pytest.approx(policy.worth(small, 1000.0) * 50 / 40)


def test_cost_counts_an_entrys_shared_blocks_as_its_bytes() -> None:
    """Two manifests over the same 4 shared blocks, their tails of 10 and 200 tokens: what
    each saves per byte is alike, however small its own file. Counting its file alone would
    make the short tail look twenty times as dense."""
    blocks = tuple(bytes([i]) * 16 for i in range(4))
    short = entry(10, tokens=1034)
    long = entry(200, tokens=1224)
    for record in (short, long):
        record.block_hashes, record.block_size = blocks, 1000
    policy = _cost_policy(short, long)
    ratio = policy.worth(short, 1000.0) / policy.worth(long, 1000.0)
    assert ratio == pytest.approx((1034 / 4010) / (1224 / 4200))
    assert 0.8 < ratio < 1.2


def test_cost_never_evicts_pending_or_leased_entries() -> None:
    pending = entry(100, tokens=1, durable=False)
    leased = entry(100, tokens=1, leases=1)
    kept = entry(100, tokens=1000)
    assert _cost_policy(pending, leased, kept).select_victims(300) == [kept]


def test_cost_samples_a_large_tier_and_still_frees_what_is_asked() -> None:
    records = [entry(100, tokens=1 + i % 50) for i in range(1000)]
    policy = _cost_policy(*records)
    victims = policy.select_victims(100 * 30)
    assert len(victims) == len(set(victims)) == 30
    # Each victim is the least worth of a sample of 64: far down the tier's order.
    worst_half = sorted(records, key=lambda r: policy.worth(r, 1000.0))[:500]
    assert sum(v in worst_half for v in victims) >= 25


def test_cost_forgets_removed_entries() -> None:
    first, second, third = (entry(100, tokens=t) for t in (1, 2, 3))
    policy = _cost_policy(first, second, third)
    policy.remove(first)
    assert len(policy) == 2
    assert policy.select_victims(100) == [second]
    with pytest.raises(ValueError, match="already tracked"):
        policy.add(second)


# What the cost policy weighs by: the engines' reports (Telemetry.prefill_cost)


def test_prefill_costs_are_a_running_mean_per_identity_and_the_mean_stands_in() -> None:
    telemetry = Telemetry()
    big = Identity("big", "cfg", "tok", "codecs/1", "mlx/cpu")
    small = Identity("small", "cfg", "tok", "codecs/1", "mlx/cpu")
    unreported = Identity("other", "cfg", "tok", "codecs/1", "mlx/cpu").digest()
    assert telemetry.prefill_cost(unreported) == DEFAULT_PREFILL_COST
    telemetry.prefill_reported(big, 0.010)
    telemetry.prefill_reported(big, 0.0)  # not measured: ignored
    assert telemetry.prefill_cost(big.digest()) == 0.010
    telemetry.prefill_reported(big, 0.020)  # one slow prefill moves it by a fifth
    assert telemetry.prefill_cost(big.digest()) == pytest.approx(0.012)
    telemetry.prefill_reported(small, 0.002)
    assert telemetry.prefill_cost(unreported) == pytest.approx((0.012 + 0.002) / 2)
    assert telemetry.of(big.digest()).report(0.0)["prefill_ms_per_token"] == pytest.approx(12.0)
