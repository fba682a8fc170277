"""Blocks: runs of block_tokens tokens of an entry, named by a chained hash (FORMAT.md, v2).

hash_i = xxh3_128(hash_{i-1} || token bytes of block i), hash_{-1} = ZERO_HASH: equal hashes
within one identity mean equal tokens with equal history, hence interchangeable KV. A block's
file is named by its hash in lowercase hex.
"""

from __future__ import annotations

from typing import Final

import xxhash

from .tokens import TOKEN_BYTES

HASH_BYTES: Final = 16
BLOCK_TOKENS: Final = 256  # the default: mlx-lm's KV growth step (a buffer's room is whole blocks)
MIN_BLOCK_TOKENS: Final = 16
MAX_BLOCK_TOKENS: Final = 65536
ZERO_HASH: Final = bytes(HASH_BYTES)  # the parent of block 0
BLOCK_SUFFIX: Final = ".kvb"

_LOWER_HEX: Final = frozenset("0123456789abcdef")


def check_block_tokens(block_tokens: object) -> int:
    """block_tokens itself if it is a valid block size: a power of two in 16..65536."""
    if (
        not isinstance(block_tokens, int)
        or isinstance(block_tokens, bool)
        or not MIN_BLOCK_TOKENS <= block_tokens <= MAX_BLOCK_TOKENS
        or block_tokens & (block_tokens - 1)
    ):
        raise ValueError(
            f"block size {block_tokens!r} is not a power of two in "
            f"{MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS} tokens"
        )
    return block_tokens


def block_hash(parent: bytes, tokens: bytes | memoryview) -> bytes:
    """The hash of the block holding tokens (packed u32) after the block hashed parent."""
    hasher = xxhash.xxh3_128(parent)
    hasher.update(tokens)
    return hasher.digest()


def block_hashes(tokens: bytes, block_tokens: int) -> tuple[bytes, ...]:
    """The chained hashes of the T // block_tokens whole blocks of tokens (packed u32)."""
    step = check_block_tokens(block_tokens) * TOKEN_BYTES
    if len(tokens) % TOKEN_BYTES:
        raise ValueError(f"{len(tokens)} token bytes are not whole u32 ids")
    view = memoryview(tokens)
    hashes: list[bytes] = []
    parent = ZERO_HASH
    for start in range(0, len(tokens) - step + 1, step):
        parent = block_hash(parent, view[start : start + step])
        hashes.append(parent)
    return tuple(hashes)


def split_hashes(joined: bytes) -> tuple[bytes, ...]:
    """Concatenated hashes (as the wire and the manifest carry them), one by one."""
    if len(joined) % HASH_BYTES:
        raise ValueError(f"{len(joined)} bytes are not whole {HASH_BYTES}-byte hashes")
    return tuple(joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES))


def block_name(block: bytes) -> str:
    """The file name of the block with this hash."""
    if len(block) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, not {len(block)}")
    return block.hex() + BLOCK_SUFFIX


def is_hex_digest(text: str, size: int) -> bool:
    """Whether text is a size-byte digest in lowercase hex, as block and identity names are."""
    return len(text) == 2 * size and _LOWER_HEX.issuperset(text)


def parse_block_name(name: str) -> bytes | None:
    """The hash a block file's name gives, or None for any other name."""
    digest = name.removesuffix(BLOCK_SUFFIX)
    if digest == name or not is_hex_digest(digest, HASH_BYTES):
        return None
    return bytes.fromhex(digest)
