"""The catalog's counts, kept up as entries come and go, against walks over its records."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_protocol.tokens import pack_tokens

from kvd.store.catalog import Catalog
from kvd.store.eviction import LruPolicy
from kvd.store.leases import Leases
from kvd.store.records import EntryRecord
from kvd.store.tier_dir import TierDir, new_entry_id

DIGESTS = ("a" * 32, "b" * 32, "c" * 32)

# One step: add an entry (identity, first token, size), drop the n-th live one, lease the n-th
# live one for an owner, release the n-th lease, or end an owner's connection.
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(DIGESTS), st.integers(0, 30), st.integers(1, 9)),
        st.tuples(st.just("drop"), st.integers(0, 50)),
        st.tuples(st.just("lease"), st.integers(0, 50), st.integers(1, 3)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("close"), st.integers(1, 3)),
        st.tuples(  # entries found on disk, indexed at once (start-up)
            st.just("found"),
            st.lists(
                st.tuples(st.sampled_from(DIGESTS), st.integers(0, 30), st.integers(1, 9)),
                max_size=8,
            ),
        ),
    ),
    max_size=60,
)


def check(catalog: Catalog, doomed: dict[str, EntryRecord]) -> None:
    live = list(catalog.records.values())
    expected: dict[str, tuple[int, int]] = {}
    for r in live:
        entries, nbytes = expected.get(r.digest, (0, 0))
        expected[r.digest] = (entries + 1, nbytes + r.nbytes)
    assert [(d, (c.entries, c.bytes)) for d, c in catalog.identities()] == sorted(expected.items())
    assert catalog.leased == sum(1 for r in [*live, *doomed.values()] if r.leases)
    assert catalog.total_bytes == sum(r.nbytes for r in [*live, *doomed.values()])
    ids = sorted(catalog.records)
    for after in [None, *ids[::3]]:
        page, more = catalog.page(None, after, 4)
        following = [i for i in ids if after is None or i > after]
        assert [r.id for r in page] == following[:4]
        assert more == (len(following) > 4)
    for digest in DIGESTS:
        page, more = catalog.page(digest, None, 2)
        mine = sorted(r.id for r in live if r.digest == digest)
        assert [r.id for r in page] == mine[:2]
        assert more == (len(mine) > 2)
        assert [r.id for r in catalog.of_identity(digest)] == mine
        one = catalog.an_entry(digest)
        assert one.id in mine if one is not None else not mine


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_counts_follow_every_change(steps: list[tuple[object, ...]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        catalog = Catalog(TierDir(Path(folder)), LruPolicy())
        leases = Leases(catalog)
        held: list[tuple[int, int, EntryRecord]] = []  # (owner, lease, record)
        doomed: dict[str, EntryRecord] = {}  # dropped while leased: still counted
        for step in steps:
            live = list(catalog.records.values())
            match step:
                case ("add", str(digest), int(first), int(size)):
                    record = EntryRecord(
                        new_entry_id(), digest, pack_tokens([first, 1]), size, trimmable=True
                    )
                    try:
                        catalog.add(record)
                    except ValueError:  # the same tokens in the same identity
                        assert any(r.tokens == record.tokens for r in catalog.index(digest) or [])
                case ("drop", int(n)) if live:
                    record = live[n % len(live)]
                    catalog.drop(record)
                    if record.leases:
                        doomed[record.id] = record
                case ("lease", int(n), int(owner)) if live:
                    record = live[n % len(live)]
                    held.append((owner, leases.grant(owner, record), record))
                case ("release", int(n)) if held:
                    owner, lease, record = held.pop(n % len(held))
                    leases.release(owner, lease)
                case ("close", int(owner)):
                    leases.release_all(owner)
                    held = [h for h in held if h[0] != owner]
                case ("found", list(batch)):
                    records = [
                        EntryRecord(new_entry_id(), digest, pack_tokens([first, 1]), size, True)
                        for digest, first, size in batch
                    ]
                    seen = {(r.digest, bytes(r.tokens)) for r in live}
                    duplicates = []
                    for record in records:  # the first of the same tokens joins
                        key = (record.digest, bytes(record.tokens))
                        if key in seen:
                            duplicates.append(record.id)
                        seen.add(key)
                    refused = catalog.add_found(records)
                    assert sorted(r.id for r, _ in refused) == sorted(duplicates)
            doomed = {i: r for i, r in doomed.items() if r.leases}
            assert len(leases) == len(held)
            check(catalog, doomed)


def test_entries_found_at_once_keep_their_order_of_use_across_identities(tmp_path: Path) -> None:
    catalog = Catalog(TierDir(tmp_path), LruPolicy())
    records = [
        EntryRecord(new_entry_id(), DIGESTS[n % 3], pack_tokens([n, 1]), 10, True, durable=True)
        for n in range(9)
    ]
    assert catalog.add_found(records) == []
    assert [r.last_used for r in records] == sorted(r.last_used for r in records)
    assert catalog.policy.select_victims(90) == records  # least recently used first


def test_a_forgotten_entry_leaves_its_file(tmp_path: Path) -> None:
    dirs = TierDir(tmp_path)
    catalog = Catalog(dirs, LruPolicy())
    kept, dropped = (
        EntryRecord(new_entry_id(), DIGESTS[0], pack_tokens([n, 1]), 10, True, durable=True)
        for n in range(2)
    )
    for record in (kept, dropped):
        path = dirs.entry_path(record.digest, record.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
        catalog.add(record)
    catalog.forget(kept)
    catalog.drop(dropped)
    assert len(catalog) == 0
    assert catalog.total_bytes == 0
    catalog.deleter.wait_idle()
    assert dirs.entry_path(kept.digest, kept.id).exists()
    assert not dirs.entry_path(dropped.digest, dropped.id).exists()


def test_an_entry_of_an_identity_of_checkpoints_only_is_its_first(tmp_path: Path) -> None:
    catalog = Catalog(TierDir(tmp_path), LruPolicy())
    records = [
        EntryRecord(
            entry_id, DIGESTS[0], pack_tokens([n]), 10, False, durable=True, checkpoint_key="g"
        )
        for n, entry_id in enumerate(sorted(new_entry_id() for _ in range(3)))
    ]
    catalog.add_found(records[::-1])
    assert catalog.an_entry(DIGESTS[0]) is records[0]
    assert catalog.an_entry(DIGESTS[1]) is None
