"""Entry files on the engine's side: writing a planned entry into the daemon's staging
descriptor, and reading a looked-up one: its head and tensors by pread, checksummed as they
are copied, or mapped read-only with one aligned view per tensor.

All of it works on descriptors the daemon passed over the socket; nothing names a path.
Reading a mapping past the end of a file that shrank kills the process (SIGBUS), and any
file can be truncated behind the daemon's back: the engine reads by pread, which fails
cleanly instead, and maps only on request, after fstat says the file is still whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

from kvd_protocol.checksum import new_checksum
from kvd_protocol.dtypes import tensor_nbytes
from kvd_protocol.entry import ALIGNMENT, PREFIX_BYTES, EntryHeader, EntryPlan, Slot
from kvd_protocol.entry_reader import parse_header, parse_prefix
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import DEFAULT_LIMITS, Limits

from .read_ahead import will_read

if TYPE_CHECKING:
    import xxhash

# Each tensor is copied and checksummed a piece at a time (written, or read), so the checksum
# reads bytes the copy has just brought into the cache instead of reading them twice. Read
# and checksummed, 512 MiB cost the least CPU in pieces of 0.5-2 MiB on the Linux VM (112 ms
# against 128 ms in the 256 KiB pieces that stay in its L2, and 133 ms in 8 MiB ones).
CHUNK_BYTES: Final = 1 << 20
IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

# The kernel copies out of the page cache about three times faster on the machines measured
# (x86-64 Linux) when a destination's offset within a cache line is not past its source's.
# Slots start on 16 KiB boundaries, but MLX's CPU build puts a buffer's bytes 8 past malloc's
# 16-byte boundary: a destination is read as its bytes up to its first cache line boundary,
# then the rest, which starts on one (Metal's buffers start on a page: nothing to split).
LINE: Final = 64
_AT: Final = ctypes.c_char * 0  # from_buffer of it: the address of a writable view

# Anything exposing the buffer protocol: numpy and MLX arrays, bytes, memoryviews; or a list
# of such buffers, the tensor's bytes in C order in pieces (a tensor that is not contiguous
# in memory, as a cache's live rows: codecs.tensor_pieces). Checked at run time
# (tensor_views); Python 3.11's type stubs of the array libraries do not declare it.
TensorData: TypeAlias = Any

# Byte views of one tensor, in order: together its bytes in C order.
Pieces: TypeAlias = Sequence[memoryview]


class TensorLayoutError(ValueError):
    """A tensor handed to a put does not match its planned slot (size, contiguity, count)."""


class Expected(Protocol):
    """What a tensor handed to a put must be: a slot, or a layer spec's tensor."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def tensor_views(plan: EntryPlan, tensors: Sequence[TensorData]) -> list[Pieces]:
    """The byte views of each tensor, checked against its slot; raises TensorLayoutError."""
    return views_of(plan.slots, tensors)


def views_of(expected: Sequence[Expected], tensors: Sequence[TensorData]) -> list[Pieces]:
    """The flat byte views of each tensor (one, or its pieces), checked against what is
    expected of it (size, contiguity, count); raises TensorLayoutError."""
    if len(tensors) != len(expected):
        raise TensorLayoutError(f"{len(tensors)} tensors for {len(expected)} planned slots")
    views: list[Pieces] = []
    for i, (tensor, slot) in enumerate(zip(tensors, expected, strict=True)):
        parts = tensor if isinstance(tensor, list | tuple) else [tensor]
        pieces = [
            _flat(f"tensor {i}" if part is tensor else f"tensor {i}, piece {j}", part)
            for j, part in enumerate(parts)
        ]
        found = sum(piece.nbytes for piece in pieces)
        nbytes = tensor_nbytes(slot.dtype, slot.shape)
        if found != nbytes:
            raise TensorLayoutError(
                f"tensor {i}: {found} bytes, its slot ({slot.dtype} {list(slot.shape)}) "
                f"holds {nbytes}"
            )
        views.append([piece for piece in pieces if piece.nbytes])
    return views


def _flat(what: str, buffer: TensorData) -> memoryview:
    """A flat byte view of a C-contiguous buffer; raises TensorLayoutError."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TensorLayoutError(
            f"{what}: {type(buffer).__name__} does not expose the buffer protocol"
        ) from None
    if not view.c_contiguous:
        raise TensorLayoutError(f"{what}: not C-contiguous; make a contiguous copy first")
    if view.nbytes == 0:
        return memoryview(b"")  # cast() refuses shapes with a zero in them
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def write_entry(fd: int, plan: EntryPlan, views: Sequence[Pieces]) -> None:
    """Write the entry into fd (read-write, sized to plan.file_size): each tensor's pieces
    back to back in its slot, checksummed while copied, then the head at offset 0.

    With pwrite, not through a mapping: the kernel copies into the page cache at about twice
    the speed of faulting in a fresh mapping page by page (256 MiB: 1.7x memcpy against 3.1x),
    releases the GIL while it does, and a full disk is an OSError rather than a SIGBUS. The
    descriptor stays open; the caller closes it."""
    size = os.fstat(fd).st_size
    if size != plan.file_size:
        raise ValueError(f"staging file is {size} bytes, the entry needs {plan.file_size}")
    checksums = write_slots(fd, list(zip(plan.slots, views, strict=True)))
    write_all(fd, memoryview(plan.head(checksums)), 0)


Hasher: TypeAlias = "xxhash.xxh3_64 | None"
Piece: TypeAlias = tuple[memoryview, Hasher]  # a view and the checksum its bytes go to


def calls_of(pieces: Iterable[Piece], limit: int) -> Iterator[list[Piece]]:
    """pieces in iovecs of at most limit bytes (a longer view is split) and IOV_MAX entries."""
    group: list[Piece] = []
    size = 0
    for view, hasher in pieces:
        for pos in range(0, view.nbytes, limit):
            piece = view[pos : pos + limit]
            if group and (size + piece.nbytes > limit or len(group) == IOV_MAX):
                yield group
                group, size = [], 0
            group.append((piece, hasher))
            size += piece.nbytes
    if group:
        yield group


def line_split(pieces: Iterable[memoryview]) -> list[memoryview]:
    """pieces (writable), each as its bytes up to its first cache line boundary (if it
    does not start on one) and the rest: see LINE."""
    out: list[memoryview] = []
    for piece in pieces:
        head = -ctypes.addressof(_AT.from_buffer(piece)) % LINE if piece.nbytes else 0
        if 0 < head < piece.nbytes:
            out.extend((piece[:head], piece[head:]))
        else:
            out.append(piece)
    return out


def advanced(group: list[memoryview], done: int) -> list[memoryview]:
    """What is left of group after its first done bytes."""
    while done and done >= group[0].nbytes:
        done -= group[0].nbytes
        group = group[1:]
    return [group[0][done:], *group[1:]] if done else group


# What goes between two slots (their alignment padding): zeros, as the file reads there.
_ZEROS: Final = memoryview(bytes(ALIGNMENT))


def write_slots(fd: int, slots: Sequence[tuple[Slot, Pieces]]) -> list[bytes]:
    """Each slot's pieces at its start (slots in file order), and zeros between slots, in as
    few pwritev calls as CHUNK_BYTES allows (a small tensor's slot needs no call of its
    own); each slot's checksum, computed as its pieces are written."""
    hashers = [new_checksum() for _ in slots]
    laid = ((slot, runs, hasher) for (slot, runs), hasher in zip(slots, hashers, strict=True))
    start, pieces = slot_pieces(laid, _ZEROS)
    if pieces:
        _write(fd, start, pieces)
    return [hasher.digest() for hasher in hashers]


def slot_pieces(
    slots: Iterable[tuple[Slot, Pieces, Hasher]], gap: memoryview
) -> tuple[int, list[Piece]]:
    """Where the bytes of slots (in file order) start, and their pieces from there to the
    last slot's end: each slot's runs tagged with its hasher, and views of gap (ALIGNMENT
    bytes) between slots. An empty slot has no bytes, wherever it starts."""
    pieces: list[Piece] = []
    start = at = -1
    for slot, runs, hasher in slots:
        if not slot.nbytes:
            continue
        if at < 0:
            start = at = slot.start
        if slot.start < at:
            raise ValueError(f"slot at {slot.start} overlaps the one before it, ending at {at}")
        pieces.extend(
            (gap[: min(ALIGNMENT, slot.start - p)], None) for p in range(at, slot.start, ALIGNMENT)
        )
        pieces.extend((run, hasher) for run in runs)
        at = slot.end
    return start, pieces


def _write(fd: int, offset: int, pieces: Sequence[Piece]) -> None:
    for group in calls_of(pieces, CHUNK_BYTES):
        pending = [piece for piece, _ in group]
        while pending:
            written = os.pwritev(fd, pending, offset)
            if not written:
                raise OSError(f"no progress writing at offset {offset}")
            pending, offset = advanced(pending, written), offset + written
        for piece, hasher in group:
            if hasher is not None:
                hasher.update(piece)  # while the piece is still in the CPU's cache


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """All of data at offset of fd (pwrite until done); no checksum."""
    while data:
        written = os.pwrite(fd, data, offset)
        if not written:
            raise OSError(f"no progress writing the staging file at offset {offset}")
        data, offset = data[written:], offset + written


@dataclass(eq=False)
class _Mapping:
    """A read-only mapping of a whole entry file and a view of each tensor's bytes, each on
    a 16 KiB boundary of the page-aligned mapping."""

    tensors: tuple[memoryview, ...]
    _base: memoryview
    _mapping: mmap.mmap

    def close(self) -> None:
        """Release the views and unmap. Arrays the caller built on a view still hold the
        mapping: it is then unmapped when the last of them goes."""
        # BufferError: a view (or the mapping) is exported to the caller's arrays, see above.
        for view in (*self.tensors, self._base):
            with contextlib.suppress(BufferError):
                view.release()
        with contextlib.suppress(BufferError):
            self._mapping.close()


# Map every page up front, in one call: a reader of the views reads all of them, and taking
# a fault per 4 KiB page costs more than the copy itself (Linux; elsewhere pages fault in).
_PREFAULT = getattr(mmap, "MAP_POPULATE", 0)


def _map(fd: int, size: int, header: EntryHeader) -> _Mapping:
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _PREFAULT, prot=mmap.PROT_READ)
    base = memoryview(mapping)
    return _Mapping(tuple(base[slot.start : slot.end] for slot in header.slots), base, mapping)


class EntryFile:
    """A looked-up entry file: its descriptor (owned: close() closes it) and its head, read
    by pread and validated against the file's size (fstat on the descriptor)."""

    def __init__(self, fd: int, name: str, header: EntryHeader, size: int) -> None:
        self.name = name
        self.header = header
        self.size = size
        self._fd = fd
        self._mapped: _Mapping | None = None

    @classmethod
    def open(cls, fd: int, name: str, limits: Limits = DEFAULT_LIMITS) -> EntryFile:
        """Take over fd (also when this raises: it is then closed) and validate the head;
        raises EntryFormatError for a damaged file, OSError for one that cannot be read."""
        try:
            size = os.fstat(fd).st_size
            prefix = parse_prefix(name, _pread(fd, PREFIX_BYTES, 0), limits)
            header_bytes = _pread(fd, prefix.header_length, PREFIX_BYTES)
            header = parse_header(name, prefix, header_bytes, size, limits)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, name, header, size)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def read_slot(self, index: int, pieces: Sequence[memoryview], *, verify: bool = True) -> None:
        """Fill pieces (writable byte views, together exactly the slot's size), in order, with
        slot index's bytes, checked against its checksum unless not verify; raises
        EntryFormatError (a short file, a checksum that differs) or OSError."""
        slot = self.header.slots[index]
        if sum(piece.nbytes for piece in pieces) != slot.nbytes:
            raise ValueError(f"pieces for {slot.nbytes} bytes expected")
        hasher = new_checksum() if verify else None
        offset = slot.start
        for piece in line_split(pieces):
            for pos in range(0, piece.nbytes, CHUNK_BYTES):
                chunk = piece[pos : pos + CHUNK_BYTES]
                self._read_exactly(chunk, offset, slot)
                if hasher is not None:
                    hasher.update(chunk)  # while the chunk is still in the CPU's cache
                offset += chunk.nbytes
        if hasher is not None and hasher.digest() != slot.checksum:
            raise EntryFormatError(
                self.name,
                Rule.DATA_CHECKSUM,
                f"slot at {slot.start}: bytes do not match its checksum",
            )

    def fills(self, *, verify: bool = True) -> list[Callable[[Sequence[memoryview]], None]]:
        """Per slot, read_slot of it (the restore's Fill); the whole file is about to be read."""
        will_read(self._fd)
        return [partial(self.read_slot, i, verify=verify) for i in range(len(self.header.slots))]

    def verify(self) -> None:
        """Check every tensor's bytes against its slot checksum; raises EntryFormatError."""
        # Page-aligned (a bytearray is not): see LINE for what alignment is worth.
        scratch = memoryview(mmap.mmap(-1, CHUNK_BYTES))
        for index, slot in enumerate(self.header.slots):
            pieces = [scratch] * (slot.nbytes // CHUNK_BYTES)
            if slot.nbytes % CHUNK_BYTES:
                pieces.append(scratch[: slot.nbytes % CHUNK_BYTES])
            self.read_slot(index, pieces)

    @property
    def tensors(self) -> tuple[memoryview, ...]:
        """A read-only view of each tensor, from a mapping made on first use, once fstat says
        the file still has its size. Mapped views fault (SIGBUS) if the file shrinks later:
        read_slot never does."""
        if self._mapped is None:
            if self.closed:
                raise ValueError(f"entry {self.name} is closed")
            size = os.fstat(self._fd).st_size
            if size != self.size:
                rule = Rule.TRUNCATED if size < self.size else Rule.FILE_SIZE
                raise EntryFormatError(
                    self.name, rule, f"{size} bytes now, {self.size} when looked up"
                )
            self._mapped = _map(self._fd, size, self.header)
        return self._mapped.tensors

    def close(self) -> None:
        """Close the descriptor, and the mapping if any: arrays built on its views keep it
        until the last of them goes."""
        if self._mapped is not None:
            self._mapped.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read_exactly(self, target: memoryview, offset: int, slot: Slot) -> None:
        while target:
            got = os.preadv(self._fd, [target], offset)
            if not got:
                raise EntryFormatError(
                    self.name,
                    Rule.TRUNCATED,
                    f"slot at {slot.start}: the file ends at {offset}, the slot at {slot.end}",
                )
            target, offset = target[got:], offset + got


def _pread(fd: int, length: int, offset: int) -> bytes:
    """Up to length bytes at offset: fewer only where the file ends (the parser says so)."""
    parts = []
    while length:
        part = os.pread(fd, length, offset)
        if not part:
            break
        parts.append(part)
        length, offset = length - len(part), offset + len(part)
    return b"".join(parts)
