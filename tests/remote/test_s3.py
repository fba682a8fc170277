"""The S3 client against a real s3_store (SeaweedFS on loopback): what each call returns, and
that bodies stream whole and are never read past the caller's limit."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from seaweed import Seaweed

from kvd.remote.bucket import Bucket, BucketError, ObjectTooLarge


def test_a_missing_object_is_none_for_head_and_get(s3_store: Bucket, s3_prefix: str) -> None:
    assert s3_store.head(f"{s3_prefix}/absent") is None
    assert s3_store.get(f"{s3_prefix}/absent", 1024) is None
    assert s3_store.get_to_file(f"{s3_prefix}/absent", 0, 1024) is None


def test_put_if_absent_creates_once(s3_store: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/layout"
    assert s3_store.put_if_absent(key, b"first") is True
    assert s3_store.put_if_absent(key, b"second") is False  # 412: the first stays
    assert s3_store.head(key) == 5
    assert s3_store.get(key, 5) == b"first"


def test_get_past_the_limit_is_refused(s3_store: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/object"
    s3_store.put_if_absent(key, b"x" * 1000)
    assert s3_store.get(key, 1000) == b"x" * 1000
    with pytest.raises(ObjectTooLarge, match="1000 bytes, over the limit of 999"):
        s3_store.get(key, 999)
    assert s3_store.get(key, 1000) == b"x" * 1000  # the client goes on after a refusal


def test_a_file_goes_up_and_comes_down_byte_for_byte(
    s3_store: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    body = os.urandom(5 << 20 | 12345)  # over SeaweedFS's 4 MiB chunk, not a multiple
    source = tmp_path / "block"
    source.write_bytes(body + b"trailing bytes not sent")
    key = f"{s3_prefix}/block.kvb"
    with source.open("rb") as file:
        assert s3_store.put_file_if_absent(key, file.fileno(), len(body)) is True
        assert s3_store.put_file_if_absent(key, file.fileno(), len(body)) is False
    assert s3_store.head(key) == len(body)
    target = tmp_path / "fetched"
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert s3_store.get_to_file(key, fd, len(body)) == len(body)
        with pytest.raises(ObjectTooLarge):
            s3_store.get_to_file(key, fd, len(body) - 1)
    finally:
        os.close(fd)
    assert target.read_bytes() == body


def test_a_file_shorter_than_said_is_not_sent(
    s3_store: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    source = tmp_path / "short"
    source.write_bytes(b"y" * 100)
    with source.open("rb") as file, pytest.raises(ValueError, match="ended at 100 of 200"):
        s3_store.put_file_if_absent(f"{s3_prefix}/short", file.fileno(), 200)
    assert s3_store.head(f"{s3_prefix}/short") is None


def test_a_local_write_error_is_not_a_store_error(
    s3_store: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """A staging file that cannot be written (here: opened read-only; a full disk alike)
    raises the OSError itself, so it never counts against the s3_store's health."""
    s3_store.put_if_absent(f"{s3_prefix}/k", b"v" * 3000)
    (tmp_path / "staging").write_bytes(b"")
    with (
        (tmp_path / "staging").open("rb") as file,
        pytest.raises(OSError, match="Bad file descriptor") as raised,
    ):
        s3_store.get_to_file(f"{s3_prefix}/k", file.fileno(), 3000)
    assert not isinstance(raised.value, BucketError)
    assert s3_store.get(f"{s3_prefix}/k", 3000) == b"v" * 3000


def test_delete_removes_and_tolerates_absent(s3_store: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/gone"
    s3_store.put_if_absent(key, b"1")
    s3_store.delete(key)
    assert s3_store.head(key) is None
    s3_store.delete(key)


def test_list_pages_through_keys_in_order(s3_store: Bucket, s3_prefix: str) -> None:
    keys = [f"{s3_prefix}/b/{n:04d}.kvb" for n in range(25)]
    for key in keys:
        s3_store.put_if_absent(key, key.encode())
    s3_store.put_if_absent(f"{s3_prefix}/layout", b"{}")
    listed = s3_store.list(f"{s3_prefix}/b/", 100)
    assert listed == [(key, len(key)) for key in keys]
    assert s3_store.list(f"{s3_prefix}/b/", 7) == listed[:7]
    assert s3_store.list(f"{s3_prefix}/none/", 10) == []


def test_keys_with_characters_that_need_escaping(s3_store: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/a b+c=d&e~f%g/ü.kvb"
    assert s3_store.put_if_absent(key, b"odd") is True
    assert s3_store.get(key, 3) == b"odd"
    assert s3_store.list(f"{s3_prefix}/a b+c", 10) == [(key, 3)]


def test_threads_share_one_client(s3_store: Bucket, s3_prefix: str) -> None:
    """Each thread keeps a connection of its own; all calls of all threads succeed."""
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for n in range(20):
                key = f"{s3_prefix}/{worker}/{n}"
                assert s3_store.put_if_absent(key, key.encode()) is True
                assert s3_store.get(key, 100) == key.encode()
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_connections_are_reused(s3_store: Bucket, s3_prefix: str) -> None:
    s3_store.put_if_absent(f"{s3_prefix}/k", b"v")
    connection = s3_store._connection()
    sock = connection.sock
    assert sock is not None
    for _ in range(5):
        assert s3_store.get(f"{s3_prefix}/k", 1) == b"v"
        assert s3_store.head(f"{s3_prefix}/absent") is None
    assert connection.sock is sock


def test_the_client_reconnects_after_the_store_restarts(
    seaweed: Seaweed, s3_store: Bucket, s3_prefix: str
) -> None:
    """A kept connection the s3_store closed is replaced without failing the call."""
    s3_store.put_if_absent(f"{s3_prefix}/k", b"v")
    seaweed.stop()
    seaweed.start()
    assert s3_store.get(f"{s3_prefix}/k", 1) == b"v"
