"""entry_io on real files, and the clients' behaviour when no daemon answers (no daemon here).

The file tests use the functions the client uses, on real descriptors of temp files; the
degradation tests use a real socket path where nothing answers.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_client import entry_io
from kvd_client.async_client import AsyncClient
from kvd_client.client import Client
from kvd_client.entry_io import TensorLayoutError
from kvd_client.link import Backoff
from kvd_protocol.entry import ALIGNMENT, EntryPlan, LayerSpec, TensorSpec, plan_entry
from kvd_protocol.entry_reader import parse_head, verify_slot
from kvd_protocol.errors import DaemonUnavailableError, EntryFormatError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity(
    model_id="test/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
TOKENS = pack_tokens(range(100, 148))
NEVER_AGAIN = Backoff(initial=3600.0, maximum=3600.0)
ALWAYS_RETRY = Backoff(initial=0.0, maximum=0.0)


def _tensors() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.standard_normal((2, 4, 48, 16)).astype(np.float16),
        rng.standard_normal((2, 4, 48, 16)).astype(np.float16),
        np.arange(5, dtype=np.int32),
        np.zeros((0, 3), dtype=np.float32),  # an empty slot
        # larger than one copy chunk, and not a multiple of it
        rng.integers(0, 255, entry_io.CHUNK_BYTES * 2 + 12345, dtype=np.uint8),
    ]


def _layers(tensors: list[np.ndarray]) -> list[LayerSpec]:
    def spec(array: np.ndarray) -> TensorSpec:
        return TensorSpec(str(array.dtype), tuple(array.shape))

    return [
        LayerSpec("kv", (spec(tensors[0]), spec(tensors[1])), trimmable=True, meta={"offset": 48}),
        LayerSpec("state", tuple(spec(t) for t in tensors[2:]), trimmable=False),
    ]


def _plan(tensors: list[np.ndarray]) -> EntryPlan:
    return plan_entry(IDENTITY, TOKENS, _layers(tensors), created=1.0e9, min_reuse=4)


def _staging(path: Path, size: int) -> int:
    """A read-write descriptor of a file pre-sized as the daemon does."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    return fd


def _write(path: Path, tensors: list[np.ndarray]) -> EntryPlan:
    plan = _plan(tensors)
    fd = _staging(path, plan.file_size)
    try:
        entry_io.write_entry(fd, plan, entry_io.tensor_views(plan, tensors))
    finally:
        os.close(fd)
    return plan


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@pytest.fixture
def entry_file(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    tensors = _tensors()
    path = tmp_path / "entry"
    _write(path, tensors)
    return path, tensors


@pytest.fixture
def mapped(entry_file: tuple[Path, list[np.ndarray]]) -> Iterator[entry_io.EntryFile]:
    path, _ = entry_file
    fd = os.open(path, os.O_RDONLY)
    try:
        entry = entry_io.EntryFile.open(os.dup(fd), path.name)
    finally:
        os.close(fd)  # the entry holds a duplicate of it
    yield entry
    entry.close()


# --- writing --------------------------------------------------------------------------------


def test_written_entry_parses_and_every_slot_holds_its_tensor(
    entry_file: tuple[Path, list[np.ndarray]],
) -> None:
    path, tensors = entry_file
    data = path.read_bytes()
    header = parse_head(path.name, data, len(data))
    assert header.identity == IDENTITY
    assert header.tokens == TOKENS
    assert header.min_reuse == 4
    assert [layer.kind for layer in header.layers] == ["kv", "state"]
    assert header.layers[0].meta == {"offset": 48}
    assert len(header.slots) == len(tensors)
    for slot, tensor in zip(header.slots, tensors, strict=True):
        assert slot.start % ALIGNMENT == 0
        assert data[slot.start : slot.end] == tensor.tobytes()
        verify_slot(path.name, slot, data[slot.start : slot.end])


def test_write_refuses_a_staging_file_of_the_wrong_size(tmp_path: Path) -> None:
    tensors = _tensors()
    plan = _plan(tensors)
    fd = _staging(tmp_path / "short", plan.file_size - ALIGNMENT)
    try:
        with pytest.raises(ValueError, match="staging file"):
            entry_io.write_entry(fd, plan, entry_io.tensor_views(plan, tensors))
        assert os.pread(fd, 64, 0) == bytes(64)  # nothing was written
    finally:
        os.close(fd)


def test_non_contiguous_tensor_is_refused_clearly() -> None:
    tensors = _tensors()
    plan = _plan(tensors)
    tensors[0] = np.zeros((96, 128), dtype=np.float16)[:, ::2]  # the slot's byte count, strided
    assert tensors[0].nbytes == plan.slots[0].nbytes
    with pytest.raises(TensorLayoutError, match="not C-contiguous"):
        entry_io.tensor_views(plan, tensors)


def test_wrong_size_tensor_is_refused_clearly() -> None:
    tensors = _tensors()
    plan = _plan(tensors)
    tensors[2] = np.arange(6, dtype=np.int32)
    with pytest.raises(TensorLayoutError, match="tensor 2: 24 bytes"):
        entry_io.tensor_views(plan, tensors)


def test_wrong_tensor_count_and_non_buffers_are_refused() -> None:
    tensors = _tensors()
    plan = _plan(tensors)
    with pytest.raises(TensorLayoutError, match="4 tensors for 5"):
        entry_io.tensor_views(plan, tensors[:4])
    with pytest.raises(TensorLayoutError, match="buffer protocol"):
        entry_io.tensor_views(plan, [*tensors[:2], [0, 1, 2, 3, 4], *tensors[3:]])


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.sampled_from(["float16", "bfloat16", "float32", "int8", "uint32"]),
            st.lists(st.integers(0, 40), min_size=0, max_size=3),
        ),
        min_size=0,
        max_size=6,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_layout_round_trips_through_a_file(
    tmp_path_factory: pytest.TempPathFactory, shapes: list[tuple[str, list[int]]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    specs = [TensorSpec(dtype, tuple(shape)) for dtype, shape in shapes]
    plan = plan_entry(
        IDENTITY, TOKENS, [LayerSpec("kv", tuple(specs), True)], created=0.0, min_reuse=0
    )
    tensors = [rng.integers(0, 256, slot.nbytes, dtype=np.uint8) for slot in plan.slots]
    path = tmp_path_factory.mktemp("entries") / "entry"
    fd = _staging(path, plan.file_size)
    try:
        entry_io.write_entry(fd, plan, entry_io.tensor_views(plan, tensors))
        entry = entry_io.EntryFile.open(os.dup(fd), path.name)
    finally:
        os.close(fd)
    try:
        entry.verify()
        assert [bytes(view) for view in entry.tensors] == [t.tobytes() for t in tensors]
    finally:
        entry.close()


# --- reading --------------------------------------------------------------------------------


def test_mapped_views_are_exact_aligned_and_read_only(
    mapped: entry_io.EntryFile, entry_file: tuple[Path, list[np.ndarray]]
) -> None:
    _, tensors = entry_file
    assert len(mapped.tensors) == len(tensors)
    for view, tensor, slot in zip(mapped.tensors, tensors, mapped.header.slots, strict=True):
        assert view.readonly
        assert view.nbytes == slot.nbytes == tensor.nbytes
        assert bytes(view) == tensor.tobytes()
        if view.nbytes:
            assert _address(view) % ALIGNMENT == 0
    with pytest.raises(TypeError):
        mapped.tensors[0][0] = 1
    mapped.verify()


def test_verify_finds_a_flipped_byte(entry_file: tuple[Path, list[np.ndarray]]) -> None:
    path, _ = entry_file
    data = bytearray(path.read_bytes())
    slot = parse_head(path.name, data, len(data)).slots[1]
    data[slot.start + 17] ^= 0x01
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        entry = entry_io.EntryFile.open(os.dup(fd), path.name)
    finally:
        os.close(fd)
    try:
        with pytest.raises(EntryFormatError) as caught:
            entry.verify()
        assert caught.value.rule is Rule.DATA_CHECKSUM
    finally:
        entry.close()


def test_close_unmaps_and_invalidates_the_views(mapped: entry_io.EntryFile) -> None:
    view = mapped.tensors[0]
    assert not mapped.closed
    mapped.close()
    assert mapped.closed
    with pytest.raises(ValueError, match="released"):
        bytes(view)
    mapped.close()  # twice is harmless


def test_close_leaves_arrays_built_on_a_view_readable(
    mapped: entry_io.EntryFile, entry_file: tuple[Path, list[np.ndarray]]
) -> None:
    _, tensors = entry_file
    adopted = np.frombuffer(mapped.tensors[0], dtype=np.float16).reshape(tensors[0].shape)
    mapped.close()  # must not raise: the mapping lives on while the array does
    assert np.array_equal(adopted, tensors[0])


@pytest.mark.parametrize(
    ("content", "rule"),
    [(b"", Rule.TRUNCATED), (b"not an entry file" * 10, Rule.MAGIC)],
)
def test_mapping_a_bad_file_raises_entry_format_error(
    tmp_path: Path, content: bytes, rule: Rule
) -> None:
    path = tmp_path / "bad"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EntryFormatError) as caught:
            entry_io.EntryFile.open(os.dup(fd), path.name)
    finally:
        os.close(fd)
    assert caught.value.rule is rule


# --- no daemon ------------------------------------------------------------------------------


@pytest.fixture(params=["missing", "refusing"])
def dead_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A socket path where nothing answers: no file at all, or a socket nobody listens on."""
    path = tmp_path / "kvd.sock"
    if request.param == "missing":
        yield str(path)
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(path))  # bound, never listening: connect is refused
        yield str(path)


def _put(client: Client) -> str:
    tensors = _tensors()
    ticket = client.put_entry(IDENTITY, TOKENS, _layers(tensors), tensors)
    return ticket.state.state


def test_client_without_daemon_degrades(dead_socket: str) -> None:
    with Client.connect(dead_socket, backoff=ALWAYS_RETRY) as client:
        assert not client.connected
        assert _put(client) == "unavailable"
        assert client.lookup(IDENTITY, TOKENS) is None
        with pytest.raises(DaemonUnavailableError):
            client.ping()
        with pytest.raises(DaemonUnavailableError):
            client.status()
        with pytest.raises(DaemonUnavailableError):
            client.flush()
        assert client.stats.unavailable_puts == 1
        assert client.stats.failed_lookups == 1
        assert client.stats.reconnects == 0


def test_connect_with_require_raises_daemon_unavailable(dead_socket: str) -> None:
    with pytest.raises(DaemonUnavailableError, match="cannot connect"):
        Client.connect(dead_socket, require=True)


def test_ticket_of_an_unavailable_put_answers_without_raising(dead_socket: str) -> None:
    with Client.connect(dead_socket) as client:
        tensors = _tensors()
        ticket = client.put_entry(IDENTITY, TOKENS, _layers(tensors), tensors)
        assert ticket.id is None
        assert ticket.wait(timeout=0.0).state == "unavailable"
        assert ticket.wait().state == "unavailable"


def test_each_call_tries_to_reconnect_at_most_once(dead_socket: str) -> None:
    with Client.connect(dead_socket, backoff=ALWAYS_RETRY, breaker=False) as client:
        assert client.stats.connect_attempts == 1
        for _ in range(5):
            _put(client)
            client.lookup(IDENTITY, TOKENS)
        assert client.stats.connect_attempts == 1 + 10


def test_backoff_spares_calls_the_connect_while_down(dead_socket: str) -> None:
    with Client.connect(dead_socket, backoff=NEVER_AGAIN) as client:
        for _ in range(100):
            assert _put(client) == "unavailable"
            assert client.lookup(IDENTITY, TOKENS) is None
        assert client.stats.connect_attempts == 1
        assert client.stats.unavailable_puts == 100
        assert client.stats.failed_lookups == 100


def test_caller_mistakes_raise_even_when_the_daemon_is_down(dead_socket: str) -> None:
    with Client.connect(dead_socket) as client:
        tensors = _tensors()
        layers = _layers(tensors)
        tensors[2] = np.arange(7, dtype=np.int32)
        with pytest.raises(TensorLayoutError):
            client.put_entry(IDENTITY, TOKENS, layers, tensors)
        assert client.stats.unavailable_puts == 0


def test_a_daemon_that_never_answers_counts_as_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "kvd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(path))
        hung.listen(8)  # connections queue up, nothing reads them: the hello gets no reply
        with Client.connect(str(path), timeout=0.05, backoff=ALWAYS_RETRY, breaker=False) as client:
            assert not client.connected
            assert _put(client) == "unavailable"
            assert client.lookup(IDENTITY, TOKENS) is None
            assert client.stats.connect_attempts == 3


def test_async_client_without_daemon_degrades(dead_socket: str) -> None:
    async def scenario() -> None:
        client = await AsyncClient.connect(dead_socket, backoff=ALWAYS_RETRY, breaker=False)
        async with client:
            assert not client.connected
            tensors = _tensors()
            ticket = await client.put_entry(IDENTITY, TOKENS, _layers(tensors), tensors)
            assert ticket.state.state == "unavailable"
            assert (await ticket.wait()).state == "unavailable"
            assert await client.lookup(IDENTITY, TOKENS) is None
            with pytest.raises(DaemonUnavailableError):
                await client.ping()
            assert client.stats.unavailable_puts == 1
            assert client.stats.failed_lookups == 1
            assert client.stats.connect_attempts == 4
        with pytest.raises(DaemonUnavailableError):
            await AsyncClient.connect(dead_socket, require=True)

    asyncio.run(scenario())


def test_a_destination_is_read_from_its_first_cache_line_boundary_on() -> None:
    memory = np.zeros(8 * entry_io.LINE, dtype=np.uint8)
    base = -memory.ctypes.data % entry_io.LINE  # memory[base] starts a cache line
    whole = memoryview(memory)  # type: ignore[arg-type]
    pieces = [
        whole[base + 24 : base + 200],
        whole[base + 200 : base + 208],
        whole[base + 256 : base + 320],
    ]
    split = entry_io.line_split(pieces)
    assert [piece.nbytes for piece in split] == [40, 136, 8, 64]
    assert b"".join(bytes(piece) for piece in split) == b"".join(bytes(p) for p in pieces)
    starts = [np.frombuffer(piece, dtype=np.uint8).ctypes.data % entry_io.LINE for piece in split]
    assert starts[1] == starts[3] == 0
