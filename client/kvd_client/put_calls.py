"""The put, written once for both clients (calls.py says how a call runs): planned for the
daemon as the link knows it (_PutContent.planned), then sent (_send_put): begin, the blocks the
daemon does not hold, the staging file, commit; aborted on any failure."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Final

from kvd_protocol.entry import (
    Checkpoint,
    EntryPlan,
    LayerSpec,
    MetaValue,
    TensorSpec,
    plan_entry,
    plan_manifest,
)
from kvd_protocol.errors import DaemonUnavailableError
from kvd_protocol.identity import Identity
from kvd_protocol.messages import (
    BLOCKS_FEATURE,
    ENGINE_DROPS_FEATURE,
    MAX_BLOCK_BATCH,
    PREFILL_COST_FEATURE,
    RETENTION_FEATURE,
    DropReport,
    PutAbort,
    PutAbortReply,
    PutBegin,
    PutBeginReply,
    PutBlocks,
    PutBlocksReply,
    PutCommit,
    PutCommitReply,
    Retention,
)
from kvd_protocol.tokens import TOKEN_BYTES, pack_tokens

from . import block_io, entry_io
from .calls import SKIPPED, UNAVAILABLE, Blocking, Call, Exchange, claimed, expect, log, scoped
from .entry_io import TensorData
from .link import DaemonError, Link
from .results import PutOutcome, TicketState
from .workers import Descriptors


def put_entry(
    link: Link,
    identity: Identity,
    tokens: bytes | Sequence[int],
    layers: Sequence[LayerSpec],
    tensors: Sequence[TensorData],
    *,
    created: float,
    min_reuse: int,
    checkpoint: Checkpoint | None,
    meta: Mapping[str, MetaValue] | None,
    dropped: DropReport | None = None,
    retention: Retention | None = None,
) -> Call[PutOutcome]:
    """Plan, begin, write into the staging descriptors, commit (with dropped, to a daemon
    that offers "engine_drops": a put that gets no ticket tells nothing; with retention, to
    one that offers "retention"). Caller mistakes (a
    layout the planner rejects, a tensor that does not fit its slot) raise before the daemon
    is asked.

    Cut into blocks (a manifest, FORMAT.md "Version 2") when the daemon offers blocks, the
    client's block size is not 0 and some layer is blocked with a whole block of tokens; the
    daemon says how many leading blocks it holds already, and only the others are written.
    A cut tensor may come as a block_io.CutCopy that leaves out blocks taken to be held: a
    daemon that holds fewer has the put aborted, raising block_io.BlocksNotHeld."""
    packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    content = _PutContent(identity, packed, layers, tensors, created, min_reuse, checkpoint, meta)
    while True:  # twice at most: planned again once the daemon has first answered
        started = time.perf_counter()
        planned = content.planned(link)
        if link.breaker is not None and link.breaker.skip_put():
            return _not_begun(link, DaemonUnavailableError(SKIPPED))
        if link.server is not None:
            return (yield from _send_put(link, planned, started, dropped, retention))
        try:  # its word: the tenant the header names the identity under, its features
            yield from scoped(link, identity)
        except (DaemonUnavailableError, DaemonError) as exc:
            return _not_begun(link, exc)


@dataclass(frozen=True)
class _PlannedPut:
    """A put laid out for the daemon as the link knows it: what put_begin asks for, and how
    the staging file and the blocks are written."""

    identity: Identity  # as the daemon names it: the header says it so
    tokens: bytes
    size: int  # of the staging file
    write: Callable[[int], None]  # the staging file's bytes, into its descriptor
    blocks: block_io.BlockWriter | None  # a manifest's blocks; None for a version 1 entry


@dataclass(frozen=True)
class _PutContent:
    """What a put stores, as the engine gave it: planned for the daemon as the link knows it."""

    identity: Identity
    tokens: bytes
    layers: Sequence[LayerSpec]
    tensors: Sequence[TensorData]
    created: float
    min_reuse: int
    checkpoint: Checkpoint | None
    meta: Mapping[str, MetaValue] | None

    def planned(self, link: Link) -> _PlannedPut:
        """The put's layout: cut into blocks when _blocks_for says so, else a version 1
        entry. Raises ValueError (the planner's) or TensorLayoutError for a caller's mistake."""
        named = link.scope(self.identity)
        if not _blocks_for(link, self.tokens, self.layers):
            plan = plan_entry(
                named,
                self.tokens,
                self.layers,
                created=self.created,
                min_reuse=self.min_reuse,
                checkpoint=self.checkpoint,
                meta=self.meta,
                limits=link.limits,
            )
            views = _whole_views(link, plan, self.layers, self.tensors)
            write = partial(entry_io.write_entry, plan=plan, views=views)
            return _PlannedPut(named, self.tokens, plan.file_size, write, None)
        manifest = plan_manifest(
            named,
            self.tokens,
            self.layers,
            block_tokens=link.block_tokens,
            created=self.created,
            min_reuse=self.min_reuse,
            checkpoint=self.checkpoint,
            meta=self.meta,
            limits=link.limits,
        )
        sources = block_io.sources(_whole_slots(self.layers), self.tensors)
        writer = block_io.BlockWriter(manifest, sources)
        return _PlannedPut(
            named, self.tokens, manifest.entry.file_size, writer.write_manifest, writer
        )


def _send_put(
    link: Link,
    put: _PlannedPut,
    started: float,
    dropped: DropReport | None,
    retention: Retention | None,
) -> Call[PutOutcome]:
    """Begin the planned put, write its blocks the daemon does not hold and its staging file,
    commit; given up (aborted) on any failure. started: when it was planned (perf_counter),
    for the commit's store_ms."""
    writer = put.blocks
    hashes = b"".join(writer.plan.hashes) if writer is not None else b""
    request = PutBegin(
        id=link.next_id(),
        identity=put.identity,
        tokens=put.tokens,
        size=put.size,
        prefill_cost=link.prefill_cost if link.offers(PREFILL_COST_FEATURE) else 0.0,
        blocks=hashes,
        block_tokens=link.block_tokens if hashes else 0,
        block_size=writer.plan.block_size if writer is not None else 0,
        retention=retention if link.offers(RETENTION_FEATURE) else None,
    )
    try:
        begin = expect((yield Exchange(request)), PutBeginReply)
    except (DaemonUnavailableError, DaemonError) as exc:
        return _not_begun(link, exc)
    epoch = link.epoch
    if begin.skip is not None:
        return PutOutcome(None, TicketState("stored", begin.skip), epoch)
    assert begin.fd is not None  # the Connection delivers the descriptor a begin declares
    staging = Descriptors([begin.fd])
    try:
        try:
            if writer is not None:
                link.stats.blocks_held += begin.held
                yield from put_blocks(link, begin.put, epoch, begin.held, writer)
            yield Blocking(staging.lent(partial(put.write, begin.fd)))
            link.stats.bytes_written += put.size
        finally:
            staging.release()  # a put given up mid-write: closed when the write ends
        took = (time.perf_counter() - started) * 1000
        store_ms = took if link.offers("restore_report") else None
        commit = PutCommit(
            id=link.next_id(),
            put=begin.put,
            store_ms=store_ms,
            dropped=dropped if link.offers(ENGINE_DROPS_FEATURE) else None,
        )
        ticket = expect((yield Exchange(commit, epoch=epoch)), PutCommitReply).ticket
    except (DaemonUnavailableError, DaemonError, OSError) as exc:
        yield from _abort(link, begin.put, epoch)
        return _not_begun(link, exc, epoch)
    except Exception:
        yield from _abort(link, begin.put, epoch)
        raise
    return PutOutcome(ticket, TicketState("pending"), epoch)


def _not_begun(link: Link, exc: Exception, epoch: int | None = None) -> PutOutcome:
    """A put the daemon could not be asked for or finish (unavailable, counted) or that it
    refused or that failed here (failed); epoch: the connection's it was begun on."""
    epoch = link.epoch if epoch is None else epoch
    if isinstance(exc, DaemonUnavailableError):
        link.stats.unavailable_puts += 1
        return PutOutcome(None, TicketState(UNAVAILABLE, str(exc)), epoch)
    return PutOutcome(None, TicketState("failed", str(exc)), epoch)


def _blocks_for(link: Link, tokens: bytes, layers: Sequence[LayerSpec]) -> bool:
    """Whether a put of these layers is cut into blocks (see put_entry)."""
    return (
        link.block_tokens > 0
        and link.offers(BLOCKS_FEATURE)
        and len(tokens) // TOKEN_BYTES >= link.block_tokens
        and any(layer.blocked for layer in layers)
    )


def _whole_views(
    link: Link, plan: EntryPlan, layers: Sequence[LayerSpec], tensors: Sequence[TensorData]
) -> list[entry_io.Pieces]:
    """The byte views of a version 1 entry's tensors, checked (TensorLayoutError) also before
    the daemon's first word; a snapshot that left out blocks (block_io.CutCopy) is made whole
    only after it: until then the put is planned again once the daemon answers."""
    if link.server is None:
        block_io.sources(_whole_slots(layers), tensors)
        return []
    return entry_io.tensor_views(plan, block_io.whole(tensors))


def _whole_slots(layers: Sequence[LayerSpec]) -> list[TensorSpec]:
    return [tensor for layer in layers for tensor in layer.tensors]


def put_blocks(
    link: Link, put: int, epoch: int, held_blocks: int, writer: block_io.BlockWriter
) -> Call[None]:
    """Write blocks held_blocks.. of a begun put: their staging files asked for in batches
    (batch_blocks), each batch written (Blocking) and closed before the next is asked for (or,
    when the put is given up mid-batch, once its last write has ended): the daemon checks it
    meanwhile. Raises BlocksNotHeld first if the writer lacks blocks the daemon does not
    hold."""
    writer.check_held(held_blocks)
    count = len(writer.plan.hashes)
    per_batch = batch_blocks(writer.plan.block_size)
    for first in range(held_blocks, count, per_batch):
        batch = min(per_batch, count - first)
        request = PutBlocks(id=link.next_id(), put=put, first=first, count=batch)
        reply = expect((yield Exchange(request, epoch=epoch)), PutBlocksReply)
        with Descriptors(claimed(reply, batch)) as fds:
            yield Blocking(partial(writer.write_blocks, first, fds))
            link.stats.blocks_written += batch
            link.stats.bytes_written += batch * writer.plan.block_size


# A put's blocks are asked for in batches of at least this many bytes, and of a block for each
# writer thread at least: the daemon checks a batch's blocks (closed once written) while the
# next batch is written, so that the commit is left the last batch to check; a batch's round
# trip is a small part of its writing.
BATCH_BYTES: Final = 64 << 20


def batch_blocks(block_size: int) -> int:
    """How many blocks of block_size bytes a put_blocks asks for at once."""
    wanted = max(block_io.WRITERS, -(-BATCH_BYTES // max(1, block_size)))
    return min(MAX_BLOCK_BATCH, wanted)


def _abort(link: Link, put: int, epoch: int) -> Call[None]:
    """Tell the daemon to discard a put; it may be gone already, which is as good."""
    try:
        request = PutAbort(id=link.next_id(), put=put)
        expect((yield Exchange(request, epoch=epoch)), PutAbortReply)
    except (DaemonUnavailableError, DaemonError) as exc:
        log.debug("put_abort of put %d not confirmed: %s", put, exc)
