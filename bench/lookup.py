"""Prefix lookup time against the number of indexed entries.

Anchor: a dict lookup of the whole prompt (an exact-match hash lookup, the cheapest lookup a
cache could do), measured on the same prompts in the same run. For contrast, the linear scan
(the rules as a loop over every entry) at the smallest size. Index only: no files.

The workload: a few dozen shared system prompts; conversations that start from one and branch
from earlier conversations at random points; 256-4096 tokens per entry (scaled down at 1M
entries to keep memory to a few GB, as the table says). Prompts continue an entry (next
turn), branch from inside one (an edit), or start afresh (a miss).

    .venv/bin/python bench/lookup.py [--sizes 1000,100000,1000000] [--queries 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

from kvd_protocol.tokens import TOKEN_BYTES, token_count

from kvd.store.prefix_index import PrefixIndex, scan_best_match
from kvd.store.records import EntryRecord

SYSTEM_PROMPTS = 32
MIN_TOKENS, MAX_TOKENS = 256, 4096
FULL_SCALE_UP_TO = 100_000  # above this many entries, token counts are divided by SCALE
SCALE = 8
SCAN_UP_TO = 10_000  # entries: the linear scan takes seconds per lookup at 1M
SCAN_QUERIES = 200


def random_tokens(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n * TOKEN_BYTES)


def build_entries(rng: random.Random, count: int, lo: int, hi: int) -> list[EntryRecord]:
    """Conversations over shared system prompts, each branching from an earlier one or fresh."""
    systems = [random_tokens(rng, rng.randint(lo // 2, lo)) for _ in range(SYSTEM_PROMPTS)]
    entries: list[EntryRecord] = []
    while len(entries) < count:
        target = rng.randint(lo, hi)
        if entries and rng.random() < 0.7:
            parent = bytes(rng.choice(entries).tokens)
            cut = rng.randint(lo // 2, token_count(parent))
            prefix = parent[: cut * TOKEN_BYTES]
        else:
            prefix = rng.choice(systems)
        grow = max(target - token_count(prefix), 1)
        entries.append(
            EntryRecord(
                id=f"{len(entries):08x}",
                digest="bench",
                tokens=prefix + random_tokens(rng, grow),
                nbytes=0,
                trimmable=rng.random() < 0.9,
                last_used=len(entries),
            )
        )
    return entries


def make_prompts(rng: random.Random, entries: list[EntryRecord], n: int, lo: int) -> list[bytes]:
    prompts = []
    for _ in range(n):
        kind = rng.random()
        base = bytes(rng.choice(entries).tokens)
        if kind < 0.45:  # the next turn of a stored conversation
            prompts.append(base + random_tokens(rng, rng.randint(20, 300)))
        elif kind < 0.9:  # an edit: branch from inside one
            cut = rng.randint(1, token_count(base)) * TOKEN_BYTES
            prompts.append(base[:cut] + random_tokens(rng, rng.randint(20, 300)))
        else:  # a new system prompt: a miss
            prompts.append(random_tokens(rng, rng.randint(lo, 2 * lo)))
    return prompts


def timings_us(call: Callable[[bytes], object], prompts: list[bytes]) -> list[float]:
    out = []
    for prompt in prompts:
        start = time.perf_counter_ns()
        call(prompt)
        out.append((time.perf_counter_ns() - start) / 1000)
    return out


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes vs KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    rows = []
    for size in sizes:
        scale = 1 if size <= FULL_SCALE_UP_TO else SCALE
        lo, hi = MIN_TOKENS // scale, MAX_TOKENS // scale
        tokens_note = f"{lo}–{hi}" + ("" if scale == 1 else f" (÷{scale})")
        rng = random.Random(args.seed)
        # The collector is paused while millions of long-lived objects are made, then they are
        # frozen out of its scans, as a daemon loading its index at start would do.
        gc.disable()
        entries = build_entries(rng, size, lo, hi)
        started = time.perf_counter()
        index = PrefixIndex()
        for record in entries:
            with contextlib.suppress(ValueError):  # the rare branch that repeats its parent
                index.add(record)
        build_s = time.perf_counter() - started
        gc.freeze()
        gc.enable()
        exact = {record.tokens: record for record in index}
        prompts = make_prompts(rng, entries, args.queries, lo)
        hits = sum(index.best_match(p) is not None for p in prompts) / len(prompts)
        # Fresh copies: a bytes object caches its hash, and the anchor must compute it.
        fresh = [bytes(bytearray(p)) for p in prompts]
        radix = timings_us(index.best_match, prompts)
        anchor = timings_us(exact.get, fresh)
        anchor_median = statistics.median(anchor)
        shape = f"| {len(index):,} | {tokens_note} | {hits:.0%} | {build_s:.1f} |"
        measured = [("radix best_match", radix), ("dict exact (anchor)", anchor)]
        if size <= SCAN_UP_TO:
            indexed, scanned = list(index), prompts[:SCAN_QUERIES]
            measured.append(("linear scan", timings_us(partial(scan_best_match, indexed), scanned)))
            assert all(index.best_match(p) == scan_best_match(indexed, p) for p in scanned)
        for name, times in measured:
            median = statistics.median(times)
            rows.append(
                f"| {name} {shape} {median:.1f} | {p99(times):.1f} | {median / anchor_median:.1f} |"
            )
        del index, exact, entries
        gc.unfreeze()
        gc.collect()

    print("| lookup | entries | tokens/entry | hits | build s | median µs | p99 µs | × anchor |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\npeak RSS {peak_rss_mib():,.0f} MiB; goal: best_match under 1 ms at 1M entries")


if __name__ == "__main__":
    main()
