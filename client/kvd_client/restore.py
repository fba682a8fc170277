"""From a looked-up entry's read-only views to MLX arrays in MLX-owned memory.

On Apple silicon (mlx >= 0.32.1) MLX adopts 16 KiB-aligned host memory without a copy. An
adopted array is backed by the entry's read-only mapping, and MLX writes into a buffer it
believes it owns alone (donation, in-place slice assignment), so an adopted array never ends
up in a cache: it is only the input of the copy that with_room() makes anyway (the KV
kinds), and owned() copies from the view directly. On the Linux CPU build MLX cannot adopt;
with_room() then copies once, from the mapping straight into the room-to-grow buffer (an MLX
array's buffer is writable), which spares the first decode step a whole-cache copy.

Measured on the Linux CPU build (64 x 8 MiB float16, allocator warm): mx.array(np.frombuffer
(view)) copies at about 9.8 GB/s; with_room()'s one copy into a zeroed buffer with room runs
at 5.8 GB/s, against 1.8 GB/s for copying in and concatenating with zeros. A first restore in
a process runs at about 1.8 GB/s whatever the method: fresh destinations fault page by page.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import mlx.core as mx
import numpy as np

STEP: Final = 256  # mlx-lm's KV growth step: restored KV gets room up to the next multiple


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


MLX_VERSION: Final = importlib.metadata.version("mlx")
# Adoption of host memory landed in mlx 0.32.1, and only Metal implements it.
ADOPTS: Final = mx.metal.is_available() and _version(MLX_VERSION) >= (0, 32, 1)


def dtype_name(dtype: mx.Dtype) -> str:
    """The header name of an MLX dtype: "float16", "bfloat16", ..."""
    return str(dtype).rpartition(".")[2]


def _host_view(view: memoryview, name: str, shape: tuple[int, ...]) -> np.ndarray:
    # numpy has no bfloat16: its bytes travel as uint16 and are reinterpreted in MLX.
    host = np.uint16 if name == "bfloat16" else np.dtype(name)
    return np.frombuffer(view, dtype=host).reshape(shape)


def _adopt(view: memoryview, name: str, shape: tuple[int, ...]) -> mx.array:
    array = mx.asarray(_host_view(view, name, shape), copy=False)
    return array.view(mx.bfloat16) if name == "bfloat16" else array


def _copy(view: memoryview, name: str, shape: tuple[int, ...]) -> mx.array:
    array = mx.array(_host_view(view, name, shape))
    return array.view(mx.bfloat16) if name == "bfloat16" else array


@dataclass(frozen=True)
class TensorSource:
    """One stored tensor, not yet in MLX: its bytes (a read-only view), dtype and shape."""

    view: memoryview
    dtype: str
    shape: tuple[int, ...]

    def _array(self) -> mx.array:
        """Adopted where MLX can, else copied: only ever the input of a copying op."""
        return (_adopt if ADOPTS else _copy)(self.view, self.dtype, self.shape)

    def owned(self) -> mx.array:
        """The tensor copied into MLX-owned memory. Not by an MLX op on an adopted array:
        an elementwise op may donate its input's buffer, the mapping, as its output."""
        return _copy(self.view, self.dtype, self.shape)

    def with_room(self, length: int, axis: int = 2) -> mx.array:
        """The tensor (length along axis) in a fresh buffer with capacity for the next tokens,
        ceil((length + 1) / STEP) * STEP, zero beyond: mlx-lm then appends in place
        instead of copying the whole cache on the first decode step."""
        return with_room_all([self], length, axis)[0]

    def _grown(self, length: int, axis: int) -> mx.array:
        if len(self.shape) <= axis or self.shape[axis] != length:
            raise ValueError(f"tensor of shape {list(self.shape)} holds no {length} along {axis}")
        capacity = -(-(length + 1) // STEP) * STEP
        if ADOPTS:
            # One copy on the GPU; a concatenation's output is larger than any input, so it
            # is never a donated buffer (never the mapping).
            array = self._array()
            pad = list(array.shape)
            pad[axis] = capacity - length
            return mx.concatenate([array, mx.zeros(pad, array.dtype)], axis=axis)
        shape = list(self.shape)
        shape[axis] = capacity
        return mx.zeros(shape, getattr(mx, self.dtype))

    def _fill(self, grown: mx.array, length: int, axis: int) -> None:
        """Copy the view into the first length places of an evaluated grown buffer."""
        buffer = memoryview(grown)  # type: ignore[arg-type]  # mx.array has the buffer protocol
        target = _host_view(buffer, self.dtype, tuple(grown.shape))
        target[(slice(None),) * axis + (slice(0, length),)] = _host_view(
            self.view, self.dtype, self.shape
        )


def with_room_all(sources: Sequence[TensorSource], length: int, axis: int = 2) -> list[mx.array]:
    """TensorSource.with_room of several tensors (a layer's keys and values): allocated and
    evaluated together by MLX on this thread, then, on the CPU build, filled in parallel
    (numpy releases the GIL while it copies)."""
    grown = [source._grown(length, axis) for source in sources]
    mx.eval(grown)  # materialised: from here on their buffers are plain memory we may fill
    if not ADOPTS:
        fills = [
            _copiers().submit(source._fill, array, length, axis)
            for source, array in zip(sources, grown, strict=True)
        ]
        for fill in fills:
            fill.result()
    return grown


@functools.cache
def _copiers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="kvd-restore")
