"""The read path: a prompt's blocks fetched from the bucket into the tier, as an ordinary put.

A lookup whose prompt runs at least remote_min_tokens past the tier's best match starts a
fetch (or joins the one under way for the same prompt): a probe (probe.py) finds how many
blocks the bucket holds, then the fetch begins a put of that prefix through the tier's own put
path (blocks the tier holds are not fetched: the put holds them), downloads the others
straight into the put's staging files, at most remote_requests at once and a window of
DOWNLOAD_WINDOW staging files open at a time whatever the prompt's length, each bounded by the
layout's block size, writes the manifest from the layout and commits. The commit checks it as
any put's: chain hashes, headers, every checksum. Whatever goes wrong aborts the put (its
staging files deleted) and is counted by reason, without a traceback; nothing remote touches a
local entry. A block missing from the bucket, or of the wrong size, mid-chain: the blocks
before it are fetched instead (a put of its own), when they reach remote_min_tokens past the
local match. A block found damaged (of the wrong size, or refused by the commit's checks) is
remembered with the chain it ends (RemoteContext.damaged, bounded): later probes stop before it,
so it is downloaded at most once per memo lifetime.

A lookup waits for the probe only briefly (PROBE_WAIT) and is told to ask again when the fetch
is under way; a probe or fetch not done by then goes on (the next lookup finds it local). The
probe and the fetch each have remote_fetch_timeout, and every bucket request within them at
most what is left of it: at the deadline the fetch is cancelled, the requests under way are
cut off (their connections shut down, their threads abandoned: context.py), the put aborted and
the miss counted "timeout", so its slot (MAX_FETCHES) and request tokens are free at once.
The lines a bucket's answers provoke (misses, cuts) are rate-limited.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

import anyio
import xxhash
from anyio.abc import TaskGroup
from kvd_protocol.blocks import block_name
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import ManifestPlan
from kvd_protocol.errors import EntryFormatError, ErrorCode, ProtocolError
from kvd_protocol.identity import Identity
from kvd_protocol.messages import MAX_BLOCK_BATCH, Lookup
from kvd_protocol.tokens import TOKEN_BYTES

from kvd.logs import RateLimited, get_logger
from kvd.remote.bucket import Bucket, BucketError, ObjectTooLarge
from kvd.remote.context import RemoteContext
from kvd.remote.layout import Layout, manifest_plan
from kvd.remote.local_tier import LocalTier
from kvd.remote.probe import FetchError, Prober, fewest_blocks
from kvd.store.staged_put import DeclaredBlocks, Put

log = get_logger("kvd.remote.fetcher")
limited = RateLimited(log)  # what the bucket's answers provoke at will

FETCH_OWNER: Final = 0  # the owner of the fetches' puts: sessions are numbered from 1
PROBE_WAIT: Final = 0.05  # seconds a lookup waits for a probe: half an engine's 0.1 s deadline
MAX_FETCHES: Final = 16  # probes and fetches under way at once; past it, lookups start none


_PROBE_MISSES: Final = frozenset({"no_layout", "short"})

T = TypeVar("T")


def download_window(requests: int) -> int:
    """Staging files a fetch holds open at once: twice the requests that may run, so the
    next are ready as each ends; at most a put_blocks batch."""
    return max(1, min(MAX_BLOCK_BATCH, 2 * requests))


@dataclass(eq=False)
class Fetch:
    """One prompt's probe and fetch, shared by the lookups that ask for it."""

    probed: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    blocks: int = 0  # the blocks the fetch commits (0: none, or not probed yet)
    deadline: float = 0.0  # monotonic: when the fetch is aborted (set once probed)

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)


class Fetcher:
    """The remote tier's fetches under way, by prompt; counted in the remote's counters."""

    def __init__(self, context: RemoteContext, local: LocalTier) -> None:
        self._context = context
        self._config = context.config
        self._local = local
        self._counters = context.counters
        self.prober = Prober(context)  # shared with presence queries (kvd.remote.presence)
        self._fetches: dict[tuple[str, bytes], Fetch] = {}  # by identity digest, prompt hash
        self._tasks: TaskGroup | None = None
        self._window = download_window(self._config.remote_requests)

    async def run(self) -> None:
        """Hold the fetches' tasks until cancelled (the daemon stops: fetches under way are
        aborted with it, their staging files deleted)."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            try:
                await anyio.sleep_forever()
            finally:
                self._tasks = None

    def memos(self) -> dict[str, dict[str, int]]:
        """The sizes and caps of what the fetches remember (the status's figures)."""
        return {"absent_layouts": self.prober.absent.figures()}

    def waits(self, lookup: Lookup, tenant: str) -> bool:
        """Whether lookup may wait for a fetch (answered by wait(), as a task of its own): one
        asked again after a fetch, or one that may wait and whose prompt runs at least
        remote_min_tokens past the tier's best match, while the bucket is not down. A lookup
        that may not wait (a client that predates the field) is answered at once, and the
        fetch it warrants starts meanwhile: its next lookup finds the blocks local. One naming
        an identity outside the peer's tenant (a refusal) starts none."""
        if lookup.fetch == "fetched":
            return True
        if self._tasks is None or not self._context.health.up:
            return False
        if not lookup.identity.namespace.startswith(tenant):
            return False  # refused at once
        tokens = lookup.tokens
        past = len(tokens) // TOKEN_BYTES - self._local.reads.longest_match(lookup.identity, tokens)
        if past < max(self._config.remote_min_tokens, 1):
            return False
        if lookup.fetch is None:
            self._start(lookup.identity, tokens)
        return lookup.fetch is not None

    async def wait(self, lookup: Lookup) -> float | None:
        """For a lookup that may wait ("wait"): the seconds left of the fetch of its prompt, once
        a probe found one worth it within PROBE_WAIT; None to answer from what is local. Asked
        again after it ("fetched"): None once the fetch is committed, failed or out of time."""
        key = (lookup.identity.digest(), xxhash.xxh3_128_digest(lookup.tokens))
        if lookup.fetch == "fetched":
            fetch = self._fetches.get(key)
            if fetch is not None:
                with anyio.move_on_after(fetch.left()):
                    await fetch.done.wait()
            return None
        fetch = self._start(lookup.identity, lookup.tokens)
        if fetch is None:
            return None
        with anyio.move_on_after(PROBE_WAIT):
            await fetch.probed.wait()
        return fetch.left() if fetch.blocks and not fetch.done.is_set() else None

    def _start(self, identity: Identity, tokens: bytes) -> Fetch | None:
        """The fetch of tokens under way, or a new one; None when too many are."""
        key = (identity.digest(), xxhash.xxh3_128_digest(tokens))
        fetch = self._fetches.get(key)
        if fetch is None and len(self._fetches) < MAX_FETCHES and self._tasks is not None:
            fetch = self._fetches[key] = Fetch()
            self._tasks.start_soon(self._run, key, fetch, identity, tokens)
        return fetch

    async def _run(
        self, key: tuple[str, bytes], fetch: Fetch, identity: Identity, tokens: bytes
    ) -> None:
        started = time.perf_counter()
        timeout = self._config.remote_fetch_timeout
        deadline = time.monotonic() + timeout
        try:
            with anyio.fail_after(timeout):
                layout, blocks = await self._probe(identity, tokens, deadline)
            fetch.blocks, fetch.deadline = blocks, time.monotonic() + timeout
            deadline = fetch.deadline
            probe_ms = round((time.perf_counter() - started) * 1000, 1)
            fetch.probed.set()
            phases: dict[str, float] = {}
            with anyio.fail_after(timeout):
                try:
                    fetched = await self._fetch(
                        identity, tokens, layout, blocks, phases, deadline=deadline
                    )
                except FetchError as hole:
                    blocks = self._cut(identity, tokens, layout, hole)
                    fetched = await self._fetch(
                        identity, tokens, layout, blocks, phases, deadline=deadline
                    )
        except FetchError as exc:
            self._missed(identity, exc.reason, str(exc))
        except TimeoutError:
            self._missed(identity, "timeout", f"not done within {timeout:g} s")
        except BucketError as exc:  # one cut off by the fetch's own deadline is its timeout
            late = time.monotonic() >= deadline
            self._missed(identity, "timeout" if late else "store_error", str(exc))
        except OSError as exc:  # the tier's disk, writing the manifest or a block
            self._missed(identity, "refused", f"staging: {exc.strerror or exc}")
        else:
            if not fetched:
                return  # the tier held it already (a put raced this fetch): no fetch at all
            self._counters.hits += 1
            seconds = time.perf_counter() - started
            self._counters.fetch_rates.append(fetched / max(seconds, 1e-9) / 1e9)
            log.info(
                "remote_fetched",
                identity=key[0],
                blocks=blocks,
                probe_ms=probe_ms,
                **{f"{phase}_ms": round(ms, 1) for phase, ms in phases.items()},
                seconds=round(seconds, 3),
            )
        finally:
            fetch.probed.set()
            fetch.done.set()
            del self._fetches[key]

    def _missed(self, identity: Identity, reason: str, detail: str) -> None:
        self._counters.misses[reason] += 1
        fields = {"identity": identity.digest(), "reason": reason, "detail": detail}
        # A probe that found nothing is the usual; a block that fails its checks is not.
        if reason in _PROBE_MISSES:
            log.debug("remote_miss", **fields)
        elif reason == "damaged":
            limited.warning("remote_miss", **fields)
        else:
            limited.info("remote_miss", **fields)

    async def _probe(
        self, identity: Identity, tokens: bytes, deadline: float
    ) -> tuple[Layout, int]:
        digest = identity.digest()
        layout = await self.prober.layout(digest, deadline)
        local = self._local.reads.longest_match(identity, tokens)
        least = self._config.remote_min_tokens
        extent = await self.prober.extent(digest, layout, tokens, local, least, deadline=deadline)
        return layout, extent

    def _cut(self, identity: Identity, tokens: bytes, layout: Layout, hole: FetchError) -> int:
        """The blocks before hole, the first block the download found missing or damaged, to
        fetch instead; hole raised again unless they reach remote_min_tokens past the local
        match."""
        local = self._local.reads.longest_match(identity, tokens)
        least = fewest_blocks(local, self._config.remote_min_tokens, layout.block_tokens)
        if hole.block is None or hole.block < least:
            raise hole
        say = limited.warning if hole.reason == "damaged" else limited.info
        say("remote_fetch_cut", identity=identity.digest(), blocks=hole.block, detail=str(hole))
        return hole.block

    async def _fetch(
        self,
        identity: Identity,
        tokens: bytes,
        layout: Layout,
        blocks: int,
        phases: dict[str, float],
        *,
        deadline: float,
    ) -> int:
        """Put the first blocks of tokens from the bucket, by deadline; the bytes of the entry
        committed. phases: the milliseconds of each step (begin, download, commit), for the
        log."""
        fetched = tokens[: blocks * layout.block_tokens * TOKEN_BYTES]
        try:
            plan = manifest_plan(
                layout, identity, fetched, created=time.time(), limits=self._local.limits
            )
        except ValueError as exc:  # a layout this daemon cannot make an entry of
            raise FetchError("no_layout", str(exc)) from None
        declared = DeclaredBlocks(plan.hashes, layout.block_tokens, plan.block_size)
        puts = self._local.puts
        mark = time.perf_counter()
        try:
            put, _, fd = await puts.begin(
                FETCH_OWNER, identity, fetched, plan.entry.file_size, declared
            )
        except ProtocolError as exc:
            raise FetchError("refused", exc.message) from None
        if put is None or fd is None:
            return 0  # the tier holds it already (a lookup raced this fetch)
        mark = _lap(phases, "begin", mark)
        try:
            await self._write(put, fd, plan, deadline)
        except BaseException:
            puts.abort_owned(FETCH_OWNER, put.id)
            raise
        mark = _lap(phases, "download", mark)
        try:
            await puts.commit_owned(FETCH_OWNER, put.id)
        except ProtocolError as exc:  # the commit removed its files
            if exc.code is not ErrorCode.INVALID_ENTRY:
                raise FetchError("refused", exc.message) from None
            refused = exc.__cause__
            name = refused.name if isinstance(refused, EntryFormatError) else ""
            self._damaged(identity.digest(), plan.hashes, put.held_blocks, name)
            raise FetchError("damaged", exc.message) from None
        _lap(phases, "commit", mark)
        return plan.entry.file_size + blocks * plan.block_size

    def _damaged(self, digest: str, hashes: Sequence[bytes], first: int, refused: str) -> None:
        """Remember the block the commit refused (refused: the file it named; the last block,
        the chain as a whole, when that is none of them), so no later probe goes as far."""
        named = (h for h in hashes[first:] if block_name(h) == refused)
        self._context.damaged.add((digest, next(named, hashes[-1])))

    async def _write(self, put: Put, fd: int, plan: ManifestPlan, deadline: float) -> None:
        """The manifest (every layer blocked: its tails are empty) and the blocks not held,
        a window of staging files open at a time. The first bucket failure, else the first
        block found missing or damaged, is raised alone, the downloads under way cancelled."""
        try:
            empty = [checksum(b"")] * len(plan.entry.slots)
            os.pwrite(fd, plan.entry.head(empty), 0)
        finally:
            os.close(fd)
        holes: list[FetchError] = []  # blocks missing or damaged in the bucket
        failures: list[Exception] = []  # the bucket failing, no room for a staging file
        window = anyio.Semaphore(self._window)
        async with anyio.create_task_group() as downloads:

            async def download(index: int) -> None:
                try:
                    (block_fd,) = await self._local.puts.block_files(FETCH_OWNER, put.id, index, 1)
                    try:
                        await self._download(put, plan, index, block_fd, deadline)
                    finally:
                        os.close(block_fd)
                except FetchError as exc:
                    holes.append(exc)
                    downloads.cancel_scope.cancel()  # the others are in vain
                except ProtocolError as exc:
                    failures.append(FetchError("refused", exc.message))
                    downloads.cancel_scope.cancel()
                except (BucketError, OSError) as exc:
                    failures.append(exc)
                    downloads.cancel_scope.cancel()
                finally:
                    window.release()

            for index in range(put.held_blocks, len(plan.hashes)):
                await window.acquire()
                downloads.start_soon(download, index)
        if failures:
            raise failures[0]
        if holes:  # the first of them: the blocks before it may be worth a fetch
            raise min(holes, key=lambda hole: hole.block or 0)

    async def _download(
        self, put: Put, plan: ManifestPlan, index: int, fd: int, deadline: float
    ) -> None:
        """Block index of the put into fd, whole and of the layout's size, by deadline."""
        digest, block = put.identity.digest(), plan.hashes[index]
        key, size = self._context.block_key(digest, block), plan.block_size
        handed = _HandedFd(fd)
        try:
            got = await self._context.call(
                handed.running(
                    lambda bucket, by, own: bucket.get_to_file(key, own, size, deadline=by)
                ),
                deadline,
            )
        except ObjectTooLarge as exc:
            self._context.damaged.add((digest, block))
            raise FetchError("damaged", f"block {index}: {exc}", index) from None
        finally:
            handed.let_go()
        if got is None:
            self._context.known.discard((digest, block))
            raise FetchError("missing", f"block {index} ({key}) is not in the bucket", index)
        if got != size:
            self._context.damaged.add((digest, block))
            raise FetchError(
                "damaged", f"block {index} ({key}) holds {got} bytes, not {size}", index
            )
        self._context.known.add((digest, block))  # so the entry's upload skips it
        self._counters.downloaded_blocks += 1
        self._counters.downloaded_bytes += size


class _HandedFd:
    """A copy (dup) of a staging file's descriptor for the worker thread that downloads into
    it, closed by whichever of the event loop and the thread lets go of it last: a thread
    abandoned mid-download (its fetch out of time) never writes through a descriptor number
    the loop closed, and another file may have been given since."""

    def __init__(self, fd: int) -> None:
        self._fd = os.dup(fd)
        self._holders = 1  # the loop
        self._lock = threading.Lock()

    def running(self, request: Callable[[Bucket, float, int], T]) -> Callable[[Bucket, float], T]:
        """request(bucket, deadline, fd) holding the copy while it runs (in the thread)."""

        def run(bucket: Bucket, deadline: float) -> T:
            with self._lock:
                if not self._holders:  # the loop let go before the thread began
                    raise BucketError("the download was abandoned before it began")
                self._holders += 1
            try:
                return request(bucket, deadline, self._fd)
            finally:
                self.let_go()

        return run

    def let_go(self) -> None:
        with self._lock:
            self._holders -= 1
            last = not self._holders
        if last:
            os.close(self._fd)


def _lap(phases: dict[str, float], phase: str, since: float) -> float:
    """Note the milliseconds of phase, which began at since; now, when the next begins."""
    now = time.perf_counter()
    phases[phase] = (now - since) * 1000
    return now
