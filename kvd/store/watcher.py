"""Entries added or removed behind the daemon's back: noticed by watchfiles, and by a periodic
full reconcile for what events miss (inotify overflow, FSEvents drops).

Whatever appears under the entries folder is adopted, quarantined or ignored, with a log line;
none of it stops the daemon:
- an entry file that disappears takes its entry out of the index (never served again);
- a valid entry file that appears in its identity's folder is adopted (a copy from another
  machine, a restore from backup), and so are the entries of a new identity folder;
- an invalid one, a symbolic link, a file in another identity's folder, or a copy of an
  indexed entry under another name (a duplicate) is quarantined;
- an indexed entry file modified in place (entries are written once) is validated again, data
  included, and quarantined if it no longer holds what the index says;
- shared blocks (`<identity>/blocks/<hash>.kvb`): a block file removed, or modified so that it
  no longer validates, takes every manifest listing it out of the index (quarantined,
  block_missing); a valid block file no manifest lists is an orphan, collected once the
  batch's manifests are adopted (copy a manifest's blocks in with it, or before it in the
  same batch); an invalid one is quarantined;
- anything else (a file that is not `<identity>/<id>.kve` or a block, a folder deeper down)
  is ignored. Files being copied in under a temporary name are left alone until renamed.
Files the daemon writes or deletes itself are recognised by their entry id and left alone.
If the entries folder itself is removed, it is made again and the index follows. A batch
that cannot be listed for want of a descriptor (the daemon at its open-file limit) changes
nothing and is left to the next full reconcile.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from kvd_protocol.blocks import parse_block_name
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits
from watchfiles import Change, awatch

from kvd.logs import get_logger
from kvd.store import entry_files
from kvd.store.blocks import Block
from kvd.store.records import EntryRecord, record_from_header
from kvd.store.tier import Tier
from kvd.store.tier_dir import BLOCKS_FOLDER, ENTRY_SUFFIX

log = get_logger("kvd.store.watcher")


async def watch_entries(tier: Tier, *, reconcile_first: bool = False) -> None:
    """React to changes under the entries folder until cancelled.

    reconcile_first: catch up with the whole folder first, as a restarted watch must (the
    first one starts once start-up has listed the directory: Tier.settle).
    """
    await tier.settled.wait()
    while True:
        await anyio.to_thread.run_sync(_make_folder, tier.dirs.entries)
        if reconcile_first:
            await reconcile(tier, None)
        root = _root(tier)  # FSEvents reports resolved paths
        # rust_timeout bounds how long the watch thread takes to notice a cancel (at shutdown).
        async for changes in awatch(root, recursive=True, rust_timeout=200):
            if (Change.deleted, str(root)) in changes:
                log.warning("entries_folder_removed", path=str(root))
                break  # a watch of a removed folder sees nothing more: make it again
            await reconcile(tier, changes)
        reconcile_first = True


async def reconcile_periodically(tier: Tier, every: float) -> None:
    await tier.settled.wait()
    while True:
        await anyio.sleep(every)
        await reconcile(tier, None)


def _make_folder(path: Path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)


def _root(tier: Tier) -> Path:
    return Path(os.path.realpath(tier.dirs.entries))


def _place(root: Path, path: Path) -> tuple[str, ...] | None:
    """The path's parts under root, its folders resolved but not its own name (a symbolic
    link is judged as itself, not as what it points to); None outside root."""
    resolved = Path(os.path.realpath(path.parent)) / path.name
    try:
        return resolved.relative_to(root).parts
    except ValueError:
        return None


def _entry_id(name: str) -> str | None:
    return name[: -len(ENTRY_SUFFIX)] if name.endswith(ENTRY_SUFFIX) else None


@dataclass
class Changed:
    """What a batch of events (or a whole listing) names: entry files by id, the ids of
    those modified in place, and block files (by path) with those modified in place."""

    entries: dict[str, Path] = field(default_factory=dict)
    modified: set[str] = field(default_factory=set)
    blocks: set[Path] = field(default_factory=set)
    blocks_modified: set[Path] = field(default_factory=set)
    empty_folders: set[Path] = field(default_factory=set)  # identity folders with no file


def _listing(root: Path) -> Changed:
    """Every entry and block file under root (blocking: run in a thread)."""
    found = Changed()
    for folder in os.scandir(root):
        if folder.is_dir(follow_symlinks=False):
            path = Path(folder.path)
            entries = _folder_listing(path)
            blocks = _blocks_listing(path / BLOCKS_FOLDER)
            found.entries |= entries
            found.blocks |= blocks
            if not entries and not blocks and _holds_nothing_else(path):
                found.empty_folders.add(path)
    return found


def _holds_nothing_else(folder: Path) -> bool:
    """Whether an identity folder holds nothing but, perhaps, its (empty) blocks folder."""
    try:
        with os.scandir(folder) as entries:
            return all(entry.name == BLOCKS_FOLDER for entry in entries)
    except OSError:
        return False


def _blocks_listing(folder: Path) -> set[Path]:
    """The files of one identity's blocks folder (blocking: run in a thread)."""
    try:
        with os.scandir(folder) as entries:
            return {Path(entry.path) for entry in entries}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _folder_listing(folder: Path) -> dict[str, Path]:
    """The entry files of one identity folder by entry id (blocking: run in a thread)."""
    found: dict[str, Path] = {}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                entry_id = _entry_id(entry.name)
                if entry_id is not None:
                    found[entry_id] = Path(entry.path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # gone again, or not a folder after all
    return found


def _changed_entries(root: Path, changes: Iterable[tuple[Change, str]]) -> Changed:
    """Entry and block files named by a batch of events (those of a new identity or blocks
    folder included), and those modified in place (blocking: run in a thread)."""
    found = Changed()
    candidates, modified = found.entries, found.modified
    for change, name in changes:
        path = Path(name)
        parts = _place(root, path)
        if parts is None or not parts:
            continue
        if len(parts) == 1:
            if path.is_dir() and not path.is_symlink():
                if change is Change.added:  # a new identity folder, with its files
                    candidates |= _folder_listing(path)
                    found.blocks |= _blocks_listing(path / BLOCKS_FOLDER)
            elif change is not Change.deleted:
                log.info("foreign_file_ignored", path=str(path), reason="not in an identity folder")
            continue
        if parts[1] == BLOCKS_FOLDER:
            if len(parts) == 2 and change is Change.added:
                found.blocks |= _blocks_listing(path)
            elif len(parts) == 3:
                found.blocks.add(path)
                if change is Change.modified:
                    found.blocks_modified.add(path)
            continue
        entry_id = _entry_id(parts[-1]) if len(parts) == 2 else None
        if entry_id is None:
            if change is not Change.deleted and os.path.lexists(path):
                log.info("foreign_file_ignored", path=str(path), reason="not an entry file")
            continue
        candidates[entry_id] = path
        if change is Change.modified:
            modified.add(entry_id)
    return found


async def reconcile(tier: Tier, changes: Iterable[tuple[Change, str]] | None) -> None:
    """Make the index agree with the paths of a batch of events (None: the whole entries
    folder).

    Entries are matched by id (their file name), so a batch of events costs its own size,
    not the size of the tier.
    """
    catalog = tier.catalog
    root = _root(tier)
    try:
        if changes is None:
            found = await anyio.to_thread.run_sync(_listing, root)
        else:
            found = await anyio.to_thread.run_sync(_changed_entries, root, changes)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        # No descriptor free to list a folder (the server is at its limit): nothing is
        # changed on a half listing; the next full reconcile catches up.
        log.warning("reconcile_deferred", reason=str(exc))
        return
    if changes is None:
        on_disk = found.entries
        durable = {r.id: r for r in catalog.durable()}
        gone = durable.keys() - on_disk.keys()
        candidates = {**on_disk, **{i: catalog.path_of(durable[i]) for i in gone}}
        found.blocks |= {b.path for b in catalog.blocks if b.durable}  # those gone, too
    else:
        candidates = found.entries
        on_disk = {i: p for i, p in candidates.items() if os.path.lexists(p)}
    modified = found.modified
    # Blocks first: a manifest copied in with its blocks finds them held.
    adopted = []
    for path in found.blocks:
        block = await _reconcile_block(tier, root, path, path in found.blocks_modified)
        if block is not None:
            adopted.append(block)
    for entry_id, path in candidates.items():
        if catalog.is_doomed(entry_id):
            continue  # removed from the index, its file kept until its last lease ends
        record = catalog.records.get(entry_id)
        if record is None:
            if entry_id in on_disk:
                await _adopt(tier, path)
        elif not record.durable:
            continue  # the writer's own file, on its way into place
        elif entry_id not in on_disk:
            log.warning("entry_removed_outside", entry=record.id)
            catalog.drop(record)
        elif path.parent.name != record.identity:
            # The same name in another identity's folder: not where this entry lives.
            await tier.quarantine.file(path, "a copy of an entry in another identity's folder")
        elif entry_id in modified:
            await _recheck(tier, record, path)
    orphans = catalog.blocks.collect_orphans(adopted)
    if orphans:
        log.info("orphan_blocks_collected", count=orphans)
    tier.evict_to_cap()
    if found.empty_folders:
        tier.remove_empty_folders(found.empty_folders)


async def _reconcile_block(tier: Tier, root: Path, path: Path, modified: bool) -> Block | None:
    """Make the block store agree with one path under a blocks folder; the block adopted, if
    it was unknown (no manifest lists it yet)."""
    parts = _place(root, path)
    block_hash = parse_block_name(path.name)
    if parts is None or len(parts) != 3 or block_hash is None:
        if os.path.lexists(path):
            log.info("foreign_file_ignored", path=str(path), reason="not a block file")
        return None
    identity = parts[0]
    block = tier.catalog.blocks.get(identity, block_hash)
    if block is not None and not block.durable:
        return None  # the writer's own, on its way into place
    if not os.path.lexists(path):
        if block is not None and not os.path.lexists(block.path):
            log.warning("block_removed_outside", block=path.name, identity=identity)
            tier.writer.bad_block(block, "its file was removed behind the daemon's back")
        return None
    if block is not None and not modified:
        return None
    try:
        header = await anyio.to_thread.run_sync(entry_files.read_block_header, path, tier.limits)
        if header.identity != identity:
            raise EntryFormatError(path.name, Rule.SCHEMA, "its identity is not its folder's")
        if block is not None and header.file_size != block.size:
            raise EntryFormatError(path.name, Rule.FILE_SIZE, "not the block the store holds")
    except FileNotFoundError:
        return None  # removed meanwhile: its deletion event follows
    except (EntryFormatError, OSError) as exc:
        if block is None:
            await tier.quarantine.file(path, str(exc))
        elif tier.catalog.blocks.get(identity, block_hash) is block:
            log.warning("block_modified_outside", block=path.name, reason=str(exc))
            tier.writer.bad_block(block, str(exc))
        return None
    if block is not None or tier.catalog.blocks.get(identity, block_hash) is not None:
        return None
    # Held with no ref: the manifests of this batch attach to it, or it is collected.
    return tier.catalog.blocks.adopt(identity, block_hash, header.file_size, path)


async def _adopt(tier: Tier, path: Path) -> None:
    try:
        header = await anyio.to_thread.run_sync(entry_files.read_header, path, tier.limits)
        if header.identity.digest() != path.parent.name:
            raise EntryFormatError(path.name, Rule.SCHEMA, "its identity is not its folder's")
    except (EntryFormatError, OSError) as exc:
        await tier.quarantine.file(path, str(exc))
        return
    record = record_from_header(path.stem, header, last_used=tier.catalog.tick())
    if path.stem in tier.catalog.records:  # adopted meanwhile (a second event for the same file)
        return
    problem = tier.catalog.unservable(record)
    if problem is not None:
        await tier.quarantine.file(path, problem)
        return
    try:
        tier.catalog.add(record)
    except ValueError:  # the same tokens as an indexed entry: a copy under another name
        await tier.quarantine.file(path, "a duplicate of another entry")
        return
    log.info("entry_adopted", entry=record.id, identity=record.identity)


def _still_valid(path: Path, record: EntryRecord, limits: Limits) -> None:
    """Raise EntryFormatError unless the file still holds the indexed entry, data included
    (blocking: run in a thread)."""
    header = entry_files.read_header(path, limits)
    if header.file_size != record.nbytes or header.tokens != record.tokens:
        raise EntryFormatError(path.name, Rule.SCHEMA, "not the entry the index holds")
    entry_files.verify_data(path, header)


async def _recheck(tier: Tier, record: EntryRecord, path: Path) -> None:
    """An indexed entry's file was modified in place: keep it only if still valid."""
    try:
        await anyio.to_thread.run_sync(_still_valid, path, record, tier.limits)
    except FileNotFoundError:
        return  # removed meanwhile: its deletion event follows
    except (EntryFormatError, OSError) as exc:
        log.warning("entry_modified_outside", entry=record.id, reason=str(exc))
        await tier.quarantine.file(path, str(exc))
        tier.catalog.drop(record)  # its file is in quarantine: nothing left to unlink here
