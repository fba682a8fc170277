"""The op table: each request class with its reply class (the one table of what the protocol
can say), and how a decoded body becomes a request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.limits import Limits
from kvd_protocol.messages import (
    U32,
    Evict,
    EvictReply,
    FindCheckpoint,
    FindCheckpointReply,
    Flush,
    FlushReply,
    ForgetCheckpoint,
    ForgetCheckpointReply,
    Hello,
    HelloReply,
    ListEntries,
    ListEntriesReply,
    Lookup,
    LookupReply,
    OpenBlocks,
    OpenBlocksReply,
    OpenEntry,
    OpenEntryReply,
    Ping,
    PingReply,
    Presence,
    PresenceReply,
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
    Status,
    StatusReply,
    TicketReply,
    Verify,
    VerifyReply,
    WaitTicket,
)


@dataclass(frozen=True)
class Op:
    request: type[Request]
    reply: type[Reply]


OPS: Final[Mapping[str, Op]] = MappingProxyType(
    {
        op.request.op: op
        for op in (
            Op(Hello, HelloReply),
            Op(Ping, PingReply),
            Op(PutBegin, PutBeginReply),
            Op(PutBlocks, PutBlocksReply),
            Op(PutCommit, PutCommitReply),
            Op(PutAbort, PutAbortReply),
            Op(WaitTicket, TicketReply),
            Op(Lookup, LookupReply),
            Op(OpenBlocks, OpenBlocksReply),
            Op(FindCheckpoint, FindCheckpointReply),
            Op(ForgetCheckpoint, ForgetCheckpointReply),
            Op(Release, ReleaseReply),
            Op(Flush, FlushReply),
            Op(Status, StatusReply),
            Op(ListEntries, ListEntriesReply),
            Op(Evict, EvictReply),
            Op(Verify, VerifyReply),
            Op(OpenEntry, OpenEntryReply),
            Op(Presence, PresenceReply),
        )
    }
)


def peek_id(obj: object) -> int:
    """The request id of a decoded body, or 0 when it has none that could be answered."""
    if type(obj) is dict or isinstance(obj, Mapping):
        value = obj.get("id")
        if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
            return value if 1 <= value <= U32 else 0
    return 0


def decode_request(obj: object, limits: Limits) -> Request:
    """The request a decoded body holds; raises ProtocolError (UNKNOWN_OP, BAD_MESSAGE,
    TOO_LARGE)."""
    op = obj.get("op") if type(obj) is dict or isinstance(obj, Mapping) else None
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "expected a map with a string 'op'")
    spec = OPS.get(op)
    if spec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op[:64]!r}")
    return spec.request.from_wire(obj, limits)
