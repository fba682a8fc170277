"""The remote tier of one daemon, behind one façade: the context to the bucket (context.py: the
client, its health, the figures), the uploads (uploader.py) and the fetches.

While the health is down, the uploads are dropped (counted) and lookups do not ask the
bucket; the health's probe brings it back. The upload queue is journaled in the tier folder
(upload_journal): a restart offers again what a stop cut off. The server builds one when
`remote` is set and runs run() for the daemon's life.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
from kvd_protocol.messages import Lookup

from kvd.config import Config
from kvd.remote.context import RemoteContext
from kvd.remote.fetcher import Fetcher
from kvd.remote.local_tier import LocalTier
from kvd.remote.upload_journal import UploadJournal
from kvd.remote.upload_queue import Mark
from kvd.remote.uploader import Uploader
from kvd.store.tier_dir import TierDir


@dataclass(frozen=True)
class RemoteFlush:
    """How a flush of the puts and their uploads ended."""

    durable: bool  # every put accepted before it is durable
    pending: int  # puts not durable yet
    uploads: int  # uploads still pending (the restart's not offered again yet included)
    upload_bytes: int  # their bytes not known to be in the bucket
    dropped: int  # uploads dropped since the last flush answered
    dropped_for: float  # seconds since then (or since the daemon started)
    down: str | None  # the bucket is down: why (its last error); None when it is not

    @property
    def done(self) -> bool:
        """Every put durable, every upload sent, none dropped, the bucket not down."""
        return self.durable and not self.uploads and not self.dropped and self.down is None


class Remote:
    """The daemon's remote tier: built from the config and the parts of the local tier it
    uses (LocalTier); run() runs it. Its uploads listen to the local tier's notices."""

    def __init__(self, config: Config, local: LocalTier) -> None:
        self.config = config
        self._local = local
        self.context = RemoteContext(config, local.limits)
        journal = UploadJournal(TierDir(config.dir).upload_journal)
        self.uploader = Uploader(self.context, journal, local)
        self.fetcher = Fetcher(self.context, local)
        local.on_stored(self.uploader.stored)
        local.on_hit(self.uploader.hit)

    # --- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """For the daemon's life: the fetches (a lookup may start one from the first), a
        first probe (a daemon whose credentials are refused says so now, once), then the
        health's recovery and the uploads."""
        context = self.context
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.fetcher.run)
            await context.probe()
            tasks.start_soon(context.health.recover, context.probe)
            tasks.start_soon(self.uploader.run)

    def lookup_waits(self, lookup: Lookup, tenant: str) -> bool:
        """Whether a lookup is answered after the fetch it may wait for (Fetcher.waits)."""
        return self.fetcher.waits(lookup, tenant)

    async def fetch_for(self, lookup: Lookup) -> float | None:
        """A lookup's fetch: the seconds the client may wait for it, or None to answer from
        what is local now (Fetcher.wait)."""
        return await self.fetcher.wait(lookup)

    async def flush(self, timeout: float | None) -> RemoteFlush:
        """Make every entry accepted so far durable (which queues its upload, as the policy
        says), then wait until every upload queued by then is sent or dropped; all within
        timeout seconds (None: no deadline)."""
        began = time.monotonic()
        mark = Mark()  # open: the uploads of the entries the flush makes durable join it
        durable, pending = await self._local.flush(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
        uploads, nbytes, dropped, since = await self.uploader.flush(mark, left)
        health = self.context.health
        down = None if health.up else health.last_error or "down"
        return RemoteFlush(
            durable, pending, uploads, nbytes, dropped, max(0.0, time.time() - since), down
        )

    def close(self) -> None:
        self.uploader.journal.close()
        self.context.close()

    def status(self) -> dict[str, Any]:
        """The status report's `remote` section: no credential in it."""
        counters, health = self.context.counters, self.context.health
        uploader = self.uploader
        queue, journal, resumed = uploader.queue, uploader.journal, uploader.resumed
        return {
            "state": health.state.value,
            "last_error": health.last_error or None,
            "url": self.config.remote,
            "endpoint": self.config.remote_endpoint or None,
            "upload_policy": self.config.remote_upload,
            "pending_uploads": queue.pending_count,
            "pending_bytes": queue.pending_bytes,
            "uploaded_blocks": counters.uploaded_blocks,
            "uploaded_bytes": counters.uploaded_bytes,
            "already_there_blocks": counters.already_there,
            "upload_drops": queue.dropped,
            "upload_dropped_bytes": queue.dropped_bytes,
            "not_shareable": counters.not_shareable,
            "layout_mismatch": counters.layout_mismatch,
            "journal_uploads": journal.written,
            "journal_bytes": journal.size,
            "journal_problem": journal.problem,
            "restart_uploads": resumed.pending,
            "restart_reoffered": resumed.reoffered,
            "restart_gone": resumed.gone,
            "downloaded_blocks": counters.downloaded_blocks,
            "downloaded_bytes": counters.downloaded_bytes,
            "hits": counters.hits,
            "misses": sum(counters.misses.values()),
            "misses_by_reason": dict(counters.misses),
            "restore_gbps_p50": counters.fetch_gbps_p50(),
            "abandoned_requests": counters.abandoned_requests,
            "memos": self.context.memos() | self.fetcher.memos() | self.uploader.memos(),
        }
