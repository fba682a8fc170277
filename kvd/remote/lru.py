"""Maps and sets that forget their least recently used members past a capacity, and any member
older than a maximum age: what the remote tier remembers of the bucket (blocks known there,
layouts, negative answers, damaged chains, entries offered) in bounded memory, whatever the
bucket serves and however many identities clients name, and for a bounded time (a bucket may
expire objects by age).

The capacity counts weight: one a member unless the caller weighs it (a layout by its bytes).
figures() is what the status shows of each: its size, its weight and its capacity."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruMap(Generic[K, V]):
    """A map that forgets its least recently set or got members while their weights add up
    past its capacity, and a member set more than max_age seconds ago (by clock) when it is
    next asked for. A member heavier than the whole capacity is not kept."""

    def __init__(
        self,
        capacity: int,
        max_age: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.max_age = max_age
        self.weight = 0
        self._clock = clock
        self._members: OrderedDict[K, tuple[V, int, float]] = OrderedDict()  # value, weight, set

    def get(self, key: K) -> V | None:
        found = self._members.get(key)
        if found is None:
            return None
        value, _, added = found
        if self._clock() - added > self.max_age:
            self.pop(key)
            return None
        self._members.move_to_end(key)
        return value

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._members)

    def set(self, key: K, value: V, weight: int = 1) -> None:
        self.pop(key)
        if weight > self.capacity:
            return
        self._members[key] = (value, weight, self._clock())
        self.weight += weight
        while self.weight > self.capacity:
            _, (_, gone, _) = self._members.popitem(last=False)
            self.weight -= gone

    def pop(self, key: K) -> V | None:
        found = self._members.pop(key, None)
        if found is None:
            return None
        self.weight -= found[1]
        return found[0]

    def figures(self) -> dict[str, int]:
        """What the status shows of it: members, their weight, the capacity."""
        return {"size": len(self), "weight": self.weight, "capacity": self.capacity}


class LruSet(Generic[K]):
    """A set that forgets its least recently added or asked member past its capacity, and a
    member added more than max_age seconds ago (by clock) when it is next asked for."""

    def __init__(
        self,
        capacity: int,
        max_age: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._map: LruMap[K, bool] = LruMap(capacity, max_age, clock)

    @property
    def capacity(self) -> int:
        return self._map.capacity

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def add(self, key: K) -> None:
        self._map.set(key, True)

    def discard(self, key: K) -> None:
        self._map.pop(key)

    def figures(self) -> dict[str, int]:
        """What the status shows of it: members and the capacity."""
        return {"size": len(self), "capacity": self.capacity}
