"""A set that forgets its least recently used members past a capacity, and any member older
than a maximum age: what the remote tier remembers of the store (blocks known there, entries
offered) in bounded memory, and for a bounded time (a store may expire objects by age)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LruSet(Generic[K]):
    """A set that forgets its least recently added or asked member past its capacity, and a
    member added more than max_age seconds ago (by clock) when it is next asked for."""

    def __init__(
        self,
        capacity: int,
        max_age: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.max_age = max_age
        self._clock = clock
        self._members: OrderedDict[K, float] = OrderedDict()  # member -> when added

    def __contains__(self, key: object) -> bool:
        added = self._members.get(key)  # type: ignore[arg-type]
        if added is None:
            return False
        if self._clock() - added > self.max_age:
            del self._members[key]  # type: ignore[arg-type]
            return False
        self._members.move_to_end(key)  # type: ignore[arg-type]
        return True

    def __len__(self) -> int:
        return len(self._members)

    def add(self, key: K) -> None:
        self._members[key] = self._clock()
        self._members.move_to_end(key)
        if len(self._members) > self.capacity:
            self._members.popitem(last=False)

    def discard(self, key: K) -> None:
        self._members.pop(key, None)
