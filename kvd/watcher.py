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

RECONCILE_SECONDS = 300.0


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


async def reconcile_periodically(tier: Tier, every: float = RECONCILE_SECONDS) -> None:
    while True:
        await anyio.sleep(every)
        await reconcile(tier, None)


def _listing(tier: Tier) -> set[Path]:
    found: set[Path] = set()
    for folder in os.scandir(tier.dirs.entries):
        if folder.is_dir(follow_symlinks=False):
            found.update(
                Path(os.path.realpath(entry.path))
                for entry in os.scandir(folder.path)
                if entry.name.endswith(ENTRY_SUFFIX)
            )
    return found


async def reconcile(tier: Tier, paths: Iterable[Path] | None) -> None:
    """Make the index agree with the given paths (None: the whole entries folder)."""
    durable = {
        Path(os.path.realpath(tier.files[r.id])): r for r in tier.live_records() if r.durable
    }
    if paths is None:
        on_disk = await anyio.to_thread.run_sync(_listing, tier)
        candidates = on_disk | set(durable)
    else:
        candidates = {Path(os.path.realpath(p)) for p in paths}
        on_disk = {p for p in candidates if p.exists()}
    for path in candidates:
        record = durable.get(path)
        if record is not None and path not in on_disk:
            log.warning("entry_removed_outside", entry=record.id)
            tier.drop_record(record)
        elif record is None and path in on_disk and path.stem not in tier.records:
            await _adopt(tier, path)
    tier.evict_to_cap()


async def _adopt(tier: Tier, path: Path) -> None:
    if path.parent.parent != Path(os.path.realpath(tier.dirs.entries)):
        return
    try:
        header = await anyio.to_thread.run_sync(entry_files.read_header, path, tier.limits)
        if header.identity.digest() != path.parent.name:
            raise EntryFormatError(path.name, Rule.SCHEMA, "its identity is not its folder's")
    except (EntryFormatError, OSError) as exc:
        await tier.quarantine_file(path, str(exc))
        return
    record = record_from_header(path.stem, header, last_used=tier.tick())
    if path.stem in tier.records:  # adopted meanwhile (a second event for the same file)
        return
    tier.add_record(record, path)
    log.info("entry_adopted", entry=record.id, identity=record.identity)
