"""The API of Client and AsyncClient, written once: every operation, property and result.

Each operation is a method returning the call it runs (calls.py, prompt_cache.py), made a
method of both clients by @operation (operations.py): Client's returns the result,
AsyncClient's a coroutine of it. Tickets and lookup results are written the same way. The
clients add only what differs by nature: their I/O loop (_run), connect, close and with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from kvd_protocol.entry import Checkpoint, LayerSpec, MetaValue
from kvd_protocol.identity import Identity
from kvd_protocol.messages import BLOCKS_FEATURE, DropReport, EntrySummary, Retention

from . import calls, put_calls
from .breaker import Breaker
from .calls import Call
from .entry_io import TensorData
from .link import ClientStats, Link
from .operations import operation
from .results import (
    Evicted,
    LookupHit,
    LookupResultBase,
    Presence,
    PutOutcome,
    TicketBase,
    TicketState,
)

if TYPE_CHECKING:
    from .identity import EngineIdentity
    from .prompt_cache import Restored


class TicketApi(TicketBase):
    """Ticket and AsyncTicket, written once."""

    def __init__(self, client: ClientApi[Any, Any], outcome: PutOutcome) -> None:
        super().__init__(outcome)
        self._link = client._link

    @operation
    def wait(self, timeout: float | None = None) -> Call[TicketState]:
        """The state once settled, or after timeout seconds (None: until settled)."""
        self._state = yield from calls.wait_ticket(self._link, self, timeout)
        return self._state


class LookupResultApi(LookupResultBase):
    """LookupResult and AsyncLookupResult, written once."""

    def __init__(self, client: ClientApi[Any, Any], hit: LookupHit) -> None:
        super().__init__(hit)
        self._link = client._link

    @operation
    def release(self) -> Call[None]:
        """Close the file (and its mapping), and end the lease (once)."""
        hit = self._close()
        if hit is not None:
            yield from calls.release_lease(self._link, hit.lease, hit.epoch)


TicketT = TypeVar("TicketT", bound=TicketApi)
LookupResultT = TypeVar("LookupResultT", bound=LookupResultApi)


class Closes(Protocol):
    def close(self) -> None: ...


class ClientApi(Generic[TicketT, LookupResultT]):
    """Client and AsyncClient, written once: all but their I/O."""

    _ticket_type: type[TicketT]  # what puts return
    _lookup_result_type: type[LookupResultT]  # what lookups return
    _transport: Closes | None

    def __init__(self, link: Link, *, owns_breaker: bool = False) -> None:
        self._link = link
        self._transport = None
        self._owns_breaker = owns_breaker  # stopped when this client closes

    def twin(self) -> Self:
        """A client of the same daemon with the same settings on a connection of its own
        (made on its first call), sharing this one's breaker: an exchange on one never waits
        for the other's. Close it apart; its stats are its own."""
        return type(self)(self._link.twin())

    @property
    def connected(self) -> bool:
        return self._transport is not None

    @property
    def stats(self) -> ClientStats:
        return self._link.stats

    @property
    def socket_path(self) -> str:
        return self._link.socket_path

    def scoped(self, identity: Identity) -> Identity:
        """identity as the daemon last connected to knows it: its namespace under this
        client's tenant (its digest is the one the daemon's status lists)."""
        return self._link.scope(identity)

    @property
    def breaker(self) -> Breaker | None:
        return self._link.breaker

    @property
    def block_tokens(self) -> int:
        """The tokens per block of this client's puts against the daemon last connected to:
        0 when they are whole entries (blocks off, not offered, or no daemon answered yet)."""
        link = self._link
        return link.block_tokens if link.offers(BLOCKS_FEATURE) else 0

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed tokens of prefill in seconds: later puts tell the daemon what
        a token costs this engine, which the cost eviction policy weighs entries by."""
        self._link.measured_prefill(tokens, seconds)

    # --- operations ---

    @operation
    def ping(self) -> Call[float]:
        """The round trip of a ping, in seconds; raises DaemonUnavailableError."""
        return calls.ping(self._link)

    @operation
    def status(self) -> Call[dict[str, object]]:
        """The daemon's status: what `kvctl status --json` prints."""
        return calls.status(self._link)

    @operation
    def flush(self, timeout: float | None = None) -> Call[bool]:
        """Wait until everything accepted so far is durable (at most timeout seconds);
        whether it is."""
        return calls.flush(self._link, timeout)

    @operation
    def list_entries(
        self,
        identity: Identity | str | None = None,
        *,
        after: str | None = None,
        limit: int | None = None,
    ) -> Call[list[EntrySummary]]:
        """Stored entries, of one identity (or its digest) or all, after an entry id."""
        return calls.list_entries(self._link, identity, after, limit)

    @operation
    def evict(
        self,
        entry: str | None = None,
        identity: Identity | str | None = None,
        all: bool = False,  # the protocol's name for it
    ) -> Call[Evicted]:
        """Delete one entry, every entry of one identity (or its digest), or all of them;
        what went."""
        return calls.evict(self._link, entry, identity, all)

    @operation
    def put_entry(
        self,
        identity: Identity,
        tokens: bytes | Sequence[int],
        layers: Sequence[LayerSpec],
        tensors: Sequence[TensorData],
        *,
        min_reuse: int = 0,
        checkpoint: Checkpoint | None = None,
        meta: Mapping[str, MetaValue] | None = None,
        dropped: DropReport | None = None,
        retention: Retention | None = None,
    ) -> Call[TicketT]:
        """Hand an entry to the daemon: one copy of each tensor into the staging file.
        dropped: snapshots of this identity the engine dropped since it last told, told with
        the commit to a daemon that offers "engine_drops" (a ticket with an id: committed).
        retention: keep the entry (or the one held that it duplicates) before unretained
        ones this long, each use renewing it (a daemon that offers "retention")."""
        outcome = yield from put_calls.put_entry(
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
            retention=retention,
        )
        return self._ticket_type(self, outcome)

    @operation
    def lookup(
        self, identity: Identity, tokens: bytes | Sequence[int], *, min_tokens: int = 0
    ) -> Call[LookupResultT | None]:
        """The longest usable cached prefix of tokens, or None (also below min_tokens)."""
        hit = yield from calls.lookup(self._link, identity, tokens, min_tokens)
        return None if hit is None else self._lookup_result_type(self, hit)

    @operation
    def presence(
        self, identity: Identity | EngineIdentity, tokens: bytes | Sequence[int]
    ) -> Call[Presence]:
        """How many tokens of the prompt the daemon would restore now, how many more its
        remote tier holds, and why each stops there; restores nothing and counts no hit or
        miss. Raises DaemonUnavailableError, or DaemonError from a daemon without it."""
        named = identity if isinstance(identity, Identity) else identity.to_protocol()
        return calls.presence(self._link, named, tokens)

    @operation
    def find_checkpoint(
        self, identity: Identity, key: str, prompt: bytes | Sequence[int]
    ) -> Call[LookupResultT | None]:
        """The newest generation checkpoint under key whose tokens extend prompt, or None."""
        hit = yield from calls.find_checkpoint(self._link, identity, key, prompt)
        return None if hit is None else self._lookup_result_type(self, hit)

    @operation
    def forget_checkpoint(self, identity: Identity, key: str) -> Call[int]:
        """Drop the checkpoints of a finished generation; how many went."""
        return calls.forget_checkpoint(self._link, identity, key)

    @operation
    def put(
        self,
        identity: EngineIdentity,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        meta: Mapping[str, MetaValue] | None = None,
        checkpoint: Checkpoint | None = None,
        retention: Retention | None = None,
    ) -> Call[TicketT]:
        """Snapshot a list of mlx-lm caches as they are and put them (prompt_cache.py);
        retention as put_entry's."""
        from . import prompt_cache  # noqa: PLC0415 - mlx-lm is needed here only

        outcome = yield from prompt_cache.put(
            self._link,
            identity,
            tokens,
            cache,
            created=time.time(),
            meta=meta,
            checkpoint=checkpoint,
            retention=retention,
        )
        return self._ticket_type(self, outcome)

    @operation
    def get(
        self,
        identity: EngineIdentity,
        tokens: Sequence[int],
        *,
        model: Any = None,
        min_tokens: int = 0,
    ) -> Call[Restored | None]:
        """The mlx-lm caches of the longest usable prefix of tokens, or None, also when it is
        shorter than min_tokens (prompt_cache.py)."""
        from . import prompt_cache  # noqa: PLC0415

        return prompt_cache.get(self._link, identity, tokens, model=model, min_tokens=min_tokens)

    @operation
    def get_checkpoint(
        self, identity: EngineIdentity, key: str, prompt: Sequence[int], *, model: Any = None
    ) -> Call[Restored | None]:
        """The caches of the newest generation checkpoint under key that extends prompt,
        with Restored.checkpoint saying where the generation stands; or None."""
        from . import prompt_cache  # noqa: PLC0415

        return prompt_cache.get_checkpoint(self._link, identity, key, prompt, model=model)

    # --- shared by both I/O loops ---

    def _drop(self) -> None:
        for fd in self._link.drop():
            os.close(fd)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
