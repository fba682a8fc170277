"""The index snapshot: start-up in seconds at 100k entries, checked against the directory.

A full start-up scan reads and validates every entry's header (tens of microseconds each, far
more for long prompts). The snapshot keeps what the index needs of each durable entry, with the
file's size and modification time. At start the directory is listed (cheap: one stat per
file); an entry whose file still has the recorded size and mtime is taken from the snapshot, any
other file is scanned as usual, and snapshot rows without a file are forgotten. So a stale or
partial snapshot costs only the scans of what changed, and a missing or corrupt one (checked by
its checksum) costs a full scan: never a wrong index.

File: 8-byte magic, 8-byte xxh3-64 of the body, then the msgpack body
{"version": 1, "rows": [[identity, id, nbytes, mtime_ns, tokens, trimmable, min_reuse,
created, last_used, checkpoint_key], ...]}.
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
from kvd_protocol.checksum import CHECKSUM_BYTES, checksum

from kvd.durability import replace_durably
from kvd.logs import get_logger
from kvd.records import EntryRecord

log = get_logger("kvd.snapshot")

MAGIC = b"KVDSNAP\n"
VERSION = 1


@dataclass(frozen=True)
class SnapshotRow:
    """One durable entry as the snapshot remembers it, with its file's size and mtime."""

    record: EntryRecord
    mtime_ns: int


def save_snapshot(path: Path, entries: Iterable[tuple[Path, EntryRecord]]) -> int:
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
            ]
        )
    rows.sort(key=itemgetter(8))  # least recently used first: start-up reads them in order
    body = msgpack.packb({"version": VERSION, "rows": rows}, use_bin_type=True)
    temporary = path.with_suffix(".tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(MAGIC + checksum(body) + body)
        replace_durably(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk keeps no half snapshot (the old one stays)
        raise
    return len(rows)


def load_snapshot(path: Path) -> dict[str, SnapshotRow]:
    """The snapshot's rows by entry id (ids are 128 random bits: unique across identities);
    empty when missing, corrupt or foreign."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size <= len(MAGIC) + CHECKSUM_BYTES:
                log.warning("snapshot_ignored", path=str(path), reason="too short")
                return {}
            # Decoded straight from the page cache: no copy of hundreds of MiB first.
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return _decode(path, view)
                finally:
                    view.release()
    except FileNotFoundError:
        return {}


def _decode(path: Path, data: memoryview) -> dict[str, SnapshotRow]:
    head = len(MAGIC) + CHECKSUM_BYTES
    body = data[head:]
    try:
        if data[: len(MAGIC)] != MAGIC or data[len(MAGIC) : head] != checksum(body):
            log.warning("snapshot_ignored", path=str(path), reason="bad magic or checksum")
            return {}
        decoded = msgpack.unpackb(body, raw=False, use_list=False)
        if decoded.get("version") != VERSION:
            log.warning("snapshot_ignored", path=str(path), reason="another version")
            return {}
        return {row[1]: _row(row) for row in decoded["rows"]}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        log.warning("snapshot_ignored", path=str(path), reason=f"malformed: {exc}")
        return {}
    finally:
        body.release()


def _row(row: tuple[object, ...]) -> SnapshotRow:
    identity, entry_id, nbytes, mtime_ns, tokens, trimmable, min_reuse, created, last_used, key = (
        row
    )
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
    )
    return SnapshotRow(record, mtime_ns)
