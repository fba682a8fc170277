"""BlockHeads: a manifest's block heads checked by comparison with one that passed the full
checks give what the full checks give, and nothing for any head the full checks would refuse
or judge apart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from entry_samples import header_of, read_block, sample_manifest, write, write_blocks
from hypothesis import given
from hypothesis import strategies as st
from kvd_protocol.blocks import ZERO_HASH
from kvd_protocol.entry import (
    CHECKSUMMED_PREFIX_BYTES,
    PREFIX,
    PREFIX_BYTES,
    BlockHeader,
    encode_block_header,
    header_checksum,
)
from kvd_protocol.entry_reader import BlockHeads, check_block
from kvd_protocol.errors import EntryFormatError, Rule

PLAN = sample_manifest(tokens=88)  # blocks of 16: 5 blocks and an 8-token tail
_, MANIFEST = write(PLAN.entry)
BLOCKS = write_blocks(PLAN)
MODEL_NAME, MODEL_BLOB, MODEL = BLOCKS[0]
HEADS = BlockHeads.of(MANIFEST, MODEL, bytes(MODEL_BLOB))
HEAD_BYTES = PREFIX_BYTES + PREFIX.unpack_from(MODEL_BLOB)[3]


def _heads() -> BlockHeads:
    assert HEADS is not None
    return HEADS


def _resealed(blob: bytearray) -> bytearray:
    """blob with its header checksum made right again for whatever its head now holds."""
    view = memoryview(blob)
    blob[CHECKSUMMED_PREFIX_BYTES:PREFIX_BYTES] = header_checksum(
        bytes(view[:CHECKSUMMED_PREFIX_BYTES]), view[PREFIX_BYTES:HEAD_BYTES]
    )
    return blob


def _fully_checked(index: int, blob: bytes | bytearray, name: str) -> Any:
    block = read_block(blob, name)
    check_block(MANIFEST, index, block, name)
    return block


def _vouched(model: BlockHeader, index: int, checksums: Sequence[bytes]) -> BlockHeader:
    """What a check that found checksums vouches for: the model's header with block index's
    parent, tokens and hash (the manifest's) and those slot checksums."""
    step = len(model.tokens)
    sums = iter(checksums)
    return replace(
        model,
        hash=MANIFEST.block_hashes[index],
        parent=MANIFEST.block_hashes[index - 1] if index else ZERO_HASH,
        tokens=MANIFEST.tokens[index * step : (index + 1) * step],
        layers=tuple(
            tuple(replace(slot, checksum=next(sums)) for slot in slots) for slots in model.layers
        ),
    )


def test_every_block_is_what_the_full_checks_make_of_it() -> None:
    assert len(BLOCKS) == 5
    assert _heads().length == HEAD_BYTES
    assert _heads().slots == MODEL.slots
    for index, (name, blob, header) in enumerate(BLOCKS):
        found = _heads().check(index, blob, len(blob))
        assert found is not None
        assert _vouched(MODEL, index, found) == header == _fully_checked(index, blob, name)


def test_a_block_in_another_place_or_of_another_size_gets_no_verdict() -> None:
    _, blob, _ = BLOCKS[2]
    assert _heads().check(3, blob, len(blob)) is None  # another parent and other tokens
    assert _heads().check(5, blob, len(blob)) is None  # past the manifest's blocks
    assert _heads().check(-1, blob, len(blob)) is None
    assert _heads().check(2, blob, len(blob) + 16384) is None  # the file grew
    assert _heads().check(2, blob[: HEAD_BYTES - 1], len(blob)) is None  # a short read


@given(st.integers(0, HEAD_BYTES - 1), st.integers(1, 255))
def test_a_changed_head_byte_gets_no_verdict(at: int, flip: int) -> None:
    _, original, _ = BLOCKS[3]
    blob = bytearray(original)
    blob[at] ^= flip
    assert _heads().check(3, blob, len(blob)) is None  # the header checksum differs


_OUTSIDE_THE_DIGEST = st.integers(0, HEAD_BYTES - 1).filter(
    lambda at: not CHECKSUMMED_PREFIX_BYTES <= at < PREFIX_BYTES  # resealing undoes those
)


@given(_OUTSIDE_THE_DIGEST, st.integers(1, 255))
def test_a_changed_and_resealed_head_is_what_the_full_checks_make_of_it(at: int, flip: int) -> None:
    """Only a changed slot checksum passes the compare; whatever passes, the full checks pass
    with the same header."""
    name, original, header = BLOCKS[3]
    blob = bytearray(original)
    blob[at] ^= flip
    found = _heads().check(3, _resealed(blob), len(blob))
    if found is not None:  # else the full checks judge it (refused, or not the model's bytes)
        assert _vouched(MODEL, 3, found) == _fully_checked(3, blob, name)
        assert list(found) != [s.checksum for s in header.slots]


def _rewritten(header: BlockHeader) -> bytearray:
    """Block 3's file with its head encoding header instead (of the same length), resealed."""
    _, original, _ = BLOCKS[3]
    head = encode_block_header(header)
    assert len(head) == HEAD_BYTES - PREFIX_BYTES
    blob = bytearray(original)
    blob[PREFIX_BYTES:HEAD_BYTES] = head
    return _resealed(blob)


def test_a_resealed_head_with_other_slot_checksums_is_accepted_with_them() -> None:
    """A fixed case of the property above that is sure to pass the compare."""
    name, _, header = BLOCKS[3]
    other = [bytes(8), b"\xff" * 8, *[s.checksum for s in header.slots[2:]]]
    changed = _vouched(header, 3, other)
    found = _heads().check(3, _rewritten(changed), len(BLOCKS[3][1]))
    assert found == tuple(other)
    assert _vouched(MODEL, 3, found) == changed == _fully_checked(3, _rewritten(changed), name)


def test_a_resealed_head_with_another_shape_is_left_to_the_full_checks() -> None:
    """The same bytes for the same count of a slot's elements but another shape: the compare
    gives no verdict, and the full checks refuse the block as not the manifest's."""
    name, _, header = BLOCKS[3]
    first, *rest = header.layers[0]
    assert first.shape == (1, 2, 16, 8)
    reshaped = replace(
        header, layers=((replace(first, shape=(2, 1, 16, 8)), *rest), *header.layers[1:])
    )
    blob = _rewritten(reshaped)
    assert _heads().check(3, blob, len(blob)) is None
    with pytest.raises(EntryFormatError) as refused:
        _fully_checked(3, blob, name)
    assert refused.value.rule is Rule.BLOCK_MISMATCH


def test_a_model_in_another_encoding_makes_no_check() -> None:
    """A writer that orders the header's keys otherwise writes a valid block; the compare
    needs the encoding it knows, and gives way to the full checks."""
    obj = header_of(MODEL_BLOB)
    reordered = {key: obj[key] for key in reversed(list(obj))}
    packed = msgpack.packb(reordered, use_bin_type=True)
    assert len(packed) == HEAD_BYTES - PREFIX_BYTES
    blob = bytearray(MODEL_BLOB)
    blob[PREFIX_BYTES:HEAD_BYTES] = packed
    model = _fully_checked(0, _resealed(blob), MODEL_NAME)
    assert model == MODEL
    assert BlockHeads.of(MANIFEST, model, bytes(blob)) is None


@pytest.mark.parametrize("index", range(5))
def test_the_model_may_be_any_block(index: int) -> None:
    _, blob, header = BLOCKS[index]
    heads = BlockHeads.of(MANIFEST, header, bytes(blob))
    assert heads is not None
    for other, (_, other_blob, other_header) in enumerate(BLOCKS):
        found = heads.check(other, other_blob, len(other_blob))
        assert found is not None
        assert _vouched(header, other, found) == other_header
