"""The blocking client: drives the calls of calls.py over a blocking Unix socket.

Put and lookup never raise into the engine when the daemon is absent, slow or restarting;
see calls.py for what each operation does. Thread-safe: one exchange at a time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from kvd_protocol.blocks import BLOCK_TOKENS
from kvd_protocol.entry import Checkpoint, LayerSpec, MetaValue
from kvd_protocol.errors import ProtocolError
from kvd_protocol.identity import Identity as WireIdentity
from kvd_protocol.messages import BLOCKS_FEATURE, DropReport, EntrySummary, Reply

from . import calls
from .breaker import Breaker
from .calls import Call, Exchange
from .entry_io import TensorData
from .link import (
    DEFAULT_BACKOFF,
    DEFAULT_LOOKUP_TIMEOUT,
    Backoff,
    ClientStats,
    DaemonUnavailable,
    Link,
    default_client_name,
    default_socket_path,
)
from .results import Evicted, LookupHit, LookupResultBase, PutOutcome, TicketBase, TicketState
from .transport import BlockingTransport, TransportClosed

if TYPE_CHECKING:
    from .identity import Identity
    from .prompt_cache import Restored

T = TypeVar("T")
# Seconds an exchange may run past its timeout rather than set the socket's timeout anew
# (two system calls, and two more to set it back) before a read: the time its send took, when
# that was this short. A loaded machine's scheduler alone can hold a send for a millisecond.
TIMEOUT_SLACK = 0.01


class Client:
    """A connection to the kvd daemon, re-made as needed. Make one with Client.connect()."""

    def __init__(self, link: Link, *, owns_breaker: bool = False) -> None:
        self._link = link
        self._transport: BlockingTransport | None = None
        self._lock = threading.RLock()
        self._owns_breaker = owns_breaker  # stopped when this client closes

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
        (and retries on later calls), unless require: then DaemonUnavailable is raised.
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
        except DaemonUnavailable as exc:
            if require:
                raise
            link.failed(str(exc))
        return client

    def twin(self) -> Client:
        """A client of the same daemon with the same settings on a connection of its own
        (made on its first call), sharing this one's breaker: an exchange on one never waits
        for the other's. Close it apart; its stats are its own."""
        return Client(self._link.twin())

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

    @property
    def block_tokens(self) -> int:
        """The tokens per block of this client's puts against the daemon last connected to:
        0 when they are whole entries (blocks off, not offered, or no daemon answered yet)."""
        link = self._link
        return link.block_tokens if link.offers(BLOCKS_FEATURE) else 0

    def close(self) -> None:
        if self._owns_breaker and self._link.breaker is not None:
            self._link.breaker.stop()
        with self._lock:
            self._drop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- operations ---

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed tokens of prefill in seconds: later puts tell the daemon what
        a token costs this engine, which the cost eviction policy weighs entries by."""
        self._link.measured_prefill(tokens, seconds)

    def ping(self) -> float:
        """The round trip of a ping, in seconds; raises DaemonUnavailable."""
        return self._run(calls.ping(self._link))

    def status(self) -> dict[str, object]:
        return self._run(calls.status(self._link))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything accepted so far is durable (at most timeout seconds);
        whether it is."""
        return self._run(calls.flush(self._link, timeout))

    def list_entries(
        self,
        identity: WireIdentity | str | None = None,
        *,
        after: str | None = None,
        limit: int | None = None,
    ) -> list[EntrySummary]:
        """Stored entries, of one identity (or its digest) or all, after an entry id."""
        return self._run(calls.list_entries(self._link, identity, after, limit))

    def evict(
        self,
        entry: str | None = None,
        identity: WireIdentity | str | None = None,
        all: bool = False,  # the protocol's name for it
    ) -> Evicted:
        return self._run(calls.evict(self._link, entry, identity, all))

    def put_entry(
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
    ) -> Ticket:
        """Hand an entry to the daemon: one copy of each tensor into the staging file.
        dropped: snapshots of this identity the engine dropped since it last told, told with
        the commit to a daemon that offers "engine_drops" (a ticket with an id: committed)."""
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
        return Ticket(self, self._run(call))

    def lookup(
        self, identity: WireIdentity, tokens: bytes | Sequence[int], *, min_tokens: int = 0
    ) -> LookupResult | None:
        """The longest usable cached prefix of tokens, or None (also below min_tokens)."""
        hit = self._run(calls.lookup(self._link, identity, tokens, min_tokens))
        return None if hit is None else LookupResult(self, hit)

    def find_checkpoint(
        self, identity: WireIdentity, key: str, prompt: bytes | Sequence[int]
    ) -> LookupResult | None:
        """The newest generation checkpoint under key whose tokens extend prompt, or None."""
        hit = self._run(calls.find_checkpoint(self._link, identity, key, prompt))
        return None if hit is None else LookupResult(self, hit)

    def forget_checkpoint(self, identity: WireIdentity, key: str) -> int:
        """Drop the checkpoints of a finished generation; how many went."""
        return self._run(calls.forget_checkpoint(self._link, identity, key))

    def put(
        self,
        identity: Identity,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        meta: Mapping[str, MetaValue] | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> Ticket:
        """Snapshot a list of mlx-lm caches as they are and put them (prompt_cache.py)."""
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
        return Ticket(self, self._run(call))

    def get(
        self,
        identity: Identity,
        tokens: Sequence[int],
        *,
        model: Any = None,
        min_tokens: int = 0,
    ) -> Restored | None:
        """The mlx-lm caches of the longest usable prefix of tokens, or None, also when it is
        shorter than min_tokens (prompt_cache.py)."""
        from . import prompt_cache  # noqa: PLC0415

        return self._run(
            prompt_cache.get(self._link, identity, tokens, model=model, min_tokens=min_tokens)
        )

    def get_checkpoint(
        self, identity: Identity, key: str, prompt: Sequence[int], *, model: Any = None
    ) -> Restored | None:
        """The caches of the newest generation checkpoint under key that extends prompt,
        with Restored.checkpoint saying where the generation stands; or None."""
        from . import prompt_cache  # noqa: PLC0415

        return self._run(
            prompt_cache.get_checkpoint(self._link, identity, key, prompt, model=model)
        )

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
                    result = self._exchange(step) if isinstance(step, Exchange) else step.work()
                except Exception as exc:
                    error = exc
        finally:
            call.close()

    def _exchange(self, step: Exchange) -> Reply:
        """The reply to step's request, over the current connection or a new one; once more
        on a new one when calls.broken says so. An exchange due by a time waits for the
        connection no longer than that (another thread's exchange may hold it)."""
        link = self._link
        if not self._lock.acquire(timeout=-1 if step.by is None else calls.left(step.by)):
            raise DaemonUnavailable(f"{step.request.op}: the connection stayed busy past its due")
        try:
            fresh = calls.must_connect(link, step, connected=self._transport is not None)
            try:
                return self._exchange_locked(step, fresh=fresh)
            except DaemonUnavailable as exc:
                link.failed(str(exc))
                raise
        finally:
            self._lock.release()

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
        except (OSError, ProtocolError, DaemonUnavailable) as exc:
            self._drop()
            link.connect_failed(now)
            raise DaemonUnavailable(f"cannot connect to {link.socket_path}: {exc}") from exc

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

    def _drop(self) -> None:
        for fd in self._link.drop():
            os.close(fd)
        if self._transport is not None:
            self._transport.close()
            self._transport = None


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


class Ticket(TicketBase):
    """The daemon's word on a put: wait() until it is stored, dropped or failed."""

    def __init__(self, client: Client, outcome: PutOutcome) -> None:
        super().__init__(outcome)
        self._client = client

    def wait(self, timeout: float | None = None) -> TicketState:
        """The state once settled, or after timeout seconds (None: until settled)."""
        self._state = self._client._run(calls.wait_ticket(self._client._link, self, timeout))
        return self._state


class LookupResult(LookupResultBase):
    """A looked-up entry, mapped read-only. release() it, or use it in a with block."""

    def __init__(self, client: Client, hit: LookupHit) -> None:
        super().__init__(hit)
        self._client = client

    def release(self) -> None:
        """Close the file (and its mapping), and end the lease (once)."""
        hit = self._close()
        if hit is not None:
            self._client._run(calls.release_lease(self._client._link, hit.lease, hit.epoch))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
