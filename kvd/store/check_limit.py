"""Whole-file checks that clients can ask for, bounded: `verify`, and a release that reports
damage (each reads an entry and its blocks whole and checksums every byte).

Any client may ask for either about any entry, again and again; unbounded, they would fill
the worker threads the writer needs and read the disk flat out. So: at most RUNNING checks
run at once across the daemon and WAITING more wait their turn (beyond, REFUSED: busy, try
later); a connection has one check at a time (OVER_LIMIT for a second); and an entry whose
reported damage was not found is not checked again on a report for RECHECK_SECONDS (the
release is answered, the check skipped). Owned by the event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio
from kvd_protocol.errors import ErrorCode, ProtocolError

RUNNING: Final = 1  # checks reading at once: one worker thread, the others the writer's
WAITING: Final = 8
RECHECK_SECONDS: Final = 60.0
REMEMBERED: Final = 4096  # entries found intact on a report, remembered (the oldest go)


class CheckLimit:
    """The turns of whole-file checks, and the entries recently found intact."""

    def __init__(self) -> None:
        self._turns = anyio.Semaphore(RUNNING)
        self._queued = 0  # running or waiting
        self._owners: set[int] = set()  # connections with a check under way
        self._intact: OrderedDict[str, float] = OrderedDict()  # entry id -> when found so
        self.run = 0  # checks run since start
        self.refused = 0  # checks refused: busy, or one under way on the connection
        self.skipped = 0  # damage reports of an entry found intact within RECHECK_SECONDS

    @asynccontextmanager
    async def turn(self, owner: int) -> AsyncIterator[None]:
        """Wait for a check's turn for owner's connection; REFUSED or OVER_LIMIT at once when
        there is none to wait for."""
        if owner in self._owners:
            self.refused += 1
            raise ProtocolError(
                ErrorCode.OVER_LIMIT, "a check asked on this connection is under way already"
            )
        if self._queued >= RUNNING + WAITING:
            self.refused += 1
            raise ProtocolError(
                ErrorCode.REFUSED,
                f"kvd is busy checking {self._queued} entries for clients: try later",
            )
        self._queued += 1
        self._owners.add(owner)
        try:
            async with self._turns:
                self.run += 1
                yield
        finally:
            self._queued -= 1
            self._owners.discard(owner)

    def recently_intact(self, entry: str) -> bool:
        """Whether entry was checked and found intact less than RECHECK_SECONDS ago."""
        when = self._intact.get(entry)
        if when is None:
            return False
        if time.monotonic() - when < RECHECK_SECONDS:
            return True
        del self._intact[entry]
        return False

    def found_intact(self, entry: str) -> None:
        self._intact[entry] = time.monotonic()
        self._intact.move_to_end(entry)
        if len(self._intact) > REMEMBERED:
            self._intact.popitem(last=False)

    def counts(self) -> dict[str, int]:
        """For status."""
        return {"run": self.run, "refused": self.refused, "skipped": self.skipped}
