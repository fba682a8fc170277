"""Making file data and renames durable, reserving space, and measuring free space.

On macOS fsync() hands data to the drive, which may keep it in its cache and write it later
and out of order; only fcntl(F_FULLFSYNC) asks the drive to flush. Linux's fsync already
does. A durable write is: data synced, rename, directory synced (replace_durably).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
from pathlib import Path

# macOS F_PREALLOCATE and its fstore_t (xnu bsd/sys/fcntl.h); Python does not name them.
_F_PREALLOCATE = 42
_F_ALLOCATEALL = 4  # all of the space or none of it
_F_PEOFPOSMODE = 3  # offset counted from the physical end of the file
_FSTORE = struct.Struct("=Iiqqq")  # flags, posmode, offset, length, bytes allocated (out)

# Errors that mean "this file system cannot do that", as opposed to "no space".
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOTTY})


def sync_file(fd: int) -> None:
    """Flush a file's data and metadata to stable storage (F_FULLFSYNC on macOS)."""
    if not full_fsync(fd):
        os.fsync(fd)


def full_fsync(fd: int) -> bool:
    """macOS: ask the drive itself to flush fd's file (F_FULLFSYNC); False where the file
    system refuses it, and off macOS (where fsync already does it)."""
    if sys.platform != "darwin":
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    except OSError:
        # As SQLite does: file systems without F_FULLFSYNC (network, FAT, some external
        # drives) refuse it; fsync is then the best there is, and reports real errors.
        return False
    return True


def sync_directory(path: Path | str) -> None:
    """Make the directory's entries (a create, rename or unlink in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sync_file(fd)
    except OSError as error:
        # Some file systems cannot sync a directory at all (EINVAL); PostgreSQL ignores that
        # too. Anything else (EIO above all) is a real failure.
        if error.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def replace_durably(src: Path | str, dst: Path | str) -> None:
    """Rename `src` over `dst` so that, after a crash, `dst` is either the old file or all of
    the new one. Syncs the source's data first, so the caller need not."""
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sync_file(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    src_dir = Path(src).resolve().parent
    dst_dir = Path(dst).resolve().parent
    sync_directory(dst_dir)
    if src_dir != dst_dir:
        sync_directory(src_dir)  # the rename also removed a name from here


def preallocate(fd: int, size: int) -> bool:
    """Grow the file to `size` bytes with the space reserved, so that ENOSPC comes now rather
    than in the middle of writing through a mapping (where it would be SIGBUS). Never
    shrinks. File systems that cannot reserve space just get the size: False then."""
    current = os.fstat(fd).st_size
    if size <= current:
        return True
    reserved = True
    if sys.platform == "darwin":
        request = _FSTORE.pack(_F_ALLOCATEALL, _F_PEOFPOSMODE, 0, size - current, 0)
        try:
            fcntl.fcntl(fd, _F_PREALLOCATE, request)
        except OSError as error:
            if error.errno not in _UNSUPPORTED:
                raise
            reserved = False
        # F_PREALLOCATE reserves blocks but leaves the size as it was.
        os.ftruncate(fd, size)
    else:
        try:
            os.posix_fallocate(fd, current, size - current)
        except OSError as error:
            if error.errno not in _UNSUPPORTED:
                raise
            os.ftruncate(fd, size)
            reserved = False
    return reserved


def disk_free(path: Path | str) -> int:
    """Bytes an unprivileged process can still write on the file system holding `path`."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize
