"""Ping, lookup, their replies and errors, coded by hand: most of an engine's exchanges.

The generic path (record.Record) walks each class's field table and calls a checker per
field; for these few small messages that walk costs more than the exchange's system calls.
Each decoder here takes a decoded body and returns its message only when the body has the
usual shape and every field passes the test the field's checker starts with (its fast
case); on anything else it returns None and the Connection takes the generic path, so every
error and its text come from the generic path alone. Each encoder returns the map
Message.to_wire() returns. tests/protocol/test_small_messages.py holds both to the generic
path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from .errors import ErrorCode
from .identity import Identity
from .limits import Limits
from .messages import (
    U32,
    ErrorReply,
    Lookup,
    LookupReply,
    Message,
    Ping,
    PingReply,
)
from .tokens import TOKEN_BYTES

Decoder = Callable[[dict[str, Any], Limits], Any]

_ENVELOPE: Final = frozenset({"op", "id"})
_LOOKUP: Final = _ENVELOPE | {"identity", "tokens"}
_LOOKUP_ANY: Final = _LOOKUP | {"min_tokens", "explain"}  # with its optional fields
_LOOKUP_REPLY: Final = _ENVELOPE | {"matched", "entry", "lease"}
_LOOKUP_REPLY_ANY: Final = _LOOKUP_REPLY | {"miss", "detail"}
_ERROR: Final = _ENVELOPE | {"code", "message"}
_CODES: Final = {code.value: code for code in ErrorCode}


def _id_only(kind: type[Ping] | type[PingReply]) -> Decoder:
    """The decoder of a message that holds its id alone (a ping, its reply)."""

    def decode(body: dict[str, Any], limits: Limits) -> Ping | PingReply | None:
        if body.keys() == _ENVELOPE:
            message_id = body["id"]
            if type(message_id) is int and 1 <= message_id <= U32:
                return kind.checked({"id": message_id})
        return None

    return decode


def _lookup(body: dict[str, Any], limits: Limits) -> Lookup | None:
    keys = body.keys()
    if keys == _LOOKUP:
        min_tokens, explain = 0, False
    elif _LOOKUP <= keys <= _LOOKUP_ANY:
        min_tokens, explain = body.get("min_tokens", 0), body.get("explain", False)
        if not (type(min_tokens) is int and 0 <= min_tokens <= limits.max_tokens):
            return None
        if type(explain) is not bool:
            return None
    else:
        return None
    request_id, tokens = body["id"], body["tokens"]
    if not (
        type(request_id) is int
        and 1 <= request_id <= U32
        and type(tokens) is bytes
        and len(tokens) <= limits.max_tokens * TOKEN_BYTES
        and not len(tokens) % TOKEN_BYTES
    ):
        return None
    identity = Identity.known(body["identity"], limits)
    if identity is None:
        return None
    values = {
        "id": request_id,
        "identity": identity,
        "tokens": tokens,
        "min_tokens": min_tokens,
        "explain": explain,
    }
    return Lookup.checked(values)


def _lookup_reply(body: dict[str, Any], limits: Limits) -> LookupReply | None:
    """A miss; a hit (its entry summary to check) takes the generic path."""
    keys = body.keys()
    if not _LOOKUP_REPLY <= keys <= _LOOKUP_REPLY_ANY:
        return None
    reply_id, matched = body["id"], body["matched"]
    miss, detail = body.get("miss"), body.get("detail")
    if (
        type(reply_id) is int
        and 1 <= reply_id <= U32
        and type(matched) is int
        and 0 <= matched <= U32
        and body["entry"] is None
        and body["lease"] is None
        and (miss is None or (type(miss) is str and len(miss) <= limits.max_name_bytes >> 2))
        and (detail is None or (type(detail) is str and len(detail) <= limits.max_frame_bytes >> 2))
    ):
        values = {
            "id": reply_id,
            "matched": matched,
            "entry": None,
            "lease": None,
            "miss": miss,
            "detail": detail,
            "fd": None,
        }
        return LookupReply.checked(values)
    return None


def _error_reply(body: dict[str, Any], limits: Limits) -> ErrorReply | None:
    if body.keys() != _ERROR:
        return None
    reply_id, code, message = body["id"], body["code"], body["message"]
    if (
        type(reply_id) is int
        and 0 <= reply_id <= U32
        and type(code) is str
        and code in _CODES
        and type(message) is str
        and len(message) <= limits.max_frame_bytes >> 2  # schema.text's fast case
    ):
        return ErrorReply.checked({"id": reply_id, "code": _CODES[code], "message": message})
    return None


# By op: each takes a dict body of that op (what the Connection checks first), as do these:
REQUEST_DECODERS: Final[Mapping[str, Decoder]] = {"ping": _id_only(Ping), "lookup": _lookup}
# ("error": an error reply). A reply decoded here declares no descriptors: a lookup's is a
# miss.
REPLY_DECODERS: Final[Mapping[str, Decoder]] = {
    "ping": _id_only(PingReply),
    "lookup": _lookup_reply,
    "error": _error_reply,
}


def _ping_map(message: Ping | PingReply) -> dict[str, object]:
    return {"op": "ping", "id": message.id}


def _lookup_map(message: Lookup) -> dict[str, object]:
    body: dict[str, object] = {
        "op": "lookup",
        "id": message.id,
        "identity": message.identity.to_wire(),
        "tokens": message.tokens,
    }
    if message.min_tokens:  # left out at its default, as Record.to_map does
        body["min_tokens"] = message.min_tokens
    if message.explain:
        body["explain"] = True
    return body


def _lookup_reply_map(message: LookupReply) -> dict[str, object]:
    entry = message.entry
    body: dict[str, object] = {
        "op": "lookup",
        "id": message.id,
        "matched": message.matched,
        "entry": None if entry is None else entry.to_map(),
        "lease": message.lease,
    }
    if message.miss is not None:  # left out at their defaults, as Record.to_map does
        body["miss"] = message.miss
    if message.detail is not None:
        body["detail"] = message.detail
    return body


def _error_map(message: ErrorReply) -> dict[str, object]:
    return {"op": "error", "id": message.id, "code": message.code, "message": message.message}


# By exact class: a subclass (FindCheckpointReply) has an op of its own.
ENCODERS: Final[Mapping[type[Message], Callable[[Any], dict[str, object]]]] = {
    Ping: _ping_map,
    PingReply: _ping_map,
    Lookup: _lookup_map,
    LookupReply: _lookup_reply_map,
    ErrorReply: _error_map,
}
