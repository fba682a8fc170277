"""The cache codecs: how each mlx-lm cache class becomes an entry layer and comes back.

One table, keyed by the exact class. A codec has a kind (the name stored in the header),
blocked (whether its tensors grow by token along axis 2, so that they are stored in blocks
shared between entries: FORMAT.md, "Version 2"), optionally grows (whether load gives its
tensors room to grow, restore.with_room_all: a restore then allocates their buffers with
the others' before any codec runs), snapshot(cache) -> (meta, tensors),
load(meta, sources) -> cache, trimmable(meta), and check(meta, template): whether a stored
layer fits the cache the model would make. Snapshots hold only the live tokens (no step
padding) as evaluated arrays, views of the cache's own buffers (not copied); trimmability is
derived from the stored meta alone, so the header says what the daemon may do with it.

Written for the cache.py of mlx-lm 0.32.2 (state layouts differ across versions: the codec
set's version is part of every entry's identity, see CODEC_ID).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as _mlx_lm_cache
from numpy.lib.stride_tricks import as_strided

from .restore import TensorSource, owned_all, with_room_all

mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes

CODEC_SET: Final = "mlx-lm-cache"
CODEC_VERSION: Final = 1
CODEC_ID: Final = f"{CODEC_SET}/{CODEC_VERSION}"

T = TypeVar("T")
Meta = Mapping[str, Any]
Snapshot = tuple[dict[str, Any], list[mx.array]]


class CodecError(ValueError):
    """A cache cannot be snapshotted (no codec, a batch of several) or a stored layer
    cannot be loaded (meta or tensors that do not fit its kind)."""


class Codec(Protocol):
    @property
    def kind(self) -> str:
        """The layer kind stored in entry headers."""
        ...

    @property
    def blocked(self) -> bool:
        """Whether the layer's tensors are cut by token into blocks: every one of them has
        shape [batch, heads, tokens, ...] and holds exactly the layer's tokens, which its
        meta's "offset" counts (so the layer's first n rows under offset n are its prefix)."""
        ...

    def snapshot(self, cache: Any) -> Snapshot:
        """The layer's meta and its tensors, evaluated (views of the cache's buffers where
        they can be: tensor_pieces writes them without a copy)."""
        ...

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        """A cache from what snapshot stored; raises CodecError. Arrays are lazy."""
        ...

    def trimmable(self, meta: Meta) -> bool:
        """Whether the stored layer can be cut to a shorter prefix."""
        ...

    def check(self, meta: Meta, template: Any) -> str | None:
        """Why the stored layer does not fit template (a fresh cache of the model), or None."""
        ...


# --- helpers shared by the codecs ----------------------------------------------------------


def _stored(*arrays: mx.array) -> list[mx.array]:
    """Arrays ready to write: evaluated, not copied (tensor_pieces writes strided ones)."""
    out = list(arrays)
    mx.eval(out)
    return out


def _live(array: mx.array, length: int) -> mx.array:
    return array[..., :length, :]


# A strided tensor is written from its own buffer a contiguous run at a time when its runs
# are at least this long; shorter ones would cost more in calls than a copy does.
MIN_RUN: Final = 16 << 10


def tensor_pieces(array: mx.array) -> list[memoryview]:
    """The bytes of an evaluated array in C order, as byte views of its own buffer: one if it
    is contiguous, else one per contiguous run. A KV layer's live rows, [B, H, :T, D] of a
    [B, H, capacity, D] buffer, are B * H runs of T * D elements; MLX's copy of them into a
    contiguous array (mx.contiguous) ran at 1.5-1.9 GB/s on the CPU build, a third of what
    writing the runs costs. An array whose runs are shorter than MIN_RUN is copied first.

    The views hold the buffer through an array of their own: while they live, MLX writes
    the cache's next tokens into a copy of it (no donation) rather than in place. Kept by
    the cache's own array object instead, they would see in-place writes (mlx-lm assigns
    into its buffers: a slice assignment replaces the object's array and donates the old
    buffer to it)."""
    # A new array on the same buffer; bfloat16's buffer format is one numpy refuses.
    own = array.view(mx.uint16 if array.dtype == mx.bfloat16 else array.dtype)
    data = np.asarray(memoryview(cast(Any, own)))  # MLX's strides, not a copy
    if data.nbytes == 0:
        return []
    tail, run = data.ndim, data.itemsize  # the trailing axes that are one contiguous run
    while tail and (data.shape[tail - 1] == 1 or data.strides[tail - 1] == run):
        run *= data.shape[tail - 1]
        tail -= 1
    shape, strides = data.shape[:tail], data.strides[:tail]
    if tail and (run < MIN_RUN or min(strides) < 0):
        return tensor_pieces(mx.contiguous(own))
    # One flat view from the first byte to the last, and the runs as slices of it (cheaper
    # than a numpy view per run).
    span = sum((n - 1) * stride for n, stride in zip(shape, strides, strict=True)) + run
    flat = memoryview(cast(Any, as_strided(data.view(np.uint8), shape=(span,), strides=(1,))))
    starts = [0]
    for n, stride in zip(shape, strides, strict=True):
        starts = [start + i * stride for start in starts for i in range(n)]
    return [flat[start : start + run] for start in starts]


def grows(codec: Codec) -> bool:
    """Whether codec's load gives each of its tensors with an axis 2 room to grow along it
    (with_room_all); a codec registered without saying is given buffers as it asks."""
    return bool(getattr(codec, "grows", False))


def _int(meta: Meta, key: str, low: int = 0) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CodecError(f"meta {key!r} is {value!r}, not an integer >= {low}")
    return value


def _count(sources: Sequence[TensorSource], *allowed: int) -> None:
    if len(sources) not in allowed:
        raise CodecError(f"{len(sources)} tensors, expected {' or '.join(map(str, allowed))}")


def _same_class(template: Any, cls: type) -> str | None:
    if type(template) is not cls:
        return f"the model makes a {type(template).__name__} here, the entry has a {cls.__name__}"
    return None


def _load(build: Callable[[], T], what: str) -> T:
    try:
        return build()
    except ValueError as exc:  # shapes that do not fit the stored lengths
        raise CodecError(f"{what}: {exc}") from None


# --- the codecs ------------------------------------------------------------------------------


class KVCodec:
    """KVCache: keys and values up to offset; restored with room to grow."""

    kind = "kv"
    blocked = True
    grows = True

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None or cache.offset == 0:
            return {"offset": 0}, []
        n = cache.offset
        return {"offset": n}, _stored(_live(cache.keys, n), _live(cache.values, n))

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        offset = _int(meta, "offset")
        cache = mlc.KVCache()
        _count(sources, 0 if offset == 0 else 2)
        if sources:
            keys, values = _load(lambda: with_room_all(sources, offset), self.kind)
            # Not through state: mlx-lm 0.31's setter takes no offset (vllm-mlx runs on it).
            cache.keys, cache.values, cache.offset = keys, values, offset
        return cache

    def trimmable(self, meta: Meta) -> bool:
        return True

    def check(self, meta: Meta, template: Any) -> str | None:
        # mlx-lm quantizes a model's KV caches itself (kv_bits), so either fits a KVCache.
        return _same_class(template, mlc.KVCache)


class QuantizedKVCodec:
    """QuantizedKVCache: (packed, scales, biases) of keys then values, up to offset.
    Groups run along the head dimension, so cutting along tokens keeps whole groups."""

    kind = "quantized_kv"
    blocked = True
    grows = True

    def snapshot(self, cache: Any) -> Snapshot:
        meta = {"offset": cache.offset, "group_size": cache.group_size, "bits": cache.bits}
        if cache.keys is None or cache.offset == 0:
            return {**meta, "offset": 0}, []
        n = cache.offset
        return meta, _stored(*(_live(part, n) for part in (*cache.keys, *cache.values)))

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        offset = _int(meta, "offset")
        cache = mlc.QuantizedKVCache(_int(meta, "group_size", 1), _int(meta, "bits", 1))
        _count(sources, 0 if offset == 0 else 6)
        if sources:
            parts = _load(lambda: with_room_all(sources, offset), self.kind)
            cache.keys, cache.values = tuple(parts[:3]), tuple(parts[3:])
            cache.offset = offset
        return cache

    def trimmable(self, meta: Meta) -> bool:
        return True

    def check(self, meta: Meta, template: Any) -> str | None:
        # A model makes KVCache; mlx-lm swaps in QuantizedKVCache when quantizing its KV.
        if type(template) is mlc.KVCache:
            return None
        return _same_class(template, mlc.QuantizedKVCache)


class RotatingKVCodec:
    """RotatingKVCache: before the window wraps, the live tokens in order; after, the whole
    ring as laid out with its write index. Trimmable only before it wraps."""

    kind = "rotating_kv"
    blocked = False  # a wrapped ring's rows are not in token order

    def snapshot(self, cache: Any) -> Snapshot:
        meta = {
            "offset": cache.offset,
            "keep": cache.keep,
            "max_size": cache.max_size,
            "idx": cache._idx,
        }
        if cache.keys is None:
            return meta, []
        keys, values = cache.keys, cache.values
        if cache.offset < cache.max_size:  # not wrapped: the ring is the tokens in order
            keys, values = _live(keys, cache.offset), _live(values, cache.offset)
        return meta, _stored(keys, values)

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        cache = mlc.RotatingKVCache(_int(meta, "max_size", 1), _int(meta, "keep"))
        offset, idx = _int(meta, "offset"), _int(meta, "idx")
        _count(sources, 0, 2)
        if sources:
            if offset < cache.max_size and any(s.shape[2:3] != (offset,) for s in sources):
                raise CodecError(f"{self.kind}: an unwrapped ring must hold {offset} tokens")
            # The ring is written in place once full: it must live in MLX-owned memory.
            keys, values = owned_all(sources)
            cache.keys, cache.values = keys, values
        cache.offset, cache._idx = offset, idx
        return cache

    def trimmable(self, meta: Meta) -> bool:
        return _int(meta, "offset") < _int(meta, "max_size", 1)

    def check(self, meta: Meta, template: Any) -> str | None:
        problem = _same_class(template, mlc.RotatingKVCache)
        if problem is None and (template.max_size, template.keep) != (
            meta.get("max_size"),
            meta.get("keep"),
        ):
            problem = (
                f"the model's window is {template.max_size} (keep {template.keep}), "
                f"the entry's {meta.get('max_size')} (keep {meta.get('keep')})"
            )
        return problem


class ChunkedKVCodec:
    """ChunkedKVCache: the tokens kept since start_position. Trimmable only while nothing was
    dropped from the front (a trim below start_position cannot be honoured)."""

    kind = "chunked_kv"
    blocked = False  # its rows start at start_position, not at token 0
    grows = True

    def snapshot(self, cache: Any) -> Snapshot:
        meta = {
            "offset": cache.offset,
            "chunk_size": cache.chunk_size,
            "start_position": cache.start_position,
        }
        if cache.keys is None:
            return meta, []
        n = cache.offset - cache.start_position
        return meta, _stored(_live(cache.keys, n), _live(cache.values, n))

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        cache = mlc.ChunkedKVCache(_int(meta, "chunk_size", 1))
        offset, start = _int(meta, "offset"), _int(meta, "start_position")
        if start > offset:
            raise CodecError(f"start_position {start} is past offset {offset}")
        _count(sources, 0, 2)
        if sources:
            keys, values = _load(lambda: with_room_all(sources, offset - start), self.kind)
            cache.keys, cache.values = keys, values
        cache.offset, cache.start_position = offset, start
        return cache

    def trimmable(self, meta: Meta) -> bool:
        return _int(meta, "start_position") == 0

    def check(self, meta: Meta, template: Any) -> str | None:
        problem = _same_class(template, mlc.ChunkedKVCache)
        if problem is None and template.chunk_size != meta.get("chunk_size"):
            problem = f"chunk size {meta.get('chunk_size')}, the model's is {template.chunk_size}"
        return problem


class ConcatenateKVCodec:
    """ConcatenateKVCache: keys and values as they are. Recorded untrimmable: the class says
    it trims, but it keeps appending after all of its keys, whatever its offset says."""

    kind = "concatenate_kv"
    blocked = False

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None or cache.offset == 0:
            return {"offset": 0}, []
        return {"offset": cache.offset}, _stored(cache.keys, cache.values)

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        offset = _int(meta, "offset")
        cache = mlc.ConcatenateKVCache()
        _count(sources, 0 if offset == 0 else 2)
        if sources:
            if any(len(s.shape) < 2 or s.shape[-2] != offset for s in sources):
                raise CodecError(f"{self.kind}: tensors do not hold {offset} tokens")
            cache.state = tuple(owned_all(sources))
        return cache

    def trimmable(self, meta: Meta) -> bool:
        return False

    def check(self, meta: Meta, template: Any) -> str | None:
        return _same_class(template, mlc.ConcatenateKVCache)


class ArraysCodec:
    """ArraysCache (recurrent and convolution state): its entries, None ones recorded as
    absent, then left_padding and lengths when set. Never trimmable."""

    kind = "arrays"
    blocked = False

    def snapshot(self, cache: Any) -> Snapshot:
        extra = {"left_padding": cache.left_padding, "lengths": cache.lengths}
        meta = {
            "present": [entry is not None for entry in cache.cache],
            **{name: value is not None for name, value in extra.items()},
        }
        arrays = [a for a in (*cache.cache, *extra.values()) if a is not None]
        return meta, _stored(*arrays)

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        present = meta.get("present")
        if not isinstance(present, Sequence) or not all(isinstance(p, bool) for p in present):
            raise CodecError(f"meta 'present' is {present!r}, not a list of booleans")
        flags = [*present, meta.get("left_padding") is True, meta.get("lengths") is True]
        _count(sources, sum(flags))
        arrays = iter(owned_all(sources))
        values = [next(arrays) if flag else None for flag in flags]
        cache = mlc.ArraysCache(len(present))
        # Not through state: mlx-lm 0.31's is the entries alone (vllm-mlx runs on it).
        cache.cache, cache.left_padding, cache.lengths = values[: len(present)], *values[-2:]
        return cache

    def trimmable(self, meta: Meta) -> bool:
        return False

    def check(self, meta: Meta, template: Any) -> str | None:
        problem = _same_class(template, mlc.ArraysCache)
        present = meta.get("present")
        if problem is None and (
            not isinstance(present, Sequence) or len(template.cache) != len(present)
        ):
            problem = f"the model keeps {len(template.cache)} arrays, the entry {present!r}"
        return problem


class CacheListCodec:
    """CacheList: each child's kind, meta and slot count in meta; their tensors in order.
    Trimmable only if every child is."""

    kind = "cache_list"
    blocked = False

    def snapshot(self, cache: Any) -> Snapshot:
        children: list[dict[str, Any]] = []
        tensors: list[mx.array] = []
        for child in cache.caches:
            codec = codec_for(child)
            meta, arrays = codec.snapshot(child)
            children.append({"kind": codec.kind, "meta": meta, "slots": len(arrays)})
            tensors.extend(arrays)
        return {"children": children}, tensors

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        children = []
        at = 0
        for kind, child_meta, slots in self._children(meta):
            children.append(codec_named(kind).load(child_meta, sources[at : at + slots]))
            at += slots
        _count(sources, at)
        return mlc.CacheList(*children)

    def trimmable(self, meta: Meta) -> bool:
        return all(codec_named(kind).trimmable(m) for kind, m, _ in self._children(meta))

    def check(self, meta: Meta, template: Any) -> str | None:
        problem = _same_class(template, mlc.CacheList)
        if problem is not None:
            return problem
        children = self._children(meta)
        if len(children) != len(template.caches):
            return f"the model's cache list has {len(template.caches)} caches, not {len(children)}"
        for (kind, child_meta, _), child in zip(children, template.caches, strict=True):
            problem = codec_named(kind).check(child_meta, child)
            if problem is not None:
                return problem
        return None

    @staticmethod
    def _children(meta: Meta) -> list[tuple[str, Meta, int]]:
        children = meta.get("children")
        if not isinstance(children, Sequence):
            raise CodecError(f"meta 'children' is {children!r}, not a list")
        out = []
        for child in children:
            if not isinstance(child, Mapping) or not isinstance(child.get("meta"), Mapping):
                raise CodecError(f"a cache list child is {child!r}")
            out.append((str(child.get("kind")), child["meta"], _int(child, "slots")))
        return out


@dataclass(frozen=True)
class Extracted:
    """A batch cache of one sequence, stored as that sequence's cache (mlx-lm's extract);
    a batch of several is refused: snapshot one sequence at a time."""

    inner: Codec
    empty: Any  # a cache -> the inner class's empty cache, for a batch cache never filled

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def blocked(self) -> bool:
        return self.inner.blocked

    @property
    def grows(self) -> bool:
        return grows(self.inner)

    def snapshot(self, cache: Any) -> Snapshot:
        if cache.keys is None:
            return self.inner.snapshot(self.empty(cache))
        size = cache.keys.shape[0]
        if size != 1:
            raise CodecError(
                f"{type(cache).__name__} holds {size} sequences; snapshot one at a time "
                "(its extract(i) gives the cache of sequence i)"
            )
        return self.inner.snapshot(cache.extract(0))

    def load(self, meta: Meta, sources: Sequence[TensorSource]) -> Any:
        return self.inner.load(meta, sources)

    def trimmable(self, meta: Meta) -> bool:
        return self.inner.trimmable(meta)

    def check(self, meta: Meta, template: Any) -> str | None:
        return self.inner.check(meta, template)


# --- the table --------------------------------------------------------------------------------

_KV = KVCodec()
_ROTATING = RotatingKVCodec()

_BY_CLASS: dict[type, Codec] = {}
_BY_KIND: dict[str, Codec] = {}


def register_codec(cls: type, codec: Codec) -> None:
    """Add a codec for exactly cls (a model-specific cache class). A class with a codec
    already, or a kind bound to another codec, is ambiguous: CodecError."""
    if cls in _BY_CLASS:
        raise CodecError(f"{_qualified(cls)} has a codec already ({_BY_CLASS[cls].kind})")
    bound = _BY_KIND.get(codec.kind)
    loader = codec.inner if isinstance(codec, Extracted) else codec
    if bound is not None and bound is not loader:
        raise CodecError(f"kind {codec.kind!r} is taken by another codec")
    _BY_CLASS[cls] = codec
    _BY_KIND[codec.kind] = loader


def codec_for(cache: Any) -> Codec:
    """The codec of exactly this cache's class (never of a base class); raises CodecError."""
    codec = _BY_CLASS.get(type(cache))
    if codec is None:
        raise CodecError(
            f"no codec for cache class {_qualified(type(cache))}; register_codec() adds one"
        )
    return codec


def codec_named(kind: str) -> Codec:
    """The codec that loads layers of kind; raises CodecError for a kind not in the table."""
    codec = _BY_KIND.get(kind)
    if codec is None:
        raise CodecError(f"unknown cache kind {kind!r}")
    return codec


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


register_codec(mlc.KVCache, _KV)
register_codec(mlc.QuantizedKVCache, QuantizedKVCodec())
register_codec(mlc.RotatingKVCache, _ROTATING)
register_codec(mlc.ChunkedKVCache, ChunkedKVCodec())
register_codec(mlc.ConcatenateKVCache, ConcatenateKVCodec())
register_codec(mlc.ArraysCache, ArraysCodec())
register_codec(mlc.CacheList, CacheListCodec())
register_codec(mlc.BatchKVCache, Extracted(_KV, lambda batch: mlc.KVCache()))
register_codec(
    mlc.BatchRotatingKVCache,
    Extracted(_ROTATING, lambda batch: mlc.RotatingKVCache(batch.max_size)),
)
