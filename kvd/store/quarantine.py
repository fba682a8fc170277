"""Files that failed validation are moved aside for inspection, never served, and counted."""

from __future__ import annotations

from pathlib import Path

import anyio

from kvd.logs import get_logger
from kvd.store import entry_files
from kvd.store.counters import Counters
from kvd.store.tier_dir import TierDir

log = get_logger("kvd.store.quarantine")


class Quarantine:
    """The tier's quarantine folder, capped in bytes (the oldest files go first)."""

    def __init__(self, dirs: TierDir, max_bytes: int, counters: Counters) -> None:
        self._folder = dirs.quarantine
        self._max_bytes = max_bytes
        self._counters = counters

    async def file(self, path: Path, reason: str) -> None:
        """Move path aside; a file that cannot be moved is deleted instead. Counted once the
        file is where status says (a reader of the count may look), and once only: a file
        another check moved first is not counted again."""
        log.warning("quarantined", file=path.name, reason=reason)
        if await anyio.to_thread.run_sync(self._move, path):
            self._counters.quarantined += 1

    def now(self, path: Path, reason: str) -> None:
        """file() for a caller that cannot wait (a lookup): on the event loop itself, at the
        cost of a rename and a listing of the small quarantine folder."""
        log.warning("quarantined", file=path.name, reason=reason)
        if self._move(path):
            self._counters.quarantined += 1

    def _move(self, path: Path) -> bool:
        """Whether the file was ours to take aside (moved, or deleted when it could not be)."""
        try:
            return entry_files.quarantine(path, self._folder, self._max_bytes)
        except OSError as exc:
            log.error("quarantine_failed", file=str(path), error=str(exc))
            entry_files.unlink_quietly(path)
            return True
