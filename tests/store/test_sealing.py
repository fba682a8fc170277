"""Sealing a staging file (kvd/store/sealing.py) on real files: as it is when no writer of it is
left, else a copy the writer cannot reach; the writer's file truncated."""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd.store import sealing

SIZE = 3 * 16384 + 123
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="read leases are Linux's")


def staged(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(SIZE)
    path = tmp_path / "put.kvs"
    path.write_bytes(data)
    return path, data


def sealed_bytes(sealed: sealing.Sealed) -> bytes:
    try:
        return os.pread(sealed.fd, SIZE + 1, 0)
    finally:
        os.close(sealed.fd)


@linux_only
def test_a_file_no_one_can_write_is_sealed_as_it_is(tmp_path: Path) -> None:
    path, data = staged(tmp_path)
    reader = os.open(path, os.O_RDONLY)  # readers do not count
    try:
        sealed = sealing.seal(path, SIZE, tmp_path / "copy.kvs")
    finally:
        os.close(reader)
    assert (sealed.path, sealed.copied) == (path, False)
    assert sealed_bytes(sealed) == data
    assert not (tmp_path / "copy.kvs").exists()


def test_a_file_a_descriptor_can_still_write_is_sealed_by_a_copy(tmp_path: Path) -> None:
    path, data = staged(tmp_path)
    writer = os.open(path, os.O_RDWR)
    try:
        sealed = sealing.seal(path, SIZE, tmp_path / "copy.kvs")
        assert (sealed.path, sealed.copied) == (tmp_path / "copy.kvs", True)
        assert os.fstat(writer).st_size == 0  # the writer's file, truncated
        os.pwrite(writer, b"\x00" * 64, 0)  # what it writes now reaches nothing sealed
    finally:
        os.close(writer)
    assert sealed_bytes(sealed) == data


@linux_only
def test_a_shared_writable_mapping_is_a_writer_too(tmp_path: Path) -> None:
    path, data = staged(tmp_path)
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)  # the mapping keeps its write access
    try:
        sealed = sealing.seal(path, SIZE, tmp_path / "copy.kvs")
    finally:
        mapping.close()
    assert sealed.copied
    assert sealed_bytes(sealed) == data


def test_a_copy_takes_no_more_than_the_declared_size(tmp_path: Path) -> None:
    path, data = staged(tmp_path)
    writer = os.open(path, os.O_RDWR)
    try:
        sealed = sealing.seal(path, SIZE - 100, tmp_path / "copy.kvs")
    finally:
        os.close(writer)
    if sys.platform == "darwin":  # a clone is the file whole: its size check refuses it
        assert sealed_bytes(sealed) == data
    else:
        assert sealed_bytes(sealed) == data[: SIZE - 100]


def test_every_way_of_copying_copies_the_bytes_up_to_the_end_of_the_source(
    tmp_path: Path,
) -> None:
    path, data = staged(tmp_path)
    source = os.open(path, os.O_RDONLY)
    try:
        ways: list[tuple[str, Callable[[int, int, int], object]]] = [
            ("range", sealing.copy_bytes),
            ("plain", sealing.copy_plain),
        ]
        for name, copy in ways:
            target = os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                copy(source, target, SIZE + 4096)  # more than there is: up to the end
                assert os.pread(target, SIZE + 1, 0) == data, name
            finally:
                os.close(target)
    finally:
        os.close(source)
