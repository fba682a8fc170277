"""A small S3 client: the few calls the remote tier makes, on http.client.

Blocking and thread-safe: each thread keeps one connection (keep-alive) to the endpoint. Every
call has a deadline on its whole duration (connect, send, the answer's head and body; by
default the request timeout from now): a watchdog thread shuts down the connection of a call
still under way at its deadline, so a bucket that trickles its answer a byte at a time cannot
hold a call past it. Another thread may end a call at once the same way (deadlines.Interrupt,
bound to the calling thread by interruptible(): the daemon's event loop, for a call it no
longer waits for). Bodies are read into the caller's file or buffer and never past the
caller's limit, so a hostile or broken bucket cannot make the daemon hold more than it asked
for. Requests are signed with SigV4 in the Authorization header; over plain http a body's
sha256 is signed too (the bucket refuses a body changed on the way), over https TLS already
protects it and the body goes unsigned (no hash pass over every block uploaded). Addressing
is path-style (bucket in the path), which every S3-compatible server takes; AWS's own
endpoint gets the bucket in the host name.

The credentials are a CredentialSource's, as they are at each request (read again when they
change, expire or are refused: credential_source.py), or fixed ones.

Failures come as BucketError subclasses whose messages name the call and the cause, never a
secret:
    BucketUnavailable  no connection, a reset, not done by its deadline ("not done within N
                      s"), interrupted, TLS refused, 5xx
      BucketBusy       the bucket asks to slow down: 429, 503 SlowDown, a 503 with Retry-After,
                      a 503 to a HEAD (which has no body to say SlowDown in)
    BucketAuthError    no credentials, or the bucket refused them (401/403)
      BucketClockSkewed  a refusal for the clock: RequestTimeTooSkewed, or the answer's Date
                      more than SKEW_LIMIT_S from this machine's ("clock off by N s")
    BucketRefused      any other refusal (4xx: NoSuchBucket, InvalidRequest, ...)
    ObjectTooLarge    an object longer than the caller's limit
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import socket
import ssl
import threading
import time
import weakref
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from kvd.config import Config
from kvd.remote.credential_source import CredentialSource
from kvd.remote.credentials import Credentials, CredentialsError
from kvd.remote.deadlines import Bound, Interrupt
from kvd.remote.sigv4 import EMPTY_SHA256, UNSIGNED_PAYLOAD, Signer, canonical_query, uri_path

CHUNK: Final = 1 << 20  # bytes read from the socket at a time
ERROR_BODY_LIMIT: Final = 64 << 10  # an error's XML is read up to this, to learn its Code
LIST_PAGE_LIMIT: Final = 8 << 20  # a ListObjectsV2 page (1000 keys) is far smaller
LIST_PAGE_KEYS: Final = 1000  # S3's largest page
_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
SKEW_LIMIT_S: Final = 300.0  # a refusal whose answer's Date is further off is put to the clock
BUSY_WAIT_MAX_S: Final = 60.0  # a Retry-After is honoured up to this


class BucketError(Exception):
    """A call to the bucket failed; the message never holds a secret."""


class BucketUnavailable(BucketError):  # noqa: N818 - reads as the state the health takes
    """The bucket did not answer, or answered that it cannot now (5xx)."""


class BucketBusy(BucketUnavailable):
    """The bucket asks for fewer requests (429, 503 SlowDown): it is there, and answers again
    after a while; retry_after, the seconds it asked for (Retry-After), if it said."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BucketAuthError(BucketError):
    """No credentials, or the bucket refused them."""


class BucketClockSkewed(BucketAuthError):  # noqa: N818 - reads as the bucket's answer
    """The bucket refused the request for this machine's clock, not its credentials; offset,
    the bucket's clock minus this machine's in seconds, when its answer had a Date."""

    def __init__(self, message: str, offset: float | None) -> None:
        super().__init__(message)
        self.offset = offset


class BucketRefused(BucketError):  # noqa: N818 - reads as the bucket's answer
    """The bucket refused the request itself (a 4xx other than auth)."""


class ObjectTooLarge(BucketError):  # noqa: N818 - reads as what the bucket holds
    """An object is longer than the caller would read."""


def endpoint_for(endpoint: str, region: str, bucket: str) -> tuple[str, str]:
    """The URL to connect to and the path every key goes under: path-style for a configured
    endpoint; AWS's regional endpoint with the bucket in the host (a bucket name with a dot
    stays path-style: it would not match AWS's wildcard certificate)."""
    if endpoint:
        return endpoint, f"/{bucket}"
    if "." in bucket:
        return f"https://s3.{region}.amazonaws.com", f"/{bucket}"
    return f"https://{bucket}.s3.{region}.amazonaws.com", ""


def _describe(error: BaseException, bound: Bound) -> str:
    """A failure's cause in a few words (never a request or header)."""
    if bound.interrupt.expired:
        return bound.overdue()
    if bound.interrupt.interrupted:
        return "interrupted"
    if isinstance(error, TimeoutError):
        return bound.overdue()
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"TLS: {error.verify_message}"
    if isinstance(error, ssl.SSLError):
        return f"TLS: {error.reason or error.strerror}"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return type(error).__name__


def _failure(what: str, response: http.client.HTTPResponse, code: str) -> BucketError:
    """The error an answer means; `code` is S3's error Code if the body had one."""
    status = response.status
    message = f"{what}: HTTP {status}" + (f" {code}" if code else "")
    retry_after = _retry_after(response)
    # A HEAD's answer has no body, so no Code: S3 answers a HEAD it would slow down 503 alone.
    asked = code == "SlowDown" or retry_after is not None or what.startswith("HEAD ")
    if status == 429 or (status == 503 and asked):
        return BucketBusy(f"{message}: the bucket asks for fewer requests", retry_after)
    if status >= 500:
        return BucketUnavailable(message)
    if status in (401, 403):
        offset = _clock_offset_of(response)
        off = offset is not None and abs(offset) > SKEW_LIMIT_S
        if off or code == "RequestTimeTooSkewed":
            by = f" by {round(abs(offset))} s" if off and offset is not None else ""
            side = "" if not by else " (behind)" if offset and offset > 0 else " (ahead)"
            return BucketClockSkewed(
                f"{message}: this machine's clock is off{by}{side} from the bucket's", offset
            )
        return BucketAuthError(f"{message}: credentials refused")
    return BucketRefused(message)


def _clock_offset_of(response: http.client.HTTPResponse) -> float | None:
    """The bucket's clock minus this machine's, in seconds, from the answer's Date (None
    without one); to the second, as the header is."""
    return _offset(response.getheader("date"), time.time())


def _offset(date: str | None, at: float) -> float | None:
    """The clock of a Date header, received at time.time() `at`, minus this machine's."""
    if date is None:
        return None
    try:
        moment = parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp() - at


def _retry_after(response: http.client.HTTPResponse) -> float | None:
    """Retry-After in seconds (its date form is not used by S3 stores), up to BUSY_WAIT_MAX_S."""
    value = (response.getheader("retry-after") or "").strip()
    if not value.isdigit():
        return None
    return min(float(value), BUSY_WAIT_MAX_S)


class Bucket:
    """One bucket of an S3-compatible store; keys are relative to the bucket."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        credentials: Credentials | CredentialSource,
        *,
        region: str = "us-east-1",
        timeout: float = 10.0,
        ca_file: Path | None = None,
    ) -> None:
        url, self._root = endpoint_for(endpoint, region, bucket)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not http(s)://HOST[:PORT]")
        self.endpoint = url
        self.name = bucket
        self.timeout = timeout
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._host_header = parts.netloc.rpartition("@")[2]
        self._region = region
        self._source = credentials if isinstance(credentials, CredentialSource) else None
        fixed = credentials if isinstance(credentials, Credentials) else None
        self._signer: Signer | None = None if fixed is None else Signer(fixed, region)
        self._context = ssl.create_default_context(cafile=ca_file) if self._tls else None
        self._local = threading.local()
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._open_lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        config: Config,
        environ: Mapping[str, str] | None = None,
        *,
        credentials: CredentialSource | None = None,
    ) -> Bucket:
        """The bucket `config.remote` names, signed with the credentials `credentials` reads
        (by default a source of config and environ's): every call raises BucketAuthError while
        there are none, or they cannot be read (a file that is not 0600, ...). A CA bundle for
        a private TLS endpoint comes from AWS_CA_BUNDLE, as for AWS's own tools."""
        if not config.remote:
            raise ValueError("the remote setting is empty: there is no bucket")
        environ = os.environ if environ is None else environ
        bucket = config.remote.removeprefix("s3://").partition("/")[0]
        if credentials is None:
            credentials = CredentialSource(config.remote_credentials_file, environ)
        ca_bundle = environ.get("AWS_CA_BUNDLE")
        return cls(
            config.remote_endpoint,
            bucket,
            credentials,
            region=config.remote_region,
            timeout=config.remote_request_timeout,
            ca_file=Path(ca_bundle) if ca_bundle else None,
        )

    def __repr__(self) -> str:
        return f"Bucket({self.endpoint!r}, name={self.name!r})"

    # The calls.

    def head(self, key: str, *, deadline: float | None = None) -> int | None:
        """The object's size; None if there is none."""
        with self._call(deadline) as bound:
            response = self._request(bound, "HEAD", key)
            self._finish(response)  # a HEAD's answer has no body, so no error Code either
            if response.status == 404:
                return None
            if not 200 <= response.status < 300:
                raise _failure(f"HEAD {key}", response, "")
            size = _content_length(response)
            if size is None:
                raise BucketUnavailable(f"HEAD {key}: the answer has no Content-Length")
            return size

    def get(self, key: str, limit: int, *, deadline: float | None = None) -> bytes | None:
        """A small object whole; None if there is none; ObjectTooLarge past `limit` bytes."""
        with self._call(deadline) as bound:
            response = self._request(bound, "GET", key)
            if self._absent(response, f"GET {key}"):
                return None
            return self._read_all(bound, response, f"GET {key}", limit)

    def get_to_file(
        self, key: str, fd: int, limit: int, *, deadline: float | None = None
    ) -> int | None:
        """Streams the object into `fd` from offset 0 (pwrite) and returns its size; None if
        there is none; ObjectTooLarge past `limit` bytes (what was written stays: the
        caller's file is a staging file it deletes)."""
        with self._call(deadline) as bound:
            response = self._request(bound, "GET", key)
            if self._absent(response, f"GET {key}"):
                return None
            return self._read_body(
                bound,
                response,
                f"GET {key}",
                limit,
                lambda chunk, offset: _pwrite_all(fd, chunk, offset),
            )

    def put_if_absent(self, key: str, body: bytes, *, deadline: float | None = None) -> bool:
        """Creates the object unless the key exists (If-None-Match: *): False if it did."""
        payload = UNSIGNED_PAYLOAD if self._tls else hashlib.sha256(body).hexdigest()
        with self._call(deadline) as bound:
            response = self._request(
                bound, "PUT", key, headers={"if-none-match": "*"}, payload=payload, body=body
            )
            return self._created(response, f"PUT {key}")

    def put_file_if_absent(
        self, key: str, fd: int, size: int, *, deadline: float | None = None
    ) -> bool:
        """As put_if_absent, the body the first `size` bytes of `fd` (sent with sendfile over
        http; the fd's offset moves). ValueError if the file is shorter; the file's own read
        errors are OSErrors, not BucketErrors (sent through TLS, the bucket's and the file's
        cannot be told apart)."""
        if os.fstat(fd).st_size < size:
            raise ValueError(f"the file ended at {os.fstat(fd).st_size} of {size} bytes")
        payload = UNSIGNED_PAYLOAD if self._tls else _file_sha256(fd, size)
        with self._call(deadline) as bound:
            response = self._request(
                bound, "PUT", key, headers={"if-none-match": "*"}, payload=payload, file=(fd, size)
            )
            return self._created(response, f"PUT {key}")

    def delete(self, key: str, *, deadline: float | None = None) -> None:
        """Deletes the object (an absent one too)."""
        with self._call(deadline) as bound:
            response = self._request(bound, "DELETE", key)
            code = self._error_code(response)
        if not 200 <= response.status < 300 and (response.status, code) != (404, "NoSuchKey"):
            raise _failure(f"DELETE {key}", response, code)

    def list(
        self, prefix: str, limit: int, *, deadline: float | None = None
    ) -> list[tuple[str, int]]:
        """Up to `limit` (key, size) pairs of the objects whose key starts with `prefix`, in
        key order (every page within the one deadline)."""
        found: list[tuple[str, int]] = []
        token = ""
        with self._call(deadline) as bound:
            while len(found) < limit:
                query = {"list-type": "2", "prefix": prefix}
                query["max-keys"] = str(min(LIST_PAGE_KEYS, limit - len(found)))
                if token:
                    query["continuation-token"] = token
                what = f"LIST {prefix}"
                response = self._request(bound, "GET", None, query=query)
                self._check(response, what)
                page = self._read_all(bound, response, what, LIST_PAGE_LIMIT)
                entries, token = _parse_list(page, what)
                found.extend(entries[: limit - len(found)])
                if not (token and entries):  # an empty page that says more follow would loop
                    break
        return found

    @contextmanager
    def interruptible(self, interrupt: Interrupt) -> Iterator[None]:
        """The calls this thread makes within are ended by interrupt.interrupt() (from any
        thread) as by their deadline."""
        self._local.interrupt = interrupt
        try:
            yield
        finally:
            self._local.interrupt = None

    def close(self) -> None:
        """Closes every thread's connection (a later call opens a new one)."""
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            connection.close()

    def signed_with(self) -> tuple[Credentials, float] | None:
        """The credentials this thread's last request was signed with, and when
        (time.monotonic())."""
        signed: tuple[Credentials, float] | None = getattr(self._local, "signed_with", None)
        return signed

    def clock_offset(self) -> float | None:
        """The bucket's clock minus this machine's, in seconds, by the Date of the last answer
        this thread had (None: none, or without a Date)."""
        date: tuple[str | None, float] | None = getattr(self._local, "date", None)
        return None if date is None else _offset(*date)

    # The transport.

    def _signer_now(self) -> Signer:
        """The signer of the credentials as they are now (read again when due)."""
        signer = self._signer
        if self._source is not None:
            try:
                credentials = self._source.current()
            except CredentialsError as error:
                raise BucketAuthError(str(error)) from None
            if signer is None or signer.credentials is not credentials:
                signer = self._signer = Signer(credentials, self._region)
        assert signer is not None  # fixed credentials have their signer from the start
        self._local.signed_with = (signer.credentials, time.monotonic())
        return signer

    @contextmanager
    def _call(self, deadline: float | None) -> Iterator[Bound]:
        """One call's bound: until deadline (None: the request timeout from now), ended by
        the thread's Interrupt if it has one. Its socket is watched no more once it ends, so
        a later interrupt cannot shut down the connection the thread keeps for the next."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        bound = Bound.until(deadline, getattr(self._local, "interrupt", None))
        try:
            yield bound
        finally:
            bound.interrupt.watch(None)

    def _connection(self) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is None:
            if self._context is not None:
                connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.timeout, context=self._context
                )
            else:
                connection = http.client.HTTPConnection(
                    self._host, self._port, timeout=self.timeout
                )
            self._local.connection = connection
            with self._open_lock:
                self._open.add(connection)
        return connection

    def _request(
        self,
        bound: Bound,
        method: str,
        key: str | None,
        *,
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        payload: str = EMPTY_SHA256,
        body: bytes = b"",
        file: tuple[int, int] | None = None,
    ) -> http.client.HTTPResponse:
        """Sends one signed request and returns the response, its body unread. A connection
        kept from an earlier call that turns out closed by the bucket (its idle timeout, a
        restart) is replaced once; a conditional PUT sent twice that way answers 412 the
        second time if the first reached the bucket, which reads as "already there": true.
        Every step is within bound: its connect and sends by their socket timeout, the
        whole by the watchdog (bound's Interrupt shuts the socket down)."""
        path = uri_path(self._root + "/" + key) if key is not None else self._root or "/"
        query = query or {}
        signed = self._signer_now().headers(
            method,
            self._host_header,
            path,
            query=query,
            headers=headers or {},
            payload_hash=payload,
        )
        target = path + ("?" + canonical_query(query) if query else "")
        length = file[1] if file is not None else len(body)
        what = f"{method} {key if key is not None else '/'}"
        retry = True
        while True:
            connection = self._connection()
            reused = connection.sock is not None
            try:
                if connection.sock is None:
                    connection.timeout = bound.left()
                    connection.connect()
                else:
                    connection.sock.settimeout(bound.left())
                if not bound.interrupt.watch(connection.sock):
                    raise TimeoutError("interrupted")  # described by bound
                connection.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for name, value in signed.items():
                    connection.putheader(name, value)
                if method in ("PUT", "POST") or length:
                    connection.putheader("content-length", str(length))
                connection.endheaders()
                if file is not None:
                    _send_file(connection, *file)
                elif body:
                    connection.send(body)
                response = connection.getresponse()
                self._local.date = (response.getheader("date"), time.time())
                return response
            except (OSError, http.client.HTTPException) as error:  # TLS refusals are OSErrors
                connection.close()
                again = retry and reused and not bound.interrupt.interrupted
                if not again or isinstance(error, TimeoutError):
                    raise BucketUnavailable(f"{what}: {_describe(error, bound)}") from None
                retry = False
            except ValueError:  # the caller's file is shorter than it said
                connection.close()
                raise

    def _read_body(
        self,
        bound: Bound,
        response: http.client.HTTPResponse,
        what: str,
        limit: int,
        sink: Callable[[memoryview, int], object],
    ) -> int:
        """Reads the body into `sink(chunk, offset)`, never more than limit + 1 bytes; the
        size read. A body that ends before its Content-Length, or not by bound's deadline
        (the watchdog shut its socket: it looks ended), is the bucket failing; the sink's own
        errors (a full disk) are the caller's, raised as they are."""
        declared = _content_length(response)
        if declared is not None and declared > limit:
            self._drop(response)
            raise ObjectTooLarge(f"{what}: {declared} bytes, over the limit of {limit}")
        buffer = memoryview(bytearray(min(CHUNK, limit + 1)))
        total = 0
        while True:
            try:
                count = response.readinto(buffer[: min(len(buffer), limit + 1 - total)])
            except (OSError, http.client.HTTPException) as error:
                self._drop(response)
                raise BucketUnavailable(f"{what}: {_describe(error, bound)}") from None
            if not count:
                break
            if total + count > limit:
                self._drop(response)
                raise ObjectTooLarge(f"{what}: over the limit of {limit} bytes")
            try:
                sink(buffer[:count], total)
            except BaseException:
                self._drop(response)
                raise
            total += count
        if bound.interrupt.interrupted:
            self._drop(response)
            raise BucketUnavailable(f"{what}: {_describe(TimeoutError(), bound)}")
        if declared is not None and total != declared:
            self._drop(response)
            raise BucketUnavailable(f"{what}: the body ended at {total} of {declared} bytes")
        return total

    def _read_all(
        self, bound: Bound, response: http.client.HTTPResponse, what: str, limit: int
    ) -> bytes:
        body = bytearray()
        self._read_body(bound, response, what, limit, lambda chunk, _: body.extend(chunk))
        return bytes(body)

    def _drop(self, response: http.client.HTTPResponse) -> None:
        """Abandons a response whose body is not read whole: its connection cannot carry
        another request."""
        response.close()
        self._connection().close()

    def _finish(self, response: http.client.HTTPResponse) -> bytes:
        """Reads a body the caller does not stream (an error's XML, a PUT's answer) up to a
        small cap, so the connection can carry the next request; past the cap, or broken,
        the connection is dropped."""
        try:
            body = response.read(ERROR_BODY_LIMIT)
        except (OSError, http.client.HTTPException):
            body = b""
        if not response.isclosed():
            self._drop(response)
        return body

    def _error_code(self, response: http.client.HTTPResponse) -> str:
        """S3's error Code from an error response's XML ("" if none, as for a HEAD)."""
        match = _CODE.search(self._finish(response))
        return match.group(1).decode() if match else ""

    def _check(self, response: http.client.HTTPResponse, what: str) -> None:
        """Raises the BucketError a status other than 2xx means."""
        if not 200 <= response.status < 300:
            raise _failure(what, response, self._error_code(response))

    def _absent(self, response: http.client.HTTPResponse, what: str) -> bool:
        """True for a 404 that says the key is not there (not a bucket that is not)."""
        if response.status != 404:
            self._check(response, what)
            return False
        code = self._error_code(response)
        if code == "NoSuchBucket":
            raise _failure(what, response, code)
        return True

    def _created(self, response: http.client.HTTPResponse, what: str) -> bool:
        if response.status == 412:
            self._finish(response)
            return False
        self._check(response, what)
        self._finish(response)
        return True


def _content_length(response: http.client.HTTPResponse) -> int | None:
    value = response.getheader("content-length")
    return int(value) if value is not None and value.isdigit() else None


def _pwrite_all(fd: int, chunk: memoryview, offset: int) -> None:
    while chunk:
        written = os.pwrite(fd, chunk, offset)
        chunk = chunk[written:]
        offset += written


def _file_sha256(fd: int, size: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(CHUNK, size - offset), offset)
        if not chunk:
            raise ValueError(f"the file ended at {offset} of {size} bytes")
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _send_file(connection: http.client.HTTPConnection, fd: int, size: int) -> None:
    """The first `size` bytes of fd on the connection's socket (os.sendfile where the socket
    is plain; read and sent through TLS otherwise)."""
    sock: socket.socket | None = connection.sock
    if sock is None:
        raise ConnectionError("not connected")
    with os.fdopen(os.dup(fd), "rb", buffering=0) as file:
        sent = sock.sendfile(file, 0, size)
    if sent != size:
        raise ValueError(f"the file ended at {sent} of {size} bytes")


def _parse_list(page: bytes, what: str) -> tuple[list[tuple[str, int]], str]:
    """The (key, size) pairs of a ListObjectsV2 page and the token of the next ("" if last)."""
    try:
        root = ET.fromstring(page)
    except ET.ParseError:
        raise BucketUnavailable(f"{what}: the listing is not XML") from None
    entries = []
    token = ""
    truncated = False
    for element in root:
        tag = element.tag.rpartition("}")[2]
        if tag == "Contents":
            fields = {child.tag.rpartition("}")[2]: child.text or "" for child in element}
            size = fields.get("Size", "")
            if "Key" not in fields or not size.isdigit():
                raise BucketUnavailable(f"{what}: a listed object without key or size")
            entries.append((fields["Key"], int(size)))
        elif tag == "IsTruncated":
            truncated = (element.text or "").strip() == "true"
        elif tag == "NextContinuationToken":
            token = element.text or ""
    return entries, token if truncated else ""
