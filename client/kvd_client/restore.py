"""From a looked-up entry's tensors to MLX arrays in MLX-owned memory: one copy each.

Each destination is allocated by MLX without being written (allocated), then filled through
its buffer by the tensor's Fill: for an entry file, pread straight from the page cache,
checksummed while the bytes are still in the CPU's cache (entry_io.EntryFile.read_slot). KV
tensors get room to grow (with_room): the stored tokens fill the start of a buffer sized for
the next ones, which spares the first decode step a whole-cache copy; the room is zeroed
without touching fresh pages (platform_memory). A restore allocates every buffer it expects
in one call before the codecs run (planned, TensorSource.target), and its fills run on reader
threads (Filling).

No array is ever backed by the file itself: a mapping faults (SIGBUS) when the file
shrinks behind it, and MLX writes into buffers it believes it owns (donation, in-place slice
assignment).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, TypeAlias

import mlx.core as mx
import numpy as np

from .platform_memory import Span, zero_rooms
from .workers import settle

STEP: Final = 256  # mlx-lm's KV growth step: restored KV gets room up to the next multiple

MLX_VERSION: Final = importlib.metadata.version("mlx")

# The CPU build's buffers are malloc's (private anonymous memory); a GPU build's are not.
CPU_BUFFERS: Final = not mx.metal.is_available() and not mx.cuda.is_available()

# Fills the given writable byte views, in order, with a tensor's bytes (together exactly its
# size); raises when the bytes cannot be had or trusted.
Fill: TypeAlias = Callable[[Sequence[memoryview]], None]


def dtype_name(dtype: mx.Dtype) -> str:
    """The header name of an MLX dtype: "float16", "bfloat16", ..."""
    return str(dtype).rpartition(".")[2]


def mlx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype of a header name (dtype_name's inverse; mlx.core spells bool bool_)."""
    dtype: mx.Dtype = getattr(mx, "bool_" if name == "bool" else name)
    return dtype


@dataclass(frozen=True)
class TensorSource:
    """One stored tensor, not yet in MLX: how to get its bytes, its dtype and shape."""

    fill: Fill
    dtype: str
    shape: tuple[int, ...]
    # Its buffer, allocated with the others of the restore (planned): taken by owned_all or
    # with_room_all when its shape is the one they ask for, else they allocate one.
    target: mx.array | None = None

    @property
    def nbytes(self) -> int:
        size: int = mlx_dtype(self.dtype).size
        return math.prod(self.shape) * size

    def owned(self) -> mx.array:
        """The tensor, in a buffer of its own."""
        return owned_all([self])[0]

    def with_room(self, length: int, axis: int = 2) -> mx.array:
        """The tensor (length along axis) in a fresh buffer with capacity for the next tokens,
        ceil((length + 1) / STEP) * STEP, zero beyond: mlx-lm then appends in place
        instead of copying the whole cache on the first decode step."""
        return with_room_all([self], length, axis)[0]

    def _runs(self, target: mx.array, length: int, axis: int) -> list[memoryview]:
        """The byte ranges of target (shaped as the tensor but longer along axis) that the
        tensor fills, in file order: length rows at the start of each index before axis."""
        if not self.nbytes:
            return []
        outer = math.prod(self.shape[:axis])
        row = self.nbytes // (outer * length)
        runs = _bytes(target).reshape(outer, target.shape[axis] * row)[:, : length * row]
        return [run.data for run in runs]


def _bytes(array: mx.array) -> np.ndarray:
    """The bytes of an evaluated array's buffer, writable (the buffer is the array's own)."""
    return np.frombuffer(memoryview(array), dtype=np.uint8)  # type: ignore[arg-type]


Layout: TypeAlias = tuple[tuple[int, ...], str]  # a buffer's shape and dtype


def room_shape(shape: Sequence[int], axis: int = 2) -> tuple[int, ...]:
    """The shape of a buffer with room for a tensor of shape to grow along axis: its length
    there rounded up past the next token to a multiple of STEP."""
    grown = list(shape)
    grown[axis] = -(-(shape[axis] + 1) // STEP) * STEP
    return tuple(grown)


def planned(layouts: Sequence[tuple[Sequence[int], str, bool]]) -> list[mx.array]:
    """The buffers of a restore, allocated in one call: per tensor (shape, dtype, grows),
    a buffer of its shape, or with room along axis 2 when it grows (and has that axis)."""
    return allocated(
        [
            (room_shape(shape) if grows and len(shape) > 2 else tuple(shape), dtype)
            for shape, dtype, grows in layouts
        ]
    )


def _targets(sources: Sequence[TensorSource], layouts: Sequence[Layout]) -> list[mx.array]:
    """Each source's buffer of its layout: its target if it has that layout, else one
    allocated now (all such in one call)."""
    found = [
        source.target
        if source.target is not None
        and tuple(source.target.shape) == shape
        and dtype_name(source.target.dtype) == dtype
        else None
        for source, (shape, dtype) in zip(sources, layouts, strict=True)
    ]
    missing = iter(
        allocated([layout for layout, t in zip(layouts, found, strict=True) if t is None])
    )
    return [next(missing) if target is None else target for target in found]


def owned_all(sources: Sequence[TensorSource]) -> list[mx.array]:
    """Each tensor in a buffer of its own."""
    targets = _targets(sources, [(source.shape, source.dtype) for source in sources])
    for source, target in zip(sources, targets, strict=True):
        source.fill([_bytes(target).data] if source.nbytes else [])
    return targets


def with_room_all(sources: Sequence[TensorSource], length: int, axis: int = 2) -> list[mx.array]:
    """TensorSource.with_room of several tensors (a layer's keys and values); their room
    reads as zeros, as mlx-lm's own buffers beyond their tokens do."""
    for source in sources:
        if len(source.shape) <= axis or source.shape[axis] != length:
            raise ValueError(f"tensor of shape {list(source.shape)} holds no {length} along {axis}")
    targets = _targets(sources, [(room_shape(s.shape, axis), s.dtype) for s in sources])
    for source, target in zip(sources, targets, strict=True):  # before any fill reads into them
        if source.nbytes:
            buffer = (_address(target), target.nbytes)
            zero_rooms(
                buffer,
                _rooms(source, buffer[0], length, target.shape[axis], axis),
                private=CPU_BUFFERS,
            )
    for source, target in zip(sources, targets, strict=True):
        source.fill(source._runs(target, length, axis))
    return targets


def _rooms(source: TensorSource, base: int, length: int, capacity: int, axis: int) -> list[Span]:
    """Where the room of source's buffer (at base, capacity long along axis) lies: the rows
    past length of each index before axis."""
    outer = math.prod(source.shape[:axis])
    row = source.nbytes // (outer * length)
    span = capacity * row
    return [(base + o * span + length * row, span - length * row) for o in range(outer)]


_MAX_DIMENSION: Final = (1 << 31) - 1  # MLX's dimensions are int32: a larger buffer is zeros


def allocated(layouts: Sequence[Layout]) -> list[mx.array]:
    """Evaluated arrays of these (shape, dtype), in MLX buffers asked for at exactly their
    size (so MLX's cache of freed buffers can serve them, and takes them back for reuse), not
    yet written: the caller fills every byte.

    MLX offers no uninitialised allocation but the one mx.load makes before it reads a tensor
    into it: a file object that declares the buffers and writes nothing gets it (mx.zeros
    costs a memset of the whole buffer, and its page faults). MLX reads a file object's
    tensors one at a time, each a hand-off to its loader thread and back: one call for all
    of a restore's buffers."""
    if not layouts:
        return []
    sizes = [math.prod(shape) * mlx_dtype(dtype).size for shape, dtype in layouts]
    if any(nbytes > _MAX_DIMENSION for nbytes in sizes):
        zeros = [mx.zeros(shape, mlx_dtype(dtype)) for shape, dtype in layouts]
        mx.eval(zeros)
        return zeros
    declared, end = {}, 0
    for i, nbytes in enumerate(sizes):
        declared[str(i)] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [end, end + nbytes]}
        end += nbytes
    loaded = mx.load(_Unwritten(declared, end), format="safetensors")  # type: ignore[arg-type]
    arrays = [
        loaded.pop(str(i)).view(mlx_dtype(dtype)).reshape(shape)  # type: ignore[union-attr]
        for i, (shape, dtype) in enumerate(layouts)
    ]
    mx.eval(arrays)
    return arrays


def _address(array: mx.array) -> int:
    """Where an evaluated array's bytes start in memory."""
    return int(_bytes(array).ctypes.data)


class _Unwritten:
    """A read-only file object of a safetensors file: its header as given, then tensor data
    that reads succeed on without writing a byte (mx.load reads it into the new buffers)."""

    closed = False

    def __init__(self, tensors: dict[str, object], data_bytes: int) -> None:
        header = json.dumps(tensors).encode()
        self._head = struct.pack("<Q", len(header)) + header
        self._size = len(self._head) + data_bytes
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = (0, self._pos, self._size)[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: memoryview) -> int:
        # The head is read first, on the caller's thread; each tensor then on MLX's loader
        # thread, in one read of its whole size, which is all this has to answer.
        head = self._head[self._pos : self._pos + buffer.nbytes]
        buffer[: len(head)] = head
        self._pos += buffer.nbytes
        return buffer.nbytes


class Filling:
    """The fills and reads of one restore, run by a pool of reader threads while this thread
    goes on allocating the next buffers (or asking for the next blocks); leaving the block
    waits for every one of them, then raises the first failure. Nothing may read the arrays
    before (the buffers are still being filled), and nothing is left writing into them
    after.

    inline: each fill and read runs on this thread as it is handed over (its failure still
    raised on leaving the block, after the others ran): for a restore too small for the
    reader threads to pay (INLINE_BYTES)."""

    def __init__(self, *, inline: bool = False) -> None:
        self._pending: list[Future[None]] = []
        self._inline = inline

    def deferred(self, fill: Fill) -> Fill:
        """fill, handed to a reader thread (or run now, inline): returns once handed over."""

        def submit(pieces: Sequence[memoryview]) -> None:
            self._pending.append(self._run(functools.partial(fill, pieces)))

        return submit

    def started(self, reads: Sequence[Callable[[], None]]) -> Reading:
        """reads, handed to the reader threads (or run now, inline): returns once handed over."""
        pending = [self._run(read) for read in reads]
        self._pending.extend(pending)
        return Reading(pending)

    def _run(self, work: Callable[[], None]) -> Future[None]:
        if not self._inline:
            return _readers().submit(work)
        done: Future[None] = Future()
        try:
            work()
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def __enter__(self) -> Filling:
        return self

    def __exit__(self, *exc_info: object) -> None:
        settle(self._pending)


@dataclass(frozen=True)
class Reading:
    """Reads started on the reader threads (Filling.started)."""

    pending: Sequence[Future[None]]

    def wait(self) -> None:
        """Wait for every read, then raise the first failure."""
        settle(self.pending)


# A restore of at most this many tensor bytes is filled on the caller's thread (Filling's
# inline): a hand-off to a reader thread and back costs more than the threads save while the
# reads are few. Gets of the 32-layer bench cache on the 2-core Linux VM, loaded, inline
# against the readers in turn in one process (medians of paired ratios, 15-60 pairs per run):
# 32 MiB (one block) 0.84-1.00x the time, 64 MiB 0.87-0.98x, 128 MiB 0.89-1.19x, 256 MiB
# 0.93-1.06x.
INLINE_BYTES: Final = 64 << 20

# Reads from the page cache wait on the kernel's copy: more threads than cores go faster
# (four, as many as mx.load uses, read about twice as fast as one on the 2-core Linux VM).
READERS: Final = 4


@functools.cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="kvd-restore")
