"""Which file system holds a path, and where it is mounted.

Linux: the mount in /proc/self/mountinfo whose mount point is the longest prefix of the
path, resolved (its fifth field, octal-escaped, and the type after the " - "). macOS:
statfs(2) through ctypes, f_fstypename and f_mntonname of the 64-bit-inode `struct statfs`
(xnu bsd/sys/mount.h); Python does not bind statfs.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

MOUNTINFO: Final = Path("/proc/self/mountinfo")
# File systems on another machine (or a user-space one): no local rename, flock or change
# events the daemon can rely on.
REMOTE: Final = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "afpfs", "webdav", "9p", "ceph", "glusterfs"}
)

# struct statfs (64-bit inodes): f_fstypename[16] at byte 72, f_mntonname[1024] at 88, 2168
# bytes in all; the buffer is larger, so a longer struct cannot overrun it.
_STATFS_BYTES: Final = 4096
_TYPE_NAME: Final = slice(72, 88)
_MOUNTED_ON: Final = slice(88, 88 + 1024)
_OCTAL_ESCAPE: Final = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class FileSystem:
    type: str
    mount_point: str

    @property
    def remote(self) -> bool:
        return self.type in REMOTE or self.type.startswith("fuse")


def file_system_of(path: Path) -> FileSystem:
    """The file system holding path (which must exist); OSError where this cannot be told."""
    if sys.platform == "darwin":
        return _statfs(path)
    if sys.platform == "linux":
        return from_mountinfo(path.resolve(), MOUNTINFO.read_text())
    raise OSError(errno.ENOTSUP, f"file system types are not read on {sys.platform}")


def from_mountinfo(path: Path, table: str) -> FileSystem:
    """The file system holding path (resolved), from the text of a mountinfo table."""
    best: FileSystem | None = None
    for line in table.splitlines():
        mount, _, after = line.partition(" - ")
        fields = mount.split()
        if len(fields) < 5 or not after:
            continue
        point = _OCTAL_ESCAPE.sub(lambda match: chr(int(match[1], 8)), fields[4])
        if path.is_relative_to(point) and (best is None or len(point) >= len(best.mount_point)):
            best = FileSystem(type=after.split()[0], mount_point=point)  # later mounts win
    if best is None:
        raise OSError(errno.ENOENT, f"no mount holds {path} in {MOUNTINFO}")
    return best


def _statfs(path: Path) -> FileSystem:
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _statfs_call()(os.fsencode(path), buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))
    raw = buffer.raw
    return FileSystem(
        type=raw[_TYPE_NAME].split(b"\0")[0].decode(),
        mount_point=os.fsdecode(raw[_MOUNTED_ON].split(b"\0")[0]),
    )


@functools.cache
def _statfs_call() -> Any:
    """libSystem's statfs with 64-bit inodes: `statfs$INODE64` on Intel, `statfs` on arm64."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        call = getattr(libc, "statfs$INODE64")
    except AttributeError:
        call = libc.statfs
    call.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    call.restype = ctypes.c_int
    return call
