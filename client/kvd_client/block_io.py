"""Tensors cut by token on the engine's side: their rows written into block files (and the
manifest's tail) straight from the source arrays, and read back straight into the restore's
buffers, one pwritev / preadv per tensor per block (FORMAT.md, "Version 2").

A cut tensor [batch, heads, tokens, ...] in C order is batch * heads outer runs, each of
tokens rows. A block's slot holds rows [i*B, (i+1)*B) of every run, back to back; the
manifest's tail slot rows [n*B, T). The rows are never gathered into a copy: the kernel
takes the runs as an iovec, and the checksum reads each piece right after it was copied.
A cut tensor may also come as a CutCopy, a snapshot's copy of it a block at a time: each
block's bytes are then one buffer of its own, and blocks the daemon holds may be absent.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Final, TypeAlias, cast

from kvd_protocol.blocks import block_name
from kvd_protocol.checksum import new_checksum
from kvd_protocol.dtypes import itemsize
from kvd_protocol.entry import (
    ALIGNMENT,
    PREFIX_BYTES,
    TOKEN_AXIS,
    EntryHeader,
    ManifestPlan,
    Slot,
    with_rows,
)
from kvd_protocol.entry_reader import BlockHeads, check_block, parse_block_header, parse_prefix
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

from .entry_io import (  # CHUNK_BYTES: copied per call, then checksummed
    CHUNK_BYTES,
    Expected,
    Hasher,
    Piece,
    Pieces,
    TensorData,
    TensorLayoutError,
    advanced,
    calls_of,
    line_split,
    slot_pieces,
    views_of,
    write_all,
    write_slots,
)
from .workers import Descriptors, run_all

if TYPE_CHECKING:  # restore.py needs MLX; the raw put path (calls.py) must not
    from .restore import Fill


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


class BlocksNotHeld(Exception):  # noqa: N818 - an outcome the cold tier counts
    """A put whose snapshot left out blocks it took the daemon to hold, and the daemon holds
    fewer (evicted meanwhile): aborted before anything was written."""

    def __init__(self, held_blocks: int, needed: int) -> None:
        super().__init__(
            f"the daemon holds {held_blocks} leading blocks, the snapshot needs {needed}"
        )
        self.held_blocks = held_blocks


@dataclass(frozen=True)
class CutCopy:
    """A cut tensor copied a block at a time: per block of the entry the bytes of its rows
    of every outer run (exactly a block slot's), or None for a block the daemon holds (not
    copied); and the tail rows [n*B, T) the same way."""

    outer: int
    blocks: Sequence[memoryview | None]
    tail: memoryview

    @property
    def needed(self) -> int:
        """The blocks up to the last one left out: what the daemon must hold for a put."""
        return max((i + 1 for i, block in enumerate(self.blocks) if block is None), default=0)

    def whole(self) -> list[memoryview]:
        """The tensor's bytes in C order (a run of each block, then of the tail, per outer
        index), for an entry stored whole; raises BlocksNotHeld if a block was left out."""
        if self.needed:
            raise BlocksNotHeld(0, self.needed)
        parts = [*cast(list[memoryview], self.blocks), self.tail]
        runs = [part.nbytes // self.outer for part in parts]
        return [
            part[o * run : (o + 1) * run]
            for o in range(self.outer)
            for part, run in zip(parts, runs, strict=True)
            if run
        ]


Source: TypeAlias = "Pieces | CutCopy"  # a tensor's bytes as BlockWriter takes them


def sources(expected: Sequence[Expected], tensors: Sequence[TensorData]) -> list[Source]:
    """The byte views of each tensor (entry_io.views_of), a CutCopy kept as it is (checked
    by BlockWriter against its plan); raises TensorLayoutError."""
    if len(tensors) != len(expected):
        raise TensorLayoutError(f"{len(tensors)} tensors for {len(expected)} planned slots")
    plain = [i for i, tensor in enumerate(tensors) if not isinstance(tensor, CutCopy)]
    views = iter(views_of([expected[i] for i in plain], [tensors[i] for i in plain]))
    return [tensor if isinstance(tensor, CutCopy) else next(views) for tensor in tensors]


def whole(tensors: Sequence[TensorData]) -> list[TensorData]:
    """tensors with each CutCopy as its whole bytes (CutCopy.whole), for a version 1 entry."""
    return [tensor.whole() if isinstance(tensor, CutCopy) else tensor for tensor in tensors]


# Where the bytes between two slots (alignment padding) are read to: never looked at, so the
# reader threads may all write it at once.
_PADDING: Final = memoryview(bytearray(ALIGNMENT))


def read_slots(
    fd: int,
    slots: Sequence[Slot],
    runs: Sequence[Sequence[memoryview]],
    checksums: Sequence[bytes] | None,
    name: str,
) -> None:
    """Fill each slot's runs with its bytes, reading from the first slot's start to the last
    one's end (in file order, whatever the order given) in as few preadv calls as
    CHUNK_BYTES allows, each slot checked against its checksum in checksums unless None;
    raises EntryFormatError (the file ends first: truncated; the bytes differ:
    data_checksum) or OSError. name: the file's, for errors."""
    in_order = sorted(range(len(slots)), key=lambda k: slots[k].start)
    hashers: list[Hasher] = [None if checksums is None else new_checksum() for _ in slots]
    start, pieces = slot_pieces(((slots[k], runs[k], hashers[k]) for k in in_order), _PADDING)
    if pieces:
        _read(fd, start, pieces, name)
    if checksums is not None:
        for slot, hasher, checksum in zip(slots, hashers, checksums, strict=True):
            _check(hasher, checksum, slot.start, name)


def _read(fd: int, offset: int, pieces: Sequence[Piece], name: str) -> None:
    start = offset
    aligned = [(part, hasher) for piece, hasher in pieces for part in line_split([piece])]
    for group in calls_of(aligned, CHUNK_BYTES):
        pending = [piece for piece, _ in group]
        while pending:
            got = os.preadv(fd, pending, offset)
            if not got:
                raise EntryFormatError(
                    name, Rule.TRUNCATED, f"slot at {start}: the file ends at {offset}"
                )
            pending, offset = advanced(pending, got), offset + got
        for piece, hasher in group:
            if hasher is not None:
                hasher.update(piece)  # while the piece is still in the CPU's cache


def _check(hasher: Hasher, checksum: bytes, start: int, name: str) -> None:
    if hasher is not None and hasher.digest() != checksum:
        raise EntryFormatError(
            name, Rule.DATA_CHECKSUM, f"slot at {start}: bytes do not match its checksum"
        )


def _check_size(fd: int, size: int) -> None:
    found = os.fstat(fd).st_size
    if found != size:
        raise ValueError(f"staging file is {found} bytes, {size} planned")


# --- a put: the block files and the manifest, straight from the source arrays ---------------

# One file's buffered writes take turns (ext4 holds the inode's lock across the copy into
# the page cache), but block files are inodes of their own: their copies run at once, one
# core each. A 1 GiB put of 32 blocks on the 2-core Linux VM (loaded by other work): best
# 546 ms on one thread, 476 on two, 364 on four; four, as the restore has readers.
WRITERS: Final = min(4, os.cpu_count() or 1)


@functools.cache
def _writers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="kvd-put")


class BlockWriter:
    """The files of a planned manifest, from the entry's tensors (each one's byte views, or
    a CutCopy of a cut tensor, in the plan's tensor order: sources()): each block's rows of
    every cut tensor, then its head; the manifest's tails of the cut tensors and the other
    tensors whole, then its head."""

    def __init__(self, plan: ManifestPlan, views: Sequence[Source]) -> None:
        header = plan.entry.header
        self.plan = plan
        self._views = views
        self._tokens, self._block = header.token_count, header.block_tokens
        slots = header.slots  # a tuple made on each access
        self._cuts = {
            i: Cut.of(slots[i].dtype, with_rows(slots[i].shape, self._tokens))
            for i in plan.blocked_tensors
        }
        for i, view in enumerate(views):
            if isinstance(view, CutCopy):
                self._check_copy(i, view)

    def _check_copy(self, index: int, copy: CutCopy) -> None:
        cut = self._cuts.get(index)
        if cut is None:
            raise TensorLayoutError(f"tensor {index} is not cut into blocks, but copied so")
        tail = self._tokens - len(self.plan.hashes) * self._block
        block_bytes = cut.outer * self._block * cut.row
        if len(copy.blocks) != len(self.plan.hashes) or copy.outer != cut.outer:
            raise TensorLayoutError(
                f"tensor {index}: copied as {len(copy.blocks)} blocks of {copy.outer} runs, "
                f"planned as {len(self.plan.hashes)} of {cut.outer}"
            )
        sizes = [block.nbytes for block in copy.blocks if block is not None]
        if any(size != block_bytes for size in sizes) or copy.tail.nbytes != tail * (
            cut.outer * cut.row
        ):
            raise TensorLayoutError(f"tensor {index}: a block or its tail of the wrong size")

    def check_held(self, held_blocks: int) -> None:
        """Raise BlocksNotHeld unless the daemon's held leading blocks cover every block a
        CutCopy left out."""
        needed = max((view.needed for view in self._views if isinstance(view, CutCopy)), default=0)
        if held_blocks < needed:
            raise BlocksNotHeld(held_blocks, needed)

    def write_blocks(self, first: int, fds: Descriptors) -> None:
        """Blocks first, first + 1, ... into fds, each pre-sized to the plan's block size,
        several at once on the writer threads, each write lent the descriptors (they stay
        open until it ends, whatever the holder does meanwhile); every write has ended when
        this returns or raises."""
        jobs = [
            fds.lent(partial(self._write_block, index, fd))
            for index, fd in enumerate(fds.fds, first)
        ]
        run_all(_writers(), jobs)

    def _write_block(self, index: int, fd: int) -> None:
        plan = self.plan
        _check_size(fd, plan.block_size)
        checksums = write_slots(
            fd,
            [
                (slot, self._rows(i, index))
                for slot, i in zip(plan.block_slots, plan.blocked_tensors, strict=True)
            ],
        )
        write_all(fd, memoryview(plan.block_head(index, checksums)), 0)  # heads: no checksum

    def _rows(self, tensor: int, block: int | None) -> Pieces:
        """Cut tensor's rows of block (None: its tail), straight from its source."""
        view = self._views[tensor]
        if isinstance(view, CutCopy):
            rows = view.tail if block is None else view.blocks[block]
            if rows is None:  # check_held let the put go on: never
                raise BlocksNotHeld(block or 0, view.needed)
            return [rows] if rows.nbytes else []
        start = len(self.plan.hashes) if block is None else block
        stop = self._tokens if block is None else (block + 1) * self._block
        return self._cuts[tensor].runs(view, start * self._block, stop)

    def write_manifest(self, fd: int) -> None:
        """The manifest into fd, pre-sized to its planned size."""
        entry = self.plan.entry
        _check_size(fd, entry.file_size)
        checksums = write_slots(
            fd,
            [
                (slot, self._rows(i, None) if i in self._cuts else cast(Pieces, view))
                for i, (slot, view) in enumerate(zip(entry.slots, self._views, strict=True))
            ],
        )
        write_all(fd, memoryview(entry.head(checksums)), 0)


# --- a restore: the block files into the grown buffers ---------------------------------------


class BlockReads:
    """The cut tensors of one restore of a manifest that lists blocks: each one's destination
    bytes, taken when the restore allocates its buffer (fill), then filled from the blocks
    once every buffer exists, a block at a time in one pass over its file (read_block, on
    any thread, blocks in any order).

    The first block's head is parsed and checked in full; the others are compared with it
    (BlockHeads), and parsed in full only when that finds a difference."""

    def __init__(self, header: EntryHeader, *, verify: bool, limits: Limits) -> None:
        self.header = header
        self._verify, self._limits = verify, limits
        self._tokens, self._block = header.token_count, header.block_tokens
        slots = header.slots
        cut = [layer.blocked for layer in header.layers for _ in layer.slots]
        self._order = [i for i, blocked in enumerate(cut) if blocked]  # as a block lists them
        self._cuts = {
            i: Cut.of(slots[i].dtype, with_rows(slots[i].shape, self._tokens)) for i in self._order
        }
        self._targets: dict[int, Sequence[memoryview]] = {}
        # Per cut tensor whose destination is one view per outer run (a grown buffer's), those
        # views: a block's rows of it are then a slice of each.
        self._outer_runs: dict[int, list[memoryview]] = {}
        self._heads: BlockHeads | None = None  # set by the first head parsed in full
        # Once: a writer whose heads differ is parsed in full. Never for a single block: no
        # other head to compare with it.
        self._heads_tried = len(header.block_hashes) < 2

    def shape(self, index: int) -> tuple[int, ...]:
        """The whole shape of tensor index (its slot's, for a tensor not cut)."""
        shape = self.header.slots[index].shape
        return with_rows(shape, self._tokens) if index in self._cuts else shape

    def fill(self, index: int, tail: Fill) -> Fill:
        """Tensor index's Fill: for a cut tensor, its destination is kept for read_block and
        tail (the manifest slot's Fill) gets the tail rows; any other tensor is tail's alone."""
        cut = self._cuts.get(index)
        if cut is None:
            return tail
        rows = (len(self.header.block_hashes) * self._block, self._tokens)

        def take(pieces: Sequence[memoryview]) -> None:
            self._targets[index] = pieces
            outer = cut.runs(pieces, 0, cut.length)
            if len(outer) == cut.outer:
                self._outer_runs[index] = outer
            tail(cut.runs(pieces, *rows))

        return take

    def read_block(self, index: int, fd: int) -> None:
        """Block index from fd (left open), once every cut tensor's fill has run: its head
        read and checked against the manifest, then every cut tensor's rows in one pass over
        the file (preadv of CHUNK_BYTES at a time); raises EntryFormatError or OSError."""
        slots, checksums = self._head(index, fd)
        first, end = index * self._block, (index + 1) * self._block
        runs = [self._rows(i, first, end) for i in self._order]
        name = block_name(self.header.block_hashes[index])
        read_slots(fd, slots, runs, checksums if self._verify else None, name)

    def _rows(self, index: int, first: int, end: int) -> list[memoryview]:
        """Rows [first, end) of cut tensor index, as views into its destination."""
        outer = self._outer_runs.get(index)
        if outer is None:
            return self._cuts[index].runs(self._targets[index], first, end)
        row = self._cuts[index].row
        return [run[first * row : end * row] for run in outer]

    def _head(self, index: int, fd: int) -> tuple[Sequence[Slot], Sequence[bytes]]:
        """Block index's slots and their checksums, once its head passed the checks."""
        size = os.fstat(fd).st_size
        heads = self._heads
        data = os.pread(fd, PREFIX_BYTES if heads is None else heads.length, 0)
        if heads is not None:
            checksums = heads.check(index, data, size)
            if checksums is not None:
                return heads.slots, checksums
        name = block_name(self.header.block_hashes[index])
        prefix = parse_prefix(name, data, self._limits)
        end = PREFIX_BYTES + prefix.header_length
        if len(data) < end:
            data += os.pread(fd, end - len(data), len(data))
        block = parse_block_header(name, prefix, data[PREFIX_BYTES:], size, self._limits)
        check_block(self.header, index, block, name)
        slots = block.slots
        if not self._heads_tried:  # threads that get here at once each try: any will do
            self._heads_tried = True
            self._heads = BlockHeads.of(self.header, block, data)
        return slots, [slot.checksum for slot in slots]
