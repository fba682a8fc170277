"""The block store's refs, pins, collection and bytes, kept by the catalog as manifests come
and go, against a recount over the records and the block files really on disk."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_protocol.tokens import pack_tokens

from kvd.store.blocks import Block, BlockStore
from kvd.store.catalog import Catalog
from kvd.store.deleter import Deleter
from kvd.store.eviction import Eviction, LruPolicy
from kvd.store.leases import Leases
from kvd.store.records import EntryRecord
from kvd.store.tier_dir import TierDir, new_entry_id

DIGESTS = ("a" * 32, "b" * 32)
BLOCK_SIZE = 10
MANIFEST_SIZE = 3


def chain(branch: int, count: int) -> list[bytes]:
    """count hashes of one branch: branch 0 is the prefix every entry may share."""
    return [bytes([branch, index]) * 8 for index in range(count)]


# One step: a put (identity, shared blocks, own blocks, first token) that either commits at
# once or stays begun (its held blocks pinned); the end of the n-th begun put (committed or
# aborted); drop, lease, release as in test_catalog; evicting down to a cap in blocks.
STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.sampled_from(DIGESTS),
            st.integers(0, 5),
            st.integers(0, 2),
            st.integers(0, 30),
            st.booleans(),
        ),
        st.tuples(st.just("end"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("drop"), st.integers(0, 50)),
        st.tuples(st.just("lease"), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
    ),
    max_size=60,
)


class Begun:
    """A put begun: its record, the blocks it was told are held (pinned), its staged files."""

    def __init__(self, catalog: Catalog, staging: Path, record: EntryRecord) -> None:
        store = catalog.block_store
        held = store.count_held(record.digest, record.block_hashes)
        self.record = record
        self.pinned = store.pin(record.digest, record.block_hashes[:held])
        self.staged: dict[bytes, Path] = {}
        for block_hash in record.block_hashes[held:]:
            path = staging / f"{new_entry_id()}.tmp"
            path.write_bytes(bytes(BLOCK_SIZE))
            self.staged[block_hash] = path

    def commit(self, catalog: Catalog) -> None:
        try:
            catalog.add(self.record, staged_blocks=self.staged)
        except ValueError:  # the same tokens in the same identity: the put is refused
            self.abort(catalog)
            return
        catalog.block_store.unpin(self.pinned)

    def abort(self, catalog: Catalog) -> None:
        for path in self.staged.values():
            path.unlink()
        catalog.block_store.unpin(self.pinned)


def check(catalog: Catalog, kept: list[EntryRecord], begun: list[Begun], staging: Path) -> None:
    """Every count against a recount: refs by the manifests that hold bytes (indexed and
    doomed), pins by the begun puts, bytes by the files (once the deleter is idle)."""
    catalog.deleter.wait_idle()
    store = catalog.block_store
    blocks = list(store)
    for block in blocks:
        assert block.refs == sum(block in catalog.blocks_of(r) for r in kept), block
        assert block.pins == sum(block in b.pinned for b in begun), block
        assert block.refs or block.pins, f"{block} is neither listed nor pinned: not collected"
        listing = {r for r in catalog.records.values() if block in catalog.blocks_of(r)}
        assert set(catalog.listing(block)) == listing
        assert block.path.stat().st_size == block.size
    for record in kept:
        listed = catalog.blocks_of(record)
        assert [b.hash for b in listed] == list(record.block_hashes)
        assert all(store.get(record.digest, b.hash) is b for b in listed), "a kept block went"
    on_disk = {p for p in staging.iterdir()}
    staged = {p for b in begun for p in b.staged.values()}
    assert on_disk == {b.path for b in blocks} | staged, "a file no block or put owns"
    assert store.bytes == sum(b.size for b in blocks) == BLOCK_SIZE * len(blocks)
    assert len(store) == len(blocks)
    for digest in DIGESTS:
        mine = [b for b in blocks if b.digest == digest]
        manifests = sum(r.nbytes for r in catalog.records.values() if r.digest == digest)
        assert catalog.identity_bytes(digest) == manifests + BLOCK_SIZE * len(mine)
    assert catalog.total_bytes == sum(r.nbytes for r in kept) + store.bytes
    assert catalog.logical_bytes == sum(r.nbytes + len(r.block_hashes) * BLOCK_SIZE for r in kept)


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_refs_pins_and_bytes_follow_every_change(steps: list[tuple[object, ...]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        staging = Path(folder) / "staging"
        staging.mkdir()
        catalog = Catalog(TierDir(Path(folder)), LruPolicy())
        leases = Leases(catalog)
        held: list[tuple[int, EntryRecord]] = []
        begun: list[Begun] = []
        doomed: dict[str, EntryRecord] = {}
        for step in steps:
            live = list(catalog.records.values())
            match step:
                case ("put", str(digest), int(shared), int(own), int(first), bool(at_once)):
                    record = EntryRecord(
                        new_entry_id(),
                        digest,
                        pack_tokens([first, shared, own]),
                        MANIFEST_SIZE,
                        trimmable=False,
                        durable=True,
                        block_hashes=(*chain(0, shared), *chain(first + 1, own)),
                        block_size=BLOCK_SIZE,
                    )
                    put = Begun(catalog, staging, record)
                    if at_once:
                        put.commit(catalog)
                    else:
                        begun.append(put)
                case ("end", int(n), bool(commit)) if begun:
                    put = begun.pop(n % len(begun))
                    put.commit(catalog) if commit else put.abort(catalog)
                case ("drop", int(n)) if live:
                    record = live[n % len(live)]
                    catalog.drop(record)
                    if record.leases:
                        doomed[record.id] = record
                case ("lease", int(n)) if live:
                    record = live[n % len(live)]
                    held.append((leases.grant(1, record), record))
                case ("release", int(n)) if held:
                    lease, _ = held.pop(n % len(held))
                    leases.release(1, lease)
                case ("evict", int(cap_blocks)):
                    Eviction(catalog, cap_blocks * BLOCK_SIZE, 0).to_cap()
                    leased = [r for _, r in held]
                    assert all(r.id in catalog.records or r.id in doomed for r in leased)
                    evictable = [r for r in catalog.records.values() if not r.leases]
                    assert catalog.total_bytes <= cap_blocks * BLOCK_SIZE or not evictable
            doomed = {i: r for i, r in doomed.items() if r.leases}
            kept = [*catalog.records.values(), *doomed.values()]
            check(catalog, kept, begun, staging)


def test_eviction_frees_what_it_measures_not_what_the_policy_guesses(tmp_path: Path) -> None:
    """Ten manifests of 3 bytes each listing one shared block of 10 and one own block: a cap
    that wants 35 bytes freed takes three of them (13 bytes each), not twelve (3 bytes each),
    and the shared block stays until the last manifest that lists it goes."""
    (tmp_path / "staging").mkdir()
    catalog = Catalog(TierDir(tmp_path), LruPolicy())
    for n in range(10):
        record = EntryRecord(
            new_entry_id(),
            DIGESTS[0],
            pack_tokens([n]),
            MANIFEST_SIZE,
            trimmable=False,
            durable=True,
            block_hashes=(*chain(0, 1), *chain(n + 1, 1)),
            block_size=BLOCK_SIZE,
        )
        Begun(catalog, tmp_path / "staging", record).commit(catalog)
    assert catalog.total_bytes == 10 * 3 + 11 * 10
    assert catalog.logical_bytes == 10 * (3 + 2 * 10)
    Eviction(catalog, catalog.total_bytes - 35, 0).to_cap()
    assert len(catalog) == 7
    assert catalog.counters.evicted_bytes == 3 * 13
    shared = catalog.block_store.get(DIGESTS[0], chain(0, 1)[0])
    assert shared is not None
    assert shared.refs == 7
    Eviction(catalog, 0, 0).to_cap()
    assert len(catalog) == 0
    assert len(catalog.block_store) == 0
    assert catalog.total_bytes == 0
    catalog.deleter.wait_idle()
    assert list((tmp_path / "staging").iterdir()) == []


def test_a_block_neither_held_nor_written_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    catalog = Catalog(TierDir(tmp_path), LruPolicy())
    record = EntryRecord(
        new_entry_id(),
        DIGESTS[0],
        pack_tokens([1]),
        MANIFEST_SIZE,
        trimmable=True,
        block_hashes=tuple(chain(0, 2)),
        block_size=BLOCK_SIZE,
    )
    with pytest.raises(KeyError, match="neither held nor written"):
        catalog.add(record)
    assert len(catalog) == 0
    assert catalog.index(DIGESTS[0]) is None
    assert catalog.total_bytes == 0
    assert len(catalog.block_store) == 0


def test_a_forgotten_block_is_not_the_one_of_its_hash_that_joins_later(tmp_path: Path) -> None:
    """A block quarantined while a doomed manifest still lists it: the manifest's last lease
    later takes no ref from a new block of the same hash."""
    deleter = Deleter(tmp_path / "deleting")
    store = BlockStore(deleter)
    (block_hash,) = chain(0, 1)
    old_path, new_path = tmp_path / "old", tmp_path / "new"
    old_path.write_bytes(b"x")
    new_path.write_bytes(b"y")
    (old,) = store.attach(DIGESTS[0], [block_hash], 1, {block_hash: old_path})
    store.forget(old)
    (new,) = store.attach(DIGESTS[0], [block_hash], 1, {block_hash: new_path})
    store.detach([old])
    assert store.get(DIGESTS[0], block_hash) is new
    assert new.refs == 1
    assert new_path.exists()
    assert store.bytes == 1
    store.detach([new])
    deleter.wait_idle()
    assert not new_path.exists()
    assert store.bytes == 0
    assert isinstance(new, Block)
