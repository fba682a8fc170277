"""Generated entries round-trip; damaged or forged files fail only with EntryFormatError."""

from __future__ import annotations

from typing import Any

import pytest
from entry_samples import data_of, forge, header_of, read, sample_plan, write
from hypothesis import given
from hypothesis import strategies as st
from kvd_protocol.dtypes import ITEM_SIZES
from kvd_protocol.entry import (
    ALIGNMENT,
    PREFIX,
    PREFIX_BYTES,
    Checkpoint,
    LayerSpec,
    TensorSpec,
    plan_entry,
)
from kvd_protocol.entry_reader import parse_head, verify_slot
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
I64_MIN = -(1 << 63)

BLOB, HEADER = write(sample_plan())
VALID = bytes(BLOB)
HEADER_END = PREFIX_BYTES + PREFIX.unpack_from(VALID)[3]  # the prefix's header length

names = st.text(max_size=12)
ints = st.integers(I64_MIN, U64)
finite = st.floats(allow_nan=False)
leaves = st.none() | st.booleans() | ints | finite | names | st.binary(max_size=8)


def nested(depth: int) -> st.SearchStrategy[Any]:
    """Layer state nested at most depth containers deep."""
    if depth == 0:
        return leaves
    inner = nested(depth - 1)
    return leaves | st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3)


tensors = st.builds(
    TensorSpec,
    st.sampled_from(sorted(ITEM_SIZES)),
    st.lists(st.integers(0, 6), max_size=3).map(tuple),
)
layer_specs = st.builds(
    LayerSpec,
    names,
    st.lists(tensors, max_size=3).map(tuple),
    st.booleans(),
    st.dictionaries(names, nested(3), max_size=3),
)
checkpoints = st.none() | st.builds(
    Checkpoint,
    names,
    st.integers(0, U32),
    st.integers(0, U64),
    st.booleans(),
    ints.map(abs),
    ints.map(abs),
)
entry_meta = st.dictionaries(names, names | ints | finite | st.booleans(), max_size=4)


@st.composite
def plans(draw: st.DrawFn) -> Any:
    tokens = draw(st.lists(st.integers(0, U32), max_size=50))
    return plan_entry(
        draw(st.builds(Identity, names, names, names, names, names, names)),
        pack_tokens(tokens),
        draw(st.lists(layer_specs, max_size=4)),
        created=draw(st.floats(0, 4e9)),
        min_reuse=draw(st.integers(0, len(tokens))),
        checkpoint=draw(checkpoints),
        meta=draw(entry_meta),
    )


@given(plans())
def test_generated_entries_round_trip(plan: Any) -> None:
    blob, written = write(plan)
    assert len(blob) == plan.file_size
    assert read(blob) == written
    for slot in written.slots:
        verify_slot("e", slot, blob[slot.start : slot.end])


@given(st.integers(0, len(VALID) - 1), st.integers(1, 255))
def test_a_flipped_byte_is_caught_or_harmless(position: int, xor: int) -> None:
    blob = bytearray(VALID)
    blob[position] ^= xor
    if position < HEADER_END:  # prefix and header: every byte is checked or checksummed
        with pytest.raises(EntryFormatError):
            read(blob)
        return
    assert read(blob) == HEADER  # padding and tensor bytes are not the header's business
    for slot in HEADER.slots:
        data = blob[slot.start : slot.end]
        if slot.start <= position < slot.end:
            with pytest.raises(EntryFormatError) as caught:
                verify_slot("e", slot, data)
            assert caught.value.rule is Rule.DATA_CHECKSUM
        else:
            verify_slot("e", slot, data)


@given(st.integers(0, len(VALID) - 1))
def test_a_truncated_file_is_truncated(length: int) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read(VALID[:length])
    assert caught.value.rule is Rule.TRUNCATED


@given(st.integers(1, 3 * ALIGNMENT))
def test_an_extended_file_has_the_wrong_size(extra: int) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read(VALID + bytes(extra))
    assert caught.value.rule is Rule.FILE_SIZE


@given(st.binary(max_size=4096), st.binary(max_size=64))
def test_arbitrary_bytes_fail_cleanly(noise: bytes, tail: bytes) -> None:
    for blob in (noise, VALID[:8] + noise, VALID[:PREFIX_BYTES] + noise, VALID[:40] + tail + noise):
        with pytest.raises(EntryFormatError):
            parse_head("e", blob, len(blob))


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a decoded header a forger could put another value."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*path, index))
    return found


PATHS = _paths(header_of(VALID))[1:]
msgpack_values = st.recursive(
    leaves | st.integers(I64_MIN, U64),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names | ints, inner, max_size=3),
    max_leaves=8,
)


@given(st.sampled_from(PATHS), msgpack_values)
def test_a_forged_header_parses_or_fails_cleanly(path: tuple[Any, ...], value: Any) -> None:
    header = header_of(VALID)
    target = header
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    blob = forge(header, data_of(VALID))
    try:
        parsed = read(blob)
    except EntryFormatError:
        return
    # Accepted: then every slot it names lies inside the file, aligned and apart.
    assert all(s.start % ALIGNMENT == 0 and s.end <= len(blob) for s in parsed.slots)
