"""read_ahead.will_read on real files: the hint alone reads a file dropped from the page
cache back from disk (Linux, where /proc/self/io counts the bytes a process has the disk
read); a descriptor that takes no hint is left as it is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvd_client.read_ahead import ask, will_read

SIZE = 4 << 20
IO = Path("/proc/self/io")

linux_only = pytest.mark.skipif(
    not IO.exists() or not hasattr(os, "posix_fadvise"), reason="Linux only"
)


def _disk_reads() -> int:
    """Bytes this process has had read from storage so far (the kernel counts a read when it
    is sent to the disk, on the thread that sends it)."""
    for line in IO.read_text().splitlines():
        key, _, value = line.partition(": ")
        if key == "read_bytes":
            return int(value)
    raise AssertionError(f"no read_bytes in {IO}")


def _dropped(path: Path) -> int:
    """path written to disk and dropped from the page cache, opened for reading."""
    path.write_bytes(os.urandom(SIZE))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


@linux_only
def test_the_hint_has_every_file_read_from_disk(tmp_path: Path) -> None:
    control = _dropped(tmp_path / "control")
    before = _disk_reads()
    os.pread(control, 4096, 0)
    os.close(control)
    if _disk_reads() == before:
        pytest.skip("this file system keeps its pages in memory (tmpfs): nothing to read")
    fds = [_dropped(tmp_path / f"file{i}") for i in range(2)]
    try:
        before = _disk_reads()
        for fd in fds:
            will_read(fd)
        assert _disk_reads() - before >= 2 * SIZE
    finally:
        for fd in fds:
            os.close(fd)


def test_a_regular_file_takes_the_hint(tmp_path: Path) -> None:
    """Nothing dropped: on macOS this is what says F_RDADVISE's number and struct are right."""
    path = tmp_path / "entry"
    path.write_bytes(os.urandom(SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        ask(fd)
        assert os.pread(fd, 16, SIZE - 16) == path.read_bytes()[-16:]
    finally:
        os.close(fd)


def test_a_descriptor_that_takes_no_hint_is_left_alone() -> None:
    read_end, write_end = os.pipe()
    try:
        will_read(read_end)  # posix_fadvise refuses a pipe (ESPIPE): a hint, dropped
        os.write(write_end, b"x")
        assert os.read(read_end, 1) == b"x"
    finally:
        os.close(read_end)
        os.close(write_end)
