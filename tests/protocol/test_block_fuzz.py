"""Generated manifests and their blocks round-trip; damaged or forged manifests and block files
fail only with EntryFormatError."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from entry_samples import (
    IDENTITY,
    data_of,
    forge,
    header_of,
    read,
    read_block,
    sample_manifest,
    write,
    write_blocks,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from kvd_protocol import entry_reader
from kvd_protocol.blocks import block_hashes
from kvd_protocol.entry import (
    ALIGNMENT,
    FLAG_BLOCK,
    PREFIX,
    PREFIX_BYTES,
    LayerSpec,
    TensorSpec,
    plan_manifest,
)
from kvd_protocol.entry_reader import check_block, parse_block_head, parse_prefix, verify_slot
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.schema import SchemaError
from kvd_protocol.tokens import pack_tokens
from test_entry_fuzz import _paths, msgpack_values

PLAN = sample_manifest()
MANIFEST_BLOB, MANIFEST = write(PLAN.entry)
MANIFEST_FILE = bytes(MANIFEST_BLOB)
BLOCK_NAME, _BLOB, BLOCK = write_blocks(PLAN)[1]
BLOCK_FILE = bytes(_BLOB)
BLOCK_HEADER_END = PREFIX_BYTES + PREFIX.unpack_from(BLOCK_FILE)[3]
MANIFEST_HEADER_END = PREFIX_BYTES + PREFIX.unpack_from(MANIFEST_FILE)[3]

dtypes = st.sampled_from(["float16", "bfloat16", "uint32", "int8", "float32"])


@st.composite
def manifests(draw: st.DrawFn) -> Any:
    """A manifest of blocked KV-like layers and whole other layers, any token count."""
    count = draw(st.integers(0, 80))
    layers = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            heads, width = draw(st.integers(1, 3)), draw(st.integers(0, 4))
            tensors = tuple(
                TensorSpec(draw(dtypes), (1, heads, count, width))
                for _ in range(draw(st.integers(1, 3)))
            )
            layers.append(LayerSpec("kv", tensors, True, {"offset": count}, blocked=True))
        else:
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
            layers.append(LayerSpec("ssm", (TensorSpec(draw(dtypes), shape),), False))
    return plan_manifest(
        IDENTITY,
        pack_tokens(draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=count, max_size=count))),
        layers,
        block_tokens=draw(st.sampled_from([0, 16, 32])),
        created=draw(st.floats(0, 4e9)),
        min_reuse=draw(st.integers(0, count)),
    )


@given(manifests())
def test_generated_manifests_and_blocks_round_trip(plan: Any) -> None:
    blob, written = write(plan.entry)
    assert read(blob) == written
    assert len(written.block_hashes) == (
        written.token_count // written.block_tokens if written.block_tokens else 0
    )
    for slot in written.slots:
        verify_slot("e", slot, blob[slot.start : slot.end])
    for index, (name, block_blob, header) in enumerate(write_blocks(plan)):
        assert len(block_blob) == plan.block_size
        block = read_block(block_blob, name)
        assert block == header
        check_block(written, index, block, name)
        for slot in block.slots:
            verify_slot(name, slot, block_blob[slot.start : slot.end])


@pytest.mark.parametrize(
    ("valid", "header_end", "parsed", "reader"),
    [
        (BLOCK_FILE, BLOCK_HEADER_END, BLOCK, lambda b: read_block(b, BLOCK_NAME)),
        (MANIFEST_FILE, MANIFEST_HEADER_END, MANIFEST, read),
    ],
    ids=["block", "manifest"],
)
@given(data=st.data())
def test_a_flipped_byte_is_caught_or_harmless(
    valid: bytes, header_end: int, parsed: Any, reader: Any, data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(valid) - 1))
    blob = bytearray(valid)
    blob[position] ^= data.draw(st.integers(1, 255))
    if position < header_end:  # prefix and header: every byte is checked or checksummed
        with pytest.raises(EntryFormatError):
            reader(blob)
        return
    assert reader(blob) == parsed  # padding and tensor bytes are not the header's business
    for slot in parsed.slots:
        span = blob[slot.start : slot.end]
        if slot.start <= position < slot.end:
            with pytest.raises(EntryFormatError) as caught:
                verify_slot("b", slot, span)
            assert caught.value.rule is Rule.DATA_CHECKSUM
        else:
            verify_slot("b", slot, span)


@given(st.integers(0, len(BLOCK_FILE) - 1))
def test_a_truncated_block_is_truncated(length: int) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read_block(BLOCK_FILE[:length], BLOCK_NAME)
    assert caught.value.rule is Rule.TRUNCATED


@given(st.integers(1, 3 * ALIGNMENT))
def test_an_extended_block_has_the_wrong_size(extra: int) -> None:
    with pytest.raises(EntryFormatError) as caught:
        read_block(BLOCK_FILE + bytes(extra), BLOCK_NAME)
    assert caught.value.rule is Rule.FILE_SIZE


@given(st.binary(max_size=4096), st.binary(max_size=64))
def test_arbitrary_bytes_fail_cleanly_as_a_block(noise: bytes, tail: bytes) -> None:
    for blob in (
        noise,
        BLOCK_FILE[:8] + noise,
        BLOCK_FILE[:PREFIX_BYTES] + noise,
        BLOCK_FILE[:40] + tail + noise,
    ):
        with pytest.raises(EntryFormatError):
            parse_block_head(BLOCK_NAME, blob, len(blob))


BLOCK_PATHS = _paths(header_of(BLOCK_FILE))[1:]
MANIFEST_PATHS = _paths(header_of(MANIFEST_FILE))[1:]


def _forged(valid: bytes, path: tuple[Any, ...], value: Any, **prefix: Any) -> bytes:
    header = header_of(valid)
    target = header
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return forge(header, data_of(valid), **prefix)


@given(st.sampled_from(BLOCK_PATHS), msgpack_values)
def test_a_forged_block_header_parses_or_fails_cleanly(path: tuple[Any, ...], value: Any) -> None:
    blob = _forged(BLOCK_FILE, path, value, version=2, flags=FLAG_BLOCK)
    try:
        parsed = read_block(blob, "staging")
    except EntryFormatError:
        return
    assert all(s.start % ALIGNMENT == 0 and s.end <= len(blob) for s in parsed.slots)
    layout = [(s.dtype, s.shape) for s in parsed.slots]
    if (parsed.hash, parsed.digest, layout) == (
        BLOCK.hash,
        BLOCK.digest,
        [(s.dtype, s.shape) for s in BLOCK.slots],
    ):  # still the manifest's block 1 in all that check_block compares
        check_block(MANIFEST, 1, parsed, "staging")
        return
    with pytest.raises(EntryFormatError) as caught:
        check_block(MANIFEST, 1, parsed, "staging")
    assert caught.value.rule is Rule.BLOCK_MISMATCH


@given(st.sampled_from(MANIFEST_PATHS), msgpack_values)
def test_a_forged_manifest_header_parses_or_fails_cleanly(
    path: tuple[Any, ...], value: Any
) -> None:
    blob = _forged(MANIFEST_FILE, path, value, version=2)
    try:
        parsed = read(blob)
    except EntryFormatError:
        return
    assert all(s.start % ALIGNMENT == 0 and s.end <= len(blob) for s in parsed.slots)
    step = parsed.block_tokens
    assert parsed.block_hashes == (block_hashes(parsed.tokens, step) if step else ())
    tail = parsed.token_count - len(parsed.block_hashes) * step
    assert all(s.shape[2] == tail for layer in parsed.layers if layer.blocked for s in layer.slots)


_SLOT_MAP = header_of(BLOCK_FILE)["layers"][0]["slots"][1]
_BLOCK_PREFIX = parse_prefix(BLOCK_NAME, BLOCK_FILE[:PREFIX_BYTES])


@given(
    st.sampled_from([*_SLOT_MAP, "extra"]),
    msgpack_values,
    st.integers(0, len(_SLOT_MAP["shape"])),
    st.booleans(),
)
def test_a_slot_map_has_one_verdict_on_the_fast_path_and_the_checked_one(
    key: str, value: Any, dim: int, drop: bool
) -> None:
    """The reader's shortcut for conforming slot maps accepts exactly what its checks accept."""
    forged = dict(_SLOT_MAP)
    if drop:
        forged.pop(key, None)
    elif key == "shape":
        forged["shape"] = [*forged["shape"][:dim], value, *forged["shape"][dim + 1 :]]
    else:
        forged[key] = value
    try:  # as the reader decodes it
        decoded = msgpack.unpackb(msgpack.packb(forged), raw=False, use_list=False)
    except ValueError:  # a map key that is no string: the whole header fails before slots
        assume(False)
    fast = entry_reader._conforming_slot(decoded, _BLOCK_PREFIX)
    try:
        checked = entry_reader._slot(decoded, "slot", _BLOCK_PREFIX, DEFAULT_LIMITS)
    except (entry_reader._RuleError, SchemaError):
        assert fast is None
        return
    assert fast == checked
