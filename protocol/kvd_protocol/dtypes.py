"""The element types an entry's tensors may have: MLX's dtypes by name, with their item sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

ITEM_SIZES: Final[Mapping[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
}


def itemsize(dtype: str) -> int:
    """The byte size of one element of dtype; raises ValueError for a dtype outside the table."""
    size = ITEM_SIZES.get(dtype)
    if size is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    return size


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """prod(shape) * itemsize(dtype); raises ValueError for an unknown dtype or a negative dim."""
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    return math.prod(shape) * itemsize(dtype)
