"""Whom the tier tells of what happens to its entries beyond its own rooms: an entry made
durable (the writer tells), an entry a lookup hit (the reads tell). The remote tier's uploads
listen, subscribed through on_stored and on_hit.

Each listener runs on the event loop, in the middle of the tier's bookkeeping: it must only
note the record (queue it), never block, never raise.
"""

from __future__ import annotations

from collections.abc import Callable

from kvd.store.records import EntryRecord

Listener = Callable[[EntryRecord], None]


class Notices:
    """The listeners of each notice, told in the order they subscribed."""

    def __init__(self) -> None:
        self._stored: list[Listener] = []  # an entry is durable
        self._hit: list[Listener] = []  # a lookup served an entry

    def on_stored(self, listener: Listener) -> None:
        """Tell listener of each entry made durable from now on."""
        self._stored.append(listener)

    def on_hit(self, listener: Listener) -> None:
        """Tell listener of each entry a lookup served from now on (once its reply is sent)."""
        self._hit.append(listener)

    def entry_stored(self, record: EntryRecord) -> None:
        for listener in self._stored:
            listener(record)

    def entry_hit(self, record: EntryRecord) -> None:
        for listener in self._hit:
            listener(record)
