"""The entry-file format: layout planning, head encoding and the round trip through the reader."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import pytest
from entry_samples import IDENTITY, read, sample_plan, write
from kvd_protocol.checksum import checksum
from kvd_protocol.dtypes import ITEM_SIZES, itemsize, tensor_nbytes
from kvd_protocol.entry import (
    ALIGNMENT,
    MAGIC,
    PREFIX_BYTES,
    Checkpoint,
    LayerSpec,
    TensorSpec,
    align_up,
    encode_header,
    plan_entry,
)
from kvd_protocol.entry_reader import parse_head, parse_header, parse_prefix, verify_slot
from kvd_protocol.limits import Limits
from kvd_protocol.tokens import pack_tokens


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    plan = sample_plan()
    blob, written = write(plan)
    path = tmp_path / "entry.kvd"
    path.write_bytes(blob)
    with path.open("rb") as f:
        prefix = parse_prefix(path.name, f.read(PREFIX_BYTES))
        header = parse_header(path.name, prefix, f.read(prefix.header_length), path.stat().st_size)
    assert header == written
    assert header.identity == IDENTITY
    assert header.token_count == 40
    assert header.min_reuse == 3
    assert header.checkpoint == Checkpoint("gen-1", 7, 1234, True, 38, 2)
    assert header.meta == {"mlx_lm": "0.32.2", "step": 3, "temp": 0.5, "greedy": False}
    assert header.layers[1].meta == {"lengths": None, "nested": {"a": (1, 2.5, b"x", "y", True)}}
    for slot in header.slots:
        verify_slot(path.name, slot, blob[slot.start : slot.end])


def test_parse_head_reads_prefix_and_header_from_one_buffer() -> None:
    blob, written = write(sample_plan())
    assert parse_head("e", memoryview(blob), len(blob)) == written


def test_every_slot_is_aligned_padded_and_in_order() -> None:
    plan = sample_plan()
    assert plan.data_start == align_up(PREFIX_BYTES + plan.header_length)
    assert plan.file_size % ALIGNMENT == 0
    previous_end = plan.data_start
    for slot in plan.slots:
        assert slot.start % ALIGNMENT == 0
        assert slot.start == plan.data_start + slot.offset
        assert slot.start == align_up(previous_end)
        assert slot.nbytes == tensor_nbytes(slot.dtype, slot.shape)
        previous_end = slot.end
    assert plan.file_size == align_up(previous_end)


def test_prefix_fields_sit_at_their_documented_offsets() -> None:
    plan = sample_plan()
    blob, _ = write(plan)
    assert blob[0:8] == MAGIC
    assert struct.unpack_from("<HHIQQ", blob, 8) == (
        1,
        0,
        plan.header_length,
        plan.data_start,
        plan.file_size,
    )
    assert blob[32:40] == bytes(8)
    covered = bytes(blob[:40]) + bytes(blob[PREFIX_BYTES : PREFIX_BYTES + plan.header_length])
    assert blob[40:48] == checksum(covered)
    assert blob[PREFIX_BYTES + plan.header_length : plan.data_start] == bytes(
        plan.data_start - PREFIX_BYTES - plan.header_length
    )


def test_head_length_does_not_depend_on_checksum_values() -> None:
    plan = sample_plan()
    zeros = plan.head([bytes(8)] * len(plan.slots))
    ones = plan.head([b"\xff" * 8] * len(plan.slots))
    assert len(zeros) == len(ones) == plan.data_start
    assert len(encode_header(plan.finish([b"\xff" * 8] * len(plan.slots)))) == plan.header_length


def test_head_rejects_wrong_checksums() -> None:
    plan = sample_plan()
    with pytest.raises(ValueError, match="checksums for"):
        plan.head([bytes(8)] * (len(plan.slots) - 1))
    with pytest.raises(ValueError, match="8 bytes"):
        plan.head([bytes(7)] * len(plan.slots))


def test_entry_is_trimmable_only_if_every_layer_is() -> None:
    plan = sample_plan()
    assert not plan.header.trimmable
    kv_only = replace(plan.header, layers=plan.header.layers[:1])
    assert kv_only.trimmable


def test_an_entry_without_layers_ends_at_data_start() -> None:
    plan = plan_entry(IDENTITY, pack_tokens([1, 2]), [], created=0.0, min_reuse=2)
    blob, written = write(plan)
    assert plan.file_size == plan.data_start == len(blob)
    assert read(blob) == written
    assert written.trimmable


def test_empty_tensors_take_no_bytes_and_round_trip() -> None:
    layer = LayerSpec(
        "kv", (TensorSpec("float16", (1, 2, 0, 8)), TensorSpec("int8", (0,))), trimmable=True
    )
    plan = plan_entry(IDENTITY, b"", [layer], created=1.0, min_reuse=0)
    assert [slot.nbytes for slot in plan.slots] == [0, 0]
    blob, written = write(plan)
    assert plan.file_size == plan.data_start
    assert read(blob) == written


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens": b"\x00" * 5}, "tokens"),
        ({"tokens": pack_tokens(range(11))}, "tokens"),
        ({"min_reuse": 41}, "min_reuse"),
        ({"min_reuse": -1}, "min_reuse"),
        ({"layers": [LayerSpec("kv", (TensorSpec("float8", (2,)),), True)]}, "dtype"),
        ({"layers": [LayerSpec("kv", (TensorSpec("int8", (2, -1)),), True)]}, "negative"),
        ({"layers": [LayerSpec("kv", (), True, {"bad": object()})]}, "unsupported"),
        ({"meta": {"list": [1]}}, "unsupported"),
        ({"created": float("nan")}, "created"),
        ({"identity": replace(IDENTITY, model_id="m" * 2000)}, "model_id"),
        ({"checkpoint": Checkpoint("k", -1, 0, False, 0, 0)}, "pending_token"),
    ],
)
def test_planner_rejects_what_a_reader_would(change: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "identity": IDENTITY,
        "tokens": pack_tokens(range(40)),
        "layers": [],
        "created": 1.0,
        "min_reuse": 0,
        "limits": Limits(max_tokens=10) if "tokens" in change else Limits(),
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        plan_entry(**args)  # type: ignore[arg-type]


def test_planner_rejects_a_header_over_the_limit() -> None:
    with pytest.raises(ValueError, match="header of"):
        plan_entry(
            IDENTITY,
            pack_tokens(range(1000)),
            [],
            created=1.0,
            min_reuse=0,
            limits=Limits(max_header_bytes=1000),
        )


def test_dtype_table_sizes() -> None:
    assert itemsize("bfloat16") == 2
    assert tensor_nbytes("complex64", (3, 2)) == 48
    with pytest.raises(ValueError, match="unknown dtype"):
        itemsize("float8")


def test_dtype_table_matches_mlx() -> None:
    mx = pytest.importorskip("mlx.core")
    dtypes = {value for value in vars(mx).values() if isinstance(value, mx.Dtype)}
    assert {str(d).removeprefix("mlx.core."): d.size for d in dtypes} == ITEM_SIZES
