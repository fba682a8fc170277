"""The entry file's layout planners: every offset and the file size, fixed before writing.

One file per cache entry, written once (FORMAT.md):

    prefix (48 bytes) | msgpack header | zero pad to data start | tensor slots, 16 KiB-aligned

Version 1 (plan_entry) holds every tensor whole. Version 2 (plan_manifest) is a manifest: the
token-axis rows of its blocked layers are cut into block files of block_tokens rows, named by
their chained hash (blocks.py), and the manifest keeps only the tail rows and the other layers.
A block file has the same shape: prefix, header, slots. The model the planners fill in (the
header, layers, slots) and the encoding of a head are entry_model.py's; this module re-exports
them, the names every writer and reader imports from here.

The planners fix every offset and the file size before any byte is written, because slot
checksums are fixed-width: a writer plans, sizes the file, streams each tensor to its offset
while checksumming it, and writes the head (prefix + header + pad) at offset 0 last.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from . import schema
from .blocks import ZERO_HASH, block_hashes
from .checksum import CHECKSUM_BYTES
from .dtypes import tensor_nbytes
from .entry_model import (
    ALIGNMENT,  # re-exported
    CHECKSUMMED_PREFIX_BYTES,  # re-exported
    FLAG_BLOCK,
    FORMAT_VERSION,
    INT_MAX,
    MAGIC,  # re-exported
    MANIFEST_VERSION,
    MAX_NDIM,
    PREFILL_CHECKPOINT_META,  # re-exported
    PREFIX,  # re-exported
    PREFIX_BYTES,
    TOKEN_AXIS,  # the axis plan_manifest cuts into blocks
    BlockHeader,
    Checkpoint,
    EntryHeader,
    Layer,
    LayerSpec,
    MetaValue,
    Slot,
    TensorSpec,
    align_up,
    check_checksums,
    check_created,
    check_entry_kind,
    encode_block_header,
    encode_head,
    encode_header,
    entry_meta,
    header_checksum,  # re-exported
    state_map,
)
from .identity import TRAITS_META, Identity
from .limits import DEFAULT_LIMITS, Limits
from .tokens import TOKEN_BYTES

__all__ = [
    "ALIGNMENT",
    "CHECKSUMMED_PREFIX_BYTES",
    "FLAG_BLOCK",
    "FORMAT_VERSION",
    "MAGIC",
    "MANIFEST_VERSION",
    "MAX_NDIM",
    "PREFILL_CHECKPOINT_META",
    "PREFIX",
    "PREFIX_BYTES",
    "TOKEN_AXIS",
    "BlockHeader",
    "Checkpoint",
    "EntryHeader",
    "EntryPlan",
    "Layer",
    "LayerSpec",
    "ManifestPlan",
    "MetaValue",
    "Slot",
    "TensorSpec",
    "align_up",
    "check_created",
    "encode_block_header",
    "encode_header",
    "entry_meta",
    "header_checksum",
    "plan_entry",
    "plan_manifest",
    "state_map",
    "with_rows",
]

_ZERO_CHECKSUM: Final = bytes(CHECKSUM_BYTES)


@dataclass(frozen=True)
class EntryPlan:
    """A file's layout, fixed before any byte is written; checksums are zero until finish()."""

    header: EntryHeader
    header_length: int

    @property
    def file_size(self) -> int:
        return self.header.file_size

    @property
    def data_start(self) -> int:
        return self.header.data_start

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.header.slots

    def finish(self, checksums: Sequence[bytes]) -> EntryHeader:
        """The header with each slot's checksum filled in, in slot order."""
        check_checksums(checksums, len(self.slots))
        sums = iter(checksums)
        layers = tuple(
            Layer(
                layer.kind,
                layer.meta,
                layer.trimmable,
                _placed(layer.slots, sums, 0),
                layer.blocked,
            )
            for layer in self.header.layers
        )
        return replace(self.header, layers=layers)

    def head(self, checksums: Sequence[bytes]) -> bytes:
        """The bytes for offset 0 once the tensors are written: prefix, header, zero pad."""
        header = self.finish(checksums)
        header_bytes = encode_header(header)
        # Fixed-width checksums keep the header's length, so the planned offsets still hold.
        assert len(header_bytes) == self.header_length, "header length drifted"
        return encode_head(header_bytes, header.data_start, header.file_size, header.version)


def _placed(
    slots: tuple[Slot, ...], checksums: Iterator[bytes], data_start: int
) -> tuple[Slot, ...]:
    """The slots with the next checksums, moved by data_start (built directly: this is hot)."""
    return tuple(
        Slot(s.dtype, s.shape, s.offset, s.nbytes, next(checksums), s.start + data_start)
        for s in slots
    )


def plan_entry(
    identity: Identity,
    tokens: bytes,
    layers: Sequence[LayerSpec],
    *,
    created: float,
    min_reuse: int,
    checkpoint: Checkpoint | None = None,
    meta: Mapping[str, MetaValue] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> EntryPlan:
    """Lay out a version 1 entry (every tensor whole; LayerSpec.blocked is not looked at);
    raises ValueError for anything a reader would reject."""
    return _plan(
        identity,
        tokens,
        layers,
        None,
        created=created,
        min_reuse=min_reuse,
        checkpoint=checkpoint,
        meta=meta,
        limits=limits,
    )


def _plan(
    identity: Identity,
    tokens: bytes,
    layers: Sequence[LayerSpec],
    block_tokens: int | None,
    *,
    created: float,
    min_reuse: int,
    checkpoint: Checkpoint | None,
    meta: Mapping[str, MetaValue] | None,
    limits: Limits,
) -> EntryPlan:
    """The plan of a version 1 entry (block_tokens None) or of a version 2 manifest whose
    blocked layers keep the rows past the whole blocks of block_tokens (0: none)."""
    _check_entry(
        identity, tokens, layers, min_reuse=min_reuse, checkpoint=checkpoint, limits=limits
    )
    hashes: tuple[bytes, ...] = ()
    if block_tokens is None:
        version, shapes = FORMAT_VERSION, [tuple(t.shape for t in spec.tensors) for spec in layers]
    else:
        hashes = block_hashes(tokens, block_tokens) if block_tokens else ()
        version, shapes = MANIFEST_VERSION, _manifest_shapes(layers, tokens, block_tokens)
    draft = _draft(
        identity,
        tokens,
        layers,
        shapes,
        created=created,
        min_reuse=min_reuse,
        checkpoint=checkpoint,
        meta=meta,
        limits=limits,
        block_tokens=block_tokens or 0,
        block_hashes=hashes,
        version=version,
    )
    return _placed_plan(draft, limits)


def _check_entry(
    identity: Identity,
    tokens: bytes,
    layers: Sequence[LayerSpec],
    *,
    min_reuse: int,
    checkpoint: Checkpoint | None,
    limits: Limits,
) -> None:
    if len(tokens) % TOKEN_BYTES or len(tokens) // TOKEN_BYTES > limits.max_tokens:
        raise ValueError(f"tokens: {len(tokens)} bytes is not a packed sequence within limits")
    if not 0 <= min_reuse <= len(tokens) // TOKEN_BYTES:
        raise ValueError(f"min_reuse {min_reuse} outside 0..token count")
    Identity.from_wire(identity.to_wire(), limits)  # the reader's checks, as early as possible
    if checkpoint is not None:
        Checkpoint.from_wire(checkpoint.to_wire(), limits)
    if len(layers) > limits.max_layers:
        raise ValueError(f"{len(layers)} layers, over the limit of {limits.max_layers}")
    if sum(len(spec.tensors) for spec in layers) > limits.max_slots:
        raise ValueError(f"more than {limits.max_slots} tensors")


def _slots(
    specs: Sequence[TensorSpec], shapes: Sequence[tuple[int, ...]], cursor: int, what: str
) -> tuple[tuple[Slot, ...], int]:
    """Slots of the given dtypes and shapes placed from cursor (relative to data start), each
    at the next aligned offset, and the cursor after them."""
    slots: list[Slot] = []
    for tensor, shape in zip(specs, shapes, strict=True):
        if len(shape) > MAX_NDIM:
            raise ValueError(f"{what}: more than {MAX_NDIM} dimensions")
        offset = align_up(cursor)
        nbytes = tensor_nbytes(tensor.dtype, shape)
        slots.append(Slot(tensor.dtype, tuple(shape), offset, nbytes, _ZERO_CHECKSUM, offset))
        cursor = offset + nbytes
    return tuple(slots), cursor


def _with_traits(identity: Identity, meta: Mapping[str, MetaValue] | None) -> dict[str, MetaValue]:
    """meta with the identity's traits, which the header keeps there (its identity map holds
    the fields a reader of any version knows)."""
    found = {} if meta is None else dict(meta)
    if identity.traits:
        found[TRAITS_META] = identity.traits
    return found


def _draft(
    identity: Identity,
    tokens: bytes,
    layers: Sequence[LayerSpec],
    shapes: Sequence[tuple[tuple[int, ...], ...]],
    *,
    created: float,
    min_reuse: int,
    checkpoint: Checkpoint | None,
    meta: Mapping[str, MetaValue] | None,
    limits: Limits,
    version: int = FORMAT_VERSION,
    block_tokens: int = 0,
    block_hashes: tuple[bytes, ...] = (),
) -> EntryHeader:
    """The header of an entry holding tensors of these shapes, slots relative to data start
    and unchecksummed; data_start is still 0 and file_size the data's size."""
    cursor = 0
    planned: list[Layer] = []
    for i, (spec, layer_shapes) in enumerate(zip(layers, shapes, strict=True)):
        what = f"layers[{i}]"
        schema.text(spec.kind, f"{what}.kind", limits.max_name_bytes)
        slots, cursor = _slots(spec.tensors, layer_shapes, cursor, what)
        state = state_map(spec.meta, f"{what}.meta")
        blocked = spec.blocked and version >= MANIFEST_VERSION
        planned.append(Layer(spec.kind, state, spec.trimmable, slots, blocked))
    checked_meta = entry_meta(_with_traits(identity, meta), limits)
    check_entry_kind(checked_meta, checkpoint is not None)
    return EntryHeader(
        identity=identity,
        tokens=tokens,
        created=check_created(created),
        min_reuse=min_reuse,
        layers=tuple(planned),
        checkpoint=checkpoint,
        meta=checked_meta,
        data_start=0,
        file_size=align_up(cursor),  # the data's size, until placed
        block_tokens=block_tokens,
        block_hashes=block_hashes,
        version=version,
    )


def _placed_plan(draft: EntryHeader, limits: Limits) -> EntryPlan:
    """The draft's plan: its header's length fixes data start, and every slot moves by it."""
    header_length = len(encode_header(draft))
    if header_length > limits.max_header_bytes:
        raise ValueError(f"header of {header_length} bytes, over the limit")
    data_start = align_up(PREFIX_BYTES + header_length)
    zeros = itertools.repeat(_ZERO_CHECKSUM)
    placed = tuple(
        Layer(
            layer.kind,
            layer.meta,
            layer.trimmable,
            _placed(layer.slots, zeros, data_start),
            layer.blocked,
        )
        for layer in draft.layers
    )
    file_size = data_start + draft.file_size
    if file_size > INT_MAX:
        raise ValueError(f"file size {file_size} does not fit in 64 bits")
    header = replace(draft, layers=placed, data_start=data_start, file_size=file_size)
    return EntryPlan(header, header_length)


# --- version 2: manifests and blocks --------------------------------------------------------


@dataclass(frozen=True)
class ManifestPlan:
    """A version 2 entry's layout: the manifest file (entry) and its blocks' files, all of
    one layout (block_size bytes, block_slots), fixed before any byte is written."""

    entry: EntryPlan  # the manifest: tails of the blocked layers, the other layers whole
    hashes: tuple[bytes, ...]  # of blocks 0..n-1
    blocked_tensors: tuple[int, ...]  # indexes into the flat tensor list: the tensors cut
    block_layers: tuple[tuple[Slot, ...], ...]  # a block file's slots, per blocked layer
    block_size: int  # every block file's exact size; 0 when there are no blocks
    block_header_length: int

    @property
    def block_tokens(self) -> int:
        return self.entry.header.block_tokens

    @property
    def block_slots(self) -> tuple[Slot, ...]:
        """A block file's slots (absolute start, nbytes), blocked layer by layer."""
        return tuple(slot for layer in self.block_layers for slot in layer)

    def block_header(self, index: int, checksums: Sequence[bytes]) -> BlockHeader:
        """Block index's header, with each of its slot's checksum filled in, in slot order."""
        if not 0 <= index < len(self.hashes):
            raise ValueError(f"block {index} of {len(self.hashes)}")
        check_checksums(checksums, len(self.block_slots))
        step = self.block_tokens * TOKEN_BYTES
        header = self.entry.header
        sums = iter(checksums)
        return BlockHeader(
            hash=self.hashes[index],
            digest=header.identity.digest(),
            parent=self.hashes[index - 1] if index else ZERO_HASH,
            tokens=header.tokens[index * step : (index + 1) * step],
            layers=tuple(_placed(slots, sums, 0) for slots in self.block_layers),
            data_start=align_up(PREFIX_BYTES + self.block_header_length),
            file_size=self.block_size,
        )

    def block_head(self, index: int, checksums: Sequence[bytes]) -> bytes:
        """The bytes for offset 0 of block index's file once its tensors are written."""
        block = self.block_header(index, checksums)
        header_bytes = encode_block_header(block)
        assert len(header_bytes) == self.block_header_length, "block header length drifted"
        return encode_head(
            header_bytes, block.data_start, block.file_size, MANIFEST_VERSION, FLAG_BLOCK
        )


def plan_manifest(
    identity: Identity,
    tokens: bytes,
    layers: Sequence[LayerSpec],
    *,
    block_tokens: int,
    created: float,
    min_reuse: int,
    checkpoint: Checkpoint | None = None,
    meta: Mapping[str, MetaValue] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> ManifestPlan:
    """Lay out a version 2 entry: the rows [i*B, (i+1)*B) of the blocked layers' tensors
    (axis 2) go to block i, for the n = T // B whole blocks; the manifest holds the tail rows
    [n*B, T) and every other layer whole. block_tokens 0, or no blocked layer, plans a
    manifest without blocks. Raises ValueError for anything a reader would reject."""
    if not any(spec.blocked for spec in layers):
        block_tokens = 0
    entry = _plan(
        identity,
        tokens,
        layers,
        block_tokens,
        created=created,
        min_reuse=min_reuse,
        checkpoint=checkpoint,
        meta=meta,
        limits=limits,
    )
    hashes = entry.header.block_hashes
    blocked = [spec for spec in layers if spec.blocked]
    flat = [spec.blocked for spec in layers for _ in spec.tensors]
    return _block_plan(entry, hashes, blocked, [i for i, cut in enumerate(flat) if cut])


def with_rows(shape: Sequence[int], rows: int) -> tuple[int, ...]:
    """shape with rows on the token axis: a cut tensor's whole shape from its tail (or
    block) slot's, and back."""
    return (*shape[:TOKEN_AXIS], rows, *shape[TOKEN_AXIS + 1 :])


def _manifest_shapes(
    layers: Sequence[LayerSpec], tokens: bytes, block_tokens: int
) -> list[tuple[tuple[int, ...], ...]]:
    """Each layer's tensor shapes in a manifest: a blocked layer's the rows past the whole
    blocks of block_tokens (0: all of them), which its tensors must have on the token axis."""
    count = len(tokens) // TOKEN_BYTES
    tail = count % block_tokens if block_tokens else count
    shapes: list[tuple[tuple[int, ...], ...]] = []
    for i, spec in enumerate(layers):
        if not spec.blocked:
            shapes.append(tuple(tensor.shape for tensor in spec.tensors))
            continue
        for tensor in spec.tensors:
            if len(tensor.shape) <= TOKEN_AXIS or tensor.shape[TOKEN_AXIS] != count:
                raise ValueError(
                    f"layers[{i}]: a blocked tensor of shape {list(tensor.shape)} does not "
                    f"have the {count} tokens on axis {TOKEN_AXIS}"
                )
        shapes.append(tuple(with_rows(tensor.shape, tail) for tensor in spec.tensors))
    return shapes


def _block_plan(
    entry: EntryPlan,
    hashes: tuple[bytes, ...],
    blocked: Sequence[LayerSpec],
    blocked_tensors: Sequence[int],
) -> ManifestPlan:
    """The manifest's plan with its block files' layout (the same for every block)."""
    if not hashes:
        return ManifestPlan(entry, (), tuple(blocked_tensors), (), 0, 0)
    block_tokens = entry.header.block_tokens
    cursor = 0
    relative: list[tuple[Slot, ...]] = []
    for i, spec in enumerate(blocked):
        shapes = [with_rows(tensor.shape, block_tokens) for tensor in spec.tensors]
        slots, cursor = _slots(spec.tensors, shapes, cursor, f"blocked layer {i}")
        relative.append(slots)
    draft = BlockHeader(
        hash=hashes[0],
        digest=entry.header.identity.digest(),
        parent=ZERO_HASH,
        tokens=entry.header.tokens[: block_tokens * TOKEN_BYTES],
        layers=tuple(relative),
        data_start=0,
        file_size=0,
    )
    # Within the limit: the manifest's header holds all of this (its tokens, its slots) and more.
    header_length = len(encode_block_header(draft))
    data_start = align_up(PREFIX_BYTES + header_length)
    zeros = itertools.repeat(_ZERO_CHECKSUM)
    placed = tuple(_placed(slots, zeros, data_start) for slots in relative)
    block_size = data_start + align_up(cursor)
    return ManifestPlan(entry, hashes, tuple(blocked_tensors), placed, block_size, header_length)
