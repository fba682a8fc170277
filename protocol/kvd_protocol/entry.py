"""The entry file: its header model, the layout planner and the encoding of its head.

One file per cache entry, written once (FORMAT.md):

    prefix (48 bytes) | msgpack header | zero pad to data start | tensor slots, 16 KiB-aligned

The planner fixes every offset and the file size before any byte is written, because slot
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
from .checksum import CHECKSUM_BYTES, new_checksum
from .dtypes import tensor_nbytes
from .identity import Identity
from .limits import DEFAULT_LIMITS, Limits
from .tokens import TOKEN_BYTES

MAGIC: Final = b"\x89KVD\r\n\x1a\n"  # PNG-style: catches 7-bit and newline-mangling transfers
FORMAT_VERSION: Final = 1
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


def _header_map(header: EntryHeader) -> dict[str, Any]:
    return {
        "identity": header.identity.to_wire(),
        "tokens": header.tokens,
        "created": header.created,
        "min_reuse": header.min_reuse,
        "layers": [
            {
                "kind": layer.kind,
                "meta": layer.meta,
                "trimmable": layer.trimmable,
                "slots": [
                    {
                        "dtype": slot.dtype,
                        "shape": slot.shape,
                        "offset": slot.offset,
                        "nbytes": slot.nbytes,
                        "checksum": slot.checksum,
                    }
                    for slot in layer.slots
                ],
            }
            for layer in header.layers
        ],
        "checkpoint": None if header.checkpoint is None else header.checkpoint.to_wire(),
        "meta": header.meta,
    }


def encode_header(header: EntryHeader) -> bytes:
    """The msgpack header bytes; floats are always float64, checksums always 8-byte bin."""
    packed: bytes = msgpack.packb(_header_map(header), use_bin_type=True)
    return packed


def header_checksum(covered_prefix: bytes | memoryview, header: bytes | memoryview) -> bytes:
    """The header checksum: over the prefix up to its checksum field, then the header."""
    hasher = new_checksum()
    hasher.update(covered_prefix)
    hasher.update(header)
    return hasher.digest()


def _head(header: EntryHeader, header_bytes: bytes) -> bytes:
    if header.data_start != align_up(PREFIX_BYTES + len(header_bytes)):
        raise ValueError("data start does not match the encoded header's length")
    covered = PREFIX.pack(
        MAGIC, FORMAT_VERSION, 0, len(header_bytes), header.data_start, header.file_size, b"", b""
    )[:CHECKSUMMED_PREFIX_BYTES]
    pad = bytes(header.data_start - PREFIX_BYTES - len(header_bytes))
    return b"".join((covered, header_checksum(covered, header_bytes), header_bytes, pad))


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
        slots = self.slots
        if len(checksums) != len(slots):
            raise ValueError(f"{len(checksums)} checksums for {len(slots)} slots")
        if any(not isinstance(c, bytes) or len(c) != CHECKSUM_BYTES for c in checksums):
            raise ValueError(f"every checksum must be {CHECKSUM_BYTES} bytes")
        sums = iter(checksums)
        layers = tuple(
            Layer(layer.kind, layer.meta, layer.trimmable, _placed(layer.slots, sums, 0))
            for layer in self.header.layers
        )
        return replace(self.header, layers=layers)

    def head(self, checksums: Sequence[bytes]) -> bytes:
        """The bytes for offset 0 once the tensors are written: prefix, header, zero pad."""
        header = self.finish(checksums)
        header_bytes = encode_header(header)
        # Fixed-width checksums keep the header's length, so the planned offsets still hold.
        assert len(header_bytes) == self.header_length, "header length drifted"
        return _head(header, header_bytes)


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
    """Lay out an entry; raises ValueError for anything a reader would reject."""
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
    cursor = 0  # relative to data start
    planned: list[Layer] = []
    for i, spec in enumerate(layers):
        schema.text(spec.kind, f"layers[{i}].kind", limits.max_name_bytes)
        slots: list[Slot] = []
        for tensor in spec.tensors:
            if len(tensor.shape) > MAX_NDIM:
                raise ValueError(f"layers[{i}]: more than {MAX_NDIM} dimensions")
            offset = align_up(cursor)
            nbytes = tensor_nbytes(tensor.dtype, tensor.shape)
            slots.append(
                Slot(tensor.dtype, tuple(tensor.shape), offset, nbytes, _ZERO_CHECKSUM, offset)
            )
            cursor = offset + nbytes
        state = state_map(spec.meta, f"layers[{i}].meta")
        planned.append(Layer(spec.kind, state, spec.trimmable, tuple(slots)))
    draft = EntryHeader(
        identity=identity,
        tokens=tokens,
        created=check_created(created),
        min_reuse=min_reuse,
        layers=tuple(planned),
        checkpoint=checkpoint,
        meta=entry_meta({} if meta is None else meta, limits),
        data_start=0,
        file_size=0,
    )
    header_length = len(encode_header(draft))
    if header_length > limits.max_header_bytes:
        raise ValueError(f"header of {header_length} bytes, over the limit")
    data_start = align_up(PREFIX_BYTES + header_length)
    zeros = itertools.repeat(_ZERO_CHECKSUM)
    placed = tuple(
        Layer(layer.kind, layer.meta, layer.trimmable, _placed(layer.slots, zeros, data_start))
        for layer in planned
    )
    file_size = data_start + align_up(cursor)
    if file_size > _INT_MAX:
        raise ValueError(f"file size {file_size} does not fit in 64 bits")
    header = replace(draft, layers=placed, data_start=data_start, file_size=file_size)
    return EntryPlan(header, header_length)
