"""Entry ids in sorted order, kept as entries come and go: what a page of `list` reads.

Ids are random, so a new one lands anywhere in the order. A plain sorted list would move half
of itself on every insert; this keeps the ids in blocks of at most BLOCK ids (each sorted, the
blocks in order, with each block's last id in `_lasts`), so an insert or a removal costs a
bisection and one block's memmove, and a page after a given id costs a bisection and its own
length.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from itertools import islice

BLOCK = 512


class IdOrder:
    """A sorted set of ids with cheap insert, remove and ordered iteration from any point."""

    def __init__(self) -> None:
        self._blocks: list[list[str]] = []
        self._lasts: list[str] = []  # _lasts[i] == _blocks[i][-1]
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, entry_id: str) -> None:
        """Insert entry_id; it must not be present already."""
        self._count += 1
        if not self._blocks:
            self._blocks.append([entry_id])
            self._lasts.append(entry_id)
            return
        i = min(bisect_left(self._lasts, entry_id), len(self._blocks) - 1)
        block = self._blocks[i]
        insort(block, entry_id)
        self._lasts[i] = block[-1]
        if len(block) > BLOCK:
            half = block[BLOCK // 2 :]
            del block[BLOCK // 2 :]
            self._blocks.insert(i + 1, half)
            self._lasts[i] = block[-1]
            self._lasts.insert(i + 1, half[-1])

    def remove(self, entry_id: str) -> None:
        """Take entry_id out; KeyError if it is not present."""
        i = bisect_left(self._lasts, entry_id)
        block = self._blocks[i] if i < len(self._blocks) else []
        j = bisect_left(block, entry_id)
        if j == len(block) or block[j] != entry_id:
            raise KeyError(entry_id)
        del block[j]
        self._count -= 1
        if block:
            self._lasts[i] = block[-1]
        else:
            del self._blocks[i]
            del self._lasts[i]

    def after(self, entry_id: str | None) -> Iterator[str]:
        """The ids greater than entry_id (all of them for None), in order."""
        if entry_id is None:
            i = j = 0
        else:
            i = bisect_right(self._lasts, entry_id)
            j = bisect_right(self._blocks[i], entry_id) if i < len(self._blocks) else 0
        if i < len(self._blocks):
            yield from islice(self._blocks[i], j, None)
        for block in islice(self._blocks, i + 1, None):
            yield from block
