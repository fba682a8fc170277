"""Entry files on the engine's side: writing a planned entry into the daemon's staging
descriptor, and mapping a looked-up entry read-only with one aligned view per tensor.

Both work on descriptors the daemon passed over the socket; neither names a path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from kvd_protocol.checksum import new_checksum
from kvd_protocol.entry import EntryHeader, EntryPlan
from kvd_protocol.entry_reader import parse_head, verify_slot
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import DEFAULT_LIMITS, Limits

# Each tensor is copied and checksummed a piece at a time, so the checksum reads bytes the
# copy has just brought into the cache instead of reading the tensor from memory twice.
CHUNK_BYTES: Final = 1 << 20

# Anything exposing the buffer protocol: numpy and MLX arrays, bytes, memoryviews. Checked at
# run time (tensor_views); Python 3.11's type stubs of the array libraries do not declare it.
TensorData: TypeAlias = Any


class TensorLayoutError(ValueError):
    """A tensor handed to a put does not match its planned slot (size, contiguity, count)."""


def tensor_views(plan: EntryPlan, tensors: Sequence[TensorData]) -> list[memoryview]:
    """A flat byte view of each tensor, checked against its slot; raises TensorLayoutError."""
    slots = plan.slots
    if len(tensors) != len(slots):
        raise TensorLayoutError(f"{len(tensors)} tensors for {len(slots)} planned slots")
    views: list[memoryview] = []
    for i, (tensor, slot) in enumerate(zip(tensors, slots, strict=True)):
        try:
            view = memoryview(tensor)
        except TypeError:
            raise TensorLayoutError(
                f"tensor {i}: {type(tensor).__name__} does not expose the buffer protocol"
            ) from None
        if not view.c_contiguous:
            raise TensorLayoutError(f"tensor {i}: not C-contiguous; make a contiguous copy first")
        if view.nbytes != slot.nbytes:
            raise TensorLayoutError(
                f"tensor {i}: {view.nbytes} bytes, its slot ({slot.dtype} {list(slot.shape)}) "
                f"holds {slot.nbytes}"
            )
        if view.nbytes == 0:
            view = memoryview(b"")  # cast() refuses shapes with a zero in them
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


def write_entry(fd: int, plan: EntryPlan, views: Sequence[memoryview]) -> None:
    """Write the entry into fd (read-write, sized to plan.file_size): each tensor to its slot,
    checksummed while copied, then the head at offset 0.

    With pwrite, not through a mapping: the kernel copies into the page cache at about twice
    the speed of faulting in a fresh mapping page by page (256 MiB: 1.7x memcpy against 3.1x),
    releases the GIL while it does, and a full disk is an OSError rather than a SIGBUS. The
    descriptor stays open; the caller closes it."""
    size = os.fstat(fd).st_size
    if size != plan.file_size:
        raise ValueError(f"staging file is {size} bytes, the entry needs {plan.file_size}")
    checksums = [
        _write_checksummed(fd, slot.start, view)
        for slot, view in zip(plan.slots, views, strict=True)
    ]
    _write_all(fd, memoryview(plan.head(checksums)), 0)


def _write_checksummed(fd: int, start: int, view: memoryview) -> bytes:
    hasher = new_checksum()
    for pos in range(0, view.nbytes, CHUNK_BYTES):
        piece = view[pos : pos + CHUNK_BYTES]
        _write_all(fd, piece, start + pos)
        hasher.update(piece)  # while the chunk is still in the CPU's cache
    return hasher.digest()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        if not written:
            raise OSError(f"no progress writing the staging file at offset {offset}")
        data, offset = data[written:], offset + written


@dataclass(eq=False)
class MappedEntry:
    """An entry file mapped read-only, its header validated from the file itself.

    tensors holds, per slot in header order, a read-only view of exactly the slot's bytes;
    each starts on a 16 KiB boundary of a page-aligned mapping, so MLX can adopt or copy it.
    """

    name: str
    header: EntryHeader
    tensors: tuple[memoryview, ...]
    _base: memoryview
    _mapping: mmap.mmap

    @property
    def closed(self) -> bool:
        return self._mapping.closed

    def verify(self) -> None:
        """Check every tensor against its slot checksum; raises EntryFormatError."""
        for slot, view in zip(self.header.slots, self.tensors, strict=True):
            verify_slot(self.name, slot, view)

    def close(self) -> None:
        """Release the views and unmap. Arrays the caller built on a view still hold the
        mapping: it is then unmapped when the last of them goes."""
        # BufferError: a view (or the mapping) is exported to the caller's arrays, see above.
        for view in (*self.tensors, self._base):
            with contextlib.suppress(BufferError):
                view.release()
        with contextlib.suppress(BufferError):
            self._mapping.close()


# Map every page up front, in one call: the restore reads all of them, and taking a fault per
# 4 KiB page costs more than the copy itself (Linux; elsewhere the pages fault in as read).
_PREFAULT = getattr(mmap, "MAP_POPULATE", 0)


def map_entry(fd: int, name: str, limits: Limits = DEFAULT_LIMITS) -> MappedEntry:
    """Map fd (an entry file, opened read-only) and validate its head; raises
    EntryFormatError. The mapping holds its own reference to the file: fd may be closed."""
    size = os.fstat(fd).st_size
    if size == 0:
        raise EntryFormatError(name, Rule.TRUNCATED, "the file is empty")
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _PREFAULT, prot=mmap.PROT_READ)
    base = memoryview(mapping)
    try:
        header = parse_head(name, base, size, limits)
        views = tuple(base[slot.start : slot.end] for slot in header.slots)
    except BaseException:
        base.release()
        mapping.close()
        raise
    return MappedEntry(name, header, views, base, mapping)
