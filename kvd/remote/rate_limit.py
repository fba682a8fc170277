"""A token bucket: uploads keep to remote_upload_rate bytes per second on average.

A send takes its bytes first and then waits off the debt, so a block larger than a second's
worth still goes (at the rate); the bucket holds at most one second of bytes, so a pause does
not let a burst through at wire speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio


class TokenBucket:
    """rate bytes per second; 0 is no cap."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0:
            raise ValueError(f"rate must be >= 0, not {rate}")
        self.rate = rate
        self._clock = clock
        self._level = float(rate)  # bytes that may go now; negative: a debt
        self._at = clock()

    def take(self, nbytes: int) -> float:
        """Take nbytes; the seconds to wait before sending them."""
        if not self.rate:
            return 0.0
        now = self._clock()
        self._level = min(float(self.rate), self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= nbytes
        return max(0.0, -self._level / self.rate)

    async def wait_for(self, nbytes: int) -> None:
        """Until nbytes may go."""
        delay = self.take(nbytes)
        if delay:
            await anyio.sleep(delay)
