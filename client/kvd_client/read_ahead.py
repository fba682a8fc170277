"""Asking the kernel to read a file from disk before the reads reach it: a restore reads
every byte of an entry's files, so each can be asked for whole, in one sequential stream,
as soon as its descriptor is had (and many files at once keep the disk's queue full).

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


def will_read(*fds: int) -> None:
    """Start reading all of each fd's file from disk now. On a cold file this waits while the
    reads are queued (Linux: ~190 ms for 64 block files of 2 MiB, 128 MiB in all), so a
    restore asks for many files on a reader thread."""
    for fd in fds:
        with contextlib.suppress(OSError):
            if sys.platform == "darwin":
                size = os.fstat(fd).st_size
                for offset in range(0, size, _MAX_COUNT):
                    count = min(_MAX_COUNT, size - offset)
                    fcntl.fcntl(fd, _F_RDADVISE, _RADVISORY.pack(offset, count))
            elif hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
