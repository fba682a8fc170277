"""Start-up: make the directory and the index agree.

Staging leftovers (puts that never committed, or a writer cut off by a crash) are reaped;
every entry file is validated (header and layout) and indexed; a file that fails, or that sits
in another identity's folder, is quarantined. Each identity's blocks folder is listed the same
way: a block file's header is validated (its hash against its name, its identity against its
folder); the tier then keeps the blocks its manifests list, collects the others (orphans of a
put cut off by a crash) and quarantines a manifest whose block is missing. The result is a
tier whose accounting equals the directory. The index snapshot (snapshot.py) spares the
header reads of unchanged files; a tier taken from it serves before the directory is listed
against it (LifeCycle.settle has the rules that keep that safe).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

from kvd_protocol.blocks import parse_block_name
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.limits import Limits

from kvd.store.entry_files import read_block_header, read_header
from kvd.store.records import EntryRecord, record_from_header
from kvd.store.snapshot import BlockRow, Snapshot
from kvd.store.tier_dir import BLOCKS_FOLDER, ENTRY_SUFFIX, TierDir


@dataclass(frozen=True)
class FoundBlock:
    """A valid block file under an identity's blocks folder."""

    digest: str
    hash: bytes
    size: int
    path: Path


def reap_staging(dirs: TierDir) -> int:
    count = 0
    for entry in os.scandir(dirs.staging):
        if entry.is_file(follow_symlinks=False) or entry.is_symlink():
            os.unlink(entry.path)
            count += 1
    return count


@dataclass
class Listing:
    """The directory as it is, against a snapshot's rows."""

    matched: bytearray  # per row: 1 if its file is there, unchanged
    found: list[EntryRecord]  # valid files the snapshot does not describe, oldest first
    blocks: list[FoundBlock]  # every valid block file, listed or not
    invalid: list[tuple[Path, str]]


def snapshot_written(dirs: TierDir, known: Snapshot) -> int | None:
    """When the snapshot file was written (its mtime), or None for an empty snapshot."""
    if not known.records and not known.blocks:
        return None
    try:
        return dirs.snapshot.stat().st_mtime_ns
    except FileNotFoundError:  # replaced meanwhile: a newer one; trust no folder's mtime
        return None


def list_against(
    dirs: TierDir,
    limits: Limits,
    known: Snapshot,
    header_read: Callable[[], None] = lambda: None,
) -> Listing:
    """List the entries folder against the snapshot's rows (blocking: run in a thread).

    In an identity folder unchanged since the snapshot was written (no entry added, removed
    or renamed: its own mtime is older), the snapshot's rows need no stat at all: entry files
    are never modified in place. A file that goes while it is listed (the daemon may serve
    meanwhile: eviction, the writer) is left out.
    """
    rows = known.rows
    written = snapshot_written(dirs, known)
    blocks: list[FoundBlock] = []
    matched = bytearray(len(known.records))
    found: list[tuple[int, EntryRecord]] = []  # files it does not describe, with their mtimes
    invalid: list[tuple[Path, str]] = []
    for folder in os.scandir(dirs.entries):
        if not folder.is_dir(follow_symlinks=False):
            invalid.append((Path(folder.path), "not an identity folder"))
            continue
        unchanged = written is not None and folder.stat().st_mtime_ns < written
        for entry in os.scandir(folder.path):
            if entry.name == BLOCKS_FOLDER and entry.is_dir(follow_symlinks=False):
                blocks += _scan_blocks(entry, folder.name, known.blocks, limits, invalid)
                continue
            if not entry.name.endswith(ENTRY_SUFFIX) or not entry.is_file(follow_symlinks=False):
                invalid.append((Path(entry.path), "not an entry file"))
                continue
            entry_id = entry.name[: -len(ENTRY_SUFFIX)]
            row = rows.get(entry_id)
            try:
                if row is not None and known.records[row].digest == folder.name:
                    if unchanged:
                        matched[row] = 1
                        continue
                    info = entry.stat(follow_symlinks=False)
                    if (info.st_mtime_ns, info.st_size) == (
                        known.mtime_ns[row],
                        known.records[row].nbytes,
                    ):
                        matched[row] = 1
                        continue
                path = Path(entry.path)
                try:
                    header = read_header(path, limits)
                except EntryFormatError as exc:
                    invalid.append((path, str(exc)))
                    continue
                finally:
                    header_read()
                if header.identity.digest() != folder.name:
                    invalid.append((path, "its identity does not match its folder"))
                    continue
                record = record_from_header(entry_id, header, last_used=0)
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns, record))
            except FileNotFoundError:
                continue
    # A file the snapshot does not know was written after it, so is more recent than all it
    # knows (oldest of those first).
    found.sort(key=itemgetter(0))
    return Listing(matched, [record for _, record in found], blocks, invalid)


def _scan_blocks(
    folder: os.DirEntry[str],
    digest: str,
    known: dict[tuple[str, bytes], BlockRow],
    limits: Limits,
    invalid: list[tuple[Path, str]],
) -> list[FoundBlock]:
    """The valid block files of one identity's blocks folder; the others go to invalid. A
    file the snapshot knows with the same size and mtime is not read (written once, as
    entries are)."""
    found = []
    for entry in os.scandir(folder.path):
        path = Path(entry.path)
        block_hash = parse_block_name(entry.name)
        if block_hash is None or not entry.is_file(follow_symlinks=False):
            invalid.append((path, "not a block file"))
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            row = known.get((digest, block_hash))
            if row is None or (row.size, row.mtime_ns) != (info.st_size, info.st_mtime_ns):
                try:
                    block = read_block_header(path, limits)
                except EntryFormatError as exc:
                    invalid.append((path, str(exc)))
                    continue
                if block.digest != digest:
                    invalid.append((path, "its identity does not match its folder"))
                    continue
        except FileNotFoundError:  # collected meanwhile, by a daemon serving already
            continue
        found.append(FoundBlock(digest, block_hash, info.st_size, path))
    return found
