"""Every mlx-lm cache class through its codec and a real entry file, back to a cache:
bit-exact state, trimmability as the class really behaves, and the table's refusals."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from kvd_client import entry_io
from kvd_client.codecs import (
    CODEC_ID,
    CodecError,
    KVCodec,
    codec_for,
    mlc,
    register_codec,
    tensor_pieces,
)
from kvd_client.identity import EngineIdentity
from kvd_client.prompt_cache import Miss, decode, encode
from kvd_protocol.entry import EntryHeader, plan_entry
from kvd_protocol.tokens import pack_tokens

IDENTITY = EngineIdentity("test/model", "cfg", "tok").to_protocol()


def _kv(tokens: int, dtype: mx.Dtype = mx.float32, seed: int = 0) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    keys = mx.random.normal((1, 2, tokens, 8), key=key).astype(dtype)
    return keys, keys * 2 + 1


def _filled(cache: Any, tokens: int, seed: int = 0) -> Any:
    cache.update_and_fetch(*_kv(tokens, seed=seed))
    mx.eval(cache.state)
    return cache


@contextmanager
def _entry(tmp_path: Path, caches: list[Any], tokens: int) -> Iterator[entry_io.EntryFile]:
    """caches encoded and written as an entry file, opened back as a lookup opens it."""
    layers, tensors, meta = encode(caches, tokens)
    plan = plan_entry(
        IDENTITY, pack_tokens(range(tokens)), layers, created=0.0, min_reuse=0, meta=meta
    )
    path = tmp_path / "entry"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, plan.file_size)
        entry_io.write_entry(fd, plan, entry_io.tensor_views(plan, tensors))
    except BaseException:
        os.close(fd)
        raise
    entry = entry_io.EntryFile.open(fd, "entry")  # takes the descriptor
    try:
        yield entry
    finally:
        entry.close()


def _round_trip(
    tmp_path: Path, caches: list[Any], tokens: int, matched: int | None = None
) -> tuple[EntryHeader, list[Any]]:
    with _entry(tmp_path, caches, tokens) as entry:
        restored = decode(entry.header, entry.fills(), tokens if matched is None else matched)
        return entry.header, restored


def _same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kv_cache_round_trips_its_live_tokens_with_room_to_grow(
    tmp_path: Path, dtype: mx.Dtype
) -> None:
    cache = mlc.KVCache()
    cache.update_and_fetch(*_kv(10, dtype))
    header, [restored] = _round_trip(tmp_path, [cache], 10)
    layer = header.layers[0]
    assert (layer.kind, layer.trimmable, dict(layer.meta)) == ("kv", True, {"offset": 10})
    assert [s.shape for s in layer.slots] == [(1, 2, 10, 8)] * 2  # no step padding stored
    assert layer.slots[0].dtype == str(dtype).rpartition(".")[2]
    assert type(restored) is mlc.KVCache
    assert restored.offset == 10
    assert restored.keys.shape[2] == 256  # room for the next tokens
    for got, want in zip(restored.keys_and_values(), cache.keys_and_values(), strict=True):
        assert _same(got, want)


def test_kv_cache_trimmed_to_the_match(tmp_path: Path) -> None:
    cache = _filled(mlc.KVCache(), 12)
    _, [restored] = _round_trip(tmp_path, [cache], 12, matched=5)
    assert restored.offset == 5
    keys, _ = restored.keys_and_values()
    assert _same(keys, cache.keys[..., :5, :])


def test_an_empty_kv_cache_round_trips(tmp_path: Path) -> None:
    _, [restored] = _round_trip(tmp_path, [mlc.KVCache()], 0)
    assert type(restored) is mlc.KVCache
    assert restored.keys is None
    assert restored.offset == 0


def test_rotating_cache_before_wrap_is_trimmable(tmp_path: Path) -> None:
    cache = _filled(mlc.RotatingKVCache(max_size=16, keep=2), 10)
    header, [restored] = _round_trip(tmp_path, [cache], 10)
    assert header.layers[0].trimmable
    assert cache.is_trimmable()
    assert restored.state[2:] == cache.state[2:]
    assert _same(restored.keys, cache.keys[..., :10, :])


def test_rotating_cache_after_wrap_is_untrimmable_and_continues_alike(tmp_path: Path) -> None:
    cache = _filled(mlc.RotatingKVCache(max_size=8, keep=2), 6)
    for step in range(5):  # decode steps: the ring fills and wraps, written in place
        cache.update_and_fetch(*_kv(1, seed=10 + step))
    mx.eval(cache.state)
    assert cache.offset == 11
    assert not cache.is_trimmable()
    header, [restored] = _round_trip(tmp_path, [cache], 11)
    assert not header.layers[0].trimmable
    assert restored.state[2:] == cache.state[2:]
    assert _same(restored.keys, cache.keys)
    assert _same(restored.values, cache.values)
    new = _kv(1, seed=99)
    for got, want in zip(
        restored.update_and_fetch(*new), cache.update_and_fetch(*new), strict=True
    ):
        assert _same(got, want)


def test_quantized_cache_round_trips_packed_scales_and_biases(tmp_path: Path) -> None:
    cache = mlc.QuantizedKVCache(group_size=32, bits=4)
    keys = mx.random.normal((1, 2, 20, 64), key=mx.random.key(3))
    cache.update_and_fetch(keys, -keys)
    header, [restored] = _round_trip(tmp_path, [cache], 20)
    layer = header.layers[0]
    assert layer.trimmable
    assert dict(layer.meta) == {"offset": 20, "group_size": 32, "bits": 4}
    assert len(layer.slots) == 6
    assert all(s.shape[2] == 20 for s in layer.slots)
    assert (restored.offset, restored.group_size, restored.bits) == (20, 32, 4)
    for got, want in zip(restored.keys_and_values(), cache.keys_and_values(), strict=True):
        assert all(_same(g, w) for g, w in zip(got, want, strict=True))


def test_arrays_cache_keeps_its_none_entries_and_is_never_trimmable(tmp_path: Path) -> None:
    cache = mlc.ArraysCache(3)
    cache[0] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    cache[2] = mx.ones((1, 2, 2), dtype=mx.float16)
    header, [restored] = _round_trip(tmp_path, [cache], 7)
    assert not header.layers[0].trimmable
    assert restored.cache[1] is None
    assert restored.left_padding is None
    assert _same(restored.cache[0], cache[0])
    assert _same(restored.cache[2], cache[2])
    with _entry(tmp_path, [cache], 7) as entry, pytest.raises(Miss, match="untrimmable"):
        decode(entry.header, entry.fills(), 6)


def test_chunked_cache_round_trips(tmp_path: Path) -> None:
    cache = _filled(mlc.ChunkedKVCache(chunk_size=64), 9)
    header, [restored] = _round_trip(tmp_path, [cache], 9)
    assert header.layers[0].trimmable
    assert (restored.offset, restored.chunk_size, restored.start_position) == (9, 64, 0)
    for got, want in zip(restored.keys_and_values(), cache.keys_and_values(), strict=True):
        assert _same(got, want)


def test_concatenate_cache_is_recorded_untrimmable(tmp_path: Path) -> None:
    cache = _filled(mlc.ConcatenateKVCache(), 5)
    assert cache.is_trimmable()  # what the class claims
    header, [restored] = _round_trip(tmp_path, [cache], 5)
    assert not header.layers[0].trimmable
    assert _same(restored.keys, cache.keys)
    assert restored.offset == 5


def test_cache_list_is_trimmable_only_if_every_child_is(tmp_path: Path) -> None:
    arrays = mlc.ArraysCache(1)
    arrays[0] = mx.ones((1, 4))
    hybrid = mlc.CacheList(arrays, _filled(mlc.KVCache(), 4))
    plain = mlc.CacheList(_filled(mlc.KVCache(), 4, seed=1), _filled(mlc.KVCache(), 4, seed=2))
    header, [restored_hybrid, restored_plain] = _round_trip(tmp_path, [hybrid, plain], 4)
    assert [layer.trimmable for layer in header.layers] == [False, True]
    assert [type(c).__name__ for c in restored_hybrid.caches] == ["ArraysCache", "KVCache"]
    assert _same(restored_hybrid.caches[0][0], arrays[0])
    for got, want in zip(restored_plain.caches, plain.caches, strict=True):
        assert _same(got.keys_and_values()[1], want.keys_and_values()[1])


def test_a_batch_of_one_is_stored_as_its_sequence(tmp_path: Path) -> None:
    batch = mlc.BatchKVCache(left_padding=[0])
    batch.update_and_fetch(*_kv(6))
    header, [restored] = _round_trip(tmp_path, [batch], 6)
    assert header.layers[0].kind == "kv"
    assert type(restored) is mlc.KVCache
    assert _same(restored.keys_and_values()[0], batch.extract(0).keys)

    rotating = mlc.BatchRotatingKVCache(max_size=16, left_padding=[0])
    rotating.update_and_fetch(*_kv(6))
    _, [restored_rotating] = _round_trip(tmp_path, [rotating], 6)
    assert type(restored_rotating) is mlc.RotatingKVCache
    assert restored_rotating.offset == 6


def test_a_batch_of_several_is_refused() -> None:
    batch = mlc.BatchKVCache(left_padding=[0, 0])
    keys = mx.zeros((2, 2, 3, 8))
    batch.update_and_fetch(keys, keys)
    with pytest.raises(CodecError, match="2 sequences"):
        encode([batch], 3)


def test_selection_is_by_exact_class() -> None:
    class Custom(mlc.KVCache):  # type: ignore[misc]
        pass

    class CustomCodec(KVCodec):
        kind = "test_custom_kv"

    with pytest.raises(CodecError, match=r"test_codecs\..*Custom"):
        codec_for(Custom())  # a subclass does not inherit its base's codec
    codec = CustomCodec()
    register_codec(Custom, codec)
    assert codec_for(Custom()) is codec
    with pytest.raises(CodecError, match="has a codec already"):
        register_codec(Custom, codec)
    with pytest.raises(CodecError, match="taken by another codec"):
        register_codec(type("Other", (mlc.KVCache,), {}), KVCodec())


def test_a_cache_holding_other_tokens_than_the_entry_is_refused() -> None:
    with pytest.raises(CodecError, match="holds 4 tokens"):
        encode([_filled(mlc.KVCache(), 4)], 5)


def test_unknown_kinds_and_codec_sets_are_misses(tmp_path: Path) -> None:
    with _entry(tmp_path, [_filled(mlc.KVCache(), 3)], 3) as entry:
        header = entry.header
        renamed = header.layers[0].__class__(
            "mystery", header.layers[0].meta, True, header.layers[0].slots
        )
        with pytest.raises(Miss, match="unknown kind"):
            decode(dataclasses.replace(header, layers=(renamed,)), entry.fills(), 3)
        other = dataclasses.replace(header.identity, codec_id="x/0")
        with pytest.raises(Miss, match="codec"):
            decode(dataclasses.replace(header, identity=other), entry.fills(), 3)
    assert header.identity.codec_id == CODEC_ID


def test_tensors_that_do_not_fit_the_meta_are_a_miss(tmp_path: Path) -> None:
    with _entry(tmp_path, [_filled(mlc.KVCache(), 3)], 3) as entry:
        layer = entry.header.layers[0]
        lying = layer.__class__(layer.kind, {"offset": 4}, True, layer.slots)
        header = dataclasses.replace(entry.header, layers=(lying,))
        with pytest.raises(Miss, match="load failed"):
            decode(header, entry.fills(), 3)


def test_the_layers_cut_into_blocks_hold_every_token_on_axis_two() -> None:
    arrays = mlc.ArraysCache(1)
    arrays[0] = mx.ones((1, 4))
    quantized = mlc.QuantizedKVCache(group_size=32, bits=4)
    keys = mx.random.normal((1, 2, 9, 64), key=mx.random.key(3))
    quantized.update_and_fetch(keys, -keys)
    caches = [
        _filled(mlc.KVCache(), 9),
        quantized,
        _filled(mlc.RotatingKVCache(max_size=4), 9),  # wrapped: its rows are not tokens 0..8
        _filled(mlc.ChunkedKVCache(chunk_size=64), 9),
        _filled(mlc.ConcatenateKVCache(), 9),
        arrays,
        mlc.CacheList(_filled(mlc.KVCache(), 9)),
    ]
    batch = mlc.BatchKVCache(left_padding=[0])
    batch.update_and_fetch(*_kv(9))
    layers, _, _ = encode([*caches, batch], 9)
    assert [layer.blocked for layer in layers] == [True, True, *[False] * 5, True]
    for layer in layers:
        assert not layer.blocked or all(t.shape[2] == 9 for t in layer.tensors)


# --- the live rows written from the caches' own buffers ----------------------------------------

LONG = 300  # tokens: off mlx-lm's 256 step, and runs of LONG * 64 elements above MIN_RUN


def _long_kv(dtype: mx.Dtype, seed: int = 0) -> tuple[mx.array, mx.array]:
    keys = mx.random.normal((1, 2, LONG, 64), key=mx.random.key(seed)).astype(dtype)
    return keys, keys * 2 + 1


def _view(array: mx.array) -> memoryview:
    """The bytes of an evaluated contiguous array (through uint8: bfloat16 has no format)."""
    return memoryview(cast(Any, array.view(mx.uint8)))


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_live_rows_are_views_of_the_buffer_one_per_head(dtype: mx.Dtype) -> None:
    cache = mlc.KVCache()
    cache.update_and_fetch(*_long_kv(dtype))
    mx.eval(cache.state)
    assert cache.keys.shape[2] == 512  # room beyond the live rows: they are strided
    _, [keys, _], _ = encode([cache], LONG)
    start, row = _address(_view(cache.keys)), 64 * dtype.size
    assert [_address(piece) for piece in keys] == [start, start + 512 * row]  # not copied
    assert [piece.nbytes for piece in keys] == [LONG * row] * 2
    live = _view(mx.contiguous(cache.keys[..., :LONG, :]))
    assert b"".join(bytes(piece) for piece in keys) == live.tobytes()


def test_a_snapshot_keeps_its_bytes_while_the_cache_goes_on() -> None:
    """The pieces hold the buffers, so the next decode steps write into copies, in a
    KVCache (rows appended into the room) and in a wrapped RotatingKVCache (its ring
    overwritten in place), and the snapshot still has the bytes it was taken with."""
    kv = mlc.KVCache()
    kv.update_and_fetch(*_long_kv(mx.float16))
    ring = mlc.RotatingKVCache(max_size=LONG, keep=4)
    ring.update_and_fetch(*_long_kv(mx.float16, seed=1))
    ring.update_and_fetch(*(a[..., :1, :] for a in _long_kv(mx.float16, seed=2)))
    mx.eval(kv.state, ring.state)
    tensors = encode([kv], LONG)[1] + encode([ring], LONG + 1)[1]
    before = [b"".join(bytes(p) for p in pieces) for pieces in tensors]
    for step in range(3):
        new = [a[..., :1, :] for a in _long_kv(mx.float16, seed=10 + step)]
        kv.update_and_fetch(*new)
        ring.update_and_fetch(*new)
        mx.eval(kv.state, ring.state)
    assert [b"".join(bytes(p) for p in pieces) for pieces in tensors] == before


def test_a_buffer_is_updated_in_place_again_once_its_snapshot_is_gone() -> None:
    cache = mlc.KVCache()
    cache.update_and_fetch(*_long_kv(mx.float16))
    mx.eval(cache.state)
    _, tensors, _ = encode([cache], LONG)
    held = _address(tensors[0][0])
    step = [a[..., :1, :] for a in _long_kv(mx.float16, seed=5)]
    cache.update_and_fetch(*step)
    mx.eval(cache.state)
    copied = _address(_view(cache.keys))
    assert copied != held  # written into a copy while the snapshot held the buffer
    del tensors
    cache.update_and_fetch(*step)
    mx.eval(cache.state)
    assert _address(_view(cache.keys)) == copied  # in place again


def test_a_copied_snapshot_leaves_the_buffers_to_the_cache() -> None:
    """encode(copy=True), for a put written while the engine decodes: its tensors are
    copies, and the cache's next step still writes into its buffer in place."""
    cache = mlc.KVCache()
    cache.update_and_fetch(*_long_kv(mx.float16))
    mx.eval(cache.state)
    buffer = _address(_view(cache.keys))
    _, tensors, _ = encode([cache], LONG, copy=True)
    assert [len(pieces) for pieces in tensors] == [1, 1]
    assert _address(tensors[0][0]) != buffer
    before = [bytes(pieces[0]) for pieces in tensors]
    cache.update_and_fetch(*(a[..., :1, :] for a in _long_kv(mx.float16, seed=5)))
    mx.eval(cache.state)
    assert _address(_view(cache.keys)) == buffer
    assert [bytes(pieces[0]) for pieces in tensors] == before


def test_a_copied_snapshot_of_a_whole_buffer_leaves_it_to_the_cache() -> None:
    """The same for a full sliding window, whose snapshot is its whole ring buffer (already
    contiguous, which MLX's contiguous would hand back uncopied)."""
    cache = mlc.RotatingKVCache(max_size=8)
    for step in range(12):
        token = mx.random.normal((1, 2, 1, 64), key=mx.random.key(step)).astype(mx.float16)
        cache.update_and_fetch(token, token * 2)
    mx.eval(cache.state)
    buffer = _address(_view(cache.keys))
    _, tensors, _ = encode([cache], 12, copy=True)
    assert all(_address(pieces[0]) != buffer for pieces in tensors)
    before = [bytes(pieces[0]) for pieces in tensors]
    token = mx.ones((1, 2, 1, 64), dtype=mx.float16)
    cache.update_and_fetch(token, token)
    mx.eval(cache.state)
    assert _address(_view(cache.keys)) == buffer
    assert [bytes(pieces[0]) for pieces in tensors] == before


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_caches_written_from_their_buffers_round_trip(tmp_path: Path, dtype: mx.Dtype) -> None:
    kv = mlc.KVCache()
    kv.update_and_fetch(*_long_kv(dtype))
    quantized = mlc.QuantizedKVCache(group_size=32, bits=8)
    quantized.update_and_fetch(*_long_kv(mx.float32, seed=1))
    rotating = mlc.RotatingKVCache(max_size=1024)
    rotating.update_and_fetch(*_long_kv(dtype, seed=2))
    batch = mlc.BatchKVCache(left_padding=[3])  # extract(0) starts 3 rows into the buffer
    batch.update_and_fetch(*_long_kv(dtype, seed=3))
    batch_tokens = batch.extract(0).offset
    caches = [kv, quantized, rotating]
    _, restored = _round_trip(tmp_path, caches, LONG)
    for got, want in zip(restored, caches, strict=True):
        for g, w in zip(got.state, want.state, strict=True):
            if isinstance(w, mx.array | tuple):
                for a, b in zip(
                    *(x if isinstance(x, tuple) else (x,) for x in (g, w)), strict=True
                ):
                    assert _same(a[..., :LONG, :], b[..., :LONG, :])
    _, [restored_batch] = _round_trip(tmp_path, [batch], batch_tokens)
    assert _same(
        restored_batch.keys[..., :batch_tokens, :], batch.extract(0).keys[..., :batch_tokens, :]
    )


def test_tensors_whose_runs_are_short_are_copied_first() -> None:
    source = mx.random.normal((2, 3, 40, 16), key=mx.random.key(7))
    for array in (source.transpose(0, 1, 3, 2), source[..., :5, :], source[:, ::-1]):
        mx.eval(array)
        [piece] = tensor_pieces(array)
        assert bytes(piece) == np.array(array).tobytes()
    assert tensor_pieces(source[..., :0, :]) == []
