"""From a looked-up entry's tensors to MLX arrays in MLX-owned memory: one copy each.

Each destination is allocated by MLX without being written (allocated), then filled through
its buffer by the tensor's Fill: for an entry file, pread straight from the page cache,
checksummed while the bytes are still in the CPU's cache (entry_io.EntryFile.read_slot). KV
tensors get room to grow (with_room): the stored tokens fill the start of a buffer sized for
the next ones, which spares the first decode step a whole-cache copy. A restore's fills run
on reader threads (Filling) while this thread allocates the next layers' buffers.

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

from .workers import settle

STEP: Final = 256  # mlx-lm's KV growth step: restored KV gets room up to the next multiple

MLX_VERSION: Final = importlib.metadata.version("mlx")

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


def owned_all(sources: Sequence[TensorSource]) -> list[mx.array]:
    """Each tensor in a buffer of its own."""
    targets = allocated([(source.shape, source.dtype) for source in sources])
    for source, target in zip(sources, targets, strict=True):
        source.fill([_bytes(target).data] if source.nbytes else [])
    return targets


def with_room_all(sources: Sequence[TensorSource], length: int, axis: int = 2) -> list[mx.array]:
    """TensorSource.with_room of several tensors (a layer's keys and values), allocated and
    evaluated together by MLX on this thread."""
    capacity = -(-(length + 1) // STEP) * STEP
    layouts = []
    for source in sources:
        if len(source.shape) <= axis or source.shape[axis] != length:
            raise ValueError(f"tensor of shape {list(source.shape)} holds no {length} along {axis}")
        shape = list(source.shape)
        shape[axis] = capacity
        layouts.append((tuple(shape), source.dtype))
    targets = allocated(layouts)
    for source, target in zip(sources, targets, strict=True):
        if source.nbytes:  # the room is zeroed: mlx-lm's state (and save_prompt_cache) has it
            outer = math.prod(source.shape[:axis])
            row = source.nbytes // (outer * length)
            _bytes(target).reshape(outer, capacity * row)[:, length * row :] = 0
        source.fill(source._runs(target, length, axis))
    return targets


# The kernel copies out of the page cache about three times faster on the machines measured
# (x86-64 Linux) when a destination's offset within a cache line is not past its source's;
# entry slots start on 16 KiB boundaries, so each destination starts on a cache line.
ALIGN: Final = 64
_MAX_DIMENSION: Final = (1 << 31) - 1  # MLX's dimensions are int32: a larger buffer is zeros


def allocated(layouts: Sequence[tuple[Sequence[int], str]]) -> list[mx.array]:
    """Evaluated arrays of these (shape, dtype), in fresh MLX buffers not yet written (the
    caller fills every byte), each starting on an ALIGN boundary.

    MLX offers no uninitialised allocation but the one mx.load makes before it reads a tensor
    into it: a file object that declares the buffers and writes nothing gets it (mx.zeros
    costs a memset of the whole buffer, and its page faults, on the one thread that allocates).
    MLX's own buffers start 24 bytes into a cache line here, so each is ALIGN bytes longer
    than needed and the array is the aligned part of it: a view, which MLX still updates in
    place (the buffer is the view's alone once the whole is dropped)."""
    sizes = [math.prod(shape) * mlx_dtype(dtype).size for shape, dtype in layouts]
    if any(nbytes + ALIGN > _MAX_DIMENSION for nbytes in sizes):
        zeros = [mx.zeros(shape, mlx_dtype(dtype)) for shape, dtype in layouts]
        mx.eval(zeros)
        return zeros
    declared, end = {}, 0
    for i, nbytes in enumerate(sizes):
        declared[str(i)] = {
            "dtype": "U8",
            "shape": [nbytes + ALIGN],
            "data_offsets": [end, end + nbytes + ALIGN],
        }
        end += nbytes + ALIGN
    loaded = mx.load(_Unwritten(declared, end), format="safetensors")  # type: ignore[arg-type]
    arrays = []
    for i, ((shape, dtype), nbytes) in enumerate(zip(layouts, sizes, strict=True)):
        whole = loaded.pop(str(i))  # type: ignore[union-attr]
        skip = -_address(whole) % ALIGN
        arrays.append(whole[skip : skip + nbytes].view(mlx_dtype(dtype)).reshape(shape))
        del whole
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
    after."""

    def __init__(self) -> None:
        self._pending: list[Future[None]] = []

    def deferred(self, fill: Fill) -> Fill:
        """fill, handed to a reader thread: returns at once."""

        def submit(pieces: Sequence[memoryview]) -> None:
            self._pending.append(_readers().submit(fill, pieces))

        return submit

    def started(self, reads: Sequence[Callable[[], None]]) -> Reading:
        """reads, handed to the reader threads: returns at once."""
        pending = [_readers().submit(read) for read in reads]
        self._pending.extend(pending)
        return Reading(pending)

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


# Reads from the page cache wait on the kernel's copy: more threads than cores go faster
# (four, as many as mx.load uses, read about twice as fast as one on the 2-core Linux VM).
READERS: Final = 4


@functools.cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="kvd-restore")
