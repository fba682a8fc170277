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
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Final, NamedTuple, TypeAlias, TypeVar

from kvd_protocol.entry import (
    Checkpoint,
    EntryHeader,
    EntryPlan,
    LayerSpec,
    MetaValue,
    TensorSpec,
    plan_entry,
    plan_manifest,
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
    BLOCKS_FEATURE,
    ENGINE_DROPS_FEATURE,
    LOOKUP_MISS_FEATURE,
    MAX_BLOCK_BATCH,
    MAX_WAIT_SECONDS,
    PREFILL_COST_FEATURE,
    REMOTE_FETCH_FEATURE,
    DropReport,
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
    PutAbort,
    PutAbortReply,
    PutBegin,
    PutBeginReply,
    PutBlocks,
    PutBlocksReply,
    PutCommit,
    PutCommitReply,
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

from . import block_io, entry_io
from .entry_io import TensorData
from .link import DaemonError, Link
from .results import Evicted, LookupHit, PutOutcome, TicketBase, TicketState
from .transport import TransportClosed
from .workers import Descriptors

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


@dataclass(frozen=True)
class Blocking:
    """File work that may take long (copying tensors): an async client runs it in a thread."""

    work: Callable[[], object]


Step: TypeAlias = Exchange | Blocking
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


def must_connect(link: Link, step: Exchange, *, connected: bool) -> bool:
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


def put_entry(
    link: Link,
    identity: Identity,
    tokens: bytes | Sequence[int],
    layers: Sequence[LayerSpec],
    tensors: Sequence[TensorData],
    *,
    created: float,
    min_reuse: int,
    checkpoint: Checkpoint | None,
    meta: Mapping[str, MetaValue] | None,
    dropped: DropReport | None = None,
) -> Call[PutOutcome]:
    """Plan, begin, write into the staging descriptors, commit (with dropped, to a daemon
    that offers "engine_drops": a put that gets no ticket tells nothing). Caller mistakes (a
    layout the planner rejects, a tensor that does not fit its slot) raise before the daemon
    is asked.

    Cut into blocks (a manifest, FORMAT.md "Version 2") when the daemon offers blocks, the
    client's block size is not 0 and some layer is blocked with a whole block of tokens; the
    daemon says how many leading blocks it holds already, and only the others are written.
    A cut tensor may come as a block_io.CutCopy that leaves out blocks taken to be held: a
    daemon that holds fewer has the put aborted, raising block_io.BlocksNotHeld."""
    packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    content = _PutContent(identity, packed, layers, tensors, created, min_reuse, checkpoint, meta)
    while True:  # twice at most: planned again once the daemon has first answered
        started = time.perf_counter()
        planned = content.planned(link)
        if link.breaker is not None and link.breaker.skip_put():
            return _not_begun(link, DaemonUnavailableError(SKIPPED))
        if link.server is not None:
            return (yield from _send_put(link, planned, started, dropped))
        try:  # its word: the tenant the header names the identity under, its features
            yield from scoped(link, identity)
        except (DaemonUnavailableError, DaemonError) as exc:
            return _not_begun(link, exc)


@dataclass(frozen=True)
class _PlannedPut:
    """A put laid out for the daemon as the link knows it: what put_begin asks for, and how
    the staging file and the blocks are written."""

    identity: Identity  # as the daemon names it: the header says it so
    tokens: bytes
    size: int  # of the staging file
    write: Callable[[int], None]  # the staging file's bytes, into its descriptor
    blocks: block_io.BlockWriter | None  # a manifest's blocks; None for a version 1 entry


@dataclass(frozen=True)
class _PutContent:
    """What a put stores, as the engine gave it: planned for the daemon as the link knows it."""

    identity: Identity
    tokens: bytes
    layers: Sequence[LayerSpec]
    tensors: Sequence[TensorData]
    created: float
    min_reuse: int
    checkpoint: Checkpoint | None
    meta: Mapping[str, MetaValue] | None

    def planned(self, link: Link) -> _PlannedPut:
        """The put's layout: cut into blocks when _blocks_for says so, else a version 1
        entry. Raises ValueError (the planner's) or TensorLayoutError for a caller's mistake."""
        named = link.scope(self.identity)
        if not _blocks_for(link, self.tokens, self.layers):
            plan = plan_entry(
                named,
                self.tokens,
                self.layers,
                created=self.created,
                min_reuse=self.min_reuse,
                checkpoint=self.checkpoint,
                meta=self.meta,
                limits=link.limits,
            )
            views = _whole_views(link, plan, self.layers, self.tensors)
            write = partial(entry_io.write_entry, plan=plan, views=views)
            return _PlannedPut(named, self.tokens, plan.file_size, write, None)
        manifest = plan_manifest(
            named,
            self.tokens,
            self.layers,
            block_tokens=link.block_tokens,
            created=self.created,
            min_reuse=self.min_reuse,
            checkpoint=self.checkpoint,
            meta=self.meta,
            limits=link.limits,
        )
        sources = block_io.sources(_whole_slots(self.layers), self.tensors)
        writer = block_io.BlockWriter(manifest, sources)
        return _PlannedPut(
            named, self.tokens, manifest.entry.file_size, writer.write_manifest, writer
        )


def _send_put(
    link: Link, put: _PlannedPut, started: float, dropped: DropReport | None
) -> Call[PutOutcome]:
    """Begin the planned put, write its blocks the daemon does not hold and its staging file,
    commit; given up (aborted) on any failure. started: when it was planned (perf_counter),
    for the commit's store_ms."""
    writer = put.blocks
    hashes = b"".join(writer.plan.hashes) if writer is not None else b""
    request = PutBegin(
        id=link.next_id(),
        identity=put.identity,
        tokens=put.tokens,
        size=put.size,
        prefill_cost=link.prefill_cost if link.offers(PREFILL_COST_FEATURE) else 0.0,
        blocks=hashes,
        block_tokens=link.block_tokens if hashes else 0,
        block_size=writer.plan.block_size if writer is not None else 0,
    )
    try:
        begin = expect((yield Exchange(request)), PutBeginReply)
    except (DaemonUnavailableError, DaemonError) as exc:
        return _not_begun(link, exc)
    epoch = link.epoch
    if begin.skip is not None:
        return PutOutcome(None, TicketState("stored", begin.skip), epoch)
    assert begin.fd is not None  # the Connection delivers the descriptor a begin declares
    staging = Descriptors([begin.fd])
    try:
        try:
            if writer is not None:
                link.stats.blocks_held += begin.held
                yield from put_blocks(link, begin.put, epoch, begin.held, writer)
            yield Blocking(staging.lent(partial(put.write, begin.fd)))
            link.stats.bytes_written += put.size
        finally:
            staging.release()  # a put given up mid-write: closed when the write ends
        took = (time.perf_counter() - started) * 1000
        store_ms = took if link.offers("restore_report") else None
        commit = PutCommit(
            id=link.next_id(),
            put=begin.put,
            store_ms=store_ms,
            dropped=dropped if link.offers(ENGINE_DROPS_FEATURE) else None,
        )
        ticket = expect((yield Exchange(commit, epoch=epoch)), PutCommitReply).ticket
    except Exception as exc:
        yield from _abort(link, begin.put, epoch)
        if isinstance(exc, DaemonUnavailableError):
            link.stats.unavailable_puts += 1
            return PutOutcome(None, TicketState(UNAVAILABLE, str(exc)), epoch)
        if isinstance(exc, DaemonError | OSError):
            return PutOutcome(None, TicketState("failed", str(exc)), epoch)
        raise
    return PutOutcome(ticket, TicketState("pending"), epoch)


def _not_begun(link: Link, exc: DaemonUnavailableError | DaemonError) -> PutOutcome:
    """A put the daemon could not be asked for (unavailable, counted) or refused (failed)."""
    if isinstance(exc, DaemonUnavailableError):
        link.stats.unavailable_puts += 1
        return PutOutcome(None, TicketState(UNAVAILABLE, str(exc)), link.epoch)
    return PutOutcome(None, TicketState("failed", str(exc)), link.epoch)


def _blocks_for(link: Link, tokens: bytes, layers: Sequence[LayerSpec]) -> bool:
    """Whether a put of these layers is cut into blocks (see put_entry)."""
    return (
        link.block_tokens > 0
        and link.offers(BLOCKS_FEATURE)
        and len(tokens) // TOKEN_BYTES >= link.block_tokens
        and any(layer.blocked for layer in layers)
    )


def _whole_views(
    link: Link, plan: EntryPlan, layers: Sequence[LayerSpec], tensors: Sequence[TensorData]
) -> list[entry_io.Pieces]:
    """The byte views of a version 1 entry's tensors, checked (TensorLayoutError) also before
    the daemon's first word; a snapshot that left out blocks (block_io.CutCopy) is made whole
    only after it: until then the put is planned again once the daemon answers."""
    if link.server is None:
        block_io.sources(_whole_slots(layers), tensors)
        return []
    return entry_io.tensor_views(plan, block_io.whole(tensors))


def _whole_slots(layers: Sequence[LayerSpec]) -> list[TensorSpec]:
    return [tensor for layer in layers for tensor in layer.tensors]


def put_blocks(
    link: Link, put: int, epoch: int, held_blocks: int, writer: block_io.BlockWriter
) -> Call[None]:
    """Write blocks held_blocks.. of a begun put: their staging files asked for in batches, each
    batch written (Blocking) and closed before the next is asked for (or, when the put is
    given up mid-batch, once its last write has ended). Raises BlocksNotHeld first if the
    writer lacks blocks the daemon does not hold."""
    writer.check_held(held_blocks)
    count = len(writer.plan.hashes)
    for first in range(held_blocks, count, MAX_BLOCK_BATCH):
        batch = min(MAX_BLOCK_BATCH, count - first)
        request = PutBlocks(id=link.next_id(), put=put, first=first, count=batch)
        reply = expect((yield Exchange(request, epoch=epoch)), PutBlocksReply)
        with Descriptors(_claimed(reply, batch)) as fds:
            yield Blocking(partial(writer.write_blocks, first, fds))
            link.stats.blocks_written += batch
            link.stats.bytes_written += batch * writer.plan.block_size


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
    return _claimed(reply, count)


def _claimed(reply: PutBlocksReply | OpenBlocksReply, count: int) -> tuple[int, ...]:
    """The reply's descriptors, exactly count of them (else all closed: DaemonError)."""
    if len(reply.fds) != count:
        for fd in reply.fds:
            os.close(fd)
        raise DaemonError(ErrorCode.BAD_DESCRIPTORS, f"{len(reply.fds)} files for {count} blocks")
    return reply.fds


def _abort(link: Link, put: int, epoch: int) -> Call[None]:
    """Tell the daemon to discard a put; it may be gone already, which is as good."""
    try:
        request = PutAbort(id=link.next_id(), put=put)
        expect((yield Exchange(request, epoch=epoch)), PutAbortReply)
    except (DaemonUnavailableError, DaemonError) as exc:
        log.debug("put_abort of put %d not confirmed: %s", put, exc)


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
) -> Call[None]:
    """End a lease, saying why the entry was unusable if damaged and how the restore went (to
    a daemon that listens), waiting no longer than a lookup; a lease of a lost connection
    ended with it."""
    damage = damaged if link.offers("release_damaged") else None
    told = report if link.offers("restore_report") else None
    try:
        request = Release(id=link.next_id(), lease=lease, damaged=damage, report=told)
        due = link.due(time.monotonic())
        expect((yield Exchange(request, epoch=epoch, by=due)), ReleaseReply)
    except (DaemonUnavailableError, DaemonError) as exc:
        log.debug("release of lease %d not confirmed: %s", lease, exc)
