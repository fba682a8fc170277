"""The entry file: its header model, the layout planners and the encoding of its head.

One file per cache entry, written once (FORMAT.md):

    prefix (48 bytes) | msgpack header | zero pad to data start | tensor slots, 16 KiB-aligned

Version 1 (plan_entry) holds every tensor whole. Version 2 (plan_manifest) is a manifest: the
token-axis rows of its blocked layers are cut into block files of block_tokens rows, named by
their chained hash (blocks.py), and the manifest keeps only the tail rows and the other layers.
A block file has the same shape: prefix, header, slots.

The planners fix every offset and the file size before any byte is written, because slot
checksums are fixed-width: a writer plans, sizes the file, streams each tensor to its offset
while checksumming it, and writes the head (prefix + header + pad) at offset 0 last.
"""

from __future__ import annotations

import itertools
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeAlias

import msgpack

from . import schema
from .blocks import ZERO_HASH, block_hashes, check_block_tokens
from .checksum import CHECKSUM_BYTES, new_checksum
from .dtypes import tensor_nbytes
from .identity import Identity
from .limits import DEFAULT_LIMITS, Limits
from .tokens import TOKEN_BYTES

MAGIC: Final = b"\x89KVD\r\n\x1a\n"  # PNG-style: catches 7-bit and newline-mangling transfers
FORMAT_VERSION: Final = 1  # every tensor whole in the entry file
MANIFEST_VERSION: Final = 2  # manifests and their block files
FLAG_BLOCK: Final = 1  # prefix flags bit 0, version 2: a block file, not a manifest
TOKEN_AXIS: Final = 2  # of a blocked layer's tensors: [batch, heads, tokens, ...]
ALIGNMENT: Final = 16384  # the arm64 page size: every slot can be mapped and adopted by MLX

# magic, version, flags, header length, data start, file size, reserved, header checksum.
PREFIX: Final = struct.Struct("<8sHHIQQ8s8s")
PREFIX_BYTES: Final = PREFIX.size  # 48
CHECKSUMMED_PREFIX_BYTES: Final = PREFIX_BYTES - CHECKSUM_BYTES  # all of it but the checksum

META_MAX_DEPTH: Final = 8  # nesting of maps and lists in a layer's meta, the meta map included
META_MAX_ITEMS: Final = 256  # entries in the entry-level meta map
MAX_NDIM: Final = 32  # dimensions of one tensor

_INT_MIN: Final = -(1 << 63)  # the integers msgpack can carry
_INT_MAX: Final = (1 << 64) - 1
_FLOAT_MAX: Final = sys.float_info.max
_ZERO_CHECKSUM: Final = bytes(CHECKSUM_BYTES)

# A layer's kind-specific state (ring index, quantization bits, ...); lists decode as tuples.
StateValue: TypeAlias = (
    bool | int | float | str | bytes | tuple["StateValue", ...] | Mapping[str, "StateValue"] | None
)
MetaValue: TypeAlias = str | int | float | bool  # entry-level engine metadata


def align_up(n: int) -> int:
    """The smallest multiple of ALIGNMENT that is >= n."""
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Slot:
    """One tensor's bytes: offset is relative to data start (as stored), start is absolute."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: bytes
    start: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class Layer:
    """One cache layer as the engine's codec recorded it."""

    kind: str
    meta: Mapping[str, StateValue]
    trimmable: bool  # the codec's word on whether this layer can be cut to a shorter prefix
    slots: tuple[Slot, ...]
    blocked: bool = False  # version 2: its slots hold the tail rows, its blocks the rest


@dataclass(frozen=True)
class Checkpoint:
    """Where an interrupted generation stands, so it can resume from this entry."""

    key: str
    pending_token: int
    seed: int
    seed_explicit: bool
    prompt_tokens: int
    generated_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "pending_token": self.pending_token,
            "seed": self.seed,
            "seed_explicit": self.seed_explicit,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
        }

    @classmethod
    def from_wire(cls, obj: object, limits: Limits = DEFAULT_LIMITS) -> Checkpoint:
        """Strictly decode; raises schema.SchemaError."""
        raw = schema.fields(obj, "checkpoint", set(cls.__dataclass_fields__))
        return cls(
            key=schema.text(raw["key"], "checkpoint.key", limits.max_name_bytes),
            pending_token=schema.integer(
                raw["pending_token"], "checkpoint.pending_token", hi=(1 << 32) - 1
            ),
            seed=schema.integer(raw["seed"], "checkpoint.seed"),
            seed_explicit=schema.boolean(raw["seed_explicit"], "checkpoint.seed_explicit"),
            prompt_tokens=schema.integer(raw["prompt_tokens"], "checkpoint.prompt_tokens"),
            generated_tokens=schema.integer(raw["generated_tokens"], "checkpoint.generated_tokens"),
        )


@dataclass(frozen=True)
class EntryHeader:
    """A parsed (or planned) entry header, with the layout facts of its file."""

    identity: Identity
    tokens: bytes  # packed little-endian u32 (tokens.py)
    created: float  # unix seconds
    min_reuse: int  # the shortest prefix this entry may be trimmed to
    layers: tuple[Layer, ...]
    checkpoint: Checkpoint | None
    meta: Mapping[str, MetaValue]
    data_start: int
    file_size: int
    block_tokens: int = 0  # version 2: tokens per block; 0 when it has no blocks
    blocks: tuple[bytes, ...] = ()  # version 2: the hashes of its token_count // block_tokens
    version: int = FORMAT_VERSION

    @property
    def token_count(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def trimmable(self) -> bool:
        """True iff every layer can be cut to a shorter prefix."""
        return all(layer.trimmable for layer in self.layers)

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Every slot, layer by layer, in header order."""
        return tuple(slot for layer in self.layers for slot in layer.slots)


@dataclass(frozen=True)
class TensorSpec:
    """What a writer knows of a tensor before writing it."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerSpec:
    """A layer to plan: its codec's kind, state and trimmability, and its tensors in order."""

    kind: str
    tensors: tuple[TensorSpec, ...]
    trimmable: bool
    meta: Mapping[str, object] = field(default_factory=dict)  # checked and frozen by the planner
    # Its tensors grow by token (axis 2): plan_manifest cuts them into blocks. The specs are
    # the whole tensors, axis 2 = the token count.
    blocked: bool = False


def state_map(value: object, what: str, depth: int = 1) -> dict[str, StateValue]:
    """Check a layer's state map (raises schema.SchemaError); lists come back as tuples."""
    if depth > META_MAX_DEPTH:
        raise schema.SchemaError(f"{what}: nested deeper than {META_MAX_DEPTH}")
    if not isinstance(value, Mapping):
        raise schema.SchemaError(f"{what}: expected a map, got {type(value).__name__}")
    out: dict[str, StateValue] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise schema.SchemaError(f"{what}: map keys must be strings")
        out[key] = _state_value(item, what, depth)
    return out


def _state_value(value: object, what: str, depth: int) -> StateValue:
    if value is None or isinstance(value, bool | float | str | bytes):
        return value
    if isinstance(value, int):
        return schema.integer(value, what, _INT_MIN, _INT_MAX)
    if isinstance(value, list | tuple):
        if depth + 1 > META_MAX_DEPTH:
            raise schema.SchemaError(f"{what}: nested deeper than {META_MAX_DEPTH}")
        return tuple(_state_value(item, what, depth + 1) for item in value)
    if isinstance(value, Mapping):
        return state_map(value, what, depth + 1)
    raise schema.SchemaError(f"{what}: unsupported value type {type(value).__name__}")


def entry_meta(value: object, limits: Limits = DEFAULT_LIMITS) -> dict[str, MetaValue]:
    """Check the entry-level meta map (raises schema.SchemaError)."""
    if not isinstance(value, Mapping):
        raise schema.SchemaError(f"meta: expected a map, got {type(value).__name__}")
    if len(value) > META_MAX_ITEMS:
        raise schema.SchemaError(f"meta: {len(value)} items, over the limit of {META_MAX_ITEMS}")
    out: dict[str, MetaValue] = {}
    for key, item in value.items():
        schema.text(key, "meta key", limits.max_name_bytes)
        if isinstance(item, bool | float | str):
            out[key] = item
        elif isinstance(item, int):
            out[key] = schema.integer(item, f"meta.{key}", _INT_MIN, _INT_MAX)
        else:
            raise schema.SchemaError(f"meta.{key}: unsupported value type {type(item).__name__}")
    return out


def check_created(value: object) -> float:
    """Creation time in unix seconds: finite and non-negative (raises schema.SchemaError)."""
    return schema.number(value, "created", 0.0, _FLOAT_MAX)


def _slot_maps(slots: Sequence[Slot]) -> list[dict[str, Any]]:
    return [
        {
            "dtype": slot.dtype,
            "shape": slot.shape,
            "offset": slot.offset,
            "nbytes": slot.nbytes,
            "checksum": slot.checksum,
        }
        for slot in slots
    ]


def _layer_map(layer: Layer, version: int) -> dict[str, Any]:
    found = {
        "kind": layer.kind,
        "meta": layer.meta,
        "trimmable": layer.trimmable,
        "slots": _slot_maps(layer.slots),
    }
    if version >= MANIFEST_VERSION:
        found["blocked"] = layer.blocked
    return found


def _header_map(header: EntryHeader) -> dict[str, Any]:
    found = {
        "identity": header.identity.to_wire(),
        "tokens": header.tokens,
        "created": header.created,
        "min_reuse": header.min_reuse,
        "layers": [_layer_map(layer, header.version) for layer in header.layers],
        "checkpoint": None if header.checkpoint is None else header.checkpoint.to_wire(),
        "meta": header.meta,
    }
    if header.version >= MANIFEST_VERSION:
        found["block_tokens"] = header.block_tokens
        found["blocks"] = b"".join(header.blocks)
    return found


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def encode_header(header: EntryHeader) -> bytes:
    """The msgpack header bytes; floats are always float64, checksums always 8-byte bin."""
    return _pack(_header_map(header))


def header_checksum(covered_prefix: bytes | memoryview, header: bytes | memoryview) -> bytes:
    """The header checksum: over the prefix up to its checksum field, then the header."""
    hasher = new_checksum()
    hasher.update(covered_prefix)
    hasher.update(header)
    return hasher.digest()


def _head(
    header_bytes: bytes, data_start: int, file_size: int, version: int, flags: int = 0
) -> bytes:
    if data_start != align_up(PREFIX_BYTES + len(header_bytes)):
        raise ValueError("data start does not match the encoded header's length")
    covered = PREFIX.pack(
        MAGIC, version, flags, len(header_bytes), data_start, file_size, b"", b""
    )[:CHECKSUMMED_PREFIX_BYTES]
    pad = bytes(data_start - PREFIX_BYTES - len(header_bytes))
    return b"".join((covered, header_checksum(covered, header_bytes), header_bytes, pad))


def _checked_checksums(checksums: Sequence[bytes], count: int) -> None:
    if len(checksums) != count:
        raise ValueError(f"{len(checksums)} checksums for {count} slots")
    if any(not isinstance(c, bytes) or len(c) != CHECKSUM_BYTES for c in checksums):
        raise ValueError(f"every checksum must be {CHECKSUM_BYTES} bytes")


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
        _checked_checksums(checksums, len(self.slots))
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
        return _head(header_bytes, header.data_start, header.file_size, header.version)


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
    _check_entry(
        identity, tokens, layers, min_reuse=min_reuse, checkpoint=checkpoint, limits=limits
    )
    shapes = [tuple(tensor.shape for tensor in spec.tensors) for spec in layers]
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
    blocks: tuple[bytes, ...] = (),
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
    return EntryHeader(
        identity=identity,
        tokens=tokens,
        created=check_created(created),
        min_reuse=min_reuse,
        layers=tuple(planned),
        checkpoint=checkpoint,
        meta=entry_meta({} if meta is None else meta, limits),
        data_start=0,
        file_size=align_up(cursor),  # the data's size, until placed
        block_tokens=block_tokens,
        blocks=blocks,
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
    if file_size > _INT_MAX:
        raise ValueError(f"file size {file_size} does not fit in 64 bits")
    header = replace(draft, layers=placed, data_start=data_start, file_size=file_size)
    return EntryPlan(header, header_length)


# --- version 2: manifests and blocks --------------------------------------------------------


@dataclass(frozen=True)
class BlockHeader:
    """A parsed (or planned) block file header: one block's rows of every blocked layer."""

    hash: bytes  # xxh3_128(parent || tokens): the block's name
    identity: str  # the identity digest of the entries it belongs to
    parent: bytes  # the previous block's hash; ZERO_HASH for a first block
    tokens: bytes  # exactly block_tokens packed u32 tokens
    layers: tuple[tuple[Slot, ...], ...]  # the slots of each blocked layer, in order
    data_start: int
    file_size: int

    @property
    def block_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Every slot, layer by layer."""
        return tuple(slot for layer in self.layers for slot in layer)


def encode_block_header(block: BlockHeader) -> bytes:
    """The msgpack header bytes of a block file."""
    return _pack(
        {
            "identity": block.identity,
            "parent": block.parent,
            "tokens": block.tokens,
            "layers": [{"slots": _slot_maps(slots)} for slots in block.layers],
        }
    )


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
        _checked_checksums(checksums, len(self.block_slots))
        step = self.block_tokens * TOKEN_BYTES
        header = self.entry.header
        sums = iter(checksums)
        return BlockHeader(
            hash=self.hashes[index],
            identity=header.identity.digest(),
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
        return _head(header_bytes, block.data_start, block.file_size, MANIFEST_VERSION, FLAG_BLOCK)


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
    _check_entry(
        identity, tokens, layers, min_reuse=min_reuse, checkpoint=checkpoint, limits=limits
    )
    count = len(tokens) // TOKEN_BYTES
    if not any(spec.blocked for spec in layers):
        block_tokens = 0
    if block_tokens:
        check_block_tokens(block_tokens)
    hashes = block_hashes(tokens, block_tokens) if block_tokens else ()
    tail = count - len(hashes) * block_tokens
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
        block_tokens=block_tokens,
        blocks=hashes,
        version=MANIFEST_VERSION,
    )
    entry = _placed_plan(draft, limits)
    blocked = [spec for spec in layers if spec.blocked]
    flat = [spec.blocked for spec in layers for _ in spec.tensors]
    return _block_plan(entry, hashes, blocked, [i for i, cut in enumerate(flat) if cut])


def with_rows(shape: Sequence[int], rows: int) -> tuple[int, ...]:
    """shape with rows on the token axis: a cut tensor's whole shape from its tail (or
    block) slot's, and back."""
    return (*shape[:TOKEN_AXIS], rows, *shape[TOKEN_AXIS + 1 :])


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
        identity=entry.header.identity.digest(),
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
