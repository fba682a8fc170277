"""From a looked-up entry's tensors to MLX arrays in MLX-owned memory: one copy each.

Each destination is allocated by MLX (zeros, evaluated), then filled through its buffer by
the tensor's Fill: for an entry file, pread straight from the page cache, checksummed while
the bytes are still in the CPU's cache (entry_io.EntryFile.read_slot). KV tensors get room
to grow (with_room): the stored tokens fill the start of a buffer sized for the next ones,
which spares the first decode step a whole-cache copy. A restore's fills run on reader
threads (Filling) while this thread allocates the next layers' buffers.

No array is ever backed by the file itself: a mapping faults (SIGBUS) when the file
shrinks behind it, and MLX writes into buffers it believes it owns (donation, in-place slice
assignment).
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final, TypeAlias

import mlx.core as mx
import numpy as np

STEP: Final = 256  # mlx-lm's KV growth step: restored KV gets room up to the next multiple

MLX_VERSION: Final = importlib.metadata.version("mlx")

# Fills the given writable byte views, in order, with a tensor's bytes (together exactly its
# size); raises when the bytes cannot be had or trusted.
Fill: TypeAlias = Callable[[Sequence[memoryview]], None]


def dtype_name(dtype: mx.Dtype) -> str:
    """The header name of an MLX dtype: "float16", "bfloat16", ..."""
    return str(dtype).rpartition(".")[2]


@dataclass(frozen=True)
class TensorSource:
    """One stored tensor, not yet in MLX: how to get its bytes, its dtype and shape."""

    fill: Fill
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size: int = getattr(mx, self.dtype).size
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
    targets = [mx.zeros(source.shape, getattr(mx, source.dtype)) for source in sources]
    mx.eval(targets)  # materialised: from here on their buffers are plain memory we may fill
    for source, target in zip(sources, targets, strict=True):
        source.fill([_bytes(target).data] if source.nbytes else [])
    return targets


def with_room_all(sources: Sequence[TensorSource], length: int, axis: int = 2) -> list[mx.array]:
    """TensorSource.with_room of several tensors (a layer's keys and values), allocated and
    evaluated together by MLX on this thread."""
    capacity = -(-(length + 1) // STEP) * STEP
    targets = []
    for source in sources:
        if len(source.shape) <= axis or source.shape[axis] != length:
            raise ValueError(f"tensor of shape {list(source.shape)} holds no {length} along {axis}")
        shape = list(source.shape)
        shape[axis] = capacity
        targets.append(mx.zeros(shape, getattr(mx, source.dtype)))
    mx.eval(targets)
    for source, target in zip(sources, targets, strict=True):
        source.fill(source._runs(target, length, axis))
    return targets


class Filling:
    """The fills of one restore, run by a pool of reader threads while this thread goes on
    allocating the next buffers; leaving the block waits for every fill, then raises the
    first failure. Nothing may read the arrays before (the buffers are still being filled),
    and nothing is left writing into them after."""

    def __init__(self) -> None:
        self._pending: list[Future[None]] = []

    def deferred(self, fill: Fill) -> Fill:
        """fill, handed to a reader thread: returns at once."""

        def submit(pieces: Sequence[memoryview]) -> None:
            self._pending.append(_readers().submit(fill, pieces))

        return submit

    def __enter__(self) -> Filling:
        return self

    def __exit__(self, *exc_info: object) -> None:
        _settle(self._pending)


def read_on_readers(reads: Sequence[Callable[[], None]]) -> None:
    """Run reads on the reader threads and wait for them all, then raise the first failure."""
    _settle([_readers().submit(read) for read in reads])


def _settle(pending: Sequence[Future[None]]) -> None:
    wait(pending)
    for future in pending:
        future.result()


# Reads from the page cache wait on the kernel's copy: more threads than cores go faster
# (four, as many as mx.load uses, read about twice as fast as one on the 2-core Linux VM).
READERS: Final = 4


@functools.cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="kvd-restore")
