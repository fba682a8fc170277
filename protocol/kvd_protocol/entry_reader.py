"""Reading an entry file's head: trusts nothing, and fails only with EntryFormatError.

A reader reads PREFIX_BYTES, calls parse_prefix (which says how many header bytes follow,
and whether the file is a block file), reads those and calls parse_header (an entry of
version 1 or a version 2 manifest) or parse_block_header (a block file) with the file's real
size. check_block says whether a block is the one a manifest lists at an index; BlockHeads
says it of a manifest's other blocks by comparing their heads' bytes with one that passed.
Readers that verify tensor bytes call verify_slot per slot. Work and memory stay within the
Limits on any input.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Final, NoReturn

import msgpack

from . import schema
from .blocks import (
    HASH_BYTES,
    ZERO_HASH,
    block_hash,
    block_hashes,
    check_block_tokens,
    is_hex_digest,
    parse_block_name,
    split_hashes,
)
from .checksum import CHECKSUM_BYTES, checksum
from .dtypes import ITEM_SIZES
from .entry_model import (
    ALIGNMENT,
    CHECKSUMMED_PREFIX_BYTES,
    FLAG_BLOCK,
    FORMAT_VERSION,
    MAGIC,
    MANIFEST_VERSION,
    MAX_NDIM,
    PREFIX,
    PREFIX_BYTES,
    TOKEN_AXIS,
    BlockHeader,
    Checkpoint,
    EntryHeader,
    Layer,
    Slot,
    align_up,
    check_created,
    check_entry_kind,
    encode_block_header,
    entry_meta,
    header_checksum,
    state_map,
)
from .errors import EntryFormatError, Rule
from .identity import TRAITS_META, Identity, parse_traits
from .limits import DEFAULT_LIMITS, Limits
from .tokens import TOKEN_BYTES

Buffer = bytes | bytearray | memoryview

_HEADER_FIELDS: Final = frozenset(
    {"identity", "tokens", "created", "min_reuse", "layers", "checkpoint", "meta"}
)
_LAYER_FIELDS: Final = frozenset({"kind", "meta", "trimmable", "slots"})
# Version 2 manifests: the keys of version 1 and these.
_MANIFEST_FIELDS: Final = _HEADER_FIELDS | {"block_tokens", "blocks"}
_MANIFEST_LAYER_FIELDS: Final = _LAYER_FIELDS | {"blocked"}
_BLOCK_FIELDS: Final = frozenset({"identity", "parent", "tokens", "layers"})
_BLOCK_LAYER_FIELDS: Final = frozenset({"slots"})
_SLOT_FIELDS: Final = frozenset({"dtype", "shape", "offset", "nbytes", "checksum"})
_RESERVED: Final = bytes(8)
_FLAGS: Final = {FORMAT_VERSION: (0,), MANIFEST_VERSION: (0, FLAG_BLOCK)}  # known, per version
_DIGEST_BYTES: Final = 16  # of Identity.digest(), in hex


@dataclass(frozen=True)
class Prefix:
    """The fixed prefix, checked for shape but not yet for its checksum (that needs the header)."""

    header_length: int
    data_start: int
    file_size: int  # as declared
    header_checksum: bytes
    covered: bytes  # the prefix bytes the header checksum covers
    version: int = FORMAT_VERSION
    is_block: bool = False  # version 2 with FLAG_BLOCK: a block file, read by parse_block_header


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
    known_flags = _FLAGS.get(version)
    if known_flags is None:
        _fail(name, Rule.VERSION, f"format version {version}, this reader knows {sorted(_FLAGS)}")
    if flags not in known_flags or reserved != _RESERVED:
        _fail(name, Rule.VERSION, f"flags {flags:#x} or reserved bytes set: a newer writer's file")
    if header_length > limits.max_header_bytes:
        _fail(name, Rule.HEADER_SIZE, f"header of {header_length} bytes, over the limit")
    if data_start != align_up(PREFIX_BYTES + header_length):
        _fail(name, Rule.HEADER_SIZE, f"data start {data_start} does not follow the header")
    if file_size % ALIGNMENT or file_size < data_start:
        _fail(name, Rule.FILE_SIZE, f"declared size {file_size} is not aligned past data start")
    return Prefix(
        header_length,
        data_start,
        file_size,
        digest,
        bytes(data[:CHECKSUMMED_PREFIX_BYTES]),
        version,
        bool(flags & FLAG_BLOCK),
    )


def parse_header(
    name: str, prefix: Prefix, header: Buffer, file_size: int, limits: Limits = DEFAULT_LIMITS
) -> EntryHeader:
    """Validate an entry's header (the prefix.header_length bytes after the prefix; any more
    are ignored) against the file's real size: version 1, or a version 2 manifest."""
    if prefix.is_block:
        _fail(name, Rule.VERSION, "a block file, not an entry")
    obj = _decoded(name, prefix, header, file_size)
    try:
        return _entry_header(obj, prefix, limits)
    except schema.SchemaError as exc:
        _fail(name, Rule.SCHEMA, str(exc))
    except _RuleError as exc:
        _fail(name, exc.rule, exc.detail)


def parse_block_header(
    name: str, prefix: Prefix, header: Buffer, file_size: int, limits: Limits = DEFAULT_LIMITS
) -> BlockHeader:
    """Validate a block file's header as parse_header does an entry's, and its hash: when name
    is a block file's name (blocks.block_name) it must be the hash of the block's parent and
    tokens (a staging file's name is not: check_block compares the hash with the manifest's)."""
    if not prefix.is_block:
        _fail(name, Rule.VERSION, f"version {prefix.version} entry, not a block file")
    obj = _decoded(name, prefix, header, file_size)
    try:
        block = _block_header(obj, prefix, limits)
    except schema.SchemaError as exc:
        _fail(name, Rule.SCHEMA, str(exc))
    except _RuleError as exc:
        _fail(name, exc.rule, exc.detail)
    named = parse_block_name(name)
    if named is not None and named != block.hash:
        _fail(name, Rule.BLOCK_HASH, f"its parent and tokens hash to {block.hash.hex()}")
    return block


def _decoded(name: str, prefix: Prefix, header: Buffer, file_size: int) -> object:
    """The header's msgpack value, once its checksum and the file's size are right."""
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
        return msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=False)
    except (ValueError, msgpack.UnpackException) as exc:
        _fail(name, Rule.SCHEMA, f"header is not msgpack: {exc}")


def parse_head(
    name: str, data: Buffer, file_size: int, limits: Limits = DEFAULT_LIMITS
) -> EntryHeader:
    """Both steps on a buffer that starts at offset 0 of the file (e.g. a mapping of it)."""
    prefix = parse_prefix(name, data, limits)
    return parse_header(name, prefix, memoryview(data)[PREFIX_BYTES:], file_size, limits)


def parse_block_head(
    name: str, data: Buffer, file_size: int, limits: Limits = DEFAULT_LIMITS
) -> BlockHeader:
    """parse_prefix and parse_block_header on a buffer that starts at offset 0 of a block file
    (a block's head is ManifestPlan.block_head's length: one read takes it)."""
    prefix = parse_prefix(name, data, limits)
    return parse_block_header(name, prefix, memoryview(data)[PREFIX_BYTES:], file_size, limits)


def check_block(manifest: EntryHeader, index: int, block: BlockHeader, name: str) -> None:
    """That block is the one manifest lists at index: its hash, parent, tokens and identity,
    and one layer per blocked layer with the manifest's tail slots' dtypes and shapes with
    block_tokens rows. Raises EntryFormatError(name, block_mismatch) naming what differs."""
    problem = _block_mismatch(manifest, index, block)
    if problem:
        _fail(name, Rule.BLOCK_MISMATCH, f"block {index} of the manifest: {problem}")


def _block_mismatch(manifest: EntryHeader, index: int, block: BlockHeader) -> str | None:
    if not 0 <= index < len(manifest.block_hashes):
        return f"the manifest lists {len(manifest.block_hashes)} blocks"
    if block.hash != manifest.block_hashes[index]:
        return f"hash {block.hash.hex()}, listed {manifest.block_hashes[index].hex()}"
    if block.parent != (manifest.block_hashes[index - 1] if index else ZERO_HASH):
        return "another parent"
    step = manifest.block_tokens * TOKEN_BYTES
    if block.tokens != manifest.tokens[index * step : (index + 1) * step]:
        return "other tokens"
    if block.digest != manifest.identity.digest():
        return f"identity {block.digest}, the manifest's is {manifest.identity.digest()}"
    blocked = [layer.slots for layer in manifest.layers if layer.blocked]
    if len(block.layers) != len(blocked):
        return f"{len(block.layers)} layers for {len(blocked)} blocked layers"
    for i, (slots, tails) in enumerate(zip(block.layers, blocked, strict=True)):
        if len(slots) != len(tails):
            return f"blocked layer {i}: {len(slots)} slots, the manifest's has {len(tails)}"
        for slot, tail in zip(slots, tails, strict=True):
            shape = (*tail.shape[:TOKEN_AXIS], manifest.block_tokens, *tail.shape[TOKEN_AXIS + 1 :])
            if slot.dtype != tail.dtype or slot.shape != shape:
                return (
                    f"blocked layer {i}: a {slot.dtype} slot of shape {list(slot.shape)}, "
                    f"needs {tail.dtype} {list(shape)}"
                )
    return None


class BlockHeads:
    """The heads of one manifest's blocks, checked against the head of one of them that
    passed parse_block_header and check_block (the model): a head whose bytes are the
    model's but for the parent, the tokens (those the manifest lists for its index) and the
    slots' checksums decodes to the model with those values, so it passes every check the
    model passed; the manifest's checks make its hash the one listed. That costs a compare
    and the header checksum instead of a decode. A head that differs anywhere else, or a
    model not encoded as encode_block_header encodes it, gets no verdict here (None): the
    full parse then judges it and says what is wrong."""

    def __init__(self, manifest: EntryHeader, model: BlockHeader, head: bytes) -> None:
        self.length = len(head)  # the bytes of a head: the prefix and the header
        self.slots = model.slots  # those of every block that passes check, but for checksums
        self._manifest, self._model, self._head = manifest, model, head
        self._parent_at, self._tokens_at, *checksums_at = _value_places(model, head)
        self._checksums_at = tuple(checksums_at)
        self._step = len(model.tokens)  # token bytes of a block

    @classmethod
    def of(cls, manifest: EntryHeader, model: BlockHeader, head: Buffer) -> BlockHeads | None:
        """The check of the other blocks of manifest, from model, parsed from head (the
        file's first bytes, at least its prefix and header) and found to be one of its
        blocks; None when model's header is not in the encoding the comparison needs."""
        prefix = PREFIX.unpack_from(head)
        own = bytes(head[: PREFIX_BYTES + prefix[3]])
        if encode_block_header(model) != own[PREFIX_BYTES:]:
            return None
        try:
            return cls(manifest, model, own)
        except ValueError:
            return None

    def check(self, index: int, data: Buffer, file_size: int) -> tuple[bytes, ...] | None:
        """The slot checksums of block index, in the model's slot order (its slots' places),
        if data (its file's first bytes, at least self.length) is the model's head but for
        that block's parent and tokens and any slot checksums, and the file is the model's
        size; else None. A block that passes is the model with those values: a restore reads
        it by the model's slots, and builds no header of its own."""
        manifest = self._manifest
        if not 0 <= index < len(manifest.block_hashes) or file_size != self._model.file_size:
            return None
        head = bytes(memoryview(data)[: self.length])
        if len(head) != self.length:
            return None
        expected = bytearray(self._head)
        expected[CHECKSUMMED_PREFIX_BYTES:PREFIX_BYTES] = head[
            CHECKSUMMED_PREFIX_BYTES:PREFIX_BYTES
        ]
        expected[self._parent_at : self._parent_at + HASH_BYTES] = (
            manifest.block_hashes[index - 1] if index else ZERO_HASH
        )
        step = self._step
        expected[self._tokens_at : self._tokens_at + step] = manifest.tokens[
            index * step : (index + 1) * step
        ]
        checksums = tuple(head[at : at + CHECKSUM_BYTES] for at in self._checksums_at)
        for at, digest in zip(self._checksums_at, checksums, strict=True):
            expected[at : at + CHECKSUM_BYTES] = digest
        if (
            expected != head
            or header_checksum(head[:CHECKSUMMED_PREFIX_BYTES], head[PREFIX_BYTES:])
            != head[CHECKSUMMED_PREFIX_BYTES:PREFIX_BYTES]
        ):
            return None
        return checksums


def _value_places(model: BlockHeader, head: bytes) -> list[int]:
    """Where in head (model's prefix and header) the bytes of its parent, its tokens and each
    slot's checksum start, in that order: the header encoded with every one of them all
    0x00 and all 0xff differs exactly there. Raises ValueError if that is not so."""

    def filled(byte: int) -> bytes:
        return encode_block_header(
            replace(
                model,
                parent=bytes([byte]) * HASH_BYTES,
                tokens=bytes([byte]) * len(model.tokens),
                layers=tuple(
                    tuple(replace(s, checksum=bytes([byte]) * CHECKSUM_BYTES) for s in slots)
                    for slots in model.layers
                ),
            )
        )

    low, high = filled(0), filled(0xFF)
    size = len(head) - PREFIX_BYTES
    if len(low) != size or len(high) != size:
        raise ValueError("the filled header has another length")
    differs = (int.from_bytes(low, "big") ^ int.from_bytes(high, "big")).to_bytes(size, "big")
    places = []  # (start, length) of each run of differing (0xff) bytes
    at = differs.find(0xFF)
    while at >= 0:
        end = differs.find(0, at)
        end = size if end < 0 else end
        places.append((at + PREFIX_BYTES, end - at))
        at = differs.find(0xFF, end)
    lengths = [HASH_BYTES, len(model.tokens)] + [CHECKSUM_BYTES] * len(model.slots)
    if [length for _, length in places] != lengths:
        raise ValueError("the values are not where the model's encoding puts them")
    return [at for at, _ in places]


def verify_slot(name: str, slot: Slot, data: Buffer) -> None:
    """Check one slot's bytes (data = file[slot.start:slot.end]) against its checksum."""
    check_slot_length(name, slot, len(data))
    check_slot_digest(name, slot, checksum(data))


def check_slot_length(name: str, slot: Slot, nbytes: int) -> None:
    """A slot read (whole or in pieces) came to nbytes: all of it, or the file is too short."""
    if nbytes != slot.nbytes:
        _fail(name, Rule.TRUNCATED, f"slot at {slot.start}: {nbytes} of {slot.nbytes} bytes")


def check_slot_digest(name: str, slot: Slot, digest: bytes) -> None:
    """A slot's checksum, computed whole or in pieces (new_checksum), against its own."""
    if digest != slot.checksum:
        _fail(name, Rule.DATA_CHECKSUM, f"slot at {slot.start}: bytes do not match its checksum")


def _entry_header(obj: object, prefix: Prefix, limits: Limits) -> EntryHeader:
    manifest = prefix.version == MANIFEST_VERSION
    raw = schema.fields(obj, "header", _MANIFEST_FIELDS if manifest else _HEADER_FIELDS)
    meta = entry_meta(raw["meta"], limits)
    identity = _with_traits(Identity.from_wire(raw["identity"], limits), meta.get(TRAITS_META))
    tokens = _tokens(raw["tokens"], limits)
    count = len(tokens) // TOKEN_BYTES
    created = check_created(raw["created"])
    min_reuse = schema.integer(raw["min_reuse"], "min_reuse")
    if min_reuse > count:
        raise _RuleError(Rule.TOKEN_COUNT, f"min_reuse {min_reuse} exceeds {count} tokens")
    layers = _layers(raw["layers"], prefix, limits, manifest)
    _check_no_overlap(slot for layer in layers for slot in layer.slots)
    block_tokens, blocks = _manifest_blocks(raw, tokens, layers, limits) if manifest else (0, ())
    checkpoint = schema.optional(raw["checkpoint"], Checkpoint.from_wire, limits)
    check_entry_kind(meta, checkpoint is not None)
    return EntryHeader(
        identity=identity,
        tokens=tokens,
        created=created,
        min_reuse=min_reuse,
        layers=layers,
        checkpoint=checkpoint,
        meta=meta,
        data_start=prefix.data_start,
        file_size=prefix.file_size,
        block_tokens=block_tokens,
        block_hashes=blocks,
        version=prefix.version,
    )


def _with_traits(identity: Identity, traits: object) -> Identity:
    """identity with the traits its header keeps in meta. Ill-formed ones are left out, not
    held against the entry: they are words for people, not part of the identity."""
    if not isinstance(traits, str) or not traits or identity.traits:
        return identity
    try:
        parse_traits(traits)
    except ValueError:
        return identity
    return replace(identity, traits=traits)


def _tokens(value: object, limits: Limits) -> bytes:
    if not isinstance(value, bytes):
        raise schema.SchemaError(f"tokens: expected bytes, got {type(value).__name__}")
    if len(value) % TOKEN_BYTES:
        raise _RuleError(Rule.TOKEN_COUNT, f"{len(value)} token bytes, not whole u32 ids")
    count = len(value) // TOKEN_BYTES
    if count > limits.max_tokens:
        raise _RuleError(Rule.TOKEN_COUNT, f"{count} tokens, over the limit of {limits.max_tokens}")
    return value


def _manifest_blocks(
    raw: dict[str, Any], tokens: bytes, layers: tuple[Layer, ...], limits: Limits
) -> tuple[int, tuple[bytes, ...]]:
    """A manifest's block size and block hashes, checked against its tokens and layers."""
    block_tokens = schema.integer(raw["block_tokens"], "block_tokens")
    if block_tokens:
        try:
            check_block_tokens(block_tokens)
        except ValueError as exc:
            raise schema.SchemaError(f"block_tokens: {exc}") from None
        if not any(layer.blocked for layer in layers):
            raise schema.SchemaError("block_tokens set, but no layer is blocked")
    joined = schema.binary(raw["blocks"], "blocks", limits.max_header_bytes, HASH_BYTES)
    count = len(tokens) // TOKEN_BYTES
    n = count // block_tokens if block_tokens else 0
    if len(joined) != n * HASH_BYTES:
        raise _RuleError(
            Rule.TOKEN_COUNT,
            f"{len(joined) // HASH_BYTES} block hashes, {count} tokens make {n} blocks",
        )
    blocks = split_hashes(joined)
    if blocks and blocks != block_hashes(tokens, block_tokens):
        raise _RuleError(Rule.BLOCK_HASH, "the blocks are not the chained hashes of its tokens")
    tail = count - n * block_tokens
    for i, layer in enumerate(layers):
        for slot in layer.slots if layer.blocked else ():
            if len(slot.shape) <= TOKEN_AXIS or slot.shape[TOKEN_AXIS] != tail:
                raise _RuleError(
                    Rule.TOKEN_COUNT,
                    f"layers[{i}]: a blocked slot of shape {list(slot.shape)}, "
                    f"not the {tail} tail tokens on axis {TOKEN_AXIS}",
                )
    return block_tokens, blocks


def _block_header(obj: object, prefix: Prefix, limits: Limits) -> BlockHeader:
    raw = schema.fields(obj, "block header", _BLOCK_FIELDS)
    digest = schema.text(raw["identity"], "identity", limits.max_name_bytes)
    if not is_hex_digest(digest, _DIGEST_BYTES):
        raise schema.SchemaError(f"identity: {digest[:64]!r} is not an identity digest")
    parent = schema.binary(raw["parent"], "parent", HASH_BYTES)
    if len(parent) != HASH_BYTES:
        raise schema.SchemaError(f"parent: {len(parent)} bytes, not {HASH_BYTES}")
    tokens = _tokens(raw["tokens"], limits)
    try:
        check_block_tokens(len(tokens) // TOKEN_BYTES)
    except ValueError as exc:
        raise _RuleError(Rule.TOKEN_COUNT, str(exc)) from None
    layers: list[tuple[Slot, ...]] = []
    budget = limits.max_slots
    for i, item in enumerate(schema.sequence(raw["layers"], "layers", limits.max_layers)):
        what = f"layers[{i}]"
        slots = _slots(schema.fields(item, what, _BLOCK_LAYER_FIELDS), what, prefix, limits, budget)
        budget -= len(slots)
        layers.append(slots)
    _check_no_overlap(slot for slots in layers for slot in slots)
    return BlockHeader(
        hash=block_hash(parent, tokens),
        digest=digest,
        parent=parent,
        tokens=tokens,
        layers=tuple(layers),
        data_start=prefix.data_start,
        file_size=prefix.file_size,
    )


def _layers(value: object, prefix: Prefix, limits: Limits, manifest: bool) -> tuple[Layer, ...]:
    layers: list[Layer] = []
    slot_budget = limits.max_slots
    for i, item in enumerate(schema.sequence(value, "layers", limits.max_layers)):
        what = f"layers[{i}]"
        raw = schema.fields(item, what, _MANIFEST_LAYER_FIELDS if manifest else _LAYER_FIELDS)
        slots = _slots(raw, what, prefix, limits, slot_budget)
        slot_budget -= len(slots)
        layers.append(
            Layer(
                kind=schema.text(raw["kind"], f"{what}.kind", limits.max_name_bytes),
                meta=state_map(raw["meta"], f"{what}.meta"),
                trimmable=schema.boolean(raw["trimmable"], f"{what}.trimmable"),
                slots=slots,
                blocked=manifest and schema.boolean(raw["blocked"], f"{what}.blocked"),
            )
        )
    return tuple(layers)


def _slots(
    raw: dict[str, Any], what: str, prefix: Prefix, limits: Limits, budget: int
) -> tuple[Slot, ...]:
    """The slots of a layer map, at most budget of them."""
    raw_slots = schema.sequence(raw["slots"], f"{what}.slots", budget)
    return tuple(
        _conforming_slot(s, prefix) or _slot(s, f"{what}.slots[{j}]", prefix, limits)
        for j, s in enumerate(raw_slots)
    )


def _conforming_slot(value: object, prefix: Prefix) -> Slot | None:
    """The slot of a map that passes every check of _slot, or None: then _slot says what is
    wrong. Without the error texts this costs a third of _slot, and a restore of a manifest
    reads as many slot maps as it has blocks times blocked tensors."""
    if type(value) is not dict or value.keys() != _SLOT_FIELDS:
        return None
    dtype, shape, offset = value["dtype"], value["shape"], value["offset"]
    nbytes, digest = value["nbytes"], value["checksum"]
    expected = ITEM_SIZES.get(dtype) if type(dtype) is str else None
    if (
        expected is None
        or type(shape) is not tuple
        or len(shape) > MAX_NDIM
        or type(offset) is not int
        or type(nbytes) is not int
        or type(digest) is not bytes
        or len(digest) != CHECKSUM_BYTES
    ):
        return None
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        expected *= d
    start = prefix.data_start + offset
    if nbytes != expected or offset < 0 or offset % ALIGNMENT or start + nbytes > prefix.file_size:
        return None
    return Slot(dtype, shape, offset, nbytes, digest, start)


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
