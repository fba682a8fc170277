"""Which entries leave the tier when it is over its byte cap or under its free-disk floor.

The cap and the floor hold after every commit, across identities: the tier keeps one policy
for all its entries, asks bytes_over() how much must go, and deletes what select_victims()
names. The policy is a setting, a name in EVICTION_POLICIES (the one table of them): LruPolicy
is the default; a cost-aware one (prefill tokens saved per byte) can join the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Protocol

from kvd.records import EntryRecord


def bytes_over(total_bytes: int, max_bytes: int | None, disk_free: int, min_free: int) -> int:
    """Bytes of entries to delete so that total_bytes <= max_bytes and disk_free >= min_free.

    max_bytes None means no cap; min_free 0 means no floor. Deleting an entry frees its bytes
    on the disk as well, so the larger of the two shortfalls satisfies both.
    """
    over_cap = 0 if max_bytes is None else total_bytes - max_bytes
    return max(0, over_cap, min_free - disk_free)


def evictable(record: EntryRecord) -> bool:
    """Whether eviction may take record now (see LruPolicy for why)."""
    return record.durable and record.leases == 0


class EvictionPolicy(Protocol):
    """The order in which entries are evicted.

    The tier calls add() when an entry is indexed, remove() whenever it leaves (evicted,
    superseded, purged, gone from disk), touch() on each use (a lookup hit), and
    select_victims() after each commit.
    """

    def add(self, record: EntryRecord) -> None: ...

    def remove(self, record: EntryRecord) -> None: ...

    def touch(self, record: EntryRecord) -> None: ...

    def select_victims(self, over_bytes: int) -> list[EntryRecord]: ...


class LruPolicy:
    """Least recently used first; a lookup hit is a use.

    Two kinds of entry are skipped, never chosen:
    - pending (not durable): the write-behind queue still owns it and its put has not been
      answered stored or dropped; deleting it would lose an accepted put behind the queue's
      back. It is the newest entry anyway.
    - leased: a reader is restoring from it right now, the surest sign it is worth keeping;
      and deleting its file would not free the disk until the reader lets go. Its bytes still
      count, so the others pay for them until the lease ends.

    Entries are kept in an OrderedDict, oldest first (touch moves one to the end), so a
    selection visits its victims and the few skipped entries before them, not every entry.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[EntryRecord, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, record: EntryRecord) -> None:
        """Start tracking record as the most recently used; ValueError if already tracked."""
        if record in self._order:
            raise ValueError(f"entry {record.id} is already tracked")
        self._order[record] = None

    def remove(self, record: EntryRecord) -> None:
        """Stop tracking record; KeyError if it is not tracked."""
        del self._order[record]

    def touch(self, record: EntryRecord) -> None:
        """Make record the most recently used; KeyError if it is not tracked."""
        self._order.move_to_end(record)

    def select_victims(self, over_bytes: int) -> list[EntryRecord]:
        """The least recently used evictable entries whose bytes add up to over_bytes.

        Fewer if every evictable entry together is not enough. Nothing is removed: the caller
        deletes each victim's file and then calls remove().
        """
        victims: list[EntryRecord] = []
        freed = 0
        for record in self._order:
            if freed >= over_bytes:
                break
            if evictable(record):
                victims.append(record)
                freed += record.nbytes
        return victims


# The eviction policies by setting value (the eviction_policy setting chooses one).
EVICTION_POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy}
