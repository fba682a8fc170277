"""Puts: a staging file handed to an engine, then committed (or aborted, or abandoned).

begin hands out a staging file, unless the tier already holds the entry (or one covering
it) or the queue has no room; the engine writes the entry into it; commit validates the
header against what begin declared and hands the entry to the writer. A put belongs to the
connection that began it: only that one may commit or abort it, and its end abandons it.
"""

from __future__ import annotations

import errno
import itertools
from dataclasses import dataclass
from pathlib import Path

import anyio
from kvd_protocol.entry import EntryHeader
from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits

from kvd import entry_files
from kvd.catalog import Catalog
from kvd.config import Config
from kvd.quarantine import Quarantine
from kvd.records import EntryRecord
from kvd.tickets import Tickets
from kvd.tier_dir import new_entry_id
from kvd.writer import Writer


@dataclass(eq=False)
class Put:
    """A staging file handed to an engine, not yet committed."""

    id: int
    owner: int  # the connection that began it
    identity: Identity
    tokens: bytes
    size: int
    path: Path


class Puts:
    """The puts begun and not yet committed, by id and by owner."""

    def __init__(
        self,
        config: Config,
        limits: Limits,
        *,
        catalog: Catalog,
        writer: Writer,
        tickets: Tickets,
        quarantine: Quarantine,
    ) -> None:
        self._config = config
        self._limits = limits
        self._catalog = catalog
        self._writer = writer
        self._tickets = tickets
        self._quarantine = quarantine
        self._puts: dict[int, Put] = {}
        self._by_owner: dict[int, dict[int, None]] = {}
        self._ids = itertools.count(1)

    async def begin(
        self, owner: int, identity: Identity, tokens: bytes, size: int
    ) -> tuple[Put | None, str | None, int | None]:
        """A staging file for a new entry, or the reason none is needed.

        Returns (put, None, fd) or (None, "duplicate" | "covered", None).
        """
        if size > self._config.max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"an entry of {size} bytes cannot fit under the tier cap of "
                f"{self._config.max_bytes} bytes",
            )
        index = self._catalog.index(identity.digest())
        if index is not None:
            if index.exact(tokens) is not None:
                self._catalog.counters.duplicates += 1
                return None, "duplicate", None
            if index.covering(tokens) is not None:
                self._catalog.counters.duplicates += 1
                return None, "covered", None
        if not await self._writer.make_room(size):
            # Before the engine spends time writing. Not one of the queue's refusals: nothing
            # was offered to the queue yet.
            raise ProtocolError(ErrorCode.REFUSED, self._writer.no_room(size))
        put_id = next(self._ids)
        path = self._catalog.dirs.staging_path(f"{put_id}-{new_entry_id()}")
        try:
            fd = await anyio.to_thread.run_sync(entry_files.create_staging, path, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ProtocolError(ErrorCode.NO_SPACE, f"no space for {size} bytes") from None
            raise
        put = Put(put_id, owner, identity, tokens, size, path)
        self._puts[put_id] = put
        self._by_owner.setdefault(owner, {})[put_id] = None
        return put, None, fd

    def take(self, owner: int, put_id: int) -> Put:
        """The owner's put, now the caller's: to commit or to abort."""
        put = self._puts.get(put_id)
        if put is None or put.owner != owner:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no put {put_id} on this connection")
        del self._puts[put_id]
        owned = self._by_owner[owner]
        del owned[put_id]
        if not owned:
            del self._by_owner[owner]
        return put

    def abort(self, put: Put) -> None:
        entry_files.unlink_quietly(put.path)

    def abandon_all(self, owner: int) -> None:
        """The owner's connection ended: its uncommitted staging files go."""
        for put_id in self._by_owner.pop(owner, {}):
            self._catalog.counters.abandoned += 1
            self.abort(self._puts.pop(put_id))

    async def commit(self, put: Put) -> int:
        """Validate the written header, index the entry and queue it; returns its ticket.

        The put is the caller's from take() on: unless it is queued, its staging file goes
        here, whatever ends the commit (a refusal, a bad file, the putter hanging up while
        it waits for room).
        """
        queued = False
        try:
            header = await self._read_header(put)
            await self._writer.make_room(put.size)  # if there is none, the queue refuses below
            # No await from here on: the index cannot change between the check and the add.
            digest = put.identity.digest()
            key = header.checkpoint.key if header.checkpoint else None
            index = self._catalog.index(digest)
            if key is None and index is not None and index.exact(put.tokens) is not None:
                # Same identity and tokens: the same cache. Keep the entry we have.
                self._catalog.counters.duplicates += 1
                ticket = self._tickets.issue()
                self._tickets.settle(ticket, "stored", "duplicate")
                return ticket
            record = EntryRecord(
                id=new_entry_id(),
                identity=digest,
                tokens=put.tokens,
                nbytes=put.size,
                trimmable=header.trimmable,
                min_reuse=header.min_reuse,
                created=header.created,
                last_used=self._catalog.tick(),
                checkpoint_key=key,
            )
            ticket = self._writer.enqueue(record, header, put.path)
            queued = True
            return ticket
        finally:
            if not queued:
                entry_files.unlink_quietly(put.path)

    async def _read_header(self, put: Put) -> EntryHeader:
        """The staging file's validated header; a bad file is quarantined (INVALID_ENTRY)."""
        try:
            header = await anyio.to_thread.run_sync(entry_files.read_header, put.path, self._limits)
            _check_matches_put(header, put)
        except EntryFormatError as exc:
            await self._quarantine.file(put.path, str(exc))
            raise ProtocolError(ErrorCode.INVALID_ENTRY, str(exc)) from None
        return header


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
