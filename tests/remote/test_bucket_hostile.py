"""The client against a bucket that misbehaves on purpose (a loopback server sending what each
test scripts): bodies past the limit, bodies cut short, trickles, floods of error text,
broken listings and headers. Every case is a BucketError, in bounded time and memory, and the
client goes on working after it."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvd.remote.bucket import Bucket, BucketError, BucketUnavailable, ObjectTooLarge
from kvd.remote.credentials import Credentials
from kvd.remote.deadlines import Interrupt

Script = Callable[[socket.socket, bytes], None]  # answers one request (its head given)
LIMIT = 1 << 20
SECRET = "hostile-test-secret"


class HostileBucket:
    """A loopback listener that answers every request with the current script."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.script: Script = ok
        self.sent = 0  # body bytes the scripts managed to send
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            try:
                while True:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        data = connection.recv(65536)
                        if not data:
                            return
                        head += data
                    self.script(connection, head)
            except OSError:
                return

    def send_body(self, connection: socket.socket, chunk: bytes, times: int) -> None:
        for _ in range(times):
            connection.sendall(chunk)
            self.sent += len(chunk)


def ok(connection: socket.socket, head: bytes) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


@pytest.fixture
def hostile() -> Iterator[HostileBucket]:
    server = HostileBucket()
    yield server
    server.listener.close()


@pytest.fixture
def bucket(hostile: HostileBucket) -> Iterator[Bucket]:
    client = Bucket(hostile.endpoint, "kvd", Credentials("AKID", SECRET), timeout=0.5)
    yield client
    client.close()


def still_works(hostile: HostileBucket, bucket: Bucket) -> None:
    hostile.script = ok
    assert bucket.get("k", 2) == b"ok"


def test_a_declared_length_past_the_limit_is_refused_unread(
    hostile: HostileBucket, bucket: Bucket, tmp_path: Path
) -> None:
    def huge(connection: socket.socket, head: bytes) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10737418240\r\n\r\n")
        hostile.send_body(connection, b"x" * 65536, 1000)

    hostile.script = huge
    with pytest.raises(ObjectTooLarge, match="10737418240 bytes, over the limit"):
        bucket.get("k", LIMIT)
    with (tmp_path / "staging").open("w+b") as file:
        with pytest.raises(ObjectTooLarge):
            bucket.get_to_file("k", file.fileno(), LIMIT)
        assert os.fstat(file.fileno()).st_size == 0
    still_works(hostile, bucket)


def test_an_endless_chunked_body_stops_at_the_limit(
    hostile: HostileBucket, bucket: Bucket, tmp_path: Path
) -> None:
    chunk = b"x" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)

    def endless(connection: socket.socket, head: bytes) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        hostile.send_body(connection, framed, 1 << 20)  # 64 GiB: stops when the client goes

    hostile.script = endless
    with pytest.raises(ObjectTooLarge, match=f"over the limit of {LIMIT} bytes"):
        bucket.get("k", LIMIT)
    with (tmp_path / "staging").open("w+b") as file:
        with pytest.raises(ObjectTooLarge):
            bucket.get_to_file("k", file.fileno(), LIMIT)
        assert os.fstat(file.fileno()).st_size <= LIMIT
    still_works(hostile, bucket)


def test_a_body_cut_short_is_the_bucket_failing(
    hostile: HostileBucket, bucket: Bucket, tmp_path: Path
) -> None:
    def short(connection: socket.socket, head: bytes) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 600)
        connection.shutdown(socket.SHUT_WR)

    hostile.script = short
    with pytest.raises(BucketUnavailable, match="ended at 600 of 1000 bytes"):
        bucket.get("k", LIMIT)
    with (tmp_path / "staging").open("w+b") as file, pytest.raises(BucketUnavailable):
        bucket.get_to_file("k", file.fileno(), LIMIT)
    still_works(hostile, bucket)


@pytest.mark.parametrize("part", ["stall", "body", "head"])
def test_a_slow_answer_ends_at_the_calls_deadline(
    hostile: HostileBucket, bucket: Bucket, part: str
) -> None:
    """A body that stalls, or a body or head sent a byte at a time, each well within the
    read timeout (0.5 s): the call ends at its deadline, the request timeout from its start
    unless the caller gives one."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"

    def slow(connection: socket.socket, request: bytes) -> None:
        if part == "stall":
            connection.sendall(head + b"x")
            time.sleep(5.0)
            return
        if part == "body":
            connection.sendall(head)
        for byte in (b"x" * 1000) if part == "body" else head:
            connection.sendall(bytes([byte]))
            time.sleep(0.1)

    hostile.script = slow
    started = time.monotonic()
    with pytest.raises(BucketUnavailable, match=r"not done within 0.5 s"):
        bucket.get("k", LIMIT)
    assert time.monotonic() - started < 1.5
    started = time.monotonic()
    with pytest.raises(BucketUnavailable, match=r"not done within 2 s"):
        bucket.get("k", LIMIT, deadline=time.monotonic() + 2.0)
    assert 1.5 < time.monotonic() - started < 3.0
    still_works(hostile, bucket)


def test_an_interrupt_ends_a_call_under_way_at_once(hostile: HostileBucket, bucket: Bucket) -> None:
    def hang(connection: socket.socket, request: bytes) -> None:
        time.sleep(5.0)

    hostile.script = hang
    interrupt = Interrupt()
    failures: list[BaseException] = []

    def call() -> None:
        with bucket.interruptible(interrupt):
            try:
                bucket.get("k", LIMIT, deadline=time.monotonic() + 30.0)
            except BucketError as error:
                failures.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    interrupt.interrupt()
    thread.join(timeout=5.0)
    assert time.monotonic() - started < 1.0
    assert [str(error) for error in failures] == ["GET k: interrupted"]
    still_works(hostile, bucket)


def test_a_flood_of_error_text_is_not_read_whole(hostile: HostileBucket, bucket: Bucket) -> None:
    def flood(connection: socket.socket, head: bytes) -> None:
        body = b"<Error><Code>SlowDown</Code>" + b"<Message>" + b"z" * (64 << 20)
        connection.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n" % len(body))
        connection.sendall(body)

    hostile.script = flood
    started = time.monotonic()
    with pytest.raises(BucketUnavailable, match="HTTP 503 SlowDown"):
        bucket.put_if_absent("k", b"v")
    assert time.monotonic() - started < 2.0
    still_works(hostile, bucket)


def test_an_error_code_is_shown_only_when_it_is_a_code(
    hostile: HostileBucket, bucket: Bucket
) -> None:
    def odd(connection: socket.socket, head: bytes) -> None:
        body = f"<Code>Denied {SECRET}\x1b[2J</Code>".encode()
        connection.sendall(b"HTTP/1.1 403 No\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    hostile.script = odd
    with pytest.raises(BucketError) as raised:
        bucket.get("k", LIMIT)
    assert str(raised.value) == "GET k: HTTP 403: credentials refused"


@pytest.mark.parametrize(
    "answer",
    [
        b"not http at all\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Pad: y\r\n" * 200 + b"\r\n",
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"y" * 100_000 + b"\r\n\r\n",
    ],
    ids=["status line", "too many headers", "header too long"],
)
def test_a_broken_answer_is_the_bucket_failing(
    hostile: HostileBucket, bucket: Bucket, answer: bytes
) -> None:
    def broken(connection: socket.socket, head: bytes) -> None:
        connection.sendall(answer)
        connection.shutdown(socket.SHUT_WR)

    hostile.script = broken
    with pytest.raises(BucketUnavailable):
        bucket.get("k", LIMIT)
    still_works(hostile, bucket)


def test_a_head_without_a_size_is_the_bucket_failing(
    hostile: HostileBucket, bucket: Bucket
) -> None:
    hostile.script = lambda connection, head: connection.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    with pytest.raises(BucketUnavailable, match="no Content-Length"):
        bucket.head("k")


@pytest.mark.parametrize(
    ("listing", "expected"),
    [
        (b"<ListBucketResult><Contents><Key>a", "not XML"),
        (b"<r><Contents><Key>a</Key><Size>-1</Size></Contents></r>", "without key or size"),
        (
            b"<!DOCTYPE r [<!ENTITY a 'aaaaaaaaaa'><!ENTITY b '&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;'>"
            b"<!ENTITY c '&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;'><!ENTITY d '&c;&c;&c;&c;&c;&c;&c;&c;"
            b"&c;&c;'><!ENTITY e '&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;'><!ENTITY f '&e;&e;&e;&e;&e;"
            b"&e;&e;&e;&e;&e;'><!ENTITY g '&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;'>]><r>&g;</r>",
            "not XML",
        ),
    ],
    ids=["truncated", "bad size", "entity expansion"],
)
def test_a_broken_listing_is_the_bucket_failing(
    hostile: HostileBucket, bucket: Bucket, listing: bytes, expected: str
) -> None:
    def answer(connection: socket.socket, head: bytes) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(listing))
        connection.sendall(listing)

    hostile.script = answer
    with pytest.raises(BucketUnavailable, match=expected):
        bucket.list("p/", 10)


def test_a_listing_that_never_ends_stops(hostile: HostileBucket, bucket: Bucket) -> None:
    """Pages that say more follow, with no keys (or the same keys), end at the caller's
    limit or at the first empty page."""
    page = (
        b"<ListBucketResult><IsTruncated>true</IsTruncated>"
        b"<NextContinuationToken>again</NextContinuationToken>%s</ListBucketResult>"
    )
    body = page % b"<Contents><Key>p/a</Key><Size>1</Size></Contents>"

    def again(connection: socket.socket, head: bytes) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        connection.sendall(body)

    hostile.script = again
    assert bucket.list("p/", 5) == [("p/a", 1)] * 5
    body = page % b""
    assert bucket.list("p/", 5) == []
