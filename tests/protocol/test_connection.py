"""Connection: round trips of every message in every chunking, and each documented error."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
from kvd_protocol.connection import NEED_DATA, BadRequest, Connection, ConnectionClosed, Role
from kvd_protocol.errors import (
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from kvd_protocol.framing import LENGTH
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.messages import (
    ErrorReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    OpenBlocks,
    OpenBlocksReply,
    Ping,
    PingReply,
    PutBegin,
    PutBeginReply,
    PutBlocks,
    PutBlocksReply,
    Status,
    StatusReply,
)
from kvd_protocol.tokens import pack_tokens
from wire_samples import (
    ENTRY,
    HELLO,
    HELLO_REPLY,
    IDENTITY,
    TOKENS,
    chunked,
    connected_pair,
    drain,
    exchanges,
    feed,
)

CHUNKINGS = [[1 << 30], [1], [2], [3], [4], [5], [7], [64], [1, 3, 2, 200], [4096]]


def _frame(body: object) -> bytes:
    packed: bytes = msgpack.packb(body)
    return LENGTH.pack(len(packed)) + packed


def _raises(code: ErrorCode) -> pytest.RaisesExc[ProtocolError]:
    return pytest.raises(ProtocolError, match=f"^{code.value}: ")


def _assert_unusable(connection: Connection) -> None:
    assert connection.failed
    assert not connection.can_send
    with pytest.raises(RemoteProtocolError):
        connection.next_event()
    with pytest.raises(RemoteProtocolError):
        connection.receive_data(b"x")
    with pytest.raises(LocalProtocolError):
        connection.send(Ping(id=99))


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", CHUNKINGS, ids=str)
def test_every_request_and_reply_round_trips_in_any_chunking(sizes: list[int]) -> None:
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    pairs = [(HELLO, HELLO_REPLY), *exchanges()]
    requests = [request for request, _ in pairs]
    replies = [reply for _, reply in pairs]

    frames = [(client.send(request), ()) for request in requests]
    assert feed(server, frames, sizes) == requests
    assert set(server.in_flight) == {request.id for request in requests}

    answers = [(server.send(reply), reply.fds) for reply in replies]
    assert server.in_flight == {}
    assert feed(client, answers, sizes) == replies
    assert client.in_flight == {}
    assert client.take_descriptors() == []
    assert client.buffered_bytes == server.buffered_bytes == 0


def test_a_reply_carries_the_descriptors_it_declares_in_arrival_order() -> None:
    client, server = connected_pair()
    hit = LookupReply(id=2, matched=3, entry=ENTRY, lease=1).with_fds((11,))
    staging = PutBeginReply(id=4, put=1, skip=None).with_fds((12,))
    requests = (
        Lookup(id=2, identity=IDENTITY, tokens=TOKENS),
        Ping(id=3),
        PutBegin(id=4, identity=IDENTITY, tokens=TOKENS, size=10),
    )
    for request in requests:
        server.receive_data(client.send(request))
    drain(server)
    stream = server.send(hit) + server.send(PingReply(id=3)) + server.send(staging)
    # Both descriptors arrive before any frame is complete: each reply pops its own, in order.
    client.receive_data(stream[:3], [11, 12])
    assert drain(client) == []
    client.receive_data(stream[3:])
    assert drain(client) == [hit, PingReply(id=3), staging]
    assert client.take_descriptors() == []


def test_end_of_stream_at_a_frame_boundary_is_connection_closed() -> None:
    client, server = connected_pair()
    server.receive_data(client.send(Ping(id=2)) + b"")
    server.receive_data(b"")
    assert server.next_event() == Ping(id=2)
    assert server.next_event() == ConnectionClosed()
    client.receive_data(b"")
    assert client.next_event() == ConnectionClosed()


def test_end_of_stream_inside_a_frame_is_a_bad_frame() -> None:
    client, server = connected_pair()
    server.receive_data(client.send(Ping(id=2))[:-1])
    server.receive_data(b"")
    with _raises(ErrorCode.BAD_FRAME):
        server.next_event()
    _assert_unusable(server)


# --- framing: fatal on both roles --------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("length", [0, DEFAULT_LIMITS.max_frame_bytes + 1, (1 << 32) - 1])
def test_a_bad_length_is_fatal_from_its_four_bytes_alone(role: Role, length: int) -> None:
    connection = Connection(role)
    connection.receive_data(LENGTH.pack(length))
    assert connection.buffered_bytes == 4
    with _raises(ErrorCode.BAD_FRAME):
        connection.next_event()
    _assert_unusable(connection)


@pytest.mark.parametrize("limit", [63, 64])
def test_a_frame_of_exactly_the_limit_is_accepted_one_byte_more_is_not(limit: int) -> None:
    server = Connection(Role.SERVER, Limits(max_frame_bytes=limit))
    empty = len(msgpack.packb(replace(HELLO, client="").to_wire()))
    hello = replace(HELLO, client="x" * (64 - empty))
    body = msgpack.packb(hello.to_wire())
    assert len(body) == 64
    server.receive_data(LENGTH.pack(len(body)) + body)
    if limit == 64:
        assert drain(server) == [hello]
    else:
        with _raises(ErrorCode.BAD_FRAME):
            server.next_event()


# --- server: bad requests are answered, the connection goes on ---------------------------------


def _bad(server: Connection, data: bytes) -> BadRequest:
    server.receive_data(data)
    events = drain(server)
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, BadRequest)
    return event


def _server() -> Connection:
    server = Connection(Role.SERVER)
    server.receive_data(_frame(HELLO.to_wire()))
    assert drain(server) == [HELLO]
    server.send(HELLO_REPLY)
    return server


def _still_serves(server: Connection, request_id: int = 50) -> None:
    server.receive_data(_frame(Ping(id=request_id).to_wire()))
    assert drain(server) == [Ping(id=request_id)]
    server.send(PingReply(id=request_id))


@pytest.mark.parametrize(
    ("body", "code", "request_id"),
    [
        ({"op": "ping", "id": 2, "extra": 1}, ErrorCode.BAD_MESSAGE, 2),
        ({"op": "lookup", "id": 3, "identity": IDENTITY.to_wire()}, ErrorCode.BAD_MESSAGE, 3),
        ({"op": "release", "id": 4, "lease": "one"}, ErrorCode.BAD_MESSAGE, 4),
        ({"op": "launch", "id": 5}, ErrorCode.UNKNOWN_OP, 5),
        ({"op": "error", "id": 6, "code": "internal", "message": ""}, ErrorCode.UNKNOWN_OP, 6),
        ({"op": "ping"}, ErrorCode.BAD_MESSAGE, 0),
        ({"op": "ping", "id": 0}, ErrorCode.BAD_MESSAGE, 0),
        ({"op": "ping", "id": -1}, ErrorCode.BAD_MESSAGE, 0),
        ({"op": "ping", "id": [1]}, ErrorCode.BAD_MESSAGE, 0),
        ([1, 2, 3], ErrorCode.BAD_MESSAGE, 0),
        (
            {"op": "hello", "id": 7, "protocol": 1, "client": "x", "pid": 1},
            ErrorCode.BAD_MESSAGE,
            7,
        ),
    ],
    ids=str,
)
def test_an_invalid_request_is_a_bad_request_event(
    body: object, code: ErrorCode, request_id: int
) -> None:
    server = _server()
    event = _bad(server, _frame(body))
    assert (event.id, event.code) == (request_id, code)
    assert request_id not in server.in_flight
    server.send(event.reply())
    _still_serves(server)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x81\xa2op\xa4ping\x00",  # trailing byte after the map
        b"\x82\xa2op\xa4pi\xffg\xa2id\x02",  # invalid UTF-8
        b"\x81\x01\x02",  # integer map key
        msgpack.packb({"op": "ping", "id": msgpack.ExtType(5, b"x")}),
        b"\x82\xa2op",  # truncated object
    ],
    ids=["reserved", "trailing", "utf8", "int-key", "ext", "truncated"],
)
def test_an_undecodable_body_is_a_bad_request_with_id_zero(body: bytes) -> None:
    server = _server()
    event = _bad(server, LENGTH.pack(len(body)) + body)
    assert (event.id, event.code) == (0, ErrorCode.BAD_MESSAGE)
    server.send(event.reply())
    _still_serves(server)


def test_a_request_before_hello_is_refused_and_hello_still_works() -> None:
    server = Connection(Role.SERVER)
    event = _bad(server, _frame(Ping(id=2).to_wire()))
    assert (event.id, event.code) == (2, ErrorCode.HANDSHAKE_REQUIRED)
    server.send(event.reply())
    server.receive_data(_frame(HELLO.to_wire()))
    assert drain(server) == [HELLO]


def test_a_duplicate_id_is_refused_and_the_original_stays_in_flight() -> None:
    server = _server()
    server.receive_data(_frame(Ping(id=2).to_wire()))
    assert drain(server) == [Ping(id=2)]
    event = _bad(server, _frame(Status(id=2).to_wire()))
    assert (event.id, event.code) == (2, ErrorCode.DUPLICATE_ID)
    server.send(event.reply())  # answers the duplicate, not the original
    assert server.in_flight == {2: "ping"}
    server.send(PingReply(id=2))
    assert server.in_flight == {}


def test_too_many_in_flight_is_refused_without_growing_the_set() -> None:
    server = Connection(Role.SERVER, Limits(max_in_flight=2))
    server.receive_data(_frame(HELLO.to_wire()) + _frame(Ping(id=2).to_wire()))
    assert drain(server) == [HELLO, Ping(id=2)]
    event = _bad(server, _frame(Ping(id=3).to_wire()))
    assert (event.id, event.code) == (3, ErrorCode.TOO_MANY_IN_FLIGHT)
    assert set(server.in_flight) == {1, 2}
    server.send(event.reply())
    server.send(PingReply(id=2))
    _still_serves(server, 3)


def test_tokens_over_the_limit_are_too_large() -> None:
    server = Connection(Role.SERVER, Limits(max_tokens=4))
    server.receive_data(_frame(HELLO.to_wire()))
    drain(server)
    lookup = Lookup(id=2, identity=IDENTITY, tokens=pack_tokens(range(5)))
    event = _bad(server, _frame(lookup.to_wire()))
    assert (event.id, event.code) == (2, ErrorCode.TOO_LARGE)


def test_bad_requests_left_unanswered_are_bounded() -> None:
    server = Connection(Role.SERVER, Limits(max_in_flight=2))
    server.receive_data(_frame([]) * 3)
    for _ in range(2):
        event = server.next_event()
        assert isinstance(event, BadRequest)
        assert (event.id, event.code) == (0, ErrorCode.BAD_MESSAGE)
    with _raises(ErrorCode.TOO_MANY_IN_FLIGHT):
        server.next_event()
    _assert_unusable(server)


def test_descriptors_sent_to_a_server_are_fatal_and_not_kept() -> None:
    server = _server()
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        server.receive_data(_frame(Ping(id=2).to_wire()), [7])
    assert server.take_descriptors() == []
    _assert_unusable(server)


def test_server_send_checks_the_reply_against_what_is_in_flight() -> None:
    server = _server()
    with _raises(ErrorCode.UNEXPECTED_REPLY):
        server.send(PingReply(id=2))
    server.receive_data(_frame(Ping(id=2).to_wire()))
    drain(server)
    with _raises(ErrorCode.UNEXPECTED_REPLY):
        server.send(replace(HELLO_REPLY, id=2))
    with _raises(ErrorCode.BAD_MESSAGE):
        server.send(Ping(id=3))
    server.send(ErrorReply(id=2, code=ErrorCode.INTERNAL, message="boom"))
    with _raises(ErrorCode.UNEXPECTED_REPLY):
        server.send(PingReply(id=2))
    # An id-0 error is a notice tied to no request: always allowed.
    server.send(ErrorReply(id=0, code=ErrorCode.SHUTTING_DOWN, message="bye"))
    assert not server.failed


@pytest.mark.parametrize(
    "reply",
    [
        LookupReply(id=2, matched=1, entry=ENTRY, lease=1),
        LookupReply(id=2, matched=0, entry=None, lease=None, fd=5),
    ],
)
def test_server_send_checks_the_descriptor_count(reply: LookupReply) -> None:
    server = _server()
    server.receive_data(_frame(Lookup(id=2, identity=IDENTITY, tokens=TOKENS).to_wire()))
    drain(server)
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        server.send(reply)
    assert server.in_flight == {2: "lookup"}


# --- client: invalid replies are fatal ---------------------------------------------------------


def _client_waiting(*requests: Lookup | Ping | PutBlocks | OpenBlocks) -> Connection:
    client, _ = connected_pair()
    for request in requests:
        client.send(request)
    return client


def test_a_reply_to_an_unknown_id_is_fatal() -> None:
    client = _client_waiting(Ping(id=2))
    client.receive_data(_frame(PingReply(id=3).to_wire()))
    with _raises(ErrorCode.UNEXPECTED_REPLY):
        client.next_event()
    _assert_unusable(client)


def test_an_error_reply_to_an_unknown_id_is_fatal() -> None:
    client = _client_waiting(Ping(id=2))
    client.receive_data(_frame(ErrorReply(id=3, code=ErrorCode.INTERNAL, message="").to_wire()))
    with _raises(ErrorCode.UNEXPECTED_REPLY):
        client.next_event()


def test_a_reply_op_that_does_not_match_its_request_is_fatal() -> None:
    client = _client_waiting(Ping(id=2))
    client.receive_data(_frame(Status(id=2).to_wire()))
    with _raises(ErrorCode.UNEXPECTED_REPLY):
        client.next_event()


def test_an_error_reply_answers_the_request_and_id_zero_answers_none() -> None:
    client = _client_waiting(Ping(id=2))
    notice = ErrorReply(id=0, code=ErrorCode.SHUTTING_DOWN, message="bye")
    failed = ErrorReply(id=2, code=ErrorCode.NOT_FOUND, message="no")
    client.receive_data(_frame(notice.to_wire()))
    assert drain(client) == [notice]
    assert client.in_flight == {2: "ping"}
    client.receive_data(_frame(failed.to_wire()))
    assert drain(client) == [failed]
    assert client.in_flight == {}


@pytest.mark.parametrize(
    "body",
    [
        {**PingReply(id=2).to_wire(), "extra": 1},
        {"op": "ping"},
        [1],
        {"op": "error", "id": 2, "code": "nonsense", "message": ""},
    ],
    ids=str,
)
def test_an_invalid_reply_body_is_fatal(body: object) -> None:
    client = _client_waiting(Ping(id=2))
    client.receive_data(_frame(body))
    with pytest.raises(ProtocolError):
        client.next_event()
    _assert_unusable(client)


def test_trailing_bytes_in_a_reply_are_fatal() -> None:
    client = _client_waiting(Ping(id=2))
    body = msgpack.packb(PingReply(id=2).to_wire()) + b"\x00"
    client.receive_data(LENGTH.pack(len(body)) + body)
    with _raises(ErrorCode.BAD_MESSAGE):
        client.next_event()


def test_a_reply_missing_its_descriptor_is_fatal() -> None:
    client = _client_waiting(Lookup(id=2, identity=IDENTITY, tokens=TOKENS))
    client.receive_data(_frame(LookupReply(id=2, matched=1, entry=ENTRY, lease=1).to_wire()))
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.next_event()
    _assert_unusable(client)


def test_a_descriptor_no_reply_declares_is_fatal_and_handed_back() -> None:
    client = _client_waiting(Lookup(id=2, identity=IDENTITY, tokens=TOKENS))
    miss = LookupReply(id=2, matched=0, entry=None, lease=None)
    client.receive_data(_frame(miss.to_wire()), [9])
    assert client.next_event() == miss
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.next_event()
    assert client.take_descriptors() == [9]
    assert client.take_descriptors() == []


def test_more_descriptors_than_requests_in_flight_are_refused_at_once() -> None:
    client = _client_waiting(Ping(id=2))
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.receive_data(b"\x00", [5, 6])
    assert client.take_descriptors() == [5, 6]


# --- client: send checks ------------------------------------------------------------------------


def test_client_send_requires_hello_first_and_only_once() -> None:
    client = Connection(Role.CLIENT)
    with _raises(ErrorCode.HANDSHAKE_REQUIRED):
        client.send(Ping(id=2))
    client.send(HELLO)
    client.send(Ping(id=2))  # pipelined behind hello
    with _raises(ErrorCode.BAD_MESSAGE):
        client.send(Hello(id=3, protocol=1, client="x", pid=1))
    assert not client.failed


def test_client_send_refuses_a_duplicate_id_a_bad_id_and_a_reply() -> None:
    client, _ = connected_pair()
    client.send(Ping(id=2))
    with _raises(ErrorCode.DUPLICATE_ID):
        client.send(Status(id=2))
    for bad_id in (0, 1 << 32):
        with _raises(ErrorCode.BAD_MESSAGE):
            client.send(Ping(id=bad_id))
    with _raises(ErrorCode.BAD_MESSAGE):
        client.send(PingReply(id=3))
    assert client.in_flight == {2: "ping"}


def test_client_adopts_the_server_limits_from_the_hello_reply() -> None:
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    small = Limits(max_frame_bytes=200, max_in_flight=2)
    client.send(HELLO)
    client.receive_data(server_hello(server, small))
    assert drain(client) == [
        HelloReply(id=1, protocol=1, server="0.1.0", limits=small, features=())
    ]
    assert client.limits == small
    with _raises(ErrorCode.TOO_LARGE):
        client.send(Lookup(id=2, identity=IDENTITY, tokens=TOKENS))
    client.send(Ping(id=2))
    client.send(Ping(id=3))
    with _raises(ErrorCode.TOO_MANY_IN_FLIGHT):
        client.send(Ping(id=4))
    assert set(client.in_flight) == {2, 3}


def server_hello(server: Connection, limits: Limits) -> bytes:
    server.receive_data(_frame(HELLO.to_wire()))
    drain(server)
    reply = HelloReply(id=1, protocol=1, server="0.1.0", limits=limits, features=())
    return server.send(reply)


def test_a_client_reads_replies_up_to_the_server_frame_limit() -> None:
    client = Connection(Role.CLIENT, Limits(max_frame_bytes=256))
    client.send(HELLO)
    client.receive_data(server_hello(Connection(Role.SERVER), DEFAULT_LIMITS))
    assert drain(client)
    client.send(Status(id=2))
    big = {"op": "status", "id": 2, "status": {"k": "v" * 1000}}
    client.receive_data(_frame(big))
    assert drain(client) == [StatusReply(id=2, status={"k": "v" * 1000})]


def test_events_need_data_until_a_frame_is_complete() -> None:
    client, server = connected_pair()
    frame = client.send(Ping(id=2))
    for byte in chunked(frame[:-1], 1):
        server.receive_data(byte)
        assert server.next_event() is NEED_DATA
    server.receive_data(frame[-1:])
    assert server.next_event() == Ping(id=2)


def test_a_partial_frame_counts_its_declared_length_as_soon_as_that_is_in() -> None:
    client, server = connected_pair()
    frame = client.send(Ping(id=2))
    server.receive_data(frame[:2])
    assert server.next_event() is NEED_DATA
    assert server.partial_frame_bytes == 2  # its length not in yet: the bytes themselves
    server.receive_data(frame[2:5])
    assert server.next_event() is NEED_DATA
    assert server.partial_frame_bytes == len(frame)
    server.receive_data(frame[5:])
    assert server.next_event() == Ping(id=2)
    assert server.partial_frame_bytes == 0


# ---- local and remote errors, and the final error ------------------------------------------


def test_what_the_peer_sends_wrong_is_a_remote_error() -> None:
    _, server = connected_pair()
    server.receive_data(LENGTH.pack(0))
    with pytest.raises(RemoteProtocolError, match=r"^bad_frame: "):
        server.next_event()
    client, _ = connected_pair()
    client.receive_data(_frame({"op": "ping", "id": 77}))
    with pytest.raises(RemoteProtocolError, match=r"^unexpected_reply: "):
        client.next_event()


def test_what_this_side_sends_wrong_is_a_local_error_and_changes_nothing() -> None:
    client, server = connected_pair(replace(DEFAULT_LIMITS, max_frame_bytes=256))
    with pytest.raises(LocalProtocolError, match=r"^unexpected_reply: "):
        server.send(PingReply(id=5))
    server.receive_data(client.send(Status(id=5)))
    assert drain(server) == [Status(id=5)]
    with pytest.raises(LocalProtocolError, match=r"^too_large: "):
        server.send(StatusReply(id=5, status={"text": "x" * 300}))
    client.receive_data(server.send(StatusReply(id=5, status={})))
    assert drain(client) == [StatusReply(id=5, status={})]
    assert not server.failed
    assert not client.failed
    server.receive_data(client.send(Ping(id=6)))
    assert drain(server) == [Ping(id=6)]
    client.receive_data(server.send(PingReply(id=6)))
    assert drain(client) == [PingReply(id=6)]


def test_the_final_error_is_said_even_after_a_fatal_error_and_is_the_last_word() -> None:
    client, server = connected_pair()
    server.receive_data(LENGTH.pack(0))
    with pytest.raises(RemoteProtocolError) as raised:
        server.next_event()
    frame = server.send_final_error(raised.value.code, raised.value.message)
    client.receive_data(frame)
    assert drain(client) == [
        ErrorReply(id=0, code=ErrorCode.BAD_FRAME, message=raised.value.message)
    ]
    with pytest.raises(LocalProtocolError):
        server.send_final_error(ErrorCode.INTERNAL, "twice")


def test_after_the_final_error_nothing_more_is_sent() -> None:
    client, server = connected_pair()
    server.receive_data(client.send(Ping(id=3)))
    assert drain(server) == [Ping(id=3)]
    refusal = server.send_final_error(ErrorCode.SHUTTING_DOWN, "going away")
    assert not server.can_send
    with pytest.raises(LocalProtocolError):
        server.send(PingReply(id=3))
    client.receive_data(refusal)
    assert drain(client) == [ErrorReply(id=0, code=ErrorCode.SHUTTING_DOWN, message="going away")]


def test_only_a_server_says_a_final_error() -> None:
    client, _ = connected_pair()
    with pytest.raises(LocalProtocolError):
        client.send_final_error(ErrorCode.INTERNAL, "no")
    assert client.can_send


def test_a_fresh_server_connection_can_turn_a_peer_away() -> None:
    refusal = Connection(Role.SERVER).send_final_error(ErrorCode.PERMISSION_DENIED, "not you")
    client = Connection(Role.CLIENT)
    client.send(HELLO)
    client.receive_data(refusal)
    assert drain(client) == [ErrorReply(id=0, code=ErrorCode.PERMISSION_DENIED, message="not you")]


# --- replies with many descriptors (put_blocks, open_blocks) -----------------------------------


def test_a_block_files_reply_takes_its_count_of_descriptors_in_order() -> None:
    client, server = connected_pair()
    requests = (
        PutBlocks(id=2, put=1, first=4, count=3),
        Lookup(id=3, identity=IDENTITY, tokens=TOKENS),
        OpenBlocks(id=4, lease=1, first=0, count=2),
    )
    for request in requests:
        server.receive_data(client.send(request))
    assert drain(server) == list(requests)
    staged = PutBlocksReply(id=2, count=3).with_fds((10, 11, 12))
    hit = LookupReply(id=3, matched=3, entry=ENTRY, lease=1).with_fds((13,))
    opened = OpenBlocksReply(id=4, count=2).with_fds((14, 15))
    stream = server.send(staged) + server.send(hit) + server.send(opened)
    # Every descriptor arrives before any frame is complete: 6, as the requests claim at most.
    client.receive_data(stream[:2], [10, 11, 12, 13, 14, 15])
    assert drain(client) == []
    client.receive_data(stream[2:])
    assert drain(client) == [staged, hit, opened]
    assert [reply.fds for reply in (staged, hit, opened)] == [(10, 11, 12), (13,), (14, 15)]
    assert client.take_descriptors() == []


def test_queued_descriptors_are_bounded_by_what_the_requests_in_flight_claim() -> None:
    # put_blocks of 3 and a lookup claim 4; a ping claims none.
    client = _client_waiting(
        PutBlocks(id=2, put=1, first=0, count=3),
        Lookup(id=3, identity=IDENTITY, tokens=TOKENS),
        Ping(id=4),
    )
    client.receive_data(b"\x00", [1, 2, 3, 4])
    assert not client.failed
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.receive_data(b"\x00", [5])
    assert client.take_descriptors() == [1, 2, 3, 4, 5]


def test_a_descriptor_while_only_a_ping_is_in_flight_is_refused_at_once() -> None:
    client = _client_waiting(Ping(id=2))
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.receive_data(b"\x00", [5])
    assert client.take_descriptors() == [5]


def test_a_reply_declaring_more_descriptors_than_its_request_asked_is_fatal() -> None:
    client = _client_waiting(
        OpenBlocks(id=2, lease=1, first=0, count=2), Lookup(id=3, identity=IDENTITY, tokens=TOKENS)
    )
    client.receive_data(_frame(OpenBlocksReply(id=2, count=3).to_wire()), [7, 8, 9])
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.next_event()
    _assert_unusable(client)
    assert client.take_descriptors() == [7, 8, 9]


def test_a_block_files_reply_short_of_its_descriptors_is_fatal() -> None:
    client = _client_waiting(PutBlocks(id=2, put=1, first=0, count=3))
    client.receive_data(_frame(PutBlocksReply(id=2, count=3).to_wire()), [7, 8])
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.next_event()
    assert client.take_descriptors() == [7, 8]


@pytest.mark.parametrize(
    "reply",
    [
        PutBlocksReply(id=2, count=2).with_fds((5,)),
        PutBlocksReply(id=2, count=2).with_fds((5, 6, 7)),
        PutBlocksReply(id=2, count=2).with_fds((5, -1)),
        PutBlocksReply(id=2, count=4).with_fds((5, 6, 7, 8)),  # more than the request asked
    ],
)
def test_server_send_checks_a_block_files_reply(reply: PutBlocksReply) -> None:
    server = _server()
    server.receive_data(_frame(PutBlocks(id=2, put=1, first=0, count=2).to_wire()))
    assert drain(server) == [PutBlocks(id=2, put=1, first=0, count=2)]
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        server.send(reply)
    assert server.in_flight == {2: "put_blocks"}
    server.send(PutBlocksReply(id=2, count=2).with_fds((5, 6)))
    assert server.in_flight == {}


def test_an_error_reply_to_a_block_request_frees_its_claim() -> None:
    client = _client_waiting(PutBlocks(id=2, put=1, first=0, count=2), Ping(id=3))
    error = ErrorReply(id=2, code=ErrorCode.NOT_FOUND, message="no put 1")
    client.receive_data(_frame(error.to_wire()))
    assert drain(client) == [error]
    with _raises(ErrorCode.BAD_DESCRIPTORS):
        client.receive_data(b"\x00", [5])  # the ping left in flight claims none
