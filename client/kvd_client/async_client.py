"""The async client: the blocking client's API with await, on plain asyncio.

It drives the same calls (calls.py, prompt_cache.py) as Client; a put's tensor copies run in
a worker thread so the event loop keeps serving. A get's restore builds its MLX arrays on the
loop's thread (MLX work stays on the thread that runs the model), which waits while reader
threads fill them. Exchanges on one AsyncClient take turns (one request in flight at a
time): tasks that must not wait behind a long ticket wait or flush use a client of their own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from kvd_protocol.blocks import BLOCK_TOKENS
from kvd_protocol.entry import Checkpoint, LayerSpec, MetaValue
from kvd_protocol.errors import ProtocolError
from kvd_protocol.identity import Identity as WireIdentity
from kvd_protocol.messages import DropReport, EntrySummary, Reply

from . import calls
from .breaker import Breaker
from .calls import Call, Exchange
from .client import new_link
from .entry_io import TensorData
from .link import (
    DEFAULT_BACKOFF,
    DEFAULT_LOOKUP_TIMEOUT,
    Backoff,
    ClientStats,
    DaemonUnavailable,
    Link,
)
from .results import Evicted, LookupHit, LookupResultBase, PutOutcome, TicketBase, TicketState
from .transport import AsyncTransport, TransportClosed

if TYPE_CHECKING:
    from .identity import Identity
    from .prompt_cache import Restored

T = TypeVar("T")


class AsyncClient:
    """A connection to the kvd daemon, re-made as needed. Make one with
    `await AsyncClient.connect()`."""

    def __init__(self, link: Link, *, owns_breaker: bool = False) -> None:
        self._link = link
        self._transport: AsyncTransport | None = None
        self._lock = asyncio.Lock()
        self._owns_breaker = owns_breaker  # stopped when this client closes

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
        except DaemonUnavailable as exc:
            if require:
                raise
            link.failed(str(exc))
        return client

    def twin(self) -> AsyncClient:
        """As Client.twin."""
        return AsyncClient(self._link.twin())

    @property
    def connected(self) -> bool:
        return self._transport is not None

    @property
    def stats(self) -> ClientStats:
        return self._link.stats

    @property
    def socket_path(self) -> str:
        return self._link.socket_path

    @property
    def breaker(self) -> Breaker | None:
        return self._link.breaker

    async def close(self) -> None:
        if self._owns_breaker and self._link.breaker is not None:
            self._link.breaker.stop()
        async with self._lock:
            self._drop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- operations (see Client) ---

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed tokens of prefill in seconds: later puts tell the daemon what
        a token costs this engine, which the cost eviction policy weighs entries by."""
        self._link.measured_prefill(tokens, seconds)

    async def ping(self) -> float:
        return await self._run(calls.ping(self._link))

    async def status(self) -> dict[str, object]:
        return await self._run(calls.status(self._link))

    async def flush(self, timeout: float | None = None) -> bool:
        return await self._run(calls.flush(self._link, timeout))

    async def list_entries(
        self,
        identity: WireIdentity | str | None = None,
        *,
        after: str | None = None,
        limit: int | None = None,
    ) -> list[EntrySummary]:
        return await self._run(calls.list_entries(self._link, identity, after, limit))

    async def evict(
        self,
        entry: str | None = None,
        identity: WireIdentity | str | None = None,
        all: bool = False,  # the protocol's name for it
    ) -> Evicted:
        return await self._run(calls.evict(self._link, entry, identity, all))

    async def put_entry(
        self,
        identity: WireIdentity,
        tokens: bytes | Sequence[int],
        layers: Sequence[LayerSpec],
        tensors: Sequence[TensorData],
        *,
        min_reuse: int = 0,
        checkpoint: Checkpoint | None = None,
        meta: Mapping[str, MetaValue] | None = None,
        dropped: DropReport | None = None,
    ) -> AsyncTicket:
        call = calls.put_entry(
            self._link,
            identity,
            tokens,
            layers,
            tensors,
            created=time.time(),
            min_reuse=min_reuse,
            checkpoint=checkpoint,
            meta=meta,
            dropped=dropped,
        )
        return AsyncTicket(self, await self._run(call))

    async def lookup(
        self, identity: WireIdentity, tokens: bytes | Sequence[int], *, min_tokens: int = 0
    ) -> AsyncLookupResult | None:
        hit = await self._run(calls.lookup(self._link, identity, tokens, min_tokens))
        return None if hit is None else AsyncLookupResult(self, hit)

    async def find_checkpoint(
        self, identity: WireIdentity, key: str, prompt: bytes | Sequence[int]
    ) -> AsyncLookupResult | None:
        """The newest generation checkpoint under key whose tokens extend prompt, or None."""
        hit = await self._run(calls.find_checkpoint(self._link, identity, key, prompt))
        return None if hit is None else AsyncLookupResult(self, hit)

    async def forget_checkpoint(self, identity: WireIdentity, key: str) -> int:
        """Drop the checkpoints of a finished generation; how many went."""
        return await self._run(calls.forget_checkpoint(self._link, identity, key))

    async def put(
        self,
        identity: Identity,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        meta: Mapping[str, MetaValue] | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> AsyncTicket:
        """As Client.put."""
        from . import prompt_cache  # noqa: PLC0415 - mlx-lm is needed here only

        call = prompt_cache.put(
            self._link,
            identity,
            tokens,
            cache,
            created=time.time(),
            meta=meta,
            checkpoint=checkpoint,
        )
        return AsyncTicket(self, await self._run(call))

    async def get(
        self,
        identity: Identity,
        tokens: Sequence[int],
        *,
        model: Any = None,
        min_tokens: int = 0,
    ) -> Restored | None:
        """As Client.get."""
        from . import prompt_cache  # noqa: PLC0415

        return await self._run(
            prompt_cache.get(self._link, identity, tokens, model=model, min_tokens=min_tokens)
        )

    async def get_checkpoint(
        self, identity: Identity, key: str, prompt: Sequence[int], *, model: Any = None
    ) -> Restored | None:
        """As Client.get_checkpoint."""
        from . import prompt_cache  # noqa: PLC0415

        call = prompt_cache.get_checkpoint(self._link, identity, key, prompt, model=model)
        return await self._run(call)

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
                    else:
                        result = await asyncio.to_thread(step.work)
                except Exception as exc:
                    error = exc
        finally:
            call.close()

    async def _exchange(self, step: Exchange) -> Reply:
        """As Client._exchange."""
        link = self._link
        try:
            async with asyncio.timeout(None if step.by is None else calls.left(step.by)):
                await self._lock.acquire()
        except TimeoutError:
            raise DaemonUnavailable(
                f"{step.request.op}: the connection stayed busy past its due"
            ) from None
        try:
            fresh = calls.must_connect(link, step, connected=self._transport is not None)
            try:
                return await self._exchange_locked(step, fresh=fresh)
            except DaemonUnavailable as exc:
                link.failed(str(exc))
                raise
        finally:
            self._lock.release()

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
        except (OSError, ProtocolError, DaemonUnavailable) as exc:
            self._drop()
            link.connect_failed(now)
            raise DaemonUnavailable(f"cannot connect to {link.socket_path}: {exc}") from exc
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

    def _drop(self) -> None:
        for fd in self._link.drop():
            os.close(fd)
        if self._transport is not None:
            self._transport.close()
            self._transport = None


class AsyncTicket(TicketBase):
    """As Ticket, with an awaitable wait()."""

    def __init__(self, client: AsyncClient, outcome: PutOutcome) -> None:
        super().__init__(outcome)
        self._client = client

    async def wait(self, timeout: float | None = None) -> TicketState:
        call = calls.wait_ticket(self._client._link, self, timeout)
        self._state = await self._client._run(call)
        return self._state


class AsyncLookupResult(LookupResultBase):
    """As LookupResult, with an awaitable release() and `async with`."""

    def __init__(self, client: AsyncClient, hit: LookupHit) -> None:
        super().__init__(hit)
        self._client = client

    async def release(self) -> None:
        hit = self._close()
        if hit is not None:
            call = calls.release_lease(self._client._link, hit.lease, hit.epoch)
            await self._client._run(call)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()
