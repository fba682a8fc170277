"""A client's protocol state across connections (Link), free of I/O, and the errors it raises.

Link keeps what the blocking and the async client share between calls: request ids, the
current Connection and the daemon's hello (limits, tenant, features), the reconnect backoff
and the client's counters (ClientStats). The drivers move the bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

from kvd_protocol.blocks import BLOCK_TOKENS, check_block_tokens
from kvd_protocol.connection import NEED_DATA, Connection, ConnectionClosed, Role
from kvd_protocol.errors import DaemonUnavailableError, ErrorCode, ProtocolError
from kvd_protocol.identity import Identity, older_traits
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.messages import (
    IDENTITY_SOURCE_FEATURE,
    IDENTITY_TRAITS_FEATURE,
    MAX_PREFILL_COST,
    PROTOCOL_VERSION,
    U32,
    ErrorReply,
    Hello,
    HelloReply,
    Reply,
    Request,
)
from kvd_protocol.paths import default_paths

from .breaker import Breaker

log = logging.getLogger("kvd_client")


class DaemonError(Exception):
    """The daemon refused a request with an error reply (or the request breaks its limits)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Backoff:
    """Delays between connect attempts while the daemon is down: doubling from initial up to
    maximum, so that a dead daemon costs a call a clock read, not a connect per call."""

    initial: float = 0.05
    maximum: float = 1.0


DEFAULT_BACKOFF: Final = Backoff()
# Seconds a lookup may take, connecting included, before it is a miss; and each exchange of a
# restore after its hit. An engine waits no longer on the daemon before computing the prefill.
DEFAULT_LOOKUP_TIMEOUT: Final = 0.1
MIN_WAIT: Final = 0.001  # seconds: an exchange due now still gets a system call's worth


@dataclass
class ClientStats:
    """One client's counters: connections, puts, lookups and the restores built on them."""

    connect_attempts: int = 0
    reconnects: int = 0  # successful connections after the first
    unavailable_puts: int = 0  # puts answered "unavailable": the daemon was down or slow
    failed_lookups: int = 0  # lookups turned into misses by an unavailable or refusing daemon
    rejected_entries: int = 0  # looked-up files that were damaged or did not match the ask
    restored: int = 0  # gets that rebuilt caches from an entry
    bytes_written: int = 0  # into the daemon's staging files: entries, manifests and blocks
    blocks_written: int = 0  # block files written by puts
    blocks_held: int = 0  # blocks puts did not write: the daemon held them already
    remote_fetches: int = 0  # lookups the daemon answered "fetching" from its remote tier
    # Lookups and gets that came back empty, by reason: "no entry", "unavailable", "refused",
    # "below min_tokens", "mismatch", a damaged file's validation rule ("truncated",
    # "header_checksum", "data_checksum", a block's "block_hash", "block_mismatch" or
    # "block_missing"... see FORMAT.md), "unreadable" (an I/O error), and the restore's own
    # ("codec", "model", "untrimmable", "load failed").
    misses: Counter[str] = field(default_factory=Counter)


def default_socket_path() -> str:
    """KVD_SOCKET if set, else the platform default (kvd_protocol.paths)."""
    configured = os.environ.get("KVD_SOCKET")
    if configured:
        return configured
    home = PurePosixPath(Path.home())
    return str(default_paths(sys.platform, home, os.environ, os.getuid()).socket)


def default_client_name() -> str:
    return (Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "") or "python"


MIN_MEASURED_PREFILL: Final = 64  # tokens


@dataclass
class _PrefillCost:
    seconds: float = 0.0  # per token


class Link:
    """One client's protocol state across connections, free of I/O: the drivers move bytes."""

    def __init__(
        self,
        socket_path: str,
        timeout: float,
        name: str,
        backoff: Backoff,
        *,
        verify: bool,
        block_tokens: int = BLOCK_TOKENS,
        lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT,
        breaker: Breaker | None = None,
    ) -> None:
        if not 0 < lookup_timeout < math.inf:
            raise ValueError(
                f"lookup_timeout must be a positive number of seconds, not {lookup_timeout}"
            )
        self.socket_path = socket_path
        self.timeout = timeout
        self.lookup_timeout = lookup_timeout
        # Skips the daemon after a failure until it answers again; None: every call tries.
        self.breaker = breaker
        self.name = name
        self.backoff = backoff
        self.verify = verify  # restores check every tensor against its checksum
        # Puts cut blocked layers into blocks of this many tokens; 0: never (version 1).
        self.block_tokens = block_tokens and check_block_tokens(block_tokens)
        self.stats = ClientStats()
        self.limits: Limits = DEFAULT_LIMITS  # the daemon's, once a hello was answered
        self.server: HelloReply | None = None
        self.connection: Connection | None = None
        self.epoch = 0  # counts connections made
        self.last_round_trip = 0.0  # seconds, measured by the driver
        self._prefill = _PrefillCost()  # shared with twins: the engine measures, puts send
        self._last_id = 0
        self._unawaited: set[int] = set()  # ids of requests sent whose replies go unread
        self._delay = 0.0
        self._retry_at = float("-inf")

    def next_id(self) -> int:
        self._last_id = self._last_id % U32 + 1
        return self._last_id

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed tokens of prefill in seconds; prefills shorter than
        MIN_MEASURED_PREFILL are mostly fixed costs and are not taken."""
        if tokens >= MIN_MEASURED_PREFILL and seconds > 0:
            self._prefill.seconds = min(seconds / tokens, MAX_PREFILL_COST)  # the wire's bound

    @property
    def prefill_cost(self) -> float:
        """Seconds of prefill per token, as the engine last measured it (0: not measured);
        sent with each put, for the daemon's cost eviction policy."""
        return self._prefill.seconds

    @property
    def tenant(self) -> str:
        """The prefix the daemon last connected to puts before this client's namespaces: ""
        for an engine of the daemon's own user; "uid:<uid>/" for one of another user (or
        every user, when the daemon's users share)."""
        return "" if self.server is None else self.server.tenant

    def scope(self, identity: Identity) -> Identity:
        """identity as the daemon knows it: its namespace under the tenant, its traits left
        out for a daemon that predates them. Idempotent: an identity read back from an
        entry's header is under it already."""
        if identity.traits and not self.offers(IDENTITY_TRAITS_FEATURE):
            identity = dataclasses.replace(identity, traits="")
        elif identity.traits and not self.offers(IDENTITY_SOURCE_FEATURE):
            traits = older_traits(identity.traits)
            if traits != identity.traits:
                identity = dataclasses.replace(identity, traits=traits)
        tenant = self.tenant
        if identity.namespace.startswith(tenant):
            return identity
        return dataclasses.replace(identity, namespace=tenant + identity.namespace)

    def offers(self, feature: str) -> bool:
        """Whether the daemon last connected to announced feature in its hello."""
        return self.server is not None and feature in self.server.features

    def twin(self) -> Link:
        """A link with the same settings and no connection, sharing the prefill measure and the
        breaker."""
        twin = Link(
            self.socket_path,
            self.timeout,
            self.name,
            self.backoff,
            verify=self.verify,
            block_tokens=self.block_tokens,
            lookup_timeout=self.lookup_timeout,
            breaker=self.breaker,
        )
        twin._prefill = self._prefill
        return twin

    def due(self, now: float) -> float:
        """When an exchange on the engine's path begun now must be done (monotonic seconds)."""
        return now + self.lookup_timeout

    def deadline(self, wait: float | None, by: float | None, now: float) -> float | None:
        """Seconds an exchange may take before the daemon counts as slow: the client's timeout
        (plus what the daemon may take on purpose: wait, None for as long as it likes), and no
        later than by (monotonic seconds, None for no bound)."""
        own = None if wait is None else self.timeout + wait
        if by is None:
            return own
        left = max(by - now, MIN_WAIT)
        return left if own is None else min(own, left)

    def connect_timeout(self, by: float | None, now: float) -> float:
        """Seconds a connect and its hello may take: the client's timeout, no later than by."""
        return self.timeout if by is None else min(self.timeout, max(by - now, MIN_WAIT))

    # --- connecting ---

    def begin_connect(self, now: float, *, force: bool = False) -> bytes:
        """Count a connect attempt and return the hello frame to send once connected; raises
        DaemonUnavailableError while backing off after a failed attempt (unless force, or with a
        breaker: the engine's calls skip the daemon then, and the probe backs off)."""
        if not force and self.breaker is None and now < self._retry_at:
            down = f"the daemon at {self.socket_path} is down; retrying later"
            raise DaemonUnavailableError(down)
        self.stats.connect_attempts += 1
        self.connection = Connection(Role.CLIENT)
        hello = Hello(
            id=self.next_id(), protocol=PROTOCOL_VERSION, client=self.name, pid=os.getpid()
        )
        return self.connection.send(hello)

    def connected(self, reply: Reply) -> None:
        """The hello reply arrived: adopt the daemon's limits, or raise DaemonUnavailableError."""
        if isinstance(reply, ErrorReply):
            raise DaemonUnavailableError(f"the daemon refused hello: {reply.code}: {reply.message}")
        assert isinstance(reply, HelloReply)  # the Connection matched it to the hello
        self.server = reply
        self.limits = reply.limits
        self.epoch += 1
        if self.epoch > 1:
            self.stats.reconnects += 1
        self._delay, self._retry_at = 0.0, float("-inf")

    def failed(self, why: str) -> None:
        """An exchange or a connect found the daemon unavailable: the breaker, if any, opens."""
        if self.breaker is not None:
            self.breaker.trip(why)

    def connect_failed(self, now: float) -> None:
        self._delay = min(self.backoff.maximum, self._delay * 2 or self.backoff.initial)
        self._retry_at = now + self._delay

    def drop(self) -> list[int]:
        """Forget the connection; returns the received descriptors no reply claimed, to close."""
        connection, self.connection = self.connection, None
        self._unawaited.clear()
        return connection.take_descriptors() if connection is not None else []

    # --- exchanging ---

    def send(self, request: Request) -> bytes:
        assert self.connection is not None
        try:
            return self.connection.send(request)
        except ProtocolError as exc:  # e.g. a frame over the limits: nothing was sent
            raise DaemonError(exc.code, exc.message) from None

    def send_unawaited(self, request: Request) -> bytes:
        """The frame of a request whose reply is dropped when it arrives (calls.Send)."""
        frame = self.send(request)
        self._unawaited.add(request.id)
        return frame

    @property
    def replies_due(self) -> bool:
        """Whether the reply to a request sent unawaited is still to come on the connection."""
        return bool(self._unawaited)

    def receive(self, data: bytes, fds: Sequence[int]) -> None:
        assert self.connection is not None
        self.connection.receive_data(data, fds)

    def next_reply(self) -> Reply | None:
        """The reply now complete, or None to receive more; raises ProtocolError when the
        connection is unusable (the driver then drops it)."""
        assert self.connection is not None
        while True:
            event = self.connection.next_event()
            if event is NEED_DATA:
                return None
            if isinstance(event, ConnectionClosed):
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon closed the connection")
            if isinstance(event, ErrorReply) and event.id == 0:
                # The requests in flight (one, and any sent unawaited) await replies that will
                # not come.
                message = f"the daemon could not read a request: {event.message}"
                raise ProtocolError(event.code, message)
            assert isinstance(event, Reply)  # a client Connection yields nothing else
            if event.id not in self._unawaited:
                return event
            self._unawaited.discard(event.id)
            if isinstance(event, ErrorReply):
                log.debug(
                    "request %d, sent unawaited, refused: %s: %s",
                    event.id,
                    event.code.value,
                    event.message,
                )
