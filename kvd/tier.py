"""The cold tier: every piece of the daemon's state, owned by its one event loop.

The tier indexes entries per identity, hands staging files to putters, queues committed
entries for the writer, serves lookups with leases, supersedes ancestors, evicts to the cap
and keeps the counters status reports. No locks: only the event loop touches this state;
blocking file work (validation, fsync, rename, scans) runs in worker threads via entry_files.

An entry's life: put_begin creates a staging file -> commit validates its header, indexes it
(readable at once: read-your-writes) and queues it -> the writer verifies its data, syncs and
renames it into place -> stored (durable). Or: dropped (queue overflow, superseded,
duplicate), failed (bad data, disk full), or abandoned (the putter went away before commit).
"""

from __future__ import annotations

import errno
import gc
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from kvd_protocol.entry import EntryHeader
from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits
from kvd_protocol.messages import EntrySummary

from kvd import entry_files, recovery, snapshot
from kvd.config import Config, WritebackPolicy
from kvd.durability import disk_free
from kvd.eviction import LruPolicy, bytes_over
from kvd.logs import get_logger
from kvd.prefix_index import Match, PrefixIndex
from kvd.records import EntryRecord
from kvd.tier_dir import TierDir, new_entry_id
from kvd.writeback import Outcome, Overflow, WritebackQueue, WriteItem

log = get_logger("kvd.tier")

SETTLED_TICKETS_KEPT = 65536  # answers kept for late ticket waits; older ones are forgotten


@dataclass(eq=False)
class Put:
    """A staging file handed to an engine, not yet committed."""

    id: int
    owner: int  # the session that began it
    identity: Identity
    tokens: bytes
    size: int
    path: Path


@dataclass(eq=False)
class Queued:
    """The payload of a write-behind item: a committed entry waiting to be made durable."""

    record: EntryRecord
    header: EntryHeader
    staging: Path


@dataclass
class TicketState:
    state: str  # pending | stored | dropped | failed
    reason: str | None = None
    settled: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class Lease:
    record: EntryRecord
    owner: int


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    superseded: int = 0
    quarantined: int = 0
    duplicates: int = 0
    abandoned: int = 0
    bytes_written: int = 0


class Tier:
    def __init__(self, config: Config, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.dirs = TierDir(config.dir)
        self.records: dict[str, EntryRecord] = {}
        # Entries whose file is not at its place under entries/ (pending ones: in staging).
        self.staged: dict[str, Path] = {}
        self.indexes: dict[str, PrefixIndex] = {}  # identity digest -> its prompt index
        # Generation checkpoints by (identity, key), oldest first: apart from prompt lookups.
        self.checkpoints: dict[tuple[str, str], list[EntryRecord]] = {}
        self.doomed: dict[str, EntryRecord] = {}  # removed from the index, still leased
        self.eviction = LruPolicy()
        self.queue: WritebackQueue[Queued] = WritebackQueue(
            config.writeback_max_bytes, Overflow(config.writeback_policy.value)
        )
        self.total_bytes = 0  # every entry file the tier holds: pending, stored, doomed
        self.counters = Counters()
        self.puts: dict[int, Put] = {}
        self.tickets: OrderedDict[int, TicketState] = OrderedDict()
        self.leases: dict[int, Lease] = {}
        self.pending_tickets: dict[str, int] = {}  # entry id -> ticket, while queued
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._changed = anyio.Event()  # pulsed whenever the queue moves
        self._work = anyio.Event()  # pulsed when the writer has something to do
        self.started = time.time()
        self._lock_fd = -1
        self.version = 0  # bumped by every change to the set of entries
        self.snapshot_version = -1

    async def open(self) -> None:
        """Take the directory, reap, validate and index what is on disk (see recovery)."""
        self.dirs.create()
        self._lock_fd = self.dirs.lock()
        # Start-up builds one long-lived object graph and frees nothing: the collector would
        # only walk it again and again (a third of the time at 100k entries).
        gc.disable()
        result = await anyio.to_thread.run_sync(recovery.scan, self.dirs, self.limits)
        for path, reason in result.invalid:
            await self.quarantine_file(path, reason)
        for record in result.entries:  # least recently used first
            record.last_used = self.tick()
            try:
                self.add_record(record)
            except ValueError:  # the same tokens as an entry already indexed
                await self.quarantine_file(self.path_of(record), "a duplicate of another entry")
        gc.freeze()  # the index is long-lived: spare the collector from walking it again
        gc.enable()
        log.info(
            "tier_opened",
            dir=str(self.dirs.root),
            entries=len(self.records),
            bytes=self.total_bytes,
            reaped=result.reaped,
            quarantined=len(result.invalid),
            from_snapshot=result.from_snapshot,
        )
        self.evict_to_cap()

    async def save_snapshot(self) -> None:
        """Write the index snapshot of the durable entries (start-up reads it)."""
        rows = [(self.path_of(r), r) for r in self.records.values() if r.durable]
        count = await anyio.to_thread.run_sync(snapshot.save_snapshot, self.dirs.snapshot, rows)
        self.snapshot_version = self.version
        log.info("snapshot_saved", entries=count)

    async def snapshot_periodically(self, every: float) -> None:
        """Keep the snapshot close to the index, so a crash costs few header reads."""
        while True:
            await anyio.sleep(every)
            if self.version != self.snapshot_version:
                try:
                    await self.save_snapshot()
                except OSError as exc:
                    log.warning("snapshot_failed", error=str(exc))

    def close(self) -> None:
        os.close(self._lock_fd)

    # --- the event loop's helpers -------------------------------------------------------

    def _pulse_changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _pulse_work(self) -> None:
        self._work.set()
        self._work = anyio.Event()

    def _index(self, identity: str) -> PrefixIndex:
        index = self.indexes.get(identity)
        if index is None:
            index = self.indexes[identity] = PrefixIndex()
        return index

    def live_records(self) -> Iterator[EntryRecord]:
        return iter(self.records.values())

    # --- adding and removing entries -----------------------------------------------------

    def path_of(self, record: EntryRecord) -> Path:
        """Where the entry's file is: its place under entries/, unless it is still staged."""
        staged = self.staged.get(record.id)
        return staged if staged is not None else self.dirs.entry_path(record.identity, record.id)

    def add_record(self, record: EntryRecord, staged: Path | None = None) -> None:
        """Index an entry whose file is at its place, or at staged while it is pending.

        ValueError, with nothing changed, for the same tokens as an entry already indexed.
        """
        if record.checkpoint_key is None:
            self._index(record.identity).add(record)  # first: the one step that may refuse
        else:
            self.checkpoints.setdefault((record.identity, record.checkpoint_key), []).append(record)
        self.records[record.id] = record
        if staged is not None:
            self.staged[record.id] = staged
        self.version += 1
        self.total_bytes += record.nbytes
        self.eviction.add(record)

    def drop_record(self, record: EntryRecord) -> None:
        """Take an entry out of the tier; its file goes now, or when its last lease ends."""
        if self.records.pop(record.id, None) is None:
            return
        self.version += 1
        if record.checkpoint_key is None:
            index = self.indexes[record.identity]
            index.remove(record)
            if not len(index):
                del self.indexes[record.identity]
        else:
            key = (record.identity, record.checkpoint_key)
            self.checkpoints[key].remove(record)
            if not self.checkpoints[key]:
                del self.checkpoints[key]
        self.eviction.remove(record)
        if record.leases:
            self.doomed[record.id] = record
        else:
            self._delete_file(record)

    def _delete_file(self, record: EntryRecord) -> None:
        path = self.path_of(record)
        self.staged.pop(record.id, None)
        try:
            entry_files.unlink_quietly(path)
        except OSError as exc:  # the bytes are no longer ours to count either way
            log.warning("unlink_failed", entry=record.id, path=str(path), error=str(exc))
        self.total_bytes -= record.nbytes

    # --- put ---------------------------------------------------------------------------

    async def begin_put(
        self, owner: int, identity: Identity, tokens: bytes, size: int
    ) -> tuple[Put | None, str | None, int | None]:
        """A staging file for a new entry, or the reason none is needed.

        Returns (put, None, fd) or (None, "duplicate" | "covered", None).
        """
        if size > self.config.max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"an entry of {size} bytes cannot fit under the tier cap of "
                f"{self.config.max_bytes} bytes",
            )
        index = self.indexes.get(identity.digest())
        if index is not None:
            if index.exact(tokens) is not None:
                self.counters.duplicates += 1
                return None, "duplicate", None
            if index.covering(tokens) is not None:
                self.counters.duplicates += 1
                return None, "covered", None
        if self.config.writeback_policy is not WritebackPolicy.DROP_OLDEST and not (
            await self._wait_for_room(size)
        ):
            # Before the engine spends time writing. Not one of the queue's refusals: nothing
            # was offered to the queue yet.
            raise ProtocolError(ErrorCode.REFUSED, self._no_room(size))
        put_id = next(self._ids)
        path = self.dirs.staging_path(f"{put_id}-{new_entry_id()}")
        try:
            fd = await anyio.to_thread.run_sync(entry_files.create_staging, path, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ProtocolError(ErrorCode.NO_SPACE, f"no space for {size} bytes") from None
            raise
        put = Put(put_id, owner, identity, tokens, size, path)
        self.puts[put_id] = put
        return put, None, fd

    async def _wait_for_room(self, size: int) -> bool:
        """Whether the write-behind queue has room for size bytes; under the block policy,
        after waiting for it up to the block timeout."""
        if self.queue.room_for(size):
            return True
        if self.config.writeback_policy is WritebackPolicy.BLOCK:
            with anyio.move_on_after(self.config.writeback_block_timeout):
                while not self.queue.room_for(size):
                    await self._changed.wait()
                return True
        return False

    def _no_room(self, size: int) -> str:
        return (
            f"the write-behind queue holds {self.queue.pending_bytes} of "
            f"{self.queue.cap_bytes} bytes, no room for {size} more"
        )

    def take_put(self, owner: int, put_id: int) -> Put:
        put = self.puts.get(put_id)
        if put is None or put.owner != owner:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no put {put_id} on this connection")
        del self.puts[put_id]
        return put

    def abort_put(self, put: Put) -> None:
        entry_files.unlink_quietly(put.path)

    async def commit_put(self, put: Put) -> int:
        """Validate the written header, index the entry and queue it; returns its ticket.

        The put is the caller's from take_put on: unless it is queued, its staging file goes
        here, whatever ends the commit (a refusal, a bad file, the putter hanging up while
        it waits for room).
        """
        queued = False
        try:
            try:
                header = await anyio.to_thread.run_sync(
                    entry_files.read_header, put.path, self.limits
                )
                _check_matches_put(header, put)
            except EntryFormatError as exc:
                await self.quarantine_file(put.path, str(exc))
                raise ProtocolError(ErrorCode.INVALID_ENTRY, str(exc)) from None
            if self.config.writeback_policy is WritebackPolicy.BLOCK:
                await self._wait_for_room(put.size)  # the queue refuses below if it timed out
            # No await from here on: the index cannot change between the check and the add.
            ticket = next(self._ids)
            digest = put.identity.digest()
            key = header.checkpoint.key if header.checkpoint else None
            index = self.indexes.get(digest)
            if key is None and index is not None and index.exact(put.tokens) is not None:
                # Same identity and tokens: the same cache. Keep the entry we have.
                self.counters.duplicates += 1
                self._settle(ticket, "stored", "duplicate")
                return ticket
            record = EntryRecord(
                id=new_entry_id(),
                identity=digest,
                tokens=put.tokens,
                nbytes=put.size,
                trimmable=header.trimmable,
                min_reuse=header.min_reuse,
                created=header.created,
                last_used=self.tick(),
                checkpoint_key=key,
            )
            admission = self.queue.enqueue(
                WriteItem(ticket, put.size, Queued(record, header, put.path))
            )
            if not admission.accepted:
                raise ProtocolError(ErrorCode.REFUSED, self._no_room(put.size))
            queued = True
        finally:
            if not queued:
                entry_files.unlink_quietly(put.path)
        self.tickets[ticket] = TicketState("pending")
        self.pending_tickets[record.id] = ticket
        self.add_record(record, staged=put.path)
        for dropped in admission.dropped:
            del self.pending_tickets[dropped.payload.record.id]
            self.drop_record(dropped.payload.record)
            self._settle(dropped.ticket, "dropped", "write-behind queue overflow")
        self._pulse_changed()
        self._pulse_work()
        return ticket

    def tick(self) -> int:
        """The next value of the logical clock that orders uses (larger: more recent)."""
        return next(self._clock)

    async def quarantine_file(self, path: Path, reason: str) -> None:
        log.warning("quarantined", file=path.name, reason=reason)
        self.counters.quarantined += 1
        try:
            await anyio.to_thread.run_sync(
                entry_files.quarantine, path, self.dirs.quarantine, self.config.quarantine_max_bytes
            )
        except OSError as exc:
            log.error("quarantine_failed", file=str(path), error=str(exc))
            entry_files.unlink_quietly(path)

    # --- the writer ----------------------------------------------------------------------

    async def run_writer(self) -> None:
        """Make queued entries durable, one at a time, in commit order. Runs forever."""
        while True:
            item = self.queue.next()
            if item is None:
                await self._work.wait()
                continue
            await self._write(item)

    async def _write(self, item: WriteItem[Queued]) -> None:
        record, staging = item.payload.record, item.payload.staging
        self.pending_tickets.pop(record.id, None)
        final = self.dirs.entry_path(record.identity, record.id)
        try:
            await anyio.to_thread.run_sync(entry_files.verify_data, staging, item.payload.header)
            await anyio.to_thread.run_sync(entry_files.persist, staging, final)
        except EntryFormatError as exc:
            self.queue.done(item, Outcome.FAILED)
            if record.id in self.records:
                self.staged[record.id] = self.dirs.quarantine / staging.name
                self.drop_record(record)  # nothing left to unlink: quarantine moves it
            await self.quarantine_file(staging, str(exc))
            self._settle(item.ticket, "failed", str(exc))
        except OSError as exc:
            self.queue.done(item, Outcome.FAILED)
            self.drop_record(record)
            log.error("write_failed", entry=record.id, error=str(exc))
            self._settle(item.ticket, "failed", f"{exc.strerror or exc}")
        else:
            self.queue.done(item, Outcome.STORED)
            self.counters.bytes_written += record.nbytes
            self._stored(record, final, item.ticket)
            self._settle(item.ticket, "stored", None)
        self._pulse_changed()

    def _stored(self, record: EntryRecord, final: Path, ticket: int) -> None:
        if record.id not in self.records and record.id not in self.doomed:
            # Dropped while its write was under way (superseded, forgotten): its bytes left
            # the count then, but the rename may have beaten that unlink of the staging file.
            entry_files.unlink_quietly(final)
            return
        self.staged.pop(record.id, None)  # in its place now
        record.durable = True
        self.version += 1
        if record.id in self.doomed:
            return
        self._supersede(record, ticket)
        self.evict_to_cap()

    def _supersede(self, record: EntryRecord, record_ticket: int) -> None:
        """A new trimmable entry serves every prefix of itself: its ancestors can go.

        Untrimmable entries supersede nothing (an SSM snapshot cannot serve a shorter
        prompt). A checkpoint replaces the older checkpoints of its key, now that it is
        durable: a crash before this point leaves the previous one.
        """
        if record.checkpoint_key is not None:
            older = self.checkpoints[(record.identity, record.checkpoint_key)]
            for previous in [r for r in older if r is not record and r.durable]:
                self.counters.superseded += 1
                self.drop_record(previous)
            return
        if not record.trimmable:
            return
        for ancestor in self.indexes[record.identity].ancestors(record.tokens):
            if ancestor.token_count < record.min_reuse:
                continue  # the new entry cannot be trimmed that far
            self.counters.superseded += 1
            ticket = self.pending_tickets.get(ancestor.id)
            if ticket is not None and self.queue.cancel(ticket, record_ticket) is not None:
                del self.pending_tickets[ancestor.id]
                self._settle(ticket, "dropped", "superseded")
            self.drop_record(ancestor)

    def evict_to_cap(self) -> None:
        """Hold the byte cap and the free-disk floor, least recently used first."""
        try:
            free = disk_free(self.dirs.root)
        except OSError:
            free = self.config.min_free  # unknown: act on the cap alone
        over = bytes_over(self.total_bytes, self.config.max_bytes, free, self.config.min_free)
        if over <= 0:
            return
        for victim in self.eviction.select_victims(over):
            self.counters.evictions += 1
            self.counters.evicted_bytes += victim.nbytes
            self.drop_record(victim)

    def _settle(self, ticket: int, state: str, reason: str | None) -> None:
        entry = self.tickets.get(ticket)
        if entry is None:
            entry = self.tickets[ticket] = TicketState(state)
        entry.state, entry.reason = state, reason
        entry.settled.set()
        self.tickets.move_to_end(ticket)
        while len(self.tickets) > SETTLED_TICKETS_KEPT:
            oldest, first = next(iter(self.tickets.items()))
            if first.state == "pending":
                break
            del self.tickets[oldest]

    async def wait_ticket(self, ticket: int, timeout: float | None) -> TicketState:
        entry = self.tickets.get(ticket)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no ticket {ticket} (or long forgotten)")
        if entry.state == "pending" and timeout:
            with anyio.move_on_after(timeout):
                await entry.settled.wait()
        return entry

    # --- lookup and leases ----------------------------------------------------------------

    def lookup(
        self, owner: int, identity: Identity, tokens: bytes, min_tokens: int = 0
    ) -> tuple[Match, int, int] | None:
        """The best usable entry, its read-only descriptor and a lease; None on a miss, also
        when the best match is shorter than min_tokens."""
        digest = identity.digest()
        while (index := self.indexes.get(digest)) and (match := index.best_match(tokens)):
            if match.matched < min_tokens:
                break
            fd = self._open(match.record)
            if fd is not None:
                record = match.record
                self.counters.hits += 1
                index.touch(record, self.tick())
                return match, self._lease(owner, record), fd
        self.counters.misses += 1
        return None

    def _lease(self, owner: int, record: EntryRecord) -> int:
        """A use: the entry becomes the most recent, and stays on disk until released."""
        self.eviction.touch(record)
        record.leases += 1
        lease = next(self._ids)
        self.leases[lease] = Lease(record, owner)
        return lease

    def find_checkpoint(
        self, owner: int, identity: Identity, key: str, prompt: bytes
    ) -> tuple[EntryRecord, int, int] | None:
        """The newest checkpoint under key whose tokens extend prompt, opened and leased."""
        candidates = self.checkpoints.get((identity.digest(), key), [])
        for record in reversed(candidates):
            if len(record.tokens) > len(prompt) and record.tokens.startswith(prompt):
                fd = self._open(record)
                if fd is not None:
                    self.counters.hits += 1
                    return record, self._lease(owner, record), fd
        self.counters.misses += 1
        return None

    def forget_checkpoint(self, identity: Identity, key: str) -> int:
        """The generation finished: drop its checkpoints, pending ones included."""
        records = list(self.checkpoints.get((identity.digest(), key), []))
        for record in records:
            ticket = self.pending_tickets.pop(record.id, None)
            if ticket is not None and self.queue.cancel(ticket) is not None:
                self._settle(ticket, "dropped", "checkpoint forgotten")
            self.drop_record(record)  # one in flight is deleted once its write ends
        return len(records)

    def _open(self, record: EntryRecord) -> int | None:
        """Open an entry read-only; a file gone behind our back takes its entry with it."""
        candidates = [self.path_of(record)]
        if not record.durable:  # the writer may have renamed it a moment ago
            candidates.append(self.dirs.entry_path(record.identity, record.id))
        for path in candidates:
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
        log.warning("entry_file_missing", entry=record.id)
        self.staged.pop(record.id, None)
        self.drop_record(record)
        return None

    def release(self, owner: int, lease_id: int) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no lease {lease_id} on this connection")
        self._end_lease(lease_id)

    def _end_lease(self, lease_id: int) -> None:
        record = self.leases.pop(lease_id).record
        record.leases -= 1
        if not record.leases and self.doomed.pop(record.id, None) is not None:
            self._delete_file(record)

    def close_session(self, owner: int) -> None:
        """A connection ended: its leases end and its uncommitted staging files go."""
        for lease_id in [k for k, lease in self.leases.items() if lease.owner == owner]:
            self._end_lease(lease_id)
        for put in [p for p in self.puts.values() if p.owner == owner]:
            del self.puts[put.id]
            self.counters.abandoned += 1
            self.abort_put(put)
        self._pulse_changed()

    def summary(self, record: EntryRecord) -> EntrySummary:
        return EntrySummary(
            id=record.id,
            identity=record.identity,
            tokens=record.token_count,
            bytes=record.nbytes,
            trimmable=record.trimmable,
            created=record.created,
            durable=record.durable,
        )

    def list_entries(
        self, identity: str | None, limit: int, after: str | None
    ) -> tuple[list[EntrySummary], bool]:
        """A page of entries ordered by id (stable across pages), at most limit of them."""
        chosen = sorted(
            (r for r in self.records.values() if identity is None or r.identity == identity),
            key=lambda r: r.id,
        )
        if after is not None:
            chosen = [r for r in chosen if r.id > after]
        return [self.summary(r) for r in chosen[:limit]], len(chosen) > limit

    # --- flush and eviction by request -----------------------------------------------------

    async def flush(self, timeout: float | None) -> tuple[bool, int]:
        """Wait until every entry accepted so far is durable; (durable, still pending)."""
        barrier = self.queue.barrier()
        with anyio.move_on_after(timeout):
            while not barrier.satisfied:
                await self._changed.wait()
        return barrier.durable, self.queue.pending_count

    def evict(self, entry: str | None, identity: str | None, everything: bool) -> tuple[int, int]:
        """Remove entries by id, by identity or all of them; (count, bytes)."""
        if entry is not None:
            if entry not in self.records:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no entry {entry}")
            victims = [self.records[entry]]
        elif identity is not None:
            victims = [r for r in self.records.values() if r.identity == identity]
        else:
            victims = list(self.records.values()) if everything else []
        count = freed = 0
        for record in victims:
            if not record.durable:
                continue  # the queue owns it; flush first to evict it
            count += 1
            freed += record.nbytes
            self.counters.evictions += 1
            self.counters.evicted_bytes += record.nbytes
            self.drop_record(record)
        return count, freed


def _check_matches_put(header: EntryHeader, put: Put) -> None:
    """The file must hold what its put_begin declared: the daemon indexes by the declaration."""
    problems = []
    if header.identity != put.identity:
        problems.append("its identity differs from the one declared at put_begin")
    if header.tokens != put.tokens:
        problems.append("its tokens differ from the ones declared at put_begin")
    if header.file_size != put.size:
        problems.append(f"its size {header.file_size} differs from the declared {put.size}")
    if problems:
        raise EntryFormatError(put.path.name, Rule.SCHEMA, "; ".join(problems))
