"""What the blocking and the async client share: every operation, written once.

An operation is a generator (a Call) that yields the steps it needs, an Exchange (send a
request, get its reply) or Blocking file work, and is sent back each step's result, or has
the step's exception thrown into it. Client drives calls with blocking sockets, AsyncClient
with asyncio; neither holds any logic of its own beyond moving bytes. Link (link.py) is the
protocol state both keep across connections; what calls return is in results.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, TypeAlias, TypeVar

from kvd_protocol.entry import (
    EntryHeader,
)
from kvd_protocol.errors import (
    DaemonUnavailableError,
    EntryFormatError,
    ErrorCode,
    ProtocolError,
    Rule,
)
from kvd_protocol.identity import Identity
from kvd_protocol.messages import (
    LOOKUP_MISS_FEATURE,
    MAX_WAIT_SECONDS,
    REMOTE_FETCH_FEATURE,
    EntrySummary,
    ErrorReply,
    Evict,
    EvictReply,
    FindCheckpoint,
    FindCheckpointReply,
    Flush,
    FlushReply,
    ForgetCheckpoint,
    ForgetCheckpointReply,
    ListEntries,
    ListEntriesReply,
    Lookup,
    LookupReply,
    OpenBlocks,
    OpenBlocksReply,
    Ping,
    PingReply,
    Presence,
    PresenceReply,
    PutBlocksReply,
    Release,
    ReleaseReply,
    Reply,
    Request,
    RestoreReport,
    Status,
    StatusReply,
    TicketReply,
)
from kvd_protocol.messages import WaitTicket as TicketRequest
from kvd_protocol.tokens import TOKEN_BYTES, pack_tokens

from . import entry_io
from .link import DaemonError, Link
from .results import Evicted, LookupHit, TicketBase, TicketState
from .results import Presence as PresenceAnswer
from .transport import TransportClosed

log = logging.getLogger("kvd_client")

T = TypeVar("T")
R = TypeVar("R", bound=Reply)

LIST_PAGE: Final = 1000  # entries asked for per list request
TICKET_POLL_SECONDS: Final = 60.0  # Ticket.wait(None) asks again this often until settled
UNAVAILABLE: Final = "unavailable"
SKIPPED: Final = "the daemon did not answer lately: skipped until it does"


# --- steps --------------------------------------------------------------------------------


class Exchange(NamedTuple):  # not a dataclass: one is made per request, at half the cost
    """Send request and return its reply (an ErrorReply included).

    wait: how long the daemon may take on purpose (a flush or ticket timeout), on top of the
    client's timeout; None when it may take as long as it likes. epoch: the connection the
    request belongs to (a put, lease or ticket lives on one); None means the current one,
    connecting first if there is none. by: when the exchange must be done, waiting for the
    connection and connecting included (time.monotonic(); None: no bound but the timeout),
    for an exchange on the engine's path (Link.due)."""

    request: Request
    wait: float | None = 0.0
    epoch: int | None = None
    by: float | None = None


class Send(NamedTuple):
    """Send request on its connection (epoch: the one the request belongs to) and go on
    without its reply, which is dropped when it arrives: read by the next exchange on the
    connection or by the client's close. For a request that nothing waits to hear the answer
    to (the release that ends a get); the daemon takes a connection's requests in order, so
    whatever is asked after it is answered after it was done. by: as Exchange's, for the
    wait for the connection."""

    request: Request
    epoch: int
    by: float | None = None


@dataclass(frozen=True)
class Blocking:
    """File work that may take long (copying tensors): an async client runs it in a thread."""

    work: Callable[[], object]


Step: TypeAlias = Exchange | Send | Blocking
Call: TypeAlias = Generator[Step, object, T]


def expect(reply: object, kind: type[R]) -> R:
    """reply as kind; an error reply raises DaemonError (DaemonUnavailableError when the
    daemon is shutting down)."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, ErrorReply):
        if reply.code is ErrorCode.SHUTTING_DOWN:
            raise DaemonUnavailableError(f"the daemon is shutting down: {reply.message}")
        raise DaemonError(reply.code, reply.message)
    raise TypeError(f"expected a {kind.op!r} reply, got {reply!r}")


def must_connect(link: Link, step: Exchange | Send, *, connected: bool) -> bool:
    """Whether a driver connects before sending step's request: the first request of a call
    when no connection is up. A later request belongs to its call's connection (epoch):
    DaemonUnavailableError if that was lost."""
    if step.epoch is None:
        return not connected
    if step.epoch != link.epoch or not connected:
        raise DaemonUnavailableError("the connection this request belongs to was lost")
    return False


def left(by: float) -> float:
    """Seconds until by (time.monotonic()), 0 when past."""
    return max(by - time.monotonic(), 0.0)


def broken(step: Exchange, exc: BaseException, *, fresh: bool) -> DaemonUnavailableError | None:
    """What a driver raises (from exc) when step's exchange failed with exc and the
    connection was dropped: DaemonUnavailableError for an OSError (timeouts included) or a
    ProtocolError, or None to try once more on a new connection. That is worth it for the
    first request of a call, on a connection that had broken since the last call (a
    restarted daemon), unless the connection was made for this request (fresh). Never after
    a timeout: a slow daemon would cost the engine twice the wait. Anything else (an
    interruption, a cancellation) the driver raises as it is."""
    if not isinstance(exc, OSError | ProtocolError):
        raise exc
    if not fresh and step.epoch is None and isinstance(exc, TransportClosed):
        return None
    return DaemonUnavailableError(f"{step.request.op}: {exc or type(exc).__name__}")


# --- calls ------------------------------------------------------------------------------------


def scoped(link: Link, identity: Identity, by: float | None = None) -> Call[Identity]:
    """identity under the tenant the daemon gives this client (Link.scope). A client that no
    daemon has answered yet (made while it was down) connects first, with a ping (done by
    by): raises DaemonUnavailableError as the call's own request would."""
    if link.server is None:
        expect((yield Exchange(Ping(id=link.next_id()), by=by)), PingReply)
    return link.scope(identity)


def ping(link: Link) -> Call[float]:
    expect((yield Exchange(Ping(id=link.next_id()))), PingReply)
    return link.last_round_trip


def status(link: Link) -> Call[dict[str, object]]:
    reply = expect((yield Exchange(Status(id=link.next_id()))), StatusReply)
    return dict(reply.status)


def flush(link: Link, timeout: float | None) -> Call[bool]:
    request = Flush(id=link.next_id(), timeout=_wire_wait(timeout))
    return expect((yield Exchange(request, wait=timeout)), FlushReply).durable


def _digest_of(link: Link, identity: Identity | str | None) -> Call[str | None]:
    """The digest an identity (scoped to the connection's tenant) names; a digest as given."""
    if isinstance(identity, Identity):
        return (yield from scoped(link, identity)).digest()
    return identity


def list_entries(
    link: Link, identity: Identity | str | None, after: str | None, limit: int | None
) -> Call[list[EntrySummary]]:
    digest = yield from _digest_of(link, identity)
    entries: list[EntrySummary] = []
    epoch: int | None = None
    while limit is None or len(entries) < limit:
        page = LIST_PAGE if limit is None else min(LIST_PAGE, limit - len(entries))
        request = ListEntries(id=link.next_id(), identity=digest, limit=page, after=after)
        reply = expect((yield Exchange(request, epoch=epoch)), ListEntriesReply)
        epoch = link.epoch
        entries.extend(reply.entries)
        if not reply.more or not reply.entries:
            break
        after = reply.entries[-1].id
    return entries


def evict(
    link: Link, entry: str | None, identity: Identity | str | None, everything: bool
) -> Call[Evicted]:
    digest = yield from _digest_of(link, identity)
    if (entry is not None) + (digest is not None) + everything != 1:
        raise ValueError("evict: give exactly one of entry, identity, all")
    request = Evict(id=link.next_id(), entry=entry, identity=digest, all=everything)
    reply = expect((yield Exchange(request)), EvictReply)
    return Evicted(reply.evicted, reply.bytes)


def presence(link: Link, identity: Identity, tokens: bytes | Sequence[int]) -> Call[PresenceAnswer]:
    """How much of tokens the daemon would restore now, and its remote tier hold past that;
    restoring and counting nothing. Raises DaemonUnavailableError or DaemonError (a daemon
    that predates it: unknown_op)."""
    packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    named = yield from scoped(link, identity)
    request = Presence(id=link.next_id(), identity=named, digest=None, tokens=packed)
    reply = expect((yield Exchange(request)), PresenceReply)
    return PresenceAnswer(
        reply.matched,
        reply.entry,
        reply.miss,
        reply.detail,
        reply.remote,
        reply.remote_miss,
        reply.remote_detail,
    )


def open_blocks(link: Link, hit: LookupHit, first: int, count: int) -> Call[tuple[int, ...]]:
    """Read-only descriptors of blocks first..first + count - 1 of a looked-up entry, for the
    caller to close. A block the daemon cannot open raises EntryFormatError (block_missing:
    the daemon has quarantined it); else DaemonUnavailableError or DaemonError."""
    request = OpenBlocks(id=link.next_id(), lease=hit.lease, first=first, count=count)
    due = link.due(time.monotonic())  # on the engine's path: a restore waits for it
    try:
        reply = expect((yield Exchange(request, epoch=hit.epoch, by=due)), OpenBlocksReply)
    except DaemonError as exc:
        if exc.code is ErrorCode.NOT_FOUND and exc.message.startswith(Rule.BLOCK_MISSING):
            raise EntryFormatError(hit.summary.id, Rule.BLOCK_MISSING, exc.message) from None
        raise
    return claimed(reply, count)


def claimed(reply: PutBlocksReply | OpenBlocksReply, count: int) -> tuple[int, ...]:
    """The reply's descriptors, exactly count of them (else all closed: DaemonError)."""
    if len(reply.fds) != count:
        for fd in reply.fds:
            os.close(fd)
        raise DaemonError(ErrorCode.BAD_DESCRIPTORS, f"{len(reply.fds)} files for {count} blocks")
    return reply.fds


def _wire_wait(seconds: float | None) -> float | None:
    """A wait the daemon takes: at most MAX_WAIT_SECONDS (a longer one is a bad message)."""
    return None if seconds is None else min(seconds, MAX_WAIT_SECONDS)


def wait_ticket(link: Link, ticket: TicketBase, timeout: float | None) -> Call[TicketState]:
    """The ticket's state once settled or after timeout seconds (None: until settled)."""
    state = ticket.state
    while not state.settled and ticket.id is not None:
        wait = TICKET_POLL_SECONDS if timeout is None else timeout
        request = TicketRequest(
            id=link.next_id(), ticket=ticket.id, timeout=_wire_wait(wait) if wait > 0 else None
        )
        try:
            reply = expect((yield Exchange(request, wait=wait, epoch=ticket.epoch)), TicketReply)
            state = TicketState(reply.state, reply.reason)
        except (DaemonUnavailableError, DaemonError) as exc:
            state = TicketState(UNAVAILABLE, str(exc))
        if timeout is not None:
            break
    return state


def lookup(
    link: Link, identity: Identity, tokens: bytes | Sequence[int], min_tokens: int = 0
) -> Call[LookupHit | None]:
    """The longest usable cached prefix of tokens, mapped, or None (a miss), also when it is
    shorter than min_tokens (what the engine already holds). Nothing here raises into the
    engine: an unreachable daemon or an unusable file is a miss, counted."""
    packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    asked = min_tokens if link.offers("lookup_min_tokens") else 0  # else checked here
    explain = link.offers(LOOKUP_MISS_FEATURE)
    fetches = link.offers(REMOTE_FETCH_FEATURE)

    def ask(named: Identity, fetch: str | None = "wait" if fetches else None) -> Lookup:
        return Lookup(
            id=link.next_id(),
            identity=named,
            tokens=packed,
            min_tokens=asked,
            explain=explain,
            fetch=fetch,
        )

    def ask_again(named: Identity) -> Lookup:
        return ask(named, "fetched")

    found = _found(
        link,
        ask,
        LookupReply,
        identity,
        packed,
        checkpoint_key=None,
        min_tokens=min_tokens,
        after_fetch=ask_again,
    )
    return (yield from found)


def find_checkpoint(
    link: Link, identity: Identity, key: str, prompt: bytes | Sequence[int]
) -> Call[LookupHit | None]:
    """The newest generation checkpoint stored under key that extends prompt, or None."""
    packed = prompt if isinstance(prompt, bytes) else pack_tokens(prompt)

    def ask(named: Identity) -> FindCheckpoint:
        return FindCheckpoint(id=link.next_id(), identity=named, key=key, prompt=packed)

    return (yield from _found(link, ask, FindCheckpointReply, identity, packed, checkpoint_key=key))


def forget_checkpoint(link: Link, identity: Identity, key: str) -> Call[int]:
    """Drop the checkpoints of a finished generation; how many went."""
    identity = yield from scoped(link, identity)
    request = ForgetCheckpoint(id=link.next_id(), identity=identity, key=key)
    return expect((yield Exchange(request)), ForgetCheckpointReply).removed


def _found(
    link: Link,
    ask: Callable[[Identity], Request],
    kind: type[LookupReply],
    identity: Identity,
    packed: bytes,
    *,
    checkpoint_key: str | None,
    min_tokens: int = 0,
    after_fetch: Callable[[Identity], Request] | None = None,
) -> Call[LookupHit | None]:
    """Map the entry a lookup or checkpoint reply offers (ask: the request, naming identity
    under the tenant), after checking it answers the ask. Connecting and asking are done
    within the lookup timeout (a miss past it), or skipped while the breaker is open. A reply
    that says the daemon is fetching from its remote tier is followed by after_fetch's request,
    answered within the fetch's seconds plus the lookup timeout (the only longer wait)."""
    if link.breaker is not None and link.breaker.skip_lookup():
        link.stats.failed_lookups += 1
        link.stats.misses[UNAVAILABLE] += 1
        return None
    due = link.due(time.monotonic())
    try:
        identity = yield from scoped(link, identity, due)
        reply = expect((yield Exchange(ask(identity), by=due)), kind)
        if reply.fetching is not None and after_fetch is not None:
            link.stats.remote_fetches += 1
            wait = reply.fetching
            due = link.due(time.monotonic() + wait)
            reply = expect((yield Exchange(after_fetch(identity), wait=wait, by=due)), kind)
    except (DaemonUnavailableError, DaemonError) as exc:
        link.stats.failed_lookups += 1
        unavailable = isinstance(exc, DaemonUnavailableError)
        link.stats.misses[UNAVAILABLE if unavailable else "refused"] += 1
        log.info("%s missed: %s", kind.op, exc)
        return None
    if reply.entry is None or reply.lease is None or reply.fd is None:
        link.stats.misses[reply.miss or "no entry"] += 1
        log.debug("%s missed (%s): %s", kind.op, reply.miss or "no entry", reply.detail or "-")
        return None
    epoch = link.epoch
    if reply.matched < min_tokens:  # a daemon without the feature: not worth mapping
        os.close(reply.fd)
        link.stats.misses["below min_tokens"] += 1
        yield from release_lease(link, reply.lease, epoch)
        return None
    try:
        entry = entry_io.EntryFile.open(reply.fd, reply.entry.id, link.limits)
    except EntryFormatError as exc:
        yield from reject(link, reply.lease, epoch, exc.rule.value, exc, damaged=True)
        return None
    except OSError as exc:
        yield from reject(link, reply.lease, epoch, "unreadable", exc, damaged=False)
        return None
    problem = mismatch(entry.header, identity, packed, min(reply.matched, len(packed) // 4))
    found_key = entry.header.checkpoint.key if entry.header.checkpoint else None
    if problem is None and found_key != checkpoint_key:
        problem = f"its checkpoint key is {found_key!r}, not {checkpoint_key!r}"
    if problem is not None:
        entry.close()
        detail = f"{reply.entry.id}: {problem}"
        yield from reject(link, reply.lease, epoch, "mismatch", detail, damaged=False)
        return None
    return LookupHit(reply.matched, reply.entry, reply.lease, epoch, entry)


def reject(
    link: Link,
    lease: int,
    epoch: int,
    reason: str,
    detail: object,
    *,
    damaged: bool,
    started: float | None = None,
) -> Call[None]:
    """Count an offered entry the client will not use, as a miss by reason, and end its
    lease, saying so to the daemon; a damaged one is checked there and quarantined.
    started: when the get began (perf_counter), for the report."""
    link.stats.rejected_entries += 1
    link.stats.misses[reason] += 1
    log.warning("entry rejected (%s): %s", reason, detail)
    report = restore_report(reason, started, 0, 0)
    yield from release_lease(
        link, lease, epoch, damaged=str(detail) if damaged else None, report=report
    )


def restore_report(
    miss: str | None, started: float | None, nbytes: int, tokens: int
) -> RestoreReport:
    """How a get went, for the daemon's telemetry: miss None when caches were restored."""
    ms = 0.0 if started is None else (time.perf_counter() - started) * 1000
    return RestoreReport(miss=miss, ms=ms, bytes=nbytes, tokens=tokens)


def mismatch(header: EntryHeader, identity: Identity, tokens: bytes, matched: int) -> str | None:
    """Why an entry the daemon offered does not answer what was asked, or None if it does."""
    if header.identity != identity:
        return "its identity differs from the one asked for"
    if matched > header.token_count or matched * TOKEN_BYTES > len(tokens):
        return f"a match of {matched} tokens is longer than the entry or the prompt"
    if header.tokens[: matched * TOKEN_BYTES] != tokens[: matched * TOKEN_BYTES]:
        return f"its first {matched} tokens differ from the prompt's"
    return None


def release_lease(
    link: Link,
    lease: int,
    epoch: int,
    *,
    damaged: str | None = None,
    report: RestoreReport | None = None,
    awaited: bool = True,
) -> Call[None]:
    """End a lease, saying why the entry was unusable if damaged and how the restore went (to
    a daemon that listens), waiting no longer than a lookup; a lease of a lost connection
    ended with it. Not awaited: the release is sent and its answer not waited for (Send),
    for a get whose caches are restored already."""
    damage = damaged if link.offers("release_damaged") else None
    told = report if link.offers("restore_report") else None
    try:
        request = Release(id=link.next_id(), lease=lease, damaged=damage, report=told)
        due = link.due(time.monotonic())
        if awaited:
            expect((yield Exchange(request, epoch=epoch, by=due)), ReleaseReply)
        else:
            yield Send(request, epoch, due)
    except (DaemonUnavailableError, DaemonError) as exc:
        log.debug("release of lease %d not confirmed: %s", lease, exc)
