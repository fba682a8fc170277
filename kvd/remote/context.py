"""The daemon's context to the bucket: the client, its health, the figures; what the uploads and
the fetches share.

Every bucket call goes through call(): a worker thread under one limiter (remote_requests at
once for the whole daemon), within a deadline on its whole duration (remote_request_timeout,
or less: a fetch gives what is left of its own), its outcome told to the health. A call whose
caller is cancelled (a fetch out of time, the daemon stopping) is not waited for: its
connection is shut down at once (deadlines.Interrupt), its thread abandoned and counted, its
limiter token given back. A bucket that asks to slow down (BucketBusy) is asked again once the
health's pause has passed, within the caller's deadline when it gave one, else up to
BUSY_PATIENCE_S; one that refuses the credentials is asked again at once if reading them again
gave others (a key rotated, a session token renewed).

What both paths learn of the bucket is kept here, each in a bounded LRU (lru.py), whatever the
bucket serves and however many identities clients name: the identities' layouts read or
written (capped by the memory they take), the layouts refused (not downloaded again for a
while), the blocks known to be in the bucket and the blocks found damaged (with the chain each
ends). A layout is at most LAYOUT_LIMIT bytes, decoded in a worker thread, one at a time
(layout.py bounds what it may hold), never on the event loop.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

import anyio
from kvd_protocol.limits import Limits

from kvd.config import Config
from kvd.logs import RateLimited, get_logger
from kvd.remote import keys
from kvd.remote.bucket import (
    Bucket,
    BucketAuthError,
    BucketBusy,
    BucketClockSkewed,
    BucketError,
    ObjectTooLarge,
)
from kvd.remote.credential_source import CredentialSource
from kvd.remote.deadlines import Interrupt
from kvd.remote.health import Health
from kvd.remote.layout import Layout, LayoutError, decode_layout, encode_layout
from kvd.remote.lru import LruMap, LruSet

log = get_logger("kvd.remote")
limited = RateLimited(log)  # what the bucket's objects provoke at will

T = TypeVar("T")

LAYOUT_LIMIT: Final = 1 << 20  # bytes: a layout of 4096 layers is a few hundred KiB
RATES_KEPT: Final = 256  # fetch rates the p50 is taken over, the newest
KNOWN_BLOCKS: Final = 1 << 16  # block keys remembered as in the bucket (~150 bytes each)
KNOWN_MAX_AGE: Final = 3600.0  # seconds: far shorter than any lifecycle expiry (days)
BUSY_PATIENCE_S: Final = 120.0  # a call without a deadline, asked to slow down for longer, fails
LAYOUT_MEMORY: Final = 32 << 20  # bytes the layouts kept may take, estimated (~50 KiB each)
DECODED_PER_BYTE: Final = 16  # a decoded layout takes 8 to 15 times its size in the bucket
REFUSED_LAYOUTS: Final = 1024  # identities whose layout was refused, not read again for
REFUSED_LAYOUT_SECONDS: Final = 600.0  # (a layout never changes: written once)
DAMAGED_BLOCKS: Final = 1024  # blocks found damaged, each ending a chain no probe passes


def split_url(url: str) -> tuple[str, str]:
    """The bucket and key prefix of `s3://BUCKET/PREFIX` (config.remote, checked there)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix


@dataclass
class RemoteCounters:
    """What the remote tier did since the daemon started (the status report's figures)."""

    uploaded_blocks: int = 0
    uploaded_bytes: int = 0
    already_there: int = 0  # blocks a conditional create found in the bucket (412)
    not_shareable: int = 0  # entries whose blocks stay local (checkpoints, hybrids, ...)
    layout_mismatch: int = 0  # entries that do not fit their identity's layout in the bucket
    downloaded_blocks: int = 0
    downloaded_bytes: int = 0
    hits: int = 0  # fetches committed
    abandoned_requests: int = 0  # bucket calls under way whose caller was cancelled
    misses: Counter[str] = field(default_factory=Counter)  # by reason
    fetch_rates: deque[float] = field(default_factory=lambda: deque(maxlen=RATES_KEPT))

    def fetch_gbps_p50(self) -> float | None:
        """The median of the recent fetches' GB/s (probe + fetch + check + commit)."""
        return statistics.median(self.fetch_rates) if self.fetch_rates else None


class RemoteContext:
    """The bucket as the uploads and fetches see it; built from the config and the local
    tier's limits (a layout is read within them)."""

    def __init__(self, config: Config, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.bucket_name, self.prefix = split_url(config.remote)
        self.credentials = CredentialSource(config.remote_credentials_file, os.environ)
        self.health = Health(credentials_changed=self.credentials.changed)
        self.limiter = anyio.CapacityLimiter(config.remote_requests)
        self.counters = RemoteCounters()
        # identity digest -> the layout in the bucket, weighed by the memory it takes
        self.layouts: LruMap[str, Layout] = LruMap(LAYOUT_MEMORY)
        self.refused_layouts: LruSet[str] = LruSet(REFUSED_LAYOUTS, REFUSED_LAYOUT_SECONDS)
        # (digest, block hash) of blocks known to be in the bucket; forgotten after a while, so
        # that a block the bucket expired (a lifecycle rule) is sent again.
        self.known: LruSet[tuple[str, bytes]] = LruSet(KNOWN_BLOCKS, KNOWN_MAX_AGE)
        # (digest, block hash) of blocks found damaged in the bucket: a block is never
        # overwritten, so it stays damaged until the bucket expires it.
        self.damaged: LruSet[tuple[str, bytes]] = LruSet(DAMAGED_BLOCKS, KNOWN_MAX_AGE)
        self.bucket: Bucket | None = None  # made by the first call (credentials read then)
        self._decoding = anyio.CapacityLimiter(1)  # layouts decoded at once: one's memory

    async def call(self, request: Callable[[Bucket, float], T], deadline: float | None = None) -> T:
        """request(bucket, deadline) in a worker thread under the limiter, its outcome told to
        the health: BucketError as the client raises it (a BucketAuthError when no credentials
        can be had; BucketUnavailable past its deadline: remote_request_timeout from now, or
        deadline if sooner, when the health is not told). ObjectTooLarge is the bucket's
        answer, not its failure. Cancelled, it returns at once: the call's connection is shut
        down and its thread left to end by itself. Asked to slow down, it waits out the
        health's pause and asks again while the pause ends before deadline (none given:
        BUSY_PATIENCE_S from now), else raises BucketBusy: never a failure of the bucket."""
        give_up = time.monotonic() + BUSY_PATIENCE_S if deadline is None else deadline
        busy: BucketBusy | None = None
        while True:
            if not await self.health.paced(give_up):
                raise busy or BucketBusy(self.health.last_error)
            try:
                return await self._attempt(request, deadline)
            except BucketBusy as exc:
                self.health.busy(str(exc), exc.retry_after)
                busy = exc

    async def _attempt(self, request: Callable[[Bucket, float], T], deadline: float | None) -> T:
        """One request, as call() says."""
        longest = time.monotonic() + self.config.remote_request_timeout
        deadline = longest if deadline is None else min(deadline, longest)
        interrupt = Interrupt()
        started = ended = False

        def work(bucket: Bucket) -> T:
            nonlocal started, ended
            started = True
            try:
                with bucket.interruptible(interrupt):
                    return self._renewing(request)(bucket, deadline)
            finally:
                ended = True

        try:
            bucket = self.bucket or self._open()
            result = await anyio.to_thread.run_sync(
                work, bucket, limiter=self.limiter, abandon_on_cancel=True
            )
        except ObjectTooLarge:
            self.health.succeeded()
            raise
        except BucketBusy:
            raise  # call() waits and asks again
        except BucketAuthError as exc:
            self.health.failed(str(exc), refused=True)
            raise
        except BucketError as exc:
            # One the caller's own deadline cut off (a fetch out of time) is the caller's to
            # count, not a failure of the bucket's: a fetch's downloads all end at once.
            if not (deadline < longest and time.monotonic() >= deadline):
                self.health.failed(str(exc))
            raise
        finally:
            if not ended:  # cancelled: a thread not started yet will not use its connection
                interrupt.interrupt()
                self.counters.abandoned_requests += started
        self.health.succeeded()
        return result

    def _renewing(self, request: Callable[[Bucket, float], T]) -> Callable[[Bucket, float], T]:
        """request, made once more when the bucket refused the credentials and reading them
        again gave others (in the worker thread: a credential_process may run)."""

        def attempt(bucket: Bucket, deadline: float) -> T:
            try:
                return request(bucket, deadline)
            except BucketClockSkewed:
                raise  # other credentials would not help
            except BucketAuthError:
                refused = bucket.signed_with()
                if refused is None or not self.credentials.renew(*refused):
                    raise
            return request(bucket, deadline)

        return attempt

    def _open(self) -> Bucket:
        """The bucket client (its credentials are read at its first request)."""
        self.bucket = Bucket.from_config(self.config, credentials=self.credentials)
        return self.bucket

    async def probe(self) -> None:
        """One cheap call that answers whether the bucket serves this daemon (the health
        learns it): a listing of one key under the prefix."""
        root = keys.identity_key(self.prefix, "")
        with contextlib.suppress(BucketError):  # the health has it
            await self.call(lambda bucket, by: bucket.list(root, 1, deadline=by))

    def memos(self) -> dict[str, dict[str, int]]:
        """The sizes and caps of what the context remembers (the status's figures)."""
        return {
            "layouts": self.layouts.figures(),
            "refused_layouts": self.refused_layouts.figures(),
            "known_blocks": self.known.figures(),
            "damaged_blocks": self.damaged.figures(),
        }

    def block_key(self, digest: str, block_hash: bytes) -> str:
        return keys.block_key(self.prefix, digest, block_hash)

    def layout_key(self, digest: str) -> str:
        return keys.layout_key(self.prefix, digest)

    async def stored_layout(self, digest: str, deadline: float | None = None) -> Layout | None:
        """The identity's layout in the bucket (kept once read); None when there is none, or
        one that is not a layout (said at warning, rate-limited, and not read again for
        REFUSED_LAYOUT_SECONDS). BucketError as call() raises it, within deadline as call()'s."""
        found = self.layouts.get(digest)
        if found is not None or digest in self.refused_layouts:
            return found
        key = self.layout_key(digest)
        try:
            data = await self.call(
                lambda bucket, by: bucket.get(key, LAYOUT_LIMIT, deadline=by), deadline
            )
            if data is None:
                return None
            found = await anyio.to_thread.run_sync(
                decode_layout, data, digest, self.limits, limiter=self._decoding
            )
        except (ObjectTooLarge, LayoutError) as exc:
            self.refused_layouts.add(digest)
            limited.warning("remote_layout_refused", identity=digest, error=str(exc))
            return None
        self.layouts.set(digest, found, len(data) * DECODED_PER_BYTE)
        return found

    async def write_layout(self, layout: Layout) -> Layout | None:
        """Store the identity's layout unless one is there (the first written wins); the
        layout that holds in the bucket after it (None: one there that is not a layout).
        BucketError as call() raises it."""
        key = self.layout_key(layout.digest)
        data = encode_layout(layout)
        if await self.call(lambda bucket, by: bucket.put_if_absent(key, data, deadline=by)):
            self.layouts.set(layout.digest, layout, len(data) * DECODED_PER_BYTE)
            return layout
        return await self.stored_layout(layout.digest)

    def close(self) -> None:
        if self.bucket is not None:
            self.bucket.close()
