"""The probe: how much of a prompt, past what the tier holds, the store holds as blocks.

First the identity's layout (its block size and layers: an identity without one has nothing to
fetch); then the block hashes of the prompt, and a binary search of HEADs over those past the
local match for the last block the store holds. Blocks are uploaded as whole chains, so a
chain in the store is a prefix; one with a hole (a block expired) is found by the fetch, which
fails there. Blocks known to be in the store (the uploads' memo, which the probes feed too) are
not asked about again, so the probes of prompts that share a prefix ask about it once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

from kvd_protocol.blocks import block_hashes

from kvd.remote.layout import Layout

if TYPE_CHECKING:
    from kvd.remote.remote import Remote

ABSENT_SECONDS: Final = 1.0  # an identity without a layout in the store is asked again after


class FetchError(Exception):
    """Nothing fetched: reason (a remote miss reason, fetcher.MISS_REASONS) and detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Prober:
    """Asks the store what it holds of a prompt; shared by every fetch."""

    def __init__(self, remote: Remote) -> None:
        self._remote = remote
        self._absent: dict[str, float] = {}  # digest -> when its layout was found absent

    async def layout(self, digest: str) -> Layout:
        """The identity's layout; FetchError "no_layout" without one (or a bad one)."""
        absent = self._absent.get(digest)
        if absent is None or time.monotonic() - absent >= ABSENT_SECONDS:
            layout = await self._remote.stored_layout(digest)
            if layout is not None:
                self._absent.pop(digest, None)
                return layout
            self._absent[digest] = time.monotonic()
        raise FetchError("no_layout", f"the store holds no layout of identity {digest}")

    async def extent(
        self, digest: str, layout: Layout, tokens: bytes, local: int, least: int
    ) -> int:
        """How many whole blocks of tokens, from the first, the store holds: at least enough
        to reach least tokens past local (the local match), else FetchError "short"."""
        size = layout.block_tokens
        hashes = block_hashes(tokens, size)
        need = max(1, -(-(local + least) // size))  # the fewest blocks worth fetching
        if need > len(hashes) or not await self._holds(digest, hashes[need - 1]):
            raise FetchError(
                "short", f"the store holds less than {least} tokens past the {local} local"
            )
        low, high = need, len(hashes)  # the store holds blocks 0..low-1; none past high
        while low < high:
            mid = (low + high + 1) // 2
            if await self._holds(digest, hashes[mid - 1]):
                low = mid
            else:
                high = mid - 1
        return low

    async def _holds(self, digest: str, block: bytes) -> bool:
        known = self._remote.uploader.known
        if (digest, block) in known:
            return True
        key = self._remote.block_key(digest, block)
        if await self._remote.call(lambda store: store.head(key)) is None:
            return False
        known.add((digest, block))
        return True
