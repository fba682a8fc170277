"""The entry file's model: its prefix, header, layers and slots, a block file's header, the
values a header's meta maps may hold, and the encoding of a file's head (FORMAT.md).

The planners (entry.py) build these; the reader (entry_reader.py) parses and checks them.
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import msgpack

from . import schema
from .checksum import CHECKSUM_BYTES, new_checksum
from .identity import Identity
from .limits import DEFAULT_LIMITS, Limits
from .tokens import TOKEN_BYTES

MAGIC: Final = b"\x89KVD\r\n\x1a\n"  # PNG-style: catches 7-bit and newline-mangling transfers
FORMAT_VERSION: Final = 1  # every tensor whole in the entry file
MANIFEST_VERSION: Final = 2  # manifests and their block files
FLAG_BLOCK: Final = 1  # prefix flags bit 0, version 2: a block file, not a manifest
TOKEN_AXIS: Final = 2  # of a blocked layer's tensors: [batch, heads, tokens, ...]
ALIGNMENT: Final = 16384  # the arm64 page size: every slot can be mapped and adopted by MLX
# The entry meta key that marks a prefill checkpoint (True): the caches part-way through a
# prompt's prefill, an untrimmable prefix evicted before whole turns (FORMAT.md).
PREFILL_CHECKPOINT_META: Final = "prefill_checkpoint"

# magic, version, flags, header length, data start, file size, reserved, header checksum.
PREFIX: Final = struct.Struct("<8sHHIQQ8s8s")
PREFIX_BYTES: Final = PREFIX.size  # 48
CHECKSUMMED_PREFIX_BYTES: Final = PREFIX_BYTES - CHECKSUM_BYTES  # all of it but the checksum

META_MAX_DEPTH: Final = 8  # nesting of maps and lists in a layer's meta, the meta map included
META_MAX_ITEMS: Final = 256  # entries in the entry-level meta map
MAX_NDIM: Final = 32  # dimensions of one tensor

INT_MIN: Final = -(1 << 63)  # the integers msgpack can carry
INT_MAX: Final = (1 << 64) - 1
_FLOAT_MAX: Final = sys.float_info.max

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
    block_hashes: tuple[bytes, ...] = ()  # version 2: the hashes of its token_count // block_tokens
    version: int = FORMAT_VERSION

    @property
    def token_count(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def trimmable(self) -> bool:
        """True iff every layer can be cut to a shorter prefix."""
        return all(layer.trimmable for layer in self.layers)

    @property
    def prefill_checkpoint(self) -> bool:
        """Whether the entry is a prefill checkpoint (its meta marks it)."""
        return self.meta.get(PREFILL_CHECKPOINT_META) is True

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        """Every slot, layer by layer, in header order (made once: a restore asks for it per
        tensor)."""
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
        return schema.integer(value, what, INT_MIN, INT_MAX)
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
            out[key] = schema.integer(item, f"meta.{key}", INT_MIN, INT_MAX)
        else:
            raise schema.SchemaError(f"meta.{key}: unsupported value type {type(item).__name__}")
    return out


def check_entry_kind(meta: Mapping[str, MetaValue], generation_checkpoint: bool) -> None:
    """An entry is a prompt cache, a generation checkpoint or a prefill checkpoint, never two
    of them: PREFILL_CHECKPOINT_META is True when present, and never beside a generation
    checkpoint (raises schema.SchemaError)."""
    if PREFILL_CHECKPOINT_META not in meta:
        return
    value = meta[PREFILL_CHECKPOINT_META]
    if value is not True:  # 1 and 1.0 equal True, but are not the mark
        raise schema.SchemaError(
            f"meta.{PREFILL_CHECKPOINT_META}: {value!r} ({type(value).__name__}), not true: "
            "present, the key marks a prefill checkpoint and must be true"
        )
    if generation_checkpoint:
        raise schema.SchemaError(
            f"meta.{PREFILL_CHECKPOINT_META} and checkpoint both set: an entry is a prefill "
            "checkpoint or a generation checkpoint, not both"
        )


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
        "identity": header.identity.digest_fields(),  # its traits are in meta (TRAITS_META)
        "tokens": header.tokens,
        "created": header.created,
        "min_reuse": header.min_reuse,
        "layers": [_layer_map(layer, header.version) for layer in header.layers],
        "checkpoint": None if header.checkpoint is None else header.checkpoint.to_wire(),
        "meta": header.meta,
    }
    if header.version >= MANIFEST_VERSION:
        found["block_tokens"] = header.block_tokens
        found["blocks"] = b"".join(header.block_hashes)
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


def encode_head(
    header_bytes: bytes, data_start: int, file_size: int, version: int, flags: int = 0
) -> bytes:
    """A file's head: prefix (its header checksum included), header bytes, zero pad."""
    if data_start != align_up(PREFIX_BYTES + len(header_bytes)):
        raise ValueError("data start does not match the encoded header's length")
    covered = PREFIX.pack(
        MAGIC, version, flags, len(header_bytes), data_start, file_size, b"", b""
    )[:CHECKSUMMED_PREFIX_BYTES]
    pad = bytes(data_start - PREFIX_BYTES - len(header_bytes))
    return b"".join((covered, header_checksum(covered, header_bytes), header_bytes, pad))


def check_checksums(checksums: Sequence[bytes], count: int) -> None:
    """Raise ValueError unless checksums are count checksums of CHECKSUM_BYTES each."""
    if len(checksums) != count:
        raise ValueError(f"{len(checksums)} checksums for {count} slots")
    if any(not isinstance(c, bytes) or len(c) != CHECKSUM_BYTES for c in checksums):
        raise ValueError(f"every checksum must be {CHECKSUM_BYTES} bytes")


# --- version 2: manifests and blocks --------------------------------------------------------


@dataclass(frozen=True)
class BlockHeader:
    """A parsed (or planned) block file header: one block's rows of every blocked layer."""

    hash: bytes  # xxh3_128(parent || tokens): the block's name
    digest: str  # the identity digest of the entries it belongs to
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
            "identity": block.digest,
            "parent": block.parent,
            "tokens": block.tokens,
            "layers": [{"slots": _slot_maps(slots)} for slots in block.layers],
        }
    )
