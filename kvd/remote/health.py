"""The store's health: a circuit breaker every store call reports to.

    ok        no request failed lately
    degraded  a request failed within RECENT_S, the last ones not all failed
    down      FAILURES_TO_DOWN failed in a row, or the credentials were refused: nothing on
              a lookup asks the store and uploads are dropped (counted) until a probe in the
              background (recover) gets an answer again

A probe retries with backoff, BACKOFF_FIRST_S doubling to BACKOFF_MAX_S; refused credentials
are retried every AUTH_RETRY_S. Going down is said once at warning, with the error; failures
while down are not logged again unless their kind changes (the store unreachable, its
credentials refused), and coming back is said at info. last_error is a short string with no
secret in it (the client's errors hold none).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable
from typing import Final

import anyio

from kvd.logs import get_logger

log = get_logger("kvd.remote.health")

FAILURES_TO_DOWN: Final = 3
RECENT_S: Final = 30.0
BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 60.0
AUTH_RETRY_S: Final = 60.0


class State(enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    DOWN = "down"


class Health:
    """The breaker's state, fed by succeeded() and failed(); recover() runs the probe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.last_error = ""
        self.failures = 0  # in a row
        self.refused = False  # the last failure was the credentials refused
        self._failed_at: float | None = None
        self._changed = anyio.Event()  # pulsed when the store goes down

    @property
    def state(self) -> State:
        if self.failures >= FAILURES_TO_DOWN:
            return State.DOWN
        if self._failed_at is not None and self._clock() - self._failed_at < RECENT_S:
            return State.DEGRADED
        return State.OK

    @property
    def up(self) -> bool:
        """Whether the store may be asked (not down)."""
        return self.state is not State.DOWN

    def succeeded(self) -> None:
        """A store call got its answer (a 404 or a 412 is one)."""
        if self.state is State.DOWN:  # the outage is over: ok, not degraded by it
            log.info("remote_up", after=self.last_error)
            self._failed_at = None
        self.failures = 0
        self.refused = False

    def failed(self, error: str, *, refused: bool = False) -> None:
        """A store call failed (error: why, no secret); refused: the credentials were."""
        was_up, was_refused = self.up, self.refused
        self.failures += 1
        if refused:  # down at once, and stays down through failures of another kind
            self.failures = max(self.failures, FAILURES_TO_DOWN)
        self.refused = refused  # the latest failure's kind: the probe's pace
        self.last_error = error
        self._failed_at = self._clock()
        if not self.up and (was_up or self.refused != was_refused):
            log.warning("remote_down", error=error, local_only=True)
        elif self.up:  # degraded: each failure said, for the operator who wonders why
            log.info("remote_request_failed", error=error, failures=self.failures)
        if was_up and not self.up:
            self._changed.set()
            self._changed = anyio.Event()

    def retry_in(self, attempt: int) -> float:
        """Seconds before probe attempt (0, 1, ...) of an outage."""
        if self.refused:
            return AUTH_RETRY_S
        return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**attempt))

    async def recover(self, probe: Callable[[], Awaitable[None]]) -> None:
        """Runs for the daemon's life: whenever the store is down, probe it with backoff until
        it answers. probe reports to this object itself (succeeded, failed)."""
        while True:
            if self.up:
                await self._changed.wait()
                continue
            attempt = 0
            while not self.up:
                await anyio.sleep(self.retry_in(attempt))
                attempt += 1
                await probe()
