"""The blocking client: the API of api.py, its calls driven over a blocking Unix socket.

Put and lookup never raise into the engine when the daemon is absent, slow or restarting;
see api.py and calls.py for what each operation does. Thread-safe: one exchange at a time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from functools import partial
from types import TracebackType
from typing import Self, TypeVar

from kvd_protocol.blocks import BLOCK_TOKENS
from kvd_protocol.errors import DaemonUnavailableError, ProtocolError
from kvd_protocol.messages import Reply

from . import calls
from .api import ClientApi, LookupResultApi, TicketApi
from .breaker import Breaker
from .calls import Call, Exchange, Send
from .link import (
    DEFAULT_BACKOFF,
    DEFAULT_LOOKUP_TIMEOUT,
    Backoff,
    Link,
    default_client_name,
    default_socket_path,
)
from .operations import BlockingRunner
from .results import LookupHit, PutOutcome
from .transport import BlockingTransport, TransportClosed

T = TypeVar("T")
# Seconds an exchange may run past its timeout rather than set the socket's timeout anew
# (two system calls, and two more to set it back) before a read: the time its send took, when
# that was this short. A loaded machine's scheduler alone can hold a send for a millisecond.
TIMEOUT_SLACK = 0.01


class Ticket(TicketApi, BlockingRunner):
    """The daemon's word on a put: wait() until it is stored, dropped or failed."""

    def __init__(self, client: Client, outcome: PutOutcome) -> None:
        super().__init__(client, outcome)
        self._run = client._run


class LookupResult(LookupResultApi, BlockingRunner):
    """A looked-up entry, mapped read-only. release() it, or use it in a with block."""

    def __init__(self, client: Client, hit: LookupHit) -> None:
        super().__init__(client, hit)
        self._run = client._run

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Client(ClientApi[Ticket, LookupResult], BlockingRunner):
    """A connection to the kvd daemon, re-made as needed. Make one with Client.connect()."""

    _ticket_type = Ticket
    _lookup_result_type = LookupResult
    _transport: BlockingTransport | None

    def __init__(self, link: Link, *, owns_breaker: bool = False) -> None:
        super().__init__(link, owns_breaker=owns_breaker)
        self._lock = threading.RLock()

    @classmethod
    def connect(
        cls,
        socket_path: str | None = None,
        timeout: float = 5.0,
        name: str | None = None,
        *,
        require: bool = False,
        backoff: Backoff = DEFAULT_BACKOFF,
        verify: bool = True,
        block_tokens: int = BLOCK_TOKENS,
        lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT,
        breaker: bool = True,
    ) -> Client:
        """Connect and say hello. A daemon that is down gives a client that is not connected
        (and retries on later calls), unless require: then DaemonUnavailableError is raised.
        timeout: seconds an exchange may take (puts, operator calls) before the daemon counts
        as unavailable.
        verify: get() checks every tensor against its checksum as it copies it (the default;
        a mismatch is a miss, and the daemon is told to quarantine the entry).
        block_tokens: against a daemon that offers blocks, puts store plain and quantized KV
        in blocks of this many tokens (a power of two in 16..65536), each shared by every
        entry of the same model with the same tokens up to it; 0: whole entries (version 1).
        lookup_timeout: seconds a lookup (or get) may wait for the daemon, connecting
        included, before it is a miss; and each exchange of a restore after its hit.
        breaker: once a call finds the daemon unavailable, lookups and puts skip it until a
        probe in the background finds it answering (breaker.py); False: every call tries."""
        link = new_link(
            socket_path,
            timeout,
            name,
            backoff,
            verify=verify,
            block_tokens=block_tokens,
            lookup_timeout=lookup_timeout,
            breaker=breaker,
        )
        client = cls(link, owns_breaker=True)
        try:
            with client._lock:
                client._connect(force=True)
        except DaemonUnavailableError as exc:
            if require:
                raise
            link.failed(str(exc))
        return client

    def close(self) -> None:
        """Close the connection; a client made by connect() also stops its breaker's probe."""
        if self._owns_breaker and self._link.breaker is not None:
            self._link.breaker.stop()
        with self._lock:
            self._hear_replies_due()
            self._drop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- driving calls ---

    def _run(self, call: Call[T]) -> T:
        result: object = None
        error: Exception | None = None
        try:
            while True:
                try:
                    step = call.send(result) if error is None else call.throw(error)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                result, error = None, None
                try:
                    if isinstance(step, Exchange):
                        result = self._exchange(step)
                    elif isinstance(step, Send):
                        self._send(step)
                    else:
                        result = step.work()
                except Exception as exc:
                    error = exc
        finally:
            call.close()

    def _exchange(self, step: Exchange) -> Reply:
        """The reply to step's request, over the current connection or a new one; once more
        on a new one when calls.broken says so. An exchange due by a time waits for the
        connection no longer than that (another thread's exchange may hold it)."""
        with self._holding(step):
            fresh = calls.must_connect(self._link, step, connected=self._transport is not None)
            try:
                return self._exchange_locked(step, fresh=fresh)
            except DaemonUnavailableError as exc:
                self._link.failed(str(exc))
                raise

    def _send(self, step: Send) -> None:
        """Send step's request on its connection, its reply left to the next reader; a send
        that fails drops the connection (and the daemon ends its leases)."""
        with self._holding(step):
            calls.must_connect(self._link, step, connected=self._transport is not None)
            assert self._transport is not None
            frame = self._link.send_unawaited(step.request)
            try:
                self._transport.send(frame)
            except OSError as exc:
                self._drop()
                raise DaemonUnavailableError(f"{step.request.op}: {exc}") from exc

    @contextlib.contextmanager
    def _holding(self, step: Exchange | Send) -> Iterator[None]:
        """The connection held for step: waits no longer than its due."""
        if not self._lock.acquire(timeout=-1 if step.by is None else calls.left(step.by)):
            raise DaemonUnavailableError(
                f"{step.request.op}: the connection stayed busy past its due"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _hear_replies_due(self) -> None:
        """Read the replies still due to requests sent unawaited (a get's release), within the
        lookup timeout, so that what they asked is done once close returns; a connection that
        fails or stays silent is closed all the same."""
        link, transport = self._link, self._transport
        if transport is None or not link.replies_due:
            return
        due = time.monotonic() + link.lookup_timeout  # for all of them, as AsyncClient's
        with contextlib.suppress(OSError, ProtocolError):
            while link.replies_due:
                if link.next_reply() is None and link.replies_due:
                    transport.settimeout(calls.left(due))
                    link.receive(*transport.receive())

    def _exchange_locked(self, step: Exchange, *, fresh: bool) -> Reply:
        link = self._link
        if fresh:  # a connection made for this exchange
            self._connect(by=step.by)
        while True:
            frame = link.send(step.request)
            try:
                return self._round_trip(frame, link.deadline(step.wait, step.by, time.monotonic()))
            except BaseException as exc:
                self._drop()  # whatever broke the exchange, the stream is out of step
                failure = calls.broken(step, exc, fresh=fresh)
                if failure is not None:
                    raise failure from exc
            fresh = True
            self._connect(by=step.by)

    def _connect(self, *, force: bool = False, by: float | None = None) -> None:
        link = self._link
        now = time.monotonic()
        hello = link.begin_connect(now, force=force)
        try:
            self._transport = BlockingTransport.connect(
                link.socket_path, link.connect_timeout(by, now)
            )
            timeout = link.connect_timeout(by, time.monotonic())
            link.connected(self._round_trip(hello, timeout, hello=True))
        except (OSError, ProtocolError, DaemonUnavailableError) as exc:
            self._drop()
            link.connect_failed(now)
            raise DaemonUnavailableError(f"cannot connect to {link.socket_path}: {exc}") from exc

    def _round_trip(self, frame: bytes, timeout: float | None, *, hello: bool = False) -> Reply:
        """The reply to frame. hello: the connection's first frame; a daemon that turns the
        connection away may close it before the hello arrives, and its reason is read all the
        same."""
        assert self._transport is not None
        transport, link = self._transport, self._link
        started = time.monotonic()
        if not _near(timeout, transport.timeout):
            transport.settimeout(timeout)
        try:
            transport.send(frame)
        except TransportClosed:
            if not hello:
                raise
        while (reply := link.next_reply()) is None:
            if timeout is not None:
                left = started + timeout - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no reply in time")
                if left < timeout - TIMEOUT_SLACK:  # else the socket's timeout stays, unchanged
                    transport.settimeout(left)
            link.receive(*transport.receive())
        link.last_round_trip = time.monotonic() - started
        return reply


def _near(timeout: float | None, current: float | None) -> bool:
    """Whether a socket timed out after current seconds serves an exchange due in timeout: the
    same, or within TIMEOUT_SLACK (an exchange due by a time has a new timeout each time)."""
    if timeout is None or current is None:
        return timeout is current
    return abs(timeout - current) <= TIMEOUT_SLACK


def new_link(
    socket_path: str | None,
    timeout: float,
    name: str | None,
    backoff: Backoff,
    *,
    verify: bool,
    block_tokens: int,
    lookup_timeout: float,
    breaker: bool,
) -> Link:
    """The link of a new Client or AsyncClient (see Client.connect): defaults filled in, and
    with breaker, one whose probe pings on a blocking client of its own."""
    path = socket_path or default_socket_path()
    probe = partial(_answers, path, timeout)
    return Link(
        path,
        timeout,
        name or default_client_name(),
        backoff,
        verify=verify,
        block_tokens=block_tokens,
        lookup_timeout=lookup_timeout,
        breaker=Breaker(path, probe, backoff.initial, backoff.maximum) if breaker else None,
    )


def _answers(socket_path: str, timeout: float) -> None:
    """A breaker's probe: a ping on a connection of its own; raises unless answered."""
    with Client.connect(socket_path, timeout, "kvd-probe", require=True, breaker=False) as probe:
        probe.ping()
