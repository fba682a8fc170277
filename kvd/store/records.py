"""What the daemon knows of one entry, in memory: the unit the index, eviction and queue share."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvd_protocol.entry import EntryHeader
from kvd_protocol.messages import EntrySummary
from kvd_protocol.tokens import TOKEN_BYTES

# Packed little-endian u32 token ids: a new entry's own bytes, or, for an entry loaded from the
# index snapshot, a read-only view of the snapshot's token section, which the loaded entries
# share rather than each owning a copy (start-up in a fraction of the time; see snapshot.py).
# Compare a view through bytes: bytes methods take it, but its own == goes byte by byte.
Tokens = bytes | memoryview


@dataclass(slots=True)
class Retained:
    """An entry's retention (kvd.store.retention): kept before unretained entries until until
    (wall-clock seconds), which each use sets to seconds from then; priority orders retained
    entries among themselves."""

    until: float
    seconds: float
    priority: int = 0


# eq=False: a record is one entry, compared and hashed by identity, so that two entries with
# equal fields (a re-put of the same tokens) stay two distinct keys in sets and dicts.
@dataclass(slots=True, eq=False)
class EntryRecord:
    """One entry of the tier.

    digest is its Identity.digest(); tokens are the packed token ids (Tokens); nbytes is the
    file's size. min_reuse: the entry may not be trimmed below this many tokens. last_used is
    a logical clock value (larger = more recent), never a wall-clock time, so that two uses
    never tie. durable: stored and fsynced, rather than still pending in the write-behind queue.
    leases: readers with a lease on it. checkpoint_key: set for generation checkpoints, which live
    apart from prompt lookups and are never returned by a prefix lookup. used_at: the wall-clock
    time of the last lease taken since the daemon started (0: none), for people. blocks: the
    hashes of its shared blocks in order (format v2; none for v1), each a file of block_size
    bytes; nbytes stays the manifest file's own size. prefill_checkpoint: the caches part-way
    through a prompt's prefill (its header's meta marks it), never trimmable (trimmable is
    False: see lookup_trimmable) and evicted before whole entries (kvd.store.eviction).
    retained: its retention, if a put gave it one (kvd.store.retention; it may have ended).
    """

    id: str
    digest: str
    tokens: Tokens
    nbytes: int
    trimmable: bool
    min_reuse: int = 0
    created: float = 0.0
    last_used: int = 0
    durable: bool = False
    leases: int = 0
    checkpoint_key: str | None = None
    used_at: float = 0.0
    block_hashes: tuple[bytes, ...] = ()
    block_size: int = 0
    prefill_checkpoint: bool = False
    retained: Retained | None = None

    @property
    def token_count(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def logical_bytes(self) -> int:
        """What the entry takes stored alone: its file and each of its blocks."""
        return self.nbytes + len(self.block_hashes) * self.block_size


def lookup_trimmable(header: EntryHeader) -> bool:
    """Whether a lookup may trim the entry: every layer can be cut, and it is no prefill
    checkpoint, which serves only prompts that hold all of it (its place along the prompt
    is the point of it; a shorter one serves the shorter prefixes)."""
    return header.trimmable and not header.prefill_checkpoint


def record_from_header(entry_id: str, header: EntryHeader, last_used: int) -> EntryRecord:
    """The record of a durable entry file, from its validated header (its block_size is its
    blocks' files' size, which the tier learns from them)."""
    return EntryRecord(
        id=entry_id,
        digest=header.identity.digest(),
        tokens=header.tokens,
        nbytes=header.file_size,
        trimmable=lookup_trimmable(header),
        min_reuse=header.min_reuse,
        created=header.created,
        last_used=last_used,
        durable=True,
        checkpoint_key=header.checkpoint.key if header.checkpoint else None,
        block_hashes=header.block_hashes,
        prefill_checkpoint=header.prefill_checkpoint,
    )


def summary(record: EntryRecord) -> EntrySummary:
    """An entry as a lookup or a list page shows it."""
    retained = record.retained
    if retained is not None and retained.until <= time.time():
        retained = None  # it has ended: eviction forgets it when it next looks
    return EntrySummary(
        id=record.id,
        identity=record.digest,
        tokens=record.token_count,
        bytes=record.logical_bytes,  # what restoring it reads: its file and its blocks
        trimmable=record.trimmable,
        created=record.created,
        durable=record.durable,
        used=record.used_at or None,
        leases=record.leases,
        prefill_checkpoint=record.prefill_checkpoint,
        retained_until=None if retained is None else retained.until,
        retention_priority=0 if retained is None else retained.priority,
    )
