"""Restore from the remote tier as an engine sees it, against a local cold restore and against
recompute, by block count and parallelism, over loopback and emulated links.

Per link (loopback; then, where the machine allows, the emulated 1 and 10 Gbit/s links of
bench/_netem.py, each measured by a transfer through it first), a `weed mini` runs on the
link's far end and two daemons on this side, each on a tier of its own ("two Macs"):
- A stores, per block count N (--blocks) and cache, a prompt cache of N blocks of 256 tokens
  (Client.put); its uploads go to the bucket, waited for (uploads uncapped);
- per remote_requests R (--requests) and rep (--repeat), B starts afresh (empty tier, that
  remote_requests, no uploads) and each prompt is asked of it once by Client.get: lookup,
  probe of the bucket, fetch of the N blocks, check, commit and restore, timed around the call
  ("remote"); a get that restores less, or without a fetch, fails the run. Of that, B's own
  fetch (probe to commit) and its downloads, from its `remote_fetched` events ("fetch",
  "downloads"); then the same GETs of the same blocks by the same S3 client outside any
  daemon, R at once, into files ("same GETs outside"): what the bucket gives the downloads
  at that moment, so "downloads ÷ outside" near 1 says the fetch path is not the bound;
- anchors in the same run: the same get on B again once its files left the page cache
  ("local cold": sync and drop_caches as root, else posix_fadvise DONTNEED of each file;
  where neither exists, as on macOS, the files stay cached and the column is a hot get), and
  the tiny model's prefill of the same tokens ("recompute": the median of --repeat).

Two caches: "8B shape" (restore.py's: 32 layers, 8 KV heads of 128, float16; 32 MiB a
block), the bandwidth figures; and "tiny", the tests' tiny llama's own cache (2 layers,
1 KiB a token) from its prefill, whose break-even against that same prefill is a like for like
comparison (the prefill runs on OpenBLAS where installed, as in bench/ttft.py). The
break-even prompt length is where remote and recompute cross (interpolated between block
counts, at R = the largest of --requests); the restores of fewer than remote_min_tokens (256)
past the local match never ask the bucket.

A get whose probe outlasts the lookup's wait (30 ms) misses at once, as designed: the fetch
goes on, and the engine's next get waits for it or finds the prefix local. The bench asks
again at once, times both, and counts those first misses.

Medians of --repeat reps (min-max); GB/s as 10^9 bytes of tensor data per second.

    .venv/bin/python bench/remote.py [--blocks 1 4 16] [--requests 1 4 8] [--repeat 3]
        [--links loopback 1gbit 10gbit]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from _daemon import Daemon, running_daemon
from _netem import (
    GBIT_1,
    GBIT_10,
    LOOPBACK,
    Link,
    emulated_link,
    link_unavailable,
    measure_rate,
    raise_exit,
)
from _seaweed import BUCKET, LinkedSeaweed, credentials_file
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol.blocks import BLOCK_TOKENS, block_hashes
from kvd_protocol.tokens import pack_tokens
from restore import (
    DAEMON_FLAGS,
    cache_bytes,
    can_drop_page_cache,
    drop_page_cache,
    evict_files,
    realistic_cache,
)
from ttft import blas_in_use, prefill, use_openblas

from kvd.remote import keys
from kvd.remote.bucket import Bucket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "client"))
from tiny_models import tiny_llama  # the tests' tiny model

LINKS = {"loopback": None, "1gbit": GBIT_1, "10gbit": GBIT_10}
PREFIX = "bench"
SETTLE_SECONDS = 600.0  # uploads of a GiB through a 1 Gbit/s link, on a busy machine
CLIENT_TIMEOUT = 600.0
FETCH_TIMEOUT = "600"  # the bench times the restore; remote_fetch_timeout must not cut it
RATE_MIB = {"loopback": 1024, "1gbit": 128, "10gbit": 1024}  # the link's check transfer


@dataclass(frozen=True)
class Prompt:
    """One cache A stores: its kind, blocks, tokens, bytes and identity."""

    kind: str
    blocks: int
    tokens: list[int]
    cache: list[Any]
    identity: EngineIdentity

    @property
    def asked(self) -> list[int]:
        """What B is asked: one token past the stored prompt (the engine's next)."""
        return [*self.tokens, 1]

    @property
    def nbytes(self) -> int:
        return cache_bytes(self.cache)


def tokens_of(blocks: int, seed: int, vocab: int) -> list[int]:
    key = mx.random.key(seed)
    return [int(t) for t in mx.random.randint(0, vocab, (blocks * BLOCK_TOKENS,), key=key)]


def prompts(blocks: Sequence[int], repeat: int) -> tuple[list[Prompt], dict[int, list[float]]]:
    """The caches A stores, and the tiny model's prefill seconds per block count."""
    model = tiny_llama()
    prefill(model, tokens_of(1, 0, model.args.vocab_size), 2048, BLOCK_TOKENS)  # warm-up
    made: list[Prompt] = []
    recompute: dict[int, list[float]] = {}
    for count in blocks:
        tokens = tokens_of(count, count, model.args.vocab_size)
        runs = [prefill(model, tokens, 2048, len(tokens)) for _ in range(repeat)]
        recompute[count] = [run.seconds for run in runs]
        tiny = EngineIdentity("bench/remote/tiny", "cfg", "tok")
        made.append(Prompt("tiny", count, tokens, runs[-1].cache, tiny))
        shaped = EngineIdentity("bench/remote/8b-shape", "cfg", "tok")
        big = tokens_of(count, 1000 + count, model.args.vocab_size)
        made.append(Prompt("8B shape", count, big, realistic_cache(len(big), seed=count), shaped))
    return made, recompute


@dataclass
class Row:
    """A prompt's timings on one link at one remote_requests."""

    remote: list[float] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)
    late: int = 0  # first gets that missed: the probe outlasted the lookup's wait
    fetch: list[float] = field(default_factory=list)  # B's fetch: probe to commit
    download: list[float] = field(default_factory=list)  # of it, the GETs of the blocks
    outside: list[float] = field(default_factory=list)  # the same GETs by a client outside


@dataclass(frozen=True)
class Fetched:
    """B's `remote_fetched` event of one prompt: its identity and steps, in seconds."""

    identity: str
    blocks: int
    seconds: float
    download: float


def fetched_events(log: Path) -> list[Fetched]:
    """The fetches B committed, in order, from its log (JSON lines)."""
    found = []
    for line in log.read_text().splitlines():
        if '"remote_fetched"' in line:
            event = json.loads(line[line.index("{") :])
            found.append(
                Fetched(
                    event["identity"],
                    event["blocks"],
                    event["seconds"],
                    event["download_ms"] / 1000,
                )
            )
    return found


def outside_get(bucket: Bucket, digest: str, prompt: Prompt, requests: int, folder: Path) -> float:
    """Seconds the S3 client, outside any daemon, takes to GET the prompt's blocks from the
    same bucket into files, requests at once: what the bucket allows the fetch's downloads."""
    hashes = block_hashes(pack_tokens(prompt.tokens), BLOCK_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)

    def get(index: int) -> None:
        fd = os.open(folder / str(index), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            key = keys.block_key(PREFIX, digest, hashes[index])
            if bucket.get_to_file(key, fd, 1 << 40) is None:
                raise RuntimeError(f"{key} is not in the bucket")
        finally:
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(get, range(len(hashes))))
    seconds = time.perf_counter() - started
    shutil.rmtree(folder)
    return seconds


def remote_flags(endpoint: str, credentials: Path) -> list[str]:
    return [
        *("--remote", f"s3://{BUCKET}/{PREFIX}", "--remote-endpoint", endpoint),
        *("--remote-credentials-file", str(credentials), "--remote-fetch-timeout", FETCH_TIMEOUT),
        *DAEMON_FLAGS,
    ]


def remote_status(daemon: Daemon) -> dict[str, Any]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return cast(dict[str, Any], client.status()["remote"])


def store_on_a(daemon: Daemon, made: Sequence[Prompt]) -> None:
    """Puts every cache on A and waits until its uploads are done."""
    with Client.connect(daemon.socket_path, timeout=CLIENT_TIMEOUT, require=True) as client:
        for prompt in made:
            ticket = client.put(prompt.identity, prompt.tokens, prompt.cache)
            state = ticket.wait(SETTLE_SECONDS)
            if state != TicketState("stored"):
                raise RuntimeError(f"A did not store {prompt.kind} x{prompt.blocks}: {state}")
    blocks = sum(prompt.blocks for prompt in made)
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        status = remote_status(daemon)
        sent = status["uploaded_blocks"] + status["already_there_blocks"]
        if status["pending_uploads"] == 0 and sent >= blocks:
            return
        time.sleep(0.2)
    raise RuntimeError(f"A's uploads not done in {SETTLE_SECONDS:g} s: {remote_status(daemon)}")


def restored_tokens(client: Client, prompt: Prompt) -> int:
    restored = client.get(prompt.identity, prompt.asked)
    matched = 0 if restored is None else restored.matched
    del restored
    return matched


def local_get(client: Client, prompt: Prompt) -> float:
    """Seconds of one Client.get of a prompt B holds; it must restore every block, locally."""
    before = client.stats.remote_fetches
    started = time.perf_counter()
    matched = restored_tokens(client, prompt)
    seconds = time.perf_counter() - started
    gc.collect()
    if matched != len(prompt.tokens) or client.stats.remote_fetches != before:
        raise RuntimeError(f"{prompt.kind} x{prompt.blocks}: B restored {matched} tokens")
    return seconds


def remote_get(client: Client, prompt: Prompt) -> tuple[float, bool]:
    """Seconds until a Client.get of a prompt only the bucket holds restored it, and whether
    the first get missed: its probe was not done within the lookup's wait, so the engine
    would recompute, and the fetch goes on (the next get waits for it or finds it local)."""
    started = time.perf_counter()
    matched = restored_tokens(client, prompt)
    late = matched == 0
    while matched == 0 and time.perf_counter() - started < SETTLE_SECONDS:
        matched = restored_tokens(client, prompt)
    seconds = time.perf_counter() - started
    gc.collect()
    if matched != len(prompt.tokens):
        raise RuntimeError(f"{prompt.kind} x{prompt.blocks}: B restored {matched} tokens")
    return seconds, late


def cold_by() -> str | None:
    """How a tier's files leave the page cache here; None: they cannot (macOS, not root)."""
    if can_drop_page_cache():
        return "drop_caches"
    return "posix_fadvise" if hasattr(os, "posix_fadvise") else None


def drop_files(tier: Path) -> None:
    if can_drop_page_cache():
        drop_page_cache()
    elif hasattr(os, "posix_fadvise"):
        evict_files([path for path in tier.rglob("*") if path.is_file()])


@contextmanager
def fresh_b(folder: Path, flags: Sequence[str]) -> Iterator[Daemon]:
    """Daemon B on an empty tier."""
    shutil.rmtree(folder, ignore_errors=True)
    with running_daemon(folder, flags) as daemon:
        yield daemon


def run_link(
    link: Link, made: Sequence[Prompt], args: argparse.Namespace, folder: Path
) -> dict[tuple[str, int, int], Row]:
    """Every prompt's timings over one link, by (kind, blocks, requests)."""
    rows: dict[tuple[str, int, int], Row] = {}
    server = LinkedSeaweed(folder / "store", link)
    server.start()
    bucket = server.bucket()
    try:
        flags = remote_flags(server.endpoint, credentials_file(folder))
        with running_daemon(folder / "a", [*flags, "--remote-upload-rate", "0"]) as a:
            store_on_a(a, made)
        for requests in args.requests:
            b_flags = [*flags, "--remote-upload", "never", "--remote-requests", str(requests)]
            for _ in range(args.repeat):
                with (
                    fresh_b(folder / "b", b_flags) as b,
                    Client.connect(b.socket_path, timeout=CLIENT_TIMEOUT, require=True) as client,
                ):
                    for prompt in made:
                        row = rows.setdefault((prompt.kind, prompt.blocks, requests), Row())
                        seconds, late = remote_get(client, prompt)
                        row.remote.append(seconds)
                        row.late += late
                    fetched = remote_status(b)["downloaded_blocks"]
                    if fetched != sum(prompt.blocks for prompt in made):
                        raise RuntimeError(f"B fetched {fetched} blocks: {remote_status(b)}")
                    events = fetched_events(b.log)
                    if [e.blocks for e in events] != [p.blocks for p in made]:
                        raise RuntimeError(f"B's log tells of fetches {events}")
                    for prompt, event in zip(made, events, strict=True):
                        row = rows[(prompt.kind, prompt.blocks, requests)]
                        row.fetch.append(event.seconds)
                        row.download.append(event.download)
                        row.outside.append(
                            outside_get(bucket, event.identity, prompt, requests, folder / "got")
                        )
                    client.flush(SETTLE_SECONDS)
                    drop_files(b.tier)  # once untimed: the first drop evicts code pages too
                    local_get(client, made[0])
                    for prompt in made:
                        drop_files(b.tier)
                        row = rows[(prompt.kind, prompt.blocks, requests)]
                        row.cold.append(local_get(client, prompt))
    finally:
        bucket.close()
        server.stop()
    return rows


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def break_even(points: Sequence[tuple[int, float, float]]) -> str:
    """The prompt length where remote (second) and recompute (third) cross, interpolated
    between the (tokens, remote s, recompute s) points in token order."""
    tokens, remote, recompute = points[0]
    if remote <= recompute:
        return f"at most {tokens:,} tokens (the shortest measured)"
    for (t0, r0, c0), (t1, r1, c1) in itertools.pairwise(points):
        gap0, gap1 = r0 - c0, r1 - c1
        if gap1 <= 0 < gap0:
            return f"about {t0 + (t1 - t0) * gap0 / (gap0 - gap1):,.0f} tokens"
    return f"beyond {points[-1][0]:,} tokens (the longest measured)"


def print_link(
    label: str,
    rows: dict[tuple[str, int, int], Row],
    made: Sequence[Prompt],
    recompute: dict[int, list[float]],
) -> None:
    print(f"\n{label}")
    print(
        "| cache | blocks | MiB | requests | remote s | remote GB/s | first get missed | "
        "fetch s | downloads s | same GETs outside s | downloads ÷ outside | "
        "local cold s | remote ÷ local cold | recompute s | recompute ÷ remote |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (kind, blocks, requests), row in sorted(rows.items()):
        prompt = next(p for p in made if p.kind == kind and p.blocks == blocks)
        remote, cold = statistics.median(row.remote), statistics.median(row.cold)
        again = statistics.median(recompute[blocks])
        print(
            f"| {kind} | {blocks} | {prompt.nbytes / (1 << 20):,.1f} | {requests} | "
            f"{spread(row.remote)} | {prompt.nbytes / remote / 1e9:.3f} | "
            f"{row.late}/{len(row.remote)} | {spread(row.fetch)} | {spread(row.download)} | "
            f"{spread(row.outside)} | "
            f"{statistics.median(row.download) / statistics.median(row.outside):.2f} | "
            f"{spread(row.cold)} | "
            f"{remote / cold:.1f} | {again:.3f} | {again / remote:.2f} |"
        )
    widest = max(requests for _, _, requests in rows)
    for kind in sorted({kind for kind, _, _ in rows}):
        points = [
            (
                blocks * BLOCK_TOKENS,
                statistics.median(row.remote),
                statistics.median(recompute[blocks]),
            )
            for (k, blocks, requests), row in sorted(rows.items())
            if k == kind and requests == widest
        ]
        print(f"break-even, {kind} cache against the tiny model's prefill: {break_even(points)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--links", nargs="+", choices=list(LINKS), default=list(LINKS))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, raise_exit)  # the bucket and daemons stopped on the way out
    use_openblas()  # as bench/ttft.py: the prefill on the BLAS an engine here would use
    made, recompute = prompts(sorted(args.blocks), args.repeat)
    unavailable = link_unavailable()
    cold = cold_by() or "nothing: hot, the page cache cannot be dropped here"
    print(
        f"blocks of {BLOCK_TOKENS} tokens; remote_requests {args.requests}; median (min-max) "
        f"of {args.repeat} reps; local cold by {cold}; recompute: the tiny model's prefill "
        f"({blas_in_use()})"
    )
    with tempfile.TemporaryDirectory(prefix="kvd-bench-remote-") as temp:
        for name in args.links:
            spec = LINKS[name]
            folder = Path(temp) / name
            folder.mkdir()
            with ExitStack() as stack:
                if spec is None:
                    link = LOOPBACK
                elif unavailable:
                    print(f"\n{spec.label}: not emulated here ({unavailable}); loopback only")
                    continue
                else:
                    link = stack.enter_context(emulated_link(spec))
                rate = measure_rate(link, RATE_MIB[name])
                if spec is not None and rate > 1.1 * spec.rate_bits / 1e9:
                    raise RuntimeError(f"{link.label}: {rate:.2f} Gbit/s measured, not shaped")
                rows = run_link(link, made, args, folder)
                capped = (
                    " (this machine's own cap)"
                    if spec and rate < 0.8 * spec.rate_bits / 1e9
                    else ""
                )
                print_link(
                    f"{link.label} ({link.shaping}; one TCP stream: {rate:.2f} Gbit/s{capped})",
                    rows,
                    made,
                    recompute,
                )


if __name__ == "__main__":
    main()
