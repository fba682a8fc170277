"""Whole-file checks of stored entries: the one a client asks for (`verify`), the one a
damage report starts, and the check itself (head, blocks and every checksum), which
quarantines what fails when asked to repair. Their turns are CheckLimit's."""

from __future__ import annotations

import anyio
from kvd_protocol.blocks import block_name
from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError, Rule
from kvd_protocol.limits import Limits

from kvd.logs import RateLimited, get_logger
from kvd.store import entry_files
from kvd.store.catalog import Catalog
from kvd.store.check_limit import CheckLimit
from kvd.store.quarantine import Quarantine
from kvd.store.records import EntryRecord
from kvd.store.writer import Writer

log = get_logger("kvd.store.entry_checks")
broken_rules = RateLimited(log)  # a client may report damage as often as it likes


class EntryChecks:
    """The checks of the tier's entries. Owned by the event loop."""

    def __init__(
        self, catalog: Catalog, quarantine: Quarantine, writer: Writer, limits: Limits
    ) -> None:
        self.catalog = catalog
        self.quarantine = quarantine
        self.writer = writer
        self.limits = limits
        self.limit = CheckLimit()  # the turns of checks clients ask for
        self._checking: set[str] = set()  # entries reported damaged, being checked

    def counts(self) -> dict[str, int]:
        """Checks run, refused and skipped since start."""
        return self.limit.counts()

    async def reported(self, owner: int, record: EntryRecord, damaged: str) -> None:
        """A client could not use the entry's file (damaged: why): the file is checked and
        quarantined if it fails (a client's word alone never removes an entry). A pending
        entry was checked whole at its commit. Checks are bounded (CheckLimit): a report that finds
        no turn, or names an entry found intact a moment ago, is logged and not checked."""
        if not record.durable or record.id in self._checking:
            return  # checked at its commit, or another engine reported it too: one check
        if self.limit.recently_intact(record.id):
            self.limit.skipped += 1
            broken_rules.warning(
                "reported_damage_skipped", entry=record.id, reason="checked lately"
            )
            return
        self._checking.add(record.id)
        try:
            async with self.limit.turn(owner):
                problem = await self.entry(record, repair=True)
        except ProtocolError as exc:
            broken_rules.warning("reported_damage_skipped", entry=record.id, reason=exc.message)
            return
        except OSError as exc:
            log.warning("reported_entry_unreadable", entry=record.id, error=str(exc))
            return
        finally:
            self._checking.discard(record.id)
        if problem is None:
            self.limit.found_intact(record.id)
            broken_rules.warning("reported_damage_not_found", entry=record.id, reported=damaged)

    async def entry(self, record: EntryRecord, *, repair: bool) -> str | None:
        """Validate a durable entry's file whole, head and every tensor's checksum: None if it
        is intact, else what is wrong; with repair, a damaged file is quarantined and its
        entry dropped. Raises OSError when the file cannot be read at all."""
        path = self.catalog.path_of(record)
        try:
            header = await anyio.to_thread.run_sync(entry_files.verify_entry, path, self.limits)
            if header.block_hashes != record.block_hashes:
                raise EntryFormatError(path.name, Rule.SCHEMA, "not the blocks the index holds")
        except EntryFormatError as exc:
            if repair and record.id in self.catalog.records:  # not dropped meanwhile
                await self.quarantine.file(path, str(exc))  # first: dropping would unlink it
                self.catalog.drop(record)
            return str(exc)
        for index, block in enumerate(self.catalog.blocks_of(record)):
            name = block_name(block.hash)
            try:
                await anyio.to_thread.run_sync(
                    entry_files.verify_block, block.path, name, header, index, self.limits
                )
            except (EntryFormatError, FileNotFoundError) as exc:
                if repair and self.catalog.block_store.get(block.digest, block.hash) is block:
                    self.writer.bad_block(block, str(exc))  # with every manifest listing it
                return f"block {index} ({name}): {exc}"
        return None

    async def verify(self, owner: int, entry: str, repair: bool) -> tuple[str | None, bool]:
        """Check one durable entry by id for owner's connection: (what is wrong or None,
        whether it was quarantined). REFUSED or OVER_LIMIT when it finds no turn (CheckLimit)."""
        record = self.catalog.records.get(entry)
        if record is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no entry {entry}")
        if not record.durable:
            raise ProtocolError(
                ErrorCode.NOT_FOUND, f"entry {entry} is pending: its commit checked it"
            )
        try:
            async with self.limit.turn(owner):
                problem = await self.entry(record, repair=repair)
        except OSError as exc:
            if entry not in self.catalog.records:  # evicted while it waited or was read
                raise ProtocolError(
                    ErrorCode.NOT_FOUND, f"entry {entry} left the tier while it was checked"
                ) from None
            return f"unreadable: {exc}", False
        return problem, problem is not None and repair and entry not in self.catalog.records
