"""The S3 client's GET and PUT throughput on loopback against a real SeaweedFS (`weed mini`),
so that the remote tier's benchmarks know whether the client or the bucket sets the pace.

    .venv/bin/python bench/s3_client.py [--sizes 4 16] [--objects 32] [--threads 1 4]
                                        [--repeat 3] [--dir PATH]

Each row moves `--objects` MiB-sized objects with `--threads` threads (one connection each):
PUT is put_file_if_absent of a file (sendfile; the body's sha256 signed, as over plain http),
GET is get_to_file into a file (pwrite). Printed as a markdown table: MiB/s (median of the
repeats, then min-max), the client's CPU time per second of wall time (the rest is the
bucket's, on the same 2 cores), and the ratios to two anchors measured in the same run: curl
(libcurl's C client, --aws-sigv4) moving the same objects one at a time against the same
store (where curl is installed), and the same bytes through a loopback TCP socket by one
thread (no HTTP, no bucket), what no client could beat here. sha256 MiB/s shows what
signing a body costs a PUT.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "remote"))
from seaweed import ACCESS_KEY, SECRET_KEY, Seaweed, running_seaweed  # the tests' harness

from kvd.remote.bucket import Bucket

MiB = 1 << 20


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of one run."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def sha256_rate(data: bytes) -> float:
    """MiB/s of sha256 over `data`, the best of 3 (what signing a PUT's body costs)."""
    return len(data) / MiB / min(timed(lambda: hashlib.sha256(data))[0] for _ in range(3))


def loopback_tcp_seconds(data: bytes, total: int) -> float:
    """Seconds to send `total` bytes of `data` through a loopback socket to a reader."""
    server = socket.create_server(("127.0.0.1", 0))
    received = 0

    def read() -> None:
        nonlocal received
        connection, _ = server.accept()
        buffer = memoryview(bytearray(MiB))
        with connection:
            while count := connection.recv_into(buffer):
                received += count

    reader = threading.Thread(target=read)
    reader.start()
    started = time.perf_counter()
    with socket.create_connection(server.getsockname()) as sender:
        for _ in range(total // len(data)):
            sender.sendall(data)
    reader.join()
    server.close()
    assert received == total
    return time.perf_counter() - started


def curl_rates(
    seaweed: Seaweed, folder: Path, size: int, objects: int, repeat: int
) -> dict[str, list[float]]:
    """MiB/s of curl's PUT and GET of `objects` objects one after the other (one process
    each: a few ms of start-up per object); {} without curl."""
    curl = shutil.which("curl")
    if curl is None:
        return {}
    source = folder / f"curl-{size}"
    source.write_bytes(os.urandom(size))
    sign = ["--aws-sigv4", "aws:amz:us-east-1:s3", "--user", f"{ACCESS_KEY}:{SECRET_KEY}"]
    unsigned = ["-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"]
    rates: dict[str, list[float]] = {"PUT": [], "GET": []}
    for attempt in range(repeat):
        urls = [f"{seaweed.endpoint}/kvd/curl/{size}/{attempt}/{n}" for n in range(objects)]
        for name, transfer in (("PUT", ["-T", str(source)]), ("GET", ["-o", os.devnull])):
            started = time.perf_counter()
            for url in urls:
                command = [curl, "-sSf", *sign, *unsigned, *transfer, url]
                subprocess.run(command, check=True, capture_output=True)
            rates[name].append(size * objects / MiB / (time.perf_counter() - started))
    return rates


def run_size(
    bucket: Bucket, folder: Path, size: int, *, objects: int, threads: int, repeat: int
) -> list[tuple[str, list[float], list[float]]]:
    """(operation, MiB/s of each repeat, client CPU share of each repeat) for PUT and GET."""
    body = os.urandom(size)
    source = folder / f"source-{size}"
    source.write_bytes(body)
    puts: list[tuple[float, float]] = []
    gets: list[tuple[float, float]] = []
    for attempt in range(repeat):
        keys = [f"bench/{size}/{threads}/{attempt}/{n}" for n in range(objects)]

        def put(key: str) -> None:
            with source.open("rb") as file:
                assert bucket.put_file_if_absent(key, file.fileno(), size)

        def get(key: str) -> None:
            fd = os.open(folder / f"target-{threading.get_ident()}", os.O_RDWR | os.O_CREAT)
            try:
                assert bucket.get_to_file(key, fd, size) == size
            finally:
                os.close(fd)

        with ThreadPoolExecutor(threads) as pool:
            puts.append(timed(lambda: list(pool.map(put, keys))))  # noqa: B023 - run at once
            gets.append(timed(lambda: list(pool.map(get, keys))))  # noqa: B023 - run at once
        for key in keys:
            bucket.delete(key)
    total = size * objects / MiB
    return [
        (name, [total / wall for wall, _ in runs], [cpu / wall for wall, cpu in runs])
        for name, runs in (("PUT", puts), ("GET", gets))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16], help="MiB per object")
    parser.add_argument("--objects", type=int, default=32, help="objects per row")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", help="where the bucket and the files live (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        with running_seaweed(folder / "store") as seaweed:
            bucket = seaweed.bucket()
            print(
                "| object | threads | op | MiB/s (min-max) | client CPU/wall "
                "| × curl | × loopback TCP |"
            )
            print("|---:|---:|---|---:|---:|---:|---:|")
            for size_mib in args.sizes:
                size = size_mib * MiB
                data = os.urandom(size)
                total = size * args.objects
                tcp = total / MiB / loopback_tcp_seconds(data, total)
                sha256 = sha256_rate(data)
                curl = curl_rates(seaweed, folder, size, args.objects, args.repeat)
                print(f"| {size_mib} MiB | 1 | loopback TCP (anchor) | {tcp:.0f} | | | 1.00 |")
                print(f"| {size_mib} MiB | 1 | sha256 of the body | {sha256:.0f} | | | |")
                curl_median = {name: statistics.median(rates) for name, rates in curl.items()}
                for name, rates in curl.items():
                    print(
                        f"| {size_mib} MiB | 1 | curl {name} (anchor) | {curl_median[name]:.0f} "
                        f"({min(rates):.0f}-{max(rates):.0f}) | | 1.00 "
                        f"| {curl_median[name] / tcp:.3f} |"
                    )
                for threads in args.threads:
                    rows = run_size(
                        bucket,
                        folder,
                        size,
                        objects=args.objects,
                        threads=threads,
                        repeat=args.repeat,
                    )
                    for name, rates, shares in rows:
                        median = statistics.median(rates)
                        against_curl = f"{median / curl_median[name]:.2f}" if curl else ""
                        print(
                            f"| {size_mib} MiB | {threads} | {name} | {median:.0f} "
                            f"({min(rates):.0f}-{max(rates):.0f}) | "
                            f"{statistics.median(shares):.2f} | {against_curl} "
                            f"| {median / tcp:.3f} |"
                        )
            bucket.close()


if __name__ == "__main__":
    main()
