"""Messages: wire maps, strict decoding of each field, the op table, descriptor counts."""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError, astuple, fields, replace
from typing import Any

import msgpack
import pytest
from kvd_protocol.blocks import block_hashes
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.framing import decode_body
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.messages import (
    MAX_BLOCK_BATCH,
    DropReport,
    ErrorReply,
    Evict,
    FindCheckpoint,
    Flush,
    FlushReply,
    HelloReply,
    Lookup,
    LookupReply,
    Message,
    OpenBlocks,
    OpenBlocksReply,
    Ping,
    PutBegin,
    PutBeginReply,
    PutBlocks,
    PutBlocksReply,
    PutCommit,
    Release,
    Reply,
    StatusReply,
)
from kvd_protocol.ops import OPS, decode_request, peek_id
from kvd_protocol.tokens import pack_tokens
from wire_samples import BLOCKS, ENTRY, HELLO, HELLO_REPLY, IDENTITY, TOKENS, exchanges

MESSAGES: list[Message] = [HELLO, HELLO_REPLY] + [m for pair in exchanges() for m in pair]
# Fields added within a protocol version: a peer that predates them neither sends nor expects them.
OPTIONAL_FIELDS: dict[type[Message], set[str]] = {
    Lookup: {"min_tokens", "explain", "fetch"},
    LookupReply: {"miss", "detail", "fetching"},
    Release: {"damaged"},
    PutBegin: {"blocks", "block_tokens", "block_size", "prefill_cost"},
    PutBeginReply: {"held"},
    PutCommit: {"store_ms", "dropped"},
    Flush: {"remote"},
    FlushReply: {
        "remote_pending",
        "remote_pending_bytes",
        "remote_dropped",
        "remote_dropped_for",
        "remote_down",
    },
}


def _ids(messages: list[Message]) -> list[str]:
    return [f"{type(m).__name__}-{m.id}" for m in messages]


def _decode(cls: type[Message], wire: object, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode as the receiving side does: through msgpack, then the class."""
    return cls.from_wire(decode_body(msgpack.packb(wire)), limits)


def _without_fds(message: Message) -> Message:
    return message.with_fds(()) if isinstance(message, Reply) else message


@pytest.mark.parametrize("message", MESSAGES, ids=_ids(MESSAGES))
def test_every_message_round_trips_through_its_wire_map(message: Message) -> None:
    assert _decode(type(message), message.to_wire()) == _without_fds(message)


@pytest.mark.parametrize("message", MESSAGES, ids=_ids(MESSAGES))
def test_wire_map_is_the_envelope_plus_fields_and_never_a_descriptor(message: Message) -> None:
    wire = message.to_wire()
    assert wire["op"] == message.op
    assert wire["id"] == message.id
    assert "fd" not in wire


@pytest.mark.parametrize("message", MESSAGES, ids=_ids(MESSAGES))
def test_a_message_compares_hashes_and_shows_by_every_field_and_stays_frozen(
    message: Message,
) -> None:
    """Record's shared __eq__, __hash__ and __repr__ are what a dataclass would generate."""
    names = [f.name for f in fields(message)]
    twin = replace(message)
    assert twin == message
    assert twin is not message
    if not isinstance(message, StatusReply):  # a dict field: unhashable, as a dataclass's
        assert hash(twin) == hash(message)
    shown = ", ".join(f"{name}={getattr(message, name)!r}" for name in names)
    assert repr(message) == f"{type(message).__qualname__}({shown})"
    assert replace(message, id=message.id + 1) != message
    assert message != Ping(id=message.id) or type(message) is Ping
    with pytest.raises(FrozenInstanceError):
        message.id = 0  # type: ignore[misc]


def test_messages_are_equal_exactly_when_their_type_and_every_field_are() -> None:
    """Across every pair of sample messages, and each message against a copy with any one
    field changed: an __eq__ that compared less than every field would let one through."""
    for a in MESSAGES:
        for b in MESSAGES:
            assert (a == b) == (type(a) is type(b) and astuple(a) == astuple(b))
        for field in fields(a):
            value = getattr(a, field.name)
            other = _another(value)
            if other is not None:
                changed = copy.copy(a)
                object.__setattr__(changed, field.name, other)
                assert changed != a, field.name


def _another(value: object) -> object | None:
    """A value unequal to value, of a kind a field may hold (None when there is none)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, bytes):
        return value + b"x"
    if isinstance(value, tuple):
        return (*value, value[0]) if value else None
    if value is None:
        return 0
    return None


def test_op_table_pairs_each_request_with_the_reply_of_the_same_op() -> None:
    assert set(OPS) == {
        "hello",
        "ping",
        "put_begin",
        "put_blocks",
        "open_blocks",
        "put_commit",
        "put_abort",
        "ticket",
        "lookup",
        "find_checkpoint",
        "forget_checkpoint",
        "release",
        "flush",
        "status",
        "list",
        "evict",
        "verify",
        "open_entry",
        "presence",
    }
    for name, op in OPS.items():
        assert op.request.op == op.reply.op == name


def _wrong_values(good: object) -> list[object]:
    """Values of a type the field does not accept (nil is left out: optional fields take it)."""
    wrong: list[object] = [[[]]]
    if isinstance(good, bool):
        wrong += [1, "true"]
    elif isinstance(good, int):
        wrong += ["1", True, 1.0, -1]
    elif isinstance(good, float):
        wrong += ["1.0", True, -1.0]
    elif isinstance(good, str):
        wrong += [1, b"text"]
    elif isinstance(good, bytes):
        wrong += ["text", 4]
    elif isinstance(good, dict):
        wrong += [7, "map"]
    return wrong


_FIELD_CASES = [
    (message, key, bad)
    for message in MESSAGES
    for key, good in message.to_wire().items()
    if key != "op"
    for bad in _wrong_values(good)
]


@pytest.mark.parametrize(
    ("message", "key", "bad"),
    _FIELD_CASES,
    ids=[f"{type(m).__name__}-{m.id}.{k}={b!r}" for m, k, b in _FIELD_CASES],
)
def test_a_wrong_type_in_any_field_is_a_bad_message(message: Message, key: str, bad: Any) -> None:
    wire = {**message.to_wire(), key: bad}
    with pytest.raises(ProtocolError) as caught:
        _decode(type(message), wire)
    assert caught.value.code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize("message", MESSAGES, ids=_ids(MESSAGES))
def test_an_extra_field_is_a_bad_message(message: Message) -> None:
    with pytest.raises(ProtocolError) as caught:
        _decode(type(message), {**message.to_wire(), "extra": 1})
    assert caught.value.code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize("message", MESSAGES, ids=_ids(MESSAGES))
def test_a_missing_field_is_a_bad_message(message: Message) -> None:
    for key in message.to_wire().keys() - OPTIONAL_FIELDS.get(type(message), set()):
        wire = message.to_wire()
        del wire[key]
        with pytest.raises(ProtocolError) as caught:
            _decode(type(message), wire)
        assert caught.value.code is ErrorCode.BAD_MESSAGE, key


def test_an_optional_field_is_left_out_at_its_default_and_decoded_when_present() -> None:
    plain = Lookup(id=3, identity=IDENTITY, tokens=pack_tokens([1, 2, 3]))
    assert "min_tokens" not in plain.to_wire()  # what a daemon that predates it accepts
    assert _decode(Lookup, plain.to_wire()) == plain
    asking = replace(plain, min_tokens=2)
    assert asking.to_wire()["min_tokens"] == 2
    assert _decode(Lookup, asking.to_wire()) == asking
    with pytest.raises(ProtocolError):
        _decode(Lookup, {**asking.to_wire(), "min_tokens": -1})


def test_put_begin_carries_a_prefill_cost_only_when_measured() -> None:
    plain = PutBegin(id=4, identity=IDENTITY, tokens=pack_tokens([1, 2]), size=16384)
    assert "prefill_cost" not in plain.to_wire()
    measured = replace(plain, prefill_cost=0.0025)
    assert _decode(PutBegin, measured.to_wire()) == measured
    for bad in (-0.001, float("inf"), "fast"):
        with pytest.raises(ProtocolError):
            _decode(PutBegin, {**measured.to_wire(), "prefill_cost": bad})


def test_put_commit_carries_the_engine_s_drops_only_when_told() -> None:
    plain = PutCommit(id=5, put=1)
    assert "dropped" not in plain.to_wire()  # what a daemon that predates it accepts
    told = replace(plain, dropped=DropReport(snapshots=2, bytes=4096))
    assert told.to_wire()["dropped"] == {"snapshots": 2, "bytes": 4096}
    assert _decode(PutCommit, told.to_wire()) == told
    for bad in (
        {"snapshots": 2},
        {"snapshots": 2, "bytes": 1, "x": 0},
        {"snapshots": 1.5, "bytes": 1},
        3,
    ):
        with pytest.raises(ProtocolError) as caught:
            _decode(PutCommit, {**told.to_wire(), "dropped": bad})
        assert caught.value.code is ErrorCode.BAD_MESSAGE, bad


def test_a_hello_reply_names_a_tenant_only_when_there_is_one() -> None:
    assert "tenant" not in HELLO_REPLY.to_wire()  # what a client that predates it reads
    assert _decode(HelloReply, HELLO_REPLY.to_wire()) == HELLO_REPLY
    tenant = replace(HELLO_REPLY, tenant="uid:501/")
    assert tenant.to_wire()["tenant"] == "uid:501/"
    assert _decode(HelloReply, tenant.to_wire()) == tenant
    with pytest.raises(ProtocolError) as caught:
        _decode(HelloReply, {**tenant.to_wire(), "tenant": 501})
    assert caught.value.code is ErrorCode.BAD_MESSAGE


def test_nested_maps_are_checked_strictly() -> None:
    identity = {**IDENTITY.to_wire(), "extra": "x"}
    with pytest.raises(ProtocolError, match="identity"):
        _decode(
            Lookup, {**Lookup(id=1, identity=IDENTITY, tokens=b"").to_wire(), "identity": identity}
        )
    entry = ENTRY.to_map()
    del entry["durable"]
    reply = LookupReply(id=1, matched=1, entry=ENTRY, lease=1).to_wire()
    with pytest.raises(ProtocolError, match="durable"):
        _decode(LookupReply, {**reply, "entry": entry})
    limits = {**DEFAULT_LIMITS.to_wire(), "max_frame_bytes": 0}
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        _decode(HelloReply, {**HELLO_REPLY.to_wire(), "limits": limits})


def test_a_body_of_another_op_is_refused() -> None:
    with pytest.raises(ProtocolError) as caught:
        _decode(Lookup, {**Lookup(id=1, identity=IDENTITY, tokens=b"").to_wire(), "op": "ping"})
    assert caught.value.code is ErrorCode.BAD_MESSAGE


def test_tokens_over_the_limit_are_too_large_and_ragged_tokens_a_bad_message() -> None:
    limits = Limits(max_tokens=8)
    at_limit = PutBegin(id=1, identity=IDENTITY, tokens=pack_tokens(range(8)), size=1)
    assert _decode(PutBegin, at_limit.to_wire(), limits) == at_limit
    over = replace(at_limit, tokens=pack_tokens(range(9)))
    with pytest.raises(ProtocolError) as caught:
        _decode(PutBegin, over.to_wire(), limits)
    assert caught.value.code is ErrorCode.TOO_LARGE
    ragged = replace(at_limit, tokens=b"\x01\x02\x03")
    with pytest.raises(ProtocolError) as caught:
        _decode(PutBegin, ragged.to_wire(), limits)
    assert caught.value.code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize(
    ("entry", "identity", "all_"),
    [
        (None, None, False),
        ("e", "d", False),
        ("e", None, True),
        (None, "d", True),
        ("e", "d", True),
    ],
)
def test_evict_needs_exactly_one_selector(
    entry: str | None, identity: str | None, all_: bool
) -> None:
    wire = Evict(id=1, entry=entry, identity=identity, all=all_).to_wire()
    with pytest.raises(ProtocolError, match="exactly one"):
        _decode(Evict, wire)


def test_lookup_reply_has_a_lease_exactly_when_it_has_an_entry() -> None:
    for entry, lease in ((ENTRY, None), (None, 3)):
        wire = LookupReply(id=1, matched=0, entry=entry, lease=lease).to_wire()
        with pytest.raises(ProtocolError, match="lease"):
            _decode(LookupReply, wire)


def test_error_reply_accepts_id_zero_and_only_known_codes() -> None:
    notice = ErrorReply(id=0, code=ErrorCode.BAD_FRAME, message="length 0")
    assert _decode(ErrorReply, notice.to_wire()) == notice
    with pytest.raises(ProtocolError, match="error code"):
        _decode(ErrorReply, {**notice.to_wire(), "code": "no_such_code"})


def test_status_is_free_form_but_not_ext_types() -> None:
    reply = StatusReply(id=1, status={"a": {"b": [1, 2.5, None, b"x", "y", True]}})
    assert _decode(StatusReply, reply.to_wire()) == reply
    with pytest.raises(ProtocolError, match="Timestamp"):
        _decode(StatusReply, {**reply.to_wire(), "status": {"t": [msgpack.Timestamp(1)]}})
    with pytest.raises(ProtocolError, match="keys must be strings"):
        _decode(StatusReply, {**reply.to_wire(), "status": {"t": [{b"k": 1}]}})


def test_descriptor_count_follows_the_reply_fields() -> None:
    assert PutBeginReply(id=1, put=1, skip=None).descriptor_count() == 1
    assert PutBeginReply(id=1, put=1, skip="covered").descriptor_count() == 0
    assert LookupReply(id=1, matched=1, entry=ENTRY, lease=1).descriptor_count() == 1
    assert LookupReply(id=1, matched=0, entry=None, lease=None).descriptor_count() == 0
    assert HELLO_REPLY.descriptor_count() == 0
    assert PutBeginReply(id=1, put=1, skip=None).with_fds((5,)).fds == (5,)


def test_decode_request_dispatches_on_op() -> None:
    assert decode_request(HELLO.to_wire(), DEFAULT_LIMITS) == HELLO
    with pytest.raises(ProtocolError) as caught:
        decode_request({"op": "launch", "id": 1}, DEFAULT_LIMITS)
    assert caught.value.code is ErrorCode.UNKNOWN_OP
    for body in ({"id": 1}, {"op": 5, "id": 1}, [1, 2], None):
        with pytest.raises(ProtocolError) as caught:
            decode_request(body, DEFAULT_LIMITS)
        assert caught.value.code is ErrorCode.BAD_MESSAGE


def test_a_reply_op_is_not_a_request() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_request(
            ErrorReply(id=1, code=ErrorCode.INTERNAL, message="").to_wire(), DEFAULT_LIMITS
        )
    assert caught.value.code is ErrorCode.UNKNOWN_OP


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"id": 7}, 7),
        ({"id": (1 << 32) - 1}, (1 << 32) - 1),
        ({"id": 0}, 0),
        ({"id": 1 << 32}, 0),
        ({"id": True}, 0),
        ({"id": "7"}, 0),
        ({}, 0),
        ([7], 0),
    ],
)
def test_peek_id_reads_only_an_answerable_id(body: object, expected: int) -> None:
    assert peek_id(body) == expected


# --- blocks (feature "blocks") ----------------------------------------------------------------

BLOCKED_PUT = PutBegin(
    id=1,
    identity=IDENTITY,
    tokens=TOKENS,  # 64 tokens: 4 blocks of 16
    size=1 << 16,
    blocks=BLOCKS,
    block_tokens=16,
    block_size=1 << 17,
)


def test_a_put_without_blocks_leaves_the_block_fields_out() -> None:
    plain = PutBegin(id=1, identity=IDENTITY, tokens=TOKENS, size=5)
    assert plain.to_wire().keys() == {"op", "id", "identity", "tokens", "size"}
    assert _decode(PutBegin, plain.to_wire()) == plain
    assert plain.hashes == ()
    assert PutBeginReply(id=1, put=1, skip=None).to_wire().keys() == {"op", "id", "put", "skip"}


def test_a_put_with_blocks_names_its_hashes_in_order() -> None:
    assert _decode(PutBegin, BLOCKED_PUT.to_wire()) == BLOCKED_PUT
    assert BLOCKED_PUT.hashes == tuple(BLOCKS[i : i + 16] for i in range(0, 64, 16))
    # T // block_tokens blocks: 70 tokens in blocks of 32 are 2 blocks and a 6-token tail.
    seventy = pack_tokens(range(70))
    two = replace(
        BLOCKED_PUT, tokens=seventy, blocks=b"".join(block_hashes(seventy, 32)), block_tokens=32
    )
    assert len(two.hashes) == 2
    assert _decode(PutBegin, two.to_wire()) == two
    with pytest.raises(ProtocolError, match="2 block hashes for 1"):
        _decode(PutBegin, replace(two, tokens=pack_tokens(range(63))).to_wire())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"blocks": b""}, "no whole block|block hashes"),
        ({"blocks": BLOCKS[:48]}, "3 block hashes for 4"),
        ({"blocks": BLOCKS + BLOCKS[:16]}, "5 block hashes for 4"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"block_tokens": 24}, "power of two"),
        ({"block_tokens": 8}, "power of two"),
        ({"block_tokens": 1 << 17}, "power of two"),
        ({"block_tokens": 128}, "no whole block"),  # 64 tokens make no block of 128
        ({"block_size": 0}, "block_size"),
        ({"blocks": b"", "block_tokens": 0}, "block_tokens"),  # a size alone names no blocks
        ({"blocks": BLOCKS[16:] + BLOCKS[:16]}, "chained hashes"),
        ({"tokens": TOKENS[4:] + TOKENS[:4]}, "chained hashes"),
        ({"block_tokens": 32, "blocks": BLOCKS[:32]}, "chained hashes"),  # of blocks of 16
        ({"blocks": BLOCKS[:16], "block_size": 0, "block_tokens": 0}, "block_tokens"),
    ],
)
def test_put_begin_block_fields_must_agree(change: dict[str, Any], message: str) -> None:
    wire = replace(BLOCKED_PUT, **change).to_wire()
    with pytest.raises(ProtocolError, match=message) as caught:
        _decode(PutBegin, wire)
    assert caught.value.code is ErrorCode.BAD_MESSAGE


def test_block_hashes_are_whole_and_bounded() -> None:
    with pytest.raises(ProtocolError, match="multiple of 16"):
        _decode(PutBegin, {**BLOCKED_PUT.to_wire(), "blocks": BLOCKS[:-1]})
    # At most one hash per 16 tokens of max_tokens: 4 hashes under max_tokens 64, not 5.
    limits = Limits(max_tokens=64)
    assert _decode(PutBegin, BLOCKED_PUT.to_wire(), limits) == BLOCKED_PUT
    with pytest.raises(ProtocolError, match="over the limit"):
        _decode(PutBegin, {**BLOCKED_PUT.to_wire(), "blocks": BLOCKS + BLOCKS[:16]}, limits)


def test_a_skipped_put_holds_no_blocks() -> None:
    holding = PutBeginReply(id=1, put=1, skip=None, held=3)
    assert _decode(PutBeginReply, holding.to_wire()) == holding
    wire = PutBeginReply(id=1, put=1, skip="duplicate", held=1).to_wire()
    with pytest.raises(ProtocolError, match="holds no blocks"):
        _decode(PutBeginReply, wire)


@pytest.mark.parametrize("cls", [PutBlocks, OpenBlocks])
@pytest.mark.parametrize("count", [0, MAX_BLOCK_BATCH + 1])
def test_a_block_range_asks_for_1_to_64_blocks(cls: type[Message], count: int) -> None:
    good = {"op": cls.op, "id": 1, "put": 1, "lease": 1, "first": 0, "count": MAX_BLOCK_BATCH}
    wire = {k: v for k, v in good.items() if k in cls.__dataclass_fields__ or k == "op"}
    assert _decode(cls, wire).to_wire() == wire
    with pytest.raises(ProtocolError, match="count") as caught:
        _decode(cls, {**wire, "count": count})
    assert caught.value.code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize("cls", [PutBlocksReply, OpenBlocksReply])
def test_a_block_files_reply_declares_one_descriptor_per_block(cls: type[Reply]) -> None:
    reply = cls(id=1, count=3)  # type: ignore[call-arg]
    assert reply.descriptor_count() == 3
    assert reply.fds == ()
    held = reply.with_fds((7, 8, 9))
    assert held.fds == (7, 8, 9)
    assert held.to_wire() == {"op": cls.op, "id": 1, "count": 3}
    for count in (0, MAX_BLOCK_BATCH + 1):
        with pytest.raises(ProtocolError, match="count"):
            _decode(cls, {**reply.to_wire(), "count": count})


def test_each_request_bounds_the_descriptors_of_its_reply() -> None:
    assert BLOCKED_PUT.reply_descriptors() == 1
    assert Lookup(id=1, identity=IDENTITY, tokens=b"").reply_descriptors() == 1
    assert FindCheckpoint(id=1, identity=IDENTITY, key="k", prompt=b"").reply_descriptors() == 1
    assert PutBlocks(id=1, put=1, first=2, count=5).reply_descriptors() == 5
    assert OpenBlocks(id=1, lease=1, first=0, count=64).reply_descriptors() == 64
    assert Ping(id=1).reply_descriptors() == 0
