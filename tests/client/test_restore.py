"""TensorSource: read-only views to MLX arrays in MLX-owned memory, bit-exact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvd_client.restore import ADOPTS, STEP, TensorSource, dtype_name


def _source(array: mx.array) -> TensorSource:
    host = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    view = memoryview(bytes(memoryview(host))).toreadonly()  # type: ignore[arg-type]
    return TensorSource(view, dtype_name(array.dtype), tuple(array.shape))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint8])
def test_owned_is_bit_exact(dtype: mx.Dtype) -> None:
    array = (mx.random.normal((2, 3, 5), key=mx.random.key(0)) * 50).astype(dtype)
    restored = _source(array).owned()
    assert restored.dtype == dtype
    assert restored.shape == array.shape
    assert bool(mx.array_equal(restored, array).item())


@pytest.mark.parametrize("length", [1, 255, 256, 300])
def test_with_room_rounds_up_past_the_next_token(length: int) -> None:
    array = mx.random.normal((1, 2, length, 4), key=mx.random.key(1))
    grown = _source(array).with_room(length)
    assert grown.shape == (1, 2, -(-(length + 1) // STEP) * STEP, 4)
    assert bool(mx.array_equal(grown[..., :length, :], array).item())
    assert not bool(mx.any(grown[..., length:, :]).item())


def test_with_room_refuses_a_length_the_tensor_does_not_hold() -> None:
    with pytest.raises(ValueError, match="holds no 7"):
        _source(mx.zeros((1, 2, 6, 4))).with_room(7)


def test_restored_arrays_do_not_share_the_source_memory() -> None:
    source = _source(mx.arange(8, dtype=mx.float32).reshape(1, 1, 8, 1))
    before = bytes(source.view)
    for restored in (source.owned(), source.with_room(8)):
        restored[..., 0:4, :] = mx.full((1, 1, 4, 1), -1.0)  # in place, as mlx-lm appends
        mx.eval(restored)
    assert bytes(source.view) == before


def test_dtype_names_are_the_header_names() -> None:
    assert [dtype_name(d) for d in (mx.float32, mx.bfloat16, mx.uint32, mx.bool_)] == [
        "float32",
        "bfloat16",
        "uint32",
        "bool",
    ]


def test_adoption_is_used_only_where_mlx_can_adopt() -> None:
    assert mx.metal.is_available() == ADOPTS
    if not ADOPTS:
        with pytest.raises(ValueError, match="without a copy"):
            mx.asarray(np.zeros(4, np.float32), copy=False)
