"""Every number a client declares is bounded at decoding: a value that is not finite, negative
or out of its field's range is a bad message naming the field, on the generic path and the
small-message one alike, and the connection goes on."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from kvd_protocol.connection import BadRequest, Connection, Role
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.framing import LENGTH, decode_body
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.messages import (
    MAX_LIST_PAGE,
    MAX_PREFILL_COST,
    MAX_REPORTED_BYTES,
    MAX_REPORTED_DROPS,
    MAX_REPORTED_MS,
    MAX_WAIT_SECONDS,
    DropReport,
    Flush,
    ListEntries,
    Lookup,
    Message,
    Ping,
    PutBegin,
    PutCommit,
    Release,
    RestoreReport,
    WaitTicket,
)
from kvd_protocol.ops import decode_request
from kvd_protocol.tokens import pack_tokens
from wire_samples import HELLO, HELLO_REPLY, IDENTITY, drain

LIMITS = DEFAULT_LIMITS
HOSTILE_FLOATS = (float("inf"), float("-inf"), float("nan"), -1.0, 1e300, 1.7976931348623157e308)
REPORT = RestoreReport(miss=None, ms=12.5, bytes=1 << 20, tokens=100)
PUT = PutBegin(id=2, identity=IDENTITY, tokens=pack_tokens([1, 2]), size=16384)
COMMIT = PutCommit(id=2, put=1, dropped=DropReport(snapshots=3, bytes=1 << 20))
LOOKUP = Lookup(id=2, identity=IDENTITY, tokens=pack_tokens([1, 2, 3]))

# (a valid request, the path to one of its numeric fields, the largest value it accepts)
BOUNDED: list[tuple[Message, tuple[str, ...], float]] = [
    (PUT, ("prefill_cost",), MAX_PREFILL_COST),
    (PutCommit(id=2, put=1, store_ms=3.0), ("store_ms",), MAX_REPORTED_MS),
    (COMMIT, ("dropped", "snapshots"), MAX_REPORTED_DROPS),
    (COMMIT, ("dropped", "bytes"), MAX_REPORTED_BYTES),
    (WaitTicket(id=2, ticket=1, timeout=1.0), ("timeout",), MAX_WAIT_SECONDS),
    (Flush(id=2, timeout=1.0), ("timeout",), MAX_WAIT_SECONDS),
    (Release(id=2, lease=1, report=REPORT), ("report", "ms"), MAX_REPORTED_MS),
    (Release(id=2, lease=1, report=REPORT), ("report", "bytes"), MAX_REPORTED_BYTES),
    (Release(id=2, lease=1, report=REPORT), ("report", "tokens"), LIMITS.max_tokens),
    (LOOKUP, ("min_tokens",), LIMITS.max_tokens),
    (ListEntries(id=2, identity=None, limit=10, after=None), ("limit",), MAX_LIST_PAGE),
]
IDS = [f"{type(m).__name__}.{'.'.join(path)}" for m, path, _ in BOUNDED]


def _with(message: Message, path: tuple[str, ...], value: object) -> dict[str, Any]:
    """message's wire map, through msgpack, with the field at path set to value."""
    wire: dict[str, Any] = decode_body(msgpack.packb(message.to_wire()))  # type: ignore[assignment]
    inner = wire
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return wire


def _decoded(wire: dict[str, Any], limits: Limits = LIMITS) -> Message | str:
    """What the generic decoder makes of wire, or its error as "code: message"."""
    try:
        return decode_request(wire, limits)
    except ProtocolError as exc:
        return f"{exc.code.value}: {exc.message}"


def _over(bound: float) -> list[object]:
    """Values just past a bound: the next integer for a count, a larger float for a measure."""
    if isinstance(bound, int):
        return [bound + 1, -1]
    return [bound * 1.000001, *HOSTILE_FLOATS]


@pytest.mark.parametrize(("message", "path", "bound"), BOUNDED, ids=IDS)
def test_a_number_past_its_bound_is_a_bad_message_naming_its_field(
    message: Message, path: tuple[str, ...], bound: float
) -> None:
    for value in _over(bound):
        error = _decoded(_with(message, path, value))
        assert isinstance(error, str), value
        assert error.startswith(f"bad_message: {type(message).op}: "), (value, error)
        assert path[-1] in error, (value, error)


@pytest.mark.parametrize(("message", "path", "bound"), BOUNDED, ids=IDS)
def test_a_number_at_its_bound_is_taken(
    message: Message, path: tuple[str, ...], bound: float
) -> None:
    for value in (0, bound):
        if path == ("limit",) and value == 0:
            continue  # a page of no entries is asked for by nobody: limit >= 1
        decoded = _decoded(_with(message, path, value))
        assert isinstance(decoded, Message), decoded


def test_a_lookup_min_tokens_is_bounded_by_the_limits_it_is_decoded_under() -> None:
    for limits in (LIMITS, Limits(max_tokens=64)):
        at = _with(LOOKUP, ("min_tokens",), limits.max_tokens)
        assert _decoded(at, limits) == Lookup(
            id=2, identity=IDENTITY, tokens=LOOKUP.tokens, min_tokens=limits.max_tokens
        )
        over = _with(LOOKUP, ("min_tokens",), limits.max_tokens + 1)
        assert str(_decoded(over, limits)).startswith("bad_message: ")


def test_a_hostile_float_is_answered_and_the_connection_goes_on() -> None:
    server = Connection(Role.SERVER)
    server.receive_data(_frame(HELLO.to_wire()))
    assert drain(server) == [HELLO]
    server.send(HELLO_REPLY)
    for value in HOSTILE_FLOATS:
        server.receive_data(_frame(_with(PUT, ("prefill_cost",), value)))
        (event,) = drain(server)
        assert isinstance(event, BadRequest)
        assert (event.id, event.code) == (PUT.id, ErrorCode.BAD_MESSAGE)
        assert "prefill_cost" in event.message
        server.send(event.reply())
    server.receive_data(_frame(Ping(id=3).to_wire()))
    assert drain(server) == [Ping(id=3)]


def _frame(body: object) -> bytes:
    packed: bytes = msgpack.packb(body)
    return LENGTH.pack(len(packed)) + packed
