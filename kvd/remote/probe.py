"""The probe: how much of a prompt, past what the tier holds, the bucket holds as blocks.

First the identity's layout (its block size and layers: an identity without one has nothing to
fetch, asked again after ABSENT_SECONDS; the negative answers are a bounded memo); then the
block hashes of the prompt, and a search in rounds of parallel HEADs over those past the local
match, and before the first block known damaged (RemoteContext.damaged), for the last block the
bucket holds. Blocks are uploaded as whole chains, so a chain in the bucket is a prefix; one with
a hole (a block expired) is found by the fetch, which takes the blocks before it if they are
worth it. Blocks known to be in the bucket (the uploads' memo, which the probes feed too) are
not asked about again, so the probes of prompts that share a prefix ask about it once. Every
request is within the caller's deadline; a round's requests that fail raise the first failure
alone (the others cancelled), never a group of them.
"""

from __future__ import annotations

from typing import Final

import anyio
from kvd_protocol.blocks import block_hashes

from kvd.remote.bucket import BucketError
from kvd.remote.context import RemoteContext
from kvd.remote.layout import Layout
from kvd.remote.lru import LruSet

ABSENT_SECONDS: Final = 1.0  # an identity without a layout in the bucket is asked again after
ABSENT_IDENTITIES: Final = 1024  # identities remembered without a layout (over a second: all)
# Why a lookup that could have fetched did not (the status's remote misses).
MISS_REASONS: Final = (
    "no_layout",  # the bucket holds no layout of the identity (or one kvd cannot read)
    "short",  # the bucket holds less than remote_min_tokens past the local match
    "missing",  # a block the probe found was gone when fetched
    "damaged",  # a block of another size, or that failed the commit's checks
    "timeout",  # not committed within remote_fetch_timeout
    "store_error",  # the bucket failed a request (unreachable, refused, 5xx)
    "refused",  # the tier refused the put (no room, its admission policy)
)


class FetchError(Exception):
    """Nothing fetched: reason (one of MISS_REASONS) and detail, in words; block, the index of
    the block found missing or damaged when the download found it (the blocks before it may
    be fetched still)."""

    def __init__(self, reason: str, detail: str, block: int | None = None) -> None:
        if reason not in MISS_REASONS:
            raise ValueError(f"{reason!r} is not a remote miss reason")
        super().__init__(detail)
        self.reason = reason
        self.block = block


def fewest_blocks(local: int, least: int, block_tokens: int) -> int:
    """The fewest blocks, from the first, worth fetching: least tokens past the local match."""
    return max(1, -(-(local + least) // block_tokens))


class Prober:
    """Asks the bucket what it holds of a prompt; shared by every fetch."""

    def __init__(self, context: RemoteContext) -> None:
        self._context = context
        # identities whose layout was found absent (or refused), asked again after a second
        self.absent: LruSet[str] = LruSet(ABSENT_IDENTITIES, ABSENT_SECONDS)

    async def layout(self, digest: str, deadline: float) -> Layout:
        """The identity's layout; FetchError "no_layout" without one (or a bad one)."""
        if digest not in self.absent:
            layout = await self._context.stored_layout(digest, deadline)
            if layout is not None:
                return layout
            self.absent.add(digest)
        raise FetchError("no_layout", f"the bucket holds no layout of identity {digest}")

    async def extent(
        self, digest: str, layout: Layout, tokens: bytes, local: int, least: int, *, deadline: float
    ) -> int:
        """How many whole blocks of tokens, from the first, the bucket holds before the first
        known damaged: at least enough to reach least tokens past local (the local match),
        else FetchError "short" ("damaged" when a damaged block is what cut it short). A
        search in rounds of up to remote_requests HEADs at once: a round trip or two for a
        prompt of a few blocks, log base remote_requests + 1 of them for a long one."""
        size = layout.block_tokens
        hashes = block_hashes(tokens, size)
        need = fewest_blocks(local, least, size)
        damaged = self._context.damaged
        usable = next((i for i, h in enumerate(hashes) if (digest, h) in damaged), len(hashes))
        if usable < need <= len(hashes):
            raise FetchError("damaged", f"block {usable} of this prompt was found damaged before")
        low, high = need - 1, usable  # the bucket holds low blocks or more; not past high
        width = max(1, self._context.config.remote_requests)
        while low < high:
            counts = _spread(low + 1, high, width)
            asked = [hashes[count - 1] for count in counts]
            present = await self._present_all(digest, asked, deadline)
            if not present[0] and low < need:
                break
            low = max([low, *(c for c, h in zip(counts, present, strict=True) if h)])
            high = min([high, *(c - 1 for c, h in zip(counts, present, strict=True) if not h)])
        if low < need:
            raise FetchError(
                "short", f"the bucket holds less than {least} tokens past the {local} local"
            )
        return low

    async def _present_all(self, digest: str, blocks: list[bytes], deadline: float) -> list[bool]:
        """Whether the bucket holds each block, asked at once; the first BucketError alone."""
        present = [False] * len(blocks)
        failures: list[BucketError] = []

        async def ask(index: int) -> None:
            try:
                present[index] = await self._present(digest, blocks[index], deadline)
            except BucketError as exc:
                failures.append(exc)
                asking.cancel_scope.cancel()  # the round is in vain

        async with anyio.create_task_group() as asking:
            for index in range(len(blocks)):
                asking.start_soon(ask, index)
        if failures:
            raise failures[0]
        return present

    async def _present(self, digest: str, block: bytes, deadline: float) -> bool:
        known = self._context.known
        if (digest, block) in known:
            return True
        key = self._context.block_key(digest, block)
        if (
            await self._context.call(lambda bucket, by: bucket.head(key, deadline=by), deadline)
            is None
        ):
            return False
        known.add((digest, block))
        return True


def _spread(first: int, last: int, most: int) -> list[int]:
    """At most most counts from first to last, both included, evenly apart."""
    if last - first + 1 <= most:
        return list(range(first, last + 1))
    step = (last - first) / (most - 1) if most > 1 else 0
    return sorted({first + round(step * i) for i in range(most)} | {last})
