"""Reading an entry file's head: trusts nothing, and fails only with EntryFormatError.

A reader reads PREFIX_BYTES, calls parse_prefix (which says how many header bytes follow),
reads those and calls parse_header with the file's real size. Readers that verify tensor
bytes call verify_slot per slot. Work and memory stay within the Limits on any input.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import msgpack

from . import schema
from .checksum import CHECKSUM_BYTES, checksum
from .dtypes import ITEM_SIZES
from .entry import (
    ALIGNMENT,
    CHECKSUMMED_PREFIX_BYTES,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    PREFIX,
    PREFIX_BYTES,
    Checkpoint,
    EntryHeader,
    Layer,
    Slot,
    align_up,
    check_created,
    entry_meta,
    header_checksum,
    state_map,
)
from .errors import EntryFormatError, Rule
from .identity import Identity
from .limits import DEFAULT_LIMITS, Limits
from .tokens import TOKEN_BYTES

Buffer = bytes | bytearray | memoryview

_HEADER_FIELDS: Final = frozenset(
    {"identity", "tokens", "created", "min_reuse", "layers", "checkpoint", "meta"}
)
_LAYER_FIELDS: Final = frozenset({"kind", "meta", "trimmable", "slots"})
_SLOT_FIELDS: Final = frozenset({"dtype", "shape", "offset", "nbytes", "checksum"})
_RESERVED: Final = bytes(8)


@dataclass(frozen=True)
class Prefix:
    """The fixed prefix, checked for shape but not yet for its checksum (that needs the header)."""

    header_length: int
    data_start: int
    file_size: int  # as declared
    header_checksum: bytes
    covered: bytes  # the prefix bytes the header checksum covers


class _RuleError(Exception):
    """A broken rule found deep in the header; parse_header adds the file name."""

    def __init__(self, rule: Rule, detail: str) -> None:
        super().__init__(detail)
        self.rule = rule
        self.detail = detail


def _fail(name: str, rule: Rule, detail: str) -> NoReturn:
    raise EntryFormatError(name, rule, detail)


def parse_prefix(name: str, data: Buffer, limits: Limits = DEFAULT_LIMITS) -> Prefix:
    """Check the first PREFIX_BYTES of a file; name is only used in errors."""
    if len(data) < PREFIX_BYTES:
        _fail(
            name, Rule.TRUNCATED, f"{len(data)} bytes, shorter than the {PREFIX_BYTES}-byte prefix"
        )
    magic, version, flags, header_length, data_start, file_size, reserved, digest = (
        PREFIX.unpack_from(data)
    )
    if magic != MAGIC:
        _fail(name, Rule.MAGIC, f"magic {magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        _fail(name, Rule.VERSION, f"format version {version}, this reader knows {FORMAT_VERSION}")
    if flags or reserved != _RESERVED:
        _fail(name, Rule.VERSION, f"flags {flags:#x} or reserved bytes set: a newer writer's file")
    if header_length > limits.max_header_bytes:
        _fail(name, Rule.HEADER_SIZE, f"header of {header_length} bytes, over the limit")
    if data_start != align_up(PREFIX_BYTES + header_length):
        _fail(name, Rule.HEADER_SIZE, f"data start {data_start} does not follow the header")
    if file_size % ALIGNMENT or file_size < data_start:
        _fail(name, Rule.FILE_SIZE, f"declared size {file_size} is not aligned past data start")
    return Prefix(
        header_length, data_start, file_size, digest, bytes(data[:CHECKSUMMED_PREFIX_BYTES])
    )


def parse_header(
    name: str, prefix: Prefix, header: Buffer, file_size: int, limits: Limits = DEFAULT_LIMITS
) -> EntryHeader:
    """Validate the header (the prefix.header_length bytes after the prefix; any more are
    ignored) against the file's real size."""
    if len(header) < prefix.header_length:
        _fail(name, Rule.TRUNCATED, f"{len(header)} of {prefix.header_length} header bytes")
    header = memoryview(header)[: prefix.header_length]
    if header_checksum(prefix.covered, header) != prefix.header_checksum:
        _fail(name, Rule.HEADER_CHECKSUM, "prefix and header do not match their checksum")
    if file_size < prefix.file_size:
        _fail(name, Rule.TRUNCATED, f"{file_size} bytes, {prefix.file_size} declared")
    if file_size > prefix.file_size:
        _fail(name, Rule.FILE_SIZE, f"{file_size} bytes, {prefix.file_size} declared")
    try:
        obj = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=False)
    except (ValueError, msgpack.UnpackException) as exc:
        _fail(name, Rule.SCHEMA, f"header is not msgpack: {exc}")
    try:
        return _entry_header(obj, prefix, limits)
    except schema.SchemaError as exc:
        _fail(name, Rule.SCHEMA, str(exc))
    except _RuleError as exc:
        _fail(name, exc.rule, exc.detail)


def parse_head(
    name: str, data: Buffer, file_size: int, limits: Limits = DEFAULT_LIMITS
) -> EntryHeader:
    """Both steps on a buffer that starts at offset 0 of the file (e.g. a mapping of it)."""
    prefix = parse_prefix(name, data, limits)
    return parse_header(name, prefix, memoryview(data)[PREFIX_BYTES:], file_size, limits)


def verify_slot(name: str, slot: Slot, data: Buffer) -> None:
    """Check one slot's bytes (data = file[slot.start:slot.end]) against its checksum."""
    if len(data) != slot.nbytes:
        _fail(name, Rule.TRUNCATED, f"slot at {slot.start}: {len(data)} of {slot.nbytes} bytes")
    if checksum(data) != slot.checksum:
        _fail(name, Rule.DATA_CHECKSUM, f"slot at {slot.start}: bytes do not match its checksum")


def _entry_header(obj: object, prefix: Prefix, limits: Limits) -> EntryHeader:
    raw = schema.fields(obj, "header", _HEADER_FIELDS)
    identity = Identity.from_wire(raw["identity"], limits)
    tokens = raw["tokens"]
    if not isinstance(tokens, bytes):
        raise schema.SchemaError(f"tokens: expected bytes, got {type(tokens).__name__}")
    if len(tokens) % TOKEN_BYTES:
        raise _RuleError(Rule.TOKEN_COUNT, f"{len(tokens)} token bytes, not whole u32 ids")
    count = len(tokens) // TOKEN_BYTES
    if count > limits.max_tokens:
        raise _RuleError(Rule.TOKEN_COUNT, f"{count} tokens, over the limit of {limits.max_tokens}")
    created = check_created(raw["created"])
    min_reuse = schema.integer(raw["min_reuse"], "min_reuse")
    if min_reuse > count:
        raise _RuleError(Rule.TOKEN_COUNT, f"min_reuse {min_reuse} exceeds {count} tokens")
    layers = _layers(raw["layers"], prefix, limits)
    _check_no_overlap(slot for layer in layers for slot in layer.slots)
    return EntryHeader(
        identity=identity,
        tokens=tokens,
        created=created,
        min_reuse=min_reuse,
        layers=layers,
        checkpoint=schema.optional(raw["checkpoint"], Checkpoint.from_wire, limits),
        meta=entry_meta(raw["meta"], limits),
        data_start=prefix.data_start,
        file_size=prefix.file_size,
    )


def _layers(value: object, prefix: Prefix, limits: Limits) -> tuple[Layer, ...]:
    layers: list[Layer] = []
    slot_budget = limits.max_slots
    for i, item in enumerate(schema.sequence(value, "layers", limits.max_layers)):
        what = f"layers[{i}]"
        raw = schema.fields(item, what, _LAYER_FIELDS)
        raw_slots = schema.sequence(raw["slots"], f"{what}.slots", slot_budget)
        slot_budget -= len(raw_slots)
        slots = tuple(
            _slot(s, f"{what}.slots[{j}]", prefix, limits) for j, s in enumerate(raw_slots)
        )
        layers.append(
            Layer(
                kind=schema.text(raw["kind"], f"{what}.kind", limits.max_name_bytes),
                meta=state_map(raw["meta"], f"{what}.meta"),
                trimmable=schema.boolean(raw["trimmable"], f"{what}.trimmable"),
                slots=slots,
            )
        )
    return tuple(layers)


def _slot(value: object, what: str, prefix: Prefix, limits: Limits) -> Slot:
    raw: dict[str, Any] = schema.fields(value, what, _SLOT_FIELDS)
    dtype = schema.text(raw["dtype"], f"{what}.dtype", limits.max_name_bytes)
    itemsize = ITEM_SIZES.get(dtype)
    if itemsize is None:
        raise _RuleError(Rule.DTYPE, f"{what}: dtype {dtype!r} is not allowed")
    dims = schema.sequence(raw["shape"], f"{what}.shape", MAX_NDIM)
    shape = tuple(schema.integer(d, f"{what}.shape", -(1 << 63)) for d in dims)
    offset = schema.integer(raw["offset"], f"{what}.offset")
    nbytes = schema.integer(raw["nbytes"], f"{what}.nbytes")
    digest = schema.binary(raw["checksum"], f"{what}.checksum", CHECKSUM_BYTES)
    if len(digest) != CHECKSUM_BYTES:
        raise schema.SchemaError(f"{what}.checksum: {len(digest)} bytes, not {CHECKSUM_BYTES}")
    if any(d < 0 for d in shape):
        raise _RuleError(Rule.SLOT_NBYTES, f"{what}: negative dimension in {list(shape)}")
    expected = itemsize
    for d in shape:
        expected *= d
    if nbytes != expected:
        raise _RuleError(Rule.SLOT_NBYTES, f"{what}: {nbytes} bytes, shape needs {expected}")
    if offset % ALIGNMENT:
        raise _RuleError(Rule.SLOT_ALIGNMENT, f"{what}: offset {offset} is not {ALIGNMENT}-aligned")
    start = prefix.data_start + offset
    if start + nbytes > prefix.file_size:
        raise _RuleError(Rule.SLOT_BOUNDS, f"{what}: ends at {start + nbytes}, past the file")
    return Slot(dtype, shape, offset, nbytes, digest, start)


def _check_no_overlap(slots: Iterable[Slot]) -> None:
    """No two slots share a byte; empty slots hold none. O(n log n)."""
    previous: Slot | None = None
    for slot in sorted((s for s in slots if s.nbytes), key=lambda s: s.start):
        if previous is not None and slot.start < previous.end:
            raise _RuleError(
                Rule.SLOT_OVERLAP, f"slots at {previous.start} and {slot.start} overlap"
            )
        previous = slot
