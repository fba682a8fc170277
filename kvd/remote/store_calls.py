"""The read path's calls to the store: each in a worker thread, at most so many at once, and
each one's outcome told to the store's health (a failure of the store, not an absent key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import anyio

from kvd.remote.health import Health
from kvd.remote.s3 import ObjectTooLarge, S3Store, StoreError

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class StoreCalls:
    def __init__(self, store: S3Store, health: Health, at_once: int) -> None:
        self.store = store
        self.health = health
        self._limiter = anyio.CapacityLimiter(at_once)

    async def run(self, call: Callable[[*Ts], T], *args: *Ts) -> T:
        """call(*args) in a worker thread. Never abandoned when cancelled: a call writing into
        a descriptor finishes (within the store's request timeout) before it is closed."""
        try:
            result = await anyio.to_thread.run_sync(call, *args, limiter=self._limiter)
        except ObjectTooLarge:
            self.health.succeeded()  # the store answered; what it holds is another matter
            raise
        except StoreError as exc:
            self.health.failed(exc)
            raise
        self.health.succeeded()
        return result
