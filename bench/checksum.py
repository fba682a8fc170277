"""Checksum throughput against memcpy and a page-cache read of the same bytes.

The entry format checksums every tensor (kvd_protocol.checksum: xxh3-64). A reader that verifies
pays one checksum pass per restore, so the checksum must run faster than the read it follows.

    .venv/bin/python bench/checksum.py [--sizes 256 16] [--repeat 3] [--dir PATH]

Prints a markdown table: GB/s per algorithm, and its ratio to the two anchors measured in the
same run (memcpy into a preallocated buffer; readinto from a warm file); a ratio above 1 means
faster than the anchor.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import xxhash

MiB = 1 << 20

Hasher = Callable[[memoryview], object]
ALGORITHMS: dict[str, Hasher] = {
    "xxh3_64 (current)": xxhash.xxh3_64_digest,
    "xxh64": xxhash.xxh64_digest,
    "xxh3_128": xxhash.xxh3_128_digest,
    "zlib.crc32": zlib.crc32,
    "blake2b": lambda data: hashlib.blake2b(data).digest(),
    "sha1": lambda data: hashlib.sha1(data).digest(),
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "md5": lambda data: hashlib.md5(data).digest(),
}


def best_seconds(run: Callable[[], object], repeat: int) -> float:
    """The fastest of repeat runs: the least disturbed measurement of a memory-bound loop."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def page_cache_read_seconds(data: memoryview, folder: str | None, repeat: int) -> float:
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "bytes"
        path.write_bytes(data)
        target = bytearray(len(data))
        with path.open("rb", buffering=0) as f:

            def read() -> None:
                f.seek(0)
                view = memoryview(target)
                while view:  # readinto may return short counts on large requests
                    view = view[f.readinto(view) :]

            read()  # warm: the bytes are in the page cache from here on
            return best_seconds(read, repeat)


def measure(size: int, folder: str | None, repeat: int) -> list[tuple[str, float]]:
    data = memoryview(os.urandom(size))
    target = memoryview(bytearray(size))

    def copy() -> None:
        target[:] = data  # memoryview assignment is one memcpy (bytearray's own is slower)

    rows = [
        ("memcpy (anchor)", best_seconds(copy, repeat)),
        ("page-cache read (anchor)", page_cache_read_seconds(data, folder, repeat)),
    ]
    for name, algorithm in ALGORITHMS.items():
        rows.append((name, best_seconds(partial(algorithm, data), repeat)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 16], help="MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the page-cache file lives")
    args = parser.parse_args()
    print("| buffer | algorithm | GB/s | ratio to memcpy | ratio to page-cache read |")
    print("|---|---|---:|---:|---:|")
    for mib in args.sizes:
        size = mib * MiB
        rows = measure(size, args.dir, args.repeat)
        memcpy, read = rows[0][1], rows[1][1]
        for name, seconds in rows:
            rate = size / seconds / 1e9
            print(
                f"| {mib} MiB | {name} | {rate:.2f} | {memcpy / seconds:.2f} | "
                f"{read / seconds:.2f} |"
            )


if __name__ == "__main__":
    main()
