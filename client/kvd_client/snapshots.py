"""Snapshots of an engine's caches for the cold tier, copying only what is new.

A snapshot is taken on the engine's thread and written later by another while the engine
decodes on, so what it hands over must be copies (prompt_cache.encode, copy). Against a
daemon that keeps blocks, most rows of a conversation's next turn are in blocks already: the
daemon's, or those of an earlier snapshot still waiting to be sent. A Memo (one per cold
tier) knows which, by block chain hash (kvd_protocol.blocks): the blocks the daemon holds (a
put of them committed, or a restore read them) and the block copies of the snapshots not
sent yet. A snapshot cut into blocks then copies the rest only: each new block's rows of
every cut tensor into an array of its own (exactly the bytes of that block's slot), the tail
rows into one, and the tensors not cut whole. It leaves out the leading blocks the daemon
holds and shares the copies another snapshot made. A put whose daemon holds fewer of them
(evicted meanwhile) is aborted (block_io.BlocksNotHeld) and the memo forgets those blocks,
so the next snapshot copies them again.

Against a daemon without blocks, or for fewer tokens than a block, a snapshot is the whole
copy it always was. Planning (plan) and copying (take) are apart so that the backlog can
decide from a plan's size whether it is worth the copy.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import mlx.core as mx
from kvd_protocol.blocks import block_hashes
from kvd_protocol.entry import (
    PREFILL_CHECKPOINT_META,
    TOKEN_AXIS,
    LayerSpec,
    MetaValue,
    TensorSpec,
    with_rows,
)
from kvd_protocol.tokens import pack_tokens

from .backlog import Kind
from .block_io import CutCopy
from .codecs import CodecError, tensor_pieces
from .entry_io import TensorData
from .prompt_cache import entry_meta, snapshot_layers

# Block hashes the memo remembers as held by the daemon: 16,384 blocks are 4M tokens of
# 256, more than a tier holds for one model in a day; about 2 MiB.
MEMO_BLOCKS: Final = 16384
# The entry meta that marks a kind for the daemon.
_KIND_META: Final[Mapping[Kind, Mapping[str, MetaValue]]] = {
    Kind.PREFILL_CHECKPOINT: {PREFILL_CHECKPOINT_META: True}
}


@dataclass(eq=False)
class BlockCopy:
    """One block's rows of every cut tensor of a snapshot, in tensor order: each the bytes
    of its block slot, in a buffer of its own."""

    rows: tuple[memoryview, ...]
    nbytes: int


class Memo:
    """Which blocks of one identity need no copy: those the daemon holds (the most recently
    used MEMO_BLOCKS of them), and the copies that snapshots not yet sent hold (for as long
    as one holds them). Not thread-safe: its cold tier uses it under its lock."""

    def __init__(self, capacity: int = MEMO_BLOCKS) -> None:
        self._capacity = capacity
        self._held: OrderedDict[bytes, None] = OrderedDict()
        self._copies: weakref.WeakValueDictionary[bytes, BlockCopy] = weakref.WeakValueDictionary()

    def count_held(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of hashes the daemon holds, as far as the memo knows."""
        count = 0
        while count < len(hashes) and hashes[count] in self._held:
            count += 1
        self._touch(hashes[:count])
        return count

    def copy_of(self, block: bytes) -> BlockCopy | None:
        return self._copies.get(block)

    def copied(self, copies: Mapping[bytes, BlockCopy]) -> None:
        self._copies.update(copies)

    def mark_held(self, hashes: Sequence[bytes]) -> None:
        """The daemon holds these blocks (a chain's leading ones)."""
        self._touch(hashes)
        while len(self._held) > self._capacity:
            self._held.popitem(last=False)

    def forget(self, hashes: Iterable[bytes]) -> None:
        """The daemon no longer holds these blocks."""
        for block in hashes:
            self._held.pop(block, None)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        # The first block of a chain last: the least recently used go first, and a chain's
        # deepest blocks before its first ones, so what stays is a leading prefix.
        for block in reversed(hashes):
            self._held[block] = None
            self._held.move_to_end(block)


@dataclass(eq=False)
class Plan:
    """A snapshot decided but not copied: what store() weighs before it copies."""

    tokens: list[int]
    kind: Kind
    layers: list[LayerSpec]
    arrays: list[Any]  # each layer's tensors (views of the caches' buffers), flat
    block_tokens: int  # 0: not cut into blocks
    hashes: tuple[bytes, ...]
    held_blocks: int  # leading blocks the daemon holds: left out
    shared: dict[int, BlockCopy]  # block index -> a copy another snapshot made
    block_bytes: int  # a new block's copy
    private_bytes: int  # the tail rows and the tensors not cut

    @property
    def trimmable(self) -> bool:
        """Whether its entry serves shorter prefixes: the daemon never trims a prefill
        checkpoint, whatever its layers."""
        return self.kind is not Kind.PREFILL_CHECKPOINT and all(
            layer.trimmable for layer in self.layers
        )

    @property
    def new(self) -> list[int]:
        """The blocks to copy."""
        return [i for i in range(self.held_blocks, len(self.hashes)) if i not in self.shared]

    @property
    def nbytes(self) -> int:
        """What the snapshot copies."""
        return self.private_bytes + len(self.new) * self.block_bytes

    def bytes_by_owner(self) -> dict[object, int]:
        """The memory it will hold, by owner: shared copies counted once across snapshots."""
        owned: dict[object, int] = {copy: copy.nbytes for copy in self.shared.values()}
        owned.update({(self, i): self.block_bytes for i in self.new})
        owned[self] = self.private_bytes
        return owned


@dataclass(eq=False)
class Snapshot:
    """Copies of the caches holding tokens, ready to put: tensors are byte views of them,
    a cut tensor a CutCopy."""

    tokens: list[int]
    kind: Kind
    trimmable: bool
    layers: list[LayerSpec]
    tensors: list[TensorData]
    meta: dict[str, MetaValue]
    hashes: tuple[bytes, ...]
    copies: dict[bytes, BlockCopy]  # by hash: the block copies it holds, own or shared
    private_bytes: int
    copied: int  # bytes copied for it

    def bytes_by_owner(self) -> dict[object, int]:
        owned: dict[object, int] = {copy: copy.nbytes for copy in self.copies.values()}
        owned[self] = self.private_bytes
        return owned


def plan(
    memo: Memo,
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    block_tokens: int,
    kind: Kind = Kind.TURN,
) -> Plan | None:
    """What a snapshot of cache (holding exactly tokens) copies, the memo consulted (under
    its owner's lock); raises CodecError. block_tokens: the daemon's blocks (0: none).

    A segment (a prefix the engine cut on the way to a longer entry, of caches that all cut
    by token, hence always trim) is cut at its last whole block: the entry the turn ends with
    serves every shorter prefix by trimming, and shares these blocks; None when not even a
    block is left."""
    layers, arrays = snapshot_layers(cache, len(tokens))
    count = len(tokens)
    if kind is Kind.SEGMENT and block_tokens and layers and all(layer.blocked for layer in layers):
        count -= count % block_tokens
        if not count:
            return None
        layers, arrays = _prefix(layers, arrays, count)
    cut = [layer.blocked for layer in layers for _ in layer.tensors]
    whole = sum(_nbytes(a) for a in arrays)
    if not (block_tokens and count >= block_tokens and any(cut)):
        return Plan(list(tokens[:count]), kind, layers, arrays, 0, (), 0, {}, 0, whole)
    hashes = block_hashes(pack_tokens(tokens[:count]), block_tokens)
    held_blocks = memo.count_held(hashes)
    shared = {
        i: copy
        for i in range(held_blocks, len(hashes))
        if (copy := memo.copy_of(hashes[i])) is not None
    }
    cut_bytes = sum(_nbytes(a) for a, blocked in zip(arrays, cut, strict=True) if blocked)
    block_bytes = cut_bytes // count * block_tokens
    tail_bytes = cut_bytes - len(hashes) * block_bytes
    return Plan(
        list(tokens[:count]),
        kind,
        layers,
        arrays,
        block_tokens,
        hashes,
        held_blocks,
        shared,
        block_bytes,
        whole - cut_bytes + tail_bytes,
    )


def take(plan: Plan) -> Snapshot:
    """The copies a plan decided on: the one MLX work of a snapshot (on the engine's thread).
    The caller hands the snapshot's copies to the memo (Snapshot.copies)."""
    step = plan.block_tokens
    cut = [step > 0 and layer.blocked for layer in plan.layers for _ in layer.tensors]
    whole = [mx.array(a) for a, c in zip(plan.arrays, cut, strict=True) if not c]
    cut_arrays = [a for a, c in zip(plan.arrays, cut, strict=True) if c]
    new = {i: [mx.array(_rows(a, i * step, (i + 1) * step)) for a in cut_arrays] for i in plan.new}
    tail_start = len(plan.hashes) * step
    tails = [mx.array(_rows(a, tail_start, len(plan.tokens))) for a in cut_arrays]
    mx.eval([*whole, *tails, *(a for rows in new.values() for a in rows)])
    copies = dict(plan.shared)
    for i, rows in new.items():
        views = tuple(_bytes_of(a) for a in rows)
        copies[i] = BlockCopy(views, sum(view.nbytes for view in views))
    wholes, cuts = iter(whole), enumerate(zip(cut_arrays, tails, strict=True))
    tensors: list[TensorData] = []
    for c in cut:
        if not c:
            tensors.append(tensor_pieces(next(wholes)))
            continue
        k, (array, tail) = next(cuts)
        blocks = [
            None if i < plan.held_blocks else copies[i].rows[k] for i in range(len(plan.hashes))
        ]
        tensors.append(CutCopy(math.prod(array.shape[:TOKEN_AXIS]), blocks, _bytes_of(tail)))
    return Snapshot(
        plan.tokens,
        plan.kind,
        plan.trimmable,
        plan.layers,
        tensors,
        entry_meta(_KIND_META.get(plan.kind)),
        plan.hashes,
        {plan.hashes[i]: copy for i, copy in copies.items()},
        plan.private_bytes,
        plan.nbytes,
    )


def _prefix(
    layers: Sequence[LayerSpec], arrays: Sequence[Any], count: int
) -> tuple[list[LayerSpec], list[Any]]:
    """Layers cut by token (all of them) as the caches of their first count tokens: their
    tensors' first rows, their meta's offset count (codecs.Codec.blocked)."""
    prefixed = [
        dataclasses.replace(
            layer,
            tensors=tuple(TensorSpec(t.dtype, with_rows(t.shape, count)) for t in layer.tensors),
            meta={**layer.meta, "offset": count},
        )
        for layer in layers
    ]
    return prefixed, [_rows(a, 0, count) for a in arrays]


def _rows(array: Any, start: int, stop: int) -> Any:
    return array[(slice(None),) * TOKEN_AXIS + (slice(start, stop),)]


def _nbytes(array: Any) -> int:
    return int(array.nbytes)


def _bytes_of(array: mx.array) -> memoryview:
    """The bytes of a copy (contiguous: one view of its buffer)."""
    pieces = tensor_pieces(array)
    if len(pieces) > 1:
        raise CodecError(f"a copy of shape {list(array.shape)} is not contiguous")
    return pieces[0] if pieces else memoryview(b"")
