"""What the remote tier is handed of the local one, and no more: the reads its uploads lease
entries and open blocks through and its fetches measure the local match with, the puts its
fetches write through, a read-only view of the entries, the wait for start-up's listing, the
flush, and the subscriptions to the notices of entries stored and hit (kvd.store.notices).

Each part is named by what the remote tier calls on it (the local tier's services answer
them: kvd.store.reads, puts, tier_view), so that kvd.remote holds no Tier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits

from kvd.store.blocks import Block
from kvd.store.notices import Listener
from kvd.store.records import EntryRecord
from kvd.store.staged_put import DeclaredBlocks, Put


class Reads(Protocol):
    """The local tier's reads (kvd.store.reads.Reads), as the uploads and fetches use them."""

    def longest_match(self, identity: Identity, tokens: bytes) -> int: ...

    def lease_entry(self, owner: int, entry: str) -> tuple[EntryRecord, int, int] | None: ...

    def open_blocks(self, owner: int, lease_id: int, first: int, count: int) -> list[int]: ...

    def end_lease(self, owner: int, lease_id: int) -> EntryRecord: ...


class Puts(Protocol):
    """The local tier's puts (kvd.store.puts.Puts), as the fetches use them."""

    async def begin(
        self, owner: int, identity: Identity, tokens: bytes, size: int, declared: DeclaredBlocks
    ) -> tuple[Put | None, str | None, int | None]: ...

    async def block_files(self, owner: int, put_id: int, first: int, count: int) -> list[int]: ...

    async def commit_owned(self, owner: int, put_id: int) -> int: ...

    def abort_owned(self, owner: int, put_id: int) -> None: ...


class View(Protocol):
    """The local tier's read-only view (kvd.store.tier_view.TierView), as the uploads use it."""

    def entry(self, entry: str) -> EntryRecord | None: ...

    def stored_entries(self) -> Iterator[EntryRecord]: ...

    def blocks_of(self, record: EntryRecord) -> tuple[Block, ...]: ...


@dataclass(frozen=True)
class LocalTier:
    """The parts of the local tier the remote tier uses (see the module)."""

    limits: Limits
    view: View
    reads: Reads
    puts: Puts
    settled: Callable[[], Awaitable[None]]  # until start-up has listed the directory
    flush: Callable[[float | None], Awaitable[tuple[bool, int]]]  # (all durable, pending)
    on_stored: Callable[[Listener], None]  # an entry made durable, told to the listener
    on_hit: Callable[[Listener], None]  # an entry a lookup served, told to the listener
