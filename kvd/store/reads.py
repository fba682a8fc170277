"""The tier's read path: a lookup (or a checkpoint), the entry's descriptor and a lease, its
blocks' descriptors, then the lease's end.

A lookup answers at once and counts later: what only counts it (hit and miss counters, the
telemetry, the entry's place in the eviction order, the admission policy's sighting, the
notice of a hit) waits in unbooked until book_lookups(), so that the reply goes first.
Descriptors are opened read-only without following links and checked against what the
catalog says; a file that is not is quarantined, never handed out.
"""

from __future__ import annotations

import os
import time

from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.messages import RestoreReport

from kvd.config import Config
from kvd.logs import get_logger
from kvd.store import entry_files, miss_reasons
from kvd.store.admission import Admission
from kvd.store.blocks import HANDOUTS_PER_BLOCK, Block
from kvd.store.catalog import Catalog
from kvd.store.entry_checks import EntryChecks
from kvd.store.leases import Leases
from kvd.store.miss_reasons import Miss
from kvd.store.notices import Notices
from kvd.store.prefix_index import Match, PrefixIndex
from kvd.store.quarantine import Quarantine
from kvd.store.records import EntryRecord
from kvd.store.telemetry import Telemetry
from kvd.store.writer import Writer

log = get_logger("kvd.store.reads")


class Reads:
    """Lookups, checkpoints, leases and the descriptors handed out under them, each on behalf
    of an owner (the connection asking)."""

    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        *,
        leases: Leases,
        quarantine: Quarantine,
        writer: Writer,
        checks: EntryChecks,
        telemetry: Telemetry,
        admission: Admission,
        notices: Notices,
    ) -> None:
        self._max_leases = config.max_leases
        self._catalog = catalog
        self._leases = leases
        self._quarantine = quarantine
        self._writer = writer
        self._checks = checks
        self._telemetry = telemetry
        self._admission = admission
        self._notices = notices
        # Lookups answered and not yet counted (see lookup): identity, tokens, and the hit's
        # index and record, or the miss's reason.
        self._unbooked: list[tuple[Identity, bytes, tuple[PrefixIndex, Match] | str]] = []

    # --- a lookup, then its booking -------------------------------------------------------------

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

        What only counts the lookup waits (see the module): call book_lookups() next, before
        anything else changes the catalog (the op table does once the reply is sent)."""
        self._check_leases(owner)
        catalog = self._catalog
        reason, matched = miss_reasons.NO_ENTRY, 0
        while (index := catalog.index(identity.digest())) is not None and (
            match := index.best_match(tokens)
        ):
            if match.matched < min_tokens:
                reason, matched = miss_reasons.BELOW_MIN_TOKENS, match.matched
                break
            fd = catalog.open(match.record, self._quarantine.now)
            if fd is not None:
                match.record.used_at = time.time()  # before the reply: its summary says it
                lease = self._leases.grant(owner, match.record)
                self._unbooked.append((identity, tokens, (index, match)))
                return match, lease, fd
            if match.record.id in catalog.records:  # kept, but unreadable now
                reason, matched = miss_reasons.UNREADABLE, match.matched
                break
        if reason == miss_reasons.NO_ENTRY and min_tokens > 1:  # the engine has more
            reason = miss_reasons.BELOW_MIN_TOKENS
        miss = miss_reasons.explain(
            catalog,
            self._telemetry,
            identity,
            tokens,
            reason=reason,
            matched=matched,
            min_tokens=min_tokens,
            tenant=tenant,
        )
        self._unbooked.append((identity, tokens, miss.reason))
        return miss

    def longest_match(self, identity: Identity, tokens: bytes) -> int:
        """The tokens of the prompt the best local entry serves (0: none), leasing nothing:
        what a fetch from the remote tier would extend."""
        index = self._catalog.index(identity.digest())
        match = index.best_match(tokens) if index is not None else None
        return 0 if match is None else match.matched

    def book_lookups(self) -> None:
        """Count the lookups answered since the last call (see lookup). Each is booked once,
        even if booking one fails."""
        pending, self._unbooked = self._unbooked, []
        counters, now = self._catalog.counters, time.time()
        telemetry = self._telemetry
        for identity, tokens, outcome in pending:
            self._admission.looked_up(identity.digest(), tokens, now)
            if outcome == miss_reasons.BELOW_MIN_TOKENS:
                counters.engine_held += 1
                telemetry.held_by_engine(identity)
            elif isinstance(outcome, str):
                counters.misses += 1
                telemetry.lookup(identity, hit=False, reason=outcome)
            else:
                index, (record, matched) = outcome
                counters.hits += 1
                telemetry.lookup(identity, hit=True)
                if record.prefill_checkpoint:
                    telemetry.prefill_checkpoint_hit(identity.digest(), matched)
                index.touch(record, self._catalog.tick())
                self._notices.entry_hit(record)

    # --- checkpoints ----------------------------------------------------------------------------

    def find_checkpoint(
        self, owner: int, identity: Identity, key: str, prompt: bytes
    ) -> tuple[EntryRecord, int, int] | None:
        """The newest checkpoint under key whose tokens extend prompt, opened and leased."""
        self._check_leases(owner)
        counters = self._catalog.counters
        for record in reversed(self._catalog.checkpoints(identity.digest(), key)):
            if len(record.tokens) > len(prompt) and bytes(record.tokens[: len(prompt)]) == prompt:
                fd = self._catalog.open(record, self._quarantine.now)
                if fd is not None:
                    counters.hits += 1
                    self._telemetry.lookup(identity, hit=True)
                    record.used_at = time.time()
                    return record, self._leases.grant(owner, record), fd
        counters.misses += 1
        self._telemetry.lookup(identity, hit=False, reason="no checkpoint")
        return None

    def forget_checkpoint(self, identity: Identity, key: str) -> int:
        """The generation finished: drop its checkpoints, pending ones included."""
        records = self._catalog.checkpoints(identity.digest(), key)
        for record in records:
            self._writer.withdraw(record, "checkpoint forgotten")
            self._catalog.drop(record)  # one in flight is deleted once its write ends
        return len(records)

    # --- leases and the descriptors under them --------------------------------------------------

    def lease_entry(self, owner: int, entry: str) -> tuple[EntryRecord, int, int] | None:
        """A durable entry by id, opened read-only and leased to owner (its blocks then come
        from open_blocks; what they are, from TierView.blocks_of); None when it is gone or
        cannot be read now."""
        record = self._catalog.records.get(entry)
        if record is None or not record.durable:
            return None
        fd = self._catalog.open(record, self._quarantine.now)
        return None if fd is None else (record, self._leases.grant(owner, record), fd)

    def open_entry(self, owner: int, entry: str) -> tuple[EntryRecord, int, int]:
        """lease_entry for a connection (kvctl export): within its leases, NOT_FOUND (saying
        why) when the entry is not there or not durable yet."""
        self._check_leases(owner)
        found = self.lease_entry(owner, entry)
        if found is None:
            pending = self._catalog.records.get(entry) is not None
            why = "it is not durable yet: flush first" if pending else "no such entry"
            raise ProtocolError(ErrorCode.NOT_FOUND, f"entry {entry}: {why}")
        return found

    def open_blocks(self, owner: int, lease_id: int, first: int, count: int) -> list[int]:
        """Read-only descriptors of blocks first.. of the entry under the owner's lease, each
        opened without following links and checked by fstat against its size. A block gone or
        not what the tier says is quarantined with every manifest listing it; either that or
        one unreadable now (EIO, no descriptor free) is NOT_FOUND (block_missing), and the
        engine's restore a miss."""
        lease = self._leases.lease(owner, lease_id)
        record = lease.record
        blocks = self._catalog.blocks_of(record)
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
            candidates.append(self._catalog.dirs.block_path(block.digest, block.hash))
        for path in candidates:
            try:
                return entry_files.open_entry(path, block.size, block.mtime_ns)
            except FileNotFoundError:
                continue
            except entry_files.ChangedError as exc:  # start-up's listing reads it again
                log.warning("block_changed_since_snapshot", block=block.hash.hex(), reason=str(exc))
                return None
            except EntryFormatError as exc:  # never handed out
                self._writer.bad_block(block, str(exc))
                return None
            except OSError as exc:  # EIO, or out of descriptors: not now, the block kept
                log.warning("block_unreadable", block=block.hash.hex(), error=str(exc))
                return None
        if self._catalog.block_store.get(block.digest, block.hash) is block:
            self._writer.bad_block(block, "its file is gone")
        return None

    def _check_leases(self, owner: int) -> None:
        if self._leases.count_of(owner) >= self._max_leases:
            raise ProtocolError(
                ErrorCode.OVER_LIMIT,
                f"{self._max_leases} leases taken on this connection: release some first",
            )

    def end_lease(
        self, owner: int, lease_id: int, report: RestoreReport | None = None
    ) -> EntryRecord:
        """End a lease; its entry's record. report: how the engine's restore went, for the
        telemetry."""
        record = self._leases.release(owner, lease_id)
        if report is not None:
            self._telemetry.restored(record.digest, report, time.time())
            if report.miss is not None:
                self._catalog.counters.hit_unused()
        return record

    async def check_reported(self, owner: int, record: EntryRecord, damaged: str) -> None:
        """A client could not use the entry's file (damaged: why): see EntryChecks.reported."""
        await self._checks.reported(owner, record, damaged)
