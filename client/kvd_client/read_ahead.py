"""Asking the kernel to read a file from disk before the reads reach it: a restore of an
entry stored whole reads every byte of it, so the file is asked for whole, in one
sequential stream, rather than as the readers' interleaved preads reach each part.

Linux: posix_fadvise(WILLNEED). macOS has no posix_fadvise; fcntl(F_RDADVISE) asks the same
of a byte range. Elsewhere the reads read as they go. A hint: a file system that refuses
it changes nothing, and its error is dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import sys
from typing import Final

# macOS F_RDADVISE and its struct radvisory (xnu bsd/sys/fcntl.h): off_t ra_offset, int
# ra_count (then padding to 16 bytes); Python does not name them.
_F_RDADVISE: Final = 44
_RADVISORY: Final = struct.Struct("=qi4x")
_MAX_COUNT: Final = 1 << 30  # ra_count is an int: a larger file is asked for in steps


def will_read(fd: int) -> None:
    """Start reading all of fd's file from disk now (ask, its refusal dropped). On a cold file
    this waits while the reads are queued (Linux).

    Block files are not asked for: with the hint on a reader thread, a cold 512 MiB restore
    of 16 blocks took 1,137 ms against 919 ms without (the hint reads the files one after
    the other, where four readers without it keep four streams going)."""
    with contextlib.suppress(OSError):
        ask(fd)


def ask(fd: int) -> None:
    """The hint itself; OSError if fd's file refuses it."""
    if sys.platform == "darwin":
        size = os.fstat(fd).st_size
        for offset in range(0, size, _MAX_COUNT):
            count = min(_MAX_COUNT, size - offset)
            fcntl.fcntl(fd, _F_RDADVISE, _RADVISORY.pack(offset, count))
    elif hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
