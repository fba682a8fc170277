"""The index snapshot: a faithful round trip, and never trusted when damaged."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from kvd_protocol.checksum import checksum
from kvd_protocol.tokens import pack_tokens

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
    rows = load_snapshot(snapshot)
    assert set(rows) == {"e1", "e2"}
    for path, original in files:
        row = rows[original.id]
        assert row.mtime_ns == path.stat().st_mtime_ns
        loaded = row.record
        for name in EntryRecord.__slots__:
            assert getattr(loaded, name) == getattr(original, name), name


def test_a_vanished_file_is_left_out(tmp_path: Path, files: list[tuple[Path, EntryRecord]]) -> None:
    files[0][0].unlink()
    snapshot = tmp_path / "index.snapshot"
    assert save_snapshot(snapshot, files) == 1
    assert set(load_snapshot(snapshot)) == {"e2"}


def test_missing_snapshot_is_empty(tmp_path: Path) -> None:
    assert load_snapshot(tmp_path / "none") == {}


@pytest.mark.parametrize("offset", [0, 3, 8, 12, 20, -1])
def test_a_flipped_byte_makes_it_ignored(
    tmp_path: Path, files: list[tuple[Path, EntryRecord]], offset: int
) -> None:
    snapshot = tmp_path / "index.snapshot"
    save_snapshot(snapshot, files)
    data = bytearray(snapshot.read_bytes())
    data[offset] ^= 0x01
    snapshot.write_bytes(bytes(data))
    assert load_snapshot(snapshot) == {}


@pytest.mark.parametrize(
    "body",
    [
        {"version": 2, "rows": []},
        {"version": 1, "rows": [["a", "b"]]},
        {"version": 1, "rows": [["a", "b", 1, 2, "not bytes", True, 0, 1.0, 1, None]]},
        {"version": 1},
        [1, 2, 3],
    ],
)
def test_a_well_checksummed_but_wrong_body_is_ignored(tmp_path: Path, body: object) -> None:
    packed = msgpack.packb(body, use_bin_type=True)
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(MAGIC + checksum(packed) + packed)
    assert load_snapshot(snapshot) == {}


@pytest.mark.parametrize("length", [0, 5, 16])
def test_a_short_file_is_ignored(tmp_path: Path, length: int) -> None:
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(MAGIC[:length] + bytes(max(0, length - len(MAGIC))))
    assert load_snapshot(snapshot) == {}
