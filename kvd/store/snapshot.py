"""The index snapshot: start-up in under a second at 100k entries, checked against the directory.

A full start-up scan reads and validates every entry's header (tens of microseconds each, far
more for long prompts). The snapshot keeps what the index needs of each durable entry, with the
file's size and modification time. At start the directory is listed (cheap: one stat per
file); an entry whose file still has the recorded size and mtime is taken from the snapshot, any
other file is scanned as usual, and snapshot rows without a file are forgotten. So a stale or
partial snapshot costs only the scans of what changed, and a missing or corrupt one (checked by
its checksum) costs a full scan: never a wrong index.

Shared blocks (format v2) are kept the same way, each with its file's size and mtime, and
each entry's row lists its blocks' hashes: a block file unchanged since is not read again.

File: 8-byte magic, 8-byte xxh3-64 of the rest, 8-byte little-endian length of the head, the
msgpack head, then the token section: every row's packed tokens end to end, in row order.
The head is columnar, one value per row in each column, rows least recently used first:
{"version": 4, "identities": [digest, ...], "rows": n, "ids": [id, ...], "checkpoints":
{row: key}, "manifests": {row: [hashes end to end, block_size]}, "blocks": [[identity, hash,
size, mtime_ns], ...], and as packed little-endian arrays: "identity" (into identities),
"token_bytes", "nbytes", "mtime_ns", "min_reuse", "last_used" (i64), "created" (f64),
"trimmable" and "prefill_checkpoint" (one byte each, 0 or 1)}, and "retentions": {row: [until,
seconds, priority]} for the entries retained when it was written (kvd.store.retention; a
snapshot without it, as older daemons wrote, retains none). Columns decode in C, not row
by row in Python, and the loaded records' tokens are views of the mapped token section: no
entry's tokens are copied. A snapshot of another version (version 3 had no
"prefill_checkpoint" column) is ignored as a foreign one: start-up reads every header again,
which knows each entry's kind.

The file is mapped read-only and stays mapped while a loaded entry remains. The daemon never
writes it in place (a new snapshot is a new file renamed over it), so the mapping never
changes under the daemon; a file truncated in place by someone else would (SIGBUS on the next
read of its tokens), like editing the daemon's memory.
"""

from __future__ import annotations

import mmap
import os
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain, compress, repeat
from operator import attrgetter
from pathlib import Path
from typing import TypeVar

import msgpack
from kvd_protocol.blocks import HASH_BYTES, split_hashes
from kvd_protocol.checksum import CHECKSUM_BYTES, checksum, new_checksum
from kvd_protocol.tokens import TOKEN_BYTES

from kvd.logs import get_logger
from kvd.store.blocks import Block
from kvd.store.durability import disk_free, replace_durably
from kvd.store.records import EntryRecord, Retained
from kvd.store.tier_dir import TierDir

log = get_logger("kvd.store.snapshot")

Number = TypeVar("Number", int, float)

MAGIC = b"KVDSNAP\n"
VERSION = 4
_LENGTH = 8  # bytes of the head's length
_PREFIX = len(MAGIC) + CHECKSUM_BYTES + _LENGTH
# The packed columns of integers (i64); "created" is the one of floats (f64).
_INTEGERS = ("identity", "token_bytes", "nbytes", "mtime_ns", "min_reuse", "last_used")
# The columns of flags, one byte (0 or 1) per row.
_FLAGS = ("trimmable", "prefill_checkpoint")
ROW_BYTES = 128  # a snapshot row beside its tokens: ids, sizes, times, flags


@dataclass(frozen=True)
class BlockRow:
    """One durable block as the snapshot remembers it."""

    digest: str
    hash: bytes
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Snapshot:
    """The durable entries a snapshot remembers, least recently used first, with each file's
    mtime when it was written (records[i] and mtime_ns[i] are one row); and the blocks', by
    (identity, hash)."""

    records: Sequence[EntryRecord]
    mtime_ns: Sequence[int]
    blocks: dict[tuple[str, bytes], BlockRow]

    @cached_property
    def rows(self) -> dict[str, int]:
        """Row numbers by entry id (128 random bits: unique across identities), made when
        first read: by start-up's listing, off the path to the first ping."""
        ids = map(attrgetter("id"), self.records)
        return dict(zip(ids, range(len(self.records)), strict=True))

    def mtime_of(self, entry_id: str) -> int | None:
        """The recorded mtime of an entry's file, or None for an entry it does not hold."""
        row = self.rows.get(entry_id)
        return None if row is None else self.mtime_ns[row]


EMPTY = Snapshot((), (), {})


def save_above_floor(
    dirs: TierDir, records: list[EntryRecord], blocks: list[Block], min_free: int
) -> int | None:
    """The snapshot of these durable entries and blocks saved (blocking), unless writing it
    would take the disk under min_free free bytes: the rows written, or None."""
    estimate = sum(len(r.tokens) + len(r.block_hashes) * HASH_BYTES + ROW_BYTES for r in records)
    estimate += len(blocks) * ROW_BYTES
    try:
        free: int | None = disk_free(dirs.root)
    except OSError:
        free = None
    if free is not None and free - estimate < min_free:
        log.warning("snapshot_skipped", reason="the free-disk floor", bytes=estimate)
        return None
    # Durable entries are never staged: each file is at its place under entries/.
    rows = [(dirs.entry_path(r.digest, r.id), r) for r in records]
    return save_snapshot(dirs.snapshot, rows, blocks)


def save_snapshot(
    path: Path, entries: Iterable[tuple[Path, EntryRecord]], blocks: Iterable[Block] = ()
) -> int:
    """Write the snapshot atomically (blocking: run in a thread); returns the rows written.

    Files that vanished meanwhile are left out: the next start scans what is there.
    """
    rows: list[tuple[int, EntryRecord]] = []
    for file, record in entries:
        try:
            rows.append((file.stat().st_mtime_ns, record))
        except FileNotFoundError:
            continue
    rows.sort(key=lambda row: row[1].last_used)  # least recently used first: start-up's order
    records = [record for _, record in rows]
    identities = sorted({r.digest for r in records})
    number = {digest: i for i, digest in enumerate(identities)}
    integers = {
        "identity": [number[r.digest] for r in records],
        "token_bytes": [len(r.tokens) for r in records],
        "nbytes": [r.nbytes for r in records],
        "mtime_ns": [mtime_ns for mtime_ns, _ in rows],
        "min_reuse": [r.min_reuse for r in records],
        "last_used": [r.last_used for r in records],
    }
    block_rows = []
    for block in blocks:
        try:
            mtime_ns = block.path.stat().st_mtime_ns
        except FileNotFoundError:
            continue
        block_rows.append([block.digest, block.hash, block.size, mtime_ns])
    head: dict[str, object] = {
        "version": VERSION,
        "identities": identities,
        "rows": len(records),
        "ids": [r.id for r in records],
        "checkpoints": {i: r.checkpoint_key for i, r in enumerate(records) if r.checkpoint_key},
        "manifests": {
            i: [b"".join(r.block_hashes), r.block_size]
            for i, r in enumerate(records)
            if r.block_hashes
        },
        "blocks": block_rows,
        "retentions": {
            i: [r.retained.until, r.retained.seconds, r.retained.priority]
            for i, r in enumerate(records)
            if r.retained is not None
        },
        "trimmable": bytes(r.trimmable for r in records),
        "prefill_checkpoint": bytes(r.prefill_checkpoint for r in records),
        "created": _pack(array("d", [r.created for r in records])),
    }
    head.update({name: _pack(array("q", integers[name])) for name in _INTEGERS})
    packed = msgpack.packb(head, use_bin_type=True)
    body = (len(packed).to_bytes(_LENGTH, "little"), packed, b"".join(r.tokens for r in records))
    digest = new_checksum()
    for part in body:
        digest.update(part)
    temporary = path.with_suffix(".tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(MAGIC + digest.digest())
            out.writelines(body)
        replace_durably(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk keeps no half snapshot (the old one stays)
        raise
    return len(records)


def load_snapshot(path: Path) -> Snapshot:
    """The snapshot's entries; empty when missing, corrupt or foreign."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size <= _PREFIX:
                log.warning("snapshot_ignored", path=str(path), reason="too short")
                return EMPTY
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        return EMPTY
    try:
        snapshot, tokens_at = _decode(memoryview(mapped))
    except _UnusableError as exc:
        log.warning("snapshot_ignored", path=str(path), reason=str(exc))
        return EMPTY
    # The head is decoded into objects of their own: its pages need not stay in memory.
    head_pages = tokens_at - tokens_at % mmap.PAGESIZE
    if head_pages:
        mapped.madvise(mmap.MADV_DONTNEED, 0, head_pages)
    return snapshot


class _UnusableError(Exception):
    pass


def _decode(data: memoryview) -> tuple[Snapshot, int]:
    """The snapshot, and where its token section starts."""
    if data[: len(MAGIC)] != MAGIC:
        raise _UnusableError("bad magic")
    if data[len(MAGIC) : len(MAGIC) + CHECKSUM_BYTES] != checksum(data[_PREFIX - _LENGTH :]):
        raise _UnusableError("bad checksum")
    length = int.from_bytes(data[_PREFIX - _LENGTH : _PREFIX], "little")
    try:
        head = msgpack.unpackb(
            data[_PREFIX : _PREFIX + length], raw=False, use_list=False, strict_map_key=False
        )
        if head.get("version") != VERSION:
            raise _UnusableError("another version")
        return _records(head, data[_PREFIX + length :]), _PREFIX + length
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        raise _UnusableError(f"malformed: {exc}") from exc


def _records(head: dict[str, object], tokens: memoryview) -> Snapshot:
    count = head["rows"]
    ids = head["ids"]
    identities = head["identities"]
    checkpoints = head["checkpoints"]
    manifests = head["manifests"]
    if not (
        isinstance(count, int)
        and isinstance(ids, tuple)
        and isinstance(identities, tuple)
        and isinstance(checkpoints, dict)
        and isinstance(manifests, dict)
    ):
        raise ValueError("a part of the wrong type")
    columns = {name: _unpack(array("q"), head[name], count) for name in _INTEGERS}
    lengths = columns["token_bytes"]
    ends = list(accumulate(lengths))
    # Checked in C (map, set), not value by value in Python: 100k rows at start-up.
    if not set(map(type, chain(ids, identities, checkpoints.values()))) <= {str}:
        raise ValueError("an id, identity or key that is not a string")
    if len(ids) != count:
        raise ValueError("ids that do not match the rows")
    flags = {name: _flags(head[name], count) for name in _FLAGS}
    if (ends[-1] if ends else 0) != len(tokens) or (
        lengths and (min(lengths) < 0 or any(map(TOKEN_BYTES.__rmod__, lengths)))
    ):
        raise ValueError("token lengths that do not match the token section")
    numbers = columns["identity"]
    if numbers and not 0 <= min(numbers) <= max(numbers) < len(identities):
        raise ValueError("a row of no identity")
    digests = [sys.intern(digest) for digest in identities]  # one string per identity
    sizes: dict[int, int] = {}  # one int object per file size, not one per row
    records = list(
        map(
            EntryRecord,
            ids,
            [digests[i] for i in numbers],
            map(tokens.__getitem__, map(slice, [0, *ends], ends)),
            map(sizes.setdefault, columns["nbytes"], columns["nbytes"]),
            map(bool, flags["trimmable"]),
            columns["min_reuse"],
            _unpack(array("d"), head["created"], count),
            columns["last_used"],
            repeat(True),  # durable
        )
    )
    if not all(isinstance(row, int) and 0 <= row < count for row in (*checkpoints, *manifests)):
        raise ValueError("a checkpoint or block list of no row")
    for row, key in checkpoints.items():
        records[row].checkpoint_key = key
    for marked in compress(records, flags["prefill_checkpoint"]):
        marked.prefill_checkpoint = True
    for row, (hashes, block_size) in manifests.items():
        if not (isinstance(hashes, bytes) and isinstance(block_size, int)):
            raise ValueError("a block list of the wrong types")
        records[row].block_hashes, records[row].block_size = split_hashes(hashes), block_size
    for row, retained in _retentions(head.get("retentions", {}), count).items():
        records[row].retained = retained
    blocks = (_block_row(row) for row in _sequence(head["blocks"]))
    if len(set(ids)) != count:
        raise ValueError("an id in two rows")
    return Snapshot(records, columns["mtime_ns"], {(b.digest, b.hash): b for b in blocks})


def _retentions(rows: object, count: int) -> dict[int, Retained]:
    """The retentions by row (see the module)."""
    if not isinstance(rows, dict):
        raise ValueError("retentions that are not a map")
    found: dict[int, Retained] = {}
    for row, value in rows.items():
        until, seconds, priority = _sequence(value)
        if not (
            isinstance(row, int)
            and 0 <= row < count
            and isinstance(until, float)
            and isinstance(seconds, float)
            and isinstance(priority, int)
        ):
            raise ValueError("a retention of the wrong types or of no row")
        found[row] = Retained(until, seconds, priority)
    return found


def _flags(column: object, count: int) -> bytes:
    """A column of flags: a byte per row, 0 or 1."""
    if not isinstance(column, bytes) or len(column) != count or column.strip(b"\0\1"):
        raise ValueError("a column of flags that does not match the rows")
    return column


def _sequence(value: object) -> tuple[object, ...]:
    if not isinstance(value, tuple):
        raise ValueError("a list that is not one")
    return value


def _block_row(row: object) -> BlockRow:
    digest, block_hash, size, mtime_ns = _sequence(row)
    if not (
        isinstance(digest, str)
        and isinstance(block_hash, bytes)
        and len(block_hash) == HASH_BYTES
        and isinstance(size, int)
        and isinstance(mtime_ns, int)
    ):
        raise ValueError("a block row of the wrong types")
    return BlockRow(sys.intern(digest), block_hash, size, mtime_ns)


def _pack(column: array[Number]) -> bytes:
    if sys.byteorder == "big":  # pragma: no cover - arm64 and x86-64 are little-endian
        column.byteswap()
    return column.tobytes()


def _unpack(column: array[Number], packed: object, count: int) -> array[Number]:
    """The column, kept packed (an int or float object is made only when a value is read:
    the mtimes, say, only for the rows the listing compares)."""
    if not isinstance(packed, bytes):
        raise ValueError("a column that is not packed bytes")
    column.frombytes(packed)  # ValueError for a length that is not a whole number of values
    if len(column) != count:
        raise ValueError("a column of another length than the rows")
    if sys.byteorder == "big":  # pragma: no cover
        column.byteswap()
    return column
