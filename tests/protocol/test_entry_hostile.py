"""One hostile file per validation rule: each breaks exactly that rule and is rejected with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from entry_samples import data_of, forge, forge_packed, header_of, read, sample_plan, write
from kvd_protocol.entry import ALIGNMENT, PREFIX_BYTES
from kvd_protocol.entry_reader import verify_slot
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

BLOB, HEADER = write(sample_plan())
VALID = bytes(BLOB)
# Rules of block files and of a manifest's blocks: not broken by a single file read alone.
BLOCK_RULES = {Rule.BLOCK_HASH, Rule.BLOCK_MISMATCH, Rule.BLOCK_MISSING}


def edited(edit: Callable[[dict[str, Any]], None], **prefix: Any) -> bytes:
    """The valid file with its header map edited and its checksum made right again."""
    header = header_of(VALID)
    edit(header)
    return forge(header, data_of(VALID), **prefix)


def flipped(position: int) -> bytes:
    blob = bytearray(VALID)
    blob[position] ^= 0x01
    return bytes(blob)


def unchanged(header: dict[str, Any]) -> None:
    """Keep the header as it is (for cases that break the prefix)."""


def slot(header: dict[str, Any], layer: int = 0, index: int = 0) -> dict[str, Any]:
    found: dict[str, Any] = header["layers"][layer]["slots"][index]
    return found


def assign(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header.update(values)


def set_slot(layer: int, index: int, **values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: slot(header, layer, index).update(values)


def _unknown_key(header: dict[str, Any]) -> None:
    header["extra"] = 1


def _missing_key(header: dict[str, Any]) -> None:
    del header["meta"]


def _unknown_slot_key(header: dict[str, Any]) -> None:
    slot(header)["strides"] = [1]


def _too_many_layers(header: dict[str, Any]) -> None:
    header["layers"] = header["layers"] * 3


def _deep_state(header: dict[str, Any]) -> None:
    state: Any = 1
    for _ in range(20):
        state = {"k": state}
    header["layers"][0]["meta"] = state


def _overlap(header: dict[str, Any]) -> None:
    slot(header, 0, 1)["offset"] = slot(header, 0, 0)["offset"]


_past_end = len(data_of(VALID))  # the first offset past the file, relative to data start

# (rule, case name, hostile file bytes, limits to read with)
CASES: list[tuple[Rule, str, bytes, Limits]] = [
    (Rule.TRUNCATED, "inside the prefix", VALID[:20], Limits()),
    (Rule.TRUNCATED, "inside the header", VALID[: PREFIX_BYTES + 10], Limits()),
    (Rule.TRUNCATED, "a page short", VALID[:-ALIGNMENT], Limits()),
    (Rule.MAGIC, "one bit off", flipped(1), Limits()),
    (Rule.VERSION, "version 3", edited(unchanged, version=3), Limits()),
    (Rule.SCHEMA, "version 2 without its keys", edited(unchanged, version=2), Limits()),
    (Rule.VERSION, "a flag set", edited(unchanged, flags=1), Limits()),
    (Rule.VERSION, "reserved set", edited(unchanged, reserved=b"\x01" + bytes(7)), Limits()),
    (Rule.HEADER_SIZE, "over the limit", VALID, Limits(max_header_bytes=100)),
    (Rule.HEADER_SIZE, "data start off", edited(unchanged, data_start=0), Limits()),
    (Rule.HEADER_CHECKSUM, "a header bit", flipped(PREFIX_BYTES + 30), Limits()),
    (Rule.HEADER_CHECKSUM, "the checksum", flipped(PREFIX_BYTES - 1), Limits()),
    (Rule.SCHEMA, "not msgpack", forge_packed(b"\x82\xa1a", data_of(VALID)), Limits()),
    (Rule.SCHEMA, "trailing bytes", forge_packed(b"\xc0\xc0", data_of(VALID)), Limits()),
    (Rule.SCHEMA, "not a map", forge([1, 2], data_of(VALID)), Limits()),
    (Rule.SCHEMA, "unknown key", edited(_unknown_key), Limits()),
    (Rule.SCHEMA, "missing key", edited(_missing_key), Limits()),
    (Rule.SCHEMA, "unknown slot key", edited(_unknown_slot_key), Limits()),
    (Rule.SCHEMA, "short checksum", edited(set_slot(0, 0, checksum=b"1234567")), Limits()),
    (Rule.SCHEMA, "created a string", edited(assign(created="now")), Limits()),
    (Rule.SCHEMA, "tokens a list", edited(assign(tokens=[1, 2])), Limits()),
    (Rule.SCHEMA, "too many layers", edited(_too_many_layers), Limits(max_layers=4)),
    (Rule.SCHEMA, "too many slots", VALID, Limits(max_slots=3)),
    (Rule.SCHEMA, "deep layer state", edited(_deep_state), Limits()),
    (Rule.SCHEMA, "checkpoint a list", edited(assign(checkpoint=[1])), Limits()),
    (Rule.SCHEMA, "meta holds a map", edited(assign(meta={"a": {}})), Limits()),
    (Rule.TOKEN_COUNT, "ragged tokens", edited(assign(tokens=b"12345")), Limits()),
    (Rule.TOKEN_COUNT, "over the limit", VALID, Limits(max_tokens=39)),
    (Rule.TOKEN_COUNT, "min_reuse too big", edited(assign(min_reuse=41)), Limits()),
    (Rule.DTYPE, "float8", edited(set_slot(0, 0, dtype="float8")), Limits()),
    (Rule.SLOT_NBYTES, "one byte more", edited(set_slot(0, 0, nbytes=1281)), Limits()),
    (Rule.SLOT_NBYTES, "negative dim", edited(set_slot(0, 0, shape=[-1, 320])), Limits()),
    (Rule.SLOT_ALIGNMENT, "a 4 KiB offset", edited(set_slot(1, 1, offset=4096)), Limits()),
    (Rule.SLOT_BOUNDS, "past the end", edited(set_slot(1, 1, offset=_past_end)), Limits()),
    (Rule.SLOT_OVERLAP, "same offset", edited(_overlap), Limits()),
    (Rule.FILE_SIZE, "a page longer", VALID + bytes(ALIGNMENT), Limits()),
    (Rule.FILE_SIZE, "declared unaligned", edited(unchanged, file_size=len(VALID) + 1), Limits()),
]


def test_the_sample_is_valid_and_the_cases_touch_it() -> None:
    assert read(VALID) == HEADER
    assert slot(header_of(VALID))["nbytes"] == 1280  # the SLOT_NBYTES case edits this slot


@pytest.mark.parametrize(
    ("rule", "blob", "limits"),
    [
        pytest.param(rule, blob, limits, id=f"{rule.value}: {name}")
        for rule, name, blob, limits in CASES
    ],
)
def test_hostile_file_is_rejected_with_its_rule(rule: Rule, blob: bytes, limits: Limits) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read(blob, limits, name="hostile.kvd")
    assert caught.value.rule is rule, caught.value
    assert caught.value.name == "hostile.kvd"


def test_flipped_tensor_byte_fails_its_data_checksum() -> None:
    target = HEADER.slots[2]
    blob = bytearray(VALID)
    blob[target.start + 5] ^= 0x80
    assert read(blob) == HEADER  # the header does not cover tensor bytes
    with pytest.raises(EntryFormatError) as caught:
        verify_slot("hostile.kvd", target, blob[target.start : target.end])
    assert caught.value.rule is Rule.DATA_CHECKSUM
    for other in HEADER.slots[:2] + HEADER.slots[3:]:
        verify_slot("hostile.kvd", other, blob[other.start : other.end])


def test_short_slot_read_is_truncated() -> None:
    target = HEADER.slots[0]
    with pytest.raises(EntryFormatError) as caught:
        verify_slot("hostile.kvd", target, VALID[target.start : target.end - 1])
    assert caught.value.rule is Rule.TRUNCATED


def test_every_rule_has_a_hostile_file() -> None:
    covered = {rule for rule, *_ in CASES} | {Rule.DATA_CHECKSUM}
    assert covered == set(Rule) - BLOCK_RULES
