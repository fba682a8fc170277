"""Valid messages of every op, and helpers that drive a client and a server Connection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvd_protocol.blocks import block_hashes
from kvd_protocol.connection import NEED_DATA, Connection, Event, Role
from kvd_protocol.errors import ErrorCode
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.messages import (
    PROTOCOL_VERSION,
    DropReport,
    EntrySummary,
    ErrorReply,
    Evict,
    EvictReply,
    FindCheckpoint,
    FindCheckpointReply,
    Flush,
    FlushReply,
    ForgetCheckpoint,
    ForgetCheckpointReply,
    Hello,
    HelloReply,
    ListEntries,
    ListEntriesReply,
    Lookup,
    LookupReply,
    OpenBlocks,
    OpenBlocksReply,
    OpenEntry,
    OpenEntryReply,
    Ping,
    PingReply,
    Presence,
    PresenceReply,
    PutAbort,
    PutAbortReply,
    PutBegin,
    PutBeginReply,
    PutBlocks,
    PutBlocksReply,
    PutCommit,
    PutCommitReply,
    Release,
    ReleaseReply,
    Reply,
    Request,
    Status,
    StatusReply,
    TicketReply,
    Verify,
    VerifyReply,
    WaitTicket,
)
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity(
    model_id="mlx-community/Qwen3-8B-4bit",
    config_fingerprint="cfg-1",
    tokenizer_hash="tok-1",
    codec_id="kvd-codecs/1",
    runtime="mlx-0.29/cpu",
    namespace="tenant-a",
)
DIGEST = IDENTITY.digest()
TOKENS = pack_tokens(range(1000, 1064))
BLOCKS = b"".join(block_hashes(TOKENS, 16))  # 4 blocks of 16 tokens
ENTRY = EntrySummary(
    id="e-0001",
    identity=DIGEST,
    tokens=64,
    bytes=1 << 20,
    trimmable=True,
    created=1.7e9,
    durable=False,
)

HELLO = Hello(id=1, protocol=PROTOCOL_VERSION, client="test-engine", pid=4242)
HELLO_REPLY = HelloReply(
    id=1, protocol=PROTOCOL_VERSION, server="0.1.0", limits=DEFAULT_LIMITS, features=("put",)
)


def exchanges(first_id: int = 2) -> list[tuple[Request, Reply]]:
    """One (request, reply) pair per op and reply variant, ids counting from first_id;
    replies that carry descriptors hold made-up ones (100 + their id, 200 + their id, ...)."""
    pairs: list[tuple[Request, Reply]] = [
        (Ping(id=0), PingReply(id=0)),
        (
            PutBegin(id=0, identity=IDENTITY, tokens=TOKENS, size=3 << 20),
            PutBeginReply(id=0, put=7, skip=None),
        ),
        (
            PutBegin(id=0, identity=IDENTITY, tokens=TOKENS, size=1),
            PutBeginReply(id=0, put=8, skip="duplicate"),
        ),
        (
            PutBegin(id=0, identity=IDENTITY, tokens=b"", size=1),
            PutBeginReply(id=0, put=9, skip="covered"),
        ),
        (
            PutBegin(
                id=0,
                identity=IDENTITY,
                tokens=TOKENS,
                size=1 << 16,
                blocks=BLOCKS,
                block_tokens=16,
                block_size=1 << 17,
            ),
            PutBeginReply(id=0, put=10, skip=None, held=1),
        ),
        (PutBlocks(id=0, put=10, first=1, count=3), PutBlocksReply(id=0, count=3)),
        (PutCommit(id=0, put=7), PutCommitReply(id=0, ticket=70)),
        (
            PutCommit(id=0, put=8, store_ms=2.5, dropped=DropReport(snapshots=2, bytes=1 << 20)),
            PutCommitReply(id=0, ticket=71),
        ),
        (PutAbort(id=0, put=8), PutAbortReply(id=0)),
        (
            WaitTicket(id=0, ticket=70, timeout=None),
            TicketReply(id=0, ticket=70, state="pending", reason=None),
        ),
        (
            WaitTicket(id=0, ticket=70, timeout=2.5),
            TicketReply(id=0, ticket=70, state="dropped", reason="queue over its cap"),
        ),
        (
            Lookup(id=0, identity=IDENTITY, tokens=TOKENS),
            LookupReply(id=0, matched=63, entry=ENTRY, lease=5),
        ),
        (
            Lookup(id=0, identity=IDENTITY, tokens=TOKENS[:4]),
            LookupReply(id=0, matched=0, entry=None, lease=None),
        ),
        (
            Lookup(id=0, identity=IDENTITY, tokens=TOKENS, min_tokens=40),
            LookupReply(id=0, matched=0, entry=None, lease=None),
        ),
        (
            Lookup(id=0, identity=replace(IDENTITY, traits="kv=none"), tokens=TOKENS, explain=True),
            LookupReply(id=0, matched=0, entry=None, lease=None, miss="kv differs", detail="..."),
        ),
        (
            Lookup(id=0, identity=IDENTITY, tokens=TOKENS, fetch="wait"),
            LookupReply(id=0, matched=0, entry=None, lease=None, fetching=5.0),
        ),
        (
            Lookup(id=0, identity=IDENTITY, tokens=TOKENS, fetch="fetched"),
            LookupReply(id=0, matched=63, entry=ENTRY, lease=5),
        ),
        (
            FindCheckpoint(id=0, identity=IDENTITY, key="gen-1", prompt=TOKENS[:8]),
            FindCheckpointReply(id=0, matched=64, entry=ENTRY, lease=6),
        ),
        (
            FindCheckpoint(id=0, identity=IDENTITY, key="gen-2", prompt=TOKENS),
            FindCheckpointReply(id=0, matched=0, entry=None, lease=None),
        ),
        (
            ForgetCheckpoint(id=0, identity=IDENTITY, key="gen-1"),
            ForgetCheckpointReply(id=0, removed=2),
        ),
        (OpenBlocks(id=0, lease=5, first=0, count=2), OpenBlocksReply(id=0, count=2)),
        (Release(id=0, lease=5), ReleaseReply(id=0)),
        (
            Release(id=0, lease=6, damaged="data_checksum: slot at 16384: bytes do not match"),
            ReleaseReply(id=0),
        ),
        (Flush(id=0, timeout=None), FlushReply(id=0, durable=True, pending=0)),
        (Flush(id=0, timeout=0.0), FlushReply(id=0, durable=False, pending=3)),
        (
            Flush(id=0, timeout=5.0, remote=True),
            FlushReply(
                id=0,
                durable=False,
                pending=0,
                remote_pending=2,
                remote_pending_bytes=1 << 20,
                remote_dropped=1,
                remote_dropped_for=12.5,
                remote_down="connection refused",
            ),
        ),
        (
            Status(id=0),
            StatusReply(id=0, status={"entries": 3, "tiers": [{"bytes": 1.5, "name": b"x"}]}),
        ),
        (
            ListEntries(id=0, identity=None, limit=10, after=None),
            ListEntriesReply(id=0, entries=(ENTRY, ENTRY), more=True),
        ),
        (
            ListEntries(id=0, identity=DIGEST, limit=1, after="e-0000"),
            ListEntriesReply(id=0, entries=(), more=False),
        ),
        (
            Evict(id=0, entry="e-0001", identity=None, all=False),
            EvictReply(id=0, evicted=1, bytes=9),
        ),
        (Evict(id=0, entry=None, identity=DIGEST, all=False), EvictReply(id=0, evicted=0, bytes=0)),
        (Evict(id=0, entry=None, identity=None, all=True), EvictReply(id=0, evicted=2, bytes=4)),
        (
            Verify(id=0, entry="e-0001", repair=False),
            VerifyReply(id=0, problem=None, quarantined=False),
        ),
        (
            Verify(id=0, entry="e-0002", repair=True),
            VerifyReply(id=0, problem="tensor 3: checksum differs", quarantined=True),
        ),
        (
            OpenEntry(id=0, entry="e-0001"),
            OpenEntryReply(id=0, entry=ENTRY, lease=9),
        ),
        (
            Presence(id=0, identity=IDENTITY, digest=None, tokens=TOKENS),
            PresenceReply(
                id=0,
                matched=63,
                entry="e-0001",
                miss=None,
                detail=None,
                remote=None,
                remote_miss=None,
                remote_detail=None,
            ),
        ),
        (
            Presence(id=0, identity=None, digest=DIGEST, tokens=TOKENS),
            PresenceReply(
                id=0,
                matched=0,
                entry=None,
                miss="no entry",
                detail="...",
                remote=32,
                remote_miss="short",
                remote_detail="...",
            ),
        ),
        (
            Ping(id=0),
            ErrorReply(id=0, code=ErrorCode.SHUTTING_DOWN, message="bye"),
        ),
    ]
    numbered = []
    for offset, (request, reply) in enumerate(pairs):
        rid = first_id + offset
        answer = replace(reply, id=rid)
        if answer.descriptor_count():
            fds = tuple(100 * (k + 1) + rid for k in range(answer.descriptor_count()))
            answer = answer.with_fds(fds)
        numbered.append((replace(request, id=rid), answer))
    return numbered


def drain(connection: Connection) -> list[Event]:
    """Every event the connection can produce from what it holds."""
    events = []
    while (event := connection.next_event()) is not NEED_DATA:
        events.append(event)
    return events


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def connected_pair(limits: Limits = DEFAULT_LIMITS) -> tuple[Connection, Connection]:
    """A client and a server past the handshake."""
    client, server = Connection(Role.CLIENT, limits), Connection(Role.SERVER, limits)
    server.receive_data(client.send(HELLO))
    assert drain(server) == [HELLO]
    client.receive_data(server.send(HELLO_REPLY))
    assert drain(client) == [HELLO_REPLY]
    return client, server


def feed(
    connection: Connection,
    frames: Sequence[tuple[bytes, Sequence[int]]],
    chunk_sizes: Sequence[int],
) -> list[Event]:
    """Feed (frame, descriptors) pairs as one stream cut in chunks of the given sizes (cycling),
    draining events after each chunk. Each frame's descriptors arrive with the chunk holding the
    frame's first byte, as SCM_RIGHTS data does on a stream socket."""
    stream = b"".join(frame for frame, _ in frames)
    fds_at: dict[int, list[int]] = {}
    start = 0
    for frame, fds in frames:
        fds_at.setdefault(start, []).extend(fds)
        start += len(frame)
    events: list[Event] = []
    position = 0
    index = 0
    while position < len(stream):
        end = position + chunk_sizes[index % len(chunk_sizes)]
        fds = [fd for at, group in fds_at.items() if position <= at < end for fd in group]
        connection.receive_data(stream[position:end], fds)
        events.extend(drain(connection))
        position = end
        index += 1
    return events
