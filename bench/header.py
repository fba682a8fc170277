"""Entry-header encode and decode time against plain msgpack of the same header map.

A 128k-token, 80-layer entry: plain KV (2 slots per layer) and 4-bit quantized KV (6 slots per
layer). Encode = plan_entry + head bytes; decode = parse_prefix + parse_header (checksum,
msgpack, every validation rule). The anchor is msgpack.packb / unpackb of the header map alone.

    .venv/bin/python bench/header.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import msgpack
from kvd_protocol.entry import (
    PREFIX_BYTES,
    LayerSpec,
    TensorSpec,
    encode_header,
    plan_entry,
)
from kvd_protocol.entry_reader import parse_header, parse_prefix
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

TOKENS = 128 * 1024
LAYERS = 80
HEADS, HEAD_DIM, BITS, GROUP = 8, 128, 4, 64
IDENTITY = Identity("org/model-70b", "cfg", "tok", "codec-1", "mlx-0.32.4/gpu")


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


def measure(layer: LayerSpec, repeat: int) -> dict[str, float | int]:
    tokens = pack_tokens(i % 50_000 for i in range(TOKENS))
    layers = [layer] * LAYERS

    def plan_and_head() -> bytes:
        plan = plan_entry(IDENTITY, tokens, layers, created=1.7e9, min_reuse=0)
        return plan.head([b"\x5a" * 8] * len(plan.slots))

    head = plan_and_head()
    prefix = parse_prefix("bench", head[:PREFIX_BYTES])
    header_bytes = head[PREFIX_BYTES : PREFIX_BYTES + prefix.header_length]
    file_size = parse_header("bench", prefix, header_bytes, prefix.file_size).file_size
    header_map = msgpack.unpackb(header_bytes, raw=False)
    assert encode_header(parse_header("bench", prefix, header_bytes, file_size)) == header_bytes

    def decode() -> object:
        return parse_header(
            "bench", parse_prefix("bench", head[:PREFIX_BYTES]), header_bytes, file_size
        )

    return {
        "slots": LAYERS * len(layer.tensors),
        "header bytes": len(header_bytes),
        "file GiB": file_size / (1 << 30),
        "encode": best_us(plan_and_head, repeat),
        "packb": best_us(lambda: msgpack.packb(header_map, use_bin_type=True), repeat),
        "decode": best_us(decode, repeat),
        "unpackb": best_us(lambda: msgpack.unpackb(header_bytes, raw=False), repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(
        "| entry | slots | header bytes | file GiB | encode µs | packb µs (anchor) | ratio "
        "| decode µs | unpackb µs (anchor) | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, layer in (("plain KV", plain_layer()), ("4-bit quantized KV", quantized_layer())):
        r = measure(layer, args.repeat)
        print(
            f"| {name} | {r['slots']} | {r['header bytes']} | {r['file GiB']:.1f} "
            f"| {r['encode']:.0f} | {r['packb']:.0f} | {r['encode'] / r['packb']:.1f} "
            f"| {r['decode']:.0f} | {r['unpackb']:.0f} | {r['decode'] / r['unpackb']:.1f} |"
        )


if __name__ == "__main__":
    main()
