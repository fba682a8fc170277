"""Property tests: on any input, a Connection yields events or raises the documented
ProtocolError, never anything else; it never hangs, never loses a descriptor, and the bytes
it holds stay bounded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvd_protocol.connection import NEED_DATA, BadRequest, Connection, ConnectionClosed, Role
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.framing import LENGTH
from kvd_protocol.limits import Limits
from kvd_protocol.messages import ErrorReply, HelloReply, Message, Reply, Request
from kvd_protocol.ops import OPS
from wire_samples import HELLO, exchanges, feed

LIMITS = Limits(max_frame_bytes=1024, max_in_flight=64, max_tokens=128)
HELLO_REPLY = HelloReply(id=1, protocol=1, server="0.1.0", limits=LIMITS, features=())
PAIRS = exchanges()
REQUESTS: list[Message] = [HELLO, *(request for request, _ in PAIRS)]
REPLIES: list[Reply] = [HELLO_REPLY, *(reply for _, reply in PAIRS)]


def _frames(values: Sequence[Any]) -> bytes:
    bodies = [msgpack.packb(value, datetime=False) for value in values]
    return b"".join(LENGTH.pack(len(body)) + body for body in bodies)


REQUEST_STREAM = _frames([request.to_wire() for request in REQUESTS])
REPLY_STREAM = _frames([reply.to_wire() for reply in REPLIES])
FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


# --- strategies -------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
    | st.builds(msgpack.Timestamp, st.integers(0, (1 << 32) - 1))
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def _message_like(draw: st.DrawFn, samples: Sequence[Message]) -> Any:
    """A valid wire map with some fields dropped, changed or added; or any msgpack value."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_values)
    wire: dict[str, Any] = dict(draw(st.sampled_from(samples)).to_wire())
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*wire, "op", "id", "extra"]))
        if draw(st.booleans()):
            wire.pop(key, None)
        else:
            wire[key] = draw(_values | st.sampled_from([*OPS, "error"]) | st.integers(0, 40))
    return wire


@st.composite
def _mutated(draw: st.DrawFn, stream: bytes) -> bytes:
    """stream after a few bit flips, truncations, insertions, deletions and duplications."""
    data = bytearray(stream)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            start = draw(st.integers(0, len(data)))
            data[at:at] = data[start : start + draw(st.integers(1, 600))]
    return bytes(data)


_chunks = st.lists(st.integers(1, 300), min_size=1, max_size=8)
_fd_counts = st.lists(st.integers(0, 2), min_size=1, max_size=8)


# --- drivers ----------------------------------------------------------------------------------


def _pieces(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    pieces, position, index = [], 0, 0
    while position < len(data):
        size = sizes[index % len(sizes)]
        pieces.append(data[position : position + size])
        position += size
        index += 1
    return pieces


def _assert_unusable(connection: Connection) -> None:
    assert connection.failed
    for call in (
        connection.next_event,
        lambda: connection.receive_data(b"x"),
        lambda: connection.send(REQUESTS[1]),
    ):
        try:
            call()
        except ProtocolError:
            continue
        raise AssertionError(f"{call} did not raise on a failed connection")


def _pump(
    connection: Connection,
    pieces: Sequence[bytes],
    fd_counts: Sequence[int],
    on_event: Callable[[object], None],
) -> tuple[list[int], ErrorCode | None]:
    """Feed pieces (with fd_counts[i] fresh descriptors each, cycling), then the end of the
    stream; answer events; check the buffering bound. Returns the descriptors handed in and
    the code of the ProtocolError that ended it, if any."""
    given_fds: list[int] = []
    try:
        for index, piece in enumerate([*pieces, b""]):
            count = fd_counts[index % len(fd_counts)] if piece else 0
            fds = list(range(1000 + len(given_fds), 1000 + len(given_fds) + count))
            given_fds += fds
            connection.receive_data(piece, fds)
            while True:
                event = connection.next_event()
                if event is NEED_DATA:
                    assert connection.buffered_bytes < connection.limits.max_frame_bytes + 4
                    break
                if isinstance(event, ConnectionClosed):
                    assert connection.buffered_bytes == 0
                    return given_fds, None
                on_event(event)
                assert len(connection.in_flight) <= connection.limits.max_in_flight
    except ProtocolError as exc:
        _assert_unusable(connection)
        return given_fds, exc.code
    raise AssertionError("the end of the stream produced no ConnectionClosed")


def _server_run(stream: bytes, sizes: Sequence[int], fd_counts: Sequence[int]) -> None:
    server = Connection(Role.SERVER, LIMITS)

    def answer(event: object) -> None:
        if isinstance(event, BadRequest):
            server.send(event.reply())
        else:
            assert isinstance(event, Request)
            server.send(ErrorReply(id=event.id, code=ErrorCode.INTERNAL, message="fuzz"))

    given_fds, code = _pump(server, _pieces(stream, sizes), fd_counts, answer)
    if given_fds:
        assert code is ErrorCode.BAD_DESCRIPTORS
    else:
        assert code in (None, ErrorCode.BAD_FRAME)
    assert server.take_descriptors() == []


def _client_run(stream: bytes, sizes: Sequence[int], fd_counts: Sequence[int]) -> None:
    client = Connection(Role.CLIENT, LIMITS)
    for request in REQUESTS:
        client.send(request)
    received: list[int] = []

    def collect(event: object) -> None:
        assert isinstance(event, Reply)
        assert len(event.fds) == event.descriptor_count()
        received.extend(event.fds)

    given_fds, _ = _pump(client, _pieces(stream, sizes), fd_counts, collect)
    # Every descriptor is handed out exactly once: in a reply, or back to the caller.
    assert sorted(received + client.take_descriptors()) == given_fds


# --- properties -------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=3000), _chunks, _fd_counts)
def test_server_on_arbitrary_bytes(stream: bytes, sizes: list[int], fds: list[int]) -> None:
    _server_run(stream, sizes, [0] if fds[0] == 0 else fds)


@FUZZ
@given(st.lists(_message_like(REQUESTS), max_size=12), _chunks)
def test_server_on_arbitrary_request_maps(values: list[Any], sizes: list[int]) -> None:
    _server_run(_frames([HELLO.to_wire(), *values]), sizes, [0])


@FUZZ
@given(_mutated(REQUEST_STREAM), _chunks, _fd_counts)
def test_server_on_mutated_valid_streams(stream: bytes, sizes: list[int], fds: list[int]) -> None:
    _server_run(stream, sizes, [0] if fds[0] == 0 else fds)


@FUZZ
@given(st.binary(max_size=3000), _chunks, _fd_counts)
def test_client_on_arbitrary_bytes(stream: bytes, sizes: list[int], fds: list[int]) -> None:
    _client_run(stream, sizes, fds)


@FUZZ
@given(st.lists(_message_like(REPLIES), max_size=12), _chunks, _fd_counts)
def test_client_on_arbitrary_reply_maps(
    values: list[Any], sizes: list[int], fds: list[int]
) -> None:
    _client_run(_frames(values), sizes, fds)


@FUZZ
@given(_mutated(REPLY_STREAM), _chunks, _fd_counts)
def test_client_on_mutated_valid_streams(stream: bytes, sizes: list[int], fds: list[int]) -> None:
    _client_run(stream, sizes, fds)


@FUZZ
@given(_chunks)
def test_valid_streams_in_random_chunks_give_every_message(sizes: list[int]) -> None:
    client, server = Connection(Role.CLIENT, LIMITS), Connection(Role.SERVER, LIMITS)
    requests = feed(server, [(client.send(request), ()) for request in REQUESTS], sizes)
    assert requests == REQUESTS
    replies = feed(client, [(server.send(reply), reply.fds) for reply in REPLIES], sizes)
    assert replies == REPLIES
    assert client.take_descriptors() == []
