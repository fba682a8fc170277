"""The catalog's counts, kept up as entries come and go, against walks over its records."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_protocol.tokens import pack_tokens

from kvd.catalog import Catalog
from kvd.eviction import LruPolicy
from kvd.leases import Leases
from kvd.records import EntryRecord
from kvd.tier_dir import TierDir, new_entry_id

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
    ),
    max_size=60,
)


def check(catalog: Catalog, doomed: dict[str, EntryRecord]) -> None:
    live = list(catalog.records.values())
    expected: dict[str, tuple[int, int]] = {}
    for r in live:
        entries, nbytes = expected.get(r.identity, (0, 0))
        expected[r.identity] = (entries + 1, nbytes + r.nbytes)
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
        mine = sorted(r.id for r in live if r.identity == digest)
        assert [r.id for r in page] == mine[:2]
        assert more == (len(mine) > 2)
        assert [r.id for r in catalog.of_identity(digest)] == mine


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
                    held.append((owner, leases.take(owner, record), record))
                case ("release", int(n)) if held:
                    owner, lease, record = held.pop(n % len(held))
                    leases.release(owner, lease)
                case ("close", int(owner)):
                    leases.release_all(owner)
                    held = [h for h in held if h[0] != owner]
            doomed = {i: r for i, r in doomed.items() if r.leases}
            assert len(leases) == len(held)
            check(catalog, doomed)
