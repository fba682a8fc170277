"""A fake S3 bucket for the tests: a small HTTP/1.1 server on loopback that keeps its objects in
memory and answers honestly (HEAD, GET, conditional PUT, DELETE, ListObjectsV2), unless a test
scripts otherwise.

A test turns it hostile by rules: `bucket.on(match, answer)` makes every request that match(request)
accepts get answer(connection, request) instead of the honest answer (the newest rule first;
`times=` limits how often a rule fires). The answers below are the misbehaviours of a bucket that
is faulty, overloaded or hostile: an error status (503 SlowDown, 429, 403 with any S3 code), a
clock refusal (`skewed`), a body trickled a few bytes at a time, a head or body that never comes
(`hang`), a reset, a body other than the object's, a page of HTML. `requests` counts what was
asked, by method and key.

Signatures are not checked (the real SeaweedFS of seaweed.py checks them), but a rule may match
the access key a request was signed with (`signed_by`); the server honours
If-None-Match: * unless `ignore_if_none_match` is set (as some S3-compatible stores do).
close() ends every connection, hung ones included.
"""

from __future__ import annotations

import io
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Final
from urllib.parse import parse_qsl, unquote, urlsplit
from xml.sax.saxutils import escape

BUCKET: Final = "kvd"
HEAD_LIMIT: Final = 64 << 10  # a request head past this is refused (the tests send small ones)


@dataclass(frozen=True)
class Request:
    """One request as the bucket saw it: key is the object's key (None for the bucket)."""

    method: str
    key: str | None
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes


Answer = Callable[[socket.socket, Request], None]  # writes the whole answer to the connection
Match = Callable[[Request], bool]


@dataclass
class Rule:
    match: Match
    answer: Answer
    times: int | None  # how often it may still fire (None: always)


@dataclass
class FakeBucket:
    """The server: objects by key, the rules, what was asked."""

    bucket: str = BUCKET
    ignore_if_none_match: bool = False
    date_offset: float = 0.0  # seconds added to the Date header (a bucket whose clock is off)
    objects: dict[str, bytes] = field(default_factory=dict)
    requests: Counter[tuple[str, str | None]] = field(default_factory=Counter)
    _rules: list[Rule] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: threading.Event = field(default_factory=threading.Event)
    _connections: set[socket.socket] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    # --- what a test scripts ------------------------------------------------------------------

    def on(self, match: Match, answer: Answer, *, times: int | None = None) -> Rule:
        """Answer the requests match accepts with answer (the newest rule first)."""
        rule = Rule(match, answer, times)
        with self._lock:
            self._rules.insert(0, rule)
        return rule

    def clear(self) -> None:
        """Honest again: every rule removed."""
        with self._lock:
            self._rules.clear()

    def asked(self, method: str, key_part: str = "") -> int:
        """How many requests of method were for a key containing key_part."""
        with self._lock:
            return sum(
                count
                for (asked_method, key), count in self.requests.items()
                if asked_method == method and key_part in (key or "")
            )

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    @property
    def closed(self) -> threading.Event:
        return self._closed

    # --- serving ------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.add(connection)
            threading.Thread(target=self._connection, args=(connection,), daemon=True).start()

    def _connection(self, connection: socket.socket) -> None:
        try:
            with connection:
                reader = connection.makefile("rb")
                while not self._closed.is_set():
                    request = self._read(reader)
                    if request is None:
                        return
                    self._answer(connection, request)
        except OSError:
            return
        finally:
            with self._lock:
                self._connections.discard(connection)

    def _read(self, reader: io.BufferedReader) -> Request | None:
        line = reader.readline(HEAD_LIMIT)
        if not line:
            return None
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while True:
            header = reader.readline(HEAD_LIMIT).decode("latin-1").rstrip("\r\n")
            if not header:
                break
            name, _, value = header.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        body = reader.read(length) if length else b""
        parts = urlsplit(target)
        path = unquote(parts.path).lstrip("/")
        bucket, _, key = path.partition("/")
        if bucket != self.bucket:
            key = path  # answered as a missing bucket below
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        return Request(method, key or None, query, headers, body)

    def _answer(self, connection: socket.socket, request: Request) -> None:
        with self._lock:
            self.requests[(request.method, request.key)] += 1
            rule = next((r for r in self._rules if r.match(request)), None)
            if rule is not None and rule.times is not None:
                rule.times -= 1
                if rule.times <= 0:
                    self._rules.remove(rule)
        (rule.answer if rule is not None else self.honest)(connection, request)

    def honest(self, connection: socket.socket, request: Request) -> None:
        """The answer S3 would give (a rule's answer may fall back on it)."""
        key = request.key
        with self._lock:
            found = self.objects.get(key) if key is not None else None
        date = formatdate(time.time() + self.date_offset, usegmt=True)
        if request.method == "GET" and key is None:
            send(connection, 200, self._listing(request), date=date)
        elif request.method in ("GET", "HEAD") and key is not None:
            if found is None:
                send(connection, 404, error_xml("NoSuchKey"), date=date, head=request)
            else:
                send(connection, 200, found, date=date, head=request)
        elif request.method == "PUT" and key is not None:
            with self._lock:
                exists = key in self.objects
                conditional = request.headers.get("if-none-match") == "*"
                if exists and conditional and not self.ignore_if_none_match:
                    refused = True
                else:
                    self.objects[key] = request.body
                    refused = False
            send(
                connection,
                412 if refused else 200,
                error_xml("PreconditionFailed") if refused else b"",
                date=date,
            )
        elif request.method == "DELETE" and key is not None:
            with self._lock:
                self.objects.pop(key, None)
            send(connection, 204, b"", date=date)
        else:
            send(connection, 400, error_xml("InvalidRequest"), date=date)

    def _listing(self, request: Request) -> bytes:
        prefix = request.query.get("prefix", "")
        most = int(request.query.get("max-keys", "1000"))
        after = request.query.get("continuation-token", "")
        with self._lock:
            keys = sorted(k for k in self.objects if k.startswith(prefix) and k > after)
            sizes = {k: len(self.objects[k]) for k in keys[:most]}
        page = keys[:most]
        truncated = len(keys) > most
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{sizes[k]}</Size></Contents>" for k in page
        )
        more = (
            f"<IsTruncated>true</IsTruncated><NextContinuationToken>{escape(page[-1])}"
            "</NextContinuationToken>"
            if truncated and page
            else "<IsTruncated>false</IsTruncated>"
        )
        return (
            f'<?xml version="1.0"?><ListBucketResult>{contents}{more}</ListBucketResult>'.encode()
        )


# --- answers ---------------------------------------------------------------------------------


def error_xml(code: str) -> bytes:
    return f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()


def send(
    connection: socket.socket,
    status: int,
    body: bytes,
    *,
    date: str | None = None,
    head: Request | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """A whole answer: status, Content-Length and Date, and the body unless the request was a
    HEAD (head: the request, to tell)."""
    lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}"]
    lines.append(f"Date: {date or formatdate(usegmt=True)}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    payload = b"" if head is not None and head.method == "HEAD" else body
    connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)


def status(code: int, s3_code: str = "", headers: dict[str, str] | None = None) -> Answer:
    """An error answer: 503 SlowDown, 429, 403 RequestTimeTooSkewed, 500, ..."""

    def answer(connection: socket.socket, request: Request) -> None:
        send(
            connection, code, error_xml(s3_code) if s3_code else b"", head=request, headers=headers
        )

    return answer


def body(data: bytes, *, declared: int | None = None, code: int = 200) -> Answer:
    """This body in place of the object's (declared: the Content-Length it claims)."""

    def answer(connection: socket.socket, request: Request) -> None:
        length = len(data) if declared is None else declared
        head = f"HTTP/1.1 {code} X\r\nContent-Length: {length}\r\n\r\n".encode()
        connection.sendall(head + (b"" if request.method == "HEAD" else data))
        if declared is not None and declared != len(data):
            connection.shutdown(socket.SHUT_RDWR)  # a body cut short, or a lie

    return answer


def html(code: int = 200) -> Answer:
    """A captive portal's or a proxy's page, where S3's XML belongs."""
    page = b"<html><head><title>Sign in</title></head><body>" + b"x" * 4000 + b"</body></html>"
    return body(page, code=code)


def trickle(bucket: FakeBucket, *, every: float, chunk: int = 1, size: int = 1 << 20) -> Answer:
    """The honest object (or size bytes) a chunk at a time, each within every seconds: a read
    never times out, the whole takes forever."""

    def answer(connection: socket.socket, request: Request) -> None:
        with bucket._lock:
            data = bucket.objects.get(request.key or "") or bytes(size)
        connection.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode())
        if request.method == "HEAD":
            return
        for start in range(0, len(data), chunk):
            if bucket.closed.wait(every):
                return
            connection.sendall(data[start : start + chunk])

    return answer


def trickle_head(bucket: FakeBucket, *, every: float) -> Answer:
    """The answer's head a byte at a time, never finished."""

    def answer(connection: socket.socket, request: Request) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1_000_000:
            if bucket.closed.wait(every):
                return
            connection.sendall(bytes([byte]))

    return answer


def skewed(bucket: FakeBucket) -> Answer:
    """403 RequestTimeTooSkewed as S3 answers a request signed by a clock too far off: its Date
    from the bucket's clock (date_offset), the times in the error's XML."""

    def answer(connection: socket.socket, request: Request) -> None:
        now = time.time() + bucket.date_offset
        xml = (
            "<?xml version='1.0'?><Error><Code>RequestTimeTooSkewed</Code><Message>The "
            "difference between the request time and the current time is too large.</Message>"
            f"<RequestTime>{request.headers.get('x-amz-date', '')}</RequestTime>"
            f"<ServerTime>{formatdate(now, usegmt=True)}</ServerTime>"
            "<MaxAllowedSkewMilliseconds>900000</MaxAllowedSkewMilliseconds></Error>"
        ).encode()
        send(connection, 403, xml, date=formatdate(now, usegmt=True), head=request)

    return answer


def hang(bucket: FakeBucket) -> Answer:
    """No answer at all, until the bucket closes."""

    def answer(connection: socket.socket, request: Request) -> None:
        bucket.closed.wait()

    return answer


def reset(connection: socket.socket, request: Request) -> None:
    """The connection reset (RST) before any answer."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # Closed by its descriptor: the server's reader holds the socket object open.
    os.close(connection.detach())


def key_has(part: str, method: str | None = None) -> Match:
    """Requests for a key containing part (and of method, when given)."""
    return lambda request: part in (request.key or "") and method in (None, request.method)


def signed_by(access_key: str) -> Match:
    """Requests signed with this access key (SigV4's Credential=KEY/...)."""
    return lambda request: f"Credential={access_key}/" in request.headers.get("authorization", "")


def every_request(request: Request) -> bool:
    return True


@contextmanager
def running_bucket(**options: object) -> Iterator[FakeBucket]:
    bucket = FakeBucket(**options)  # type: ignore[arg-type]
    try:
        yield bucket
    finally:
        bucket.close()
