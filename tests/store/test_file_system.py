"""Which file system holds a path: a real mount, and the mount table's escapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvd.store.file_system import FileSystem, file_system_of, from_mountinfo

# Two lines of /proc/self/mountinfo (proc(5)): the root, and a mount point with a space.
MOUNTINFO = (
    "25 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "36 25 98:0 / /mnt/a\\040disk rw,noatime master:1 - xfs /dev/sdb1 rw,errors=continue\n"
)


@pytest.mark.skipif(sys.platform != "linux", reason="a tmpfs is mounted on Linux")
def test_a_tmpfs_is_named_with_its_mount_point(small_disk: Path) -> None:
    (small_disk / "tier").mkdir()
    assert file_system_of(small_disk / "tier") == FileSystem("tmpfs", str(small_disk.resolve()))


def test_the_longest_mount_point_holding_the_path_is_taken() -> None:
    assert from_mountinfo(Path("/mnt/a disk/tier"), MOUNTINFO) == FileSystem("xfs", "/mnt/a disk")
    assert from_mountinfo(Path("/mnt/a diskette"), MOUNTINFO) == FileSystem("ext4", "/")


def test_remote_file_systems_are_told_apart() -> None:
    assert FileSystem("nfs4", "/net").remote
    assert FileSystem("fuse.sshfs", "/mnt/far").remote
    assert not FileSystem("apfs", "/System/Volumes/Data").remote
