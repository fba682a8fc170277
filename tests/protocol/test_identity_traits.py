"""An identity's traits: words for people that travel with it and never change what it is
(its digest, its equality, an entry header's identity), checked wherever they are read."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from entry_samples import data_of, forge, header_of, read, write
from kvd_protocol import messages as m
from kvd_protocol import ops
from kvd_protocol.entry import EntryPlan, LayerSpec, TensorSpec, plan_entry
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.identity import (
    MAX_TRAITS_BYTES,
    TRAITS_META,
    Identity,
    join_traits,
    parse_traits,
)
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens
from wire_samples import IDENTITY

TRAITS = "kv=8bit-g64,template=1a2b3c4d,adapter=none"
# IDENTITY's digest as every version of kvd has computed it: the name of its folder.
DIGEST_OF_BEFORE = "3ab17b2abb77ac9110be596b3d720a89"


def test_traits_change_neither_the_digest_nor_equality() -> None:
    described = dataclasses.replace(IDENTITY, traits=TRAITS)
    assert IDENTITY.digest() == described.digest() == DIGEST_OF_BEFORE
    assert described == IDENTITY
    assert hash(described) == hash(IDENTITY)
    assert described.trait_map() == {"kv": "8bit-g64", "template": "1a2b3c4d", "adapter": "none"}
    assert described.to_wire() == {**IDENTITY.to_wire(), "traits": TRAITS}
    assert "traits" not in IDENTITY.to_wire()  # none: the map a daemon of any version reads


def test_traits_travel_with_a_lookup_and_its_reply_says_why_it_missed() -> None:
    described = dataclasses.replace(IDENTITY, traits=TRAITS)
    request = m.Lookup(id=3, identity=described, tokens=pack_tokens(range(4)), explain=True)
    decoded = ops.decode_request(msgpack.unpackb(msgpack.packb(request.to_wire())), DEFAULT_LIMITS)
    assert isinstance(decoded, m.Lookup)
    assert decoded.explain
    assert decoded.identity.traits == TRAITS
    reply = m.LookupReply(
        id=3, matched=0, entry=None, lease=None, miss="kv differs", detail="identity ..."
    )
    body = msgpack.unpackb(msgpack.packb(reply.to_wire()))
    assert m.LookupReply.from_wire(body, DEFAULT_LIMITS).miss == "kv differs"


def test_a_reply_to_a_client_that_did_not_ask_is_the_map_of_before() -> None:
    plain = m.LookupReply(id=3, matched=0, entry=None, lease=None)
    assert set(plain.to_wire()) == {"op", "id", "matched", "entry", "lease"}
    asked = m.Lookup(id=3, identity=IDENTITY, tokens=b"")
    assert set(asked.to_wire()) == {"op", "id", "identity", "tokens"}


def test_a_hit_with_a_miss_reason_is_a_bad_message() -> None:
    body = {"op": "lookup", "id": 1, "matched": 0, "entry": None, "lease": None}
    entry = {"id": "e", "identity": "d", "tokens": 1, "bytes": 1, "trimmable": True}
    hit = {**body, "entry": {**entry, "created": 1.0, "durable": True}, "lease": 4}
    with pytest.raises(ProtocolError, match="a hit has no miss reason"):
        m.LookupReply.from_wire({**hit, "miss": "no entry"}, DEFAULT_LIMITS)


@pytest.mark.parametrize(
    "traits",
    [
        "kv",  # no value
        "kv=",  # an empty one
        "KV=8",  # an upper-case key
        "kv=8,kv=4",  # a key twice
        "kv=8 bit",  # a space
        "kv=8;rm",  # a character a shell would read
        "kv=8,",  # a trailing comma
        "kv=\x1b[2J",  # a terminal's escape
        "kv=é",  # not ASCII
        ",".join(f"k{i}=v" for i in range(9)),  # more than eight
        "k=" + "v" * 49,  # a value too long
        ",".join(f"key{i}=" + "v" * 40 for i in range(4)),  # over MAX_TRAITS_BYTES
    ],
)
def test_ill_formed_traits_are_a_bad_message_naming_them(traits: str) -> None:
    request = {**m.Lookup(id=3, identity=IDENTITY, tokens=b"").to_wire()}
    request["identity"] = {**IDENTITY.to_wire(), "traits": traits}
    with pytest.raises(ProtocolError, match=r"identity\.traits") as raised:
        ops.decode_request(request, DEFAULT_LIMITS)
    assert raised.value.code is ErrorCode.BAD_MESSAGE
    with pytest.raises(ValueError, match=r"."):  # in any words: ProtocolError's are checked
        dataclasses.replace(IDENTITY, traits=traits)


def test_traits_are_bounded() -> None:
    longest = ",".join(f"k{i}=" + "v" * (MAX_TRAITS_BYTES // 8 - 4) for i in range(8))
    assert len(longest) <= MAX_TRAITS_BYTES
    assert len(parse_traits(longest)) == 8
    joined = join_traits({"kv": "none", "adapter": "lora-1a2b3c4d"})
    assert joined == "kv=none,adapter=lora-1a2b3c4d"
    with pytest.raises(ValueError, match="not key=value"):
        join_traits({"kv": "8 bit"})


def test_an_entry_keeps_its_traits_in_meta_and_its_identity_map_as_before() -> None:
    blob, _ = write(_plan(dataclasses.replace(IDENTITY, traits=TRAITS)))
    written = header_of(blob)
    assert written["identity"] == IDENTITY.digest_fields()  # what a reader of any version reads
    assert written["meta"] == {"engine": "own", TRAITS_META: TRAITS}
    header = read(blob)
    assert header.identity.traits == TRAITS
    assert header.identity.digest() == DIGEST_OF_BEFORE
    assert header.meta["engine"] == "own"


def test_an_entry_of_an_identity_without_traits_is_written_as_before() -> None:
    blob, _ = write(_plan(IDENTITY))
    assert header_of(blob)["meta"] == {"engine": "own"}
    assert read(blob).identity.traits == ""


def test_ill_formed_traits_in_meta_are_left_out_not_held_against_the_entry() -> None:
    blob, _ = write(_plan(dataclasses.replace(IDENTITY, traits=TRAITS)))
    written = header_of(blob)
    written["meta"][TRAITS_META] = "kv=\x1b[2J"
    header = read(forge(written, data_of(blob)))
    assert header.identity.traits == ""
    assert header.identity.digest() == DIGEST_OF_BEFORE
    assert header.meta[TRAITS_META] == "kv=\x1b[2J"  # meta is the engine's own, as it was


def _plan(identity: Identity) -> EntryPlan:
    spec = TensorSpec("float16", (1, 2, 8, 4))
    return plan_entry(
        identity,
        pack_tokens(range(8)),
        [LayerSpec("kv", (spec, spec), trimmable=True)],
        created=1_700_000_000.0,
        min_reuse=0,
        meta={"engine": "own"},
    )
