"""Token ids as packed little-endian uint32 bytes: one representation, on the wire and on disk."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

TOKEN_BYTES = 4
_MAX_TOKEN = (1 << 32) - 1


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Pack token ids into little-endian uint32 bytes; raises ValueError outside 0..2**32-1."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError(f"token id outside 0..{_MAX_TOKEN}: {exc}") from exc
    if packed.itemsize != TOKEN_BYTES:  # pragma: no cover - no supported platform differs
        packed = array("L", packed)
    if sys.byteorder == "big":  # pragma: no cover - arm64 and x86-64 are little-endian
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """Unpack little-endian uint32 token bytes; raises ValueError on a ragged length."""
    if len(data) % TOKEN_BYTES:
        raise ValueError(f"token bytes length {len(data)} is not a multiple of {TOKEN_BYTES}")
    ids = array("I")
    ids.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    return ids.tolist()


def token_count(data: bytes) -> int:
    return len(data) // TOKEN_BYTES


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Number of leading token ids two packed sequences share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // TOKEN_BYTES
    lo, hi = 0, n  # binary search on bytes: O(n) compares done in C, log n Python steps
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo // TOKEN_BYTES
