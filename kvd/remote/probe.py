"""The probe: how much of a prompt, past what the tier holds, the store holds as blocks.

First the identity's layout (its block size and layers: a prompt of another identity has
nothing to fetch), kept once read; then the block hashes of the prompt, and a binary search
of HEADs over those past the local match for the last block the store holds. Blocks are put
as whole chains, so a chain in the store is a prefix; one with a hole (a block expired) is
found by the fetch, which stops there. Blocks seen in the store are remembered (a bounded
set), so the probes of prompts that share a prefix ask about it once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Final

from kvd_protocol.blocks import block_hashes

from kvd.remote import keys
from kvd.remote.layout import Layout, LayoutError, decode_layout
from kvd.remote.store_calls import StoreCalls

LAYOUT_BYTES: Final = 1 << 20  # a layout names a few hundred layers at most
ABSENT_SECONDS: Final = 1.0  # an identity without a layout in the store is asked again after
KNOWN_BLOCKS: Final = 65_536  # block keys remembered as present (~10 MB)


class FetchError(Exception):
    """Nothing fetched: reason (a remote miss reason, fetcher.MISS_REASONS) and detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class KnownBlocks:
    """Block keys the store was seen to hold, the least recently seen forgotten first."""

    def __init__(self, size: int = KNOWN_BLOCKS) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._size = size

    def __contains__(self, key: str) -> bool:
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self._size:
            self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)


class Prober:
    """Asks the store what it holds of a prompt; shared by every fetch."""

    def __init__(self, calls: StoreCalls, prefix: str, known: KnownBlocks) -> None:
        self._calls = calls
        self._prefix = prefix
        self.known = known
        self._layouts: dict[str, Layout] = {}
        self._absent: dict[str, float] = {}  # digest -> when its layout was found absent

    async def layout(self, digest: str) -> Layout:
        """The identity's layout, read once; FetchError without one (or a bad one)."""
        layout = self._layouts.get(digest)
        if layout is not None:
            return layout
        if time.monotonic() - self._absent.get(digest, -ABSENT_SECONDS) < ABSENT_SECONDS:
            raise FetchError("no_layout", f"the store holds no layout of identity {digest}")
        key = keys.layout_key(self._prefix, digest)
        data = await self._calls.run(self._calls.store.get, key, LAYOUT_BYTES)
        if data is None:
            self._absent[digest] = time.monotonic()
            raise FetchError("no_layout", f"the store holds no layout of identity {digest}")
        try:
            layout = decode_layout(data, digest)
        except LayoutError as exc:
            self._absent[digest] = time.monotonic()
            raise FetchError("no_layout", f"the layout of identity {digest}: {exc}") from None
        self._layouts[digest] = layout
        return layout

    async def extent(
        self, digest: str, layout: Layout, tokens: bytes, local: int, least: int
    ) -> int:
        """How many whole blocks of tokens, from the first, the store holds: at least enough
        to reach least tokens past local (the local match), else FetchError "short"."""
        size = layout.block_tokens
        hashes = block_hashes(tokens, size)
        need = -(-(local + least) // size)  # the fewest blocks worth fetching
        if need > len(hashes) or not await self._holds(digest, hashes[need - 1]):
            raise FetchError(
                "short", f"the store holds less than {least} tokens past the {local} local"
            )
        low, high = need, len(hashes)  # the store holds blocks 0..low-1; not past high
        while low < high:
            mid = (low + high + 1) // 2
            if await self._holds(digest, hashes[mid - 1]):
                low = mid
            else:
                high = mid - 1
        return low

    async def _holds(self, digest: str, block: bytes) -> bool:
        key = keys.block_key(self._prefix, digest, block)
        if key in self.known:
            return True
        size = await self._calls.run(self._calls.store.head, key)
        if size is None:
            return False
        self.known.add(key)
        return True
