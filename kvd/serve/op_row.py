"""A row of the op table (kvd.serve.handlers): a request's handler and what its answer may
wait for; and what a handler answers from (Context) and with when it fails."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode, ProtocolError

from kvd.logs import RateLimited, get_logger
from kvd.remote.remote import Remote
from kvd.serve.peer import Peer
from kvd.store.tier import Tier

log = get_logger("kvd.serve.op_row")
broken_rules = RateLimited(log)  # a client may break a rule as often as it likes


@dataclass(frozen=True, slots=True)
class Context:
    """What one connection's requests are answered from."""

    tier: Tier
    remote: Remote | None  # the remote tier, when `remote` is set
    peer: Peer
    status: Callable[[], dict[str, object]]  # the daemon's status report


Later = Callable[[], Awaitable[m.Reply]]  # what a handler hands back to await for its reply
Handler = Callable[[Context, Any], m.Reply | Later]


class Waits(enum.Enum):
    """What a request's answer may wait for, and so where the session runs it."""

    # Nothing: answered in the reader callback, without a task switch.
    NOTHING = "nothing"
    # What it hands back to await runs as a task of its own: the connection's other requests
    # are answered meanwhile.
    TASK = "task"
    # What it hands back to await runs as a task with the connection's reading paused until
    # its reply is out, so that the reply keeps its place among the others.
    TASK_IN_ORDER = "task_in_order"


@dataclass(frozen=True, slots=True)
class Op:
    """A request's row in the op table."""

    handler: Handler
    waits: Waits = Waits.NOTHING
    # Run once its reply is sent (or fails to be): what only counts the request, so that the
    # reply goes first.
    after_reply: Callable[[Context], None] | None = None


def awaited(handler: Callable[[Context, Any], Awaitable[m.Reply]]) -> Handler:
    """The handler of a request that may always wait: all of it is awaited (Waits.TASK)."""

    def later(context: Context, request: m.Request) -> Later:
        return lambda: handler(context, request)

    return later


def failed(request: m.Request, exc: Exception) -> m.ErrorReply:
    """The reply to a request whose handler raised exc: a ProtocolError's code, else (a daemon
    bug or a failed file operation: this request only) internal, logged. A bound of the
    connection's that the request broke (over_limit) is logged too, at most every so often."""
    if isinstance(exc, ProtocolError):
        if exc.code is ErrorCode.OVER_LIMIT:
            broken_rules.warning("request_over_limit", op=request.op, error=exc.message)
        return m.ErrorReply(id=request.id, code=exc.code, message=exc.message)
    log.exception("request_failed", op=request.op)
    return m.ErrorReply(id=request.id, code=ErrorCode.INTERNAL, message=str(exc))
