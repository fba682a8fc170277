"""Entry-header encode and decode time against plain msgpack of the same header map.

A 128k-token, 80-layer entry: plain KV (2 slots per layer) and 4-bit quantized KV (6 slots per
layer), as a version 1 entry, as a version 2 manifest (blocks of 256 tokens: the manifest keeps
the tail rows and the block list) and one of that manifest's block files. Encode = planning +
head bytes (a block: block_head alone, the plan being shared by all blocks); decode =
parse_prefix + parse_header or parse_block_header (checksum, msgpack, every validation rule; a
manifest's block hashes are recomputed from its tokens). The anchor is msgpack.packb / unpackb
of the header map alone.

    .venv/bin/python bench/header.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import msgpack
from kvd_protocol.blocks import BLOCK_TOKENS, block_name
from kvd_protocol.entry import (
    PREFIX_BYTES,
    LayerSpec,
    TensorSpec,
    encode_block_header,
    encode_header,
    plan_entry,
    plan_manifest,
)
from kvd_protocol.entry_reader import parse_block_header, parse_header, parse_prefix
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

TOKENS = 128 * 1024
LAYERS = 80
HEADS, HEAD_DIM, BITS, GROUP = 8, 128, 4, 64
IDENTITY = Identity("org/model-70b", "cfg", "tok", "codec-1", "mlx-0.32.4/gpu")
CHECKSUM = b"\x5a" * 8


def plain_layer() -> LayerSpec:
    kv = TensorSpec("float16", (1, HEADS, TOKENS, HEAD_DIM))
    return LayerSpec("kv", (kv, kv), trimmable=True, meta={"offset": TOKENS})


def quantized_layer() -> LayerSpec:
    packed = TensorSpec("uint32", (1, HEADS, TOKENS, HEAD_DIM * BITS // 32))
    scales = TensorSpec("float16", (1, HEADS, TOKENS, HEAD_DIM // GROUP))
    return LayerSpec(
        "qkv",
        (packed, scales, scales, packed, scales, scales),
        trimmable=True,
        meta={"offset": TOKENS, "bits": BITS, "group_size": GROUP},
    )


def best_us(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def measure(
    head: Callable[[], bytes],
    parse: Callable[[bytes], object],
    encode: Callable[[object], bytes],
    repeat: int,
) -> dict[str, float | int]:
    """head makes a file's head; parse reads one; encode gives a parsed header's bytes back."""
    sample = head()
    prefix = parse_prefix("bench", sample[:PREFIX_BYTES])
    header_bytes = sample[PREFIX_BYTES : PREFIX_BYTES + prefix.header_length]
    assert encode(parse(sample)) == header_bytes
    header_map = msgpack.unpackb(header_bytes, raw=False)
    return {
        "header bytes": len(header_bytes),
        "file GiB": prefix.file_size / (1 << 30),
        "encode": best_us(head, repeat),
        "packb": best_us(lambda: msgpack.packb(header_map, use_bin_type=True), repeat),
        "decode": best_us(lambda: parse(sample), repeat),
        "unpackb": best_us(lambda: msgpack.unpackb(header_bytes, raw=False), repeat),
    }


def rows(layer: LayerSpec, repeat: int) -> list[tuple[str, int, dict[str, float | int]]]:
    """(kind of file, slots, measures) of the entry, the manifest and a block of layer's."""
    tokens = pack_tokens(i % 50_000 for i in range(TOKENS))
    layers = [layer] * LAYERS
    blocked = [dataclasses.replace(layer, blocked=True)] * LAYERS

    def entry_head() -> bytes:
        plan = plan_entry(IDENTITY, tokens, layers, created=1.7e9, min_reuse=0)
        return plan.head([CHECKSUM] * len(plan.slots))

    def manifest_head() -> bytes:
        plan = plan_manifest(
            IDENTITY, tokens, blocked, block_tokens=BLOCK_TOKENS, created=1.7e9, min_reuse=0
        )
        return plan.entry.head([CHECKSUM] * len(plan.entry.slots))

    def parse_entry(head: bytes) -> object:
        prefix = parse_prefix("bench", head[:PREFIX_BYTES])
        return parse_header("bench", prefix, head[PREFIX_BYTES:], prefix.file_size)

    plan = plan_manifest(
        IDENTITY, tokens, blocked, block_tokens=BLOCK_TOKENS, created=1.7e9, min_reuse=0
    )
    name = block_name(plan.hashes[1])

    def block_head() -> bytes:
        return plan.block_head(1, [CHECKSUM] * len(plan.block_slots))

    def parse_block(head: bytes) -> object:
        prefix = parse_prefix(name, head[:PREFIX_BYTES])
        return parse_block_header(name, prefix, head[PREFIX_BYTES:], prefix.file_size)

    slots = LAYERS * len(layer.tensors)
    encode_entry: Callable[[object], bytes] = encode_header  # type: ignore[assignment]
    encode_block: Callable[[object], bytes] = encode_block_header  # type: ignore[assignment]
    return [
        ("entry (v1)", slots, measure(entry_head, parse_entry, encode_entry, repeat)),
        ("manifest (v2)", slots, measure(manifest_head, parse_entry, encode_entry, repeat)),
        (f"block of {BLOCK_TOKENS}", slots, measure(block_head, parse_block, encode_block, repeat)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(
        "| layers | file | slots | header bytes | file GiB | encode µs | packb µs (anchor) "
        "| ratio | decode µs | unpackb µs (anchor) | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, layer in (("plain KV", plain_layer()), ("4-bit quantized KV", quantized_layer())):
        for kind, slots, r in rows(layer, args.repeat):
            print(
                f"| {name} | {kind} | {slots} | {r['header bytes']} | {r['file GiB']:.4g} "
                f"| {r['encode']:.0f} | {r['packb']:.0f} | {r['encode'] / r['packb']:.1f} "
                f"| {r['decode']:.0f} | {r['unpackb']:.0f} | {r['decode'] / r['unpackb']:.1f} |"
            )


if __name__ == "__main__":
    main()
