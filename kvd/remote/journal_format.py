"""The upload journal's format: the uploads pending in the queue, as records appended to a
file, so that a restart finds those a stop cut off. Pure: upload_journal.py does the I/O.

A journal is MAGIC, then fixed-size records (RECORD), each an upload that joined the queue
(ADDED: the entry's id and its bytes to send) or left it (LEFT: sent whole or counted
dropped), checked by a CRC-32 of its own. Replayed in order, what was added and has not left
is pending, in the order it joined. A file that is not a journal, or a record that fails its
check or is cut short, ends what can be read: the replay says where and why (damage), and
keeps what came before.

Compaction writes the pending uploads anew as ADDED records (compacted) once the records
left behind outnumber them (worth_compacting), so the file stays within about COMPACT_MIN
records, or twice the uploads the queue holds, whichever is more.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

MAGIC: Final = b"kvd upload journal 1\n"
RECORD: Final = struct.Struct(">c16sQI")  # kind, entry id (16 bytes), bytes, CRC-32 of the rest
ADDED: Final = b"+"
LEFT: Final = b"-"
COMPACT_MIN: Final = 256  # records below this are never worth a rewrite


@dataclass
class Replay:
    """What a journal's bytes say: the uploads pending (entry id -> bytes, in the order they
    joined), how many records were read, and the damage that ended the reading (None: read
    to its end)."""

    pending: dict[str, int] = field(default_factory=dict)
    records: int = 0
    damage: str | None = None


def record(kind: bytes, entry: str, nbytes: int = 0) -> bytes:
    """One record; ValueError for an entry id that is not 32 hex digits."""
    try:
        ident = bytes.fromhex(entry)
    except ValueError:
        ident = b""
    if len(ident) != 16:
        raise ValueError(f"an entry id is 32 hex digits, not {entry!r}")
    head = kind + ident + nbytes.to_bytes(8, "big")
    return head + zlib.crc32(head).to_bytes(4, "big")


def compacted(pending: Iterable[tuple[str, int]]) -> bytes:
    """A whole journal holding exactly the pending uploads, in their order."""
    return MAGIC + b"".join(record(ADDED, entry, nbytes) for entry, nbytes in pending)


def replay(data: bytes) -> Replay:
    """The journal's pending uploads; an empty file is an empty journal."""
    found = Replay()
    if not data:
        return found
    if not data.startswith(MAGIC):
        found.damage = "not an upload journal (its first bytes are not the journal's)"
        return found
    view = memoryview(data)[len(MAGIC) :]
    for offset in range(0, len(view) - RECORD.size + 1, RECORD.size):
        kind, ident, nbytes, crc = RECORD.unpack_from(view, offset)
        if zlib.crc32(view[offset : offset + RECORD.size - 4]) != crc or kind not in (ADDED, LEFT):
            found.damage = f"record {found.records + 1} (byte {len(MAGIC) + offset}) is damaged"
            return found
        found.records += 1
        entry = ident.hex()
        if kind == ADDED:
            found.pending[entry] = nbytes
        else:
            found.pending.pop(entry, None)
    if len(view) % RECORD.size:
        found.damage = f"its last record is cut short ({len(view) % RECORD.size} bytes)"
    return found


def worth_compacting(records: int, pending: int) -> bool:
    """Whether a journal of this many records, of which pending are uploads still pending,
    should be written anew: the records left behind dominate."""
    return records >= COMPACT_MIN and records > 2 * pending
