"""Version 2: one hostile manifest or block file per validation rule, each rejected with that
rule, and every way a block can fail to be the one its manifest lists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from entry_samples import (
    IDENTITY,
    data_of,
    forge,
    header_of,
    manifest_layers,
    read,
    read_block,
    sample_manifest,
    write,
    write_blocks,
)
from kvd_protocol.blocks import block_hash, block_name
from kvd_protocol.entry import ALIGNMENT, FLAG_BLOCK, PREFIX_BYTES, plan_manifest
from kvd_protocol.entry_reader import check_block, verify_slot
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.tokens import pack_tokens
from test_entry_hostile import CASES as V1_CASES

PLAN = sample_manifest()  # 40 tokens, blocks of 16: 2 blocks, an 8-token tail
MANIFEST_BLOB, MANIFEST = write(PLAN.entry)
MANIFEST_FILE = bytes(MANIFEST_BLOB)
BLOCKS = write_blocks(PLAN)
BLOCK_NAME, _BLOCK_BLOB, BLOCK = BLOCKS[0]
BLOCK_FILE = bytes(_BLOCK_BLOB)

Edit = Callable[[dict[str, Any]], None]


def manifest(edit: Edit, **prefix: Any) -> bytes:
    """The valid manifest with its header map edited and its checksum made right again."""
    header = header_of(MANIFEST_FILE)
    edit(header)
    return forge(header, data_of(MANIFEST_FILE), **{"version": 2, **prefix})


def block(edit: Edit, **prefix: Any) -> bytes:
    """The valid first block file, edited likewise."""
    header = header_of(BLOCK_FILE)
    edit(header)
    return forge(header, data_of(BLOCK_FILE), **{"version": 2, "flags": FLAG_BLOCK, **prefix})


def flipped(blob: bytes, position: int) -> bytes:
    changed = bytearray(blob)
    changed[position] ^= 0x01
    return bytes(changed)


def unchanged(header: dict[str, Any]) -> None:
    """Keep the header as it is (for cases that break the prefix)."""


def assign(**values: Any) -> Edit:
    return lambda header: header.update(values)


def layer(index: int, **values: Any) -> Edit:
    return lambda header: header["layers"][index].update(values)


def slot(layer_index: int, index: int, **values: Any) -> Edit:
    return lambda header: header["layers"][layer_index]["slots"][index].update(values)


def drop(key: str) -> Edit:
    return lambda header: header.pop(key)


def _no_layer_blocked(header: dict[str, Any]) -> None:
    for item in header["layers"]:
        item["blocked"] = False


def _blocks_swapped(header: dict[str, Any]) -> None:
    header["blocks"] = header["blocks"][16:] + header["blocks"][:16]


def _other_tokens(header: dict[str, Any]) -> None:
    header["tokens"] = pack_tokens(range(200, 240))


_tail = MANIFEST.slots[0]  # the first blocked slot: float16 (1, 2, 8, 8)
_past_end = len(data_of(BLOCK_FILE))

# (rule, case name, hostile manifest bytes)
MANIFEST_CASES: list[tuple[Rule, str, bytes]] = [
    (Rule.VERSION, "an unknown flag", manifest(unchanged, flags=2)),
    (Rule.VERSION, "a block file", BLOCK_FILE),
    (Rule.SCHEMA, "no block_tokens", manifest(drop("block_tokens"))),
    (Rule.SCHEMA, "no blocks", manifest(drop("blocks"))),
    (Rule.SCHEMA, "a layer without blocked", manifest(lambda h: h["layers"][1].pop("blocked"))),
    (Rule.SCHEMA, "blocked a number", manifest(layer(0, blocked=1))),
    (Rule.SCHEMA, "block_tokens 24", manifest(assign(block_tokens=24))),
    (Rule.SCHEMA, "block_tokens negative", manifest(assign(block_tokens=-16))),
    (Rule.SCHEMA, "blocks without a blocked layer", manifest(_no_layer_blocked)),
    (Rule.SCHEMA, "blocks a list", manifest(assign(blocks=[b"x" * 16]))),
    (Rule.SCHEMA, "a ragged hash", manifest(lambda h: h.update(blocks=h["blocks"][:-1]))),
    (Rule.TOKEN_COUNT, "a block short", manifest(lambda h: h.update(blocks=h["blocks"][:16]))),
    (Rule.TOKEN_COUNT, "blocks of 32", manifest(assign(block_tokens=32))),
    (Rule.TOKEN_COUNT, "a tail too long", manifest(slot(0, 0, shape=[1, 2, 16, 4]))),
    (Rule.TOKEN_COUNT, "a blocked matrix", manifest(slot(0, 0, shape=[16, 8]))),
    (Rule.BLOCK_HASH, "blocks swapped", manifest(_blocks_swapped)),
    (Rule.BLOCK_HASH, "other tokens", manifest(_other_tokens)),
]

# (rule, case name, hostile block file bytes, the name it is read under)
BLOCK_CASES: list[tuple[Rule, str, bytes, str]] = [
    (Rule.TRUNCATED, "inside the header", BLOCK_FILE[: PREFIX_BYTES + 10], BLOCK_NAME),
    (Rule.TRUNCATED, "a page short", BLOCK_FILE[:-ALIGNMENT], BLOCK_NAME),
    (Rule.VERSION, "a manifest", MANIFEST_FILE, BLOCK_NAME),
    (Rule.VERSION, "a block flag in version 1", block(unchanged, version=1), BLOCK_NAME),
    (Rule.VERSION, "another flag too", block(unchanged, flags=3), BLOCK_NAME),
    (Rule.HEADER_CHECKSUM, "a header bit", flipped(BLOCK_FILE, PREFIX_BYTES + 30), BLOCK_NAME),
    (Rule.FILE_SIZE, "a page longer", BLOCK_FILE + bytes(ALIGNMENT), BLOCK_NAME),
    (Rule.SCHEMA, "an unknown key", block(assign(kind="kv")), BLOCK_NAME),
    (Rule.SCHEMA, "no parent", block(drop("parent")), BLOCK_NAME),
    (Rule.SCHEMA, "an identity map", block(assign(identity=IDENTITY.to_wire())), BLOCK_NAME),
    (Rule.SCHEMA, "an identity not a digest", block(assign(identity="Z" * 32)), BLOCK_NAME),
    (Rule.SCHEMA, "a short parent", block(assign(parent=bytes(15))), BLOCK_NAME),
    (Rule.SCHEMA, "a layer with a kind", block(layer(0, kind="kv")), BLOCK_NAME),
    (Rule.SCHEMA, "a short checksum", block(slot(0, 0, checksum=b"1234567")), BLOCK_NAME),
    (Rule.TOKEN_COUNT, "ragged tokens", block(assign(tokens=b"12345")), "staging"),
    (Rule.TOKEN_COUNT, "17 tokens", block(assign(tokens=bytes(68))), "staging"),
    (Rule.TOKEN_COUNT, "8 tokens", block(assign(tokens=bytes(32))), "staging"),
    (Rule.BLOCK_HASH, "another parent", block(assign(parent=b"\x01" * 16)), BLOCK_NAME),
    (Rule.BLOCK_HASH, "another block's name", BLOCK_FILE, BLOCKS[1][0]),
    (Rule.DTYPE, "float8", block(slot(0, 0, dtype="float8")), BLOCK_NAME),
    (Rule.SLOT_NBYTES, "a byte more", block(slot(0, 0, nbytes=513)), BLOCK_NAME),
    (Rule.SLOT_ALIGNMENT, "a 4 KiB offset", block(slot(1, 0, offset=4096)), BLOCK_NAME),
    (Rule.SLOT_BOUNDS, "past the end", block(slot(1, 5, offset=_past_end)), BLOCK_NAME),
    (Rule.SLOT_OVERLAP, "same offset", block(slot(1, 1, offset=0)), BLOCK_NAME),
]


def test_the_samples_are_valid_and_the_cases_touch_them() -> None:
    assert read(MANIFEST_FILE) == MANIFEST
    assert read_block(BLOCK_FILE, BLOCK_NAME) == BLOCK
    assert header_of(BLOCK_FILE)["layers"][0]["slots"][0]["nbytes"] == 512  # float16 1x2x16x8
    assert _tail.shape == (1, 2, 8, 8)


@pytest.mark.parametrize(
    ("rule", "blob"),
    [pytest.param(rule, blob, id=f"{rule.value}: {name}") for rule, name, blob in MANIFEST_CASES],
)
def test_hostile_manifest_is_rejected_with_its_rule(rule: Rule, blob: bytes) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read(blob, name="hostile.kvd")
    assert caught.value.rule is rule, caught.value
    assert caught.value.name == "hostile.kvd"


@pytest.mark.parametrize(
    ("rule", "blob", "name"),
    [
        pytest.param(rule, blob, name, id=f"{rule.value}: {case}")
        for rule, case, blob, name in BLOCK_CASES
    ],
)
def test_hostile_block_is_rejected_with_its_rule(rule: Rule, blob: bytes, name: str) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read_block(blob, name)
    assert caught.value.rule is rule, caught.value
    assert caught.value.name == name


def test_a_flipped_block_byte_fails_its_slot_checksum() -> None:
    target = BLOCK.slots[3]
    blob = bytearray(BLOCK_FILE)
    blob[target.start + 1] ^= 0x40
    assert read_block(blob, BLOCK_NAME) == BLOCK
    with pytest.raises(EntryFormatError) as caught:
        verify_slot(BLOCK_NAME, target, blob[target.start : target.end])
    assert caught.value.rule is Rule.DATA_CHECKSUM


def _same_tokens(layers: list[Any], identity: Any = IDENTITY) -> Any:
    """The first block of a manifest of the sample's tokens with other layers or identity."""
    plan = plan_manifest(
        identity, MANIFEST.tokens, layers, block_tokens=16, created=1.0, min_reuse=0
    )
    return write_blocks(plan)[0][2]


_other_identity = replace(IDENTITY, namespace="other")
_fewer_layers = manifest_layers(40)[:2]
_other_dtype = [
    replace(spec, tensors=tuple(replace(t, dtype="bfloat16") for t in spec.tensors))
    if spec.kind == "kv"
    else spec
    for spec in manifest_layers(40)
]
_more_heads = [
    replace(spec, tensors=tuple(replace(t, shape=(1, 4, 40, 8)) for t in spec.tensors))
    if spec.kind == "kv"
    else spec
    for spec in manifest_layers(40)
]

# (case name, manifest index, block)
MISMATCHES: list[tuple[str, int, Any]] = [
    ("an index past the blocks", 2, BLOCK),
    ("a negative index", -1, BLOCK),
    ("the next block's place", 1, BLOCK),
    ("another parent", 1, replace(BLOCKS[1][2], parent=bytes(16))),
    ("other tokens", 0, replace(BLOCK, tokens=pack_tokens(range(16)))),
    ("another identity's", 0, _same_tokens(manifest_layers(40), _other_identity)),
    ("a layer fewer", 0, _same_tokens(_fewer_layers)),
    ("a slot fewer", 0, replace(BLOCK, layers=(BLOCK.layers[0][:1], BLOCK.layers[1]))),
    ("another dtype", 0, _same_tokens(_other_dtype)),
    ("another shape", 0, _same_tokens(_more_heads)),
]


def test_the_mismatches_share_the_sample_hashes() -> None:
    """Blocks of other identities and layouts hash alike: only check_block tells them apart."""
    for layers, identity in (
        (manifest_layers(40), _other_identity),
        (_fewer_layers, IDENTITY),
        (_other_dtype, IDENTITY),
        (_more_heads, IDENTITY),
    ):
        assert _same_tokens(layers, identity).hash == MANIFEST.block_hashes[0]
    assert block_hash(bytes(16), MANIFEST.tokens[:64]) == BLOCK.hash


@pytest.mark.parametrize(("index", "other"), [pytest.param(i, b, id=n) for n, i, b in MISMATCHES])
def test_a_block_not_the_manifests_is_a_mismatch(index: int, other: Any) -> None:
    with pytest.raises(EntryFormatError) as caught:
        check_block(MANIFEST, index, other, "b.kvb")
    assert caught.value.rule is Rule.BLOCK_MISMATCH
    assert caught.value.name == "b.kvb"


def test_every_block_of_the_manifest_is_its_own() -> None:
    for index, (name, _, header) in enumerate(BLOCKS):
        check_block(MANIFEST, index, header, name)
        assert name == block_name(MANIFEST.block_hashes[index])


def test_every_rule_has_a_hostile_file() -> None:
    covered = (
        {rule for rule, *_ in V1_CASES}
        | {rule for rule, *_ in MANIFEST_CASES}
        | {rule for rule, *_ in BLOCK_CASES}
        | {Rule.DATA_CHECKSUM, Rule.BLOCK_MISMATCH}
    )
    # block_missing: a block that cannot be had at all, the daemon's and the client's to say.
    assert covered == set(Rule) - {Rule.BLOCK_MISSING}
