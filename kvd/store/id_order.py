"""Entry ids in sorted order, kept as entries come and go: what a page of `list` reads.

Ids are random, so a new one lands anywhere in the order. A plain sorted list would move half
of itself on every insert; this keeps the ids in blocks of at most BLOCK ids (each sorted, the
blocks in order, with each block's last id in `_lasts`), so an insert or a removal costs a
bisection and one block's memmove, and a page after a given id costs a bisection and its own
length. Ids added are kept aside until the next read or removal, and then sorted in once: the
100k ids of a start-up cost one sort, not 100k inserts.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from itertools import chain, islice

BLOCK = 512


class IdOrder:
    """A sorted set of ids with cheap insert, remove and ordered iteration from any point."""

    def __init__(self) -> None:
        self._blocks: list[list[str]] = []
        self._lasts: list[str] = []  # _lasts[i] == _blocks[i][-1]
        self._added: list[str] = []  # not in the blocks yet
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, entry_id: str) -> None:
        """Insert entry_id; it must not be present already."""
        self._count += 1
        self._added.append(entry_id)

    def update(self, entry_ids: list[str]) -> None:
        """add() each of entry_ids."""
        self._count += len(entry_ids)
        self._added += entry_ids

    def _settle(self) -> None:
        """Put the ids added since the last read into the blocks: one by one if they are few,
        else by sorting everything afresh into half-full blocks (timsort merges the run that
        the blocks already are with the sorted new ids)."""
        added, self._added = self._added, []
        if len(added) <= len(self._blocks):
            for entry_id in added:
                self._insert(entry_id)
            return
        ids = sorted(chain(chain.from_iterable(self._blocks), added))
        self._blocks = [ids[i : i + BLOCK // 2] for i in range(0, len(ids), BLOCK // 2)]
        self._lasts = [block[-1] for block in self._blocks]

    def _insert(self, entry_id: str) -> None:
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
        self._settle()
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
        self._settle()
        if entry_id is None:
            i = j = 0
        else:
            i = bisect_right(self._lasts, entry_id)
            j = bisect_right(self._blocks[i], entry_id) if i < len(self._blocks) else 0
        if i < len(self._blocks):
            yield from islice(self._blocks[i], j, None)
        for block in islice(self._blocks, i + 1, None):
            yield from block
