"""The bucket's health: a circuit breaker every bucket call reports to.

    ok        no request failed lately
    degraded  a request failed, or the bucket asked to slow down, within RECENT_S, the last
              ones not all failed
    down      FAILURES_TO_DOWN failed in a row, or the credentials were refused (or the
              clock, which the bucket refuses alike): nothing on a lookup asks the bucket and
              uploads are dropped (counted) until a probe in the background (recover) gets an
              answer again

A probe retries with backoff, BACKOFF_FIRST_S doubling to BACKOFF_MAX_S; refused credentials
are retried every AUTH_RETRY_S, and at once when a credentials file changed (looked at every
CREDENTIALS_LOOK_S). Going down is said once at warning, with the error; failures while down
are not logged again unless their kind changes (the bucket unreachable, its credentials
refused), and coming back is said at info. A failure while up is said at info, at most once per
LOG_EVERY_S (with the count left out): a bucket failing every other request does not flood
the log. last_error is a short string with no secret in it
(the client's errors hold none).

A bucket that asks to slow down (429, 503 SlowDown: busy()) is not failing: it counts for no
failure in a row, and every call waits (paced) until the pause it asked for has passed: its
Retry-After, else BUSY_FIRST_S doubling to BUSY_MAX_S while it keeps asking, with jitter so that
the daemons sharing a bucket do not come back at once. Said at warning, at most once per
LOG_EVERY_S (with the count of the asks left out).
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Awaitable, Callable
from typing import Final

import anyio

from kvd.logs import RateLimited, get_logger

log = get_logger("kvd.remote.health")

FAILURES_TO_DOWN: Final = 3
RECENT_S: Final = 30.0
BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 60.0
AUTH_RETRY_S: Final = 60.0
CREDENTIALS_LOOK_S: Final = 1.0
BUSY_FIRST_S: Final = 0.5
BUSY_MAX_S: Final = 30.0
LOG_EVERY_S: Final = 10.0


class State(enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    DOWN = "down"


class Health:
    """The breaker's state, fed by succeeded() and failed(); recover() runs the probe."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        credentials_changed: Callable[[], bool] = lambda: False,
    ) -> None:
        self._clock = clock
        self._credentials_changed = credentials_changed
        self.last_error = ""
        self.failures = 0  # in a row
        self.refused = False  # the last failure was the credentials refused
        self.busy_asks = 0  # the bucket's asks to slow down since its last answer
        self._failed_at: float | None = None
        self._paused_until = 0.0  # clock(): no call before (the bucket asked to slow down)
        self._changed = anyio.Event()  # pulsed when the bucket goes down
        self._limited = RateLimited(log, LOG_EVERY_S, clock)  # what the bucket may provoke

    @property
    def state(self) -> State:
        if self.failures >= FAILURES_TO_DOWN:
            return State.DOWN
        if self._failed_at is not None and self._clock() - self._failed_at < RECENT_S:
            return State.DEGRADED
        return State.OK

    @property
    def up(self) -> bool:
        """Whether the bucket may be asked (not down)."""
        return self.state is not State.DOWN

    def succeeded(self) -> None:
        """A bucket call got its answer (a 404 or a 412 is one)."""
        if self.state is State.DOWN:  # the outage is over: ok, not degraded by it
            log.info("remote_up", after=self.last_error)
            self._failed_at = None
        self.failures = 0
        self.refused = False
        self.busy_asks = 0

    def busy(self, error: str, retry_after: float | None) -> float:
        """The bucket asked to slow down (error: its answer); the seconds every call now
        waits (paced): retry_after if it said, else the backoff of its asks in a row."""
        self.last_error = error
        self._failed_at = now = self._clock()
        if now < self._paused_until:  # asked of a request sent before the pause: no new ask
            return self._paused_until - now
        self.busy_asks += 1
        if retry_after is None:
            backoff = min(BUSY_MAX_S, BUSY_FIRST_S * 2.0 ** (self.busy_asks - 1))
            pause: float = backoff * random.uniform(0.5, 1.0)  # jitter, not a secret
        else:
            pause = max(retry_after, BUSY_FIRST_S)  # a Retry-After of 0 would not slow down
        self._paused_until = now + pause
        self._limited.warning("remote_slow_down", error=error, pause_s=round(pause, 2))
        return pause

    async def paced(self, until: float) -> bool:
        """Waits out the pause the bucket last asked for; False at once, without waiting, when
        it ends after until (a clock() time: a caller's deadline)."""
        if self._paused_until > until:
            return False
        while (left := self._paused_until - self._clock()) > 0:
            await anyio.sleep(left)
        return True

    def failed(self, error: str, *, refused: bool = False) -> None:
        """A bucket call failed (error: why, no secret); refused: the credentials were."""
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
            self._limited.info("remote_request_failed", error=error, failures=self.failures)
        if was_up and not self.up:
            self._changed.set()
            self._changed = anyio.Event()

    def retry_in(self, attempt: int) -> float:
        """Seconds before probe attempt (0, 1, ...) of an outage."""
        if self.refused:
            return AUTH_RETRY_S
        return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**attempt))

    async def recover(self, probe: Callable[[], Awaitable[None]]) -> None:
        """Runs for the daemon's life: whenever the bucket is down, probe it with backoff until
        it answers. probe reports to this object itself (succeeded, failed)."""
        while True:
            if self.up:
                await self._changed.wait()
                continue
            attempt = 0
            while not self.up:
                await self._wait_retry(self.retry_in(attempt))
                attempt += 1
                await probe()

    async def _wait_retry(self, seconds: float) -> None:
        """seconds, or less when refused credentials may have changed (a file did)."""
        if not self.refused:
            await anyio.sleep(seconds)
            return
        with anyio.move_on_after(seconds):
            while True:  # a look a second, and a probe a second at most
                await anyio.sleep(CREDENTIALS_LOOK_S)
                if self._credentials_changed():
                    return
