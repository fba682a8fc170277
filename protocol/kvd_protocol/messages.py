"""The messages of protocol version 1: one frozen dataclass per request and per reply.

A message's wire map is {"op": <op>, "id": <id>, <its fields>}; every field is always present
(an absent value is nil), and a field's checker lives beside its declaration. OPS pairs each
request class with its reply class: the one table of operations. See PROTOCOL.md.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Final, Self

from . import schema
from .blocks import HASH_BYTES, MIN_BLOCK_TOKENS, block_hashes, check_block_tokens, split_hashes
from .errors import ErrorCode, ProtocolError
from .identity import Identity
from .limits import Limits
from .tokens import TOKEN_BYTES

PROTOCOL_VERSION: Final = 1
U32: Final = (1 << 32) - 1
U64: Final = (1 << 64) - 1
MAX_FEATURES: Final = 256
SKIP_REASONS: Final = ("duplicate", "covered")
BLOCKS_FEATURE: Final = "blocks"  # put_begin's blocks, put_blocks, open_blocks
PREFILL_COST_FEATURE: Final = "prefill_cost"  # put_begin's prefill_cost
MAX_BLOCK_BATCH: Final = 64  # blocks per put_blocks / open_blocks: a reply's most descriptors
TICKET_STATES: Final = ("pending", "stored", "dropped", "failed")
# Bounds of the numbers a client declares, checked at decoding so that a daemon never counts
# one it could not use (a running mean poisoned by 1e300, a wait of a thousand years):
MAX_WAIT_SECONDS: Final = 86_400.0  # a ticket or flush wait: a day
MAX_REPORTED_MS: Final = 86_400_000.0  # store_ms and a restore report's ms: a day
MAX_PREFILL_COST: Final = 60.0  # seconds of prefill per token: a minute
MAX_REPORTED_BYTES: Final = 1 << 50  # bytes one restore read: a PiB
MAX_LIST_PAGE: Final = 10_000  # entries in one list reply: ~1.3 MB, well within a frame

# A field checker: (decoded value, field name, limits) -> the field's Python value.
# It raises schema.SchemaError (a bad message) or ProtocolError (a specific code, e.g. TOO_LARGE).
Check = Callable[[object, str, Limits], Any]


def wire(check: Check) -> dict[str, Check]:
    """The metadata of a dataclass field that is on the wire, checked by check when decoded."""
    return {"check": check}


# --- field checkers ---------------------------------------------------------------------------


def _uint(lo: int = 0, hi: int = U64) -> Check:
    def check(value: object, what: str, limits: Limits) -> int:
        if type(value) is int and lo <= value <= hi:  # the usual case, without a call
            return value
        return schema.integer(value, what, lo, hi)

    return check


def _name(value: object, what: str, limits: Limits) -> str:
    return schema.text(value, what, limits.max_name_bytes)


def _prose(value: object, what: str, limits: Limits) -> str:
    """Free text (error messages, reasons): bounded only by the frame."""
    return schema.text(value, what, limits.max_frame_bytes)


def _seconds(value: object, what: str, limits: Limits) -> float:
    return schema.number(value, what, 0.0, sys.float_info.max)


def _at_most(hi: float) -> Check:
    """A finite number in 0..hi (a duration, a measure)."""

    def check(value: object, what: str, limits: Limits) -> float:
        return schema.number(value, what, 0.0, hi)

    return check


def _token_count(value: object, what: str, limits: Limits) -> int:
    """A count of tokens: at most the max_tokens one request may carry."""
    if type(value) is int and 0 <= value <= limits.max_tokens:  # the usual case, without a call
        return value
    return schema.integer(value, what, 0, limits.max_tokens)


def _bool(value: object, what: str, limits: Limits) -> bool:
    return schema.boolean(value, what)


def _optional(check: Check) -> Check:
    return lambda value, what, limits: None if value is None else check(value, what, limits)


def _choice(choices: tuple[str, ...]) -> Check:
    def check(value: object, what: str, limits: Limits) -> str:
        if value not in choices:
            raise schema.SchemaError(f"{what}: expected one of {list(choices)}, got {value!r}")
        return str(value)

    return check


def _tokens(value: object, what: str, limits: Limits) -> bytes:
    max_bytes = limits.max_tokens * TOKEN_BYTES
    if type(value) is bytes and len(value) <= max_bytes and not len(value) % TOKEN_BYTES:
        return value  # the usual case, without a call
    if isinstance(value, bytes) and len(value) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{what}: {len(value) // TOKEN_BYTES} tokens, over the limit of {limits.max_tokens}",
        )
    return schema.binary(value, what, max_bytes, TOKEN_BYTES)


def _hashes(value: object, what: str, limits: Limits) -> bytes:
    """Block hashes, concatenated: as many as max_tokens tokens make blocks at the least."""
    max_bytes = limits.max_tokens // MIN_BLOCK_TOKENS * HASH_BYTES
    return schema.binary(value, what, max_bytes, HASH_BYTES)


def _identity(value: object, what: str, limits: Limits) -> Identity:
    return Identity.from_wire(value, limits)


def _limits(value: object, what: str, limits: Limits) -> Limits:
    names = {f.name for f in dataclasses.fields(Limits)}
    raw = schema.fields(value, what, names)
    return Limits(**{name: schema.integer(raw[name], f"{what}.{name}", 1, U32) for name in names})


def _features(value: object, what: str, limits: Limits) -> tuple[str, ...]:
    items = schema.sequence(value, what, MAX_FEATURES)
    return tuple(_name(item, what, limits) for item in items)


_ERROR_CODES = frozenset(code.value for code in ErrorCode)


def _error_code(value: object, what: str, limits: Limits) -> ErrorCode:
    if not isinstance(value, str) or value not in _ERROR_CODES:
        raise schema.SchemaError(f"{what}: not an error code: {value!r}")
    return ErrorCode(value)


_PLAIN = (type(None), bool, int, float, str, bytes)


def _status(value: object, what: str, limits: Limits) -> dict[str, Any]:
    """Free-form, but maps with string keys holding plain msgpack values (no ext types)."""
    if not isinstance(value, dict):
        raise schema.SchemaError(f"{what}: expected a map, got {type(value).__name__}")
    stack: list[object] = [value]
    while stack:  # iterative: nesting may be deeper than Python's recursion limit
        item = stack.pop()
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise schema.SchemaError(f"{what}: map keys must be strings")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, _PLAIN):
            raise schema.SchemaError(f"{what}: {type(item).__name__} is not allowed")
    return value


def _entry(value: object, what: str, limits: Limits) -> EntrySummary:
    return EntrySummary.from_map(value, what, limits)


def _report(value: object, what: str, limits: Limits) -> RestoreReport:
    return RestoreReport.from_map(value, what, limits)


def _entries(value: object, what: str, limits: Limits) -> tuple[EntrySummary, ...]:
    items = schema.sequence(value, what, limits.max_frame_bytes)
    return tuple(_entry(item, what, limits) for item in items)


# --- records ----------------------------------------------------------------------------------


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _encode(value: object) -> object:
    if isinstance(value, Record):
        return value.to_map()
    if isinstance(value, Identity | Limits):
        return value.to_wire()
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


@dataclass(frozen=True)
class _WireFields:
    """A record class's wire fields, gathered once from its declarations."""

    checked: tuple[tuple[str, Check], ...]  # (name, checker), in declaration order
    required: frozenset[str]  # every key its map must hold, the envelope's included
    # The keys it may leave out, with their defaults: fields added within a protocol version
    # (a peer that predates one neither sends nor expects it).
    optional: Mapping[str, object]
    consistency: bool  # the class has rules across fields (overrides check_consistency)


_wire_fields_cache: dict[type[Record], _WireFields] = {}


def _wire_fields(cls: type[Record]) -> _WireFields:
    """cls's wire fields, gathered on first use (callers look in the cache first: a call
    fewer per message)."""
    wired = [f for f in dataclasses.fields(cls) if "check" in f.metadata]
    optional = {f.name: f.default for f in wired if f.default is not dataclasses.MISSING}
    found = _wire_fields_cache[cls] = _WireFields(
        checked=tuple((f.name, f.metadata["check"]) for f in wired),
        required=frozenset(f.name for f in wired if f.name not in optional) | cls.envelope,
        optional=optional,
        consistency=cls.check_consistency is not Record.check_consistency,
    )
    return found


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Record:
    """A msgpack map with exactly the fields declared with wire().

    Every record class is declared with eq=False and repr=False and shares the three methods
    below: dataclass compiles each generated method for each class, and those of the classes
    here were half of this module's import, paid by every start of the daemon.
    """

    envelope: ClassVar[frozenset[str]] = frozenset()  # keys checked by a subclass, not here

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.__dict__ == other.__dict__  # every field, as a dataclass's __eq__ has it

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def __repr__(self) -> str:
        values = (f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__qualname__}({', '.join(values)})"

    @classmethod
    def from_map(cls, obj: object, what: str, limits: Limits) -> Self:
        """Strictly decode; raises schema.SchemaError or ProtocolError."""
        spec = _wire_fields_cache.get(cls) or _wire_fields(cls)
        # A map holding exactly the required keys (the usual) needs one set comparison.
        if type(obj) is dict and obj.keys() == spec.required:
            raw = obj
        else:
            raw = schema.fields(obj, what, spec.required, spec.optional.keys())
        values = {}
        for name, check in spec.checked:  # a loop, not a comprehension: one call fewer
            if name in raw:
                values[name] = check(raw[name], name, limits)
        record = cls(**values)
        if spec.consistency:
            record.check_consistency()
        return record

    @classmethod
    def checked(cls, values: Mapping[str, object]) -> Self:
        """The record holding values, one for each of its fields, all checked already: what
        its constructor does, without a call per field (for small_messages' decoders)."""
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    def to_map(self) -> dict[str, object]:
        spec = _wire_fields_cache.get(type(self)) or _wire_fields(type(self))
        optional, values = spec.optional, self.__dict__
        wire_map = {}
        for name, _ in spec.checked:
            value = values[name]
            if name in optional and value == optional[name]:
                continue
            wire_map[name] = value if type(value) in _SCALARS else _encode(value)
        return wire_map

    def check_consistency(self) -> None:
        """Rules across fields; raises schema.SchemaError."""


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class EntrySummary(Record):
    """What the daemon tells about one stored entry (lookup and list replies)."""

    id: str = field(metadata=wire(_name))
    identity: str = field(metadata=wire(_name))  # Identity.digest()
    tokens: int = field(metadata=wire(_uint()))
    bytes: int = field(metadata=wire(_uint()))
    trimmable: bool = field(metadata=wire(_bool))
    created: float = field(metadata=wire(_seconds))  # seconds since the epoch
    durable: bool = field(metadata=wire(_bool))
    # Fields added within version 1 (left out at their defaults):
    used: float | None = field(default=None, metadata=wire(_optional(_seconds)))  # last lease
    leases: int = field(default=0, metadata=wire(_uint()))  # readers holding it now


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Message(Record):
    """One frame's body: {"op": op, "id": id, ...fields}."""

    op: ClassVar[str]
    envelope: ClassVar[frozenset[str]] = frozenset({"op"})
    id: int = field(metadata=wire(_uint(1, U32)))

    @classmethod
    def from_wire(cls, obj: object, limits: Limits) -> Self:
        """Strictly decode a body of this class's op; raises ProtocolError."""
        if not (type(obj) is dict or isinstance(obj, Mapping)) or obj.get("op") != cls.op:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a {cls.op!r} message")
        try:
            return cls.from_map(obj, cls.op, limits)
        except schema.SchemaError as exc:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{cls.op}: {exc}") from None

    def to_wire(self) -> dict[str, object]:
        return {"op": self.op, **self.to_map()}


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Request(Message):
    """Client to server. Requests never carry descriptors."""

    def reply_descriptors(self) -> int:
        """The most descriptors the reply to this request may carry."""
        return 0


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Reply(Message):
    """Server to client, answering the request with the same id and op."""

    def descriptor_count(self) -> int:
        """How many descriptors travel with this reply, as its own fields declare."""
        return 0

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors this reply object holds (not part of its msgpack body)."""
        return ()

    def with_fds(self, fds: tuple[int, ...]) -> Self:
        """This reply holding fds (descriptor_count() of them)."""
        return self


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class _OneDescriptorReply(Reply):
    fd: int | None = None  # travels beside the frame (SCM_RIGHTS), never in the body

    @property
    def fds(self) -> tuple[int, ...]:
        return () if self.fd is None else (self.fd,)

    def with_fds(self, fds: tuple[int, ...]) -> Self:
        return dataclasses.replace(self, fd=fds[0] if fds else None)


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class _BlockFilesReply(Reply):
    """count block files, as count descriptors in block order (first, first + 1, ...)."""

    count: int = field(metadata=wire(_uint(1, MAX_BLOCK_BATCH)))
    descriptors: tuple[int, ...] = ()  # travel beside the frame, never in the body

    def descriptor_count(self) -> int:
        return self.count

    @property
    def fds(self) -> tuple[int, ...]:
        return self.descriptors

    def with_fds(self, fds: tuple[int, ...]) -> Self:
        return dataclasses.replace(self, descriptors=tuple(fds))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class _BlockRange(Request):
    """Blocks first..first + count - 1 of an entry; the reply carries one descriptor each."""

    first: int = field(metadata=wire(_uint(0, U32)))
    count: int = field(metadata=wire(_uint(1, MAX_BLOCK_BATCH)))

    def reply_descriptors(self) -> int:
        return self.count


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ErrorReply(Reply):
    """The answer to a request that failed; id 0 when the request's id could not be read."""

    op: ClassVar[str] = "error"
    id: int = field(metadata=wire(_uint(0, U32)))
    code: ErrorCode = field(metadata=wire(_error_code))
    message: str = field(metadata=wire(_prose))


# --- operations -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Hello(Request):
    op: ClassVar[str] = "hello"
    protocol: int = field(metadata=wire(_uint(0, U32)))
    client: str = field(metadata=wire(_name))
    pid: int = field(metadata=wire(_uint(1, U32)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class HelloReply(Reply):
    op: ClassVar[str] = "hello"
    protocol: int = field(metadata=wire(_uint(0, U32)))
    server: str = field(metadata=wire(_name))  # the daemon's version
    limits: Limits = field(metadata=wire(_limits))
    features: tuple[str, ...] = field(metadata=wire(_features))
    # Added within version 1 (left out at its default): the prefix the namespace of every
    # identity this peer names must start with ("": none). A peer of another uid than the
    # daemon's gets one, so that it reaches only its own user's entries.
    tenant: str = field(default="", metadata=wire(_name))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Ping(Request):
    op: ClassVar[str] = "ping"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PingReply(Reply):
    op: ClassVar[str] = "ping"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutBegin(Request):
    """With blocks (feature "blocks"): the entry is a version 2 manifest listing blocks, the
    chained hashes of its T // block_tokens whole blocks, each a file of block_size bytes."""

    op: ClassVar[str] = "put_begin"
    identity: Identity = field(metadata=wire(_identity))
    tokens: bytes = field(metadata=wire(_tokens))
    size: int = field(metadata=wire(_uint(1)))  # the entry (manifest) file's exact size in bytes
    blocks: bytes = field(default=b"", metadata=wire(_hashes))  # HASH_BYTES each, in order
    block_tokens: int = field(default=0, metadata=wire(_uint(0, U32)))
    block_size: int = field(default=0, metadata=wire(_uint()))
    # Seconds of prefill per token as the engine last measured it (0: not measured): what
    # the cost eviction policy weighs this identity's tokens by (feature "prefill_cost").
    prefill_cost: float = field(default=0.0, metadata=wire(_at_most(MAX_PREFILL_COST)))

    def reply_descriptors(self) -> int:
        return 1

    def check_consistency(self) -> None:
        if not (self.blocks or self.block_tokens or self.block_size):
            return  # a version 1 entry, or a manifest without blocks
        try:
            check_block_tokens(self.block_tokens)
        except ValueError as exc:
            raise schema.SchemaError(f"{self.op}: block_tokens: {exc}") from None
        count = len(self.tokens) // TOKEN_BYTES // self.block_tokens
        if not count:
            raise schema.SchemaError(f"{self.op}: blocks named, but no whole block of tokens")
        if len(self.blocks) != count * HASH_BYTES:
            raise schema.SchemaError(
                f"{self.op}: {len(self.blocks) // HASH_BYTES} block hashes for "
                f"{count} whole blocks of {self.block_tokens} tokens"
            )
        if self.block_size < 1:
            raise schema.SchemaError(f"{self.op}: blocks need a block_size >= 1")
        # Checked here, so that a put is never told it holds blocks of other tokens.
        if b"".join(block_hashes(self.tokens, self.block_tokens)) != self.blocks:
            raise schema.SchemaError(f"{self.op}: blocks are not the chained hashes of tokens")

    @property
    def hashes(self) -> tuple[bytes, ...]:
        """The block hashes, one by one."""
        return split_hashes(self.blocks)


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutBeginReply(_OneDescriptorReply):
    """skip None: fd is the pre-sized staging file to write; else the entry is already held.
    held: the request's first held blocks are the daemon's already, pinned for this put; the
    client writes blocks held.. only (put_blocks)."""

    op: ClassVar[str] = "put_begin"
    put: int = field(metadata=wire(_uint()))
    skip: str | None = field(metadata=wire(_optional(_choice(SKIP_REASONS))))
    held: int = field(default=0, metadata=wire(_uint(0, U32)))

    def descriptor_count(self) -> int:
        return 1 if self.skip is None else 0

    def check_consistency(self) -> None:
        if self.skip is not None and self.held:
            raise schema.SchemaError(f"{self.op}: a skipped put holds no blocks for the client")


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutBlocks(_BlockRange):
    """The staging files of blocks first.. of a put begun with blocks; first >= held."""

    op: ClassVar[str] = "put_blocks"
    put: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutBlocksReply(_BlockFilesReply):
    """The staging files, read-write, each pre-sized to the put's block_size."""

    op: ClassVar[str] = "put_blocks"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class OpenBlocks(_BlockRange):
    """The files of blocks first.. of a leased entry (a version 2 manifest)."""

    op: ClassVar[str] = "open_blocks"
    lease: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class OpenBlocksReply(_BlockFilesReply):
    """The block files, read-only."""

    op: ClassVar[str] = "open_blocks"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutCommit(Request):
    """store_ms: the engine's time from handing the caches over to this commit (snapshot
    and write), for the daemon's telemetry (feature "restore_report")."""

    op: ClassVar[str] = "put_commit"
    put: int = field(metadata=wire(_uint()))
    store_ms: float | None = field(
        default=None, metadata=wire(_optional(_at_most(MAX_REPORTED_MS)))
    )


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutCommitReply(Reply):
    op: ClassVar[str] = "put_commit"
    ticket: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutAbort(Request):
    op: ClassVar[str] = "put_abort"
    put: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PutAbortReply(Reply):
    op: ClassVar[str] = "put_abort"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class WaitTicket(Request):
    """Op "ticket": wait for a put's ticket to settle, up to timeout."""

    op: ClassVar[str] = "ticket"
    ticket: int = field(metadata=wire(_uint()))
    # None: answer at once
    timeout: float | None = field(metadata=wire(_optional(_at_most(MAX_WAIT_SECONDS))))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class TicketReply(Reply):
    op: ClassVar[str] = "ticket"
    ticket: int = field(metadata=wire(_uint()))
    state: str = field(metadata=wire(_choice(TICKET_STATES)))
    reason: str | None = field(metadata=wire(_optional(_prose)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Lookup(Request):
    """min_tokens: a match shorter than this is a miss (the engine holds as much in memory);
    a daemon announces it with the "lookup_min_tokens" feature."""

    op: ClassVar[str] = "lookup"
    identity: Identity = field(metadata=wire(_identity))
    tokens: bytes = field(metadata=wire(_tokens))
    min_tokens: int = field(default=0, metadata=wire(_token_count))

    def reply_descriptors(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class LookupReply(_OneDescriptorReply):
    """A hit holds the entry, a lease to release, and fd: the entry file, read-only."""

    op: ClassVar[str] = "lookup"
    matched: int = field(metadata=wire(_uint(0, U32)))
    entry: EntrySummary | None = field(metadata=wire(_optional(_entry)))
    lease: int | None = field(metadata=wire(_optional(_uint())))

    def descriptor_count(self) -> int:
        return 1 if self.entry is not None else 0

    def check_consistency(self) -> None:
        if (self.entry is None) != (self.lease is None):
            raise schema.SchemaError(f"{self.op}: entry and lease must be both set or both nil")


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class FindCheckpoint(Request):
    """A generation checkpoint: the newest entry stored under key whose tokens extend prompt.

    Checkpoints live apart from prompt lookups, so a half-finished answer never seeds
    another prompt; they are found only by their key.
    """

    op: ClassVar[str] = "find_checkpoint"
    identity: Identity = field(metadata=wire(_identity))
    key: str = field(metadata=wire(_name))
    prompt: bytes = field(metadata=wire(_tokens))

    def reply_descriptors(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class FindCheckpointReply(LookupReply):
    """As a lookup reply; matched is the checkpoint's whole token count (no trim)."""

    op: ClassVar[str] = "find_checkpoint"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ForgetCheckpoint(Request):
    """The generation finished: its checkpoints under key can go."""

    op: ClassVar[str] = "forget_checkpoint"
    identity: Identity = field(metadata=wire(_identity))
    key: str = field(metadata=wire(_name))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ForgetCheckpointReply(Reply):
    op: ClassVar[str] = "forget_checkpoint"
    removed: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class RestoreReport(Record):
    """How an engine's restore from a leased entry went, for the daemon's telemetry: restored
    (miss nil: tokens restored from bytes read) or not (miss: the engine's reason)."""

    miss: str | None = field(metadata=wire(_optional(_name)))
    ms: float = field(metadata=wire(_at_most(MAX_REPORTED_MS)))  # lookup's start to caches built
    bytes: int = field(metadata=wire(_uint(0, MAX_REPORTED_BYTES)))
    tokens: int = field(metadata=wire(_token_count))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Release(Request):
    """damaged: why the client could not use the leased entry's file (a truncated file, a
    checksum that differs); the daemon checks the file and quarantines it if it fails. A
    daemon announces it with the "release_damaged" feature. report: how the restore went
    (feature "restore_report")."""

    op: ClassVar[str] = "release"
    lease: int = field(metadata=wire(_uint()))
    damaged: str | None = field(default=None, metadata=wire(_optional(_prose)))
    report: RestoreReport | None = field(default=None, metadata=wire(_optional(_report)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ReleaseReply(Reply):
    op: ClassVar[str] = "release"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Flush(Request):
    op: ClassVar[str] = "flush"
    # None: wait as long as it takes
    timeout: float | None = field(metadata=wire(_optional(_at_most(MAX_WAIT_SECONDS))))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class FlushReply(Reply):
    op: ClassVar[str] = "flush"
    durable: bool = field(metadata=wire(_bool))
    pending: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Status(Request):
    op: ClassVar[str] = "status"


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class StatusReply(Reply):
    op: ClassVar[str] = "status"
    status: dict[str, Any] = field(metadata=wire(_status))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ListEntries(Request):
    op: ClassVar[str] = "list"
    # an identity digest, or None for all identities
    identity: str | None = field(metadata=wire(_optional(_name)))
    limit: int = field(metadata=wire(_uint(1, MAX_LIST_PAGE)))
    # an entry id: the page starts after it (None: from the start)
    after: str | None = field(metadata=wire(_optional(_name)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ListEntriesReply(Reply):
    op: ClassVar[str] = "list"
    entries: tuple[EntrySummary, ...] = field(metadata=wire(_entries))
    more: bool = field(metadata=wire(_bool))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Evict(Request):
    """Exactly one selector: an entry id, an identity digest, or all=True."""

    op: ClassVar[str] = "evict"
    entry: str | None = field(metadata=wire(_optional(_name)))
    identity: str | None = field(metadata=wire(_optional(_name)))
    all: bool = field(metadata=wire(_bool))

    def check_consistency(self) -> None:
        if (self.entry is not None) + (self.identity is not None) + self.all != 1:
            raise schema.SchemaError("evict: set exactly one of entry, identity, all")


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class EvictReply(Reply):
    op: ClassVar[str] = "evict"
    evicted: int = field(metadata=wire(_uint()))
    bytes: int = field(metadata=wire(_uint()))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Verify(Request):
    """Check a durable entry's file whole (head and every tensor's checksum); with repair, a
    damaged one is quarantined. Repair needs the daemon's uid or root."""

    op: ClassVar[str] = "verify"
    entry: str = field(metadata=wire(_name))
    repair: bool = field(metadata=wire(_bool))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class VerifyReply(Reply):
    """problem nil: the file is intact."""

    op: ClassVar[str] = "verify"
    problem: str | None = field(metadata=wire(_optional(_prose)))
    quarantined: bool = field(metadata=wire(_bool))


@dataclass(frozen=True)
class Op:
    request: type[Request]
    reply: type[Reply]


OPS: Final[Mapping[str, Op]] = MappingProxyType(
    {
        op.request.op: op
        for op in (
            Op(Hello, HelloReply),
            Op(Ping, PingReply),
            Op(PutBegin, PutBeginReply),
            Op(PutBlocks, PutBlocksReply),
            Op(PutCommit, PutCommitReply),
            Op(PutAbort, PutAbortReply),
            Op(WaitTicket, TicketReply),
            Op(Lookup, LookupReply),
            Op(OpenBlocks, OpenBlocksReply),
            Op(FindCheckpoint, FindCheckpointReply),
            Op(ForgetCheckpoint, ForgetCheckpointReply),
            Op(Release, ReleaseReply),
            Op(Flush, FlushReply),
            Op(Status, StatusReply),
            Op(ListEntries, ListEntriesReply),
            Op(Evict, EvictReply),
            Op(Verify, VerifyReply),
        )
    }
)


def peek_id(obj: object) -> int:
    """The request id of a decoded body, or 0 when it has none that could be answered."""
    if type(obj) is dict or isinstance(obj, Mapping):
        value = obj.get("id")
        if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
            return value if 1 <= value <= U32 else 0
    return 0


def decode_request(obj: object, limits: Limits) -> Request:
    """The request a decoded body holds; raises ProtocolError (UNKNOWN_OP, BAD_MESSAGE,
    TOO_LARGE)."""
    op = obj.get("op") if type(obj) is dict or isinstance(obj, Mapping) else None
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "expected a map with a string 'op'")
    spec = OPS.get(op)
    if spec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op[:64]!r}")
    return spec.request.from_wire(obj, limits)
