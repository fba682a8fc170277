"""One engine's connection: bytes through the sans-I/O Connection, requests to the op table.

The session is the pump: it reads requests, hands each to its row of the op table
(kvd.serve.handlers) and sends the replies. Each connection is a task that serves its socket
from a callback of the event loop: the bytes are read as they arrive and a request that
waits for nothing (a ping, a lookup, a release...) is answered there and then, without a
task switch. What a request's answer may wait for (a put under the block policy, a commit's
validation, a ticket wait, a flush) runs as a task of its own, so that other requests on the
same connection are answered meanwhile; a reply the kernel cannot take at once, and an
answer its row wants in order (a release that checks a file), pause the reading until they
are done, so the replies of one connection keep the order of its requests. Whatever a
connection does, the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
from anyio.abc import TaskGroup
from kvd_protocol import messages as m
from kvd_protocol.connection import NEED_DATA, BadRequest, Connection, ConnectionClosed, Role
from kvd_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError

from kvd.logs import RateLimited, get_logger
from kvd.serve import socket_io
from kvd.serve.frame_budget import SMALL_FRAME_BYTES, FrameBudget
from kvd.serve.handouts import Handouts
from kvd.serve.op_row import Context, Later, Op, Waits, failed

log = get_logger("kvd.serve.session")
broken_rules = RateLimited(log)  # a client may break a rule as often as it likes

RECEIVE_BYTES = 1 << 16
RECEIVE_FDS = 4  # clients never send descriptors; room to catch and close stray ones
_RECEIVE_ANCILLARY = socket_io.ancillary_bytes(RECEIVE_FDS)


class Session:
    """The daemon's side of one engine's connection, from hello to hang-up.

    Reads bytes and descriptors off the socket into a server Connection, hands each request
    to its row of the op table (at once, or as a task of its own when its answer waits) and
    writes the replies back, one at a time. When the connection ends, its leases and
    unfinished puts end too (LifeCycle.end_session); a fatal protocol error is said with a final
    error first.
    """

    def __init__(
        self,
        context: Context,
        ops: Mapping[str, Op],
        stream: anyio.abc.SocketStream,
        frames: FrameBudget,
    ) -> None:
        self.context = context  # what the handlers answer from
        self.ops = ops
        self.peer = context.peer
        self.frames = frames  # partial frames' bytes, across connections
        self._buffered = 0  # this connection's share of them
        self._frame_timer: asyncio.TimerHandle | None = None  # a frame begun, not finished
        self.stream = stream
        self.sock = raw_socket(stream)  # read and written directly: see socket_io
        # Descriptors for replies not out yet, and out but maybe unread.
        self._handouts = Handouts(self.sock, self.peer.session, broken_rules)
        self.conn = Connection(Role.SERVER, context.tier.limits)
        # Held by a reply that must wait to go out whole (see socket_io.send).
        self._gate = socket_io.sending_gate()
        # A reply of the callback's that waits to go out (reading is paused meanwhile).
        self._outgoing: socket_io.Outgoing | None = None
        self._tasks: TaskGroup | None = None  # the connection's: answers that wait
        self._reading = False  # the reader callback is installed
        self._ended = anyio.Event()  # the peer is gone, or the connection failed
        self._fatal: ProtocolError | None = None  # to say before closing

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
            self.context.tier.life.end_session(self.peer.session)

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
        partial frames: between frames a connection may idle as long as it likes."""
        conn = self.conn
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
                    self._serve_request(event)
                elif isinstance(event, ConnectionClosed):
                    self._end()
        except RemoteProtocolError as exc:  # the peer's: said to it as the final error
            self._end(exc)
        except Exception:  # a daemon bug (a LocalProtocolError too): this connection only
            log.exception("session_failed", session=self.peer.session)
            self._end()

    def _serve_request(self, request: m.Request) -> None:
        """Hand request to its row of the op table: a reply is sent at once; what the handler
        hands back to await runs as a task, in order (reading paused) if the row says so."""
        asked = request.reply_descriptors()
        if asked and not self._handouts.may_hand_out(asked):
            self._reply(self._handouts.too_many(request))
            return
        op = self.ops[request.op]
        try:
            answer = op.handler(self.context, request)
        except Exception as exc:
            answer = failed(request, exc)
        if not isinstance(answer, m.Reply):
            if op.waits is Waits.TASK_IN_ORDER:
                self._pause_for(self._answer, op, answer, request, asked)
            else:
                assert self._tasks is not None
                self._tasks.start_soon(self._answer, op, answer, request, asked)
            return
        try:
            self._reply(answer)
        finally:
            self._answered(op, answer, asked)

    def _answered(self, op: Op, reply: m.Reply, asked: int) -> None:
        """reply is sent (or will never be): its descriptors count as handed out, and what
        only counts its request is done (Op.after_reply)."""
        self._handouts.handed_out(asked, reply)
        if op.after_reply is not None:
            op.after_reply(self.context)

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

    async def _answer(self, op: Op, later: Later, request: m.Request, asked: int) -> None:
        """A task's answer: awaited, then sent (the rest of it awaited too)."""
        try:
            reply = await later()
        except Exception as exc:
            reply = failed(request, exc)
        try:
            out = self._send(reply)
            if out is not None:
                await self._send_rest(out)
        finally:
            self._answered(op, reply, asked)

    def _reply(self, reply: m.Reply) -> None:
        """Send a reply from the callback; when the kernel does not take it whole, reading
        pauses while a task sends the rest."""
        out = self._send(reply)
        if out is not None:
            self._outgoing = out
            self._pause_for(self._send_outgoing)

    async def _send_outgoing(self) -> None:
        out = self._outgoing
        assert out is not None
        self._outgoing = None
        await self._send_rest(out)

    def _send(self, reply: m.Reply) -> socket_io.Outgoing | None:
        """The one way a reply goes out: as far as the kernel takes it now, without waiting.
        None when it went whole (the usual), or never will (_not_sent); else what is left,
        for _send_rest (which, after a frame part-way out before it, may be all of it)."""
        fds = reply.fds
        try:
            framed = self._frame(reply)
            if framed is None:
                return None
            unsent = socket_io.start(self.sock, *framed, self._gate)
            if unsent is None:
                return None
            fds = ()  # _send_rest closes them once they are sent
            return socket_io.Outgoing(unsent, reply.fds)
        except (socket_io.PeerGone, socket_io.DescriptorsRefused) as exc:
            self._not_sent(exc)
            return None
        finally:
            for fd in fds:
                os.close(fd)  # the engine holds its own copy now (or never will)

    async def _send_rest(self, out: socket_io.Outgoing) -> None:
        try:
            await socket_io.finish(self.sock, out.unsent, self._gate)
        except (socket_io.PeerGone, socket_io.DescriptorsRefused) as exc:
            self._not_sent(exc)
        finally:
            out.close()

    def _not_sent(self, exc: socket_io.PeerGone | socket_io.DescriptorsRefused) -> None:
        """A reply that could not go out: the peer is gone (nobody to tell), or its
        descriptors could not be passed (none of it went out): then the connection, whose
        replies no longer follow its requests, ends with an error that says why."""
        if isinstance(exc, socket_io.PeerGone):
            log.debug("reply_not_sent", session=self.peer.session, error=str(exc))
            return
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


def raw_socket(stream: anyio.abc.SocketStream) -> socket.socket:
    sock: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    return sock
