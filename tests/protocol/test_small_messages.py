"""The small messages' hand-written codec says exactly what the generic path says: the same
maps out, the same messages in, and on any body it does not take (None) the generic path
decides, so every error stays the generic path's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvd_protocol import identity as identity_module
from kvd_protocol import small_messages
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.identity import Identity
from kvd_protocol.limits import Limits
from kvd_protocol.messages import (
    ErrorReply,
    Lookup,
    LookupReply,
    Message,
    Ping,
    PingReply,
    Reply,
    Request,
    decode_request,
)
from kvd_protocol.tokens import pack_tokens
from wire_samples import ENTRY, IDENTITY

LIMITS = Limits(max_frame_bytes=4096, max_tokens=64, max_name_bytes=32)
FUZZ = settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])

SAMPLES: list[Message] = [
    Ping(id=1),
    Ping(id=(1 << 32) - 1),
    PingReply(id=7),
    Lookup(id=2, identity=IDENTITY, tokens=pack_tokens(range(5))),
    Lookup(id=3, identity=IDENTITY, tokens=b"", min_tokens=4),
    Lookup(id=3, identity=IDENTITY, tokens=b"", explain=True),
    Lookup(
        id=3, identity=replace(IDENTITY, traits="kv=none"), tokens=b"", min_tokens=1, explain=True
    ),
    LookupReply(id=4, matched=0, entry=None, lease=None),
    LookupReply(id=4, matched=0, entry=None, lease=None, miss="no entry", detail="none here"),
    LookupReply(id=4, matched=0, entry=None, lease=None, miss="other"),
    LookupReply(id=5, matched=64, entry=ENTRY, lease=9),
    ErrorReply(id=0, code=ErrorCode.BAD_FRAME, message="no"),
    ErrorReply(id=6, code=ErrorCode.NOT_FOUND, message="é" * 8),
]


def small_request(body: dict[str, Any], limits: Limits) -> Request | None:
    """What the Connection's small-request path makes of body: its op's decoder's answer."""
    op = body.get("op")
    decode = small_messages.REQUEST_DECODERS.get(op) if type(op) is str else None
    request: Request | None = None if decode is None else decode(body, limits)
    return request


def small_reply(body: dict[str, Any], op: str, limits: Limits) -> Reply | None:
    """The same for a reply to a request of op (op "error": an error reply)."""
    decode = small_messages.REPLY_DECODERS.get(op)
    reply: Reply | None = None if decode is None or body.get("op") != op else decode(body, limits)
    return reply


def test_each_encoder_makes_the_map_to_wire_makes() -> None:
    for message in SAMPLES:
        encode = small_messages.ENCODERS[type(message)]
        assert encode(message) == message.to_wire()
        assert list(encode(message)) == list(message.to_wire())  # the same order, too


def test_each_small_message_decodes_to_what_the_generic_path_makes() -> None:
    for message in SAMPLES:  # the generic path first: a lookup's identity is then known
        body = msgpack.unpackb(msgpack.packb(message.to_wire()))  # as a Connection sees it
        decoded: Message | None
        if isinstance(message, Reply):
            op = "error" if isinstance(message, ErrorReply) else message.op
            generic: Message = type(message).from_wire(body, LIMITS)
            decoded = small_reply(body, op, LIMITS)
        else:
            generic = decode_request(body, LIMITS)
            decoded = small_request(body, LIMITS)
        if message == LookupReply(id=5, matched=64, entry=ENTRY, lease=9):
            assert decoded is None  # a hit's entry is checked by the generic path
            continue
        assert decoded == generic == message
        assert type(decoded) is type(message)
        assert decoded.__dict__ == generic.__dict__  # every field set, as the constructor sets


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 64), 1 << 65)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
_identity_maps = st.fixed_dictionaries(
    {name: st.text(max_size=40) | _values for name in IDENTITY.to_wire()},
    optional={"traits": st.sampled_from(["kv=none", "kv=", "é=1"]) | _values},
)


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A small message's map with fields dropped, changed or added."""
    body: dict[str, Any] = msgpack.unpackb(msgpack.packb(draw(st.sampled_from(SAMPLES)).to_wire()))
    for _ in range(draw(st.integers(0, 3))):
        keys = [*body, "id", "min_tokens", "explain", "miss", "detail", "extra", "code", "message"]
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()):
            body.pop(key, None)
        elif key == "identity" or draw(st.integers(0, 5)) == 0:
            body[key] = draw(_identity_maps)
        else:
            body[key] = draw(_values | st.sampled_from(["ping", "lookup", "error", "not_found"]))
    return body


def _generic(decode: Any, *args: Any) -> Message | str:
    try:
        message: Message = decode(*args)
    except ProtocolError as exc:
        return f"{exc.code}: {exc.message}"
    return message


@FUZZ
@given(_bodies())
def test_on_any_body_the_codec_agrees_with_the_generic_path_or_leaves_it_to_it(
    body: dict[str, Any],
) -> None:
    if "id" not in body:
        return  # the Connection never asks without one
    for op in ("ping", "lookup", "error"):
        decoded = small_reply(body, op, LIMITS)
        if decoded is not None:
            assert decoded == _generic(type(decoded).from_wire, body, LIMITS)
    request = small_request(body, LIMITS)
    if request is not None:
        assert request == _generic(decode_request, body, LIMITS)


def test_an_identity_decoded_before_is_known_only_within_the_limit_it_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(identity_module, "_known", {})  # room for this one, whatever ran before
    wire = Identity("m" * 20, "c", "t", "k", "r").to_wire()
    decoded = Identity.from_wire(dict(wire), LIMITS)
    assert Identity.known(dict(wire), LIMITS) is decoded
    assert Identity.known(dict(wire), Limits(max_name_bytes=19)) is None
    assert Identity.known({**wire, "namespace": ["x"]}, LIMITS) is None  # unhashable: no
    assert Identity.known({**wire, "runtime": b"r"}, LIMITS) is None
