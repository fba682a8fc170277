"""One end of a kvd connection as a sans-I/O state machine: bytes and descriptors in, events out.

In the manner of h11: the caller moves bytes (send() returns them; receive_data() takes them)
and descriptors (a reply's `fds` go out in the same sendmsg as its frame; received ones are
passed to receive_data()). The Connection never touches a socket and never closes a descriptor.
See PROTOCOL.md for the rules it enforces: what may happen when is one table of transitions
(connection_states.py); what it raises follows the one rule of errors.py's ProtocolError.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final, Literal, NoReturn, TypeAlias

from .connection_states import INITIAL, TRANSITIONS, State, Step, refusal
from .connection_states import Role as Role  # noqa: PLC0414 - re-exported: importers read it here
from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .framing import FrameReader, FrameWriter, decode_body
from .limits import DEFAULT_LIMITS, Limits
from .messages import (
    U32,
    ErrorReply,
    Hello,
    HelloReply,
    Message,
    Reply,
    Request,
)
from .ops import OPS, decode_request, peek_id


class NeedData(Enum):
    NEED_DATA = "need_data"


NEED_DATA: Final = NeedData.NEED_DATA  # next_event(): no complete frame yet, receive more


@dataclass(frozen=True)
class BadRequest:
    """Server side: a frame that is not a valid request. Answer it with reply(); the
    connection goes on."""

    id: int  # 0 when the request's id could not be read
    code: ErrorCode
    message: str

    def reply(self) -> ErrorReply:
        return ErrorReply(id=self.id, code=self.code, message=self.message)


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer ended the stream (receive_data(b"")) at a frame boundary."""


Event: TypeAlias = Request | Reply | BadRequest | ConnectionClosed

_SENDING: Final = frozenset({State.HELLO_FIRST, State.OPEN})  # this side may still send


# What sending (or receiving) a message is to the machine of the side that sends it, by the
# message's class: one of OPS's, or an error reply.
_STEPS: Final[Mapping[type[Message], Step]] = {
    **{op.request: Step.REQUEST for op in OPS.values()},
    **{op.reply: Step.REPLY for op in OPS.values()},
    Hello: Step.HELLO,
    ErrorReply: Step.REPLY,
}


def _step_of(message: Message) -> Step:
    step = _STEPS.get(type(message))
    if step is None:
        raise LocalProtocolError(ErrorCode.BAD_MESSAGE, f"not a message: {type(message).__name__}")
    return step


def _check_id(message: Message, lo: int) -> None:
    value = message.id
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= U32:
        raise LocalProtocolError(ErrorCode.BAD_MESSAGE, f"message id {value!r} outside {lo}..{U32}")


class Connection:
    """The protocol state of one connection, for a client or a server: the two machines of
    connection_states.py, and the requests in flight."""

    def __init__(self, role: Role, limits: Limits = DEFAULT_LIMITS) -> None:
        self.role = role
        self._client = role is Role.CLIENT
        self._peer = Role.SERVER if self._client else Role.CLIENT
        self.limits = limits  # a client adopts the server's limits from the hello reply
        self._reader = FrameReader(limits.max_frame_bytes)
        self._writer = FrameWriter(limits.max_frame_bytes)
        self._states = dict(INITIAL)  # each side's machine, by the role that sends
        self._in_flight: dict[int, str] = {}  # request id -> op, awaiting a reply
        self._claims: dict[int, int] = {}  # request id in flight -> its reply's most descriptors
        self._claimable = 0  # the sum of _claims
        self._unanswered: list[int] = []  # server: ids of BadRequest events not yet answered
        self._fds: deque[int] = deque()  # client: received descriptors not yet claimed
        self._error: ProtocolError | None = None  # the fatal one, once both machines FAILED

    # --- state, for callers and tests ---

    @property
    def states(self) -> Mapping[Role, State]:
        """The state of each side's machine."""
        return dict(self._states)

    @property
    def in_flight(self) -> Mapping[int, str]:
        """Request ids awaiting a reply, with their op."""
        return dict(self._in_flight)

    @property
    def buffered_bytes(self) -> int:
        """Received bytes not yet returned in an event (at most one partial frame once
        next_event() has returned NEED_DATA)."""
        return self._reader.buffered

    @property
    def partial_frame_bytes(self) -> int:
        """Once next_event() has returned NEED_DATA: the bytes the partial frame buffered will
        take once whole (its declared length, as soon as that is in), 0 between frames."""
        return self._reader.partial_frame_bytes

    @property
    def failed(self) -> bool:
        """True once a fatal ProtocolError was raised: every later call raises."""
        return self._error is not None

    @property
    def can_send(self) -> bool:
        """False once failed or once the final error was sent: nothing more goes out."""
        return self._states[self.role] in _SENDING

    def take_descriptors(self) -> list[int]:
        """Client: every received descriptor not yet handed out in a reply, for the caller to
        close (after a ProtocolError, or when giving up on the connection). Works when failed."""
        fds = list(self._fds)
        self._fds.clear()
        return fds

    # --- the table ---

    def _after(self, role: Role, step: Step) -> State:
        """The state role's machine takes on step (set by the caller once the step is done);
        raises the refusal when the table has no such transition."""
        state = self._states[role]
        after = TRANSITIONS.get((role, state, step))
        if after is None:
            kind = LocalProtocolError if role is self.role else RemoteProtocolError
            if state is State.FAILED:
                raise self._unusable(kind)
            raise kind(*refusal(role, state, step))
        return after

    # --- sending ---

    def send(self, message: Message) -> bytes:
        """The frame for message, after checking it is allowed now (if not: the rule of
        errors.py's ProtocolError)."""
        after = self._after(self.role, _step_of(message))
        # The table lets a client send requests only, and a server replies only.
        if self._client:
            self._check_request(message)
            frame = self._frame(message)
            self._states[Role.CLIENT] = after
            self._enter(message)  # type: ignore[arg-type]
        else:
            self._check_reply(message)  # type: ignore[arg-type]
            frame = self._frame(message)
            self._settle(message)  # type: ignore[arg-type]  # the server's machine stays OPEN
        return frame

    def send_final_error(self, code: ErrorCode, message: str) -> bytes:
        """Server: the frame of a last error reply (id 0), said before closing: after a fatal
        RemoteProtocolError, or to turn a peer away. Allowed in any state, once; every send
        after it raises LocalProtocolError."""
        after = self._after(self.role, Step.FINAL_ERROR)
        frame = self._frame(ErrorReply(id=0, code=code, message=message))
        self._states[self.role] = after
        return frame

    def _check_request(self, request: Message) -> None:
        _check_id(request, 1)
        if request.id in self._in_flight:
            raise LocalProtocolError(
                ErrorCode.DUPLICATE_ID, f"request id {request.id} is in flight"
            )
        if len(self._in_flight) >= self.limits.max_in_flight:
            raise LocalProtocolError(
                ErrorCode.TOO_MANY_IN_FLIGHT,
                f"{len(self._in_flight)} requests in flight, the limit",
            )

    def _check_reply(self, reply: Reply) -> None:
        is_error = type(reply) is ErrorReply  # ErrorReply has no subclasses
        _check_id(reply, 0 if is_error else 1)
        fds, count = reply.fds, reply.descriptor_count()
        if len(fds) != count or (fds and not all(isinstance(fd, int) and fd >= 0 for fd in fds)):
            raise LocalProtocolError(
                ErrorCode.BAD_DESCRIPTORS,
                f"{reply.op} reply holds {fds}, needs {count} descriptor(s)",
            )
        if len(fds) > self._claims.get(reply.id, 0):
            raise LocalProtocolError(
                ErrorCode.BAD_DESCRIPTORS,
                f"{reply.op} reply holds {len(fds)} descriptor(s), more than its request asked",
            )
        if is_error:
            if reply.id in self._unanswered or reply.id in self._in_flight:
                return
            if reply.id == 0:  # a notice not tied to any request
                return
        elif self._in_flight.get(reply.id) == reply.op:
            return
        raise LocalProtocolError(
            ErrorCode.UNEXPECTED_REPLY,
            f"no {reply.op!r} request with id {reply.id} awaits a reply",
        )

    def _settle(self, reply: Reply) -> None:
        """Server: the request (or bad request) reply answers is answered."""
        if type(reply) is ErrorReply and reply.id in self._unanswered:
            self._unanswered.remove(reply.id)
        else:
            self._leave(reply.id)

    def _enter(self, request: Request) -> None:
        """request is in flight, and its reply may claim its descriptors."""
        self._in_flight[request.id] = request.op
        claim = request.reply_descriptors()
        if claim:
            self._claims[request.id] = claim
            self._claimable += claim

    def _leave(self, request_id: int) -> str | None:
        """The op of the request answered now (None if none was in flight with that id)."""
        self._claimable -= self._claims.pop(request_id, 0)
        return self._in_flight.pop(request_id, None)

    # --- receiving ---

    def receive_data(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Bytes (and the descriptors of the same recvmsg) from the peer; b"" is the end of the
        stream. Call next_event() until NEED_DATA before feeding more.

        A server raises BAD_DESCRIPTORS for any descriptor and keeps none (the caller closes
        them). A client queues them first, so take_descriptors() returns them on any error."""
        if self._error is not None:
            raise self._unusable(RemoteProtocolError)
        if fds:
            if self._client:
                self._fds.extend(fds)
            try:
                self._states[self._peer] = self._after(self._peer, Step.DESCRIPTORS)
            except RemoteProtocolError as exc:
                self._fail(exc)
        if self._reader.ended and (data or fds):
            self._fail(RemoteProtocolError(ErrorCode.BAD_FRAME, "data after the end of the stream"))
        if self._fds and len(self._fds) > self._claimable:
            self._fail(
                RemoteProtocolError(
                    ErrorCode.BAD_DESCRIPTORS,
                    f"{len(self._fds)} descriptors queued, the replies awaited claim at most "
                    f"{self._claimable}",
                )
            )
        if data:
            self._reader.feed(data)
        else:
            self._reader.ended = True

    def next_event(self) -> Event | Literal[NeedData.NEED_DATA]:
        """The next event, or NEED_DATA. Raises ProtocolError only for fatal errors: a
        RemoteProtocolError for what the peer sent; a LocalProtocolError for a server that
        left max_in_flight bad requests unanswered."""
        if self._error is not None:
            raise self._unusable(RemoteProtocolError)
        try:
            view = self._reader.next_frame()
            if view is None:  # no complete frame: more bytes are needed, or the stream ended
                if self._fds and not self._reader.buffered:
                    raise RemoteProtocolError(
                        ErrorCode.BAD_DESCRIPTORS,
                        f"{len(self._fds)} descriptor(s) arrived that no reply declares",
                    )
                if not self._reader.ended:
                    return NEED_DATA
                if self._reader.buffered:
                    raise RemoteProtocolError(
                        ErrorCode.BAD_FRAME, "the stream ended inside a frame"
                    )
                self._states[self._peer] = self._after(self._peer, Step.END)
                return ConnectionClosed()
            with view:
                try:
                    body = decode_body(view)
                except ProtocolError as exc:
                    if self._client:
                        raise
                    return self._reject(0, exc.code, exc.message)
            if self._client:
                return self._reply_event(body)
            return self._request_event(body)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            self._fail(exc)
        except ProtocolError as exc:  # from decoding what the peer sent
            self._fail(RemoteProtocolError(exc.code, exc.message))

    def _request_event(self, body: object) -> Request | BadRequest:
        request_id = peek_id(body)
        if not request_id:
            return self._reject(0, ErrorCode.BAD_MESSAGE, f"no request id in 1..{U32}")
        if request_id in self._in_flight or request_id in self._unanswered:
            return self._reject(request_id, ErrorCode.DUPLICATE_ID, "request id is in flight")
        if len(self._in_flight) >= self.limits.max_in_flight:
            return self._reject(
                request_id,
                ErrorCode.TOO_MANY_IN_FLIGHT,
                f"{len(self._in_flight)} requests in flight, the limit",
            )
        try:
            request = decode_request(body, self.limits)
        except ProtocolError as exc:
            return self._reject(request_id, exc.code, exc.message)
        try:  # a request the client's machine refuses is answered, not fatal
            self._states[Role.CLIENT] = self._after(Role.CLIENT, _step_of(request))
        except RemoteProtocolError as exc:
            return self._reject(request_id, exc.code, exc.message)
        self._enter(request)
        return request

    def _reject(self, request_id: int, code: ErrorCode, message: str) -> BadRequest:
        # A server answers each BadRequest before asking for the next event, so this bound
        # is only reached by a server that ignores them: fatal, as buffering must stay bounded.
        if len(self._unanswered) >= self.limits.max_in_flight:
            raise LocalProtocolError(
                ErrorCode.TOO_MANY_IN_FLIGHT,
                f"{len(self._unanswered)} bad requests left unanswered",
            )
        self._unanswered.append(request_id)
        return BadRequest(request_id, code, message)

    def _reply_event(self, body: object) -> Reply:
        self._after(Role.SERVER, Step.REPLY)  # OPEN stays OPEN: the checks below are per id
        if not (type(body) is dict or isinstance(body, Mapping)):
            raise RemoteProtocolError(ErrorCode.BAD_MESSAGE, "a reply must be a map")
        op, reply_id = body.get("op"), peek_id(body)
        if op == ErrorReply.op:
            error = ErrorReply.from_wire(body, self.limits)
            if error.id and self._leave(error.id) is None:
                raise RemoteProtocolError(
                    ErrorCode.UNEXPECTED_REPLY, f"error reply to id {error.id}, not in flight"
                )
            return error
        expected = self._in_flight.get(reply_id)
        if expected is None:
            raise RemoteProtocolError(ErrorCode.UNEXPECTED_REPLY, "reply to an id not in flight")
        if op != expected:
            raise RemoteProtocolError(
                ErrorCode.UNEXPECTED_REPLY, f"{op!r} reply to a {expected!r} request"
            )
        reply = OPS[expected].reply.from_wire(body, self.limits)
        wanted = reply.descriptor_count()
        if wanted > self._claims.get(reply_id, 0):
            raise RemoteProtocolError(
                ErrorCode.BAD_DESCRIPTORS,
                f"{op} reply declares {wanted} descriptor(s), more than its request asked",
            )
        if wanted > len(self._fds):
            raise RemoteProtocolError(
                ErrorCode.BAD_DESCRIPTORS,
                f"{op} reply declares {wanted} descriptor(s), {len(self._fds)} arrived",
            )
        self._leave(reply_id)
        if wanted:
            reply = reply.with_fds(tuple(self._fds.popleft() for _ in range(wanted)))
        if type(reply) is HelloReply:
            self.limits = reply.limits
            self._reader.max_frame_bytes = reply.limits.max_frame_bytes
            self._writer.max_frame_bytes = reply.limits.max_frame_bytes
        return reply

    # --- failure ---

    def _unusable(self, kind: type[ProtocolError]) -> ProtocolError:
        assert self._error is not None
        return kind(self._error.code, f"connection unusable after: {self._error.message}")

    def _fail(self, exc: ProtocolError) -> NoReturn:
        self._error = exc
        self._states = dict.fromkeys(Role, State.FAILED)
        raise exc

    def _frame(self, message: Message) -> bytes:
        try:
            return self._writer.frame(message.to_wire())
        except ProtocolError as exc:  # over the frame limit: the message is this side's
            raise LocalProtocolError(exc.code, exc.message) from None
