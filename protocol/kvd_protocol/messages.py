"""The messages of protocol version 1: one frozen dataclass per request and per reply.

A message's wire map is {"op": <op>, "id": <id>, <its fields>}; every field is always present
(an absent value is nil), and a field's declaration names its checker (fields.py); each class
is a Record (record.py). The op table pairing them is ops.py. See PROTOCOL.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Self

from . import schema
from .blocks import HASH_BYTES, block_hashes, check_block_tokens, split_hashes
from .errors import ErrorCode, ProtocolError
from .fields import U32 as U32  # noqa: PLC0414 - re-exported: importers read it from here
from .fields import (
    _at_most,
    _bool,
    _choice,
    _error_code,
    _features,
    _hashes,
    _identity,
    _limits,
    _name,
    _optional,
    _prose,
    _seconds,
    _status,
    _token_count,
    _tokens,
    _uint,
    wire,
)
from .identity import Identity
from .limits import Limits
from .record import Record

# The records messages carry, read from here by their users as the messages are:
from .summaries import MAX_REPORTED_BYTES as MAX_REPORTED_BYTES  # noqa: PLC0414
from .summaries import MAX_REPORTED_DROPS as MAX_REPORTED_DROPS  # noqa: PLC0414
from .summaries import MAX_REPORTED_MS as MAX_REPORTED_MS  # noqa: PLC0414
from .summaries import DropReport as DropReport  # noqa: PLC0414
from .summaries import EntrySummary as EntrySummary  # noqa: PLC0414
from .summaries import RestoreReport as RestoreReport  # noqa: PLC0414
from .summaries import Retention as Retention  # noqa: PLC0414
from .summaries import _drops, _entries, _entry, _report, _retention
from .tokens import TOKEN_BYTES

PROTOCOL_VERSION: Final = 1
SKIP_REASONS: Final = ("duplicate", "covered")
BLOCKS_FEATURE: Final = "blocks"  # put_begin's blocks, put_blocks, open_blocks
PREFILL_COST_FEATURE: Final = "prefill_cost"  # put_begin's prefill_cost
IDENTITY_TRAITS_FEATURE: Final = "identity_traits"  # an identity's traits
IDENTITY_SOURCE_FEATURE: Final = "identity_source"  # its source trait (a "/" in a value)
LOOKUP_MISS_FEATURE: Final = "lookup_miss"  # lookup's explain, its reply's miss and detail
ENGINE_DROPS_FEATURE: Final = "engine_drops"  # put_commit's dropped
REMOTE_FETCH_FEATURE: Final = "remote_fetch"  # lookup's fetch, its reply's fetching
# A lookup's fetch: "wait", the client may wait for a fetch from the remote tier (the reply may
# say fetching); "fetched", it asks again once the fetch it was told of is done.
FETCH_ASKS: Final = ("wait", "fetched")
MAX_FETCH_SECONDS: Final = 600.0  # a reply's fetching: what a client waits for at most
REMOTE_FLUSH_FEATURE: Final = "remote_flush"  # flush's remote, its reply's remote_pending/bytes
RETENTION_FEATURE: Final = "retention"  # put_begin's retention, an EntrySummary's retained_until
OPEN_ENTRY_FEATURE: Final = "open_entry"  # the open_entry op: a durable entry by id, leased
PRESENCE_FEATURE: Final = "presence"  # the presence op: how much of a prompt would restore
MAX_BLOCK_BATCH: Final = 64  # blocks per put_blocks / open_blocks: a reply's most descriptors
TICKET_STATES: Final = ("pending", "stored", "dropped", "failed")
# Bounds of the numbers a client declares, checked at decoding so that a daemon never counts
# one it could not use (a wait of a thousand years; a reported figure: summaries.py):
MAX_WAIT_SECONDS: Final = 86_400.0  # a ticket or flush wait: a day
MAX_PREFILL_COST: Final = 60.0  # seconds of prefill per token: a minute
MAX_LIST_PAGE: Final = 10_000  # entries in one list reply: ~1.3 MB, well within a frame


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
    # Keep the entry (or the one already held that it duplicates or is covered by) before
    # unretained ones for this long (feature "retention").
    retention: Retention | None = field(default=None, metadata=wire(_optional(_retention)))

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
    and write), for the daemon's telemetry (feature "restore_report"). dropped: the
    snapshots of this put's identity the engine dropped since its last commit (feature
    "engine_drops")."""

    op: ClassVar[str] = "put_commit"
    put: int = field(metadata=wire(_uint()))
    store_ms: float | None = field(
        default=None, metadata=wire(_optional(_at_most(MAX_REPORTED_MS)))
    )
    dropped: DropReport | None = field(default=None, metadata=wire(_optional(_drops)))


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
    # Whether a miss's reply says why (miss, detail): a client that reads them asks, so that
    # one that predates them never gets a field it does not know (feature "lookup_miss").
    explain: bool = field(default=False, metadata=wire(_bool))
    # Whether the client may wait for a fetch from the remote tier (FETCH_ASKS; nil: it may
    # not, as one that predates the feature "remote_fetch").
    fetch: str | None = field(default=None, metadata=wire(_optional(_choice(FETCH_ASKS))))

    def reply_descriptors(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class LookupReply(_OneDescriptorReply):
    """A hit holds the entry, a lease to release, and fd: the entry file, read-only. A miss
    asked to explain itself holds miss, its reason (one of a fixed set: PROTOCOL.md), and
    detail, in words. fetching (to a lookup whose fetch is "wait"): the daemon fetches more of
    the prompt from the remote tier; ask again (fetch "fetched") within that many seconds. It
    offers no entry then."""

    op: ClassVar[str] = "lookup"
    matched: int = field(metadata=wire(_uint(0, U32)))
    entry: EntrySummary | None = field(metadata=wire(_optional(_entry)))
    lease: int | None = field(metadata=wire(_optional(_uint())))
    miss: str | None = field(default=None, metadata=wire(_optional(_name)))
    detail: str | None = field(default=None, metadata=wire(_optional(_prose)))
    fetching: float | None = field(
        default=None, metadata=wire(_optional(_at_most(MAX_FETCH_SECONDS)))
    )

    def descriptor_count(self) -> int:
        return 1 if self.entry is not None else 0

    def check_consistency(self) -> None:
        if (self.entry is None) != (self.lease is None):
            raise schema.SchemaError(f"{self.op}: entry and lease must be both set or both nil")
        if self.entry is not None and (self.miss is not None or self.detail is not None):
            raise schema.SchemaError(f"{self.op}: a hit has no miss reason")
        if self.entry is not None and self.fetching is not None:
            raise schema.SchemaError(f"{self.op}: a hit is not fetching")


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
    """remote: wait for the remote tier's uploads too (feature "remote_flush")."""

    op: ClassVar[str] = "flush"
    # None: wait as long as it takes
    timeout: float | None = field(metadata=wire(_optional(_at_most(MAX_WAIT_SECONDS))))
    remote: bool = field(default=False, metadata=wire(_bool))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class FlushReply(Reply):
    """remote_pending, remote_pending_bytes: the uploads queued before a remote flush that
    were still pending when it answered; remote_dropped: the uploads dropped since the last
    remote flush answered, remote_dropped_for: the seconds since then (or since the daemon
    started); remote_down: the store is down, and why (nil when it is not); all nil unless it
    asked for remote. durable: the puts are durable and the uploads all sent, none dropped,
    the store not down."""

    op: ClassVar[str] = "flush"
    durable: bool = field(metadata=wire(_bool))
    pending: int = field(metadata=wire(_uint()))
    remote_pending: int | None = field(default=None, metadata=wire(_optional(_uint())))
    remote_pending_bytes: int | None = field(default=None, metadata=wire(_optional(_uint())))
    remote_dropped: int | None = field(default=None, metadata=wire(_optional(_uint())))
    remote_dropped_for: float | None = field(default=None, metadata=wire(_optional(_seconds)))
    remote_down: str | None = field(default=None, metadata=wire(_optional(_prose)))


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


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class OpenEntry(Request):
    """A durable entry by id, opened read-only and leased as a lookup's hit is: its blocks
    come from open_blocks under the lease (feature "open_entry"). What kvctl export reads."""

    op: ClassVar[str] = "open_entry"
    entry: str = field(metadata=wire(_name))

    def reply_descriptors(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class OpenEntryReply(_OneDescriptorReply):
    """The entry's summary, a lease to release, and fd: the entry file, read-only."""

    op: ClassVar[str] = "open_entry"
    entry: EntrySummary = field(metadata=wire(_entry))
    lease: int = field(metadata=wire(_uint()))

    def descriptor_count(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Presence(Request):
    """How much of a prompt the tier would restore now, and how much more the remote tier
    holds, restoring nothing and counting nothing (feature "presence"). The identity is named
    whole (an engine) or by its digest (kvctl): exactly one of the two."""

    op: ClassVar[str] = "presence"
    identity: Identity | None = field(metadata=wire(_optional(_identity)))
    digest: str | None = field(metadata=wire(_optional(_name)))
    tokens: bytes = field(metadata=wire(_tokens))

    def check_consistency(self) -> None:
        if (self.identity is None) == (self.digest is None):
            raise schema.SchemaError(f"{self.op}: set exactly one of identity, digest")


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class PresenceReply(Reply):
    """matched: the tokens a lookup would restore now (entry: from which entry); miss and
    detail: why no more (a lookup's miss reason), nil when all but the prompt's last token
    would. remote: how many tokens past matched the remote tier holds (nil without one);
    remote_miss and remote_detail: why it holds no more (nil when it reaches as far)."""

    op: ClassVar[str] = "presence"
    matched: int = field(metadata=wire(_uint(0, U32)))
    entry: str | None = field(metadata=wire(_optional(_name)))
    miss: str | None = field(metadata=wire(_optional(_name)))
    detail: str | None = field(metadata=wire(_optional(_prose)))
    remote: int | None = field(metadata=wire(_optional(_uint(0, U32))))
    remote_miss: str | None = field(metadata=wire(_optional(_name)))
    remote_detail: str | None = field(metadata=wire(_optional(_prose)))
