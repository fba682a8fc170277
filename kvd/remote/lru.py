"""A set that forgets its least recently used members past a capacity: what the remote tier
remembers of the store (blocks known there, entries offered) in bounded memory."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LruSet(Generic[K]):
    """A set that forgets its least recently added or asked member past its capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._members: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        if key in self._members:
            self._members.move_to_end(key)  # type: ignore[arg-type]
            return True
        return False

    def __len__(self) -> int:
        return len(self._members)

    def add(self, key: K) -> None:
        self._members[key] = None
        self._members.move_to_end(key)
        if len(self._members) > self.capacity:
            self._members.popitem(last=False)

    def discard(self, key: K) -> None:
        self._members.pop(key, None)
