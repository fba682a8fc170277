"""Zeros in the room a restore leaves for a cache's next tokens, without touching memory the
kernel has not handed out yet: the one platform-specific part of a restore's memory.

A restored KV tensor lives in a buffer longer than its tokens (restore.with_room_all), and
mlx-lm's own buffers beyond their tokens are zeros (it grows them with mx.zeros; a batch's
padding can be rolled over that part), so the room must read as zeros too. MLX hands out
a buffer from its cache of freed ones or from the allocator: memory used before, whose
room holds old bytes, or fresh pages, which the kernel fills with zeros on first touch.
Writing zeros over fresh pages would fault every one of them in (a 4 KiB page fault costs
several times the copy of its bytes) for tokens that may never come.

Linux, buffers of MLX's CPU build (malloc's: private anonymous memory): mincore(2) says
which of the room's pages are in memory. Those are written with zeros; the others are
dropped with madvise(MADV_DONTNEED), after which private anonymous memory reads as zeros (a
page that was swapped out loses its old bytes) and costs nothing until its first write,
when mlx-lm appends a token there. The bytes of a page the room shares with the tokens are
written either way. Buffers of a GPU build (CUDA's managed memory) are written.

Elsewhere the room is written with zeros. On macOS, MLX's buffers are Metal shared memory:
a page out of memory may sit in the memory compressor with its old bytes, and
MADV_DONTNEED does not promise zeros, so every page of the room is written (fresh ones
fault in, 16 KiB at a time).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Final

PAGE: Final = mmap.PAGESIZE
_MADV_DONTNEED: Final = 4  # Linux's value (asm-generic/mman-common.h), which Python lacks
LINUX: Final = sys.platform.startswith("linux")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

Span = tuple[int, int]  # (address, bytes) of memory the caller owns


def zero_rooms(buffer: Span, rooms: Sequence[Span], *, private: bool) -> None:
    """Make every byte of rooms (spans inside buffer) read as zero. buffer is the caller's
    alone, and its bytes outside the rooms are yet to be written: they may be dropped too.
    private: buffer is private anonymous memory (malloc's), whose pages not in memory are
    then left untouched (Linux); else every byte of the rooms is written."""
    rooms = [room for room in rooms if room[1] > 0]
    if not (private and LINUX):
        for address, nbytes in rooms:
            _write_zeros(address, nbytes)
        return
    first, last = _pages_within(*buffer)
    resident = _resident(first, last - first) if last > first else b""
    if resident.count(0) == len(resident):  # fresh memory: one call drops it all
        if resident:
            _drop(first, last - first)
        for address, nbytes in rooms:  # and what lies outside the whole pages is written
            _write_outside(address, nbytes, first, last)
        return
    for address, nbytes in rooms:
        _zero_by_residency(address, nbytes, first, resident)


def _pages_within(address: int, nbytes: int) -> Span:
    """The first and the end of the whole pages within a span."""
    first = -(-address // PAGE) * PAGE
    last = (address + nbytes) // PAGE * PAGE
    return first, max(first, last)


def _write_outside(address: int, nbytes: int, first: int, last: int) -> None:
    """Zeros over the bytes of a span outside the pages [first, last)."""
    end = address + nbytes
    if end <= first or address >= last:
        _write_zeros(address, nbytes)
        return
    if address < first:
        _write_zeros(address, first - address)
    if end > last:
        _write_zeros(last, end - last)


def _zero_by_residency(address: int, nbytes: int, base: int, resident: bytes) -> None:
    """A room's whole pages written if in memory, dropped if not (resident: mincore's
    answer for the pages from base); its edges written."""
    first, last = _pages_within(address, nbytes)
    _write_outside(address, nbytes, first, last)
    pages = resident[(first - base) // PAGE : (last - base) // PAGE]
    start = 0
    while start < len(pages):  # runs of pages alike
        kind = pages[start]
        end = start + 1
        while end < len(pages) and pages[end] == kind:
            end += 1
        where, size = first + start * PAGE, (end - start) * PAGE
        if kind:
            _write_zeros(where, size)
        else:
            _drop(where, size)
        start = end


def _write_zeros(address: int, nbytes: int) -> None:
    if nbytes > 0:
        ctypes.memset(address, 0, nbytes)


def _resident(address: int, nbytes: int) -> bytes:
    """Per page of a page-aligned span, 1 if it is in memory, else 0 (mincore)."""
    pages = nbytes // PAGE
    found = ctypes.create_string_buffer(pages)
    if _libc.mincore(address, nbytes, found) != 0:
        raise _os_error("mincore")
    return bytes(byte & 1 for byte in found.raw) if found.raw.strip(b"\0\1") else found.raw


def _drop(address: int, nbytes: int) -> None:
    if _libc.madvise(address, nbytes, _MADV_DONTNEED) != 0:
        raise _os_error("madvise(MADV_DONTNEED)")


def _os_error(call: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{call}: {os.strerror(errno)}")


def probe() -> str:
    """What zero_rooms does here, tried on a mapping of its own: a span over a page in
    memory with old bytes and pages never touched comes back zeros, the bytes around it
    unchanged and (Linux) the untouched pages still out of memory; raises ValueError if
    not, OSError if a call is refused."""
    size = 4 * PAGE
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as malloc's memory
    with mmap.mmap(-1, size, flags=private) as mapping:
        view = (ctypes.c_char * size).from_buffer(mapping)
        base = ctypes.addressof(view)
        try:
            ctypes.memset(base, 0xA5, 2 * PAGE)  # two pages in memory, the others fresh
            zero_rooms((base, size), [(base + 100, size - 200)], private=True)
            # Asked before the bytes are read: a read maps a page (the zero page) in.
            touched = LINUX and any(_resident(base + 2 * PAGE, PAGE))  # the last one was written
            data = bytes(view)
            if data[100 : size - 100] != bytes(size - 200):
                raise ValueError("the span does not read as zeros")
            if data[:100] != b"\xa5" * 100:
                raise ValueError("bytes before the span changed")
            if touched:
                raise ValueError("a page never touched was brought into memory")
            if not LINUX:
                return "memset: every page of a room is written (fresh ones fault in)"
            return "mincore, MADV_DONTNEED: pages in memory zeroed, fresh ones left untouched"
        finally:
            del view  # the mapping closes only once nothing exports it
