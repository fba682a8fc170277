"""The op table: each request's handler, once, and what its answer may wait for.

A handler takes its connection's Context and its request, and returns the reply there and
then, or what to await for it (a Later), which the session runs as the request's row says
(Op, kvd.serve.op_row). The session is the pump (kvd.serve.session): it hands each request
to its row and sends what comes back. A daemon with a remote tier wraps the lookup's
handler (fetching), so that a lookup that may wait for a fetch waits in a task of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Final

from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode, ProtocolError

from kvd import __version__
from kvd.remote.presence import remote_presence
from kvd.remote.remote import Remote
from kvd.serve.op_row import Context, Handler, Later, Op, Waits, awaited
from kvd.serve.status import tenant_report
from kvd.serve.tenant_bounds import check_digest, check_identity, refused
from kvd.store.miss_reasons import Miss
from kvd.store.records import summary
from kvd.store.staged_put import DeclaredBlocks

FEATURES = (
    "put",
    "lookup",
    "leases",
    "flush",
    "evict",
    "list",
    "lookup_min_tokens",
    "verify",
    "release_damaged",
    "restore_report",
    m.PREFILL_COST_FEATURE,
    m.BLOCKS_FEATURE,
    m.IDENTITY_TRAITS_FEATURE,
    m.IDENTITY_SOURCE_FEATURE,
    m.LOOKUP_MISS_FEATURE,
    m.ENGINE_DROPS_FEATURE,
    m.REMOTE_FLUSH_FEATURE,
    m.RETENTION_FEATURE,
    m.OPEN_ENTRY_FEATURE,
    m.PRESENCE_FEATURE,
)
REMOTE_FEATURES = (*FEATURES, m.REMOTE_FETCH_FEATURE)  # a daemon with a remote tier's


# --- the connection -----------------------------------------------------------------------


def hello(c: Context, request: m.Hello) -> m.HelloReply:
    if request.protocol != m.PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"this daemon speaks protocol {m.PROTOCOL_VERSION}, not {request.protocol}",
        )
    c.peer.name = request.client
    return m.HelloReply(
        id=request.id,
        protocol=m.PROTOCOL_VERSION,
        server=__version__,
        limits=c.tier.limits,
        features=FEATURES if c.remote is None else REMOTE_FEATURES,
        tenant=c.peer.tenant,
    )


def ping(c: Context, request: m.Ping) -> m.PingReply:
    return m.PingReply(id=request.id)


def status(c: Context, request: m.Status) -> m.StatusReply:
    report = c.status()
    if c.peer.tenant:  # another user's: its own part of it
        known = c.tier.view.known_identities()
        report = tenant_report(report, c.peer, known)
    return m.StatusReply(id=request.id, status=report)


# --- puts ---------------------------------------------------------------------------------


async def put_begin(c: Context, request: m.PutBegin) -> m.PutBeginReply:
    if c.peer.tenant:
        check_identity(c.peer, request, request.identity)
    c.peer.named(request.identity.digest())
    put, skip, fd = await c.tier.puts.begin(
        c.peer.session,
        request.identity,
        request.tokens,
        request.size,
        DeclaredBlocks(request.hashes, request.block_tokens, request.block_size),
        prefill_cost=request.prefill_cost,
        retention=request.retention,
    )
    return m.PutBeginReply(
        id=request.id,
        put=put.id if put else 0,
        skip=skip,
        fd=fd,
        held=put.held_blocks if put else 0,
    )


async def put_blocks(c: Context, request: m.PutBlocks) -> m.PutBlocksReply:
    fds = await c.tier.puts.block_files(c.peer.session, request.put, request.first, request.count)
    return m.PutBlocksReply(id=request.id, count=len(fds), descriptors=tuple(fds))


async def put_commit(c: Context, request: m.PutCommit) -> m.PutCommitReply:
    ticket = await c.tier.puts.commit_owned(
        c.peer.session, request.put, request.store_ms, request.dropped
    )
    return m.PutCommitReply(id=request.id, ticket=ticket)


def put_abort(c: Context, request: m.PutAbort) -> m.PutAbortReply:
    c.tier.puts.abort_owned(c.peer.session, request.put)
    return m.PutAbortReply(id=request.id)


async def ticket(c: Context, request: m.WaitTicket) -> m.TicketReply:
    state = await c.tier.tickets.wait(request.ticket, request.timeout)
    return m.TicketReply(
        id=request.id, ticket=request.ticket, state=state.state, reason=state.reason
    )


async def flush(c: Context, request: m.Flush) -> m.FlushReply:
    if not request.remote:
        durable, pending = await c.tier.admin.flush(request.timeout)
        return m.FlushReply(id=request.id, durable=durable, pending=pending)
    if c.remote is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, "this kvd has no remote tier (`remote`)")
    flushed = await c.remote.flush(request.timeout)
    return m.FlushReply(
        id=request.id,
        durable=flushed.done,
        pending=flushed.pending,
        remote_pending=flushed.uploads,
        remote_pending_bytes=flushed.upload_bytes,
        remote_dropped=flushed.dropped,
        remote_dropped_for=flushed.dropped_for,
        remote_down=flushed.down,
    )


# --- reads ----------------------------------------------------------------------------------


def lookup(c: Context, request: m.Lookup) -> m.LookupReply:
    if c.peer.tenant:
        check_identity(c.peer, request, request.identity)
    c.peer.named(request.identity.digest())
    found = c.tier.reads.lookup(
        c.peer.session, request.identity, request.tokens, request.min_tokens, c.peer.tenant
    )
    if isinstance(found, Miss):
        told = request.explain  # a client that predates the reasons is told none
        return m.LookupReply(
            id=request.id,
            matched=0,
            entry=None,
            lease=None,
            miss=found.reason if told else None,
            detail=found.detail if told else None,
        )
    match, lease, fd = found
    return m.LookupReply(
        id=request.id, matched=match.matched, entry=summary(match.record), lease=lease, fd=fd
    )


def book_lookups(c: Context) -> None:
    """What a lookup only counts (Reads.lookup), once its reply is sent."""
    c.tier.reads.book_lookups()


def fetching(lookup: Callable[[Context, m.Lookup], m.LookupReply]) -> Handler:
    """lookup, wrapped by the remote tier: a lookup that may wait for a fetch
    (Remote.lookup_waits) is answered once the fetch is done (or out of time), or told to ask
    again after it (fetching: the seconds the fetch has left); the others at once."""

    def handler(c: Context, request: m.Lookup) -> m.LookupReply | Later:
        remote = c.remote
        assert remote is not None
        if not remote.lookup_waits(request, c.peer.tenant):
            return lookup(c, request)

        async def fetched() -> m.LookupReply:
            if c.peer.tenant:
                check_identity(c.peer, request, request.identity)
            if (left := await remote.fetch_for(request)) is not None:
                return m.LookupReply(
                    id=request.id, matched=0, entry=None, lease=None, fetching=left
                )
            return lookup(c, request)

        return fetched

    return handler


def open_blocks(c: Context, request: m.OpenBlocks) -> m.OpenBlocksReply:
    fds = c.tier.reads.open_blocks(c.peer.session, request.lease, request.first, request.count)
    return m.OpenBlocksReply(id=request.id, count=len(fds), descriptors=tuple(fds))


def open_entry(c: Context, request: m.OpenEntry) -> m.OpenEntryReply:
    """A durable entry by id, leased as a hit is (kvctl export reads it and its blocks)."""
    if c.peer.tenant and (digest := c.tier.view.identity_of(request.entry)):
        check_digest(c.tier.view, c.peer, request, digest)
    record, lease, fd = c.tier.reads.open_entry(c.peer.session, request.entry)
    return m.OpenEntryReply(id=request.id, entry=summary(record), lease=lease, fd=fd)


def presence(c: Context, request: m.Presence) -> m.PresenceReply | Later:
    """How much of the prompt a lookup would restore now, and the remote tier hold past it
    (kvd.store.presence, kvd.remote.presence): counted nowhere."""
    identity = request.identity
    if identity is not None:
        if c.peer.tenant:
            check_identity(c.peer, request, identity)
        digest = identity.digest()
    else:
        assert request.digest is not None  # the message's check: one of the two
        digest = request.digest
        if c.peer.tenant:
            check_digest(c.tier.view, c.peer, request, digest)
    local = c.tier.view.presence(digest, identity, request.tokens, c.peer.tenant)
    reply = m.PresenceReply(
        id=request.id,
        matched=local.matched,
        entry=local.entry,
        miss=local.miss.reason if local.miss else None,
        detail=local.miss.detail if local.miss else None,
        remote=None,
        remote_miss=None,
        remote_detail=None,
    )
    remote = c.remote
    if remote is None:
        return reply

    async def probed() -> m.PresenceReply:
        more = await remote_presence(remote, digest, request.tokens, local.matched)
        return replace(reply, remote=more.more, remote_miss=more.miss, remote_detail=more.detail)

    return probed


def find_checkpoint(c: Context, request: m.FindCheckpoint) -> m.FindCheckpointReply:
    if c.peer.tenant:
        check_identity(c.peer, request, request.identity)
    found = c.tier.reads.find_checkpoint(
        c.peer.session, request.identity, request.key, request.prompt
    )
    if found is None:
        return m.FindCheckpointReply(id=request.id, matched=0, entry=None, lease=None)
    record, lease, fd = found
    return m.FindCheckpointReply(
        id=request.id, matched=record.token_count, entry=summary(record), lease=lease, fd=fd
    )


def forget_checkpoint(c: Context, request: m.ForgetCheckpoint) -> m.ForgetCheckpointReply:
    if c.peer.tenant:
        check_identity(c.peer, request, request.identity)
    removed = c.tier.reads.forget_checkpoint(request.identity, request.key)
    return m.ForgetCheckpointReply(id=request.id, removed=removed)


def release(c: Context, request: m.Release) -> m.ReleaseReply | Later:
    """Ends the lease. A release that reports damage is answered once the entry's file is
    checked (Waits.TASK_IN_ORDER, so that its answer keeps its place among the others)."""
    record = c.tier.reads.end_lease(c.peer.session, request.lease, request.report)
    damaged = request.damaged
    if damaged is None:
        return m.ReleaseReply(id=request.id)

    async def checked() -> m.ReleaseReply:
        await c.tier.reads.check_reported(c.peer.session, record, damaged)
        return m.ReleaseReply(id=request.id)

    return checked


# --- administration ---------------------------------------------------------------------------


def list_entries(c: Context, request: m.ListEntries) -> m.ListEntriesReply:
    if c.peer.tenant:
        if request.identity is None:
            # Picking a tenant's entries out of every identity's would cost a page a walk
            # of the tier: a tenant lists its identities one at a time.
            raise refused(
                c.peer, request, "every identity", "list one identity of yours (its digest)"
            )
        check_digest(c.tier.view, c.peer, request, request.identity)
    entries, more = c.tier.admin.list_entries(request.identity, request.limit, request.after)
    return m.ListEntriesReply(id=request.id, entries=tuple(entries), more=more)


def evict(c: Context, request: m.Evict) -> m.EvictReply:
    if not c.peer.admin:
        raise ProtocolError(
            ErrorCode.PERMISSION_DENIED, "evict needs the daemon's own user or root"
        )
    count, freed = c.tier.admin.evict(request.entry, request.identity, request.all)
    return m.EvictReply(id=request.id, evicted=count, bytes=freed)


async def verify(c: Context, request: m.Verify) -> m.VerifyReply:
    if request.repair and not c.peer.admin:
        raise ProtocolError(
            ErrorCode.PERMISSION_DENIED, "verify --repair needs the daemon's own user or root"
        )
    if c.peer.tenant and (digest := c.tier.view.identity_of(request.entry)):
        check_digest(c.tier.view, c.peer, request, digest)
    problem, quarantined = await c.tier.admin.verify(c.peer.session, request.entry, request.repair)
    return m.VerifyReply(id=request.id, problem=problem, quarantined=quarantined)


# --- the table ------------------------------------------------------------------------------

OPS: Final[Mapping[str, Op]] = MappingProxyType(
    {
        "hello": Op(hello),
        "ping": Op(ping),
        "status": Op(status),
        "put_begin": Op(awaited(put_begin), Waits.TASK),
        "put_blocks": Op(awaited(put_blocks), Waits.TASK),
        "put_commit": Op(awaited(put_commit), Waits.TASK),
        "put_abort": Op(put_abort),
        "ticket": Op(awaited(ticket), Waits.TASK),
        "flush": Op(awaited(flush), Waits.TASK),
        "lookup": Op(lookup, after_reply=book_lookups),
        "open_blocks": Op(open_blocks),
        "find_checkpoint": Op(find_checkpoint),
        "forget_checkpoint": Op(forget_checkpoint),
        # At once, unless it reports damage: then once the entry's file is checked.
        "release": Op(release, Waits.TASK_IN_ORDER),
        "list": Op(list_entries),
        "evict": Op(evict),
        "verify": Op(awaited(verify), Waits.TASK),
        "open_entry": Op(open_entry),
        # At once without a remote tier; with one, once the bucket is asked.
        "presence": Op(presence, Waits.TASK),
    }
)


def op_table(remote: Remote | None) -> Mapping[str, Op]:
    """The daemon's op table: OPS, with the lookup's handler wrapped by the remote tier's
    fetch when there is one (a lookup may then wait for it, in a task of its own)."""
    if remote is None:
        return OPS
    local = OPS["lookup"]
    wrapped = replace(local, handler=fetching(lookup), waits=Waits.TASK)
    return MappingProxyType({**OPS, "lookup": wrapped})
