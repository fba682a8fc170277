"""Uploads: durable local entries' blocks written behind to the bucket, never on an engine's
path.

The tier tells of entries stored and entries a lookup hit (kvd.store.notices); the upload
policy (UPLOAD_POLICIES, the remote_upload setting) says which join the queue (upload_queue:
byte-capped, drop-oldest): `always` when stored, `second-hit` when a lookup first hits it,
`never` none. Checkpoints, untrimmable entries and entries without a whole block never do
(counted: not shareable).

One upload at a time: the uploader leases the entry (the tier's reader path: files opened
read-only, checked by size), reads its manifest's header for the identity's layout, writes
the layout once per identity (the first written wins; an entry that does not fit the one in
the bucket uploads nothing, said once at warning, counted), then sends each block not known
to be in the bucket (a HEAD first: a block another daemon sent is not sent again) with a
conditional create (412: already there, counted, not an error), at most half of
remote_requests at once, at remote_upload_rate. What the bucket is known to hold
is remembered (a bounded LRU of block keys), so a block is asked about once. The bucket down:
uploads are dropped and counted, the health says why.

The queue is journaled (upload_journal): each upload that joins it and leaves it (sent whole,
or counted dropped) is noted, and an upload a stop cut off (in flight or queued) stays in the
journal. At start (resume, once the tier has listed its folder) the uploads the journal
holds are offered again, oldest first, without waiting for the policy's event (under the
policy `never` they are counted dropped); those whose entry is gone meanwhile are counted
dropped (why: gone). A journal found damaged keeps what it could read, and the newest
shareable entries, as many as the queue's cap holds, are offered again besides. A flush
waits for the resume. What the bucket's answers provoke again and again is logged
rate-limited (kvd.logs.RateLimited).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Final

import anyio
from kvd_protocol.errors import EntryFormatError, ProtocolError

from kvd.logs import RateLimited, get_logger
from kvd.remote.bucket import BucketError
from kvd.remote.context import RemoteContext
from kvd.remote.layout import Layout, NotShareable, layout_of
from kvd.remote.local_tier import LocalTier
from kvd.remote.lru import LruSet
from kvd.remote.rate_limit import TokenBucket
from kvd.remote.upload_journal import UploadJournal
from kvd.remote.upload_queue import Mark, Upload, UploadQueue
from kvd.store import entry_files
from kvd.store.blocks import Block
from kvd.store.records import EntryRecord

log = get_logger("kvd.remote.uploader")
limited = RateLimited(log)  # what the bucket's answers (and the entries') provoke at will

OWNER: Final = 0  # the uploads' leases in the tier (connections count from 1)
BLOCK_BATCH: Final = 16  # block files of one upload open at once
OFFERED: Final = 1 << 16  # entry ids remembered as offered once


@dataclass
class Resumed:
    """What start-up found of the uploads a stop cut off (the journal's figures)."""

    pending: int = 0  # uploads the journal had: pending from before this start
    reoffered: int = 0  # of them offered again (queued)
    gone: int = 0  # of them dropped: their entry gone meanwhile


@dataclass(frozen=True)
class UploadPolicy:
    """When an entry's blocks join the upload queue."""

    when_stored: bool
    when_hit: bool


# The upload policies by setting value (config.REMOTE_UPLOAD_POLICY_NAMES).
UPLOAD_POLICIES: Final[Mapping[str, UploadPolicy]] = {
    "always": UploadPolicy(when_stored=True, when_hit=False),
    "second-hit": UploadPolicy(when_stored=False, when_hit=True),
    "never": UploadPolicy(when_stored=False, when_hit=False),
}


def shareable(record: EntryRecord) -> bool:
    """Whether an entry's blocks may go to the bucket: whole blocks of an entry that is not a
    checkpoint and whose every layer is blocked (trimmable)."""
    return (
        bool(record.block_hashes)
        and record.trimmable
        and record.checkpoint_key is None
        and not record.prefill_checkpoint
    )


class Uploader:
    """The upload queue, its journal and the task that drains it (run), fed by the tier's
    notices."""

    def __init__(self, context: RemoteContext, journal: UploadJournal, local: LocalTier) -> None:
        config = context.config
        self.context = context
        self._local = local
        self.journal = journal
        self.policy = UPLOAD_POLICIES[config.remote_upload]
        self.queue = UploadQueue(config.remote_upload_bytes)
        self.known = context.known  # (identity, block hash) of blocks known in the bucket
        found = journal.load()
        self.damaged = found.damage  # what ended the journal's reading at start
        self.resumed = Resumed(pending=len(found.pending))
        self._unresumed = dict(found.pending)  # the journal's, not offered again yet
        self._resuming = anyio.Event()  # set once they are
        self._offered: LruSet[str] = LruSet(OFFERED)
        # identities whose stored layout does not fit (the first of them, past OFFERED)
        self._mismatched: LruSet[str] = LruSet(OFFERED)
        self._rate = TokenBucket(config.remote_upload_rate)
        self._sends = max(1, config.remote_requests // 2)
        self._reported_drops = 0  # queue.dropped when the last flush answered
        self.reported_at = time.time()  # when the last flush answered (or the start)
        self._work = anyio.Event()  # pulsed when an upload is queued
        self._changed = anyio.Event()  # pulsed when an upload leaves the queue

    def memos(self) -> dict[str, dict[str, int]]:
        """The sizes and caps of what the uploads remember (the status's figures)."""
        return {
            "offered_entries": self._offered.figures(),
            "mismatched_identities": self._mismatched.figures(),
        }

    # --- the tier's notices (on the event loop: only queue) ---------------------------------

    def stored(self, record: EntryRecord) -> None:
        if self.policy.when_stored:
            self._offer(record)

    def hit(self, record: EntryRecord) -> None:
        if self.policy.when_hit:
            self._offer(record)

    def _offer(self, record: EntryRecord) -> bool:
        """Queue the entry's blocks not known to be in the bucket, once per entry; whether
        it joined the queue (or is in it)."""
        if record.id in self._offered:
            return self.queue.holds(record.id)
        self._offered.add(record.id)
        counters = self.context.counters
        if not shareable(record):
            counters.not_shareable += 1
            return False
        if record.digest in self._mismatched:
            counters.layout_mismatch += 1
            return False
        blocks = tuple(h for h in record.block_hashes if (record.digest, h) not in self.known)
        if not blocks and record.digest in self.context.layouts:
            return False  # all there already
        if not self.context.health.up:  # the health said why, once
            self.queue.drop_at_once(len(blocks) * record.block_size)
            return False
        dropped = self.queue.add(record.id, record.digest, blocks, record.block_size)
        if blocks:  # an upload of the layout alone loses nothing if a stop cuts it off
            self.journal.added(record.id, len(blocks) * record.block_size)
        for upload in dropped or ():
            self._dropped(upload.entry, upload.left, "cap")
        self._work.set()
        self._work = anyio.Event()
        return True

    def _dropped(self, entry: str, nbytes: int, why: str) -> None:
        """An upload left the queue unsent (counted by the queue already): said, unjournaled."""
        self.journal.left(entry)
        limited.info("remote_upload_dropped", entry=entry, bytes=nbytes, why=why)

    # --- start-up ---------------------------------------------------------------------------

    async def resume(self) -> None:
        """Offer again the uploads the journal had at start (see the module's docstring),
        once the tier has listed its directory; said at info when there were any."""
        await self._local.settled()
        resumed = self.resumed
        uploads = self.policy.when_stored or self.policy.when_hit
        while self._unresumed:
            entry = next(iter(self._unresumed))
            nbytes = self._unresumed.pop(entry)
            record = self._local.view.entry(entry)
            if record is None or not uploads:
                self.queue.drop_at_once(nbytes)
                resumed.gone += record is None
                self._dropped(entry, nbytes, "gone" if record is None else "policy never")
            elif self._offer(record):
                resumed.reoffered += 1
            else:  # not shareable now, all in the bucket already, or the bucket down (counted)
                self.journal.left(entry)
        if self.damaged is not None and uploads:
            self._offer_newest()
        self._resuming.set()
        if resumed.pending or self.damaged is not None:
            log.info(
                "remote_uploads_resumed",
                pending=resumed.pending,
                reoffered=resumed.reoffered,
                gone=resumed.gone,
                journal_damaged=self.damaged,
            )

    def _offer_newest(self) -> None:
        """A damaged journal: the newest shareable entries, as many as the queue's cap holds,
        offered again (a block the bucket holds costs a HEAD, not its bytes)."""
        room = self.queue.cap_bytes - self.queue.pending_bytes
        newest = sorted(self._local.view.stored_entries(), key=lambda r: r.created, reverse=True)
        chosen = []
        for record in newest:
            nbytes = len(record.block_hashes) * record.block_size
            if not shareable(record) or nbytes > room:
                continue
            room -= nbytes
            chosen.append(record)
        for record in reversed(chosen):  # oldest first, as they came
            self._offer(record)

    # --- sending ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Resume (once), then send queued uploads, oldest first, one at a time, and keep
        the journal. Runs forever."""
        if not self._resuming.is_set():
            await self.resume()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.journal.run)
            await self._drain()

    async def _drain(self) -> None:
        while True:
            upload = self.queue.next()
            if upload is None:
                await self._work.wait()
                continue
            try:
                dropped = await self._send(upload)
                # A stop may end the calls under way: their failure is the stop's, and the
                # upload stays in the journal for the next start.
                await anyio.lowlevel.checkpoint()
            except anyio.get_cancelled_exc_class():
                raise
            except Exception:
                self._finish(upload, "failed")
                raise
            self._finish(upload, dropped)

    def _finish(self, upload: Upload, dropped: str | None) -> None:
        """The upload in flight is done: sent whole (dropped None), or dropped (why)."""
        self.queue.done(upload, dropped=dropped is not None)
        if dropped is None:
            self.journal.left(upload.entry)
        else:
            self._dropped(upload.entry, upload.left, dropped)
        self._changed.set()
        self._changed = anyio.Event()

    async def _send(self, upload: Upload) -> str | None:
        """One entry's layout and blocks, under a lease on the entry; None when sent, else
        why it was dropped (the bucket down or failing, the entry gone before its turn)."""
        context = self.context
        if not context.health.up:
            return "store down"
        leased = self._local.reads.lease_entry(OWNER, upload.entry)
        if leased is None:
            return "gone"
        record, lease, fd = leased
        try:
            try:
                header = await anyio.to_thread.run_sync(
                    entry_files.entry_head, fd, record.id, self._local.limits
                )
            finally:
                os.close(fd)
            layout = layout_of(header)
            if await self._fits(layout):
                await self._send_blocks(upload, record, lease)
        except NotShareable as exc:
            limited.info("remote_not_shareable", entry=record.id, why=str(exc))
            context.counters.not_shareable += 1
        except BucketError:
            return "store failed"  # the health has the bucket's failure
        except (OSError, ValueError, EntryFormatError, ProtocolError) as exc:
            limited.warning("remote_upload_failed", entry=record.id, error=str(exc))
            return "failed"
        finally:
            with contextlib.suppress(ProtocolError):  # expired (lease_max_age) meanwhile
                self._local.reads.end_lease(OWNER, lease)
        return None

    async def _fits(self, layout: Layout) -> bool:
        """Whether the identity's layout in the bucket is this one's (writing it if there is
        none); said once at warning per identity when not."""
        digest = layout.digest
        if digest not in self._mismatched:
            stored = self.context.layouts.get(digest) or await self.context.write_layout(layout)
            if stored is not None and stored.fits(layout):
                return True
            self._mismatched.add(digest)
            limited.warning(
                "remote_layout_mismatch",
                identity=digest,
                block_tokens=layout.block_tokens,
                stored_block_tokens=None if stored is None else stored.block_tokens,
                why="the bucket's layout for this identity has other blocks or layers: its "
                "entries stay local",
            )
        self.context.counters.layout_mismatch += 1
        return False

    async def _send_blocks(self, upload: Upload, record: EntryRecord, lease: int) -> None:
        """The upload's blocks, BLOCK_BATCH files open at a time; BucketError at the first
        failure (the sends under way end first)."""
        local, digest = self._local, record.digest
        wanted = set(upload.block_hashes)
        blocks = local.view.blocks_of(record)
        for first in range(0, len(blocks), BLOCK_BATCH):
            batch = blocks[first : first + BLOCK_BATCH]
            unsent = [
                i
                for i, block in enumerate(batch)
                if block.hash in wanted and (digest, block.hash) not in self.known
            ]
            if not unsent:
                continue
            fds = local.reads.open_blocks(OWNER, lease, first, len(batch))
            failures: list[BaseException] = []
            try:
                async with anyio.create_task_group() as sends:
                    limiter = anyio.CapacityLimiter(self._sends)
                    send = partial(self._send_block, limiter=limiter, failures=failures)
                    for i in unsent:
                        sends.start_soon(send, upload, batch[i], fds[i])
            finally:
                for fd in fds:
                    os.close(fd)
            if failures:
                raise failures[0]

    async def _send_block(
        self,
        upload: Upload,
        block: Block,
        fd: int,
        *,
        limiter: anyio.CapacityLimiter,
        failures: list[BaseException],
    ) -> None:
        """One block: a HEAD first (another daemon of the identity may have sent it: its
        bytes need not go again), else a conditional create. A failure is kept in failures
        (and the block is not sent when one came before)."""
        context, digest, block_hash, size = self.context, upload.digest, block.hash, block.size
        key = context.block_key(digest, block_hash)
        async with limiter:
            if failures:
                return
            try:
                created = (
                    await context.call(lambda bucket, by: bucket.head(key, deadline=by)) is None
                )
                if created:
                    await self._rate.wait_for(size)
                    created = await context.call(
                        lambda bucket, by: bucket.put_file_if_absent(key, fd, size, deadline=by)
                    )
            except (BucketError, OSError, ValueError) as exc:
                failures.append(exc)
                return
        counters = context.counters
        if created:
            counters.uploaded_blocks += 1
            counters.uploaded_bytes += size
        else:
            counters.already_there += 1
        self.known.add((digest, block_hash))
        self.queue.sent(upload, size)

    async def flush(self, mark: Mark, timeout: float | None) -> tuple[int, int, int, float]:
        """Wait until the uploads from before the restart are offered again, then until every
        upload of the mark (closed then) is sent or dropped, up to timeout seconds: (uploads
        left, their bytes, uploads dropped since the last flush answered: before this one
        began too, so that no drop goes unsaid, and when that was: the start for the first)."""
        with anyio.move_on_after(timeout):
            await self._resuming.wait()
            self.queue.close(mark)
            while self.queue.left_of(mark)[0]:
                await self._changed.wait()
        if not self._resuming.is_set():
            self.queue.close(mark)
        left, nbytes = self.queue.left_of(mark)
        left += len(self._unresumed)
        nbytes += sum(self._unresumed.values())
        dropped, self._reported_drops = (
            self.queue.dropped - self._reported_drops,
            self.queue.dropped,
        )
        since, self.reported_at = self.reported_at, time.time()
        return left, nbytes, dropped, since
