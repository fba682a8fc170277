"""Valid and forged entry files for the entry-format tests, built in memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
from kvd_protocol.blocks import block_name
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import (
    CHECKSUMMED_PREFIX_BYTES,
    FORMAT_VERSION,
    MAGIC,
    PREFIX,
    PREFIX_BYTES,
    BlockHeader,
    Checkpoint,
    EntryHeader,
    EntryPlan,
    LayerSpec,
    ManifestPlan,
    TensorSpec,
    align_up,
    header_checksum,
    plan_entry,
    plan_manifest,
)
from kvd_protocol.entry_reader import parse_block_header, parse_header, parse_prefix
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity("org/model", "cfg0", "tok0", "codec-1", "mlx-0.32.4/cpu", "tenant")


def sample_plan(tokens: int = 40) -> EntryPlan:
    """Two layers (plain KV, then an untrimmable SSM state) and a checkpoint."""
    layers = [
        LayerSpec(
            "kv",
            (TensorSpec("float16", (1, 2, tokens, 8)), TensorSpec("float16", (1, 2, tokens, 8))),
            trimmable=True,
            meta={"offset": tokens},
        ),
        LayerSpec(
            "ssm",
            (TensorSpec("float32", (1, 3, 5)), TensorSpec("bfloat16", (1, 4, 4))),
            trimmable=False,
            meta={"lengths": None, "nested": {"a": [1, 2.5, b"x", "y", True]}},
        ),
    ]
    checkpoint = Checkpoint("gen-1", 7, 1234, True, tokens - 2, 2)
    return plan_entry(
        IDENTITY,
        pack_tokens(range(tokens)),
        layers,
        created=1_700_000_000.25,
        min_reuse=3,
        checkpoint=checkpoint,
        meta={"mlx_lm": "0.32.2", "step": 3, "temp": 0.5, "greedy": False},
    )


def manifest_layers(tokens: int) -> list[LayerSpec]:
    """Plain KV and 4-bit quantized KV (blocked), an SSM state and a rotating window (whole)."""
    kv = TensorSpec("float16", (1, 2, tokens, 8))
    packed, scales = (
        TensorSpec("uint32", (1, 2, tokens, 1)),
        TensorSpec("float16", (1, 2, tokens, 1)),
    )
    return [
        LayerSpec("kv", (kv, kv), trimmable=True, meta={"offset": tokens}, blocked=True),
        LayerSpec(
            "ssm", (TensorSpec("float32", (1, 3, 5)),), trimmable=False, meta={"lengths": None}
        ),
        LayerSpec(
            "quantized_kv",
            (packed, scales, scales, packed, scales, scales),
            trimmable=True,
            meta={"offset": tokens, "bits": 4, "group_size": 8},
            blocked=True,
        ),
        LayerSpec("rotating", (TensorSpec("bfloat16", (1, 2, 16, 8)),) * 2, trimmable=False),
    ]


def sample_manifest(tokens: int = 40, block_tokens: int = 16) -> ManifestPlan:
    """40 tokens in blocks of 16: 2 blocks and an 8-token tail."""
    return plan_manifest(
        IDENTITY,
        pack_tokens(range(100, 100 + tokens)),
        manifest_layers(tokens),
        block_tokens=block_tokens,
        created=1_700_000_000.5,
        min_reuse=min(2, tokens),
        checkpoint=Checkpoint("gen-2", 9, 99, False, max(0, tokens - 1), 1),
        meta={"mlx_lm": "0.32.2"},
    )


def write_blocks(plan: ManifestPlan) -> list[tuple[str, bytearray, BlockHeader]]:
    """Every block file of plan as a writer makes it: (its name, its bytes, its header)."""
    files = []
    for index, digest in enumerate(plan.hashes):
        blob = bytearray(plan.block_size)
        sums = []
        for k, slot in enumerate(plan.block_slots):
            data = bytes((index * 31 + k + j) % 253 for j in range(slot.nbytes))
            blob[slot.start : slot.end] = data
            sums.append(checksum(data))
        head = plan.block_head(index, sums)
        blob[: len(head)] = head
        files.append((block_name(digest), blob, plan.block_header(index, sums)))
    return files


def read_block(
    blob: bytes | bytearray, name: str = "b.kvb", limits: Limits = DEFAULT_LIMITS
) -> BlockHeader:
    """Read as a reader of a block file would: prefix, then the header bytes it announces."""
    prefix = parse_prefix(name, blob[:PREFIX_BYTES], limits)
    header = blob[PREFIX_BYTES : PREFIX_BYTES + prefix.header_length]
    return parse_block_header(name, prefix, header, len(blob), limits)


def write(plan: EntryPlan, tensors: Sequence[bytes] | None = None) -> tuple[bytearray, EntryHeader]:
    """The whole file, written as a writer would: tensors at their offsets, then the head."""
    blob = bytearray(plan.file_size)
    sums = []
    for i, slot in enumerate(plan.slots):
        data = (
            tensors[i] if tensors is not None else bytes((i + k) % 251 for k in range(slot.nbytes))
        )
        blob[slot.start : slot.end] = data
        sums.append(checksum(data))
    blob[: plan.data_start] = plan.head(sums)
    return blob, plan.finish(sums)


def read(blob: bytes | bytearray, limits: Limits = DEFAULT_LIMITS, name: str = "e") -> EntryHeader:
    """Read as a reader of a file would: prefix, then exactly the header bytes it announces."""
    prefix = parse_prefix(name, blob[:PREFIX_BYTES], limits)
    header = blob[PREFIX_BYTES : PREFIX_BYTES + prefix.header_length]
    return parse_header(name, prefix, header, len(blob), limits)


def header_of(blob: bytes | bytearray) -> dict[str, Any]:
    """The decoded header map of a valid file, with lists as lists so tests can edit it."""
    length = PREFIX.unpack_from(blob)[3]
    obj: dict[str, Any] = msgpack.unpackb(
        bytes(blob[PREFIX_BYTES : PREFIX_BYTES + length]), raw=False
    )
    return obj


def data_of(blob: bytes | bytearray) -> bytes:
    """The bytes from data start to the end of a valid file."""
    return bytes(blob[PREFIX.unpack_from(blob)[4] :])


def forge(header: object, data: bytes, **prefix: Any) -> bytes:
    """A file with any header object and prefix fields, and a correct header checksum."""
    return forge_packed(msgpack.packb(header, use_bin_type=True), data, **prefix)


def forge_packed(
    packed: bytes,
    data: bytes,
    *,
    magic: bytes = MAGIC,
    version: int = FORMAT_VERSION,
    flags: int = 0,
    reserved: bytes = bytes(8),
    header_length: int | None = None,
    data_start: int | None = None,
    file_size: int | None = None,
) -> bytes:
    """A file with any header bytes and prefix fields, and a correct header checksum."""
    start = align_up(PREFIX_BYTES + len(packed)) if data_start is None else data_start
    size = start + len(data) if file_size is None else file_size
    length = len(packed) if header_length is None else header_length
    covered = PREFIX.pack(magic, version, flags, length, start, size, reserved, b"")
    covered = covered[:CHECKSUMMED_PREFIX_BYTES]
    body = covered + header_checksum(covered, packed) + packed
    return body + bytes(max(0, start - len(body))) + data
