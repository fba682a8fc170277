"""Leases: an entry under lease is never deleted from under its reader.

A lookup hit takes a lease for the connection that asked; release ends it, and so does the end
of the connection. Leases are indexed by their owner, so a connection that closes ends its own
leases without a look at anyone else's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvd_protocol.errors import ErrorCode, ProtocolError

from kvd.catalog import Catalog
from kvd.records import EntryRecord


@dataclass(frozen=True, slots=True)
class Lease:
    record: EntryRecord
    owner: int  # the connection that holds it


class Leases:
    """Every lease held, by id and by owner."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[int, dict[int, None]] = {}  # owner -> its lease ids, in order
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def held_by(self, owner: int) -> int:
        return len(self._by_owner.get(owner, ()))

    def take(self, owner: int, record: EntryRecord) -> int:
        """A new lease on record for owner; a use of the entry."""
        lease = next(self._ids)
        self._leases[lease] = Lease(record, owner)
        self._by_owner.setdefault(owner, {})[lease] = None
        self._catalog.lease_taken(record)
        return lease

    def record(self, owner: int, lease_id: int) -> EntryRecord:
        """The entry owner's lease is on; NOT_FOUND if owner holds no such lease."""
        return self._lease(owner, lease_id).record

    def _lease(self, owner: int, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no lease {lease_id} on this connection")
        return lease

    def release(self, owner: int, lease_id: int) -> EntryRecord:
        """End owner's lease; the entry it was on."""
        lease = self._lease(owner, lease_id)
        owned = self._by_owner[owner]
        del owned[lease_id]
        if not owned:
            del self._by_owner[owner]
        self._end(lease_id)
        return lease.record

    def release_all(self, owner: int) -> None:
        """The owner's connection ended: every lease it holds ends, and no other is looked at."""
        for lease_id in self._by_owner.pop(owner, {}):
            self._end(lease_id)

    def _end(self, lease_id: int) -> None:
        self._catalog.lease_ended(self._leases.pop(lease_id).record)
