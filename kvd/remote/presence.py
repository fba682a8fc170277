"""Presence, the remote tier's part: how many tokens of a prompt past the local match the
bucket holds, without downloading a byte (the probe's HEADs, kvd.remote.probe), and why it
holds no more. What a lookup that may wait would then restore is the local match and this:
a fetch takes the same chain of whole blocks, when it reaches remote_min_tokens past the
local match. Nothing is counted: the remote tier's hits and misses are its fetches'.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import anyio
from kvd_protocol.tokens import token_count

from kvd.remote.bucket import BucketError
from kvd.remote.probe import FetchError
from kvd.remote.remote import Remote


class RemotePresence(NamedTuple):
    more: int  # tokens past the local match the bucket holds
    miss: str | None  # why no more (a remote miss reason, kvd.remote.probe); None: none left
    detail: str | None


async def remote_presence(remote: Remote, digest: str, tokens: bytes, local: int) -> RemotePresence:
    """How much of tokens past local (the local match) the bucket holds for the identity of
    digest, asked within remote_fetch_timeout."""
    reach = token_count(tokens) - 1  # a lookup restores at most this much
    if local >= reach:
        return RemotePresence(0, None, None)
    health = remote.context.health
    if not health.up:
        return RemotePresence(0, "store_error", f"the bucket is down: {health.last_error or '?'}")
    timeout = remote.config.remote_fetch_timeout
    deadline = time.monotonic() + timeout
    prober = remote.fetcher.prober
    try:
        with anyio.fail_after(timeout):
            layout = await prober.layout(digest, deadline)
            blocks = await prober.extent(digest, layout, tokens, local, 1, deadline=deadline)
    except FetchError as exc:
        return RemotePresence(0, exc.reason, str(exc))
    except TimeoutError:
        return RemotePresence(0, "timeout", f"the bucket did not answer within {timeout:g} s")
    except BucketError as exc:  # one its own deadline cut off is its timeout, as a fetch's
        late = time.monotonic() >= deadline
        return RemotePresence(0, "timeout" if late else "store_error", str(exc))
    there = min(blocks * layout.block_tokens, reach)
    if there >= reach:
        return RemotePresence(there - local, None, None)
    return RemotePresence(
        max(0, there - local),
        "short",
        f"the bucket holds the first {blocks} blocks of {layout.block_tokens} tokens of this "
        f"{reach + 1}-token prompt, no more (a block's tokens are whole)",
    )
