"""Entry format version 2: the manifest and block layouts, and their round trips through the
reader; version 1 files are untouched by it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from entry_samples import (
    IDENTITY,
    header_of,
    manifest_layers,
    read,
    read_block,
    sample_manifest,
    sample_plan,
    write,
    write_blocks,
)
from kvd_protocol.blocks import ZERO_HASH, block_hashes, block_name
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import (
    ALIGNMENT,
    FLAG_BLOCK,
    MAGIC,
    PREFIX_BYTES,
    LayerSpec,
    TensorSpec,
    align_up,
    plan_entry,
    plan_manifest,
)
from kvd_protocol.entry_reader import (
    check_block,
    parse_block_head,
    parse_block_header,
    parse_prefix,
    verify_slot,
)
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.tokens import pack_tokens


def test_a_manifest_round_trips_through_files(tmp_path: Path) -> None:
    plan = sample_manifest()
    blob, written = write(plan.entry)
    (tmp_path / "entry.kvd").write_bytes(blob)
    read_back = read((tmp_path / "entry.kvd").read_bytes())
    assert read_back == written
    assert read_back.version == 2
    assert read_back.block_tokens == 16
    assert read_back.block_hashes == plan.hashes == block_hashes(written.tokens, 16)
    assert [layer.blocked for layer in read_back.layers] == [True, False, True, False]
    for slot in read_back.slots:
        verify_slot("entry.kvd", slot, blob[slot.start : slot.end])
    files = write_blocks(plan)
    assert len(files) == 2
    for index, (name, block_blob, header) in enumerate(files):
        path = tmp_path / name
        path.write_bytes(block_blob)
        block = read_block(path.read_bytes(), name)
        assert block == header
        assert block.hash == plan.hashes[index]
        assert block.parent == (plan.hashes[index - 1] if index else ZERO_HASH)
        assert block.digest == IDENTITY.digest()
        assert block.block_tokens == 16
        check_block(read_back, index, block, name)
        for slot in block.slots:
            verify_slot(name, slot, block_blob[slot.start : slot.end])


def test_the_prefix_tells_a_manifest_from_a_block() -> None:
    plan = sample_manifest()
    blob, _ = write(plan.entry)
    name, block_blob, _ = write_blocks(plan)[0]
    assert struct.unpack_from("<HH", blob, 8) == (2, 0)
    assert struct.unpack_from("<HH", block_blob, 8) == (2, FLAG_BLOCK)
    manifest, block = parse_prefix("e", blob), parse_prefix(name, block_blob)
    assert (manifest.version, manifest.is_block) == (2, False)
    assert (block.version, block.is_block) == (2, True)
    v1 = parse_prefix("e", write(sample_plan())[0])
    assert (v1.version, v1.is_block) == (1, False)


def test_version_1_files_keep_their_bytes() -> None:
    """plan_entry writes version 1 whatever the layers say: no version 2 key, flags 0."""
    blocked = [
        LayerSpec(s.kind, s.tensors, s.trimmable, s.meta, blocked=True) for s in manifest_layers(40)
    ]
    plain = plan_entry(
        IDENTITY, pack_tokens(range(40)), manifest_layers(40), created=1.0, min_reuse=0
    )
    marked = plan_entry(IDENTITY, pack_tokens(range(40)), blocked, created=1.0, min_reuse=0)
    blob, header = write(plain)
    assert write(marked)[0] == blob
    assert struct.unpack_from("<HH", blob, 8) == (1, 0)
    assert set(header_of(blob)) == {
        "identity",
        "tokens",
        "created",
        "min_reuse",
        "layers",
        "checkpoint",
        "meta",
    }
    assert set(header_of(blob)["layers"][0]) == {"kind", "meta", "trimmable", "slots"}
    assert (header.version, header.block_tokens, header.block_hashes) == (1, 0, ())
    assert not any(layer.blocked for layer in read(blob).layers)


def test_the_manifest_keeps_the_tail_and_the_whole_layers() -> None:
    plan = sample_manifest()  # 40 tokens: blocks [0, 16) and [16, 32), tail [32, 40)
    layers = manifest_layers(40)
    shapes = [slot.shape for slot in plan.entry.slots]
    assert shapes[:2] == [(1, 2, 8, 8)] * 2
    assert shapes[2] == (1, 3, 5)
    assert shapes[3:9] == [(1, 2, 8, 1)] * 6
    assert shapes[9:] == [(1, 2, 16, 8)] * 2  # the rotating window: whole
    assert plan.blocked_tensors == (0, 1, 3, 4, 5, 6, 7, 8)
    flat = [tensor for layer in layers for tensor in layer.tensors]
    assert [flat[i].dtype for i in plan.blocked_tensors] == [s.dtype for s in plan.block_slots]
    assert [s.shape for s in plan.block_slots] == [(1, 2, 16, 8)] * 2 + [(1, 2, 16, 1)] * 6
    assert [len(layer) for layer in plan.block_layers] == [2, 6]


def test_every_block_file_has_one_aligned_layout_and_size() -> None:
    plan = sample_manifest(tokens=70)  # 4 blocks and a 6-token tail
    files = write_blocks(plan)
    assert len(files) == len(plan.hashes) == 4
    assert plan.block_size % ALIGNMENT == 0
    heads = [blob[: blob.index(MAGIC) + PREFIX_BYTES] for _, blob, _ in files]
    assert len({len(head) for head in heads}) == 1
    data_start = align_up(PREFIX_BYTES + plan.block_header_length)
    previous_end = data_start
    for slot in plan.block_slots:
        assert slot.start == align_up(previous_end) == data_start + slot.offset
        previous_end = slot.end
    assert plan.block_size == align_up(previous_end)
    for index, (name, blob, header) in enumerate(files):
        assert len(blob) == plan.block_size
        assert len(plan.block_head(index, [bytes(8)] * len(plan.block_slots))) == data_start
        assert name == block_name(plan.hashes[index])
        assert header.slots == tuple(
            type(s)(s.dtype, s.shape, s.offset, s.nbytes, c, s.start)
            for s, c in zip(plan.block_slots, (x.checksum for x in header.slots), strict=True)
        )


def test_a_block_head_is_read_from_one_buffer() -> None:
    plan = sample_manifest()
    name, blob, header = write_blocks(plan)[1]
    assert parse_block_head(name, memoryview(blob), len(blob)) == header


def test_block_checksums_go_where_the_slots_are() -> None:
    plan = sample_manifest()
    sums = [checksum(bytes([k])) for k in range(len(plan.block_slots))]
    header = plan.block_header(1, sums)
    assert [slot.checksum for slot in header.slots] == sums
    with pytest.raises(ValueError, match="checksums for"):
        plan.block_head(0, sums[:-1])
    with pytest.raises(ValueError, match="8 bytes"):
        plan.block_head(0, [bytes(7)] * len(sums))
    for index in (-1, 2):
        with pytest.raises(ValueError, match="of 2"):
            plan.block_head(index, sums)


@pytest.mark.parametrize(("tokens", "block_tokens"), [(15, 16), (40, 0), (0, 16)])
def test_a_manifest_without_blocks(tokens: int, block_tokens: int) -> None:
    plan = sample_manifest(tokens, block_tokens)
    assert (plan.hashes, plan.block_slots, plan.block_size) == ((), (), 0)
    blob, written = write(plan.entry)
    header = read(blob)
    assert header == written
    assert (header.version, header.block_tokens, header.block_hashes) == (2, block_tokens, ())
    assert header.slots[0].shape == (1, 2, tokens, 8)  # the whole KV is the tail
    assert header.layers[0].blocked


def test_a_manifest_exactly_of_whole_blocks_has_empty_tails() -> None:
    plan = sample_manifest(tokens=32)
    assert len(plan.hashes) == 2
    blob, written = write(plan.entry)
    assert read(blob) == written
    assert [slot.nbytes for slot in written.slots if slot.shape[2:3] == (0,)] == [0] * 8


def test_without_a_blocked_layer_a_manifest_has_no_blocks() -> None:
    whole = [layer for layer in manifest_layers(40) if not layer.blocked]
    plan = plan_manifest(
        IDENTITY, pack_tokens(range(40)), whole, block_tokens=16, created=1.0, min_reuse=0
    )
    assert (plan.block_tokens, plan.hashes, plan.blocked_tensors) == (0, (), ())
    blob, written = write(plan.entry)
    assert read(blob) == written


def test_shared_prefixes_give_the_same_block_files() -> None:
    tokens = list(range(64))
    layers = manifest_layers(70)
    first = plan_manifest(
        IDENTITY, pack_tokens(tokens + [1] * 6), layers, block_tokens=16, created=1.0, min_reuse=0
    )
    second = plan_manifest(
        IDENTITY, pack_tokens(tokens + [2] * 6), layers, block_tokens=16, created=2.0, min_reuse=0
    )
    assert first.hashes == second.hashes
    assert first.block_size == second.block_size
    sums = [bytes(8)] * len(first.block_slots)
    assert all(first.block_head(i, sums) == second.block_head(i, sums) for i in range(4))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_tokens": 24}, "power of two"),
        ({"block_tokens": 8}, "power of two"),
        (
            {"layers": [LayerSpec("kv", (TensorSpec("int8", (4, 40)),), True, blocked=True)]},
            "axis 2",
        ),
        (
            {"layers": [LayerSpec("kv", (TensorSpec("int8", (1, 1, 39)),), True, blocked=True)]},
            "axis 2",
        ),
        ({"tokens": b"\x00" * 5}, "tokens"),
    ],
)
def test_manifest_planner_rejects_what_a_reader_would(
    change: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {
        "identity": IDENTITY,
        "tokens": pack_tokens(range(40)),
        "layers": manifest_layers(40),
        "block_tokens": 16,
        "created": 1.0,
        "min_reuse": 0,
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        plan_manifest(**args)  # type: ignore[arg-type]


def test_a_block_named_by_another_hash_is_refused_by_its_name() -> None:
    plan = sample_manifest()
    name, blob, header = write_blocks(plan)[0]
    prefix = parse_prefix(name, blob)
    header_bytes = blob[PREFIX_BYTES : PREFIX_BYTES + prefix.header_length]
    other = block_name(plan.hashes[1])
    with pytest.raises(EntryFormatError) as caught:
        parse_block_header(other, prefix, header_bytes, len(blob))
    assert caught.value.rule is Rule.BLOCK_HASH
    # A staging file's name is no block's name: the hash is only computed.
    assert parse_block_header("staging-7.tmp", prefix, header_bytes, len(blob)) == header
