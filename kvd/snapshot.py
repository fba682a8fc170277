"""The index snapshot: start-up in seconds at 100k entries, checked against the directory.

A full start-up scan reads and validates every entry's header (tens of microseconds each, far
more for long prompts). The snapshot keeps what the index needs of each durable entry, with the
file's size and modification time. At start the directory is listed (cheap: one stat per
file); an entry whose file still has the recorded size and mtime is taken from the snapshot, any
other file is scanned as usual, and snapshot rows without a file are forgotten. So a stale or
partial snapshot costs only the scans of what changed, and a missing or corrupt one (checked by
its checksum) costs a full scan: never a wrong index.

Shared blocks (format v2) are kept the same way, each with its file's size and mtime, and
each entry's row lists its blocks' hashes: a block file unchanged since is not read again.

File: 8-byte magic, 8-byte xxh3-64 of the body, then the msgpack body
{"version": 2, "rows": [[identity, id, nbytes, mtime_ns, tokens, trimmable, min_reuse,
created, last_used, checkpoint_key, blocks, block_size], ...], "blocks": [[identity, hash,
size, mtime_ns], ...]} (blocks: the entry's hashes, 16 bytes each, end to end).
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

import msgpack
from kvd_protocol.blocks import HASH_BYTES, split_hashes
from kvd_protocol.checksum import CHECKSUM_BYTES, checksum

from kvd.blocks import Block
from kvd.durability import replace_durably
from kvd.logs import get_logger
from kvd.records import EntryRecord

log = get_logger("kvd.snapshot")

MAGIC = b"KVDSNAP\n"
VERSION = 2


@dataclass(frozen=True)
class SnapshotRow:
    """One durable entry as the snapshot remembers it, with its file's size and mtime."""

    record: EntryRecord
    mtime_ns: int


@dataclass(frozen=True)
class BlockRow:
    """One durable block as the snapshot remembers it."""

    identity: str
    hash: bytes
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Snapshot:
    """The entries' rows by entry id (ids are 128 random bits: unique across identities) and
    the blocks' by (identity, hash)."""

    rows: dict[str, SnapshotRow]
    blocks: dict[tuple[str, bytes], BlockRow]


EMPTY = Snapshot({}, {})


def save_snapshot(
    path: Path, entries: Iterable[tuple[Path, EntryRecord]], blocks: Iterable[Block] = ()
) -> int:
    """Write the snapshot atomically (blocking: run in a thread); returns the rows written.

    Files that vanished meanwhile are left out: the next start scans what is there.
    """
    rows = []
    for file, r in entries:
        try:
            mtime_ns = file.stat().st_mtime_ns
        except FileNotFoundError:
            continue
        rows.append(
            [
                r.identity,
                r.id,
                r.nbytes,
                mtime_ns,
                r.tokens,
                r.trimmable,
                r.min_reuse,
                r.created,
                r.last_used,
                r.checkpoint_key,
                b"".join(r.blocks),
                r.block_size,
            ]
        )
    rows.sort(key=itemgetter(8))  # least recently used first: start-up reads them in order
    block_rows = []
    for block in blocks:
        try:
            mtime_ns = block.path.stat().st_mtime_ns
        except FileNotFoundError:
            continue
        block_rows.append([block.identity, block.hash, block.size, mtime_ns])
    body = msgpack.packb(
        {"version": VERSION, "rows": rows, "blocks": block_rows}, use_bin_type=True
    )
    temporary = path.with_suffix(".tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(MAGIC + checksum(body) + body)
        replace_durably(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk keeps no half snapshot (the old one stays)
        raise
    return len(rows)


def load_snapshot(path: Path) -> Snapshot:
    """The snapshot's rows; empty when missing, corrupt or foreign."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size <= len(MAGIC) + CHECKSUM_BYTES:
                log.warning("snapshot_ignored", path=str(path), reason="too short")
                return EMPTY
            # Decoded straight from the page cache: no copy of hundreds of MiB first.
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return _decode(path, view)
                finally:
                    view.release()
    except FileNotFoundError:
        return EMPTY


def _decode(path: Path, data: memoryview) -> Snapshot:
    head = len(MAGIC) + CHECKSUM_BYTES
    body = data[head:]
    try:
        if data[: len(MAGIC)] != MAGIC or data[len(MAGIC) : head] != checksum(body):
            log.warning("snapshot_ignored", path=str(path), reason="bad magic or checksum")
            return EMPTY
        decoded = msgpack.unpackb(body, raw=False, use_list=False)
        if decoded.get("version") != VERSION:
            log.warning("snapshot_ignored", path=str(path), reason="another version")
            return EMPTY
        rows = {row[1]: _row(row) for row in decoded["rows"]}
        blocks = (_block_row(row) for row in decoded["blocks"])
        return Snapshot(rows, {(b.identity, b.hash): b for b in blocks})
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        log.warning("snapshot_ignored", path=str(path), reason=f"malformed: {exc}")
        return EMPTY
    finally:
        body.release()


def _row(row: tuple[object, ...]) -> SnapshotRow:
    (
        identity,
        entry_id,
        nbytes,
        mtime_ns,
        tokens,
        trimmable,
        min_reuse,
        created,
        last_used,
        key,
        blocks,
        block_size,
    ) = row
    if not (
        isinstance(identity, str)
        and isinstance(entry_id, str)
        and isinstance(nbytes, int)
        and isinstance(mtime_ns, int)
        and isinstance(tokens, bytes)
        and isinstance(trimmable, bool)
        and isinstance(min_reuse, int)
        and isinstance(created, float)
        and isinstance(last_used, int)
        and (key is None or isinstance(key, str))
        and isinstance(blocks, bytes)
        and isinstance(block_size, int)
    ):
        raise ValueError("a row of the wrong types")
    record = EntryRecord(
        id=entry_id,
        identity=sys.intern(identity),  # one string per identity, not one per row
        tokens=tokens,
        nbytes=nbytes,
        trimmable=trimmable,
        min_reuse=min_reuse,
        created=created,
        last_used=last_used,
        durable=True,
        checkpoint_key=key,
        blocks=split_hashes(blocks),
        block_size=block_size,
    )
    return SnapshotRow(record, mtime_ns)


def _block_row(row: tuple[object, ...]) -> BlockRow:
    identity, block_hash, size, mtime_ns = row
    if not (
        isinstance(identity, str)
        and isinstance(block_hash, bytes)
        and len(block_hash) == HASH_BYTES
        and isinstance(size, int)
        and isinstance(mtime_ns, int)
    ):
        raise ValueError("a block row of the wrong types")
    return BlockRow(sys.intern(identity), block_hash, size, mtime_ns)
