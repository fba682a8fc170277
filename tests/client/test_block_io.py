"""block_io on real arrays and real files: the rows of a block cut out of source arrays and
restore buffers without copies, written by pwritev and read back by preadv, checksummed."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_client import entry_io
from kvd_client.block_io import BlockReads, BlockWriter, Cut, read_slots
from kvd_client.client import Client
from kvd_client.entry_io import CHUNK_BYTES, EntryFile, write_slots
from kvd_client.workers import Descriptors
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import ALIGNMENT, LayerSpec, Slot, TensorSpec, plan_manifest
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def _rows(array: np.ndarray, start: int, stop: int) -> bytes:
    """What a block's slot holds: rows start..stop of every outer index, in C order."""
    return np.ascontiguousarray(array[:, :, start:stop]).tobytes()


def read_runs(
    fd: int, offset: int, runs: list[memoryview], digest: bytes | None, name: str
) -> None:
    """read_slots of one slot at offset, as long as runs, checked against digest unless None."""
    nbytes = sum(run.nbytes for run in runs)
    slot = Slot("uint8", (nbytes,), 0, nbytes, digest or bytes(8), offset)
    read_slots(fd, [slot], [runs], None if digest is None else [digest], name)


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    descriptor = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    yield descriptor
    os.close(descriptor)


def test_the_cut_of_a_kv_tensor() -> None:
    assert Cut.of("float16", (1, 8, 300, 128)) == Cut(outer=8, length=300, row=256)
    assert Cut.of("uint32", (2, 2, 5, 4)).nbytes == 2 * 2 * 5 * 4 * 4
    with pytest.raises(ValueError, match="no token axis"):
        Cut.of("float16", (4, 5))


@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 5),
    length=st.integers(1, 40),
    width=st.integers(1, 6),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_runs_are_the_rows_of_every_outer_index(
    batch: int, heads: int, length: int, width: int, data: st.DataObject
) -> None:
    array = np.arange(batch * heads * length * width, dtype=np.int32).reshape(
        batch, heads, length, width
    )
    start = data.draw(st.integers(0, length))
    stop = data.draw(st.integers(start, length))
    cut = Cut.of("int32", array.shape)
    whole = _bytes(array)
    assert b"".join(cut.runs([whole], start, stop)) == _rows(array, start, stop)
    # The same bytes given as arbitrary consecutive pieces (a restore's destination runs).
    bounds = sorted(data.draw(st.lists(st.integers(0, whole.nbytes), max_size=6)))
    edges = [0, *bounds, whole.nbytes]
    pieces = [whole[a:b] for a, b in itertools.pairwise(edges)]
    assert b"".join(cut.runs(pieces, start, stop)) == _rows(array, start, stop)


def test_runs_are_views_into_the_arrays_not_copies() -> None:
    array = np.zeros((1, 2, 8, 4), dtype=np.float32)
    (first, second) = Cut.of("float32", array.shape).runs([_bytes(array)], 2, 4)
    first[:] = b"\x01" * first.nbytes
    assert array[0, 0, 2:4].view(np.uint32).tolist() == [[0x01010101] * 4] * 2
    assert not array[0, 1].any()
    assert second.nbytes == 2 * 16


def test_runs_refuse_pieces_that_are_not_the_tensor() -> None:
    cut = Cut(outer=2, length=4, row=8)
    with pytest.raises(ValueError, match="64 bytes"):
        cut.runs([memoryview(bytes(60))], 0, 4)
    with pytest.raises(ValueError, match="outside"):
        cut.runs([memoryview(bytes(64))], 3, 5)


def _write_runs(fd: int, offset: int, runs: list[memoryview]) -> bytes:
    """runs written back to back as one slot at offset; its checksum."""
    size = sum(run.nbytes for run in runs)
    return write_slots(fd, [(Slot("uint8", (size,), 0, size, b"", offset), runs)])[0]


def test_slots_are_written_in_one_pass_with_zeros_between_them(fd: int) -> None:
    rng = np.random.default_rng(9)
    parts = [rng.integers(1, 255, n, np.uint8) for n in (5000, 70000, 300)]
    starts = [ALIGNMENT, 2 * ALIGNMENT, 8 * ALIGNMENT]
    os.pwrite(fd, b"\xee" * 9 * ALIGNMENT, 0)  # not zero: the gaps must be written
    slots = [
        Slot("uint8", (a.size,), 0, a.size, b"", at) for a, at in zip(parts, starts, strict=True)
    ]
    empty = Slot("uint8", (0,), 0, 0, b"", 3)  # may start anywhere
    late = Slot("uint8", (0,), 0, 0, b"", 5 * ALIGNMENT)  # first, past the next slot's start
    wanted = [
        (late, []),
        (slots[0], [_bytes(parts[0])]),
        (empty, []),
        *((s, [_bytes(a)]) for s, a in zip(slots[1:], parts[1:], strict=True)),
    ]
    sums = write_slots(fd, wanted)
    assert sums == [
        checksum(b""),
        checksum(parts[0].tobytes()),
        checksum(b""),
        *(checksum(a.tobytes()) for a in parts[1:]),
    ]
    data = os.pread(fd, 9 * ALIGNMENT, 0)
    assert data[:ALIGNMENT] == b"\xee" * ALIGNMENT  # before the first slot: untouched
    for slot, a in zip(slots, parts, strict=True):
        assert data[slot.start : slot.end] == a.tobytes()
    gaps = [(slots[0].end, slots[1].start), (slots[1].end, slots[2].start)]
    assert all(data[low:high] == bytes(high - low) for low, high in gaps)
    assert data[slots[2].end :] == b"\xee" * (9 * ALIGNMENT - slots[2].end)


def test_the_rows_of_an_mlx_array_are_written_as_its_block_and_read_into_a_longer_buffer(
    fd: int,
) -> None:
    keys = mx.random.normal((1, 4, 300, 32)).astype(mx.float16)
    mx.eval(keys)
    source = np.array(keys)
    cut = Cut.of("float16", keys.shape)
    view = memoryview(keys).cast("B")  # type: ignore[arg-type]
    written = _write_runs(fd, 4096, cut.runs([view], 256, 300))
    assert written == checksum(_rows(source, 256, 300))
    assert os.pread(fd, 1 << 20, 4096) == _rows(source, 256, 300)
    # Back into rows 256..300 of a buffer with room for 512 tokens, as a restore grows it.
    target = np.zeros((1, 4, 512, 32), dtype=np.float16)
    room = Cut.of("float16", (1, 4, 300, 32))
    runs = [_bytes(target)[o * 512 * 64 : o * 512 * 64 + 300 * 64] for o in range(4)]
    read_runs(fd, 4096, room.runs(runs, 256, 300), written, "block")
    assert np.array_equal(target[:, :, 256:300], source[:, :, 256:300])
    assert not target[:, :, :256].any()
    assert not target[:, :, 300:].any()


def test_runs_longer_than_a_call_and_more_runs_than_an_iovec_holds(fd: int) -> None:
    long = np.random.default_rng(1).integers(0, 255, CHUNK_BYTES * 2 + 7, np.uint8)
    many = np.arange(entry_io.IOV_MAX + 50, dtype=np.uint8).reshape(1, -1, 1, 1)
    runs = [_bytes(long), *Cut.of("uint8", many.shape).runs([_bytes(many)], 0, 1)]
    expected = long.tobytes() + many.tobytes()
    assert _write_runs(fd, 0, runs) == checksum(expected)
    back = [memoryview(bytearray(run.nbytes)) for run in runs]
    read_runs(fd, 0, back, checksum(expected), "entry")
    assert b"".join(bytes(piece) for piece in back) == expected


def test_a_short_file_and_changed_bytes_are_refused_by_rule(fd: int) -> None:
    data = np.arange(64, dtype=np.uint8)
    digest = _write_runs(fd, 0, [_bytes(data)])
    with pytest.raises(EntryFormatError) as short:
        read_runs(fd, 32, [memoryview(bytearray(64))], digest, "block")
    assert short.value.rule is Rule.TRUNCATED
    os.pwrite(fd, b"\xff", 10)
    with pytest.raises(EntryFormatError) as changed:
        read_runs(fd, 0, [memoryview(bytearray(64))], digest, "block")
    assert changed.value.rule is Rule.DATA_CHECKSUM
    unchecked = memoryview(bytearray(64))
    read_runs(fd, 0, [unchecked], None, "block")  # verification off: the bytes as they are
    assert unchecked[10] == 0xFF


def test_slots_given_out_of_file_order_are_each_read_and_checked(fd: int) -> None:
    """A valid block may list its slots in any order of offsets (the format asks only that
    none overlap); an empty slot may start anywhere."""
    rng = np.random.default_rng(5)
    first, second = (rng.integers(0, 255, n, np.uint8) for n in (5000, 300))
    at = [ALIGNMENT, 3 * ALIGNMENT]  # apart by a gap, read into padding
    sums = [
        _write_runs(fd, offset, [_bytes(a)]) for offset, a in zip(at, (first, second), strict=True)
    ]
    empty = Slot("uint8", (0,), 0, 0, checksum(b""), 2 * ALIGNMENT + 7)
    slots = [
        Slot("uint8", (300,), 0, 300, sums[1], at[1]),
        empty,
        Slot("uint8", (5000,), 0, 5000, sums[0], at[0]),
    ]
    back = [bytearray(300), bytearray(0), bytearray(5000)]
    runs = [[memoryview(b)[:100], memoryview(b)[100:]] for b in back]
    read_slots(fd, slots, runs, [slot.checksum for slot in slots], "block")
    assert bytes(back[0]) == second.tobytes()
    assert bytes(back[2]) == first.tobytes()
    with pytest.raises(EntryFormatError) as changed:
        read_slots(fd, slots, runs, [sums[1], checksum(b""), sums[1]], "block")
    assert changed.value.rule is Rule.DATA_CHECKSUM


# --- a manifest and its blocks on real files, written and read back -------------------------

BLOCK = 16
TOKENS = 3 * BLOCK + 5  # three whole blocks and a tail of five rows
IDENTITY = Identity("test/model", "cfg", "tok", "codecs/1", "mlx/cpu")


def _entry_tensors() -> tuple[list[LayerSpec], list[np.ndarray]]:
    """A cut layer (keys, values), a layer stored whole, and another cut layer."""
    rng = np.random.default_rng(3)
    kv = [rng.standard_normal((1, 2, TOKENS, 8)).astype(np.float16) for _ in range(4)]
    ring = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)

    def spec(array: np.ndarray) -> TensorSpec:
        return TensorSpec(str(array.dtype), tuple(array.shape))

    layers = [
        LayerSpec("kv", (spec(kv[0]), spec(kv[1])), True, {"offset": TOKENS}, blocked=True),
        LayerSpec("rotating_kv", (spec(ring),), False, blocked=False),
        LayerSpec("kv", (spec(kv[2]), spec(kv[3])), True, {"offset": TOKENS}, blocked=True),
    ]
    return layers, [kv[0], kv[1], ring, kv[2], kv[3]]


def _file(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    return fd


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[EntryFile, list[int], list[np.ndarray]]]:
    """The entry written as a manifest and its blocks: the manifest opened as a lookup opens
    it, the blocks' descriptors, the source arrays."""
    layers, arrays = _entry_tensors()
    plan = plan_manifest(
        IDENTITY, pack_tokens(range(TOKENS)), layers, block_tokens=BLOCK, created=1.0, min_reuse=0
    )
    writer = BlockWriter(plan, [[_bytes(a)] for a in arrays])
    paths = [tmp_path / f"block{i}" for i in range(len(plan.hashes))]
    with Descriptors([_file(path, plan.block_size) for path in paths[:2]]) as first:
        writer.write_blocks(0, first)
    with Descriptors([_file(path, plan.block_size) for path in paths[2:]]) as rest:
        writer.write_blocks(2, rest)
    blocks = [os.open(path, os.O_RDWR) for path in paths]
    manifest = _file(tmp_path / "manifest", plan.entry.file_size)
    writer.write_manifest(manifest)
    entry = EntryFile.open(manifest, "manifest")
    yield entry, blocks, arrays
    entry.close()
    for fd in blocks:
        os.close(fd)


def _restored(entry: EntryFile, blocks: list[int], order: list[int]) -> list[np.ndarray]:
    """Each tensor in a buffer as a restore makes it (cut ones with room for 64 rows), filled
    by BlockReads from the manifest, then from the blocks of order one by one."""
    header = entry.header
    reads = BlockReads(header, verify=True, limits=DEFAULT_LIMITS)
    targets = []
    for i, fill in enumerate(entry.fills()):
        shape = reads.shape(i)
        if i == 2:
            target = np.zeros(shape, np.float32)
            reads.fill(i, fill)([_bytes(target)])
        else:
            target = np.zeros((*shape[:2], 64, *shape[3:]), np.float16)
            run = 64 * 8 * 2
            pieces = [_bytes(target)[o * run : o * run + TOKENS * 8 * 2] for o in range(2)]
            reads.fill(i, fill)(pieces)
        targets.append(target)
    for index in order:
        reads.read_block(index, blocks[index])
    return targets


def test_a_manifest_and_its_blocks_restore_every_tensor(
    stored: tuple[EntryFile, list[int], list[np.ndarray]],
) -> None:
    entry, blocks, arrays = stored
    header = entry.header
    assert header.block_tokens == BLOCK
    assert len(header.block_hashes) == 3
    assert [layer.blocked for layer in header.layers] == [True, False, True]
    assert [slot.shape[2] for slot in header.slots] == [5, 5, 8, 5, 5]  # tails; the ring whole
    targets = _restored(entry, blocks, [2, 0, 1])  # any order: each block has its place
    for i, (target, array) in enumerate(zip(targets, arrays, strict=True)):
        got = target if i == 2 else target[:, :, :TOKENS]
        assert np.array_equal(got, array)
        assert i == 2 or not target[:, :, TOKENS:].any()


def test_another_block_in_a_blocks_place_is_refused_by_its_hash(
    stored: tuple[EntryFile, list[int], list[np.ndarray]],
) -> None:
    entry, blocks, _ = stored
    with pytest.raises(EntryFormatError) as wrong:
        _restored(entry, [blocks[0], blocks[2], blocks[1]], [0, 1, 2])
    assert wrong.value.rule is Rule.BLOCK_HASH


@pytest.mark.parametrize("first", [0, 1], ids=["head compared", "head parsed"])
def test_a_block_whose_rows_changed_is_refused_by_its_checksum(
    stored: tuple[EntryFile, list[int], list[np.ndarray]], first: int
) -> None:
    entry, blocks, _ = stored
    size = os.fstat(blocks[1]).st_size
    data_start = size - 4 * 16384  # four slots (two cut layers: keys, values), 16 KiB each
    os.pwrite(blocks[1], b"\x7f", data_start + 3)
    with pytest.raises(EntryFormatError) as changed:
        _restored(entry, blocks, [first, 1 - first, 2])
    assert changed.value.rule is Rule.DATA_CHECKSUM


def test_a_client_refuses_a_block_size_the_format_does_not_allow(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="power of two"):
        Client.connect(str(tmp_path / "kvd.sock"), block_tokens=100)
    with Client.connect(str(tmp_path / "kvd.sock"), block_tokens=0) as whole:
        assert not whole.connected  # nothing answers there: blocks off is still a client


def test_blocks_written_at_once_are_each_whole_and_a_failed_one_waits_for_the_others(
    tmp_path: Path,
) -> None:
    """The blocks of one batch go to the writer threads together; when one of them cannot
    be written, write_blocks raises only once the others' writes have ended, and those blocks
    are whole."""
    layers, arrays = _entry_tensors()
    plan = plan_manifest(
        IDENTITY, pack_tokens(range(TOKENS)), layers, block_tokens=BLOCK, created=1.0, min_reuse=0
    )
    writer = BlockWriter(plan, [[_bytes(a)] for a in arrays])
    serial = [tmp_path / f"serial{i}" for i in range(3)]
    for index, path in enumerate(serial):
        with Descriptors([_file(path, plan.block_size)]) as one:
            writer.write_blocks(index, one)  # one block: on this thread
    together = [tmp_path / f"together{i}" for i in range(3)]
    with Descriptors([_file(path, plan.block_size) for path in together]) as fds:
        writer.write_blocks(0, fds)
    after = [tmp_path / f"after{i}" for i in (1, 2)]
    read_only = os.open(together[0], os.O_RDONLY)
    with (
        Descriptors([read_only, *(_file(path, plan.block_size) for path in after)]) as failing,
        pytest.raises(OSError, match="Bad file descriptor"),
    ):
        writer.write_blocks(0, failing)
    expected = [path.read_bytes() for path in serial]
    assert [path.read_bytes() for path in together] == expected
    assert [path.read_bytes() for path in after] == expected[1:]


def test_descriptors_close_when_the_holder_and_every_job_lent_them_are_done(
    tmp_path: Path,
) -> None:
    """The holder's release closes at once when no job is under way; with one under way the
    job closes them as it ends; a job that starts after the release never sees them."""
    first = Descriptors([_file(tmp_path / "a", 0)])
    first.release()
    first.release()  # twice: nothing more
    assert not _names(first.fds[0], tmp_path / "a")

    b = tmp_path / "b"
    held = Descriptors([_file(b, 0)])
    started, go_on = threading.Event(), threading.Event()

    def write() -> bool:
        started.set()
        go_on.wait()
        os.pwrite(held.fds[0], b"after the release", 0)
        return _names(held.fds[0], b)

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(held.lent(write))
        started.wait()
        held.release()  # the holder gives up mid-write
        assert _names(held.fds[0], b)
        go_on.set()
        assert job.result()  # still open for the whole write
    assert not _names(held.fds[0], b)  # closed by the job as it ended
    assert b.read_bytes() == b"after the release"
    with pytest.raises(OSError, match="given up"):
        held.lent(write)()


def _names(fd: int, path: Path) -> bool:
    """Whether fd is open on path's file (a closed number may have been reused since)."""
    try:
        return os.path.samestat(os.fstat(fd), path.stat())
    except OSError:
        return False
