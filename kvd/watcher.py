"""Entries added or removed behind the daemon's back: noticed by watchfiles, and by a periodic
full reconcile for what events miss (inotify overflow, files in a new folder, FSEvents drops).

An entry file that disappears takes its entry out of the index (never served again); a valid
entry file that appears in its identity's folder is adopted (a copy from another machine, a
restore from backup); an invalid one is quarantined. Files the daemon writes or deletes itself
are recognised by their entry id and left alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import anyio
from kvd_protocol.errors import EntryFormatError, Rule
from watchfiles import Change, awatch

from kvd import entry_files
from kvd.logs import get_logger
from kvd.records import record_from_header
from kvd.tier import Tier
from kvd.tier_dir import ENTRY_SUFFIX

log = get_logger("kvd.watcher")


def _is_entry_file(change: Change, path: str) -> bool:
    return path.endswith(ENTRY_SUFFIX)


async def watch_entries(tier: Tier) -> None:
    """React to changes under the entries folder until cancelled."""
    root = Path(os.path.realpath(tier.dirs.entries))  # FSEvents reports resolved paths
    # rust_timeout bounds how long the watch thread takes to notice a cancel (at shutdown).
    async for changes in awatch(
        root, watch_filter=_is_entry_file, recursive=True, rust_timeout=200
    ):
        await reconcile(tier, {Path(path) for _, path in changes})


async def reconcile_periodically(tier: Tier, every: float) -> None:
    while True:
        await anyio.sleep(every)
        await reconcile(tier, None)


def _entry_id(root: Path, path: Path) -> str | None:
    """The entry id of root/<identity>/<id>.kve; None for any other path."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return None
    if len(parts) != 2 or not parts[1].endswith(ENTRY_SUFFIX):
        return None
    return parts[1][: -len(ENTRY_SUFFIX)]


def _listing(root: Path) -> dict[str, Path]:
    """Every entry file under root by entry id (blocking: run in a thread)."""
    found: dict[str, Path] = {}
    for folder in os.scandir(root):
        if folder.is_dir(follow_symlinks=False):
            for entry in os.scandir(folder.path):
                if entry.name.endswith(ENTRY_SUFFIX):
                    found[entry.name[: -len(ENTRY_SUFFIX)]] = Path(entry.path)
    return found


async def reconcile(tier: Tier, paths: Iterable[Path] | None) -> None:
    """Make the index agree with the given paths (None: the whole entries folder).

    Entries are matched by id (their file name), so a batch of events costs its own size,
    not the size of the tier.
    """
    catalog = tier.catalog
    root = Path(os.path.realpath(tier.dirs.entries))
    if paths is None:
        on_disk = await anyio.to_thread.run_sync(_listing, root)
        durable = {r.id: r for r in catalog.durable()}
        gone = durable.keys() - on_disk.keys()
        candidates = {**on_disk, **{i: catalog.path_of(durable[i]) for i in gone}}
    else:
        candidates = {}
        for path in paths:
            entry_id = _entry_id(root, Path(os.path.realpath(path)))
            if entry_id is not None:
                candidates[entry_id] = path
        on_disk = {i: p for i, p in candidates.items() if p.exists()}
    for entry_id, path in candidates.items():
        if catalog.is_doomed(entry_id):
            continue  # removed from the index, its file kept until its last lease ends
        record = catalog.records.get(entry_id)
        if record is not None and record.durable and entry_id not in on_disk:
            log.warning("entry_removed_outside", entry=record.id)
            catalog.drop(record)
        elif record is None and entry_id in on_disk:
            await _adopt(tier, path)
    tier.evict_to_cap()


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
    tier.catalog.add(record)
    log.info("entry_adopted", entry=record.id, identity=record.identity)
