"""The checksum of entry headers and tensors: fixed 8 bytes, chosen by bench/checksum.py.

xxh3-64 runs faster than memcpy and a page-cache read (docs/benchmarks.md, "Checksum"; Linux
measured, a Mac not), so verifying a restore costs less than the read itself; zlib.crc32 and
hashlib's digests do not. Its 8-byte digest fills the format's fixed checksum field.
"""

from __future__ import annotations

import xxhash

CHECKSUM_BYTES = 8


def checksum(data: bytes | bytearray | memoryview) -> bytes:
    """The 8-byte big-endian xxh3-64 digest of data."""
    return xxhash.xxh3_64_digest(data)


def new_checksum() -> xxhash.xxh3_64:
    """An incremental hasher, for checksumming data that arrives in pieces."""
    return xxhash.xxh3_64()
