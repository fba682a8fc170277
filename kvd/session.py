"""One engine's connection: bytes through the sans-I/O Connection, requests to the tier.

Each connection is a task; a request that may wait (a put under the block policy, a commit's
validation, a ticket wait, a flush) runs as a task of its own so that other requests on the
same connection are answered meanwhile. Whatever a connection does, the server goes on.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from kvd_protocol import messages as m
from kvd_protocol.connection import NEED_DATA, BadRequest, Connection, ConnectionClosed, Role
from kvd_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError

from kvd import __version__, socket_io
from kvd.logs import get_logger
from kvd.peercred import PeerCredentials
from kvd.puts import DeclaredBlocks
from kvd.tier import Tier, summary

log = get_logger("kvd.session")

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
)
# Requests answered inline: they never wait, so ordering stays simple and latency low.
INLINE = frozenset(
    {
        "hello",
        "ping",
        "lookup",
        "find_checkpoint",
        "forget_checkpoint",
        "release",
        "status",
        "list",
        "evict",
        "put_abort",
        "open_blocks",
    }
)


@dataclass
class Peer:
    session: int
    credentials: PeerCredentials
    name: str = ""
    admin: bool = False  # the daemon's own uid or root: may evict


class Session:
    """The daemon's side of one engine's connection, from hello to hang-up.

    Reads bytes and descriptors off the socket into a server Connection, hands each request
    to its handler (inline, or as a task of its own when it may wait) and writes the replies
    back, one at a time. When the connection ends, its leases and unfinished puts end too
    (Tier.close_session); a fatal protocol error is said with a final error first.
    """

    def __init__(
        self,
        tier: Tier,
        stream: anyio.abc.SocketStream,
        peer: Peer,
        status: Callable[[], dict[str, object]],
    ) -> None:
        self.tier = tier
        self.stream = stream
        self.sock = raw_socket(stream)  # read and written directly: see socket_io
        self.peer = peer
        self.status = status
        self.conn = Connection(Role.SERVER, tier.limits)
        # Held by a reply that must wait to go out whole (see socket_io.send).
        self._send_lock = anyio.Lock(fast_acquire=True)
        # One handler per op; each takes its request and returns its reply.
        self._handlers: dict[str, Callable[[Any], Awaitable[m.Reply]]] = {
            "hello": self._hello,
            "ping": self._ping,
            "put_begin": self._put_begin,
            "put_blocks": self._put_blocks,
            "put_commit": self._put_commit,
            "put_abort": self._put_abort,
            "ticket": self._ticket,
            "lookup": self._lookup,
            "find_checkpoint": self._find_checkpoint,
            "forget_checkpoint": self._forget_checkpoint,
            "open_blocks": self._open_blocks,
            "release": self._release,
            "flush": self._flush,
            "status": self._status,
            "list": self._list,
            "evict": self._evict,
            "verify": self._verify,
        }

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                await self._receive_loop(tasks)
                tasks.cancel_scope.cancel()  # the peer is gone: nobody awaits those answers
        finally:
            self.tier.close_session(self.peer.session)

    async def _receive_loop(self, tasks: TaskGroup) -> None:
        while True:
            try:
                data, fds = await self._receive()
            except socket_io.PeerGone:
                return
            except TimeoutError:
                frame_timeout = self.tier.config.frame_timeout
                await self._fatal(
                    RemoteProtocolError(
                        ErrorCode.TIMEOUT, f"a frame begun and not finished in {frame_timeout:g} s"
                    )
                )
                return
            except socket_io.BadAncillary as exc:
                await self._fatal(RemoteProtocolError(ErrorCode.BAD_DESCRIPTORS, str(exc)))
                return
            try:
                self.conn.receive_data(data, fds)
            except ProtocolError as exc:
                for fd in fds:
                    os.close(fd)
                await self._fatal(exc)
                return
            while True:
                try:
                    event = self.conn.next_event()
                except ProtocolError as exc:
                    await self._fatal(exc)
                    return
                if event is NEED_DATA:
                    break
                if isinstance(event, ConnectionClosed):
                    return
                if isinstance(event, BadRequest):
                    await self._send(event.reply())
                elif isinstance(event, m.Request):
                    if event.op in INLINE:
                        await self._answer(event)
                    else:
                        tasks.start_soon(self._answer, event)

    async def _receive(self) -> tuple[bytes, list[int]]:
        """The next bytes from the peer. Between frames a connection may idle as long as it
        likes; inside one (part of a frame buffered), the rest must come within frame_timeout:
        TimeoutError otherwise."""
        if not self.conn.buffered_bytes:
            return await socket_io.receive(self.sock, RECEIVE_BYTES, _RECEIVE_ANCILLARY)
        with anyio.fail_after(self.tier.config.frame_timeout):
            return await socket_io.receive(self.sock, RECEIVE_BYTES, _RECEIVE_ANCILLARY)

    async def _fatal(self, exc: ProtocolError) -> None:
        """A fatal protocol error: say why, then close (the stream cannot be resynchronised)."""
        log.info("connection_error", session=self.peer.session, error=str(exc))
        frame = self.conn.send_final_error(exc.code, exc.message)
        with contextlib.suppress(socket_io.PeerGone):
            await socket_io.send(self.sock, frame, (), self._send_lock)

    async def _answer(self, request: m.Request) -> None:
        try:
            reply = await self._handlers[request.op](request)
        except ProtocolError as exc:
            reply = m.ErrorReply(id=request.id, code=exc.code, message=exc.message)
        except Exception as exc:  # a daemon bug or a failed file operation: this request only
            log.exception("request_failed", op=request.op)
            reply = m.ErrorReply(id=request.id, code=ErrorCode.INTERNAL, message=str(exc))
        await self._send(reply)

    async def _send(self, reply: m.Reply) -> None:
        fds = reply.fds
        try:
            if not self.conn.can_send:  # closing after a fatal error: nobody reads on
                log.debug("reply_not_sent", session=self.peer.session, op=reply.op)
                return
            frame, sent_fds = self._frame(reply)
            await socket_io.send(self.sock, frame, sent_fds, self._send_lock)
        except socket_io.PeerGone as exc:
            log.debug("reply_not_sent", session=self.peer.session, error=str(exc))
        finally:
            for fd in fds:
                os.close(fd)  # the engine holds its own copy now (or never will)

    def _frame(self, reply: m.Reply) -> tuple[bytes, tuple[int, ...]]:
        """The reply's frame and descriptors. A reply the protocol refuses (a daemon bug, or
        one over the frame limit) is logged as an error and its request gets that error."""
        try:
            return self.conn.send(reply), reply.fds
        except LocalProtocolError as exc:
            log.error("reply_refused", session=self.peer.session, op=reply.op, error=str(exc))
            if isinstance(reply, m.ErrorReply):
                raise
            error = m.ErrorReply(id=reply.id, code=exc.code, message=f"no reply: {exc.message}")
            return self.conn.send(error), ()

    # --- handlers: each takes its request and returns its reply --------------------------

    async def _hello(self, request: m.Hello) -> m.HelloReply:
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
            features=FEATURES,
        )

    async def _ping(self, request: m.Request) -> m.PingReply:
        return m.PingReply(id=request.id)

    async def _put_begin(self, request: m.PutBegin) -> m.PutBeginReply:
        self.tier.telemetry.prefill_reported(request.identity, request.prefill_cost)
        put, skip, fd = await self.tier.begin_put(
            self.peer.session,
            request.identity,
            request.tokens,
            request.size,
            DeclaredBlocks(request.hashes, request.block_tokens, request.block_size),
        )
        return m.PutBeginReply(
            id=request.id,
            put=put.id if put else 0,
            skip=skip,
            fd=fd,
            held=put.held if put else 0,
        )

    async def _put_blocks(self, request: m.PutBlocks) -> m.PutBlocksReply:
        fds = await self.tier.put_blocks(
            self.peer.session, request.put, request.first, request.count
        )
        return m.PutBlocksReply(id=request.id, count=len(fds), descriptors=tuple(fds))

    async def _open_blocks(self, request: m.OpenBlocks) -> m.OpenBlocksReply:
        fds = self.tier.open_blocks(self.peer.session, request.lease, request.first, request.count)
        return m.OpenBlocksReply(id=request.id, count=len(fds), descriptors=tuple(fds))

    async def _put_commit(self, request: m.PutCommit) -> m.PutCommitReply:
        ticket = await self.tier.commit_put(self.peer.session, request.put, request.store_ms)
        return m.PutCommitReply(id=request.id, ticket=ticket)

    async def _put_abort(self, request: m.PutAbort) -> m.PutAbortReply:
        self.tier.abort_put(self.peer.session, request.put)
        return m.PutAbortReply(id=request.id)

    async def _ticket(self, request: m.WaitTicket) -> m.TicketReply:
        state = await self.tier.wait_ticket(request.ticket, request.timeout)
        return m.TicketReply(
            id=request.id, ticket=request.ticket, state=state.state, reason=state.reason
        )

    async def _lookup(self, request: m.Lookup) -> m.LookupReply:
        found = self.tier.lookup(
            self.peer.session, request.identity, request.tokens, request.min_tokens
        )
        if found is None:
            return m.LookupReply(id=request.id, matched=0, entry=None, lease=None)
        match, lease, fd = found
        return m.LookupReply(
            id=request.id,
            matched=match.matched,
            entry=summary(match.record),
            lease=lease,
            fd=fd,
        )

    async def _find_checkpoint(self, request: m.FindCheckpoint) -> m.FindCheckpointReply:
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

    async def _forget_checkpoint(self, request: m.ForgetCheckpoint) -> m.ForgetCheckpointReply:
        removed = self.tier.forget_checkpoint(request.identity, request.key)
        return m.ForgetCheckpointReply(id=request.id, removed=removed)

    async def _release(self, request: m.Release) -> m.ReleaseReply:
        await self.tier.release(self.peer.session, request.lease, request.damaged, request.report)
        return m.ReleaseReply(id=request.id)

    async def _flush(self, request: m.Flush) -> m.FlushReply:
        durable, pending = await self.tier.flush(request.timeout)
        return m.FlushReply(id=request.id, durable=durable, pending=pending)

    async def _status(self, request: m.Request) -> m.StatusReply:
        return m.StatusReply(id=request.id, status=self.status())

    async def _list(self, request: m.ListEntries) -> m.ListEntriesReply:
        entries, more = self.tier.list_entries(request.identity, request.limit, request.after)
        return m.ListEntriesReply(id=request.id, entries=tuple(entries), more=more)

    async def _evict(self, request: m.Evict) -> m.EvictReply:
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
        problem, quarantined = await self.tier.verify(request.entry, request.repair)
        return m.VerifyReply(id=request.id, problem=problem, quarantined=quarantined)


def raw_socket(stream: anyio.abc.SocketStream) -> socket.socket:
    sock: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    return sock
