"""The circuit breaker over one daemon: once a call finds it unavailable (a timeout, a refused
or broken connection), the engine's lookups and puts skip it at once, costing a flag read,
until a probe, a ping on a connection of its own from a thread of its own, finds it
answering again; then it closes by itself. A hung daemon so costs an engine one deadline, not
one per request.

Shared by the clients of one engine (Client.twin): a put stuck in a hung daemon opens it for
the lookups too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

log = logging.getLogger("kvd_client")

MIN_PROBE_DELAY: Final = 0.01  # seconds: a backoff of 0 must not make the probe spin


@dataclass
class BreakerStats:
    opened: int = 0  # times a failure opened it
    skipped_lookups: int = 0  # lookups (and checkpoint finds) answered as misses while open
    skipped_puts: int = 0  # puts answered "unavailable" while open


class Breaker:
    """Open or closed; thread-safe. probe: raises unless the daemon answers (a ping on a new
    connection); tried after first_delay seconds, then at doubling delays up to max_delay (the
    client's Backoff)."""

    def __init__(
        self, daemon: str, probe: Callable[[], object], first_delay: float, max_delay: float
    ) -> None:
        self.daemon = daemon  # the socket path, for the log
        self.stats = BreakerStats()
        self._probe = probe
        self._first_delay = max(first_delay, MIN_PROBE_DELAY)
        self._max_delay = max(max_delay, MIN_PROBE_DELAY)
        self._lock = threading.Lock()
        self._open = False
        self._stopped = threading.Event()

    @property
    def is_open(self) -> bool:
        return self._open

    def trip(self, why: str) -> None:
        """A call found the daemon unavailable: open, and start probing (unless open already,
        or stopped)."""
        with self._lock:
            if self._open or self._stopped.is_set():
                return
            self._open = True
            self.stats.opened += 1
        log.warning(
            "kvd: the daemon at %s does not answer (%s): skipped until it does", self.daemon, why
        )
        threading.Thread(target=self._probe_until_answered, name="kvd-probe", daemon=True).start()

    def skip_lookup(self) -> bool:
        """Whether a lookup skips the daemon now (counted)."""
        if not self._open:  # the usual case: a read, no lock
            return False
        with self._lock:
            self.stats.skipped_lookups += 1
        return True

    def skip_put(self) -> bool:
        """Whether a put skips the daemon now (counted)."""
        if not self._open:
            return False
        with self._lock:
            self.stats.skipped_puts += 1
        return True

    def stop(self) -> None:
        """No more probing (the client is closed): a probe under way ends after its attempt."""
        self._stopped.set()

    def _probe_until_answered(self) -> None:
        opened = time.monotonic()
        delay = self._first_delay
        while not self._stopped.wait(delay):
            try:
                self._probe()
            except Exception as exc:  # whatever the probe met, the daemon did not answer
                log.debug("kvd: probe of %s: %s", self.daemon, exc)
                delay = min(self._max_delay, delay * 2)
                continue
            with self._lock:
                self._open = False
            took = time.monotonic() - opened
            log.info("kvd: the daemon at %s answers again (skipped for %.1f s)", self.daemon, took)
            return
