"""Soak: 16 engine processes put, look up, release and ask for status for minutes against one
daemon under a small tier cap and a small write-behind cap.

Checked while it runs (the status is sampled every SAMPLE_SECONDS on a connection of its own):
the tier's bytes never exceed the cap; the daemon's RSS stays flat (its first sample after
warm-up against its last); no request fails other than by design; no engine's breaker opens
(a lookup not answered within the engine's lookup timeout opens it, and the engine then skips
the daemon). By design: tickets dropped by the write-behind queue or by a superseding entry,
puts refused while the queue and the puts under way fill its cap, puts skipped as duplicates,
lookup misses. Anything else (a failed ticket, a put skipped or a lookup failed with the daemon
taken as unavailable, a rejected lookup, an exception, an error in the daemon's log, a
non-zero exit) fails the run. Each lookup is timed as the engine sees it, to the reply (the
hit's verification after it is the engine's own work). The anchor is the work itself: rates
are per second of the same run, the lookups' times against the engines' lookup timeout.

    .venv/bin/python bench/soak.py [--seconds 180] [--clients 16] [--cap 4M]
"""

from __future__ import annotations

import argparse
import array
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from pathlib import Path

import numpy as np
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_client.link import DEFAULT_LOOKUP_TIMEOUT
from kvd_protocol.entry import LayerSpec, TensorSpec
from kvd_protocol.identity import Identity
from kvd_protocol.quantities import parse_size

IDENTITIES = [Identity(f"bench/soak-{i}", "cfg", "tok", "codecs/1", "mlx/cpu") for i in range(4)]
SAMPLE_SECONDS = 0.05
WARMUP_FRACTION = 0.1  # RSS is compared from this far into the run
RSS_FLAT_BYTES = 16 << 20  # growth below this (or below RSS_FLAT_RATIO) is flat
RSS_FLAT_RATIO = 0.10
WRITEBACK_CAP = "1M"  # small: the drop-oldest policy drops, by design
# The mix of operations each engine draws from, by weight.
MIX = {"put": 4, "lookup": 5, "status": 1}


@dataclass(frozen=True)
class Job:
    number: int
    address: str
    stop_at: float  # time.monotonic()


@dataclass
class Tally:
    """What one engine did and saw, by kind."""

    operations: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, bool]] = field(default_factory=Counter)  # (what, by design)
    failures: list[str] = field(default_factory=list)
    lookup_seconds: array.array[float] = field(default_factory=lambda: array.array("d"))
    breaker_opened: int = 0  # times the engine's breaker opened: it skipped the daemon then

    def saw(self, outcome: str, *, by_design: bool) -> None:
        self.outcomes[outcome, by_design] += 1
        if not by_design:
            self.failures.append(outcome)


def _put(
    client: Client, rng: random.Random, tally: Tally, known: list[tuple[int, list[int]]]
) -> None:
    which = rng.randrange(len(IDENTITIES))
    if known and rng.random() < 0.3:  # extend a prompt seen before: supersedes its entry
        which, base = rng.choice(known)
        tokens = [*base, *(rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 64)))]
    else:
        tokens = [rng.randrange(1, 50_000) for _ in range(rng.randrange(16, 256))]
    spec = TensorSpec("float16", (1, 2, len(tokens), 8))
    tensors = [np.full(spec.shape, len(tokens) % 251, np.float16) for _ in range(4)]
    layers = [LayerSpec("kv", (spec, spec), trimmable=True)] * 2
    ticket = client.put_entry(IDENTITIES[which], tokens, layers, tensors)
    state = ticket.wait(30.0)
    # The reason's first words only: a refusal's message carries the byte counts of the moment.
    reason = None if state.reason is None else state.reason.split(":")[0]
    label = state.state if reason is None else f"{state.state}: {reason}"
    by_design = state.state in ("stored", "dropped") or str(state.reason).startswith("refused")
    tally.saw(f"put {label}", by_design=by_design)
    known.append((which, tokens))
    del known[:-64]


def _lookup(
    client: Client, rng: random.Random, tally: Tally, known: list[tuple[int, list[int]]]
) -> None:
    if known and rng.random() < 0.8:
        which, tokens = rng.choice(known)
        prompt = [*tokens, 7]
    else:
        which, prompt = (
            rng.randrange(len(IDENTITIES)),
            [rng.randrange(1, 50_000) for _ in range(64)],
        )
    failed = client.stats.failed_lookups
    started = time.perf_counter()
    result = client.lookup(IDENTITIES[which], prompt)
    tally.lookup_seconds.append(time.perf_counter() - started)
    if result is None:
        if client.stats.failed_lookups > failed:  # unavailable (late, skipped) or refused
            tally.saw("lookup failed", by_design=False)
        else:
            tally.saw("lookup miss", by_design=True)
        return
    with result:  # the release: a lease returned at once, as an engine does after its copy
        result.verify()
        tally.saw("lookup hit", by_design=True)


def engine(job: Job, results: Queue[Tally]) -> None:
    """One engine's loop until stop_at; its tally goes to results."""
    tally = Tally()
    rng = random.Random(job.number)
    known: list[tuple[int, list[int]]] = []
    kinds, weights = list(MIX), list(MIX.values())
    try:
        with Client.connect(job.address, require=True) as client:
            while time.monotonic() < job.stop_at:
                kind = rng.choices(kinds, weights)[0]
                if kind == "put":
                    _put(client, rng, tally, known)
                elif kind == "lookup":
                    _lookup(client, rng, tally, known)
                else:
                    client.status()
                tally.operations[kind] += 1
            if client.stats.rejected_entries:
                tally.failures.append(f"{client.stats.rejected_entries} rejected lookups")
            if client.breaker is not None and client.breaker.stats.opened:
                tally.breaker_opened = client.breaker.stats.opened
                tally.failures.append(f"the breaker opened {tally.breaker_opened} times")
    except Exception as exc:  # reported, not raised: the run must say it
        tally.failures.append(f"{type(exc).__name__}: {exc}")
    results.put(tally)


@dataclass
class Samples:
    bytes: list[int] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the run, bytes)


def sample(address: str, started: float, done: threading.Event, into: Samples) -> None:
    with Client.connect(address, require=True) as client:
        while not done.is_set():
            status = client.status()
            tier_bytes, daemon = status["bytes"], status["daemon"]
            assert isinstance(tier_bytes, int)
            assert isinstance(daemon, dict)
            into.bytes.append(tier_bytes)
            into.rss.append((time.monotonic() - started, int(daemon["rss_bytes"])))
            time.sleep(SAMPLE_SECONDS)


def run(seconds: float, clients: int, cap: int) -> int:
    flags = ["--max-bytes", str(cap), "--writeback-max-bytes", WRITEBACK_CAP, "--min-free", "0"]
    context = mp.get_context("spawn")  # the same on Linux and macOS
    results: Queue[Tally] = context.Queue()
    samples = Samples()
    with (
        tempfile.TemporaryDirectory(prefix="kvd-soak-") as work,
        running_daemon(Path(work), flags) as daemon,
    ):
        started = time.monotonic()
        jobs = [Job(n, daemon.socket_path, started + seconds) for n in range(clients)]
        processes = [context.Process(target=engine, args=(job, results)) for job in jobs]
        done = threading.Event()
        sampler = threading.Thread(target=sample, args=(daemon.socket_path, started, done, samples))
        sampler.start()
        for process in processes:
            process.start()
        tallies = [results.get(timeout=seconds + 120) for _ in processes]
        for process in processes:
            process.join()
        done.set()
        sampler.join()
        elapsed = time.monotonic() - started
        with Client.connect(daemon.socket_path, require=True) as client:
            flushed = client.flush(60.0)
            final = client.status()
    # running_daemon has checked the daemon: a clean exit, no error in its log.
    return report(
        tallies, samples, final=final, elapsed=elapsed, clients=clients, cap=cap, flushed=flushed
    )


def report(
    tallies: list[Tally],
    samples: Samples,
    *,
    final: dict[str, object],
    elapsed: float,
    clients: int,
    cap: int,
    flushed: bool,
) -> int:
    operations = sum((t.operations for t in tallies), Counter[str]())
    outcomes = sum((t.outcomes for t in tallies), Counter[tuple[str, bool]]())
    failures = [f for t in tallies for f in t.failures]
    lookups = sorted(s for t in tallies for s in t.lookup_seconds)
    opened = sum(t.breaker_opened for t in tallies)
    warm = [rss for at, rss in samples.rss if at >= elapsed * WARMUP_FRACTION] or [0]
    rss_start, rss_end = warm[0], samples.rss[-1][1]
    growth = rss_end - rss_start
    flat = growth < RSS_FLAT_BYTES or growth < RSS_FLAT_RATIO * rss_start
    over = max(samples.bytes) > cap
    mib = 1 << 20
    print(f"soak: {clients} engines for {elapsed:.0f} s, tier cap {cap / mib:.1f} MiB, "
          f"write-behind cap {WRITEBACK_CAP}")  # fmt: skip
    print()
    print("| operation | count | per second |")
    print("|---|---:|---:|")
    for kind in MIX:
        print(f"| {kind} | {operations[kind]:,} | {operations[kind] / elapsed:,.0f} |")
    print()
    print("| outcome | count | by design |")
    print("|---|---:|---|")
    for (outcome, by_design), count in sorted(outcomes.items()):
        print(f"| {outcome} | {count:,} | {'yes' if by_design else 'no: a failure'} |")
    print()
    late = sum(1 for s in lookups if s > DEFAULT_LOOKUP_TIMEOUT)
    cuts = statistics.quantiles(lookups, n=100) if len(lookups) > 1 else [0.0] * 99
    p50, p99, worst = (statistics.median(lookups), cuts[98], lookups[-1]) if lookups else (0, 0, 0)
    ms = 1e3
    timeout = f"{DEFAULT_LOOKUP_TIMEOUT * ms:g} ms"
    print(f"| lookups, to the reply | p50 ms | p99 ms | max ms | over the timeout ({timeout}) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| {len(lookups):,} | {p50 * ms:.2f} | {p99 * ms:.2f} | {worst * ms:.1f} | {late:,} |")
    print()
    print("| check | value | verdict |")
    print("|---|---:|---|")
    peak = max(samples.bytes)
    print(f"| tier bytes, peak of {len(samples.bytes):,} samples | {peak / mib:.2f} MiB "
          f"| {'over the cap' if over else 'within the cap'} |")  # fmt: skip
    print(f"| daemon RSS after warm-up -> end | {rss_start / mib:.1f} -> {rss_end / mib:.1f} MiB "
          f"| {'flat' if flat else 'grew'} ({growth / mib:+.1f} MiB) |")  # fmt: skip
    # Growth that levels off is a structure filling to its bound; growth that goes on is a leak.
    quarters = [_rss_at(samples, elapsed * q) / mib for q in (0.25, 0.5, 0.75, 1.0)]
    print(
        f"| daemon RSS at 1/4, 1/2, 3/4, end | {' / '.join(f'{q:.1f}' for q in quarters)} MiB | |"
    )
    print(f"| engines' breakers opened | {opened} | {'none' if not opened else 'FAILED'} |")
    verdict = "none" if not failures else "FAILED"
    print(f"| failures other than by design | {len(failures)} | {verdict} |")
    print(f"| flush at the end | {'durable' if flushed else 'not durable'} | |")
    print(f"| entries at the end | {final['entries']} | |")
    kept = final.get("kept")  # what the daemon keeps of what clients named (absent: older)
    if isinstance(kept, dict):
        held = ", ".join(f"{name} {count:,}" for name, count in kept.items())
        print(f"| kept at the end | {held} | |")
    for failure in Counter(failures).most_common(10):
        print(f"  failure: {failure[0]} (x{failure[1]})", file=sys.stderr)
    return 0 if not failures and not over and flat and flushed else 1


def _rss_at(samples: Samples, seconds: float) -> int:
    """The daemon's RSS at the last sample taken by seconds into the run."""
    return [rss for at, rss in samples.rss if at <= seconds][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="length of the run")
    parser.add_argument("--clients", type=int, default=16, help="engine processes")
    parser.add_argument("--cap", default="4M", help="the tier's byte cap (K/M/G)")
    args = parser.parse_args()
    return run(args.seconds, args.clients, parse_size(args.cap))


if __name__ == "__main__":
    sys.exit(main())
