"""Leases: an entry under lease is never deleted from under its reader.

A lookup hit takes a lease for the connection that asked; release ends it, and so does the end
of the connection, and so does age: a lease older than lease_max_age ends (expire), so
that a reader that never releases cannot keep entries from eviction for ever (its descriptors
stay valid: an unlinked file lives while it is open). Leases are indexed by their owner, so a
connection that closes ends its own leases without a look at anyone else's.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvd_protocol.errors import ErrorCode, ProtocolError

from kvd.store.catalog import Catalog
from kvd.store.records import EntryRecord

# Expired lease ids remembered, so that a late release or open_blocks is told why: a bound,
# the oldest forgotten first (then the answer is only "no lease").
EXPIRED_REMEMBERED = 4096


@dataclass(slots=True)
class Lease:
    record: EntryRecord
    owner: int  # the connection it was granted to
    taken: float = field(default_factory=time.monotonic)
    opened: int = 0  # block descriptors handed out on it (open_blocks)


class Leases:
    """Every lease, by id and by owner."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[int, dict[int, None]] = {}  # owner -> its lease ids, in order
        self._ids = itertools.count(1)
        self._expired: OrderedDict[int, int] = OrderedDict()  # lease id -> its owner
        self.expired = 0  # leases ended by age since start

    def __len__(self) -> int:
        return len(self._leases)

    def count_of(self, owner: int) -> int:
        """How many leases owner has."""
        return len(self._by_owner.get(owner, ()))

    def grant(self, owner: int, record: EntryRecord) -> int:
        """A new lease on record for owner; a use of the entry."""
        lease = next(self._ids)
        self._leases[lease] = Lease(record, owner)
        self._by_owner.setdefault(owner, {})[lease] = None
        self._catalog.lease_taken(record)
        return lease

    def record(self, owner: int, lease_id: int) -> EntryRecord:
        """The entry owner's lease is on; NOT_FOUND if owner has no such lease."""
        return self.lease(owner, lease_id).record

    def lease(self, owner: int, lease_id: int) -> Lease:
        """Owner's lease; NOT_FOUND if owner has no such lease (saying so if it expired)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            if self._expired.get(lease_id) == owner:
                raise ProtocolError(
                    ErrorCode.NOT_FOUND,
                    f"lease {lease_id} ended: it was kept longer than the lease age limit",
                )
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no lease {lease_id} on this connection")
        return lease

    def release(self, owner: int, lease_id: int) -> EntryRecord:
        """End owner's lease; the entry it was on."""
        lease = self.lease(owner, lease_id)
        self._disown(lease_id, owner)
        self._end(lease_id)
        return lease.record

    def expire(self, max_age: float, now: float | None = None) -> list[Lease]:
        """End every lease taken more than max_age seconds ago; the leases ended."""
        deadline = (time.monotonic() if now is None else now) - max_age
        stale = []
        for lease_id, lease in self._leases.items():  # in the order they were taken
            if lease.taken > deadline:
                break
            stale.append((lease_id, lease))
        for lease_id, lease in stale:
            self._disown(lease_id, lease.owner)
            self._end(lease_id)
            self._expired[lease_id] = lease.owner
            if len(self._expired) > EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)
        self.expired += len(stale)
        return [lease for _, lease in stale]

    def _disown(self, lease_id: int, owner: int) -> None:
        owned = self._by_owner[owner]
        del owned[lease_id]
        if not owned:
            del self._by_owner[owner]

    def release_all(self, owner: int) -> None:
        """The owner's connection ended: every lease it has ends, and no other is looked at."""
        for lease_id in self._by_owner.pop(owner, {}):
            self._end(lease_id)

    def _end(self, lease_id: int) -> None:
        self._catalog.lease_ended(self._leases.pop(lease_id).record)
