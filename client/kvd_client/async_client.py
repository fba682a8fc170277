"""The async client: the API of api.py with await, its calls driven on plain asyncio.

It drives the same calls (calls.py, prompt_cache.py) as Client; a put's tensor copies run in
a worker thread so the event loop keeps serving. A get's restore builds its MLX arrays on the
loop's thread (MLX work stays on the thread that runs the model), which waits while reader
threads fill them. Exchanges on one AsyncClient take turns (one request awaited at a
time): tasks that must not wait behind a long ticket wait or flush use a client of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self, TypeVar

from kvd_protocol.blocks import BLOCK_TOKENS
from kvd_protocol.errors import DaemonUnavailableError, ProtocolError
from kvd_protocol.messages import Reply

from . import calls
from .api import ClientApi, LookupResultApi, TicketApi
from .calls import Call, Exchange, Send
from .client import new_link
from .link import DEFAULT_BACKOFF, DEFAULT_LOOKUP_TIMEOUT, Backoff, Link
from .operations import AsyncRunner
from .results import LookupHit, PutOutcome
from .transport import AsyncTransport, TransportClosed

T = TypeVar("T")


class AsyncTicket(TicketApi, AsyncRunner):
    """As Ticket, with an awaitable wait()."""

    def __init__(self, client: AsyncClient, outcome: PutOutcome) -> None:
        super().__init__(client, outcome)
        self._run = client._run


class AsyncLookupResult(LookupResultApi, AsyncRunner):
    """As LookupResult, with an awaitable release() and `async with`."""

    def __init__(self, client: AsyncClient, hit: LookupHit) -> None:
        super().__init__(client, hit)
        self._run = client._run

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()


class AsyncClient(ClientApi[AsyncTicket, AsyncLookupResult], AsyncRunner):
    """A connection to the kvd daemon, re-made as needed. Make one with
    `await AsyncClient.connect()`."""

    _ticket_type = AsyncTicket
    _lookup_result_type = AsyncLookupResult
    _transport: AsyncTransport | None

    def __init__(self, link: Link, *, owns_breaker: bool = False) -> None:
        super().__init__(link, owns_breaker=owns_breaker)
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(
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
    ) -> AsyncClient:
        """As Client.connect; the breaker's probe runs on a thread of its own."""
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
            async with client._lock:
                await client._connect(force=True)
        except DaemonUnavailableError as exc:
            if require:
                raise
            link.failed(str(exc))
        return client

    async def close(self) -> None:
        """As Client.close."""
        if self._owns_breaker and self._link.breaker is not None:
            self._link.breaker.stop()
        async with self._lock:
            await self._hear_replies_due()
            self._drop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- driving calls ---

    async def _run(self, call: Call[T]) -> T:
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
                        result = await self._exchange(step)
                    elif isinstance(step, Send):
                        await self._send(step)
                    else:
                        result = await asyncio.to_thread(step.work)
                except Exception as exc:
                    error = exc
        finally:
            call.close()

    async def _exchange(self, step: Exchange) -> Reply:
        """As Client._exchange."""
        async with self._holding(step):
            fresh = calls.must_connect(self._link, step, connected=self._transport is not None)
            try:
                return await self._exchange_locked(step, fresh=fresh)
            except DaemonUnavailableError as exc:
                self._link.failed(str(exc))
                raise

    async def _send(self, step: Send) -> None:
        """As Client._send."""
        async with self._holding(step):
            calls.must_connect(self._link, step, connected=self._transport is not None)
            assert self._transport is not None
            frame = self._link.send_unawaited(step.request)
            try:
                await self._transport.send(frame)
            except OSError as exc:
                self._drop()
                raise DaemonUnavailableError(f"{step.request.op}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def _holding(self, step: Exchange | Send) -> AsyncIterator[None]:
        """As Client._holding."""
        try:
            async with asyncio.timeout(None if step.by is None else calls.left(step.by)):
                await self._lock.acquire()
        except TimeoutError:
            raise DaemonUnavailableError(
                f"{step.request.op}: the connection stayed busy past its due"
            ) from None
        try:
            yield
        finally:
            self._lock.release()

    async def _hear_replies_due(self) -> None:
        """As Client._hear_replies_due."""
        link, transport = self._link, self._transport
        if transport is None or not link.replies_due:
            return
        with contextlib.suppress(OSError, ProtocolError):
            async with asyncio.timeout(link.lookup_timeout):
                while link.replies_due:
                    if link.next_reply() is None and link.replies_due:
                        link.receive(*await transport.receive())

    async def _exchange_locked(self, step: Exchange, *, fresh: bool) -> Reply:
        link = self._link
        if fresh:  # a connection made for this exchange
            await self._connect(by=step.by)
        while True:
            frame = link.send(step.request)
            try:
                timeout = link.deadline(step.wait, step.by, time.monotonic())
                return await self._round_trip(frame, timeout)
            except BaseException as exc:
                self._drop()  # whatever broke the exchange, the stream is out of step
                failure = calls.broken(step, exc, fresh=fresh)
                if failure is not None:
                    raise failure from exc
            fresh = True
            await self._connect(by=step.by)

    async def _connect(self, *, force: bool = False, by: float | None = None) -> None:
        link = self._link
        now = time.monotonic()
        hello = link.begin_connect(now, force=force)
        try:
            async with asyncio.timeout(link.connect_timeout(by, now)):
                self._transport = await AsyncTransport.connect(link.socket_path)
            timeout = link.connect_timeout(by, time.monotonic())
            link.connected(await self._round_trip(hello, timeout, hello=True))
        except (OSError, ProtocolError, DaemonUnavailableError) as exc:
            self._drop()
            link.connect_failed(now)
            raise DaemonUnavailableError(f"cannot connect to {link.socket_path}: {exc}") from exc
        except BaseException:
            self._drop()
            raise

    async def _round_trip(
        self, frame: bytes, timeout: float | None, *, hello: bool = False
    ) -> Reply:
        """As Client._round_trip."""
        assert self._transport is not None
        transport, link = self._transport, self._link
        started = time.monotonic()
        async with asyncio.timeout(timeout):
            try:
                await transport.send(frame)
            except TransportClosed:
                if not hello:
                    raise
            while (reply := link.next_reply()) is None:
                link.receive(*await transport.receive())
        link.last_round_trip = time.monotonic() - started
        return reply
