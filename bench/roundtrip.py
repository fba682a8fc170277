"""Round trip of a small request to kvd against Redis on a Unix socket, 1 and 8 clients.

kvd: a ping, and a lookup that misses (its identity holds one entry, the prompt shares no
prefix with it), each through kvd_client.Client, timed around the call as an engine sees it.
Anchors, measured in the same run against a redis-server started here on a temporary Unix
socket: `redis-benchmark -s SOCK -t ping -c C` (a C client: the PING_MBULK row), and a raw
Python client sending the same RESP PING (the fairer anchor: kvd's client is Python too).

Concurrent clients are separate processes, each with its own connection, started together:
threads of one process would share one GIL and measure the benchmark, not the server. The
machine's core count limits what 8 clients can show; it is printed with the table. Without
redis-server on PATH the kvd rows are printed alone, with a note.

Beside the latencies, the CPU time each request cost the client processes and the server
(kvd or redis-server) process: on a machine shared with other work the latencies move with
its load, the CPU times far less, so they show what a change to either side did.

    .venv/bin/python bench/roundtrip.py [--requests 20000] [--tokens 256]
"""

from __future__ import annotations

import argparse
import csv
import io
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path

import psutil
from _daemon import running_daemon, socket_folder
from kvd_client.client import Client
from kvd_protocol.entry import LayerSpec, TensorSpec
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity("bench/roundtrip", "cfg", "tok", "codecs/1", "mlx/cpu")
STORED_TOKENS = list(range(1, 65))  # the one entry: the miss walks a real index, not nothing
CONCURRENCY = (1, 8)
WARMUP = 200  # requests per client before the clock starts
START_DELAY = 0.5  # seconds from handing out a job to its synchronized start
# kvd's p50 within this many times redis-benchmark's p50, by clients
GOAL = {1: 2.0, 8: 4.0}
RESP_PING = b"*1\r\n$4\r\nPING\r\n"  # the RESP array form: redis-benchmark's PING_MBULK
RESP_PONG = b"+PONG\r\n"


@dataclass(frozen=True)
class Job:
    kind: str  # a key of OPERATIONS
    address: str  # the socket
    requests: int
    tokens: int  # prompt length of a lookup
    start_at: float  # time.monotonic() at which every client of the run starts


@dataclass(frozen=True)
class Timings:
    started: float
    ended: float
    latencies: list[float]  # seconds
    cpu: float  # seconds of this client process's CPU time over the timed requests


# --- what a client process runs ------------------------------------------------------------


@contextmanager
def kvd_ping(job: Job) -> Iterator[Callable[[], object]]:
    with Client.connect(job.address, require=True) as client:
        yield client.ping


@contextmanager
def kvd_lookup_miss(job: Job) -> Iterator[Callable[[], object]]:
    prompt = pack_tokens(range(100_000, 100_000 + job.tokens))
    with Client.connect(job.address, require=True) as client:

        def lookup() -> None:
            if client.lookup(IDENTITY, prompt) is not None:
                raise AssertionError("the lookup was meant to miss")

        yield lookup
        if client.stats.failed_lookups:  # a refused lookup is also None: not a real miss
            raise AssertionError(f"{client.stats.failed_lookups} lookups failed")


@contextmanager
def resp_ping(job: Job) -> Iterator[Callable[[], object]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(job.address)

        def ping() -> None:
            sock.sendall(RESP_PING)
            reply = b""
            while len(reply) < len(RESP_PONG):
                chunk = sock.recv(64)
                if not chunk:
                    raise ConnectionError("redis closed the connection")
                reply += chunk
            if reply != RESP_PONG:
                raise AssertionError(f"unexpected reply {reply!r}")

        yield ping


OPERATIONS = {"kvd ping": kvd_ping, "kvd lookup miss": kvd_lookup_miss, "resp ping": resp_ping}


def run_job(job: Job) -> Timings:
    with OPERATIONS[job.kind](job) as call:
        for _ in range(WARMUP):
            call()
        time.sleep(max(0.0, job.start_at - time.monotonic()))
        latencies = []
        clock = time.perf_counter
        started, cpu = time.monotonic(), time.process_time()
        for _ in range(job.requests):
            t0 = clock()
            call()
            latencies.append(clock() - t0)
        ended, cpu = time.monotonic(), time.process_time() - cpu
    return Timings(started, ended, latencies, cpu)


def worker(jobs: Queue[Job | None], results: Queue[Timings | str]) -> None:
    while (job := jobs.get()) is not None:
        try:
            results.put(run_job(job))
        except Exception as exc:  # reported to the parent, which stops the run
            results.put(f"{job.kind}: {type(exc).__name__}: {exc}")


class ClientPool:
    """Client processes that run the same job together; spawned once, reused per case."""

    def __init__(self, size: int) -> None:
        context = mp.get_context("spawn")  # the same on Linux and macOS
        self.jobs: list[Queue[Job | None]] = [context.Queue() for _ in range(size)]
        self.results: Queue[Timings | str] = context.Queue()
        self.processes = [
            context.Process(target=worker, args=(jobs, self.results), daemon=True)
            for jobs in self.jobs
        ]
        for process in self.processes:
            process.start()

    def run(
        self, kind: str, address: str, clients: int, requests: int, tokens: int, *, server: int
    ) -> Stats:
        """The case's figures; server: the pid of the process answering, for its CPU time."""
        start_at = time.monotonic() + START_DELAY
        each = max(1, requests // clients)  # redis-benchmark's -n is the total, too
        for jobs in self.jobs[:clients]:
            jobs.put(Job(kind, address, each, tokens, start_at))
        timings = []
        server_cpu = _cpu_seconds(server)  # from the hand-out: the warm-up is counted too
        for _ in range(clients):
            result = self.results.get()
            if isinstance(result, str):
                raise RuntimeError(result)
            timings.append(result)
        server_cpu = _cpu_seconds(server) - server_cpu
        latencies = [t for timing in timings for t in timing.latencies]
        elapsed = max(t.ended for t in timings) - min(t.started for t in timings)
        client_cpu = sum(t.cpu for t in timings) / len(latencies)
        served = len(latencies) + WARMUP * clients
        return Stats.of(latencies, len(latencies) / elapsed, client_cpu, server_cpu / served)

    def close(self) -> None:
        for jobs in self.jobs:
            jobs.put(None)
        for process in self.processes:
            process.join()


# --- statistics and anchors ----------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


@dataclass(frozen=True)
class Stats:
    p50: float  # seconds
    p99: float
    ops: float  # per second, all clients together
    client_cpu: float | None = None  # seconds of client CPU per request (None: not measured)
    server_cpu: float | None = None  # seconds of the server's CPU per request

    @classmethod
    def of(cls, latencies: list[float], ops: float, client_cpu: float, server_cpu: float) -> Stats:
        cuts = statistics.quantiles(latencies, n=100)
        return cls(statistics.median(latencies), cuts[98], ops, client_cpu, server_cpu)


@contextmanager
def redis_server(folder: str) -> Iterator[tuple[str, int] | None]:
    """A redis-server on a Unix socket in folder (no TCP, no persistence): its socket path and
    pid, or None when redis-server is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    path = os.path.join(folder, "redis.sock")
    command = [binary, "--port", "0", "--unixsocket", path, "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(
        [*command, "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.01)
        yield path, process.pid
    finally:
        process.terminate()
        process.wait()


def redis_benchmark(path: str, clients: int, requests: int) -> Stats | None:
    """redis-benchmark's own numbers for the RESP PING (PING_MBULK), or None without it."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    command = [binary, "-s", path, "-t", "ping", "-n", str(requests), "-c", str(clients)]
    output = subprocess.run([*command, "--csv"], capture_output=True, text=True, check=True)
    for row in csv.DictReader(io.StringIO(output.stdout)):
        if row["test"] == "PING_MBULK":
            ms = 1e-3
            p50, p99 = float(row["p50_latency_ms"]) * ms, float(row["p99_latency_ms"]) * ms
            return Stats(p50, p99, float(row["rps"]))
    raise RuntimeError(f"no PING_MBULK row in redis-benchmark's output:\n{output.stdout}")


def put_one_entry(address: str) -> None:
    spec = TensorSpec("float16", (1, 2, len(STORED_TOKENS), 8))
    layers = [LayerSpec("kv", (spec, spec), trimmable=True)]
    tensors = [bytes(2 * 2 * len(STORED_TOKENS) * 8)] * 2
    with Client.connect(address, require=True) as client:
        ticket = client.put_entry(IDENTITY, STORED_TOKENS, layers, tensors)
        if ticket.wait(60.0).state != "stored":
            raise RuntimeError(f"the setup entry was not stored: {ticket.state}")


# --- the table -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="per case, all clients")
    parser.add_argument("--tokens", type=int, default=256, help="prompt length of the lookup")
    args = parser.parse_args()

    rows: list[tuple[str, int, Stats, bool]] = []  # name, clients, stats, is kvd
    pool = ClientPool(max(CONCURRENCY))
    try:
        with (
            tempfile.TemporaryDirectory(prefix="kvd-bench-") as work,
            running_daemon(Path(work)) as daemon,
            socket_folder() as folder,
            redis_server(folder) as redis,
        ):
            put_one_entry(daemon.socket_path)
            for clients in CONCURRENCY:
                for kind in ("kvd ping", "kvd lookup miss"):
                    stats = pool.run(
                        kind,
                        daemon.socket_path,
                        clients,
                        args.requests,
                        args.tokens,
                        server=daemon.pid,
                    )
                    rows.append((kind, clients, stats, True))
                if redis is None:
                    continue
                redis_path, redis_pid = redis
                stats = pool.run(
                    "resp ping", redis_path, clients, args.requests, args.tokens, server=redis_pid
                )
                rows.append(("redis PING, raw Python RESP client", clients, stats, False))
                bench = redis_benchmark(redis_path, clients, args.requests)
                if bench is not None:
                    rows.append(("redis PING, redis-benchmark", clients, bench, False))
    finally:
        pool.close()
    print_table(rows, args, redis_found=shutil.which("redis-server") is not None)


def print_table(
    rows: list[tuple[str, int, Stats, bool]], args: argparse.Namespace, *, redis_found: bool
) -> None:
    anchors = {(name, clients): stats for name, clients, stats, kvd in rows if not kvd}
    print(
        f"{args.requests:,} requests per case, lookup prompt {args.tokens} tokens, "
        f"{os.cpu_count()} CPUs; client processes, one connection each.\n"
    )
    print(
        "| request | clients | p50 µs | p99 µs | ops/s | p50 / redis-benchmark p50 "
        "| p50 / raw RESP p50 | goal: p50 within "
        + ", ".join(f"{GOAL[c]:g}× at {c}" for c in CONCURRENCY)
        + " of redis-benchmark "
        "| client CPU µs | server CPU µs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for name, clients, stats, kvd in rows:
        bench = anchors.get(("redis PING, redis-benchmark", clients))
        raw = anchors.get(("redis PING, raw Python RESP client", clients))
        vs_bench = "" if bench is None else f"{stats.p50 / bench.p50:.1f}"
        vs_raw = "" if raw is None else f"{stats.p50 / raw.p50:.1f}"
        goal = ""
        if kvd and bench is not None:
            goal = "met" if stats.p50 <= GOAL[clients] * bench.p50 else "not met"
        label = name if kvd else f"{name} (anchor)"
        client_cpu = "" if stats.client_cpu is None else f"{stats.client_cpu * 1e6:.1f}"
        server_cpu = "" if stats.server_cpu is None else f"{stats.server_cpu * 1e6:.1f}"
        print(
            f"| {label} | {clients} | {stats.p50 * 1e6:.1f} | {stats.p99 * 1e6:.1f} "
            f"| {stats.ops:,.0f} | {vs_bench} | {vs_raw} | {goal} | {client_cpu} | {server_cpu} |"
        )
    if not redis_found:
        print(
            "\nredis-server is not installed (apt-get install redis-server, brew install "
            "redis): the Redis anchors were not measured."
        )


if __name__ == "__main__":
    main()
