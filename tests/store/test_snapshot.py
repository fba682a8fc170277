"""The index snapshot: a faithful round trip, and never trusted when damaged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from kvd_protocol.checksum import checksum
from kvd_protocol.tokens import pack_tokens

from kvd.store.blocks import Block
from kvd.store.records import EntryRecord, Retained
from kvd.store.snapshot import EMPTY, MAGIC, load_snapshot, save_snapshot


def record(
    entry_id: str, tokens: list[int], key: str | None = None, prefill_checkpoint: bool = False
) -> EntryRecord:
    return EntryRecord(
        id=entry_id,
        digest="a" * 32,
        tokens=pack_tokens(tokens),
        nbytes=16384 * len(tokens),
        trimmable=key is None,
        min_reuse=1,
        created=1.5,
        last_used=7,
        durable=True,
        checkpoint_key=key,
        prefill_checkpoint=prefill_checkpoint,
    )


@pytest.fixture
def files(tmp_path: Path) -> list[tuple[Path, EntryRecord]]:
    rows = [
        record("e1", [1, 2, 3]),
        record("e2", [1, 2], key="resume-1"),
        record("e3", [1, 2, 3, 4], prefill_checkpoint=True),
    ]
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
    assert save_snapshot(snapshot, files) == 3
    loaded = load_snapshot(snapshot)
    rows = loaded.rows
    assert set(rows) == {"e1", "e2", "e3"}
    assert [r.prefill_checkpoint for r in loaded.records] == [False, False, True]
    for path, original in files:
        row = rows[original.id]
        assert loaded.mtime_ns[row] == path.stat().st_mtime_ns
        record = loaded.records[row]
        for name in EntryRecord.__slots__:
            assert getattr(record, name) == getattr(original, name), name


def test_retentions_round_trip_and_a_snapshot_without_them_retains_none(
    tmp_path: Path, files: list[tuple[Path, EntryRecord]]
) -> None:
    """An older daemon's snapshot has no "retentions": it loads whole, nothing retained."""
    snapshot = tmp_path / "index.snapshot"
    files[1][1].retained = Retained(until=2e9, seconds=3600.0, priority=3)
    save_snapshot(snapshot, files)
    loaded = load_snapshot(snapshot)
    assert [r.retained for r in loaded.records] == [None, Retained(2e9, 3600.0, 3), None]
    _rewritten(snapshot, _drop("retentions"))
    loaded = load_snapshot(snapshot)
    assert len(loaded.records) == 3
    assert [r.retained for r in loaded.records] == [None, None, None]


def test_blocks_and_each_entrys_block_list_round_trip(tmp_path: Path) -> None:
    """A v2 entry's row keeps its hashes and block size; each block file its size and mtime,
    one that vanished meanwhile left out."""
    hashes = (b"\x01" * 16, b"\x02" * 16)
    manifest = record("e3", [4, 5])
    manifest.block_hashes, manifest.block_size = hashes, 32768
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
    (entry,) = loaded.records
    assert (entry.block_hashes, entry.block_size) == (hashes, 32768)
    assert list(loaded.blocks) == [("a" * 32, hashes[0])]
    row = loaded.blocks["a" * 32, hashes[0]]
    assert (row.size, row.mtime_ns) == (32768, blocks[0].path.stat().st_mtime_ns)


def test_rows_come_least_recently_used_first_and_share_one_token_buffer(tmp_path: Path) -> None:
    files = []
    for n, last_used in enumerate([5, 2, 9, 1]):
        r = record(f"e{n}", [n + 1] * (n + 1))
        r.last_used = last_used
        files.append((tmp_path / f"{r.id}.kve", r))
        files[-1][0].write_bytes(b"x")
    snapshot = tmp_path / "index.snapshot"
    save_snapshot(snapshot, files)
    records = load_snapshot(snapshot).records
    assert [r.last_used for r in records] == [1, 2, 5, 9]
    assert [bytes(r.tokens) for r in records] == [
        pack_tokens([n + 1] * (n + 1)) for n in (3, 1, 0, 2)
    ]
    # Views of the one mapped token section, not a copy each.
    assert all(isinstance(r.tokens, memoryview) and r.tokens.readonly for r in records)
    assert len({id(r.tokens.obj) for r in records if isinstance(r.tokens, memoryview)}) == 1


def test_a_vanished_file_is_left_out(tmp_path: Path, files: list[tuple[Path, EntryRecord]]) -> None:
    files[0][0].unlink()
    snapshot = tmp_path / "index.snapshot"
    assert save_snapshot(snapshot, files) == 2
    assert set(load_snapshot(snapshot).rows) == {"e2", "e3"}


def test_missing_snapshot_is_empty(tmp_path: Path) -> None:
    assert load_snapshot(tmp_path / "none") == EMPTY


@pytest.mark.parametrize("offset", [0, 3, 8, 12, 16, 20, 30, -1])
def test_a_flipped_byte_makes_it_ignored(
    tmp_path: Path, files: list[tuple[Path, EntryRecord]], offset: int
) -> None:
    snapshot = tmp_path / "index.snapshot"
    save_snapshot(snapshot, files)
    data = bytearray(snapshot.read_bytes())
    data[offset] ^= 0x01
    snapshot.write_bytes(bytes(data))
    assert load_snapshot(snapshot) == EMPTY


def _rewritten(snapshot: Path, change: Callable[[dict[str, Any], bytes], bytes]) -> None:
    """The snapshot with its head changed (and its tokens, by what change returns), well
    checksummed: only the checks of the body can refuse it."""
    data = snapshot.read_bytes()
    length = int.from_bytes(data[16:24], "little")
    head = msgpack.unpackb(data[24 : 24 + length], strict_map_key=False)
    tokens = change(head, data[24 + length :])
    packed = msgpack.packb(head, use_bin_type=True)
    rest = len(packed).to_bytes(8, "little") + packed + tokens
    snapshot.write_bytes(MAGIC + checksum(rest) + rest)


def _set(name: str, value: object) -> Callable[[dict[str, Any], bytes], bytes]:
    def change(head: dict[str, Any], tokens: bytes) -> bytes:
        head[name] = value
        return tokens

    return change


def _drop(name: str) -> Callable[[dict[str, Any], bytes], bytes]:
    def change(head: dict[str, Any], tokens: bytes) -> bytes:
        del head[name]
        return tokens

    return change


def _short_tokens(head: dict[str, Any], tokens: bytes) -> bytes:
    return tokens[:-4]


@pytest.mark.parametrize(
    "change",
    [
        _set("version", 1),
        _set("rows", 4),
        _set("ids", ["e1"]),
        _set("ids", ["e1", 2, "e3"]),
        _set("ids", ["e1", "e1", "e3"]),  # an id in two rows
        _set("identities", []),
        _set("identity", (5).to_bytes(8, "little") * 3),
        _set("identity", (-1).to_bytes(8, "little", signed=True) * 3),
        _set("nbytes", b"\0" * 20),
        _set("created", "not packed"),
        _set("version", 3),  # no prefill_checkpoint column: the headers are read again
        _set("trimmable", b"\0\2\0"),
        _set("prefill_checkpoint", b"\0\1"),
        _set("prefill_checkpoint", b"\0\1\2"),
        _drop("prefill_checkpoint"),
        _set("token_bytes", b"".join(n.to_bytes(8, "little") for n in (12, 2, 18))),
        _set("checkpoints", {3: "resume-1"}),
        _set("checkpoints", {-1: "resume-1"}),
        _set("checkpoints", {1: 7}),
        _drop("last_used"),
        _set("manifests", {0: [b"\x01" * 15, 32768]}),
        _set("manifests", {0: [b"\x01" * 16, "big"]}),
        _set("manifests", {3: [b"\x01" * 16, 32768]}),
        _set("blocks", [["a" * 32, b"not 16 bytes", 1, 2]]),
        _set("blocks", [["a" * 32, b"\x01" * 16, 1]]),
        _set("blocks", 7),
        _set("retentions", [1]),
        _set("retentions", {3: [2e9, 60.0, 0]}),
        _set("retentions", {0: [2e9, 60.0]}),
        _set("retentions", {0: [2e9, "60", 0]}),
        _short_tokens,
    ],
)
def test_a_well_checksummed_but_wrong_body_is_ignored(
    tmp_path: Path,
    files: list[tuple[Path, EntryRecord]],
    change: Callable[[dict[str, Any], bytes], bytes],
) -> None:
    snapshot = tmp_path / "index.snapshot"
    files[0][1].block_hashes, files[0][1].block_size = (b"\x03" * 16,), 32768
    block = tmp_path / "block.kvb"
    block.write_bytes(b"y")
    save_snapshot(snapshot, files, [Block(b"\x03" * 16, "a" * 32, 32768, block, durable=True)])
    assert load_snapshot(snapshot) != EMPTY
    _rewritten(snapshot, change)
    assert load_snapshot(snapshot) == EMPTY


@pytest.mark.parametrize("head", [b"\x93\x01\x02\x03", b"\xc1", b"\x81"])
def test_a_head_that_is_no_map_is_ignored(tmp_path: Path, head: bytes) -> None:
    rest = len(head).to_bytes(8, "little") + head
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(MAGIC + checksum(rest) + rest)
    assert load_snapshot(snapshot) == EMPTY


@pytest.mark.parametrize("length", [0, 5, 16, 24])
def test_a_short_file_is_ignored(tmp_path: Path, length: int) -> None:
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(MAGIC[:length] + bytes(max(0, length - len(MAGIC))))
    assert load_snapshot(snapshot) == EMPTY
