"""Engine-side put of a realistic prompt cache against mlx-lm's save_prompt_cache of it.

The cache is restore.py's: 32 mlx-lm KVCache layers, keys and values float16 of shape
(1, 8, tokens, 128); 4,096 tokens = 512 MiB by default, --full for 16,384 tokens = 2 GiB.
Timed, per rep, against a real `kvd serve`:

- put: Client.put(identity, tokens, cache) until it returns, i.e. the codec snapshot and the
  bytes handed over into the daemon's staging file (durability is the daemon's, later);
- anchor, same run: save_prompt_cache of the same cache to a new file in the tier's
  directory (page cache, no fsync either); and memcpy of the same bytes into a preallocated
  buffer (np.copyto), the floor of any one-copy hand-over.

Each put waits for its ticket and the entry is then evicted, so the writer never runs under a
timed put and every put writes into recycled page-cache memory; each saved file is deleted
after its rep likewise. The median of --repeat reps after one untimed warm-up is printed.

    .venv/bin/python bench/put_cache.py [--full] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _daemon import running_daemon
from kvd_client.client import Client
from mlx_lm.models.cache import save_prompt_cache
from restore import (
    DAEMON_FLAGS,
    FULL_TOKENS,
    HEAD_DIM,
    IDENTITY,
    KV_HEADS,
    LAYERS,
    TOKENS,
    cache_arrays,
    cache_bytes,
    realistic_cache,
)

SETTLE_SECONDS = 600.0


def median_seconds(run: Callable[[], float], repeat: int) -> float:
    """The median of repeat runs, each returning its own timed seconds, after one warm-up."""
    run()
    return statistics.median(run() for _ in range(repeat))


class Puts:
    def __init__(self, client: Client, cache: list[Any], tokens: int, folder: Path) -> None:
        self.client, self.cache, self.tokens, self.folder = client, cache, tokens, folder
        self.count = 0
        self.source = np.concatenate([np.array(a).reshape(-1) for a in cache_arrays(cache)])
        self.target = np.empty_like(self.source)
        np.copyto(self.target, self.source)  # the target's pages exist before any timed copy

    def memcpy(self) -> float:
        start = time.perf_counter()
        np.copyto(self.target, self.source)
        return time.perf_counter() - start

    def put(self) -> float:
        self.count += 1
        first = self.count * 1_000_000  # disjoint token ranges: no entry is another's prefix
        tokens = list(range(first, first + self.tokens))
        start = time.perf_counter()
        ticket = self.client.put(IDENTITY, tokens, self.cache)
        elapsed = time.perf_counter() - start
        state = ticket.wait(SETTLE_SECONDS)
        if state.state != "stored":
            raise RuntimeError(f"the put was not stored: {state}")
        self.client.evict(all=True)
        return elapsed

    def save(self) -> float:
        path = self.folder / "save-prompt-cache-anchor.safetensors"
        start = time.perf_counter()
        save_prompt_cache(str(path), self.cache)
        elapsed = time.perf_counter() - start
        path.unlink()
        gc.collect()
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help=f"{FULL_TOKENS} tokens (2 GiB)")
    parser.add_argument("--tokens", type=int, default=None, help=f"default {TOKENS}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    args = parser.parse_args()
    tokens = args.tokens or (FULL_TOKENS if args.full else TOKENS)

    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work), DAEMON_FLAGS) as daemon,
        Client.connect(daemon.socket_path, timeout=120.0, require=True) as client,
    ):
        cache = realistic_cache(tokens)
        nbytes = cache_bytes(cache)
        puts = Puts(client, cache, tokens, daemon.tier)
        rows = [
            ("memcpy (anchor)", median_seconds(puts.memcpy, args.repeat)),
            ("mlx-lm save_prompt_cache (anchor)", median_seconds(puts.save, args.repeat)),
            ("kvd Client.put (returns: bytes handed over)", median_seconds(puts.put, args.repeat)),
        ]

    print(
        f"{LAYERS} layers × (keys, values) float16 (1, {KV_HEADS}, {tokens:,}, {HEAD_DIM}) = "
        f"{nbytes / (1 << 20):,.0f} MiB; median of {args.repeat} reps; files in the tier's "
        "directory, page cache only (no fsync).\n"
    )
    print("| path | ms | GB/s | × memcpy | × save_prompt_cache | goal: put faster than save |")
    print("|---|---:|---:|---:|---:|---|")
    memcpy, save = rows[0][1], rows[1][1]
    for name, seconds in rows:
        goal = ("met" if seconds < save else "not met") if name.startswith("kvd") else ""
        print(
            f"| {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} "
            f"| {memcpy / seconds:.2f} | {save / seconds:.2f} | {goal} |"
        )


if __name__ == "__main__":
    main()
