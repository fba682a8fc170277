"""What the daemon makes of files added, changed or removed under its entries folder behind
its back (the watcher finds them): each adopted, quarantined, taken out of the index or left
alone; see kvd.store.watcher for the rules."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from kvd_protocol.blocks import parse_block_name
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

from kvd.logs import get_logger
from kvd.store import entry_files
from kvd.store.blocks import Block
from kvd.store.catalog import Catalog
from kvd.store.quarantine import Quarantine
from kvd.store.records import EntryRecord, record_from_header
from kvd.store.tier_dir import BLOCKS_FOLDER
from kvd.store.writer import Writer

log = get_logger("kvd.store.adoption")


@dataclass
class Changed:
    """What a batch of events (or a whole listing) names: entry files by id, the ids of
    those modified in place, and block files (by path) with those modified in place."""

    entries: dict[str, Path] = field(default_factory=dict)
    modified: set[str] = field(default_factory=set)
    blocks: set[Path] = field(default_factory=set)
    blocks_modified: set[Path] = field(default_factory=set)
    empty_folders: set[Path] = field(default_factory=set)  # identity folders with no file


def place(root: Path, path: Path) -> tuple[str, ...] | None:
    """The path's parts under root, its folders resolved but not its own name (a symbolic
    link is judged as itself, not as what it points to); None outside root."""
    resolved = Path(os.path.realpath(path.parent)) / path.name
    try:
        return resolved.relative_to(root).parts
    except ValueError:
        return None


class Adoption:
    """The index made to agree with what a listing of the entries folder found."""

    def __init__(
        self, catalog: Catalog, writer: Writer, quarantine: Quarantine, limits: Limits
    ) -> None:
        self._catalog = catalog
        self._writer = writer
        self._quarantine = quarantine
        self._limits = limits

    async def reconcile(self, root: Path, found: Changed, everything: bool) -> None:
        """Make the index agree with the paths found under root (its real path): those of a
        batch of events, or everything: the whole folder, when entries and blocks the index
        holds and the listing does not are gone.

        Entries are matched by id (their file name), so a batch of events costs its own size,
        not the size of the tier.
        """
        if everything:
            on_disk = found.entries
            durable = {r.id: r for r in self._catalog.durable()}
            gone = durable.keys() - on_disk.keys()
            candidates = {**on_disk, **{i: self._catalog.path_of(durable[i]) for i in gone}}
            found.blocks |= {
                b.path for b in self._catalog.block_store if b.durable
            }  # those gone, too
        else:
            candidates = found.entries
            on_disk = {i: p for i, p in candidates.items() if os.path.lexists(p)}
        modified = found.modified
        # Blocks first: a manifest copied in with its blocks finds them held.
        adopted = []
        for path in found.blocks:
            if self._let_go(root, path):
                continue
            block = await self._reconcile_block(root, path, path in found.blocks_modified)
            if block is not None:
                adopted.append(block)
        for entry_id, path in candidates.items():
            if self._catalog.is_doomed(entry_id):
                continue  # removed from the index, its file kept until its last lease ends
            record = self._catalog.records.get(entry_id)
            if record is None:
                if entry_id in on_disk and not self._let_go(root, path):
                    await self._adopt(path)
            elif not record.durable:
                continue  # the writer's own file, on its way into place
            elif entry_id not in on_disk:
                log.warning("entry_removed_outside", entry=record.id)
                self._catalog.drop(record)
            elif path.parent.name != record.digest:
                # The same name in another identity's folder: not where this entry lives.
                await self._quarantine.file(path, "a copy of an entry in another identity's folder")
            elif entry_id in modified:
                await self._recheck(record, path)
        orphans = self._catalog.block_store.collect_orphans(adopted)
        if orphans:
            log.info("orphan_blocks_collected", count=orphans)

    def _let_go(self, root: Path, path: Path) -> bool:
        """Whether path is a file the tier let go of, still leaving its place (deleter.py)."""
        parts = place(root, path)
        return parts is not None and self._catalog.deleter.leaving(
            self._catalog.dirs.entries.joinpath(*parts)
        )

    async def _reconcile_block(self, root: Path, path: Path, modified: bool) -> Block | None:
        """Make the block store agree with one path under a blocks folder; the block adopted, if
        it was unknown (no manifest lists it yet)."""
        parts = place(root, path)
        block_hash = parse_block_name(path.name)
        if parts is None or len(parts) != 3 or block_hash is None:
            if os.path.lexists(path):
                log.info("foreign_file_ignored", path=str(path), reason="not a block file")
            return None
        digest = parts[0]
        block = self._catalog.block_store.get(digest, block_hash)
        if block is not None and not block.durable:
            return None  # the writer's own, on its way into place
        if not os.path.lexists(path):
            if block is not None and not os.path.lexists(block.path):
                log.warning("block_removed_outside", block=path.name, identity=digest)
                self._writer.bad_block(block, "its file was removed behind the daemon's back")
            return None
        if block is not None and not modified:
            return None
        try:
            header = await anyio.to_thread.run_sync(
                entry_files.read_block_header, path, self._limits
            )
            if header.digest != digest:
                raise EntryFormatError(path.name, Rule.SCHEMA, "its identity is not its folder's")
            if block is not None and header.file_size != block.size:
                raise EntryFormatError(path.name, Rule.FILE_SIZE, "not the block the store holds")
        except FileNotFoundError:
            return None  # removed meanwhile: its deletion event follows
        except (EntryFormatError, OSError) as exc:
            if block is None:
                await self._quarantine.file(path, str(exc))
            elif self._catalog.block_store.get(digest, block_hash) is block:
                log.warning("block_modified_outside", block=path.name, reason=str(exc))
                self._writer.bad_block(block, str(exc))
            return None
        if block is not None or self._catalog.block_store.get(digest, block_hash) is not None:
            return None
        # Held with no ref: the manifests of this batch attach to it, or it is collected.
        return self._catalog.block_store.adopt(digest, block_hash, header.file_size, path)

    async def _adopt(self, path: Path) -> None:
        try:
            header = await anyio.to_thread.run_sync(entry_files.read_header, path, self._limits)
            if header.identity.digest() != path.parent.name:
                raise EntryFormatError(path.name, Rule.SCHEMA, "its identity is not its folder's")
        except (EntryFormatError, OSError) as exc:
            await self._quarantine.file(path, str(exc))
            return
        record = record_from_header(path.stem, header, last_used=self._catalog.tick())
        if (
            path.stem in self._catalog.records
        ):  # adopted meanwhile (a second event for the same file)
            return
        problem = self._catalog.unservable(record)
        if problem is not None:
            await self._quarantine.file(path, problem)
            return
        try:
            self._catalog.add(record)
        except ValueError:  # the same tokens as an indexed entry: a copy under another name
            await self._quarantine.file(path, "a duplicate of another entry")
            return
        log.info("entry_adopted", entry=record.id, identity=record.digest)

    async def _recheck(self, record: EntryRecord, path: Path) -> None:
        """An indexed entry's file was modified in place: keep it only if still valid."""
        try:
            await anyio.to_thread.run_sync(_still_valid, path, record, self._limits)
        except FileNotFoundError:
            return  # removed meanwhile: its deletion event follows
        except (EntryFormatError, OSError) as exc:
            log.warning("entry_modified_outside", entry=record.id, reason=str(exc))
            await self._quarantine.file(path, str(exc))
            self._catalog.drop(record)  # its file is in quarantine: nothing left to unlink here

    def remove_empty_folders(self, folders: Iterable[Path]) -> int:
        """Remove identity folders a listing found empty, whose identity the tier no longer
        holds (no entry, pending ones included, no block, none being written): clients name
        identities at will, and each would otherwise keep a folder, and the watcher a watch
        on it, for ever. On the event loop (an rmdir of an empty folder or two), so that no
        entry of the identity can be added meanwhile; the writer makes its folders again when
        it needs them. How many went."""
        removed = 0
        for folder in folders:
            digest = folder.name
            if self._catalog.holds(digest) or self._catalog.block_store.identity_bytes(digest):
                continue
            if self._writer.writing(digest):
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    (folder / BLOCKS_FOLDER).rmdir()
                folder.rmdir()
            except OSError as exc:  # not empty after all (a file came), or gone
                log.debug("folder_kept", folder=folder.name, error=str(exc))
                continue
            removed += 1
        if removed:
            log.info("empty_identity_folders_removed", count=removed)
        return removed


def _still_valid(path: Path, record: EntryRecord, limits: Limits) -> None:
    """Raise EntryFormatError unless the file still holds the indexed entry, data included
    (blocking: run in a thread)."""
    header = entry_files.read_header(path, limits)
    if header.file_size != record.nbytes or header.tokens != record.tokens:
        raise EntryFormatError(path.name, Rule.SCHEMA, "not the entry the index holds")
    entry_files.verify_data(path, header)
