"""The cold tier: the daemon's state, owned by its one event loop, behind one façade.

Its rooms, each with one job: the catalog (catalog.py: records, indexes, counts, eviction
order), puts (puts.py), the writer (writer.py: the write-behind queue and its task), tickets
(tickets.py), leases (leases.py) and adoption (adoption.py: files made behind the daemon's
back). Other parts call the tier's methods, never a room's. No locks: only the event loop
touches this state; blocking file work (validation, fsync, rename, scans) runs in worker
threads via entry_files.

An entry's life: put_begin creates a staging file -> commit seals it and checks it whole,
indexes it (readable at once: read-your-writes) and queues it -> the writer syncs it and
renames it into place -> stored (durable). Or: refused at commit (bad data), dropped (queue
overflow, superseded, duplicate), failed (disk full), or abandoned (the putter went away
before commit).
"""

from __future__ import annotations

import gc
import itertools
import operator
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits
from kvd_protocol.messages import DropReport, EntrySummary, RestoreReport, Retention

from kvd.config import Config
from kvd.logs import get_logger
from kvd.progress import Progress
from kvd.store import entry_files, miss_reasons, recovery, snapshot
from kvd.store.admission import ADMISSION_POLICIES
from kvd.store.adoption import Adoption, Changed
from kvd.store.blocks import Block
from kvd.store.catalog import Catalog
from kvd.store.entry_checks import EntryChecks
from kvd.store.eviction import EVICTION_POLICIES
from kvd.store.leases import Leases
from kvd.store.miss_reasons import Miss
from kvd.store.notices import Notices
from kvd.store.prefix_index import Match, PrefixIndex
from kvd.store.puts import HANDOUTS_PER_BLOCK, Puts
from kvd.store.quarantine import Quarantine
from kvd.store.records import EntryRecord, summary
from kvd.store.retention import Retaining
from kvd.store.staged_put import NO_BLOCKS, DeclaredBlocks, Put
from kvd.store.telemetry import Telemetry
from kvd.store.tickets import TicketAnswer, Tickets
from kvd.store.tier_dir import TierDir
from kvd.store.tier_report import tier_report
from kvd.store.writer import Writer

log = get_logger("kvd.store.tier")

LISTING_RETRY_S = 5.0  # start-up's listing failed (an I/O error): tried again after this


class Tier:
    """The tier directory and everything the daemon knows about it.

    Requests come in through the methods below, each on behalf of an owner (the connection
    asking); the rooms do the work. Other parts call these methods, never a room's.
    """

    def __init__(self, config: Config, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.dirs = TierDir(config.dir)
        # A lambda: the catalog is made next, with the eviction policy that reads the telemetry.
        self.telemetry = Telemetry(has_entries=lambda digest: self.catalog.holds(digest))  # noqa: PLW0108
        eviction = EVICTION_POLICIES[config.eviction_policy](self.telemetry.prefill_cost)
        self.retention = Retaining(eviction, config.max_retention, self.namespace_of)
        self.catalog = Catalog(self.dirs, self.retention)
        self.quarantine = Quarantine(self.dirs, config.quarantine_max_bytes, self.catalog.counters)
        self.tickets = Tickets()
        self.notices = Notices()  # whom stored entries and lookup hits are told of
        self.admission = ADMISSION_POLICIES[config.admission](
            config.admission_min_tokens, config.admission_window
        )
        self.writer = Writer(
            config,
            self.catalog,
            tickets=self.tickets,
            quarantine=self.quarantine,
            telemetry=self.telemetry,
            notices=self.notices,
        )
        self.puts = Puts(
            config,
            limits,
            catalog=self.catalog,
            writer=self.writer,
            tickets=self.tickets,
            admission=self.admission,
            telemetry=self.telemetry,
            retention=self.retention,
        )
        self.leases = Leases(self.catalog)
        self.started = time.time()
        self._lock_fd = -1
        self._snapshot_version = -1
        self.checks = EntryChecks(self.catalog, self.quarantine, self.writer, limits)
        self.adoption = Adoption(self.catalog, self.writer, self.quarantine, limits)
        self.settled = anyio.Event()  # set once start-up has listed the directory (settle)
        self._unchecked: snapshot.Snapshot | None = None  # taken from it, not listed yet
        self._reaped = 0
        # Lookups answered and not yet counted (see lookup): identity, tokens, and the hit's
        # index and record, or the miss's reason.
        self.unbooked: list[tuple[Identity, bytes, tuple[PrefixIndex, Match] | str]] = []

    # --- the directory ---------------------------------------------------------------------

    async def open(self) -> None:
        """Take the directory, reap staging and index what is on disk: from the snapshot, its
        files not yet checked (settle() lists the directory against it while the daemon
        serves), or without one by reading every header (see recovery)."""
        self.dirs.create()
        self._lock_fd = self.dirs.lock()
        # Start-up builds one long-lived object graph and frees nothing: the collector would
        # only walk it again and again (docs/benchmarks.md, "Start-up", has what that cost).
        gc.disable()
        self._reaped = await anyio.to_thread.run_sync(recovery.reap_staging, self.dirs)
        self.catalog.deleter.reap()
        known = await anyio.to_thread.run_sync(snapshot.load_snapshot, self.dirs.snapshot)
        if known.records or known.blocks:
            blocks = self.catalog.block_store
            for row in known.blocks.values():
                path = self.dirs.block_path(row.digest, row.hash)
                blocks.adopt(row.digest, row.hash, row.size, path, row.mtime_ns)
            self.catalog.expect_mtimes(known.mtime_of)
            self._unchecked = known
            await self._index(known.records)
            log.info("snapshot_loaded", entries=len(self.catalog), blocks=len(blocks))
        else:
            # A full scan reads every header (minutes at 100k entries): counted on a terminal.
            progress = Progress("reading entry headers", None)
            try:
                listed = await anyio.to_thread.run_sync(
                    recovery.list_against, self.dirs, self.limits, known, progress.step
                )
            finally:
                progress.close()
            await self._take(listed, 0)
        gc.freeze()  # the index is long-lived: spare the collector from walking it again
        gc.enable()
        self.evict_to_cap()
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
                        recovery.list_against, self.dirs, self.limits, known
                    )
                    break
                except OSError as exc:  # files stay checked by mtime too until a listing succeeds
                    log.warning("startup_listing_failed", error=str(exc), retry_s=LISTING_RETRY_S)
                    await anyio.sleep(LISTING_RETRY_S)
            catalog = self.catalog
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
                    self.writer.bad_block(block, why)
            catalog.expect_mtimes(None)
            self._unchecked = None
            await self._take(listed, sum(listed.matched))
            self.evict_to_cap()
        finally:  # what waits for it goes on, also when it failed
            self.settled.set()

    async def _take(self, listed: recovery.Listing, from_snapshot: int) -> None:
        """Index what a listing found beside the snapshot's rows; the tier is opened."""
        for path, reason in listed.invalid:
            await self.quarantine.file(path, reason)
        blocks = self.catalog.block_store
        for block in listed.blocks:
            if blocks.get(block.digest, block.hash) is None:
                blocks.adopt(block.digest, block.hash, block.size, block.path)
        await self._index(listed.found)
        orphans = blocks.collect_orphans()  # of puts a crash cut off
        log.info(
            "tier_opened",
            dir=str(self.dirs.root),
            entries=len(self.catalog),
            bytes=self.catalog.total_bytes,
            blocks=len(blocks),
            orphan_blocks=orphans,
            reaped=self._reaped,
            quarantined=len(listed.invalid),
            from_snapshot=from_snapshot,
        )
        self.settled.set()

    async def _index(self, records: Sequence[EntryRecord]) -> None:
        """Index entries found on disk, least recently used first; those that cannot be
        served (a block missing, the same tokens as another) are quarantined."""
        catalog = self.catalog
        for record, problem in catalog.add_found(records):
            await self.quarantine.file(catalog.path_of(record), problem)

    async def _name_identities(self) -> None:
        """Learn each identity's names for people (model id, namespace) from one of its
        entries' headers: status names models, not digests, before any engine comes."""
        for digest, _ in self.catalog.identities():
            record = self.catalog.an_entry(digest)
            if record is None:
                continue
            path = self.catalog.path_of(record)
            try:
                header = await anyio.to_thread.run_sync(entry_files.read_header, path, self.limits)
            except (OSError, EntryFormatError) as exc:
                log.info("identity_unnamed", identity=digest, error=str(exc))
                continue
            self.telemetry.seen(header.identity)

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
        records = list(self.catalog.durable())
        blocks = [b for b in self.catalog.block_store if b.durable]
        version = self.catalog.version
        count = await anyio.to_thread.run_sync(
            snapshot.save_above_floor, self.dirs, records, blocks, self.config.min_free
        )
        if count is None:
            return
        self._snapshot_version = version
        log.info("snapshot_saved", entries=count)

    async def snapshot_periodically(self, every: float) -> None:
        """Keep the snapshot close to the index, so a crash costs few header reads."""
        while True:
            await anyio.sleep(every)
            if self.catalog.version != self._snapshot_version:
                try:
                    await self.save_snapshot()
                except OSError as exc:
                    log.warning("snapshot_failed", error=str(exc))

    async def expire_puts_periodically(self) -> None:
        """Abort the puts not committed within put_timeout (their staging bytes come back),
        and those whose staging files outgrew what they declared: a client writing past the
        end is stopped within this period."""
        every = min(self.config.put_timeout / 4, 5.0)
        while True:
            await anyio.sleep(every)
            self.puts.expire()
            self.puts.abort_outgrown()

    async def expire_leases_periodically(self) -> None:
        """End the leases held longer than lease_max_age: a reader that never releases keeps
        its entries from eviction that long at most."""
        max_age = self.config.lease_max_age
        every = min(max_age / 4, 5.0)
        while True:
            await anyio.sleep(every)
            expired = self.leases.expire(max_age)
            if expired:
                owners = sorted({lease.owner for lease in expired})
                log.warning("leases_expired", count=len(expired), sessions=owners[:16])
                self.evict_to_cap()  # what they kept over the cap may go now

    def close(self) -> None:
        os.close(self._lock_fd)

    def evict_to_cap(self) -> None:
        """Hold the byte cap and the free-disk floor."""
        self.catalog.evict_to_cap(self.config.max_bytes, self.config.min_free)

    def report(self) -> dict[str, Any]:
        """The status report's figures of the tier (see tier_report)."""
        return tier_report(
            config=self.config,
            root=self.dirs.root,
            catalog=self.catalog,
            puts=self.puts,
            queue=self.writer.queue,
            telemetry=self.telemetry,
            leases=self.leases,
            checks=self.checks,
            tickets=self.tickets,
            admission=self.admission,
            retained=self.retention.retained_bytes(),
            started=self.started,
        )

    # --- put: begin, commit (or abort), then the ticket ----------------------------------------

    async def begin_put(
        self,
        owner: int,
        identity: Identity,
        tokens: bytes,
        size: int,
        declared: DeclaredBlocks = NO_BLOCKS,
        *,
        prefill_cost: float = 0.0,
        retention: Retention | None = None,
    ) -> tuple[Put | None, str | None, int | None]:
        """See Puts.begin."""
        return await self.puts.begin(
            owner, identity, tokens, size, declared, prefill_cost=prefill_cost, retention=retention
        )

    async def put_blocks(self, owner: int, put_id: int, first: int, count: int) -> list[int]:
        """Descriptors of the staging files of blocks first.. of the owner's put."""
        return await self.puts.block_files(owner, put_id, first, count)

    async def commit_put(
        self,
        owner: int,
        put_id: int,
        store_ms: float | None = None,
        dropped: DropReport | None = None,
    ) -> int:
        """The owner's put, validated and queued; returns its ticket. store_ms: the engine's
        time from handing the caches over to this commit, if it said; dropped: the snapshots
        of the put's identity it dropped since it last told, counted once the commit gives a
        ticket (the engine keeps them for its next commit otherwise)."""
        put = self.puts.pop(owner, put_id)
        ticket = await self.puts.commit(put)  # from take() on, nothing may come between
        digest = put.identity.digest()
        if store_ms is not None:
            self.telemetry.store_reported(digest, store_ms)
        if dropped is not None:
            self.telemetry.drops_reported(digest, dropped)
        return ticket

    def abort_put(self, owner: int, put_id: int) -> None:
        self.puts.abort(self.puts.pop(owner, put_id))

    async def wait_ticket(self, ticket: int, timeout: float | None) -> TicketAnswer:
        return await self.tickets.wait(ticket, timeout)

    async def run_writer(self) -> None:
        await self.writer.run()

    async def flush(self, timeout: float | None) -> tuple[bool, int]:
        return await self.writer.flush(timeout)

    # --- get: lookup (or a checkpoint), then release ---------------------------------------------

    def lookup(
        self,
        owner: int,
        identity: Identity,
        tokens: bytes,
        min_tokens: int = 0,
        tenant: str = "",
    ) -> tuple[Match, int, int] | Miss:
        """The best usable entry, its read-only descriptor and a lease; or the Miss, why
        nothing was usable (miss_reasons: told of the identities under tenant only), also
        when the best match is shorter than min_tokens.

        What only counts the lookup (hit and miss counters, telemetry, the entry's place in
        the eviction order, the admission policy's sighting) waits in unbooked, so that the
        reply goes first: call book_lookups() next, before anything else changes the
        catalog (the session does once the reply is sent)."""
        self._check_leases(owner)
        reason, matched = miss_reasons.NO_ENTRY, 0
        while (index := self.catalog.index(identity.digest())) is not None and (
            match := index.best_match(tokens)
        ):
            if match.matched < min_tokens:
                reason, matched = miss_reasons.BELOW_MIN_TOKENS, match.matched
                break
            fd = self.catalog.open(match.record, self.quarantine.now)
            if fd is not None:
                match.record.used_at = time.time()  # before the reply: its summary says it
                lease = self.leases.grant(owner, match.record)
                self.unbooked.append((identity, tokens, (index, match)))
                return match, lease, fd
            if match.record.id in self.catalog.records:  # kept, but unreadable now
                reason, matched = miss_reasons.UNREADABLE, match.matched
                break
        if reason == miss_reasons.NO_ENTRY and min_tokens > 1:  # the engine holds more
            reason = miss_reasons.BELOW_MIN_TOKENS
        miss = miss_reasons.explain(
            self.catalog,
            self.telemetry,
            identity,
            tokens,
            reason=reason,
            matched=matched,
            min_tokens=min_tokens,
            tenant=tenant,
        )
        self.unbooked.append((identity, tokens, miss.reason))
        return miss

    def longest_match(self, identity: Identity, tokens: bytes) -> int:
        """The tokens of the prompt the best local entry serves (0: none), leasing nothing:
        what a fetch from the remote tier would extend."""
        index = self.catalog.index(identity.digest())
        match = index.best_match(tokens) if index is not None else None
        return 0 if match is None else match.matched

    def book_lookups(self) -> None:
        """Count the lookups answered since the last call (see lookup). Each is booked once,
        even if booking one fails."""
        pending, self.unbooked = self.unbooked, []
        counters, now = self.catalog.counters, time.time()
        for identity, tokens, outcome in pending:
            self.admission.looked_up(identity.digest(), tokens, now)
            if outcome == miss_reasons.BELOW_MIN_TOKENS:
                counters.engine_held += 1
                self.telemetry.held_by_engine(identity)
            elif isinstance(outcome, str):
                counters.misses += 1
                self.telemetry.lookup(identity, hit=False, reason=outcome)
            else:
                index, (record, matched) = outcome
                counters.hits += 1
                self.telemetry.lookup(identity, hit=True)
                if record.prefill_checkpoint:
                    self.telemetry.prefill_checkpoint_hit(identity.digest(), matched)
                index.touch(record, self.catalog.tick())
                self.notices.entry_hit(record)

    def open_blocks(self, owner: int, lease_id: int, first: int, count: int) -> list[int]:
        """Read-only descriptors of blocks first.. of the entry under the owner's lease, each
        opened without following links and checked by fstat against its size. A block gone or
        not what the store says is quarantined with every manifest listing it; either that or
        one unreadable now (EIO, no descriptor free) is NOT_FOUND (block_missing), and the
        engine's restore a miss."""
        lease = self.leases.lease(owner, lease_id)
        record = lease.record
        blocks = self.catalog.blocks_of(record)
        if first + count > len(blocks):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"entry {record.id} has {len(blocks)} blocks, not {first}..{first + count - 1}",
            )
        if lease.opened + count > HANDOUTS_PER_BLOCK * len(blocks):
            raise ProtocolError(
                ErrorCode.OVER_LIMIT,
                f"lease {lease_id} had {lease.opened} block descriptors of entry {record.id}'s "
                f"{len(blocks)} blocks: each is handed out at most {HANDOUTS_PER_BLOCK} times",
            )
        fds: list[int] = []
        try:
            for index in range(first, first + count):
                fd = self._open_block(blocks[index])
                if fd is None:
                    raise ProtocolError(
                        ErrorCode.NOT_FOUND,
                        f"{Rule.BLOCK_MISSING.value}: block {index} of entry {record.id} "
                        f"({blocks[index].hash.hex()}) cannot be opened",
                    )
                fds.append(fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        lease.opened += count
        return fds

    def _open_block(self, block: Block) -> int | None:
        candidates = [block.path]
        if not block.durable:  # the writer may have placed it a moment ago
            candidates.append(self.dirs.block_path(block.digest, block.hash))
        for path in candidates:
            try:
                return entry_files.open_entry(path, block.size, block.mtime_ns)
            except FileNotFoundError:
                continue
            except entry_files.ChangedError as exc:  # start-up's listing reads it again
                log.warning("block_changed_since_snapshot", block=block.hash.hex(), reason=str(exc))
                return None
            except EntryFormatError as exc:  # never handed out
                self.writer.bad_block(block, str(exc))
                return None
            except OSError as exc:  # EIO, or out of descriptors: not now, the block kept
                log.warning("block_unreadable", block=block.hash.hex(), error=str(exc))
                return None
        if self.catalog.block_store.get(block.digest, block.hash) is block:
            self.writer.bad_block(block, "its file is gone")
        return None

    def lease_entry(self, owner: int, entry: str) -> tuple[EntryRecord, int, int] | None:
        """A durable entry by id, opened read-only and leased to owner (its blocks then come
        from open_blocks; what they are, from blocks_of); None when it is gone or cannot be
        read now."""
        record = self.catalog.records.get(entry)
        if record is None or not record.durable:
            return None
        fd = self.catalog.open(record, self.quarantine.now)
        return None if fd is None else (record, self.leases.grant(owner, record), fd)

    def blocks_of(self, record: EntryRecord) -> tuple[Block, ...]:
        return self.catalog.blocks_of(record)

    def find_checkpoint(
        self, owner: int, identity: Identity, key: str, prompt: bytes
    ) -> tuple[EntryRecord, int, int] | None:
        """The newest checkpoint under key whose tokens extend prompt, opened and leased."""
        self._check_leases(owner)
        counters = self.catalog.counters
        for record in reversed(self.catalog.checkpoints(identity.digest(), key)):
            if len(record.tokens) > len(prompt) and bytes(record.tokens[: len(prompt)]) == prompt:
                fd = self.catalog.open(record, self.quarantine.now)
                if fd is not None:
                    counters.hits += 1
                    self.telemetry.lookup(identity, hit=True)
                    record.used_at = time.time()
                    return record, self.leases.grant(owner, record), fd
        counters.misses += 1
        self.telemetry.lookup(identity, hit=False, reason="no checkpoint")
        return None

    def forget_checkpoint(self, identity: Identity, key: str) -> int:
        """The generation finished: drop its checkpoints, pending ones included."""
        records = self.catalog.checkpoints(identity.digest(), key)
        for record in records:
            self.writer.withdraw(record, "checkpoint forgotten")
            self.catalog.drop(record)  # one in flight is deleted once its write ends
        return len(records)

    def _check_leases(self, owner: int) -> None:
        if self.leases.count_of(owner) >= self.config.max_leases:
            raise ProtocolError(
                ErrorCode.OVER_LIMIT,
                f"{self.config.max_leases} leases held on this connection: release some first",
            )

    def end_lease(
        self, owner: int, lease_id: int, report: RestoreReport | None = None
    ) -> EntryRecord:
        """End a lease; its entry's record. report: how the engine's restore went, for the
        telemetry."""
        record = self.leases.release(owner, lease_id)
        if report is not None:
            self.telemetry.restored(record.digest, report, time.time())
            if report.miss is not None:
                self.catalog.counters.hit_unused()
        return record

    async def check_reported(self, owner: int, record: EntryRecord, damaged: str) -> None:
        """A client could not use the entry's file (damaged: why): see EntryChecks.reported."""
        await self.checks.reported(owner, record, damaged)

    async def verify(self, owner: int, entry: str, repair: bool) -> tuple[str | None, bool]:
        """Check one durable entry by id for owner's connection: see EntryChecks.verify."""
        return await self.checks.verify(owner, entry, repair)

    def __len__(self) -> int:
        """The entries the tier holds, pending ones included."""
        return len(self.catalog)

    def entries_folder(self) -> Path:
        return self.dirs.entries

    async def wait_settled(self) -> None:
        """Until start-up has listed the directory (settle), or given up."""
        await self.settled.wait()

    async def adopt(self, root: Path, found: Changed, everything: bool) -> None:
        """Make the index agree with what a listing under root found (see Adoption), then
        hold the cap and let the empty identity folders go."""
        await self.adoption.reconcile(root, found, everything)
        self.evict_to_cap()
        if found.empty_folders:
            self.adoption.remove_empty_folders(found.empty_folders)

    def holds(self, digest: str) -> bool:
        """Whether the tier holds an entry of the identity (pending ones included)."""
        return self.catalog.holds(digest)

    def namespace_of(self, digest: str) -> str | None:
        """The identity's namespace, as a request or an entry's header told; None if unknown."""
        names = self.telemetry.identities.get(digest)
        return None if names is None else names.namespace

    def entry(self, entry: str) -> EntryRecord | None:
        """The entry by id; None without such an entry."""
        return self.catalog.records.get(entry)

    def stored_entries(self) -> Iterator[EntryRecord]:
        """The durable entries (not those pending in the write-behind queue)."""
        return self.catalog.durable()

    def identity_of(self, entry: str) -> str | None:
        """The digest of the identity of the entry by id; None without such an entry."""
        record = self.catalog.records.get(entry)
        return None if record is None else record.digest

    def close_session(self, owner: int) -> None:
        """A connection ended: its leases end and its uncommitted staging files go."""
        self.leases.release_all(owner)
        self.puts.abandon_all(owner)
        self.writer.pulse_changed()

    # --- listing and eviction by request ----------------------------------------------------------

    def list_entries(
        self, digest: str | None, limit: int, after: str | None
    ) -> tuple[list[EntrySummary], bool]:
        """A page of entries ordered by id (stable across pages), at most limit of them."""
        records, more = self.catalog.page(digest, after, limit)
        return [summary(r) for r in records], more

    def evict(self, entry: str | None, digest: str | None, everything: bool) -> tuple[int, int]:
        """Remove entries by id, by identity (its digest) or all of them; (count, bytes)."""
        records = self.catalog.records
        if entry is not None:
            if entry not in records:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no entry {entry}")
            victims = [records[entry]]
        elif digest is not None:
            victims = self.catalog.of_identity(digest)
        else:
            victims = list(records.values()) if everything else []
        count = freed = 0
        for record in victims:
            if not record.durable:
                continue  # the queue owns it; flush first to evict it
            count += 1
            freed += self.catalog.evicted(record)
        return count, freed
