"""The S3 client against a real bucket (SeaweedFS on loopback): what each call returns, and
that bodies stream whole and are never read past the caller's limit."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from seaweed import Seaweed

from kvd.remote.bucket import Bucket, BucketError, ObjectTooLarge


def test_a_missing_object_is_none_for_head_and_get(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    assert seaweed_bucket.head(f"{s3_prefix}/absent") is None
    assert seaweed_bucket.get(f"{s3_prefix}/absent", 1024) is None
    assert seaweed_bucket.get_to_file(f"{s3_prefix}/absent", 0, 1024) is None


def test_put_if_absent_creates_once(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/layout"
    assert seaweed_bucket.put_if_absent(key, b"first") is True
    assert seaweed_bucket.put_if_absent(key, b"second") is False  # 412: the first stays
    assert seaweed_bucket.head(key) == 5
    assert seaweed_bucket.get(key, 5) == b"first"


def test_get_past_the_limit_is_refused(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/object"
    seaweed_bucket.put_if_absent(key, b"x" * 1000)
    assert seaweed_bucket.get(key, 1000) == b"x" * 1000
    with pytest.raises(ObjectTooLarge, match="1000 bytes, over the limit of 999"):
        seaweed_bucket.get(key, 999)
    assert seaweed_bucket.get(key, 1000) == b"x" * 1000  # the client goes on after a refusal


def test_a_file_goes_up_and_comes_down_byte_for_byte(
    seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    body = os.urandom(5 << 20 | 12345)  # over SeaweedFS's 4 MiB chunk, not a multiple
    source = tmp_path / "block"
    source.write_bytes(body + b"trailing bytes not sent")
    key = f"{s3_prefix}/block.kvb"
    with source.open("rb") as file:
        assert seaweed_bucket.put_file_if_absent(key, file.fileno(), len(body)) is True
        assert seaweed_bucket.put_file_if_absent(key, file.fileno(), len(body)) is False
    assert seaweed_bucket.head(key) == len(body)
    target = tmp_path / "fetched"
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert seaweed_bucket.get_to_file(key, fd, len(body)) == len(body)
        with pytest.raises(ObjectTooLarge):
            seaweed_bucket.get_to_file(key, fd, len(body) - 1)
    finally:
        os.close(fd)
    assert target.read_bytes() == body


def test_a_file_shorter_than_said_is_not_sent(
    seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    source = tmp_path / "short"
    source.write_bytes(b"y" * 100)
    with source.open("rb") as file, pytest.raises(ValueError, match="ended at 100 of 200"):
        seaweed_bucket.put_file_if_absent(f"{s3_prefix}/short", file.fileno(), 200)
    assert seaweed_bucket.head(f"{s3_prefix}/short") is None


def test_a_local_write_error_is_not_a_bucket_error(
    seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """A staging file that cannot be written (here: opened read-only; a full disk alike)
    raises the OSError itself, so it never counts against the bucket's health."""
    seaweed_bucket.put_if_absent(f"{s3_prefix}/k", b"v" * 3000)
    (tmp_path / "staging").write_bytes(b"")
    with (
        (tmp_path / "staging").open("rb") as file,
        pytest.raises(OSError, match="Bad file descriptor") as raised,
    ):
        seaweed_bucket.get_to_file(f"{s3_prefix}/k", file.fileno(), 3000)
    assert not isinstance(raised.value, BucketError)
    assert seaweed_bucket.get(f"{s3_prefix}/k", 3000) == b"v" * 3000


def test_delete_removes_and_tolerates_absent(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/gone"
    seaweed_bucket.put_if_absent(key, b"1")
    seaweed_bucket.delete(key)
    assert seaweed_bucket.head(key) is None
    seaweed_bucket.delete(key)


def test_list_pages_through_keys_in_order(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    keys = [f"{s3_prefix}/b/{n:04d}.kvb" for n in range(25)]
    for key in keys:
        seaweed_bucket.put_if_absent(key, key.encode())
    seaweed_bucket.put_if_absent(f"{s3_prefix}/layout", b"{}")
    listed = seaweed_bucket.list(f"{s3_prefix}/b/", 100)
    assert listed == [(key, len(key)) for key in keys]
    assert seaweed_bucket.list(f"{s3_prefix}/b/", 7) == listed[:7]
    assert seaweed_bucket.list(f"{s3_prefix}/none/", 10) == []


def test_keys_with_characters_that_need_escaping(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    key = f"{s3_prefix}/a b+c=d&e~f%g/ü.kvb"
    assert seaweed_bucket.put_if_absent(key, b"odd") is True
    assert seaweed_bucket.get(key, 3) == b"odd"
    assert seaweed_bucket.list(f"{s3_prefix}/a b+c", 10) == [(key, 3)]


def test_threads_share_one_client(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    """Each thread keeps a connection of its own; all calls of all threads succeed."""
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for n in range(20):
                key = f"{s3_prefix}/{worker}/{n}"
                assert seaweed_bucket.put_if_absent(key, key.encode()) is True
                assert seaweed_bucket.get(key, 100) == key.encode()
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_connections_are_reused(seaweed_bucket: Bucket, s3_prefix: str) -> None:
    seaweed_bucket.put_if_absent(f"{s3_prefix}/k", b"v")
    connection = seaweed_bucket._connection()
    sock = connection.sock
    assert sock is not None
    for _ in range(5):
        assert seaweed_bucket.get(f"{s3_prefix}/k", 1) == b"v"
        assert seaweed_bucket.head(f"{s3_prefix}/absent") is None
    assert connection.sock is sock


def test_the_client_reconnects_after_the_bucket_restarts(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str
) -> None:
    """A kept connection the bucket closed is replaced without failing the call."""
    seaweed_bucket.put_if_absent(f"{s3_prefix}/k", b"v")
    seaweed.stop()
    seaweed.start()
    assert seaweed_bucket.get(f"{s3_prefix}/k", 1) == b"v"
