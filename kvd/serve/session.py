"""One engine's connection: bytes through the sans-I/O Connection, requests to the tier.

Each connection is a task that serves its socket from a callback of the event loop: the
bytes are read as they arrive and a request that never waits (a ping, a lookup, a release...)
is answered there and then, without a task switch. A request that may wait (a put under the
block policy, a commit's validation, a ticket wait, a flush) runs as a task of its own, so
that other requests on the same connection are answered meanwhile; a reply the kernel cannot
take at once, and a release that checks a file, pause the reading until they are done, so
the replies of one connection keep the order of its requests. Whatever a connection does,
the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup
from kvd_protocol import messages as m
from kvd_protocol.connection import NEED_DATA, BadRequest, Connection, ConnectionClosed, Role
from kvd_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from kvd_protocol.identity import Identity

from kvd import __version__
from kvd.logs import RateLimited, get_logger
from kvd.remote.remote import Remote
from kvd.serve import socket_io
from kvd.serve.frame_budget import SMALL_FRAME_BYTES, FrameBudget
from kvd.serve.handouts import Handouts, descriptors_asked
from kvd.serve.peer import Peer
from kvd.serve.status import tenant_report
from kvd.store.miss_reasons import Miss
from kvd.store.staged_put import DeclaredBlocks
from kvd.store.tier import Tier, summary

log = get_logger("kvd.serve.session")
broken_rules = RateLimited(log)  # a client may break a rule as often as it likes

RECEIVE_BYTES = 1 << 16
RECEIVE_FDS = 4  # clients never send descriptors; room to catch and close stray ones
_RECEIVE_ANCILLARY = socket_io.ancillary_bytes(RECEIVE_FDS)
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
)
REMOTE_FEATURES = (*FEATURES, m.REMOTE_FETCH_FEATURE)  # a daemon with a remote tier's


def _waits_for_a_fetch(asked: m.Request, remote: Remote | None, tenant: str) -> bool:
    """A lookup that may wait for a fetch from the remote tier: a task (Remote.lookup_waits)."""
    return type(asked) is m.Lookup and remote is not None and remote.lookup_waits(asked, tenant)


class Session:
    """The daemon's side of one engine's connection, from hello to hang-up.

    Reads bytes and descriptors off the socket into a server Connection, hands each request
    to its handler (at once, in order, or as a task of its own when it may wait) and writes
    the replies back, one at a time. When the connection ends, its leases and unfinished puts
    end too (Tier.close_session); a fatal protocol error is said with a final error first.
    """

    def __init__(
        self,
        tier: Tier,
        stream: anyio.abc.SocketStream,
        peer: Peer,
        status: Callable[[], dict[str, object]],
        frames: FrameBudget,
        *,
        remote: Remote | None = None,
    ) -> None:
        self.tier = tier
        self.remote = remote  # the remote tier, when `remote` is set
        self.frames = frames  # partial frames' bytes, across connections
        self._buffered = 0  # this connection's share of them
        self._frame_timer: asyncio.TimerHandle | None = None  # a frame begun, not finished
        self.stream = stream
        self.sock = raw_socket(stream)  # read and written directly: see socket_io
        self.peer = peer
        # Descriptors for replies not out yet, and out but maybe unread.
        self._handouts = Handouts(self.sock, peer.session, broken_rules)
        self.status = status
        self.conn = Connection(Role.SERVER, tier.limits)
        # Held by a reply that must wait to go out whole (see socket_io.send).
        self._gate = socket_io.sending_gate()
        # A reply of the callback's that waits to go out (reading is paused meanwhile).
        self._outgoing: socket_io.Outgoing | None = None
        self._tasks: TaskGroup | None = None  # the connection's: requests that wait
        self._reading = False  # the reader callback is installed
        self._ended = anyio.Event()  # the peer is gone, or the connection failed
        self._fatal: ProtocolError | None = None  # to say before closing
        # The requests that never wait: each handler takes its request, returns its reply
        # (None: a task it started answers, with reading paused meanwhile; see _release).
        self._at_once: dict[str, Callable[[Any], m.Reply | None]] = {
            "hello": self._hello,
            "ping": self._ping,
            "lookup": self._lookup,
            "find_checkpoint": self._find_checkpoint,
            "forget_checkpoint": self._forget_checkpoint,
            "open_blocks": self._open_blocks,
            "release": self._release,
            "put_abort": self._put_abort,
            "status": self._status,
            "list": self._list,
            "evict": self._evict,
        }
        # The requests that may wait (a task each).
        self._waiting: dict[str, Callable[[Any], Awaitable[m.Reply]]] = {
            "put_begin": self._put_begin,
            "put_blocks": self._put_blocks,
            "put_commit": self._put_commit,
            "ticket": self._ticket,
            "flush": self._flush,
            "verify": self._verify,
            "lookup": self._lookup_fetched,  # one that may wait for a fetch (_waits_for_a_fetch)
        }

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                await self._serve()
                tasks.cancel_scope.cancel()  # the peer is gone: nobody awaits those answers
        finally:
            if self._outgoing is not None:  # its task never ran
                self._outgoing.close()
            self.frames.hold(self._buffered, 0)
            self._buffered = 0
            self.tier.close_session(self.peer.session)

    async def _serve(self) -> None:
        """Read from the callback until the connection ends; then say a fatal error, if any."""
        self._resume()
        try:
            await self._ended.wait()
        finally:
            self._end()  # also when cancelled: no task's _resume reads on after this
        if self._fatal is not None:
            await self._say_fatal(self._fatal)

    # --- the reader callback ------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            data, fds = socket_io.receive_now(self.sock, RECEIVE_BYTES, _RECEIVE_ANCILLARY)
        except BlockingIOError:
            return
        except socket_io.PeerGone:
            self._end()
            return
        except socket_io.BadAncillary as exc:
            self._end(RemoteProtocolError(ErrorCode.BAD_DESCRIPTORS, str(exc)))
            return
        try:
            self.conn.receive_data(data, fds)
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            if isinstance(exc, ProtocolError):
                self._end(exc)
            else:  # a daemon bug: this connection only (asyncio would log it and read on)
                log.exception("session_failed", session=self.peer.session)
                self._end()
            return
        self._serve_events()

    def _serve_events(self) -> None:
        """Answer what the Connection holds, until it needs more bytes or reading is paused
        (then what is left waits for _resume). A frame left part-way must be finished within
        frame_timeout of its first byte, and its bytes fit the budget of all connections'
        partial frames: between frames a connection may idle as long as it likes. What only
        counts a request (Tier.book_lookups) waits until its reply is sent."""
        conn, tier, tenant = self.conn, self.tier, self.peer.tenant
        try:
            while self._reading:
                event = conn.next_event()
                if event is NEED_DATA:
                    if self._buffered or conn.buffered_bytes:
                        self._frame_partway()
                    return
                if self._frame_timer is not None:  # a frame finished: the next has its own
                    self._frame_timer.cancel()
                    self._frame_timer = None
                if type(event) is BadRequest:
                    self._reply(event.reply())
                elif isinstance(event, m.Request):
                    asked = descriptors_asked(event)
                    if asked and not self._handouts.may_hand_out(asked):
                        self._reply(self._handouts.too_many(event))
                        continue
                    handler = self._at_once.get(event.op)
                    if handler is None or _waits_for_a_fetch(event, self.remote, tenant):
                        assert self._tasks is not None
                        self._tasks.start_soon(self._answer, self._waiting[event.op], event, asked)
                        continue
                    try:
                        reply = handler(event)
                    except Exception as exc:
                        reply = _failed(event, exc)
                    if reply is None:  # answered by a task the handler started
                        continue
                    try:
                        self._reply(reply)
                    finally:
                        self._handouts.handed_out(asked, reply)
                        if tier.unbooked:  # a call fewer for every other request
                            tier.book_lookups()
                elif isinstance(event, ConnectionClosed):
                    self._end()
        except RemoteProtocolError as exc:  # the peer's: said to it as the final error
            self._end(exc)
        except Exception:  # a daemon bug (a LocalProtocolError too): this connection only
            log.exception("session_failed", session=self.peer.session)
            self._end()

    def _frame_partway(self) -> None:
        """A frame is part-way in (or was, and the peer's bytes ran out): the bytes it will
        take once whole (its declared length) are held against the budget of every
        connection's partial frames from its first read on, unless it is small, and the time
        it may take is counted from its first byte, not from each read (a byte at a time
        holds no more)."""
        partial = self.conn.partial_frame_bytes
        counted = partial if partial > SMALL_FRAME_BYTES else 0
        fits = self.frames.hold(self._buffered, counted)
        self._buffered = counted
        if not fits:
            broken_rules.warning("frame_budget_exceeded", session=self.peer.session, bytes=counted)
            self._end(
                RemoteProtocolError(
                    ErrorCode.OVER_LIMIT,
                    f"partial frames of all connections hold {self.frames.buffered} bytes, over "
                    f"kvd's budget of {self.frames.limit}: this frame of yours was not taken",
                )
            )
        elif not partial and self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None
        elif partial and self._frame_timer is None:
            timeout = self.frames.timeout
            loop = asyncio.get_running_loop()
            self._frame_timer = loop.call_later(timeout, self._frame_timed_out)

    def _frame_timed_out(self) -> None:
        self._frame_timer = None
        frame_timeout = self.frames.timeout
        broken_rules.warning("frame_timed_out", session=self.peer.session)
        self._end(
            RemoteProtocolError(
                ErrorCode.TIMEOUT, f"a frame begun and not finished in {frame_timeout:g} s"
            )
        )

    def _resume(self) -> None:
        """Answer what is buffered, then read on."""
        if self._ended.is_set():
            return
        self._reading = True
        socket_io.on_readable(self.sock, self._on_readable)
        self._serve_events()

    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            socket_io.stop_reading(self.sock)
        if self._frame_timer is not None:  # not the peer's delay while the daemon waits
            self._frame_timer.cancel()
            self._frame_timer = None

    def _pause_for(self, work: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Stop reading until work(*args), run as a task, is done."""
        self._pause()
        assert self._tasks is not None
        self._tasks.start_soon(self._then_resume, work, *args)

    async def _then_resume(self, work: Callable[..., Awaitable[None]], *args: Any) -> None:
        await work(*args)
        self._resume()

    def _end(self, fatal: ProtocolError | None = None) -> None:
        """The connection ends (after saying fatal, if given)."""
        if not self._ended.is_set():
            self._fatal = fatal
            self._ended.set()
        self._pause()

    async def _say_fatal(self, exc: ProtocolError) -> None:
        """A fatal protocol error: say why, then close (the stream cannot be resynchronised)."""
        log.info("connection_error", session=self.peer.session, error=str(exc))
        frame = self.conn.send_final_error(exc.code, exc.message)
        with contextlib.suppress(socket_io.PeerGone):
            await socket_io.send(self.sock, frame, (), self._gate)

    # --- answering ----------------------------------------------------------------------------

    async def _answer(
        self, handler: Callable[[Any], Awaitable[m.Reply]], request: m.Request, asked: int = 0
    ) -> None:
        try:
            reply = await handler(request)
        except Exception as exc:
            reply = _failed(request, exc)
        try:
            await self._send(reply)
        finally:
            self._handouts.handed_out(asked, reply)

    def _reply(self, reply: m.Reply) -> None:
        """Send a reply from the callback: at once when the kernel takes it whole (the
        usual); else reading pauses while a task sends the rest (or all of it, after the
        frame part-way out before it)."""
        fds = reply.fds
        try:
            framed = self._frame(reply)
            if framed is None:
                return
            unsent = socket_io.start(self.sock, *framed, self._gate)
            if unsent is None:
                return
            self._outgoing = socket_io.Outgoing(unsent, fds)
            fds = ()  # the task closes them once they are sent
            self._pause_for(self._send_outgoing)
        except socket_io.PeerGone as exc:
            log.debug("reply_not_sent", session=self.peer.session, error=str(exc))
        except socket_io.DescriptorsRefused as exc:
            self._descriptors_refused(exc)
        finally:
            for fd in fds:
                os.close(fd)  # the engine holds its own copy now (or never will)

    async def _send_outgoing(self) -> None:
        out = self._outgoing
        assert out is not None
        try:
            await socket_io.finish(self.sock, out.unsent, self._gate)
        except socket_io.PeerGone as exc:
            log.debug("reply_not_sent", session=self.peer.session, error=str(exc))
        except socket_io.DescriptorsRefused as exc:
            self._descriptors_refused(exc)
        finally:
            self._outgoing = None
            out.close()

    async def _send(self, reply: m.Reply) -> None:
        fds = reply.fds
        try:
            framed = self._frame(reply)
            if framed is not None:
                await socket_io.send(self.sock, *framed, self._gate)
        except socket_io.PeerGone as exc:
            log.debug("reply_not_sent", session=self.peer.session, error=str(exc))
        except socket_io.DescriptorsRefused as exc:
            self._descriptors_refused(exc)
        finally:
            for fd in fds:
                os.close(fd)  # the engine holds its own copy now (or never will)

    def _descriptors_refused(self, exc: socket_io.DescriptorsRefused) -> None:
        """A reply's descriptors could not be passed (none of it went out): the connection,
        whose replies no longer follow its requests, ends with an error that says why."""
        broken_rules.warning("descriptors_not_passed", session=self.peer.session, error=str(exc))
        self._end(
            ProtocolError(
                ErrorCode.REFUSED, f"kvd could not pass a reply's descriptors now ({exc})"
            )
        )

    def _frame(self, reply: m.Reply) -> tuple[bytes, tuple[int, ...]] | None:
        """The reply's frame and the descriptors to go with it (the reply's own); None
        once closing after a fatal error (nobody reads on). A reply the protocol refuses (a
        daemon bug, or one over the frame limit) is logged as an error and its request gets
        that error."""
        if not self.conn.can_send:
            log.debug("reply_not_sent", session=self.peer.session, op=reply.op)
            return None
        try:
            return self.conn.send(reply), reply.fds
        except LocalProtocolError as exc:
            log.error("reply_refused", session=self.peer.session, op=reply.op, error=str(exc))
            if isinstance(reply, m.ErrorReply):
                raise
            error = m.ErrorReply(id=reply.id, code=exc.code, message=f"no reply: {exc.message}")
            return self.conn.send(error), ()

    # --- handlers: each takes its request and returns its reply --------------------------

    def _hello(self, request: m.Hello) -> m.HelloReply:
        if request.protocol != m.PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"this daemon speaks protocol {m.PROTOCOL_VERSION}, not {request.protocol}",
            )
        self.peer.name = request.client
        return m.HelloReply(
            id=request.id,
            protocol=m.PROTOCOL_VERSION,
            server=__version__,
            limits=self.tier.limits,
            features=FEATURES if self.remote is None else REMOTE_FEATURES,
            tenant=self.peer.tenant,
        )

    def _ping(self, request: m.Request) -> m.PingReply:
        return m.PingReply(id=request.id)

    async def _put_begin(self, request: m.PutBegin) -> m.PutBeginReply:
        if self.peer.tenant:
            self._check_identity(request, request.identity)
        self.peer.named(request.identity.digest())
        put, skip, fd = await self.tier.begin_put(
            self.peer.session,
            request.identity,
            request.tokens,
            request.size,
            DeclaredBlocks(request.hashes, request.block_tokens, request.block_size),
            prefill_cost=request.prefill_cost,
        )
        return m.PutBeginReply(
            id=request.id,
            put=put.id if put else 0,
            skip=skip,
            fd=fd,
            held=put.held_blocks if put else 0,
        )

    async def _put_blocks(self, request: m.PutBlocks) -> m.PutBlocksReply:
        fds = await self.tier.put_blocks(
            self.peer.session, request.put, request.first, request.count
        )
        return m.PutBlocksReply(id=request.id, count=len(fds), descriptors=tuple(fds))

    def _open_blocks(self, request: m.OpenBlocks) -> m.OpenBlocksReply:
        fds = self.tier.open_blocks(self.peer.session, request.lease, request.first, request.count)
        return m.OpenBlocksReply(id=request.id, count=len(fds), descriptors=tuple(fds))

    async def _put_commit(self, request: m.PutCommit) -> m.PutCommitReply:
        ticket = await self.tier.commit_put(
            self.peer.session, request.put, request.store_ms, request.dropped
        )
        return m.PutCommitReply(id=request.id, ticket=ticket)

    def _put_abort(self, request: m.PutAbort) -> m.PutAbortReply:
        self.tier.abort_put(self.peer.session, request.put)
        return m.PutAbortReply(id=request.id)

    async def _ticket(self, request: m.WaitTicket) -> m.TicketReply:
        state = await self.tier.wait_ticket(request.ticket, request.timeout)
        return m.TicketReply(
            id=request.id, ticket=request.ticket, state=state.state, reason=state.reason
        )

    async def _lookup_fetched(self, request: m.Lookup) -> m.LookupReply:
        """A lookup answered once the fetch it may wait for is done (or out of time), or told
        to ask again after it: fetching, the seconds the fetch has left."""
        if self.peer.tenant:
            self._check_identity(request, request.identity)
        if self.remote and (left := await self.remote.fetch_for(request)) is not None:
            return m.LookupReply(id=request.id, matched=0, entry=None, lease=None, fetching=left)
        reply = self._lookup(request)
        self.tier.book_lookups()  # no other request's reply to go first
        return reply

    def _lookup(self, request: m.Lookup) -> m.LookupReply:
        if self.peer.tenant:
            self._check_identity(request, request.identity)
        self.peer.named(request.identity.digest())
        found = self.tier.lookup(
            self.peer.session,
            request.identity,
            request.tokens,
            request.min_tokens,
            self.peer.tenant,
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
            id=request.id,
            matched=match.matched,
            entry=summary(match.record),
            lease=lease,
            fd=fd,
        )

    def _find_checkpoint(self, request: m.FindCheckpoint) -> m.FindCheckpointReply:
        if self.peer.tenant:
            self._check_identity(request, request.identity)
        found = self.tier.find_checkpoint(
            self.peer.session, request.identity, request.key, request.prompt
        )
        if found is None:
            return m.FindCheckpointReply(id=request.id, matched=0, entry=None, lease=None)
        record, lease, fd = found
        return m.FindCheckpointReply(
            id=request.id,
            matched=record.token_count,
            entry=summary(record),
            lease=lease,
            fd=fd,
        )

    def _forget_checkpoint(self, request: m.ForgetCheckpoint) -> m.ForgetCheckpointReply:
        if self.peer.tenant:
            self._check_identity(request, request.identity)
        removed = self.tier.forget_checkpoint(request.identity, request.key)
        return m.ForgetCheckpointReply(id=request.id, removed=removed)

    def _check_identity(self, request: m.Request, identity: Identity) -> None:
        """PERMISSION_DENIED unless identity is under the peer's tenant."""
        if not identity.namespace.startswith(self.peer.tenant):
            raise self._refused(request, f"namespace {identity.namespace!r}")

    def _check_digest(self, request: m.Request, digest: str) -> None:
        """PERMISSION_DENIED unless the identity of digest is under the peer's tenant, as
        its names say (learnt from a request naming it, or from an entry's header at start).
        One without entries shows nothing: it passes. One whose names are unknown does not."""
        if not self.tier.holds(digest):
            return
        namespace = self.tier.namespace_of(digest)
        if namespace is None:
            raise self._refused(request, f"identity {digest}, whose namespace kvd does not know")
        if not namespace.startswith(self.peer.tenant):
            raise self._refused(request, f"identity {digest} (namespace {namespace!r})")

    def _refused(
        self, request: m.Request, named: str, instead: str = "name identities under it"
    ) -> ProtocolError:
        """A request of a tenant's that reaches beyond it: logged (rate-limited) and told."""
        peer = self.peer
        broken_rules.warning(
            "identity_not_the_tenants",
            session=peer.session,
            uid=peer.credentials.uid,
            op=request.op,
            tenant=peer.tenant,
        )
        return ProtocolError(
            ErrorCode.PERMISSION_DENIED,
            f"{request.op}: {named} is not under this connection's tenant {peer.tenant!r} "
            f"(uid {peer.credentials.uid}, the hello reply's tenant): {instead}",
        )

    def _release(self, request: m.Release) -> m.ReleaseReply | None:
        """Ends the lease. A release that reports damage is answered once the entry's file is
        checked, with the connection's reading paused meanwhile, so that its answer keeps its
        place among the others (None: that task answers)."""
        record = self.tier.end_lease(self.peer.session, request.lease, request.report)
        damaged = request.damaged
        if damaged is None:
            return m.ReleaseReply(id=request.id)

        async def check(request: m.Release) -> m.ReleaseReply:
            await self.tier.check_reported(self.peer.session, record, damaged)
            return m.ReleaseReply(id=request.id)

        self._pause_for(self._answer, check, request)
        return None

    async def _flush(self, request: m.Flush) -> m.FlushReply:
        if not request.remote:
            durable, pending = await self.tier.flush(request.timeout)
            return m.FlushReply(id=request.id, durable=durable, pending=pending)
        if self.remote is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this kvd has no remote tier (`remote`)")
        flushed = await self.remote.flush(request.timeout)
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

    def _status(self, request: m.Request) -> m.StatusReply:
        status = self.status()
        if self.peer.tenant:  # another user's: its own part of it
            known = {d: t.identity for d, t in self.tier.telemetry.identities.items()}
            status = tenant_report(status, self.peer, known)
        return m.StatusReply(id=request.id, status=status)

    def _list(self, request: m.ListEntries) -> m.ListEntriesReply:
        if self.peer.tenant:
            if request.identity is None:
                # Picking a tenant's entries out of every identity's would cost a page a walk
                # of the tier: a tenant lists its identities one at a time.
                raise self._refused(
                    request, "every identity", "list one identity of yours (its digest)"
                )
            self._check_digest(request, request.identity)
        entries, more = self.tier.list_entries(request.identity, request.limit, request.after)
        return m.ListEntriesReply(id=request.id, entries=tuple(entries), more=more)

    def _evict(self, request: m.Evict) -> m.EvictReply:
        if not self.peer.admin:
            raise ProtocolError(
                ErrorCode.PERMISSION_DENIED, "evict needs the daemon's own user or root"
            )
        count, freed = self.tier.evict(request.entry, request.identity, request.all)
        return m.EvictReply(id=request.id, evicted=count, bytes=freed)

    async def _verify(self, request: m.Verify) -> m.VerifyReply:
        if request.repair and not self.peer.admin:
            raise ProtocolError(
                ErrorCode.PERMISSION_DENIED, "verify --repair needs the daemon's own user or root"
            )
        if self.peer.tenant and (digest := self.tier.identity_of(request.entry)):
            self._check_digest(request, digest)
        problem, quarantined = await self.tier.verify(
            self.peer.session, request.entry, request.repair
        )
        return m.VerifyReply(id=request.id, problem=problem, quarantined=quarantined)


def _failed(request: m.Request, exc: Exception) -> m.ErrorReply:
    """The reply to a request whose handler raised exc: a ProtocolError's code, else (a daemon
    bug or a failed file operation: this request only) internal, logged. A bound of the
    connection's that the request broke (over_limit) is logged too, at most every so often."""
    if isinstance(exc, ProtocolError):
        if exc.code is ErrorCode.OVER_LIMIT:
            broken_rules.warning("request_over_limit", op=request.op, error=exc.message)
        return m.ErrorReply(id=request.id, code=exc.code, message=exc.message)
    log.exception("request_failed", op=request.op)
    return m.ErrorReply(id=request.id, code=ErrorCode.INTERNAL, message=str(exc))


def raw_socket(stream: anyio.abc.SocketStream) -> socket.socket:
    sock: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    return sock
