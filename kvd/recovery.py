"""Start-up: make the directory and the index agree before the first request.

Staging leftovers (puts that never committed, or a writer cut off by a crash) are reaped;
every entry file is validated (header and layout) and indexed; a file that fails, or that sits
in another identity's folder, is quarantined. The result is a tier whose accounting equals
the directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvd_protocol.entry import EntryHeader
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.limits import Limits

from kvd.entry_files import read_header
from kvd.tier_dir import ENTRY_SUFFIX, TierDir


@dataclass(frozen=True)
class Found:
    path: Path
    header: EntryHeader
    mtime: float


@dataclass
class ScanResult:
    entries: list[Found]
    invalid: list[tuple[Path, str]]
    reaped: int


def reap_staging(dirs: TierDir) -> int:
    count = 0
    for entry in os.scandir(dirs.staging):
        if entry.is_file(follow_symlinks=False) or entry.is_symlink():
            os.unlink(entry.path)
            count += 1
    return count


def scan(dirs: TierDir, limits: Limits) -> ScanResult:
    """Reap staging, then read and validate every entry header (blocking: run in a thread)."""
    reaped = reap_staging(dirs)
    found: list[Found] = []
    invalid: list[tuple[Path, str]] = []
    for folder in os.scandir(dirs.entries):
        if not folder.is_dir(follow_symlinks=False):
            invalid.append((Path(folder.path), "not an identity folder"))
            continue
        for entry in os.scandir(folder.path):
            path = Path(entry.path)
            if not entry.name.endswith(ENTRY_SUFFIX) or not entry.is_file(follow_symlinks=False):
                invalid.append((path, "not an entry file"))
                continue
            try:
                header = read_header(path, limits)
            except EntryFormatError as exc:
                invalid.append((path, str(exc)))
                continue
            if header.identity.digest() != folder.name:
                invalid.append((path, "its identity does not match its folder"))
                continue
            found.append(Found(path, header, entry.stat().st_mtime))
    return ScanResult(found, invalid, reaped)
