"""Put and get of mlx-lm prompt caches (a list of cache objects, one per layer) through the
daemon: snapshot by the codec table, restore from a looked-up entry, trim to the match.

put, get and get_checkpoint are calls (calls.py), run by Client and AsyncClient alike. A put
is encode() (the caches' layers, byte views of their tensors, the meta) handed to the raw
put; the cold tier's puts take snapshot_layers() alone and copy only what is new
(snapshots.py). A get looks up and restores through _decoded: an entry stored whole is
decode() of its one file; a manifest that lists blocks has its buffers allocated once the
first batch of block descriptors is open, then its blocks read into them, batch by batch.
A get never raises and never returns a half-built cache: anything wrong with an entry is a
miss, counted by reason in the client's stats.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import mlx.core as mx
import mlx_lm
from kvd_protocol.dtypes import tensor_nbytes
from kvd_protocol.entry import Checkpoint, EntryHeader, LayerSpec, MetaValue, TensorSpec
from kvd_protocol.errors import DaemonUnavailableError, EntryFormatError
from kvd_protocol.messages import MAX_BLOCK_BATCH, Retention
from mlx_lm.models.cache import make_prompt_cache

from . import calls, put_calls
from .block_io import BlockReads
from .calls import Blocking, Call
from .codecs import CODEC_ID, Codec, CodecError, codec_for, codec_named, grows, tensor_pieces
from .identity import EngineIdentity
from .link import DaemonError, Link
from .restore import (
    INLINE_BYTES,
    Fill,
    Filling,
    Reading,
    TensorSource,
    dtype_name,
    planned,
)
from .results import LookupHit, PutOutcome

log = logging.getLogger("kvd_client")

MLX_LM_META: Final = "mlx_lm"  # entry meta key: the mlx-lm version that made the caches


@dataclass(frozen=True)
class Restored:
    """Caches rebuilt from an entry, covering the first `matched` tokens of the prompt.

    checkpoint: set when the entry is a generation checkpoint (get_checkpoint): where the
    interrupted generation stands, its pending token and seed. block_hashes: the chained hashes of
    the entry's blocks within the match (of block_tokens tokens each): the daemon holds them.
    prefill_checkpoint: the entry is a prefill checkpoint (prefill_checkpoints.py).
    """

    cache: list[Any]
    matched: int
    checkpoint: Checkpoint | None = None
    block_hashes: tuple[bytes, ...] = ()
    block_tokens: int = 0
    prefill_checkpoint: bool = False

    @property
    def blocks(self) -> tuple[bytes, ...]:
        """Deprecated: block_hashes."""
        warnings.warn(
            "Restored.blocks is deprecated: use Restored.block_hashes", DeprecationWarning, 2
        )
        return self.block_hashes


# --- put -------------------------------------------------------------------------------------


def encode(
    cache: Sequence[Any],
    token_count: int,
    meta: Mapping[str, MetaValue] | None = None,
    *,
    copy: bool = False,
) -> tuple[list[LayerSpec], list[list[memoryview]], dict[str, MetaValue]]:
    """The layers, tensors (each as byte views of the caches' buffers: tensor_pieces) and
    entry meta of a put; raises CodecError for a cache without a codec, or one holding a
    different number of tokens than the entry's.

    copy: the tensors copied into arrays of their own first (mx.array: mx.contiguous hands an
    already contiguous array back uncopied, a full sliding window's ring), for a put that
    is written after the engine goes on decoding. Kept that long, views of the caches'
    buffers would make the engine's next step copy every buffer whole instead: 0.9-1.1 s at
    4,000 tokens of 512 MiB on the CPU build, against 0.3-0.4 s for this copy."""
    layers, arrays = snapshot_layers(cache, token_count)
    tensors = [mx.array(a) for a in arrays] if copy else arrays
    mx.eval(tensors)
    pieces = [tensor_pieces(tensor) for tensor in tensors]
    return layers, pieces, entry_meta(meta)


def snapshot_layers(cache: Sequence[Any], token_count: int) -> tuple[list[LayerSpec], list[Any]]:
    """Each layer's spec and the tensors of all of them (mx.array, views of the caches'
    buffers, not evaluated), by the codec table; raises CodecError as encode does."""
    layers: list[LayerSpec] = []
    tensors: list[mx.array] = []
    for i, layer in enumerate(cache):
        codec = codec_for(layer)
        state, arrays = codec.snapshot(layer)
        offset = state.get("offset")
        if isinstance(offset, int) and offset != token_count:
            raise CodecError(f"layer {i} holds {offset} tokens, the entry has {token_count}")
        specs = tuple(TensorSpec(dtype_name(a.dtype), tuple(a.shape)) for a in arrays)
        layers.append(
            LayerSpec(codec.kind, specs, codec.trimmable(state), state, blocked=codec.blocked)
        )
        tensors.extend(arrays)
    return layers, tensors


def entry_meta(meta: Mapping[str, MetaValue] | None = None) -> dict[str, MetaValue]:
    """An entry's meta: meta, and the mlx-lm version that made the caches."""
    return {**(meta or {}), MLX_LM_META: mlx_lm.__version__}


def put(
    link: Link,
    identity: EngineIdentity,
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    created: float,
    meta: Mapping[str, MetaValue] | None,
    checkpoint: Checkpoint | None,
    retention: Retention | None = None,
) -> Call[PutOutcome]:
    """Snapshot the caches as they are and put them (with retention: put_calls.put_entry);
    raises CodecError before the daemon is asked for a cache without a codec."""
    layers, tensors, entry_meta = encode(cache, len(tokens), meta)
    return (
        yield from put_calls.put_entry(
            link,
            identity.to_protocol(),
            tokens,
            layers,
            tensors,
            created=created,
            min_reuse=0,
            checkpoint=checkpoint,
            meta=entry_meta,
            retention=retention,
        )
    )


# --- get -------------------------------------------------------------------------------------


class Miss(Exception):  # noqa: N818 - an outcome, not a failure of the caller
    """Why an entry cannot be restored; reason is the counter's key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def decode(
    header: EntryHeader, fills: Sequence[Fill], matched: int, model: Any = None
) -> list[Any]:
    """The caches of an entry stored whole (version 1, or a manifest listing no blocks; a
    get reads the blocks of the others), from its header and a Fill per slot, trimmed to
    matched tokens and evaluated; raises Miss, or EntryFormatError for tensor bytes the fills
    found damaged. With model, the entry is checked against the caches the model makes
    before anything is allocated."""
    if header.block_hashes:
        raise Miss("blocks", f"the entry lists {len(header.block_hashes)} blocks, read by a get")
    codecs = _codecs(header, matched, model)
    with _as_miss(), _filling(header, None) as filling:
        caches = _loaded(header, codecs, fills, filling, None)
    return _trimmed(caches, header.token_count - matched)


def _filling(header: EntryHeader, blocks: BlockReads | None) -> Filling:
    """The Filling of a restore of header's tensors: on this thread if they are small."""
    shapes = zip(header.slots, _whole_shapes(header, blocks), strict=True)
    nbytes = sum(tensor_nbytes(slot.dtype, shape) for slot, shape in shapes)
    return Filling(inline=nbytes <= INLINE_BYTES)


def _whole_shapes(header: EntryHeader, blocks: BlockReads | None) -> list[tuple[int, ...]]:
    """Each tensor's whole shape: its slot's, or a cut tensor's with the rows of its blocks."""
    slots = header.slots
    return [slot.shape if blocks is None else blocks.shape(i) for i, slot in enumerate(slots)]


def _codecs(header: EntryHeader, matched: int, model: Any) -> list[Codec]:
    """The codec of each layer, once the entry is known to be restorable; raises Miss."""
    if header.identity.codec_id != CODEC_ID:
        raise Miss("codec", f"entry written by codecs {header.identity.codec_id!r}")
    try:
        codecs = [codec_named(layer.kind) for layer in header.layers]
    except CodecError as exc:
        raise Miss("unknown kind", str(exc)) from None
    if model is not None:
        try:
            templates = make_prompt_cache(model)
        except Exception as exc:
            raise Miss("model", f"make_prompt_cache failed: {type(exc).__name__}: {exc}") from exc
        _check_model(header, codecs, templates)
    if header.token_count > matched and not header.trimmable:
        raise Miss("untrimmable", f"{header.token_count} tokens stored, {matched} matched")
    return codecs


def _loaded(
    header: EntryHeader,
    codecs: Sequence[Codec],
    fills: Sequence[Fill],
    filling: Filling,
    blocks: BlockReads | None,
) -> list[Any]:
    """The caches, their buffers allocated (in one call, as the codecs will ask for them)
    and handed to the fills (on reader threads); the cut tensors' rows in blocks are left
    to blocks.read_block."""
    slots = header.slots
    shapes = _whole_shapes(header, blocks)
    growing = [
        grows(codec)
        for codec, layer in zip(codecs, header.layers, strict=True)
        for _ in layer.slots
    ]
    targets = planned(
        [
            (shape, slot.dtype, grow)
            for shape, slot, grow in zip(shapes, slots, growing, strict=True)
        ]
    )
    sources = iter(
        TensorSource(
            filling.deferred(fill) if blocks is None else blocks.fill(i, filling.deferred(fill)),
            slot.dtype,
            shape,
            target,
        )
        for i, (slot, fill, shape, target) in enumerate(
            zip(slots, fills, shapes, targets, strict=True)
        )
    )
    return [
        codec.load(layer.meta, [next(sources) for _ in layer.slots])
        for codec, layer in zip(codecs, header.layers, strict=True)
    ]


def _trimmed(caches: list[Any], excess: int) -> list[Any]:
    with _as_miss():
        for cache in caches:
            if excess and cache.trim(excess) != excess:
                raise CodecError(f"a {type(cache).__name__} could not drop {excess} tokens")
        mx.eval([cache.state for cache in caches])
    return caches


@contextmanager
def _as_miss() -> Iterator[None]:
    """Anything a stored entry can provoke while loading is a miss, never a crash; damaged
    bytes (EntryFormatError) and misses go on as they are."""
    try:
        yield
    except (EntryFormatError, Miss):
        raise
    except OSError as exc:
        raise Miss("unreadable", str(exc)) from exc
    except Exception as exc:
        raise Miss("load failed", f"{type(exc).__name__}: {exc}") from exc


def _check_model(header: EntryHeader, codecs: Sequence[Codec], templates: list[Any]) -> None:
    if len(templates) != len(header.layers):
        raise Miss(
            "model", f"the model has {len(templates)} layers, the entry {len(header.layers)}"
        )
    for i, (codec, layer, template) in enumerate(
        zip(codecs, header.layers, templates, strict=True)
    ):
        try:
            problem = codec.check(layer.meta, template)
        except CodecError as exc:
            problem = str(exc)
        if problem is not None:
            raise Miss("model", f"layer {i}: {problem}")


def get(
    link: Link, identity: EngineIdentity, tokens: Sequence[int], *, model: Any, min_tokens: int = 0
) -> Call[Restored | None]:
    """The caches of the longest usable cached prefix of tokens, or None (a miss), also when
    it is shorter than min_tokens."""
    started = time.perf_counter()
    hit = yield from calls.lookup(link, identity.to_protocol(), tokens, min_tokens)
    return (yield from _restore(link, hit, model, started))


def get_checkpoint(
    link: Link, identity: EngineIdentity, key: str, prompt: Sequence[int], *, model: Any
) -> Call[Restored | None]:
    """The newest generation checkpoint under key that extends prompt, restored whole."""
    started = time.perf_counter()
    hit = yield from calls.find_checkpoint(link, identity.to_protocol(), key, prompt)
    return (yield from _restore(link, hit, model, started))


def _restore(
    link: Link, hit: LookupHit | None, model: Any, started: float
) -> Call[Restored | None]:
    """Decode a hit (the lookup counted a None), then close it and end its lease, telling the
    daemon how it went; a damaged entry is reported so."""
    if hit is None:
        return None
    restored = damage = None
    missed: str | None = None
    try:
        caches = yield from _decoded(link, hit, model)
    except EntryFormatError as exc:
        damage = exc
    except Miss as miss:
        link.stats.misses[miss.reason] += 1
        missed = miss.reason
        log.warning("restore of entry %s missed: %s", hit.summary.id, miss)
    else:
        link.stats.restored += 1
        header = hit.entry.header
        within = (
            header.block_hashes[: hit.matched // header.block_tokens] if header.block_hashes else ()
        )
        restored = Restored(
            caches,
            hit.matched,
            header.checkpoint,
            tuple(within),
            header.block_tokens,
            header.prefill_checkpoint,
        )
    finally:
        hit.entry.close()
    if damage is not None:
        rule = damage.rule.value
        yield from calls.reject(
            link, hit.lease, hit.epoch, rule, damage, damaged=True, started=started
        )
    else:
        nbytes, tokens = (0, 0) if restored is None else (hit.summary.bytes, hit.matched)
        report = calls.restore_report(missed, started, nbytes, tokens)
        # Sent, not waited for: the caches are whole, and the daemon ends the lease before it
        # takes this connection's next request.
        yield from calls.release_lease(link, hit.lease, hit.epoch, report=report, awaited=False)
    return restored


def _decoded(link: Link, hit: LookupHit, model: Any) -> Call[list[Any]]:
    """decode, and for a manifest listing blocks, its blocks read into the buffers once all
    are allocated, a block per read on the reader threads, each batch of descriptors asked
    for while the one before is read: a restore keeps at most two batches of them open
    whatever the entry's length."""
    header = hit.entry.header
    fills = hit.entry.fills(verify=link.verify)
    if not header.block_hashes:
        return decode(header, fills, hit.matched, model)
    codecs = _codecs(header, hit.matched, model)
    blocks = BlockReads(header, verify=link.verify, limits=link.limits)
    open_batches: list[tuple[int, ...]] = []  # the descriptors of each, oldest first
    reading: list[Reading] = []  # their reads
    try:
        with _as_miss(), _filling(header, blocks) as filling:
            for first in range(0, len(header.block_hashes), MAX_BLOCK_BATCH):
                if len(open_batches) == 2:
                    # Closed only once read: a failure, or the call closed at this yield
                    # (cancelled), leaves them to the finally, after Filling waited for them.
                    yield Blocking(reading[0].wait)
                    reading.pop(0)
                    _close(open_batches.pop(0))
                count = min(MAX_BLOCK_BATCH, len(header.block_hashes) - first)
                fds = yield from _open_blocks(link, hit, first, count)
                open_batches.append(fds)
                if not first:  # the first batch is had before anything is allocated
                    caches = _loaded(header, codecs, fills, filling, blocks)
                reads = [partial(blocks.read_block, first + k, fd) for k, fd in enumerate(fds)]
                reading.append(filling.started(reads))
    finally:  # once every read of them has ended (leaving Filling waits for them)
        for fds in open_batches:
            _close(fds)
    return _trimmed(caches, header.token_count - hit.matched)


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def _open_blocks(link: Link, hit: LookupHit, first: int, count: int) -> Call[tuple[int, ...]]:
    """calls.open_blocks, a daemon that cannot be asked or refuses being a miss."""
    try:
        return (yield from calls.open_blocks(link, hit, first, count))
    except DaemonUnavailableError as exc:
        raise Miss(calls.UNAVAILABLE, str(exc)) from exc
    except DaemonError as exc:
        raise Miss("refused", str(exc)) from exc
