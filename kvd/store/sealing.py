"""Sealing a staging file at commit: from then on no client can change what the tier stores.

A staging file's descriptor was handed to a client, which may keep it (or a writable mapping
of it) past its commit. Linux: a read lease is refused while any open file description of
the inode has write access, anywhere (in another process, in flight in a socket, behind a
shared writable mapping). Granted, no writer is left, and since the file and its 0700 folder
are the daemon's, none can be made: the file is sealed as it is, with no copy. Refused (or
leases disabled, or not offered by the file system): the daemon copies the file (a reflink
where the file system has them, else copy_file_range) and goes on with the copy; the
client's file is truncated to nothing, so what it writes later touches nothing of the tier.
macOS has no leases: the file is cloned (clonefile: APFS copy-on-write, no byte copied), or
copied where the file system cannot clone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

COPY_CHUNK: Final = 8 << 20  # bytes per copy_file_range or pread/pwrite call
_FICLONE: Final = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_CLONE_NOFOLLOW: Final = 0x0001  # sys/clonefile.h
# Where a copy cannot take a faster way, the slower one is taken; anything else is an error.
_NO_FAST_WAY: Final = frozenset(
    {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTTY}
)


@dataclass(frozen=True)
class Sealed:
    """The file the daemon goes on with, and a descriptor of it that only the daemon holds
    (the caller's to close). copied: it is a copy at another path; the client's file,
    truncated, is the caller's to delete."""

    path: Path
    fd: int
    copied: bool


def seal(path: Path, size: int, copy_to: Path) -> Sealed:
    """Seal staging file path, of size bytes as declared (a byte copy takes no more than
    that; a clone is the file whole, and the checks that follow see its size): as it is when
    no writer of it is left, else as a copy made at copy_to. OSError when it can be neither
    opened nor copied."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if sealed_as_it_is(fd):
            return Sealed(path, fd, copied=False)
        copy = _copy(fd, path, size, copy_to)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    # Its pages and extents go now, though the client holds it open; should that fail, the
    # copy is sealed all the same, and the file goes to the deleter next.
    with contextlib.suppress(OSError):
        os.truncate(path, 0)
    return Sealed(copy_to, copy, copied=True)


def sealed_as_it_is(fd: int) -> bool:
    """Whether fd's file is sealed as it is, with no copy: on Linux, once no writer of it is
    left; never elsewhere (macOS has no leases: a file is sealed by a clone)."""
    return sys.platform == "linux" and no_writer_left(fd)


def no_writer_left(fd: int) -> bool:
    """Linux: whether no open file description of fd's file has write access (a read lease
    is granted, then let go at once). False where leases are off or not offered: unknown."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN: a writer is left; EINVAL, ENOLCK, EACCES: no leases here
        return False
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


def _copy(source: int, path: Path, size: int, copy_to: Path) -> int:
    """The daemon's own copy of source at copy_to; a descriptor of it."""
    if sys.platform == "darwin" and clone_file(path, copy_to):
        return os.open(copy_to, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    fd = os.open(copy_to, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if not (sys.platform == "linux" and reflink(source, fd)):
            copy_bytes(source, fd, size)
    except BaseException:
        os.close(fd)
        copy_to.unlink(missing_ok=True)
        raise
    return fd


def reflink(source: int, target: int) -> bool:
    """Linux: make target share source's extents (FICLONE: btrfs, XFS); False where the file
    system cannot."""
    try:
        fcntl.ioctl(target, _FICLONE, source)
    except OSError as exc:
        if exc.errno in _NO_FAST_WAY:
            return False
        raise
    return True


def copy_bytes(source: int, target: int, size: int) -> None:
    """Copy the first size bytes of source into target (fewer if source is shorter now):
    copy_file_range where there is one, else pread and pwrite."""
    copied = 0
    try:
        copied = copy_range(source, target, size)
    except OSError as exc:
        if exc.errno not in _NO_FAST_WAY:
            raise
    copy_plain(source, target, size, copied)


def copy_range(source: int, target: int, size: int) -> int:
    """copy_file_range up to size bytes from offset 0 (the kernel copies, or shares extents
    on file systems that can); how many it copied before the end of source. ENOSYS off
    Linux."""
    if sys.platform != "linux":
        raise OSError(errno.ENOSYS, "copy_file_range is Linux's")
    done = 0
    while done < size:
        n = os.copy_file_range(source, target, min(COPY_CHUNK, size - done), done, done)
        if not n:
            break
        done += n
    return done


def copy_plain(source: int, target: int, size: int, start: int = 0) -> int:
    """Copy bytes start..size by pread and pwrite; how far it got before the end of source."""
    done = start
    while done < size:
        data = os.pread(source, min(COPY_CHUNK, size - done), done)
        if not data:
            break
        view = memoryview(data)
        while view:
            written = os.pwrite(target, view, done)
            view = view[written:]
            done += written
    return done


def clone_file(source: Path, target: Path) -> bool:
    """macOS: clonefile(2), target a new file sharing source's blocks copy-on-write (APFS);
    False where the file system cannot clone."""
    if _clonefile()(os.fsencode(source), os.fsencode(target), _CLONE_NOFOLLOW) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_FAST_WAY:
        return False
    raise OSError(code, os.strerror(code), str(target))


@functools.cache
def _clonefile() -> Any:
    """libSystem's clonefile(2), bound once."""
    clonefile = ctypes.CDLL(None, use_errno=True).clonefile
    clonefile.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32)
    clonefile.restype = ctypes.c_int
    return clonefile
