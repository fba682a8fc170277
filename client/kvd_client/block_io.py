"""Tensors cut by token on the engine's side: their rows written into block files (and the
manifest's tail) straight from the source arrays, and read back straight into the restore's
buffers, one pwritev / preadv per tensor per block (FORMAT.md, "Version 2").

A cut tensor [batch, heads, tokens, ...] in C order is batch * heads outer runs, each of
tokens rows. A block's slot holds rows [i*B, (i+1)*B) of every run, back to back; the
manifest's tail slot rows [n*B, T). The rows are never gathered into a copy: the kernel
takes the runs as an iovec, and the checksum reads each piece right after it was copied.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from kvd_protocol.checksum import new_checksum
from kvd_protocol.dtypes import itemsize
from kvd_protocol.errors import EntryFormatError, Rule

TOKEN_AXIS: Final = 2  # [batch, heads, tokens, ...]: the axis blocks cut
# Pieces copied per system call (and checksummed right after, while still in the CPU's
# cache): as entry_io's chunks, 1 MiB written, a quarter of that read.
WRITE_BYTES: Final = 1 << 20
READ_BYTES: Final = 1 << 18
IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True)
class Cut:
    """Where the rows of a tensor cut by token lie: outer runs of length rows of row bytes."""

    outer: int
    length: int
    row: int

    @classmethod
    def of(cls, dtype: str, shape: Sequence[int]) -> Cut:
        """The cut of a tensor of dtype and shape (tokens along TOKEN_AXIS); raises ValueError
        for a shape with no token axis."""
        if len(shape) <= TOKEN_AXIS:
            raise ValueError(f"a tensor of shape {list(shape)} has no token axis to cut")
        row = math.prod(shape[TOKEN_AXIS + 1 :]) * itemsize(dtype)
        return cls(math.prod(shape[:TOKEN_AXIS]), shape[TOKEN_AXIS], row)

    @property
    def nbytes(self) -> int:
        return self.outer * self.length * self.row

    def runs(self, pieces: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
        """Rows [start, stop) of every outer run, in order, as views into pieces: the
        tensor's bytes in C order, in one or more consecutive byte views (a source array,
        or a restore's destination runs). Nothing is copied."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"rows {start}..{stop} outside 0..{self.length}")
        if sum(piece.nbytes for piece in pieces) != self.nbytes:
            raise ValueError(f"pieces for {self.nbytes} bytes expected")
        if start == stop:
            return []
        span = self.length * self.row
        ranges = (
            (o * span + start * self.row, o * span + stop * self.row) for o in range(self.outer)
        )
        return _cut(pieces, ranges)


def _cut(pieces: Sequence[memoryview], ranges: Iterator[tuple[int, int]]) -> list[memoryview]:
    """The views of pieces (consecutive) that make up each byte range, ranges in order."""
    out: list[memoryview] = []
    at, base = 0, 0  # the current piece and the offset of its first byte
    for first, high in ranges:
        low = first
        while low < high:
            while base + pieces[at].nbytes <= low:
                base += pieces[at].nbytes
                at += 1
            piece = pieces[at]
            end = min(high - base, piece.nbytes)
            out.append(piece[low - base : end])
            low = base + end
    return out


def _calls(views: Sequence[memoryview], limit: int) -> Iterator[list[memoryview]]:
    """views in iovecs of at most limit bytes (a longer view is split) and IOV_MAX entries."""
    group: list[memoryview] = []
    size = 0
    for view in views:
        for pos in range(0, view.nbytes, limit):
            piece = view[pos : pos + limit]
            if group and (size + piece.nbytes > limit or len(group) == IOV_MAX):
                yield group
                group, size = [], 0
            group.append(piece)
            size += piece.nbytes
    if group:
        yield group


def _advanced(group: list[memoryview], done: int) -> list[memoryview]:
    """What is left of group after its first done bytes."""
    while done and done >= group[0].nbytes:
        done -= group[0].nbytes
        group = group[1:]
    return [group[0][done:], *group[1:]] if done else group


def write_runs(fd: int, offset: int, runs: Sequence[memoryview]) -> bytes:
    """Write runs back to back at offset of fd by pwritev; their checksum, computed as each
    piece is written."""
    hasher = new_checksum()
    for group in _calls(runs, WRITE_BYTES):
        pending = group
        while pending:
            written = os.pwritev(fd, pending, offset)
            if not written:
                raise OSError(f"no progress writing at offset {offset}")
            pending, offset = _advanced(pending, written), offset + written
        for piece in group:
            hasher.update(piece)  # while the piece is still in the CPU's cache
    return hasher.digest()


def read_runs(
    fd: int, offset: int, runs: Sequence[memoryview], checksum: bytes | None, name: str
) -> None:
    """Fill runs, in order, with the bytes at offset of fd by preadv, checked against
    checksum unless None; raises EntryFormatError (the file ends first: truncated; the bytes
    differ: data_checksum) or OSError. name: the file's, for errors."""
    hasher = new_checksum() if checksum is not None else None
    start = offset
    for group in _calls(runs, READ_BYTES):
        pending = group
        while pending:
            got = os.preadv(fd, pending, offset)
            if not got:
                raise EntryFormatError(
                    name, Rule.TRUNCATED, f"slot at {start}: the file ends at {offset}"
                )
            pending, offset = _advanced(pending, got), offset + got
        if hasher is not None:
            for piece in group:
                hasher.update(piece)  # while the piece is still in the CPU's cache
    if hasher is not None and hasher.digest() != checksum:
        raise EntryFormatError(
            name, Rule.DATA_CHECKSUM, f"slot at {start}: bytes do not match its checksum"
        )
