"""The S3 client against a real store (SeaweedFS on loopback): what each call returns, and
that bodies stream whole and are never read past the caller's limit."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from seaweed import Seaweed

from kvd.remote.s3 import ObjectTooLarge, S3Store


def test_a_missing_object_is_none_for_head_and_get(store: S3Store, prefix: str) -> None:
    assert store.head(f"{prefix}/absent") is None
    assert store.get(f"{prefix}/absent", 1024) is None
    assert store.get_to_file(f"{prefix}/absent", 0, 1024) is None


def test_put_if_absent_creates_once(store: S3Store, prefix: str) -> None:
    key = f"{prefix}/layout"
    assert store.put_if_absent(key, b"first") is True
    assert store.put_if_absent(key, b"second") is False  # 412: the first stays
    assert store.head(key) == 5
    assert store.get(key, 5) == b"first"


def test_get_past_the_limit_is_refused(store: S3Store, prefix: str) -> None:
    key = f"{prefix}/object"
    store.put_if_absent(key, b"x" * 1000)
    assert store.get(key, 1000) == b"x" * 1000
    with pytest.raises(ObjectTooLarge, match="1000 bytes, over the limit of 999"):
        store.get(key, 999)
    assert store.get(key, 1000) == b"x" * 1000  # the client goes on after a refusal


def test_a_file_goes_up_and_comes_down_byte_for_byte(
    store: S3Store, prefix: str, tmp_path: Path
) -> None:
    body = os.urandom(5 << 20 | 12345)  # over SeaweedFS's 4 MiB chunk, not a multiple
    source = tmp_path / "block"
    source.write_bytes(body + b"trailing bytes not sent")
    key = f"{prefix}/block.kvb"
    with source.open("rb") as file:
        assert store.put_file_if_absent(key, file.fileno(), len(body)) is True
        assert store.put_file_if_absent(key, file.fileno(), len(body)) is False
    assert store.head(key) == len(body)
    target = tmp_path / "fetched"
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert store.get_to_file(key, fd, len(body)) == len(body)
        with pytest.raises(ObjectTooLarge):
            store.get_to_file(key, fd, len(body) - 1)
    finally:
        os.close(fd)
    assert target.read_bytes() == body


def test_a_file_shorter_than_said_is_not_sent(store: S3Store, prefix: str, tmp_path: Path) -> None:
    source = tmp_path / "short"
    source.write_bytes(b"y" * 100)
    with source.open("rb") as file, pytest.raises(ValueError, match="ended at 100 of 200"):
        store.put_file_if_absent(f"{prefix}/short", file.fileno(), 200)
    assert store.head(f"{prefix}/short") is None


def test_delete_removes_and_tolerates_absent(store: S3Store, prefix: str) -> None:
    key = f"{prefix}/gone"
    store.put_if_absent(key, b"1")
    store.delete(key)
    assert store.head(key) is None
    store.delete(key)


def test_list_pages_through_keys_in_order(store: S3Store, prefix: str) -> None:
    keys = [f"{prefix}/b/{n:04d}.kvb" for n in range(25)]
    for key in keys:
        store.put_if_absent(key, key.encode())
    store.put_if_absent(f"{prefix}/layout", b"{}")
    listed = store.list(f"{prefix}/b/", 100)
    assert listed == [(key, len(key)) for key in keys]
    assert store.list(f"{prefix}/b/", 7) == listed[:7]
    assert store.list(f"{prefix}/none/", 10) == []


def test_keys_with_characters_that_need_escaping(store: S3Store, prefix: str) -> None:
    key = f"{prefix}/a b+c=d&e~f%g/ü.kvb"
    assert store.put_if_absent(key, b"odd") is True
    assert store.get(key, 3) == b"odd"
    assert store.list(f"{prefix}/a b+c", 10) == [(key, 3)]


def test_threads_share_one_client(store: S3Store, prefix: str) -> None:
    """Each thread keeps a connection of its own; all calls of all threads succeed."""
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for n in range(20):
                key = f"{prefix}/{worker}/{n}"
                assert store.put_if_absent(key, key.encode()) is True
                assert store.get(key, 100) == key.encode()
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_connections_are_reused(store: S3Store, prefix: str) -> None:
    store.put_if_absent(f"{prefix}/k", b"v")
    connection = store._connection()
    sock = connection.sock
    assert sock is not None
    for _ in range(5):
        assert store.get(f"{prefix}/k", 1) == b"v"
        assert store.head(f"{prefix}/absent") is None
    assert connection.sock is sock


def test_the_client_reconnects_after_the_store_restarts(
    seaweed: Seaweed, store: S3Store, prefix: str
) -> None:
    """A kept connection the store closed is replaced without failing the call."""
    store.put_if_absent(f"{prefix}/k", b"v")
    seaweed.stop()
    seaweed.start()
    assert store.get(f"{prefix}/k", 1) == b"v"
