"""The tier's life cycle: start-up (open, then settle while the daemon serves), the tasks
that run for its life (the writer, the snapshot, the expiry of puts and leases), the files
made behind the daemon's back (adopt), a connection's end and the tier's close.

Start-up takes the directory's lock, reaps staging and indexes what is on disk: from the
snapshot, its files not yet checked (settle() lists the directory against it while the daemon
serves), or without one by reading every header (see recovery).
"""

from __future__ import annotations

import gc
import itertools
import operator
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.limits import Limits

from kvd.config import Config
from kvd.logs import get_logger
from kvd.progress import Progress
from kvd.store import entry_files, recovery, snapshot
from kvd.store.adoption import Adoption, Changed
from kvd.store.catalog import Catalog
from kvd.store.eviction import Eviction
from kvd.store.leases import Leases
from kvd.store.puts import Puts
from kvd.store.quarantine import Quarantine
from kvd.store.records import EntryRecord
from kvd.store.telemetry import Telemetry
from kvd.store.tier_dir import TierDir
from kvd.store.writer import Writer

log = get_logger("kvd.store.life_cycle")

LISTING_RETRY_S = 5.0  # start-up's listing failed (an I/O error): tried again after this


class LifeCycle:
    """The tier from its open to its close, and the tasks in between."""

    def __init__(
        self,
        config: Config,
        limits: Limits,
        dirs: TierDir,
        catalog: Catalog,
        *,
        eviction: Eviction,
        quarantine: Quarantine,
        writer: Writer,
        puts: Puts,
        leases: Leases,
        adoption: Adoption,
        telemetry: Telemetry,
    ) -> None:
        self._config = config
        self._limits = limits
        self._dirs = dirs
        self._catalog = catalog
        self._eviction = eviction
        self._quarantine = quarantine
        self._writer = writer
        self._puts = puts
        self._leases = leases
        self._adoption = adoption
        self._telemetry = telemetry
        self._lock_fd = -1
        self._snapshot_version = -1
        self._settled = anyio.Event()  # set once start-up has listed the directory (settle)
        self._unchecked: snapshot.Snapshot | None = None  # taken from it, not listed yet
        self._reaped = 0

    # --- start-up ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Take the directory, reap staging and index what is on disk: from the snapshot, its
        files not yet checked (settle() lists the directory against it while the daemon
        serves), or without one by reading every header (see recovery)."""
        self._dirs.create()
        self._lock_fd = self._dirs.lock()
        # Start-up builds one long-lived object graph and frees nothing: the collector would
        # only walk it again and again (docs/benchmarks.md, "Start-up", has what that cost).
        gc.disable()
        self._reaped = await anyio.to_thread.run_sync(recovery.reap_staging, self._dirs)
        self._catalog.deleter.reap()
        known = await anyio.to_thread.run_sync(snapshot.load_snapshot, self._dirs.snapshot)
        if known.records or known.blocks:
            blocks = self._catalog.block_store
            for row in known.blocks.values():
                path = self._dirs.block_path(row.digest, row.hash)
                blocks.adopt(row.digest, row.hash, row.size, path, row.mtime_ns)
            self._catalog.expect_mtimes(known.mtime_of)
            self._unchecked = known
            await self._index(known.records)
            log.info("snapshot_loaded", entries=len(self._catalog), blocks=len(blocks))
        else:
            # A full scan reads every header (minutes at 100k entries): counted on a terminal.
            progress = Progress("reading entry headers", None)
            try:
                listed = await anyio.to_thread.run_sync(
                    recovery.list_against, self._dirs, self._limits, known, progress.step
                )
            finally:
                progress.close()
            await self._take(listed, 0)
        gc.freeze()  # the index is long-lived: spare the collector from walking it again
        gc.enable()
        self._eviction.to_cap()
        await self._name_identities()

    async def settle(self) -> None:
        """Start-up's second half, run while the daemon serves: list the directory against the
        snapshot the tier was taken from. Its entries whose file is gone or changed leave the
        index (a changed file is read again, as is every file the snapshot does not know), and
        so do its blocks whose file is gone; from then on files are checked by size alone.
        Until then a lookup serves an entry or block of the snapshot only while its file has
        the size and mtime recorded (Catalog.expect_mtimes), so nothing is handed out that the
        listing would refuse; files added meanwhile appear when it ends. settled is set then,
        or when it fails."""
        try:
            known = self._unchecked
            if known is None:
                return
            while True:
                try:
                    listed = await anyio.to_thread.run_sync(
                        recovery.list_against, self._dirs, self._limits, known
                    )
                    break
                except OSError as exc:  # files stay checked by mtime too until a listing succeeds
                    log.warning("startup_listing_failed", error=str(exc), retry_s=LISTING_RETRY_S)
                    await anyio.sleep(LISTING_RETRY_S)
            catalog = self._catalog
            for record in itertools.compress(known.records, map(operator.not_, listed.matched)):
                if catalog.records.get(record.id) is record:
                    catalog.forget(record)
            present = {(b.digest, b.hash): b.size for b in listed.blocks}
            for block in list(catalog.block_store):
                if block.mtime_ns is None:
                    continue
                block.mtime_ns = None
                size = present.get((block.digest, block.hash))
                if size != block.size:
                    why = "its file is gone" if size is None else f"its file is now {size} bytes"
                    self._writer.bad_block(block, why)
            catalog.expect_mtimes(None)
            self._unchecked = None
            await self._take(listed, sum(listed.matched))
            self._eviction.to_cap()
        finally:  # what waits for it goes on, also when it failed
            self._settled.set()

    async def _take(self, listed: recovery.Listing, from_snapshot: int) -> None:
        """Index what a listing found beside the snapshot's rows; the tier is opened."""
        for path, reason in listed.invalid:
            await self._quarantine.file(path, reason)
        blocks = self._catalog.block_store
        leaving = self._catalog.deleter.leaving  # let go of while the listing ran
        for block in listed.blocks:
            if blocks.get(block.digest, block.hash) is None and not leaving(block.path):
                blocks.adopt(block.digest, block.hash, block.size, block.path)
        found = self._catalog.dirs.entry_path
        await self._index([r for r in listed.found if not leaving(found(r.digest, r.id))])
        orphans = blocks.collect_orphans()  # of puts a crash cut off
        log.info(
            "tier_opened",
            dir=str(self._dirs.root),
            entries=len(self._catalog),
            bytes=self._catalog.total_bytes,
            blocks=len(blocks),
            orphan_blocks=orphans,
            reaped=self._reaped,
            quarantined=len(listed.invalid),
            from_snapshot=from_snapshot,
        )
        self._settled.set()

    async def _index(self, records: Sequence[EntryRecord]) -> None:
        """Index entries found on disk, least recently used first; those that cannot be
        served (a block missing, the same tokens as another) are quarantined."""
        catalog = self._catalog
        for record, problem in catalog.add_found(records):
            await self._quarantine.file(catalog.path_of(record), problem)

    async def _name_identities(self) -> None:
        """Learn each identity's names for people (model id, namespace) from one of its
        entries' headers: status names models, not digests, before any engine comes."""
        for digest, _ in self._catalog.identities():
            record = self._catalog.an_entry(digest)
            if record is None:
                continue
            path = self._catalog.path_of(record)
            try:
                header = await anyio.to_thread.run_sync(entry_files.read_header, path, self._limits)
            except (OSError, EntryFormatError) as exc:
                log.info("identity_unnamed", identity=digest, error=str(exc))
                continue
            self._telemetry.seen(header.identity)

    # --- the snapshot and the periodic tasks ------------------------------------------------

    async def save_snapshot(self) -> None:
        """Write the index snapshot of the durable entries (start-up reads it), unless it
        would take the disk under the free-disk floor: a start-up without it scans headers.
        The loop only lists the records; their paths and the file are a worker's (at 100k
        entries, building the rows in the loop stalled it for a second). Not before start-up's
        listing has checked the rows taken from the last one: it would record a changed file's
        new mtime beside what its old header said."""
        if self._unchecked is not None:
            log.info("snapshot_skipped", reason="start-up's listing has not ended")
            return
        records = list(self._catalog.durable())
        blocks = [b for b in self._catalog.block_store if b.durable]
        version = self._catalog.version
        count = await anyio.to_thread.run_sync(
            snapshot.save_above_floor, self._dirs, records, blocks, self._config.min_free
        )
        if count is None:
            return
        self._snapshot_version = version
        log.info("snapshot_saved", entries=count)

    async def snapshot_periodically(self, every: float) -> None:
        """Keep the snapshot close to the index, so a crash costs few header reads."""
        while True:
            await anyio.sleep(every)
            if self._catalog.version != self._snapshot_version:
                try:
                    await self.save_snapshot()
                except OSError as exc:
                    log.warning("snapshot_failed", error=str(exc))

    async def expire_puts_periodically(self) -> None:
        """Abort the puts not committed within put_timeout (their staging bytes come back),
        and those whose staging files outgrew what they declared: a client writing past the
        end is stopped within this period."""
        every = min(self._config.put_timeout / 4, 5.0)
        while True:
            await anyio.sleep(every)
            self._puts.expire()
            self._puts.abort_outgrown()

    async def expire_leases_periodically(self) -> None:
        """End the leases kept longer than lease_max_age: a reader that never releases keeps
        its entries from eviction that long at most."""
        max_age = self._config.lease_max_age
        every = min(max_age / 4, 5.0)
        while True:
            await anyio.sleep(every)
            expired = self._leases.expire(max_age)
            if expired:
                owners = sorted({lease.owner for lease in expired})
                log.warning("leases_expired", count=len(expired), sessions=owners[:16])
                self._eviction.to_cap()  # what they kept over the cap may go now

    async def run_writer(self) -> None:
        """The write-behind writer's task (Writer.run), for the daemon's life."""
        await self._writer.run()

    async def wait_settled(self) -> None:
        """Until start-up has listed the directory (settle), or given up."""
        await self._settled.wait()

    def entries_folder(self) -> Path:
        return self._dirs.entries

    async def adopt(self, root: Path, found: Changed, everything: bool) -> None:
        """Make the index agree with what a listing under root found (see Adoption), then
        hold the cap and let the empty identity folders go."""
        await self._adoption.reconcile(root, found, everything)
        self._eviction.to_cap()
        if found.empty_folders:
            self._adoption.remove_empty_folders(found.empty_folders)

    def end_session(self, owner: int) -> None:
        """A connection ended: its leases end and its uncommitted staging files go."""
        self._leases.release_all(owner)
        self._puts.abandon_all(owner)
        self._writer.pulse_changed()

    def close(self) -> None:
        self._catalog.deleter.wait_moved()  # else a next start would index them again
        os.close(self._lock_fd)
