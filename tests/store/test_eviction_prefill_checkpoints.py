"""The eviction rule of kvd.store.eviction, policy by policy: a prefill checkpoint no prompt has
restored from yet is evicted before whole entries of the same size and use (it counts
PREFILL_CHECKPOINT_DISCOUNT times less); once used, it ages as a whole entry."""

from __future__ import annotations

import itertools

import pytest
from kvd_protocol.tokens import pack_tokens

from kvd.store.eviction import PREFILL_CHECKPOINT_DISCOUNT, CostPolicy, LruPolicy
from kvd.store.records import EntryRecord

_ids = itertools.count()


def entry(
    *,
    prefill_checkpoint: bool = False,
    nbytes: int = 100,
    tokens: int = 100,
    used_at: float = 0.0,
    leases: int = 0,
    identity: str = "id",
) -> EntryRecord:
    """A durable record; a prefill checkpoint is untrimmable, as the tier records it."""
    n = next(_ids)
    return EntryRecord(
        id=f"e{n}",
        digest=identity,
        tokens=pack_tokens([n, *range(tokens - 1)]),
        nbytes=nbytes,
        trimmable=not prefill_checkpoint,
        durable=True,
        leases=leases,
        created=used_at,
        used_at=used_at,
        prefill_checkpoint=prefill_checkpoint,
    )


_clock = itertools.count(1)  # the catalog's logical clock: each put and each hit ticks


def lru(*records: EntryRecord) -> LruPolicy:
    """The records added in order, each put at the next tick, as the catalog does."""
    policy = LruPolicy()
    for record in records:
        record.last_used = next(_clock)
        policy.add(record)
    return policy


def use(policy: LruPolicy, record: EntryRecord) -> None:
    """A lookup answered with record, as the tier books it: a touch, then the next tick."""
    policy.touch(record)
    record.last_used = next(_clock)


def whole_and_checkpoint() -> tuple[EntryRecord, EntryRecord]:
    return entry(), entry(prefill_checkpoint=True)


# LruPolicy


@pytest.mark.parametrize("checkpoint_first", [True, False], ids=["older", "newer"])
def test_lru_evicts_a_prefill_checkpoint_before_a_whole_entry_of_the_same_size_and_use(
    checkpoint_first: bool,
) -> None:
    """Added one after the other (the nearest two uses can be) and never used since: the
    prefill checkpoint goes first, whether it is the older of the two or the newer."""
    whole, checkpoint = whole_and_checkpoint()
    policy = lru(checkpoint, whole) if checkpoint_first else lru(whole, checkpoint)
    assert policy.select_victims(1) == [checkpoint]
    assert policy.select_victims(200) == [checkpoint, whole]


def test_lru_counts_a_prefill_checkpoints_age_twice() -> None:
    """A whole entry of age 5 (ticks since its last use, plus one) against a prefill
    checkpoint of age 2 (4 as counted) or 3 (6 as counted): the larger counted age goes
    first."""
    assert PREFILL_CHECKPOINT_DISCOUNT == 2
    whole, checkpoint, others = entry(), entry(prefill_checkpoint=True), [entry() for _ in range(3)]
    policy = lru(whole, *others[:2], checkpoint, others[2])
    now = policy.now()
    assert (policy.age(whole, now), policy.age(checkpoint, now)) == (5, 4)
    assert policy.select_victims(1) == [whole]
    policy = lru(whole, others[0], checkpoint, *others[1:])
    now = policy.now()
    assert (policy.age(whole, now), policy.age(checkpoint, now)) == (5, 6)
    assert policy.select_victims(1) == [checkpoint]


def test_lru_keeps_a_prefill_checkpoint_used_recently_over_an_old_whole_entry() -> None:
    whole, checkpoint = whole_and_checkpoint()
    policy = lru(whole, checkpoint, *(entry() for _ in range(4)))
    assert policy.select_victims(1) == [checkpoint]
    use(policy, checkpoint)
    assert policy.select_victims(1) == [whole]


def test_lru_ages_a_prefill_checkpoint_a_prompt_restored_from_as_a_whole_entry() -> None:
    """Waves of prompts on one document, each restoring from the document's checkpoint and
    leaving its own turns: the checkpoint outlives the turns of the wave before, which no
    prompt uses, though it was used before they were put (counted twice, it would not)."""
    document = entry(prefill_checkpoint=True)
    policy = lru(document)
    use(policy, document)  # the first wave restores from it ...
    earlier = [entry(), entry()]
    for record in earlier:  # ... and leaves its turns
        record.last_used = next(_clock)
        policy.add(record)
    use(policy, document)  # the next wave restores from it
    later = entry()
    later.last_used = next(_clock)
    policy.add(later)
    now = policy.now()
    assert policy.age(document, now) < policy.age(earlier[0], now)
    assert PREFILL_CHECKPOINT_DISCOUNT * policy.age(document, now) >= policy.age(earlier[0], now)
    assert policy.select_victims(200) == earlier


def test_lru_takes_a_checkpoint_unused_since_a_restart_as_speculative_again() -> None:
    """The policy learns uses from touches (and used_at, the first use since the start): a
    checkpoint loaded again after a restart counts less until a prompt uses it."""
    whole, checkpoint = whole_and_checkpoint()
    policy = lru(checkpoint, whole)
    use(policy, checkpoint)
    assert policy.select_victims(1) == [whole]
    restarted = lru(whole, checkpoint)  # loaded in the order of their last use, used_at 0
    assert restarted.select_victims(1) == [checkpoint]


def test_lru_keeps_the_prefill_checkpoints_a_burst_of_prompts_uses() -> None:
    """A burst of puts, each prompt's checkpoints new, a few of the old ones hit on the way:
    those hit outlive the ones never used, which go first, oldest first."""
    used, unused = [entry(prefill_checkpoint=True) for _ in range(4)], []
    policy = lru(*used)
    for _ in range(3):
        for _ in range(4):
            unused.append(entry(prefill_checkpoint=True))
            unused[-1].last_used = next(_clock)
            policy.add(unused[-1])
        for record in used:
            use(policy, record)
    victims = policy.select_victims(100 * len(unused))
    assert victims == unused


def test_lru_skips_a_leased_or_pending_prefill_checkpoint_and_takes_the_whole_entry() -> None:
    whole = entry()
    leased = entry(prefill_checkpoint=True, leases=1)
    pending = entry(prefill_checkpoint=True)
    pending.durable = False
    policy = lru(leased, pending, whole)
    assert policy.select_victims(1000) == [whole]


def test_lru_merges_the_two_orders_within_one_identity() -> None:
    """A quota's selection (among) takes that identity's entries only, still by the rule."""
    theirs = entry(prefill_checkpoint=True, identity="other")
    whole, checkpoint = entry(identity="mine"), entry(prefill_checkpoint=True, identity="mine")
    policy = lru(theirs, whole, checkpoint)
    victims = policy.select_victims(1000, lambda r: r.digest == "mine")
    assert victims == [checkpoint, whole]


def test_lru_forgets_a_removed_prefill_checkpoint() -> None:
    whole, checkpoint = whole_and_checkpoint()
    policy = lru(whole, checkpoint)
    policy.remove(checkpoint)
    assert len(policy) == 1
    assert policy.select_victims(1000) == [whole]
    with pytest.raises(KeyError):
        policy.touch(checkpoint)
    with pytest.raises(ValueError, match="already tracked"):
        policy.add(whole)


# CostPolicy


def test_cost_values_a_prefill_checkpoint_at_a_fraction_of_a_whole_entry() -> None:
    """Same tokens, bytes and idle time: the prefill checkpoint is worth half, and goes first,
    whichever was added first."""
    whole, checkpoint = whole_and_checkpoint()
    for order in ((whole, checkpoint), (checkpoint, whole)):
        policy = CostPolicy(clock=lambda: 1000.0, seed=1)
        for record in order:
            policy.add(record)
        assert policy.worth(checkpoint, 1000.0) == pytest.approx(
            policy.worth(whole, 1000.0) / PREFILL_CHECKPOINT_DISCOUNT
        )
        assert policy.select_victims(1) == [checkpoint]


def test_cost_values_a_used_prefill_checkpoint_as_a_whole_entry() -> None:
    whole = entry(used_at=900.0)
    checkpoint = entry(prefill_checkpoint=True, used_at=900.0)  # a prompt restored from it
    policy = CostPolicy(clock=lambda: 1000.0, seed=1)
    policy.add(checkpoint)
    policy.add(whole)
    assert policy.worth(checkpoint, 1000.0) == pytest.approx(policy.worth(whole, 1000.0))


def test_cost_keeps_a_prefill_checkpoint_worth_more_than_a_whole_entry() -> None:
    """The rule weighs the kind, it does not override worth: a prefill checkpoint holding
    four times the tokens per byte outranks a whole entry."""
    whole = entry(tokens=100)
    checkpoint = entry(prefill_checkpoint=True, tokens=400)
    policy = CostPolicy(clock=lambda: 1000.0, seed=1)
    policy.add(checkpoint)
    policy.add(whole)
    assert policy.select_victims(1) == [whole]


def test_cost_skips_leased_prefill_checkpoints() -> None:
    whole = entry()
    leased = entry(prefill_checkpoint=True, leases=1)
    policy = CostPolicy(clock=lambda: 1000.0, seed=1)
    policy.add(leased)
    policy.add(whole)
    assert policy.select_victims(1000) == [whole]
