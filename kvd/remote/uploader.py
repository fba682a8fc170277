"""Uploads: durable local entries' blocks written behind to the store, never on an engine's
path.

The tier tells of entries stored and entries a lookup hit (kvd.store.notices); the upload
policy (UPLOAD_POLICIES, the remote_upload setting) says which join the queue (upload_queue:
byte-capped, drop-oldest): `always` when stored, `second-hit` when a lookup first hits it,
`never` none. Checkpoints, untrimmable entries and entries without a whole block never do
(counted: not shareable).

One upload at a time: the uploader leases the entry (the tier's reader path: files opened
read-only, checked by size), reads its manifest's header for the identity's layout, writes
the layout once per identity (the first written wins; an entry that does not fit the one in
the store uploads nothing, said once at warning, counted), then sends each block not known
to be in the store (a HEAD first: a block another daemon sent is not sent again) with a
conditional create (412: already there, counted, not an error), at most half of
remote_requests at once, at remote_upload_rate. What the store is known to hold
is remembered (a bounded LRU of block keys), so a block is asked about once. The store down:
uploads are dropped and counted, the health says why.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Final

import anyio
from kvd_protocol.errors import EntryFormatError, ProtocolError

from kvd.logs import get_logger
from kvd.remote.layout import Layout, NotShareable, layout_of
from kvd.remote.link import StoreLink
from kvd.remote.lru import LruSet
from kvd.remote.rate_limit import TokenBucket
from kvd.remote.s3 import StoreError
from kvd.remote.upload_queue import Mark, Upload, UploadQueue
from kvd.store import entry_files
from kvd.store.blocks import Block
from kvd.store.records import EntryRecord

log = get_logger("kvd.remote.uploader")

OWNER: Final = 0  # the uploads' leases in the tier (connections count from 1)
BLOCK_BATCH: Final = 16  # block files of one upload open at once
OFFERED: Final = 1 << 16  # entry ids remembered as offered once


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


class Uploader:
    """The upload queue and the task that drains it (run), fed by the tier's notices."""

    def __init__(self, link: StoreLink) -> None:
        config = link.config
        self.link = link
        self.policy = UPLOAD_POLICIES[config.remote_upload]
        self.queue = UploadQueue(config.remote_upload_bytes)
        self.known = link.known  # (identity, block hash) of blocks known in the store
        self._offered: LruSet[str] = LruSet(OFFERED)
        self._mismatched: set[str] = set()  # identities whose stored layout does not fit
        self._rate = TokenBucket(config.remote_upload_rate)
        self._sends = max(1, config.remote_requests // 2)
        self._reported_drops = 0  # queue.dropped when the last flush answered
        self._work = anyio.Event()  # pulsed when an upload is queued
        self._changed = anyio.Event()  # pulsed when an upload leaves the queue

    # --- the tier's notices (on the event loop: only queue) ---------------------------------

    def stored(self, record: EntryRecord) -> None:
        if self.policy.when_stored:
            self._offer(record)

    def hit(self, record: EntryRecord) -> None:
        if self.policy.when_hit:
            self._offer(record)

    def _offer(self, record: EntryRecord) -> None:
        """Queue the entry's blocks not known to be in the store, once per entry."""
        if record.id in self._offered:
            return
        self._offered.add(record.id)
        counters = self.link.counters
        shareable = record.block_hashes and record.trimmable and record.checkpoint_key is None
        if not shareable or record.prefill_checkpoint:
            counters.not_shareable += 1
            return
        if record.digest in self._mismatched:
            counters.layout_mismatch += 1
            return
        blocks = tuple(h for h in record.block_hashes if (record.digest, h) not in self.known)
        if not blocks and record.digest in self.link.layouts:
            return  # all there already
        if not self.link.health.up:  # the health said why, once
            self.queue.drop_at_once(len(blocks) * record.block_size)
            return
        dropped = self.queue.add(record.id, record.digest, blocks, record.block_size)
        for upload in dropped or ():
            log.info("remote_upload_dropped", entry=upload.entry, bytes=upload.left, why="cap")
        self._work.set()
        self._work = anyio.Event()

    # --- sending ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Send queued uploads, oldest first, one at a time. Runs forever."""
        while True:
            upload = self.queue.next()
            if upload is None:
                await self._work.wait()
                continue
            sent = False
            try:
                sent = await self._send(upload)
            finally:
                self.queue.done(upload, dropped=not sent)
                self._changed.set()
                self._changed = anyio.Event()

    async def _send(self, upload: Upload) -> bool:
        """One entry's layout and blocks, under a lease on the entry; False when it was
        dropped (the store down or failing, the entry gone before its turn)."""
        link = self.link
        leased = None if not link.health.up else link.tier.lease_entry(OWNER, upload.entry)
        if leased is None:
            return False
        record, lease, fd = leased
        try:
            try:
                header = await anyio.to_thread.run_sync(
                    entry_files.entry_head, fd, record.id, link.tier.limits
                )
            finally:
                os.close(fd)
            layout = layout_of(header)
            if await self._fits(layout):
                await self._send_blocks(upload, record, lease)
        except NotShareable as exc:
            log.info("remote_not_shareable", entry=record.id, why=str(exc))
            link.counters.not_shareable += 1
        except (StoreError, OSError, EntryFormatError, ProtocolError) as exc:
            if not isinstance(exc, StoreError):  # the health has a store's failure
                log.warning("remote_upload_failed", entry=record.id, error=str(exc))
            return False
        finally:
            with contextlib.suppress(ProtocolError):  # expired (lease_max_age) meanwhile
                link.tier.end_lease(OWNER, lease)
        return True

    async def _fits(self, layout: Layout) -> bool:
        """Whether the identity's layout in the store is this one's (writing it if there is
        none); said once at warning per identity when not."""
        digest = layout.identity
        if digest not in self._mismatched:
            stored = self.link.layouts.get(digest) or await self.link.write_layout(layout)
            if stored is not None and stored.fits(layout):
                return True
            self._mismatched.add(digest)
            log.warning(
                "remote_layout_mismatch",
                identity=digest,
                block_tokens=layout.block_tokens,
                stored_block_tokens=None if stored is None else stored.block_tokens,
                why="the store's layout for this identity has other blocks or layers: its "
                "entries stay local",
            )
        self.link.counters.layout_mismatch += 1
        return False

    async def _send_blocks(self, upload: Upload, record: EntryRecord, lease: int) -> None:
        """The upload's blocks, BLOCK_BATCH files open at a time; StoreError at the first
        failure (the sends under way end first)."""
        tier, digest = self.link.tier, record.digest
        wanted = set(upload.block_hashes)
        blocks = tier.blocks_of(record)
        for first in range(0, len(blocks), BLOCK_BATCH):
            batch = blocks[first : first + BLOCK_BATCH]
            unsent = [
                i
                for i, block in enumerate(batch)
                if block.hash in wanted and (digest, block.hash) not in self.known
            ]
            if not unsent:
                continue
            fds = tier.open_blocks(OWNER, lease, first, len(batch))
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
        link, digest, block_hash, size = self.link, upload.digest, block.hash, block.size
        key = link.block_key(digest, block_hash)
        async with limiter:
            if failures:
                return
            try:
                created = await link.call(lambda store: store.head(key)) is None
                if created:
                    await self._rate.wait_for(size)
                    created = await link.call(lambda store: store.put_file_if_absent(key, fd, size))
            except (StoreError, OSError, ValueError) as exc:
                failures.append(exc)
                return
        counters = link.counters
        if created:
            counters.uploaded_blocks += 1
            counters.uploaded_bytes += size
        else:
            counters.already_there += 1
        self.known.add((digest, block_hash))
        self.queue.sent(upload, size)

    async def flush(self, mark: Mark, timeout: float | None) -> tuple[int, int, int]:
        """Wait until every upload of the mark (closed now) is sent or dropped, up to timeout
        seconds: (uploads left, their bytes, uploads dropped since the last flush answered:
        before this one began too, so that no drop goes unsaid)."""
        self.queue.close(mark)
        with anyio.move_on_after(timeout):
            while self.queue.left_of(mark)[0]:
                await self._changed.wait()
        dropped, self._reported_drops = (
            self.queue.dropped - self._reported_drops,
            self.queue.dropped,
        )
        return (*self.queue.left_of(mark), dropped)
