"""merge_in_place: a restored KV cache joins mlx-lm's batch with its own buffers, holding the
same values as mlx-lm's merge would, and appends into its room."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from kvd_client.batch_merge import _agrees_with_mlx_lm, merge_in_place
from kvd_client.codecs import mlc

TOKENS = 300  # mlx-lm grows a KVCache by 256 rows: 512 rows of buffer, room for 212 more


def _cache(seed: int) -> list[object]:
    """Two layers of one sequence as mlx-lm fills them (buffers with room beyond the tokens)."""
    layers = []
    for i in range(2):
        layer = mlc.KVCache()
        keys, values = (
            mx.random.normal((1, 2, TOKENS, 8), key=mx.random.key(seed * 10 + i + k))
            for k in (0, 5)
        )
        layer.update_and_fetch(keys, values)
        layers.append(layer)
    mx.eval([layer.state for layer in layers])
    return layers


def _address(array: mx.array) -> int:
    return int(np.frombuffer(memoryview(array), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]


def _step(batch: object) -> tuple[mx.array, mx.array]:
    token = mx.ones((1, 2, 1, 8))
    keys, values = batch.update_and_fetch(token, token)  # type: ignore[attr-defined]
    mx.eval(keys, values)
    return keys, values


def _same(a: object, b: object) -> bool:
    return all(
        bool(mx.array_equal(x, y).item())
        for x, y in zip(a.keys_and_values(), b.keys_and_values(), strict=True)  # type: ignore[attr-defined]
    ) and (a.offset.tolist(), a.left_padding.tolist(), a._idx) == (  # type: ignore[attr-defined]
        b.offset.tolist(),  # type: ignore[attr-defined]
        b.left_padding.tolist(),  # type: ignore[attr-defined]
        b._idx,  # type: ignore[attr-defined]
    )


def test_a_marked_layer_becomes_the_batch_cache_with_its_own_buffers() -> None:
    marked, plain = _cache(1), _cache(1)
    merge_in_place(marked)
    while marked:  # each layer held by nothing but the batch once merged, as in the server
        layer, reference = marked.pop(), plain.pop()
        buffers = (_address(layer.keys), _address(layer.values))  # type: ignore[attr-defined]
        batch = layer.merge([layer])  # type: ignore[attr-defined]
        stock = reference.merge([reference])  # type: ignore[attr-defined]
        assert (_address(batch.keys), _address(batch.values)) == buffers  # no copy
        assert batch.keys.shape[2] > TOKENS  # and its room
        assert _same(batch, stock)
        del layer
        keys, _ = _step(batch)
        assert (_address(batch.keys), _address(batch.values)) == buffers  # appended in place
        stock_keys, _ = _step(stock)
        assert bool(mx.array_equal(keys, stock_keys).item())
        assert _same(batch, stock)


def test_a_merge_of_several_caches_or_a_second_merge_is_mlx_lm_s() -> None:
    marked, other, plain, plain_other = _cache(2), _cache(3), _cache(2), _cache(3)
    merge_in_place(marked)
    batch = marked[0].merge([marked[0], other[0]])  # type: ignore[attr-defined]
    assert _same(batch, plain[0].merge([plain[0], plain_other[0]]))  # type: ignore[attr-defined]
    assert "merge" not in vars(marked[0])  # used once: the class's merge from now on
    again = marked[0].merge([marked[0]])  # type: ignore[attr-defined]
    assert again.keys.shape[2] == TOKENS  # a buffer of its own, of the tokens alone


def test_a_copy_of_a_marked_layer_leaves_the_original_unchanged() -> None:
    marked = _cache(4)
    merge_in_place(marked)
    original = np.array(marked[0].keys)  # type: ignore[attr-defined]
    duplicate = copy.deepcopy(marked[0])
    batch = duplicate.merge([duplicate])  # type: ignore[attr-defined]
    _step(batch)
    _step(batch)
    assert np.array_equal(np.array(marked[0].keys), original)  # type: ignore[attr-defined]


def test_only_plain_kv_layers_of_one_sequence_are_marked() -> None:
    rotating, batched = mlc.RotatingKVCache(max_size=64), mlc.KVCache()
    rotating.update_and_fetch(mx.ones((1, 2, 8, 8)), mx.ones((1, 2, 8, 8)))
    batched.update_and_fetch(mx.ones((2, 2, 8, 8)), mx.ones((2, 2, 8, 8)))
    empty = mlc.KVCache()
    merge_in_place([rotating, batched, empty])
    assert all("merge" not in vars(layer) for layer in (rotating, batched, empty))


def test_an_mlx_lm_whose_batch_cache_differs_keeps_its_own_merge(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As an mlx-lm would whose batch cache reads its whole buffer: a buffer with room differs.
    monkeypatch.setattr(mlc.BatchKVCache, "keys_and_values", lambda self: (self.keys, self.values))
    _agrees_with_mlx_lm.cache_clear()
    try:
        marked = _cache(5)
        merge_in_place(marked)
        assert all("merge" not in vars(layer) for layer in marked)
        assert "restored caches are copied into the batch" in caplog.text
    finally:
        _agrees_with_mlx_lm.cache_clear()
