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
from pathlib import Path

import anyio
from watchfiles import Change, awatch

from kvd.logs import get_logger
from kvd.store.adoption import Changed, place
from kvd.store.life_cycle import LifeCycle
from kvd.store.tier_dir import BLOCKS_FOLDER, ENTRY_SUFFIX

log = get_logger("kvd.store.watcher")


async def watch_entries(life: LifeCycle, *, reconcile_first: bool = False) -> None:
    """React to changes under the entries folder until cancelled.

    reconcile_first: catch up with the whole folder first, as a restarted watch must (the
    first one starts once start-up has listed the directory: LifeCycle.settle).
    """
    await life.wait_settled()
    while True:
        await anyio.to_thread.run_sync(_make_folder, life.entries_folder())
        if reconcile_first:
            await reconcile(life, None)
        root = _root(life)  # FSEvents reports resolved paths
        # rust_timeout bounds how long the watch thread takes to notice a cancel (at shutdown).
        async for changes in awatch(root, recursive=True, rust_timeout=200):
            if (Change.deleted, str(root)) in changes:
                log.warning("entries_folder_removed", path=str(root))
                break  # a watch of a removed folder sees nothing more: make it again
            await reconcile(life, changes)
        reconcile_first = True


async def reconcile_periodically(life: LifeCycle, every: float) -> None:
    await life.wait_settled()
    while True:
        await anyio.sleep(every)
        await reconcile(life, None)


def _make_folder(path: Path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)


def _root(life: LifeCycle) -> Path:
    return Path(os.path.realpath(life.entries_folder()))


def _entry_id(name: str) -> str | None:
    return name[: -len(ENTRY_SUFFIX)] if name.endswith(ENTRY_SUFFIX) else None


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
        parts = place(root, path)
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


async def reconcile(life: LifeCycle, changes: Iterable[tuple[Change, str]] | None) -> None:
    """Make the index agree with the paths of a batch of events (None: the whole entries
    folder): see LifeCycle.adopt."""
    root = _root(life)
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
    await life.adopt(root, found, everything=changes is None)
