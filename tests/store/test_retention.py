"""The retention rule alone (kvd.store.retention): Retaining over each eviction policy, on
records, with a clock the test moves."""

from __future__ import annotations

import itertools

import pytest
from kvd_protocol.messages import Retention
from kvd_protocol.tokens import pack_tokens

from kvd.store.eviction import EVICTION_POLICIES
from kvd.store.records import EntryRecord
from kvd.store.retention import Retaining, owner_of

_ids = itertools.count()
SIZE = 100
TENANT_A, TENANT_B = "uid:1001/", "uid:1002/"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def record(digest: str = "own", nbytes: int = SIZE) -> EntryRecord:
    n = next(_ids)
    return EntryRecord(
        id=f"e{n}",
        digest=digest,
        tokens=pack_tokens([n]),
        nbytes=nbytes,
        trimmable=True,
        durable=True,
        last_used=n,
        created=1.0,
    )


def namespaces(digest: str) -> str | None:
    """Identities named after their tenant: "uid:1001/..." is tenant A's."""
    return digest if digest.startswith("uid:") else ""


@pytest.fixture(params=sorted(EVICTION_POLICIES))
def retaining(request: pytest.FixtureRequest) -> tuple[Retaining, Clock]:
    clock = Clock()
    policy = EVICTION_POLICIES[request.param](lambda digest: 1.0)
    return Retaining(policy, max_retention=86_400.0, namespace_of=namespaces, clock=clock), clock


def added(retaining: Retaining, *records: EntryRecord) -> list[EntryRecord]:
    for each in records:
        retaining.add(each)
    return list(records)


def test_an_unretained_entry_of_the_same_size_and_use_goes_before_a_retained_one(
    retaining: tuple[Retaining, Clock],
) -> None:
    policy, _ = retaining
    older, newer = added(policy, record(), record())
    policy.retain(older, Retention(seconds=60))
    assert policy.select_victims(SIZE) == [newer]


def test_with_no_retention_the_policy_alone_decides(retaining: tuple[Retaining, Clock]) -> None:
    policy, _ = retaining
    entries = added(policy, record(), record(), record())
    assert policy.select_victims(3 * SIZE) == policy.policy.select_victims(3 * SIZE)
    assert set(policy.select_victims(3 * SIZE)) == set(entries)


def test_retained_entries_alone_over_go_lowest_priority_then_soonest_end(
    retaining: tuple[Retaining, Clock],
) -> None:
    policy, _ = retaining
    high, soon, late = added(policy, record(), record(), record())
    policy.retain(high, Retention(seconds=10, priority=5))
    policy.retain(soon, Retention(seconds=10))
    policy.retain(late, Retention(seconds=1000))
    assert policy.select_victims(SIZE) == [soon]
    assert policy.select_victims(2 * SIZE) == [soon, late]
    assert policy.select_victims(3 * SIZE) == [soon, late, high]


def test_a_retention_ends_and_is_forgotten(retaining: tuple[Retaining, Clock]) -> None:
    policy, clock = retaining
    retained, other = added(policy, record(), record())
    policy.retain(retained, Retention(seconds=60))
    assert policy.retained_bytes() == {"own": SIZE}
    clock.now += 61
    assert policy.retained_bytes() == {}
    assert retained.retained is None
    assert set(policy.select_victims(SIZE)) <= {retained, other}  # the policy's choice again


def test_a_use_renews_a_retention_that_lasts(retaining: tuple[Retaining, Clock]) -> None:
    policy, clock = retaining
    (retained,) = added(policy, record())
    policy.retain(retained, Retention(seconds=60))
    clock.now += 50
    policy.touch(retained)
    assert retained.retained is not None
    assert retained.retained.until == clock.now + 60
    clock.now += 50
    assert policy.retained_bytes() == {"own": SIZE}


def test_a_retention_is_cut_to_max_retention_and_none_of_no_seconds(
    retaining: tuple[Retaining, Clock],
) -> None:
    policy, clock = retaining
    long, nothing = added(policy, record(), record())
    policy.retain(long, Retention(seconds=30 * 86_400.0))
    policy.retain(nothing, Retention(seconds=0))
    assert long.retained is not None
    assert long.retained.until == clock.now + 86_400.0
    assert nothing.retained is None


def test_a_second_retention_keeps_the_later_end_and_the_higher_priority(
    retaining: tuple[Retaining, Clock],
) -> None:
    policy, clock = retaining
    (held,) = added(policy, record())
    policy.retain(held, Retention(seconds=3600, priority=1))
    policy.retain(held, Retention(seconds=60, priority=7))
    assert held.retained is not None
    assert (held.retained.until, held.retained.priority) == (clock.now + 3600, 7)


def test_a_tenants_retentions_never_push_out_another_tenants_entries(
    retaining: tuple[Retaining, Clock],
) -> None:
    """Tenant A's entries are the oldest (each policy names them first: same worth, the
    first added) and all retained: A loses them, tenant B keeps its newer, unretained ones."""
    policy, _ = retaining
    a_first, a_second = added(policy, record(TENANT_A + "m"), record(TENANT_A + "m"))
    added(policy, record(TENANT_B + "m"), record(TENANT_B + "m"))
    for each in (a_first, a_second):
        policy.retain(each, Retention(seconds=600))
    assert policy.policy.select_victims(2 * SIZE) == [a_first, a_second]
    assert policy.select_victims(2 * SIZE) == [a_first, a_second]


def test_within_a_tenant_retention_picks_which_entries_go(
    retaining: tuple[Retaining, Clock],
) -> None:
    policy, _ = retaining
    retained, unretained = added(policy, record(TENANT_A + "m"), record(TENANT_A + "m"))
    policy.retain(retained, Retention(seconds=600))
    assert policy.select_victims(SIZE) == [unretained]


def test_leased_and_pending_retained_entries_are_never_chosen(
    retaining: tuple[Retaining, Clock],
) -> None:
    policy, _ = retaining
    leased, pending = added(policy, record(), record())
    leased.leases, pending.durable = 1, False
    for each in (leased, pending):
        policy.retain(each, Retention(seconds=600))
    assert policy.select_victims(SIZE) == []


@pytest.mark.parametrize(
    ("namespace", "owner"),
    [("", ""), (None, ""), ("team", ""), ("uid:1001/", "uid:1001/"), ("uid:7/a/b", "uid:7/")],
)
def test_an_entrys_owner_is_its_namespaces_tenant(namespace: str | None, owner: str) -> None:
    assert owner_of(namespace) == owner


def test_retained_bytes_are_counted_per_identity(retaining: tuple[Retaining, Clock]) -> None:
    policy, _ = retaining
    a, b, _unretained = added(policy, record("x"), record("y", 3 * SIZE), record("x"))
    for each in (a, b):
        policy.retain(each, Retention(seconds=60))
    assert policy.retained_bytes() == {"x": SIZE, "y": 3 * SIZE}
    policy.remove(b)
    assert policy.retained_bytes() == {"x": SIZE}
