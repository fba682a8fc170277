"""The writer: committed entries made durable, one at a time, in commit order.

A committed entry joins the write-behind queue (writeback.py) and the catalog at once, so it
is readable before it is durable. Its files were sealed and checked whole at commit
(commit_check.py): the writer syncs it and renames it into place; then the entry supersedes
its ancestors and the tier evicts down to its cap. A v2 entry's blocks not yet durable go
first, in order, each synced and renamed into its blocks folder, the folder synced once after
them: a manifest is durable only after its blocks are. A block found damaged later (a
lookup, a scan) takes with it every manifest that lists it (blocks are shared: another put
may have been told it was held). Every queued entry leaves through finish(), whatever ends it
(stored, failed, dropped by the overflow policy, cancelled by a successor or a forgotten
generation): its record follows the outcome and its ticket gets its answer there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import anyio
from kvd_protocol.errors import ErrorCode, ProtocolError, Rule

from kvd.config import Config
from kvd.logs import get_logger
from kvd.store import entry_files
from kvd.store.blocks import Block
from kvd.store.catalog import Catalog
from kvd.store.durability import sync_directory
from kvd.store.eviction import Eviction
from kvd.store.notices import Notices
from kvd.store.quarantine import Quarantine
from kvd.store.records import EntryRecord
from kvd.store.telemetry import Telemetry
from kvd.store.tickets import Tickets
from kvd.store.writeback import OVERFLOW_RULES, Outcome, WritebackQueue, WriteItem

log = get_logger("kvd.store.writer")

TICKET_STATE = {
    Outcome.STORED: "stored",
    Outcome.FAILED: "failed",
    Outcome.DROPPED: "dropped",
    Outcome.CANCELLED: "dropped",
}


@dataclass(eq=False)
class Queued:
    """The payload of a write-behind item: a committed entry waiting to be made durable."""

    record: EntryRecord
    staging: Path
    blocks_written: int = 0  # bytes of its blocks the writer made durable


class Writer:
    """The write-behind queue, the task that drains it, and the waits on it (room, flush)."""

    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        *,
        eviction: Eviction,
        tickets: Tickets,
        quarantine: Quarantine,
        telemetry: Telemetry,
        notices: Notices,
    ) -> None:
        self._config = config
        self._notices = notices
        self._catalog = catalog
        self._eviction = eviction
        self._tickets = tickets
        self._quarantine = quarantine
        self._telemetry = telemetry
        self.policy = OVERFLOW_RULES[config.writeback_policy]
        self.queue: WritebackQueue[Queued] = WritebackQueue(
            config.writeback_max_bytes, config.writeback_policy
        )
        self._queued: dict[str, int] = {}  # entry id -> ticket, while its item is queued
        self._changed = anyio.Event()  # pulsed whenever the queue moves
        self._work = anyio.Event()  # pulsed when the writer has something to do

    def writing(self, digest: str) -> bool:
        """Whether the entry being made durable now is of that identity (its folders may be
        made by the writer's thread at any moment)."""
        item = self.queue.in_flight
        return item is not None and item.payload.record.digest == digest

    def pulse_changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _pulse_work(self) -> None:
        self._work.set()
        self._work = anyio.Event()

    # --- joining the queue ---------------------------------------------------------------

    async def make_room(self, size: int, staged: Callable[[], int] = lambda: 0) -> bool:
        """Whether a put of size bytes may go ahead, as the overflow policy decides. staged():
        the bytes of puts begun and not committed, which hold the cap from put_begin on, as
        queued entries do. Drop-oldest: the oldest queued entries are dropped for room, and the
        put goes ahead while the staged bytes leave room (they cannot be dropped); block: once
        queued and staged bytes leave room (waiting for it up to the block timeout); refuse:
        only if they leave room now. As in the queue, one put fits when nothing is held."""

        def room() -> bool:
            held = staged() + self.queue.pending_bytes
            return not held or held + size <= self.queue.cap_bytes

        if self.policy.drops_oldest:
            for dropped in self.queue.shed(staged() + size):
                self.finish(dropped, Outcome.DROPPED, "write-behind queue overflow")
            # The entry in flight, if it alone is over, holds no put back (a soft cap).
            held = staged()
            return not held or held + size <= self.queue.cap_bytes
        if room():
            return True
        if self.policy.waits_for_room:
            with anyio.move_on_after(self._config.writeback_block_timeout):
                while not room():
                    await self._changed.wait()  # pulsed when the queue or the puts move
                return True
        return False

    def no_room(self, size: int) -> str:
        return (
            f"the write-behind queue holds {self.queue.pending_bytes} of "
            f"{self.queue.cap_bytes} bytes, no room for {size} more"
        )

    def enqueue(
        self,
        record: EntryRecord,
        staging: Path,
        nbytes: int,
        new_blocks: Mapping[bytes, Path] = MappingProxyType({}),
    ) -> int:
        """Queue a committed entry and index it (readable at once); returns its ticket.
        nbytes: what it will write (its file, and new_blocks: the staging files of the blocks
        its put wrote, by hash).

        REFUSED, with nothing changed, when the overflow policy has no room for it.
        """
        ticket = self._tickets.issue()
        admission = self.queue.enqueue(WriteItem(ticket, nbytes, Queued(record, staging)))
        if not admission.accepted:
            raise ProtocolError(ErrorCode.REFUSED, self.no_room(nbytes))
        self._tickets.mark_pending(ticket)
        self._queued[record.id] = ticket
        self._catalog.add(record, staged=staging, staged_blocks=new_blocks)
        for dropped in admission.dropped:
            self.finish(dropped, Outcome.DROPPED, "write-behind queue overflow")
        # Its bytes count from now on: older stored entries make room at once, so that the
        # tier holds its cap while the entry waits to be written, not only once it is.
        self._eviction.to_cap()
        self.pulse_changed()
        self._pulse_work()
        return ticket

    def withdraw(self, record: EntryRecord, reason: str, successor: int | None = None) -> None:
        """Take a still-queued entry back (not one in flight: its write is under way).

        successor: the ticket of the entry that takes its place, for flushes to wait on.
        """
        ticket = self._queued.get(record.id)
        if ticket is None:
            return
        item = self.queue.cancel(ticket, successor)
        if item is not None:
            self.finish(item, Outcome.CANCELLED, reason)

    # --- writing -------------------------------------------------------------------------

    async def run(self) -> None:
        """Make queued entries durable, one at a time, in commit order. Runs forever."""
        while True:
            item = self.queue.next()
            if item is None:
                await self._work.wait()
                continue
            await self._write(item)

    async def _write(self, item: WriteItem[Queued]) -> None:
        record, staging = item.payload.record, item.payload.staging
        final = self._catalog.dirs.entry_path(record.digest, record.id)
        try:
            await self._write_blocks(item.payload)
            await anyio.to_thread.run_sync(entry_files.persist, staging, final)
        except Exception as exc:  # a disk error, or a bug: this entry fails, the writer goes on
            bug = not isinstance(exc, OSError)
            log.error("write_failed", entry=record.id, error=str(exc), exc_info=bug)
            self.finish(item, Outcome.FAILED, f"{getattr(exc, 'strerror', None) or exc}")
        else:
            self.finish(item, Outcome.STORED, None)

    async def _write_blocks(self, queued: Queued) -> None:
        """Make the entry's blocks that are not durable yet durable, in order. OSError as
        persist() raises it."""
        record, dirs = queued.record, self._catalog.dirs
        pending = [b for b in self._catalog.blocks_of(record) if not b.durable]
        placed: list[Block] = []
        try:
            for block in pending:
                final = dirs.block_path(record.digest, block.hash)
                try:
                    await anyio.to_thread.run_sync(self._place_block, block.path, final)
                except OSError as exc:
                    self._unsynced([block], str(exc), but=record)
                    raise
                if not self._catalog.block_store.placed(block, final):
                    entry_files.unlink_quietly(final)  # collected while it was being placed
                else:
                    placed.append(block)
                    queued.blocks_written += block.size
        finally:
            # Whatever ended the loop: the blocks placed are durable only once their names are.
            await self._sync_folders(record, placed)

    def _place_block(self, staged: Path, final: Path) -> None:
        """Blocking: a block of the same hash collected a moment ago may still be leaving
        its place (deleter.py): out of the way first, so the deleter never takes this one."""
        self._catalog.deleter.reclaim(final)
        entry_files.place_block(staged, final)

    async def _sync_folders(self, record: EntryRecord, placed: list[Block]) -> None:
        """Sync the folders of the blocks placed (their new and old names); if that fails,
        they fail too (_unsynced). OSError as sync_directory raises it."""
        if not placed:
            return
        try:
            for folder in (
                self._catalog.dirs.blocks_folder(record.digest),
                self._catalog.dirs.staging,
            ):
                await anyio.to_thread.run_sync(sync_directory, folder)
        except OSError as exc:
            self._unsynced(placed, f"its folder's sync failed: {exc}", but=record)
            raise

    def _unsynced(self, blocks: list[Block], reason: str, but: EntryRecord) -> None:
        """Blocks whose sync (or their folder's) failed are never synced again: after EIO the
        kernel may have dropped their dirty pages and marked them clean, so a second fsync
        would succeed with the data lost. Each leaves the store and goes to the deleter, with
        every pending manifest listing it (but: the one whose write failed, failed by the
        caller); a later put of the same tokens writes them afresh."""
        for block in blocks:
            self._drop_block(block, reason, but)
            self._catalog.deleter.delete(block.path)

    def bad_block(self, block: Block, reason: str) -> None:
        """A block is damaged or gone: its file (if any) quarantined, the block out of the
        store, and every manifest that lists it out of the tier: a stored one quarantined, a
        queued one withdrawn. On the event loop (a lookup's open may find it): a rename or two
        in small folders."""
        self._quarantine.now(block.path, reason)
        self._drop_block(block, reason, None)

    def _drop_block(self, block: Block, reason: str, but: EntryRecord | None) -> None:
        """The block out of the store, its file left where it is, and every manifest that
        lists it out of the tier (but: the caller's, failed by the caller)."""
        catalog = self._catalog
        listing = catalog.listing(block)
        catalog.block_store.forget(block)
        why = f"{Rule.BLOCK_MISSING.value}: block {block.hash.hex()}: {reason}"
        for record in listing:
            if record.durable:
                self._quarantine.now(catalog.path_of(record), why)
            else:
                self.withdraw(record, why)
            catalog.drop(record)

    def finish(self, item: WriteItem[Queued], outcome: Outcome, reason: str | None) -> None:
        """The one way out of the queue: the record follows the outcome, the ticket is answered."""
        record = item.payload.record
        del self._queued[record.id]
        if outcome in (Outcome.STORED, Outcome.FAILED):
            self.queue.done(item, outcome)  # dropped and cancelled ones are out already
        state = TICKET_STATE[outcome]
        if outcome is Outcome.STORED:
            written = record.nbytes + item.payload.blocks_written
            self._catalog.counters.bytes_written += written
            self._telemetry.stored(record.digest, written, time.time())
            if not self._stored(record, item.ticket):
                state, reason = "dropped", self._evicted_at_once()
            elif record.id in self._catalog.records:
                self._notices.entry_stored(record)
        else:
            self._catalog.drop(record)
        self._tickets.settle(item.ticket, state, reason)
        self.pulse_changed()

    def _stored(self, record: EntryRecord, ticket: int) -> bool:
        """The entry is durable: placed, its ancestors superseded, the cap held. False when
        holding the cap took the entry itself at once (what else it could take is leased)."""
        catalog = self._catalog
        if record.id not in catalog.records and not catalog.is_doomed(record.id):
            # Dropped while its write was under way (superseded, forgotten): its bytes left
            # the count then, but the rename may have beaten that unlink of the staging file.
            entry_files.unlink_quietly(catalog.dirs.entry_path(record.digest, record.id))
            return True
        catalog.placed(record)
        if catalog.is_doomed(record.id):
            return True
        self._supersede(record, ticket)
        self._eviction.to_cap()
        return record.id in catalog.records

    def _evicted_at_once(self) -> str:
        return (
            f"evicted as soon as stored: leased entries hold {self._catalog.leased_bytes} "
            f"bytes of the cap of {self._config.max_bytes}"
        )

    def _supersede(self, record: EntryRecord, record_ticket: int) -> None:
        """A new trimmable entry serves every prefix of itself: its ancestors can go.

        Untrimmable entries supersede nothing (an SSM snapshot cannot serve a shorter
        prompt). A checkpoint replaces the older checkpoints of its key, now that it is
        durable: a crash before this point leaves the previous one.
        """
        catalog = self._catalog
        if record.checkpoint_key is not None:
            older = catalog.checkpoints(record.digest, record.checkpoint_key)
            for previous in [r for r in older if r is not record and r.durable]:
                catalog.counters.superseded += 1
                catalog.drop(previous)
            return
        if not record.trimmable:
            return
        index = catalog.index(record.digest)
        assert index is not None  # record is in it
        for ancestor in index.ancestors(record.tokens):
            if ancestor.token_count < record.min_reuse:
                continue  # the new entry cannot be trimmed that far
            catalog.counters.superseded += 1
            self.withdraw(ancestor, "superseded", successor=record_ticket)
            catalog.drop(ancestor)

    # --- the durability barrier ------------------------------------------------------------

    async def flush(self, timeout: float | None) -> tuple[bool, int]:
        """Wait until every entry accepted so far is durable; (durable, still pending)."""
        barrier = self.queue.barrier()
        with anyio.move_on_after(timeout):
            while not barrier.satisfied:
                await self._changed.wait()
        return barrier.durable, self.queue.pending_count
