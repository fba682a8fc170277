"""The index snapshot: a faithful round trip, and never trusted when damaged."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from kvd_protocol.checksum import checksum
from kvd_protocol.tokens import pack_tokens

from kvd.blocks import Block
from kvd.records import EntryRecord
from kvd.snapshot import MAGIC, load_snapshot, save_snapshot


def record(entry_id: str, tokens: list[int], key: str | None = None) -> EntryRecord:
    return EntryRecord(
        id=entry_id,
        identity="a" * 32,
        tokens=pack_tokens(tokens),
        nbytes=16384 * len(tokens),
        trimmable=key is None,
        min_reuse=1,
        created=1.5,
        last_used=7,
        durable=True,
        checkpoint_key=key,
    )


@pytest.fixture
def files(tmp_path: Path) -> list[tuple[Path, EntryRecord]]:
    rows = [record("e1", [1, 2, 3]), record("e2", [1, 2], key="resume-1")]
    paths = []
    for r in rows:
        path = tmp_path / f"{r.id}.kve"
        path.write_bytes(b"x")
        paths.append((path, r))
    return paths


def test_round_trip_keeps_every_field_and_the_mtime(
    tmp_path: Path, files: list[tuple[Path, EntryRecord]]
) -> None:
    snapshot = tmp_path / "index.snapshot"
    assert save_snapshot(snapshot, files) == 2
    rows = load_snapshot(snapshot).rows
    assert set(rows) == {"e1", "e2"}
    for path, original in files:
        row = rows[original.id]
        assert row.mtime_ns == path.stat().st_mtime_ns
        loaded = row.record
        for name in EntryRecord.__slots__:
            assert getattr(loaded, name) == getattr(original, name), name


def test_blocks_and_each_entrys_block_list_round_trip(tmp_path: Path) -> None:
    """A v2 entry's row keeps its hashes and block size; each block file its size and mtime,
    one that vanished meanwhile left out."""
    hashes = (b"\x01" * 16, b"\x02" * 16)
    manifest = record("e3", [4, 5])
    manifest.blocks, manifest.block_size = hashes, 32768
    (tmp_path / "e3.kve").write_bytes(b"x")
    blocks = []
    for block_hash in hashes:
        path = tmp_path / f"{block_hash.hex()}.kvb"
        path.write_bytes(b"y")
        blocks.append(Block(block_hash, "a" * 32, 32768, path, refs=1, durable=True))
    blocks[1].path.unlink()
    snapshot = tmp_path / "index.snapshot"
    save_snapshot(snapshot, [(tmp_path / "e3.kve", manifest)], blocks)
    loaded = load_snapshot(snapshot)
    assert loaded.rows["e3"].record.blocks == hashes
    assert loaded.rows["e3"].record.block_size == 32768
    assert list(loaded.blocks) == [("a" * 32, hashes[0])]
    row = loaded.blocks["a" * 32, hashes[0]]
    assert (row.size, row.mtime_ns) == (32768, blocks[0].path.stat().st_mtime_ns)


def test_a_vanished_file_is_left_out(tmp_path: Path, files: list[tuple[Path, EntryRecord]]) -> None:
    files[0][0].unlink()
    snapshot = tmp_path / "index.snapshot"
    assert save_snapshot(snapshot, files) == 1
    assert set(load_snapshot(snapshot).rows) == {"e2"}


def test_missing_snapshot_is_empty(tmp_path: Path) -> None:
    assert load_snapshot(tmp_path / "none").rows == {}


@pytest.mark.parametrize("offset", [0, 3, 8, 12, 20, -1])
def test_a_flipped_byte_makes_it_ignored(
    tmp_path: Path, files: list[tuple[Path, EntryRecord]], offset: int
) -> None:
    snapshot = tmp_path / "index.snapshot"
    save_snapshot(snapshot, files)
    data = bytearray(snapshot.read_bytes())
    data[offset] ^= 0x01
    snapshot.write_bytes(bytes(data))
    assert load_snapshot(snapshot).rows == {}


@pytest.mark.parametrize(
    "body",
    [
        {"version": 1, "rows": [], "blocks": []},
        {"version": 2, "rows": [["a", "b"]], "blocks": []},
        {
            "version": 2,
            "rows": [["a", "b", 1, 2, "not bytes", True, 0, 1.0, 1, None, b"", 0]],
            "blocks": [],
        },
        {
            "version": 2,
            "rows": [["a", "b", 1, 2, b"", True, 0, 1.0, 1, None, b"not 16 bytes", 0]],
            "blocks": [],
        },
        {"version": 2, "rows": [], "blocks": [["a", b"not 16 bytes", 1, 2]]},
        {"version": 2, "rows": []},
        {"version": 2},
        [1, 2, 3],
    ],
)
def test_a_well_checksummed_but_wrong_body_is_ignored(tmp_path: Path, body: object) -> None:
    packed = msgpack.packb(body, use_bin_type=True)
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(MAGIC + checksum(packed) + packed)
    loaded = load_snapshot(snapshot)
    assert loaded.rows == {}
    assert loaded.blocks == {}


@pytest.mark.parametrize("length", [0, 5, 16])
def test_a_short_file_is_ignored(tmp_path: Path, length: int) -> None:
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(MAGIC[:length] + bytes(max(0, length - len(MAGIC))))
    assert load_snapshot(snapshot).rows == {}
