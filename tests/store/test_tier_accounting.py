"""The tier's accounting against a real directory: files gone or added behind the daemon's
back, files of entries waiting for their last lease, entries dropped mid-write."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
from entry_samples import IDENTITY, write
from kvd_protocol import LayerSpec, TensorSpec, plan_entry
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

from kvd.config import Config
from kvd.store import entry_files
from kvd.store.miss_reasons import Miss
from kvd.store.tier import Tier
from kvd.store.tier_dir import TierDir, new_entry_id
from kvd.store.watcher import reconcile
from kvd.store.writeback import Outcome


def put_file(dirs: TierDir, first: int) -> Path:
    """A valid entry file of its own tokens, dropped straight into the tier."""
    spec = TensorSpec("float16", (1, 2, 16, 8))
    layer = LayerSpec("kv", (spec, spec), trimmable=False)
    plan = plan_entry(IDENTITY, pack_tokens([first, *range(15)]), [layer], created=1.0, min_reuse=0)
    blob, _ = write(plan)
    path = dirs.entry_path(IDENTITY.digest(), new_entry_id())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return path


def test_reconcile_follows_the_directory_but_spares_leased_files(tmp_path: Path) -> None:
    config = Config(dir=tmp_path / "tier", socket=tmp_path / "kvd.sock", min_free=0)
    dirs = TierDir(config.dir)
    dirs.create()
    kept, leased, removed = (put_file(dirs, first) for first in (1, 2, 3))

    async def scenario() -> None:
        tier = Tier(config, DEFAULT_LIMITS)
        await tier.life.open()
        try:
            assert set(tier.catalog.records) == {kept.stem, leased.stem, removed.stem}
            # A reader holds `leased` while it is evicted: its file stays, out of the index.
            found = tier.reads.lookup(1, IDENTITY, pack_tokens([2, *range(15), 99]))
            tier.reads.book_lookups()
            assert not isinstance(found, Miss)
            match, _, fd = found
            os.close(fd)
            assert match.record.id == leased.stem
            assert tier.admin.evict(leased.stem, None, everything=False) == (1, match.record.nbytes)
            assert leased.exists()
            assert tier.catalog.is_doomed(leased.stem)

            removed.unlink()
            added = put_file(dirs, 4)
            await reconcile(tier.life, None)

            assert set(tier.catalog.records) == {kept.stem, added.stem}  # leased not re-adopted
            assert leased.exists()
            assert tier.catalog.total_bytes == sum(p.stat().st_size for p in (kept, added, leased))
        finally:
            tier.life.close()

    anyio.run(scenario)


def test_an_entry_dropped_while_its_write_is_under_way_is_counted_once(tmp_path: Path) -> None:
    """The writer renames the staging file into place; meanwhile the entry is dropped (a
    stored descendant superseded it). Its bytes leave the count once, and no file is left."""
    config = Config(dir=tmp_path / "tier", socket=tmp_path / "kvd.sock", min_free=0)
    spec = TensorSpec("float16", (1, 2, 16, 8))
    plan = plan_entry(
        IDENTITY,
        pack_tokens(range(16)),
        [LayerSpec("kv", (spec, spec), trimmable=True)],
        created=time.time(),  # committed: a creation time the daemon can age it by
        min_reuse=0,
    )
    blob, _ = write(plan)

    async def scenario() -> None:
        tier = Tier(config, DEFAULT_LIMITS)
        await tier.life.open()
        try:
            put, _, fd = await tier.puts.begin(1, IDENTITY, pack_tokens(range(16)), plan.file_size)
            assert put is not None
            assert fd is not None
            os.pwrite(fd, blob, 0)
            os.close(fd)
            await tier.puts.commit_owned(1, put.id)
            item = tier.writer.queue.next()  # the writer takes it...
            assert item is not None
            record = item.payload.record
            final = tier.dirs.entry_path(record.digest, record.id)
            entry_files.persist(item.payload.staging, final)  # ...and renames it into place
            tier.catalog.drop(record)  # superseded meanwhile
            assert tier.catalog.total_bytes == 0
            tier.writer.finish(item, Outcome.STORED, None)  # the writer's continuation
            assert tier.catalog.total_bytes == 0
            tier.catalog.deleter.wait_idle()
            assert not final.exists()
        finally:
            tier.life.close()

    anyio.run(scenario)


def test_a_duplicate_file_found_at_start_is_quarantined(tmp_path: Path) -> None:
    config = Config(dir=tmp_path / "tier", socket=tmp_path / "kvd.sock", min_free=0)
    dirs = TierDir(config.dir)
    dirs.create()
    first, second = put_file(dirs, 7), put_file(dirs, 7)  # same identity, same tokens

    async def scenario() -> None:
        tier = Tier(config, DEFAULT_LIMITS)
        await tier.life.open()
        try:
            assert len(tier.catalog.records) == 1
            (kept,) = tier.catalog.records
            assert kept in (first.stem, second.stem)
            assert (
                tier.catalog.total_bytes
                == tier.catalog.path_of(tier.catalog.records[kept]).stat().st_size
            )
            assert tier.catalog.counters.quarantined == 1
            assert len(list(dirs.quarantine.iterdir())) == 1
        finally:
            tier.life.close()

    anyio.run(scenario)
