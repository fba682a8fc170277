"""Puts: a staging file handed to an engine, then committed (or aborted, or abandoned).

begin hands out a staging file, unless the tier already holds the entry (or one covering
it) or there is no room; the engine writes the entry into it; commit validates the header
against what begin declared and hands the entry to the writer. A put belongs to the
connection that began it: only that one may commit or abort it, and its end abandons it.

A v2 entry (a manifest) names its blocks' hashes at begin: the longest prefix of them the
tier holds is held (pinned for the put until it ends, so that no eviction takes them) and
the engine writes only the blocks after it, into staging files block_files() hands out (made on
first asking, pre-sized; asked again, the same file). At commit every one of those must have
been handed out; they join the block store with the manifest.

Commit seals the put's files and checks them whole against the declaration on a worker
thread (commit_check.py); the blocks a put_blocks handed out are checked as soon as a later
put_blocks of the put arrives, if the client closed them, on threads of their own
(block_checks.py), so the commit waits for what is left. A put that lies fails alone, at its
own commit (INVALID_ENTRY), before anything of it is indexed or offered to another put as
held: held means committed and checked.

A staging file is pre-sized, so a put holds its bytes from begin on (the manifest's and its
new blocks'). They count against the write-behind cap (staged and queued bytes together stay
under it; drop-oldest can make room only by dropping queued entries, never staged ones) and
against the free-disk floor (entries are evicted to keep it, else the put is refused with
no_space). A connection holds at most
max_open_puts of them, and one not committed within put_timeout is aborted.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, NoReturn, TypeVar

import anyio
from kvd_protocol.entry import EntryHeader
from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits
from kvd_protocol.messages import DropReport, Retention

from kvd.config import Config, quota_for
from kvd.logs import RateLimited, get_logger
from kvd.store import block_checks, commit_check, entry_files
from kvd.store.admission import Admission
from kvd.store.blocks import HANDOUTS_PER_BLOCK, Block
from kvd.store.catalog import Catalog
from kvd.store.durability import disk_free
from kvd.store.eviction import Eviction
from kvd.store.records import EntryRecord, lookup_trimmable
from kvd.store.retention import Retaining
from kvd.store.staged_put import NO_BLOCKS, DeclaredBlocks, Put
from kvd.store.telemetry import Telemetry
from kvd.store.tickets import Tickets
from kvd.store.tier_dir import new_entry_id
from kvd.store.writer import Writer

log = get_logger("kvd.store.puts")
broken_rules = RateLimited(log)  # a client may break a rule as often as it likes
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
T = TypeVar("T")


class Puts:
    """The puts begun and not yet committed, by id and by owner."""

    def __init__(
        self,
        config: Config,
        limits: Limits,
        *,
        catalog: Catalog,
        eviction: Eviction,
        writer: Writer,
        tickets: Tickets,
        admission: Admission,
        telemetry: Telemetry,
        retention: Retaining,
    ) -> None:
        self._config = config
        self._retention = retention
        self._telemetry = telemetry
        self._admission = admission
        self._limits = limits
        self._catalog = catalog
        self._eviction = eviction
        self._writer = writer
        self._tickets = tickets
        self._puts: dict[int, Put] = {}  # in the order they began
        self._by_owner: dict[int, dict[int, None]] = {}
        self._beginning: dict[int, int] = {}  # owner -> its put_begins waiting for room
        self._ids = itertools.count(1)
        self.staged_bytes = 0  # the staging files' sizes, begun and not yet committed
        self.refused = 0  # put_begins refused for want of room under the write-behind cap
        self.not_admitted = 0  # put_begins the admission policy turned away, and their bytes
        self.not_admitted_bytes = 0
        # Bytes of blocks held at put_begin, so never written, by the puts committed (per
        # identity: in its telemetry).
        self.dedup_saved_bytes = 0
        self._checks = anyio.CapacityLimiter(COMMIT_CHECKS)
        self.sealed_by_copy = 0  # files a client still held writable at commit: copied
        self.refused_at_commit = 0  # puts whose files were not what they declared
        self.outgrown = 0  # puts aborted for staging files grown past what they declared

    def __len__(self) -> int:
        return len(self._puts)

    async def begin(
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
        """A staging file for a new entry (its manifest, for one with blocks: put.held_blocks says
        how many of them the tier holds), or the reason none is needed. The telemetry learns
        the identity's names and the engine's prefill_cost (seconds per token; 0: not
        measured) first. retention: the put's (kvd.store.retention), given to the entry held
        when none is needed.

        Returns (put, None, fd) or (None, "duplicate" | "covered", None).
        """
        self._telemetry.prefill_reported(identity, prefill_cost)
        digest = identity.digest()
        hashes = declared.hashes
        held_blocks = self._catalog.block_store.count_held(digest, hashes)
        adds = size + (len(hashes) - held_blocks) * declared.block_size
        if adds > self._config.max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"an entry of {adds} bytes cannot fit under the tier cap of "
                f"{self._config.max_bytes} bytes",
            )
        skip = self._held(digest, tokens, retention)
        if skip is not None:
            return None, skip, None
        quota = self._quota(identity)
        if quota is not None and adds > quota:  # before the engine writes a byte of it
            raise ProtocolError(
                ErrorCode.NO_SPACE,
                f"an entry of {adds} bytes is over the quota of {identity.model_id} ({quota})",
            )
        refusal = self._admission.admit(digest, tokens, time.time())
        if refusal is not None:
            self.not_admitted += 1
            self.not_admitted_bytes += adds
            raise ProtocolError(ErrorCode.REFUSED, refusal)
        self._no_room_under_leases(adds)
        # The connection's slot and the blocks found held are taken before the first wait:
        # put_begins pipelined on one connection each see the others' slots (the check and
        # the taking with no await between), and an eviction while this put waits for room
        # cannot take what was found held. Both are given back if the put goes no further.
        self._take_slot(owner)
        pinned = self._catalog.block_store.pin(digest, hashes[:held_blocks])
        try:
            _check_held_size(pinned, declared.block_size)
            # Before the engine spends time writing. Not one of the queue's refusals: nothing
            # was offered to the queue yet.
            if not await self._writer.make_room(adds, lambda: self.staged_bytes):
                self.refused += 1
                raise ProtocolError(ErrorCode.REFUSED, self._no_room(adds))
            await self._keep_floor(adds)
            put_id = next(self._ids)
            path = self._catalog.dirs.staging_path(f"{put_id}-{new_entry_id()}")
            self.staged_bytes += adds  # held from here: another begin may run while this waits
            try:
                fd = await _on_loop_if_small(size, entry_files.create_staging, path, size)
            except OSError as exc:
                self.staged_bytes -= adds
                self._writer.pulse_changed()
                raise _staging_error(exc, size) from None
        except BaseException:
            self._catalog.block_store.unpin(pinned)
            raise
        finally:
            self._give_slot(owner)
        put = Put(
            put_id,
            owner,
            identity,
            tokens,
            size,
            path,
            declared=declared,
            pinned=pinned,
            retention=retention,
        )
        self._puts[put_id] = put
        self._by_owner.setdefault(owner, {})[put_id] = None
        return put, None, fd

    def _held(self, digest: str, tokens: bytes, retention: Retention | None) -> str | None:
        """Why no put is needed ("duplicate": the tier holds the entry, "covered": one it
        holds serves it), that entry given the put's retention; None when one is."""
        index = self._catalog.index(digest)
        if index is None:
            return None
        held, skip = index.exact(tokens), "duplicate"
        if held is None:
            held, skip = index.covering(tokens), "covered"
        if held is None:
            return None
        self._catalog.counters.duplicates += 1
        if retention is not None:
            self._retention.retain(held, retention)
        return skip

    def _take_slot(self, owner: int) -> None:
        """One of owner's max_open_puts, for a put_begin under way (given back by _give_slot
        once its put is registered, or refused); OVER_LIMIT when none is left."""
        began = len(self._by_owner.get(owner, ())) + self._beginning.get(owner, 0)
        if began >= self._config.max_open_puts:
            raise ProtocolError(
                ErrorCode.OVER_LIMIT,
                f"{self._config.max_open_puts} puts begun and not committed on this connection",
            )
        self._beginning[owner] = self._beginning.get(owner, 0) + 1

    def _give_slot(self, owner: int) -> None:
        self._beginning[owner] -= 1
        if not self._beginning[owner]:
            del self._beginning[owner]

    def _no_room_under_leases(self, adds: int) -> None:
        """NO_SPACE when adds more bytes cannot fit under the cap even once eviction has taken
        all it may: leased entries keep theirs. Refused before the engine writes a byte, not
        written, answered stored and evicted at once."""
        cap, leased = self._config.max_bytes, self._catalog.leased_bytes
        if leased + adds > cap:
            raise ProtocolError(
                ErrorCode.NO_SPACE,
                f"leased entries hold {leased} bytes of the tier's cap of {cap}: no room for "
                f"{adds} more until readers release them (a lease ends after "
                f"{self._config.lease_max_age:g} s)",
            )

    def _quota(self, put_identity: Identity) -> int | None:
        return quota_for(self._config.quotas, put_identity.model_id)

    def _keep_quota(self, put: Put) -> None:
        """Make the model's own entries give way to this one under its quota (in the eviction
        policy's order); NO_SPACE if even that leaves no room."""
        quota = self._quota(put.identity)
        if quota is None:
            return
        digest = put.identity.digest()
        adds = put.reserved
        self._eviction.within(digest, self._catalog.identity_bytes(digest) + adds - quota)
        stored = self._catalog.identity_bytes(digest)
        if stored + adds > quota:
            raise ProtocolError(
                ErrorCode.NO_SPACE,
                f"the quota of {put.identity.model_id} is {quota} bytes: {stored} are held "
                f"(leased or pending), no room for {adds} more",
            )

    def _no_room(self, size: int) -> str:
        queue = self._writer.queue
        return (
            f"the write-behind queue holds {queue.pending_bytes} bytes and puts under way "
            f"{self.staged_bytes}, of {queue.cap_bytes}: no room for {size} more"
        )

    async def _keep_floor(self, size: int) -> None:
        """Evict (in the policy's order) so that size more bytes keep the free-disk floor;
        NO_SPACE when even that leaves too little. The reservation that follows needs the room
        on the disk: files the deleter has yet to unlink are waited for (off the loop)."""
        floor = self._config.min_free
        if not floor:
            return
        catalog = self._catalog
        try:
            free = catalog.disk_free()
        except OSError:
            return  # unknown: the reservation itself will say
        if free - size < floor and free + catalog.total_bytes - size >= floor:
            self._eviction.to_cap(floor + size)  # can make the room
            free = catalog.disk_free()
        if free - size < floor:
            raise ProtocolError(
                ErrorCode.NO_SPACE,
                f"{size} bytes would leave {max(0, free - size)} bytes free on the disk, under "
                f"the floor of {floor}",
            )
        if catalog.deleter.pending_bytes and disk_free(catalog.dirs.root) - size < floor:
            await anyio.to_thread.run_sync(catalog.deleter.wait_idle)

    def _owned(self, owner: int, put_id: int) -> Put:
        put = self._puts.get(put_id)
        if put is None or put.owner != owner:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no put {put_id} on this connection")
        return put

    def pop(self, owner: int, put_id: int) -> Put:
        """The owner's put, now the caller's: to commit or to abort. Its bytes stay staged
        until then: a commit validating its file holds its room as the put did."""
        put = self._owned(owner, put_id)
        self._forget(put)
        return put

    async def commit_owned(
        self,
        owner: int,
        put_id: int,
        store_ms: float | None = None,
        dropped: DropReport | None = None,
    ) -> int:
        """The owner's put by id, committed (commit); its ticket. store_ms: the engine's time
        from handing the caches over to this commit, if it said; dropped: the snapshots of the
        put's identity it dropped since it last told, counted once the commit gives a ticket
        (the engine keeps them for its next commit otherwise)."""
        put = self.pop(owner, put_id)
        ticket = await self.commit(put)  # from take() on, nothing may come between
        digest = put.identity.digest()
        if store_ms is not None:
            self._telemetry.store_reported(digest, store_ms)
        if dropped is not None:
            self._telemetry.drops_reported(digest, dropped)
        return ticket

    def abort_owned(self, owner: int, put_id: int) -> None:
        """The owner's put by id, aborted."""
        self.abort(self.pop(owner, put_id))

    def counts(self) -> dict[str, int]:
        """What the puts counted since start, and what is staged now (the status's figures)."""
        return {
            "staged_bytes": self.staged_bytes,
            "staged_puts": len(self._puts),
            "refused": self.refused,
            "not_admitted": self.not_admitted,
            "not_admitted_bytes": self.not_admitted_bytes,
            "dedup_saved_bytes": self.dedup_saved_bytes,
            "sealed_by_copy": self.sealed_by_copy,
            "checked_early": block_checks.passed_early(),
            "refused_at_commit": self.refused_at_commit,
            "outgrown": self.outgrown,
        }

    async def block_files(self, owner: int, put_id: int, first: int, count: int) -> list[int]:
        """Read-write descriptors of the staging files of the owner's put's blocks first..
        first+count-1, made (pre-sized) on first asking. Only blocks the tier does not hold
        are the engine's to write: BAD_MESSAGE for a range outside held..n."""
        put = self._owned(owner, put_id)
        if first < put.held_blocks or first + count > len(put.block_hashes) or count < 1:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"blocks {first}..{first + count - 1} are not put {put_id}'s to write: it "
                f"writes blocks {put.held_blocks}..{len(put.block_hashes) - 1}",
            )
        new_blocks = len(put.block_hashes) - put.held_blocks
        if put.handed + count > HANDOUTS_PER_BLOCK * new_blocks:
            raise ProtocolError(
                ErrorCode.OVER_LIMIT,
                f"put {put_id} had {put.handed} descriptors of its {new_blocks} new blocks: "
                f"each is handed out at most {HANDOUTS_PER_BLOCK} times",
            )
        wanted = range(first, first + count)
        # The blocks handed out before are checked now, while the client writes these: the
        # engine library closed them before it asked (those still open are checked at
        # commit). A block asked for again is the client's to write again: not checked yet.
        earlier = [(i, path, put.block_name(i)) for i, path in put.block_files.items()]
        put.checks.withdraw(i for i in wanted if i in put.block_files)
        put.checks.begin(
            [block for block in earlier if block[0] not in wanted], put.block_size, self._limits
        )
        for index in wanted:
            put.block_files.setdefault(
                index, self._catalog.dirs.staging_path(f"{put.id}-{index}-{new_entry_id()}")
            )
        paths = [put.block_files[i] for i in wanted]
        put.handed += count  # before the wait: put_blocks pipelined see each other's
        try:
            fds = await _on_loop_if_small(
                count * put.block_size, entry_files.open_staging_files, paths, put.block_size
            )
        except OSError as exc:
            put.handed -= count
            raise _staging_error(exc, put.block_size) from None
        if self._puts.get(put_id) is not put:  # committed or aborted while a thread made them
            self._let_go(put, wanted, fds)
        return fds

    def _let_go(self, put: Put, indexes: range, fds: list[int]) -> NoReturn:
        """Block files made for a put that ended meanwhile: their descriptors closed, and the
        files no queued entry holds (the put was aborted: its files went before these were
        made) removed, rather than left in staging uncounted until a restart."""
        for fd in fds:
            os.close(fd)
        digest = put.identity.digest()
        for index in indexes:
            block = self._catalog.block_store.get(digest, put.block_hashes[index])
            path = put.block_files[index]
            if block is None or block.path != path:
                self._catalog.deleter.delete(path)
        raise ProtocolError(
            ErrorCode.NOT_FOUND, f"put {put.id} ended while its block files were being made"
        )

    def _forget(self, put: Put) -> None:
        del self._puts[put.id]
        owned = self._by_owner[put.owner]
        del owned[put.id]
        if not owned:
            del self._by_owner[put.owner]

    def _release(self, put: Put) -> None:
        """A taken put's bytes leave the staged count (queued now, or gone), and its held
        blocks their pins (a queued manifest keeps them by its refs now)."""
        self.staged_bytes -= put.reserved
        self._catalog.block_store.unpin(put.pinned)
        self._writer.pulse_changed()  # room, for a put that waits for it

    def _remove_files(self, put: Put) -> None:
        """The staging files of a put that was not queued, its manifest's and its blocks', to
        the deleter (an aborted 1 GiB put would otherwise stop the loop while it unlinks);
        the checks of its blocks not begun yet are not begun."""
        put.checks.cancel()
        for path in (put.path, *put.block_files.values()):
            self._catalog.deleter.delete(path)

    def abort(self, put: Put) -> None:
        """A taken put ends uncommitted: its bytes return, its files go."""
        self._release(put)
        self._remove_files(put)

    def abandon_all(self, owner: int) -> None:
        """The owner's connection ended: its uncommitted staging files go."""
        for put_id in list(self._by_owner.get(owner, {})):
            put = self._puts[put_id]
            self._forget(put)
            self._catalog.counters.abandoned += 1
            self.abort(put)

    def expire(self, now: float | None = None) -> int:
        """Abort every put begun more than put_timeout ago; how many went."""
        deadline = (time.monotonic() if now is None else now) - self._config.put_timeout
        stale = []
        for put in self._puts.values():  # oldest first
            if put.began > deadline:
                break
            stale.append(put)
        for put in stale:
            self._forget(put)
            self._catalog.counters.abandoned += 1
            self.abort(put)
            log.warning("put_expired", put=put.id, bytes=put.reserved, owner=put.owner)
        return len(stale)

    def abort_outgrown(self) -> int:
        """Abort every put whose staging files take more of the disk than it declared (a
        client may write past the end of a file it holds, or allocate beyond it): their bytes
        were never counted, under the cap or the floor. How many went."""
        outgrown = [put for put in self._puts.values() if _outgrew(put)]
        for put in outgrown:
            self._forget(put)
            self._catalog.counters.abandoned += 1
            self.outgrown += 1
            self.abort(put)
            broken_rules.warning("put_outgrown", put=put.id, declared=put.reserved, owner=put.owner)
        return len(outgrown)

    async def commit(self, put: Put) -> int:
        """Validate the written header, index the entry and queue it; returns its ticket.

        The put is the caller's from pop() on: unless it is queued, its staging file goes
        here, whatever ends the commit (a refusal, a bad file, the putter hanging up while
        it waits for room).
        """
        queued = False
        try:
            unwritten = [
                i for i in range(put.held_blocks, len(put.block_hashes)) if i not in put.block_files
            ]
            if unwritten:
                raise ProtocolError(
                    ErrorCode.INVALID_ENTRY,
                    f"blocks {_ranges(unwritten)} of put {put.id} were never handed out "
                    "(put_blocks): the entry would lack them",
                )
            header = await self._checked(put)
            await self._writer.make_room(put.reserved)  # if none, the queue refuses below
            # No await from here on: the index cannot change between the check and the add.
            digest = put.identity.digest()
            key = header.checkpoint.key if header.checkpoint else None
            index = self._catalog.index(digest)
            held = None if key is not None or index is None else index.exact(put.tokens)
            if held is not None:
                # Same identity and tokens: the same cache. Keep the entry we have.
                self._catalog.counters.duplicates += 1
                if put.retention is not None:
                    self._retention.retain(held, put.retention)
                ticket = self._tickets.issue()
                self._tickets.settle(ticket, "stored", "duplicate")
                return ticket
            if (
                self._catalog.block_store.count_held(digest, put.block_hashes[: put.held_blocks])
                < put.held_blocks
            ):
                raise ProtocolError(
                    ErrorCode.NOT_FOUND,
                    f"{Rule.BLOCK_MISSING.value}: a block held for put {put.id} at put_begin "
                    "was found damaged since and is gone: put the entry again",
                )
            self._keep_quota(put)
            record = EntryRecord(
                id=new_entry_id(),
                digest=digest,
                tokens=put.tokens,
                nbytes=put.size,
                trimmable=lookup_trimmable(header),
                min_reuse=header.min_reuse,
                created=header.created,
                last_used=self._catalog.tick(),
                checkpoint_key=key,
                block_hashes=put.block_hashes,
                block_size=put.block_size,
                prefill_checkpoint=header.prefill_checkpoint,
                retained=None if put.retention is None else self._retention.granted(put.retention),
            )
            new_blocks = {put.block_hashes[i]: path for i, path in put.block_files.items()}
            ticket = self._writer.enqueue(record, put.path, put.reserved, new_blocks)
            queued = True
            saved = put.held_blocks * put.block_size
            self.dedup_saved_bytes += saved
            self._telemetry.deduplicated(digest, saved)
            return ticket
        finally:
            self._release(put)  # in the same step as the enqueue: the bytes are never uncounted
            if not queued:
                self._remove_files(put)

    async def _checked(self, put: Put) -> EntryHeader:
        """The put's files sealed and checked whole against its declaration; its header.
        INVALID_ENTRY (with a warning) for a put that is not what it declared."""
        copies: dict[Path, Path] = {}  # a client's file -> the daemon's copy, as made
        try:
            return await anyio.to_thread.run_sync(
                commit_check.seal_and_check,
                put,
                self._catalog.dirs,
                self._limits,
                copies,
                limiter=self._checks,
            )
        except EntryFormatError as exc:
            self.refused_at_commit += 1
            broken_rules.warning("put_refused", put=put.id, owner=put.owner, reason=str(exc))
            # The cause stays: it names the file refused (a fetch remembers that block).
            raise ProtocolError(ErrorCode.INVALID_ENTRY, str(exc)) from exc
        except OSError as exc:  # a copy that found no room, say: the engine is told so
            raise _staging_error(exc, put.reserved) from None
        finally:
            self._adopt(put, copies)

    def _adopt(self, put: Put, copies: dict[Path, Path]) -> None:
        """The put goes on with the daemon's copies; the client's files (truncated) go."""
        for original, copy in copies.items():
            self.sealed_by_copy += 1
            self._catalog.deleter.delete(original)
            if original == put.path:
                put.path = copy
            for index, path in put.block_files.items():
                if path == original:
                    put.block_files[index] = copy


# Commits checked at once, each on a worker thread of its own: one reads and checksums its
# files whole, and many clients committing together must not take every thread of anyio's
# default limiter, which the writer's syncs, the quarantine and the scans share. Two keep
# both cores of a small machine busy; more would only queue on the disk and the cores.
COMMIT_CHECKS: Final = 2

# Staging files up to this size in all are made on the event loop: open and fallocate of 32
# MiB cost ~0.4 ms (ext4, 2-core VM), about what handing them to a worker thread and back
# costs, each hand-off a wake-up that waits for a core on a loaded machine. Larger ones (1
# GiB: ~13 ms) would hold up every other client: a worker thread makes them.
STAGE_ON_LOOP_BYTES: Final = 32 << 20


async def _on_loop_if_small(size: int, make: Callable[..., T], *args: object) -> T:
    if size <= STAGE_ON_LOOP_BYTES:
        return make(*args)
    return await anyio.to_thread.run_sync(make, *args)


# What a staging file may hold on disk beyond its declared size before its put counts as
# outgrown: the file system's own rounding (blocks, extents) of a preallocated file.
ALLOCATION_SLACK: Final = 1 << 20


def _outgrew(put: Put) -> bool:
    """Whether a file of put's holds more than its declared size, or more disk than that
    (space a client allocated past the end keeps the size unchanged)."""
    files = [(put.path, put.size), *((path, put.block_size) for path in put.block_files.values())]
    for path, size in files:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            continue  # a block file not made yet
        if info.st_size > size or info.st_blocks * 512 > size + ALLOCATION_SLACK:
            return True
    return False


def _check_held_size(held: list[Block], declared: int) -> None:
    """The blocks a put_begin is told it holds must be of the size it declares: the entry is
    counted, snapshotted and served by that size (a smaller one would count it as less and
    fail it at the next start)."""
    wrong = next((block for block in held if block.size != declared), None)
    if wrong is not None:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"block_size {declared} is not the size of the blocks the tier holds for these "
            f"tokens ({wrong.size} bytes)",
        )


def _staging_error(exc: OSError, size: int) -> OSError | ProtocolError:
    """What a failure to make a staging file tells the engine: no space, no descriptor, or
    (anything else) the error itself."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ProtocolError(ErrorCode.NO_SPACE, f"no space for {size} bytes")
    if exc.errno in _OUT_OF_DESCRIPTORS:
        return ProtocolError(
            ErrorCode.REFUSED, "kvd has no file descriptor free for a staging file"
        )
    return exc


def _ranges(indexes: list[int]) -> str:
    """Sorted indexes as people write them: 3..5, 8."""
    parts = []
    start = previous = indexes[0]
    for index in [*indexes[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}..{previous}")
        if index is not None:
            start = previous = index
    return ", ".join(parts)
