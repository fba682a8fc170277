"""The bundle: one file holding what a daemon needs to serve one entry elsewhere.

`kvctl export` writes it from a daemon's tier; `kvctl import` reads it into another daemon
through an ordinary put, whose commit checks it as any put's (FORMAT.md). Layout
(docs/operations.md, "Carrying an entry elsewhere"):

    prefix (48 bytes) | msgpack header | manifest file | block file 0 | ... | block file n-1

The prefix fixes every size, so the file's exact size is known from it; the header names the
identity (with its traits), the exported entry's id, and the xxh3-64 checksum of the manifest
and of each block file whole. The manifest and block files are the tier's own files, byte for
byte (a version 1 entry is a manifest with no block). Pure: bytes in, values out; the reader
raises BundleError alone on any input, and bounds what a hostile prefix can make it read or
hold (a header of at most MAX_HEADER_BYTES, at most max_tokens / 16 blocks, each piece at most
MAX_PIECE_BYTES).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import msgpack

from . import schema
from .blocks import MIN_BLOCK_TOKENS
from .checksum import CHECKSUM_BYTES, checksum
from .entry_model import ALIGNMENT
from .identity import Identity
from .limits import DEFAULT_LIMITS, Limits

MAGIC: Final = b"\x89KVDB\r\n\n"  # PNG-style, as the entry file's, and not the same
VERSION: Final = 1
# magic, version, flags, header length, manifest size, block count, reserved, block size,
# header checksum (xxh3-64 of the 40 bytes before it and the header)
PREFIX: Final = struct.Struct("<8sHHIQIIQ8s")
PREFIX_BYTES: Final = PREFIX.size  # 48
CHECKSUMMED_PREFIX_BYTES: Final = PREFIX_BYTES - CHECKSUM_BYTES
MAX_HEADER_BYTES: Final = 1 << 20  # an identity, an id, 8 bytes a block: 64k blocks in 0.5 MiB
MAX_PIECE_BYTES: Final = 1 << 40  # a manifest or a block file: far above any entry kvd holds
_HEADER_FIELDS: Final = frozenset({"identity", "entry", "manifest", "blocks"})


class BundleError(ValueError):
    """A file that is not a whole, intact bundle this reader knows: what is wrong, in words."""


@dataclass(frozen=True)
class BundleHead:
    """A bundle's prefix and header, checked: where each piece lies and its checksum."""

    identity: Identity
    entry: str  # the exported entry's id, on the daemon it came from
    manifest_size: int
    manifest_checksum: bytes
    block_size: int  # every block file's size (0 without blocks)
    block_checksums: tuple[bytes, ...]
    header_length: int

    @property
    def manifest_offset(self) -> int:
        return PREFIX_BYTES + self.header_length

    def block_offset(self, index: int) -> int:
        return self.manifest_offset + self.manifest_size + index * self.block_size

    @property
    def file_size(self) -> int:
        return self.block_offset(len(self.block_checksums))


@dataclass(frozen=True)
class BundlePrefix:
    """The fixed prefix, its shape checked; the header it covers is checked with it."""

    header_length: int
    manifest_size: int
    block_count: int
    block_size: int
    header_checksum: bytes
    covered: bytes


def max_blocks(limits: Limits) -> int:
    """The most blocks a bundle may hold: an entry of max_tokens in the smallest blocks."""
    return limits.max_tokens // MIN_BLOCK_TOKENS


def parse_prefix(
    data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> BundlePrefix:
    """Check the first PREFIX_BYTES of a bundle."""
    if len(data) < PREFIX_BYTES:
        raise BundleError(f"{len(data)} bytes, shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, flags, length, manifest, count, reserved, block, digest = PREFIX.unpack_from(
        data
    )
    if magic != MAGIC:
        raise BundleError("not a kvd bundle (its magic differs)")
    if version != VERSION or flags or reserved:
        raise BundleError(
            f"bundle version {version} (flags {flags:#x}): this reader knows {VERSION}"
        )
    if not 0 < length <= MAX_HEADER_BYTES:
        raise BundleError(f"a header of {length} bytes, not 1..{MAX_HEADER_BYTES}")
    if not (_piece(manifest) and manifest):
        raise BundleError(f"a manifest of {manifest} bytes: not a whole entry file")
    if count > max_blocks(limits):
        raise BundleError(f"{count} blocks, over the {max_blocks(limits)} an entry may have")
    if not _piece(block) or (block == 0) != (count == 0):
        raise BundleError(f"{count} blocks of {block} bytes: not whole block files")
    return BundlePrefix(
        length, manifest, count, block, digest, bytes(data[:CHECKSUMMED_PREFIX_BYTES])
    )


def _piece(size: int) -> bool:
    """Whether size can be a tier file's: a multiple of ALIGNMENT, at most MAX_PIECE_BYTES."""
    return size % ALIGNMENT == 0 and size <= MAX_PIECE_BYTES


def parse_header(
    prefix: BundlePrefix,
    header: bytes | bytearray | memoryview,
    file_size: int,
    limits: Limits = DEFAULT_LIMITS,
) -> BundleHead:
    """Check a bundle's header (the prefix.header_length bytes after the prefix) against its
    checksum and the file's real size, and decode it within bounds."""
    if len(header) < prefix.header_length:
        raise BundleError(f"truncated: {len(header)} of {prefix.header_length} header bytes")
    header = memoryview(header)[: prefix.header_length]
    if checksum(prefix.covered + bytes(header)) != prefix.header_checksum:
        raise BundleError("its prefix and header do not match their checksum: damaged")
    declared = (
        PREFIX_BYTES
        + prefix.header_length
        + prefix.manifest_size
        + prefix.block_count * prefix.block_size
    )
    if file_size != declared:
        said = "truncated" if file_size < declared else "bytes after its end"
        raise BundleError(f"{said}: {file_size} bytes, {declared} declared")
    try:
        obj = msgpack.unpackb(
            header,
            raw=False,
            strict_map_key=True,
            use_list=False,
            max_str_len=limits.max_name_bytes * 8,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=0,
            max_map_len=16,
        )
    except (ValueError, msgpack.UnpackException) as exc:
        raise BundleError(f"its header is not msgpack of the bundle's shape: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != _HEADER_FIELDS:
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise BundleError(f"its header holds {keys}, not {sorted(_HEADER_FIELDS)}")
    try:
        identity = Identity.from_wire(obj["identity"], limits)
    except schema.SchemaError as exc:
        raise BundleError(f"its {exc}") from None
    entry, manifest, blocks = obj["entry"], obj["manifest"], obj["blocks"]
    if not isinstance(entry, str) or not entry or len(entry.encode()) > limits.max_name_bytes:
        raise BundleError("its entry id is not a name")
    if not isinstance(manifest, bytes) or len(manifest) != CHECKSUM_BYTES:
        raise BundleError("its manifest checksum is not 8 bytes")
    if not isinstance(blocks, bytes) or len(blocks) != prefix.block_count * CHECKSUM_BYTES:
        raise BundleError(f"its block checksums are not 8 bytes for each of {prefix.block_count}")
    return BundleHead(
        identity=identity,
        entry=entry,
        manifest_size=prefix.manifest_size,
        manifest_checksum=manifest,
        block_size=prefix.block_size,
        block_checksums=tuple(
            blocks[i : i + CHECKSUM_BYTES] for i in range(0, len(blocks), CHECKSUM_BYTES)
        ),
        header_length=prefix.header_length,
    )


def encode_head(
    identity: Identity,
    entry: str,
    *,
    manifest_size: int,
    manifest_checksum: bytes,
    block_size: int,
    block_checksums: tuple[bytes, ...],
) -> bytes:
    """A bundle's prefix and header; its length depends on the sizes alone (the checksums are
    fixed-width), so a writer may place the pieces first and write this at offset 0 last."""
    header: bytes = msgpack.packb(
        {
            "identity": identity.to_wire(),
            "entry": entry,
            "manifest": manifest_checksum,
            "blocks": b"".join(block_checksums),
        },
        use_bin_type=True,
    )
    prefix = PREFIX.pack(
        MAGIC, VERSION, 0, len(header), manifest_size, len(block_checksums), 0, block_size, b""
    )[:CHECKSUMMED_PREFIX_BYTES]
    return prefix + checksum(prefix + header) + header
