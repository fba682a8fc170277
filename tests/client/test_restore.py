"""TensorSource: stored tensors to MLX arrays in MLX-owned memory, bit-exact, filled by the
source's Fill (here from bytes in memory; test_codecs and the end-to-end tests read files)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest
from kvd_client.codecs import mlc
from kvd_client.restore import (
    STEP,
    Filling,
    TensorSource,
    allocated,
    dtype_name,
    mlx_dtype,
    owned_all,
    planned,
    with_room_all,
)


def _fill_from(data: bytes) -> tuple[list[list[int]], object]:
    """A Fill that copies data into the pieces it is given; and the sizes it was given."""
    calls: list[list[int]] = []

    def fill(pieces: Sequence[memoryview]) -> None:
        calls.append([piece.nbytes for piece in pieces])
        at = 0
        for piece in pieces:
            piece[:] = data[at : at + piece.nbytes]
            at += piece.nbytes
        assert at == len(data)

    return calls, fill


def _source(array: mx.array) -> TensorSource:
    host = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    _, fill = _fill_from(bytes(memoryview(host)))  # type: ignore[arg-type]
    return TensorSource(fill, dtype_name(array.dtype), tuple(array.shape))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint8])
def test_owned_is_bit_exact(dtype: mx.Dtype) -> None:
    array = (mx.random.normal((2, 3, 5), key=mx.random.key(0)) * 50).astype(dtype)
    restored = _source(array).owned()
    assert restored.dtype == dtype
    assert restored.shape == array.shape
    assert bool(mx.array_equal(restored, array).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("length", [1, 255, 256, 300])
def test_with_room_rounds_up_past_the_next_token(length: int, dtype: mx.Dtype) -> None:
    array = mx.random.normal((1, 2, length, 4), key=mx.random.key(1)).astype(dtype)
    grown = _source(array).with_room(length)
    assert grown.shape == (1, 2, -(-(length + 1) // STEP) * STEP, 4)
    assert bool(mx.array_equal(grown[..., :length, :], array).item())
    assert not bool(mx.any(grown[..., length:, :]).item())


def test_with_room_fills_one_run_per_head_in_file_order() -> None:
    array = mx.arange(2 * 3 * 5 * 4, dtype=mx.float32).reshape(2, 3, 5, 4)
    calls, fill = _fill_from(bytes(memoryview(array)))  # type: ignore[arg-type]
    grown = TensorSource(fill, "float32", (2, 3, 5, 4)).with_room(5)  # type: ignore[arg-type]
    assert calls == [[5 * 4 * 4] * 6]
    assert bool(mx.array_equal(grown[..., :5, :], array).item())


def test_with_room_refuses_a_length_the_tensor_does_not_hold() -> None:
    with pytest.raises(ValueError, match="holds no 7"):
        _source(mx.zeros((1, 2, 6, 4))).with_room(7)


def test_filling_waits_for_every_fill_then_raises_the_first_failure() -> None:
    ended: list[str] = []

    def broken(pieces: Sequence[memoryview]) -> None:
        ended.append("broken")
        raise OSError("disk gone")

    def slow(pieces: Sequence[memoryview]) -> None:
        for piece in pieces:
            piece[:] = bytes(piece.nbytes)
        ended.append("slow")

    with pytest.raises(OSError, match="disk gone"), Filling() as filling:
        owned_all(
            [
                TensorSource(filling.deferred(broken), "float32", (4,)),
                TensorSource(filling.deferred(slow), "float32", (1 << 20,)),
            ]
        )
    assert sorted(ended) == ["broken", "slow"]


def test_deferred_fills_have_filled_the_arrays_when_the_block_ends() -> None:
    arrays = [mx.random.normal((1, 2, 300, 8), key=mx.random.key(i)) for i in range(6)]
    with Filling() as filling:
        sources = [_source(a) for a in arrays]
        deferred = [TensorSource(filling.deferred(s.fill), s.dtype, s.shape) for s in sources]
        grown = with_room_all(deferred, 300)
    for restored, array in zip(grown, arrays, strict=True):
        assert bool(mx.array_equal(restored[..., :300, :], array).item())


def test_restored_arrays_are_writable_in_place() -> None:
    source = _source(mx.arange(8, dtype=mx.float32).reshape(1, 1, 8, 1))
    for restored in (source.owned(), source.with_room(8)):
        restored[..., 0:4, :] = mx.full((1, 1, 4, 1), -1.0)  # in place, as mlx-lm appends
        mx.eval(restored)
        assert restored[..., 0:4, :].sum().item() == -4.0
        assert restored[..., 4:8, :].sum().item() == 4 + 5 + 6 + 7


def _address(array: mx.array) -> int:
    return int(np.frombuffer(memoryview(array), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]


def test_allocated_arrays_are_their_exact_size_and_hold_their_own_bytes() -> None:
    layouts = [((1, 8, 300, 16), "float16"), ((3, 5), "bool"), ((7,), "bfloat16"), ((), "int32")]
    mx.clear_cache()  # fresh buffers are of the size asked for (a cached one may be larger)
    arrays = allocated(layouts)
    assert [(a.shape, dtype_name(a.dtype)) for a in arrays] == layouts
    assert mx.get_array_buffer_size(arrays) == sum(a.nbytes for a in arrays)  # asked exactly
    starts = sorted((_address(a), a.nbytes) for a in arrays)
    assert all(at + n <= after for (at, n), (after, _) in itertools.pairwise(starts))  # no overlap


def test_a_planned_buffer_is_taken_when_its_layout_is_the_one_asked_for() -> None:
    keys = mx.random.normal((1, 2, 300, 8), key=mx.random.key(5))
    grown, owned, small = planned(
        [
            ((1, 2, 300, 8), "float32", True),
            ((1, 2, 300, 8), "float32", False),
            ((3,), "int32", True),
        ]
    )
    assert (grown.shape, owned.shape, small.shape) == ((1, 2, 512, 8), (1, 2, 300, 8), (3,))
    source = _source(keys)
    with_target = TensorSource(source.fill, source.dtype, source.shape, grown)
    assert _address(with_target.with_room(300)) == _address(grown)
    assert _address(with_target.owned()) != _address(grown)  # not its layout: one of its own
    assert _address(TensorSource(source.fill, source.dtype, source.shape, owned).owned()) == (
        _address(owned)
    )


def test_the_room_of_a_buffer_used_before_reads_as_zeros() -> None:
    keys = mx.random.normal((1, 2, 300, 8), key=mx.random.key(6))
    used = mx.full((1, 2, 512, 8), float("nan"))  # old bytes, as a recycled buffer holds
    mx.eval(used)
    source = _source(keys)
    grown = TensorSource(source.fill, source.dtype, source.shape, used).with_room(300)
    assert _address(grown) == _address(used)
    assert bool(mx.array_equal(grown[..., :300, :], keys).item())
    assert bool(mx.all(grown[..., 300:, :] == 0).item())


def test_the_first_decode_step_appends_in_place() -> None:
    keys, values = (mx.random.normal((1, 2, 300, 8), key=mx.random.key(i)) for i in (3, 4))
    cache = mlc.KVCache()
    cache.state = (_source(keys).with_room(300), _source(values).with_room(300), 300)
    before = (_address(cache.keys), _address(cache.values))
    step = mx.ones((1, 2, 1, 8))
    new_keys, _ = cache.update_and_fetch(step, step)
    mx.eval(new_keys)
    assert (_address(cache.keys), _address(cache.values)) == before  # no whole-cache copy
    assert bool(mx.array_equal(new_keys[..., :300, :], keys).item())
    assert bool(mx.array_equal(new_keys[..., 300:, :], step).item())


def test_dtype_names_are_the_header_names() -> None:
    assert [dtype_name(d) for d in (mx.float32, mx.bfloat16, mx.uint32, mx.bool_)] == [
        "float32",
        "bfloat16",
        "uint32",
        "bool",
    ]
    assert [mlx_dtype(n) for n in ("float32", "bfloat16", "bool")] == [
        mx.float32,
        mx.bfloat16,
        mx.bool_,
    ]


def test_inline_filling_runs_each_fill_on_this_thread_then_raises_the_first_failure() -> None:
    ran: list[tuple[str, threading.Thread]] = []

    def broken(pieces: Sequence[memoryview]) -> None:
        ran.append(("broken", threading.current_thread()))
        raise OSError("disk gone")

    def zeros(pieces: Sequence[memoryview]) -> None:
        for piece in pieces:
            piece[:] = bytes(piece.nbytes)
        ran.append(("zeros", threading.current_thread()))

    filling = Filling(inline=True)
    arrays = owned_all(
        [
            TensorSource(filling.deferred(broken), "float32", (4,)),
            TensorSource(filling.deferred(zeros), "float32", (1 << 10,)),
        ]
    )
    reading = filling.started([lambda: ran.append(("read", threading.current_thread()))])
    names = ("broken", "zeros", "read")
    assert ran == [(name, threading.current_thread()) for name in names]  # each as handed over
    assert not bool(mx.any(arrays[1]).item())
    reading.wait()  # the read went well
    with pytest.raises(OSError, match="disk gone"):  # the broken fill's, as the block ends
        filling.__exit__(None, None, None)
