"""The bundle's format (kvd_protocol.bundle): what export writes reads back; on any other
input, a damaged, truncated or forged head included, the reader raises BundleError alone and
is never made to read or hold more than its bounds."""

from __future__ import annotations

import contextlib
import random
import struct

import msgpack
import pytest
from kvd_protocol import bundle, ops
from kvd_protocol.bundle import BundleError
from kvd_protocol.checksum import checksum
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity("m", "cfg", "tok", "codecs/1", "mlx/cpu", traits="kv=8bit-g64")
MANIFEST = 3 * 16384
BLOCK = 2 * 16384
BLOCKS = 4


def _head(**changed: object) -> bytes:
    fields: dict[str, object] = {
        "manifest_size": MANIFEST,
        "manifest_checksum": checksum(b"manifest"),
        "block_size": BLOCK,
        "block_checksums": tuple(checksum(bytes([i])) for i in range(BLOCKS)),
    } | changed
    return bundle.encode_head(IDENTITY, "0123abcd", **fields)  # type: ignore[arg-type]


def _read(head: bytes, file_size: int | None = None) -> bundle.BundleHead:
    prefix = bundle.parse_prefix(head)
    size = len(head) + MANIFEST + BLOCKS * BLOCK if file_size is None else file_size
    return bundle.parse_header(prefix, head[bundle.PREFIX_BYTES :], size)


def _forged(header: object, *, count: int = BLOCKS, block: int = BLOCK) -> bytes:
    """A head whose header is any msgpack value, with a checksum that matches it."""
    body: bytes = msgpack.packb(header, use_bin_type=True)
    prefix = bundle.PREFIX.pack(bundle.MAGIC, 1, 0, len(body), MANIFEST, count, 0, block, b"")
    covered = prefix[: bundle.CHECKSUMMED_PREFIX_BYTES]
    return covered + checksum(covered + body) + body


def test_a_head_reads_back_with_every_piece_in_place() -> None:
    head = _head()
    read = _read(head)
    assert read.identity == IDENTITY
    assert read.identity.traits == IDENTITY.traits
    assert read.entry == "0123abcd"
    assert read.manifest_offset == len(head)
    assert read.block_offset(1) == len(head) + MANIFEST + BLOCK
    assert read.file_size == len(head) + MANIFEST + BLOCKS * BLOCK
    assert read.block_checksums[2] == checksum(bytes([2]))


def test_the_head_length_depends_on_the_sizes_alone() -> None:
    assert len(_head()) == len(_head(manifest_checksum=bytes(8), block_checksums=(bytes(8),) * 4))


def test_every_flipped_byte_of_the_head_is_refused() -> None:
    head = _head()
    for at in range(len(head)):
        for bit in (0x01, 0x80):
            flipped = head[:at] + bytes([head[at] ^ bit]) + head[at + 1 :]
            with pytest.raises(BundleError):
                _read(flipped, len(head) + MANIFEST + BLOCKS * BLOCK)


def test_every_cut_of_the_head_and_a_file_of_another_size_are_refused() -> None:
    head = _head()
    for end in range(len(head)):
        with pytest.raises(BundleError):
            _read(head[:end])
    whole = len(head) + MANIFEST + BLOCKS * BLOCK
    with pytest.raises(BundleError, match="truncated"):
        _read(head, whole - 1)
    with pytest.raises(BundleError, match="after its end"):
        _read(head, whole + 1)


def test_a_prefix_that_would_make_the_reader_read_or_hold_too_much_is_refused_alone() -> None:
    def prefix(length: int, manifest: int, count: int, block: int) -> bytes:
        return bundle.PREFIX.pack(bundle.MAGIC, 1, 0, length, manifest, count, 0, block, bytes(8))

    too_many = bundle.max_blocks(DEFAULT_LIMITS) + 1
    cases = {
        "header of": prefix(bundle.MAX_HEADER_BYTES + 1, MANIFEST, 1, BLOCK),
        "blocks, over": prefix(100, MANIFEST, too_many, BLOCK),
        "not a whole entry file": prefix(100, MANIFEST + 1, 1, BLOCK),
        "not whole block files": prefix(100, MANIFEST, 1, bundle.MAX_PIECE_BYTES + 16384),
    }
    for said, data in cases.items():
        with pytest.raises(BundleError, match=said):
            bundle.parse_prefix(data)
    with pytest.raises(BundleError, match="blocks of 0 bytes"):
        bundle.parse_prefix(prefix(100, MANIFEST, 1, 0))


def test_a_header_of_another_shape_is_refused_though_its_checksum_matches() -> None:
    good = {
        "identity": IDENTITY.to_wire(),
        "entry": "e",
        "manifest": bytes(8),
        "blocks": bytes(8 * BLOCKS),
    }
    cases = [
        [1, 2, 3],
        {**good, "more": 1},
        {k: v for k, v in good.items() if k != "entry"},
        {**good, "identity": {"model_id": "m"}},
        {**good, "entry": 7},
        {**good, "entry": ""},
        {**good, "manifest": bytes(7)},
        {**good, "blocks": bytes(8 * BLOCKS - 1)},
        {**good, "identity": [IDENTITY.to_wire()] * 2},
    ]
    for header in cases:
        head = _forged(header)
        with pytest.raises(BundleError):
            _read(head)
    assert _read(_forged(good)).entry == "e"


def test_random_bytes_are_refused_with_a_bundle_error_alone() -> None:
    rng = random.Random(32)
    head = _head()
    for _ in range(2000):
        data = bytearray(head)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data[: bundle.PREFIX_BYTES] = struct.pack("<8s40s", bundle.MAGIC, rng.randbytes(40))
        with contextlib.suppress(BundleError):  # anything else fails the test
            _read(bytes(data), rng.choice([len(data), len(data) + MANIFEST + BLOCKS * BLOCK]))


def test_presence_names_its_identity_whole_or_by_digest_and_not_both() -> None:
    tokens = pack_tokens([1, 2, 3])
    for identity, digest in ((IDENTITY, IDENTITY.digest()), (None, None)):
        wire = {
            "op": "presence",
            "id": 1,
            "identity": identity.to_wire() if identity else None,
            "digest": digest,
            "tokens": tokens,
        }
        with pytest.raises(ProtocolError) as caught:
            ops.decode_request(wire, DEFAULT_LIMITS)
        assert caught.value.code is ErrorCode.BAD_MESSAGE
