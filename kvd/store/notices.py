"""Whom the tier tells of what happens to its entries beyond its own rooms: an entry made
durable (the writer), an entry a lookup hit (the tier). The remote tier's uploads listen.

Each listener runs on the event loop, in the middle of the tier's bookkeeping: it must only
note the record (queue it), never block, never raise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.store.records import EntryRecord

Listener = Callable[[EntryRecord], None]


@dataclass
class Notices:
    stored: list[Listener] = field(default_factory=list)  # an entry is durable
    hit: list[Listener] = field(default_factory=list)  # a lookup served an entry

    def entry_stored(self, record: EntryRecord) -> None:
        for listener in self.stored:
            listener(record)

    def entry_hit(self, record: EntryRecord) -> None:
        for listener in self.hit:
            listener(record)
