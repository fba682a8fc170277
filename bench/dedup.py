"""Shared prefixes stored once (entry format v2): N conversations sharing a long prefix, per
block size, against the ideal and against whole (version 1) entries of the same tokens.

Each conversation is the shared prefix (--prefix tokens, 20,000 by default) and tokens of its
own (--own, 500): its caches are --layers mlx-lm KVCache layers of keys and values float16
(1, --kv-heads, tokens, --head-dim), the prefix's rows equal in every conversation, as a
model computes them. The default model is scaled down from a real one (32 layers, 8 KV heads:
16× the bytes per token) so that 100 conversations fit this 2-core machine; the ratios
below depend on the bytes per token only through the per-block overhead (a 16 KiB head and
16 KiB-aligned slots per block), which a real model makes smaller still.

Per block size (--block-tokens, 64, 256, 1024), a fresh `kvd serve`, and the conversations
put one after the other through Client.put (each ticket waited for):
- unique bytes (the daemon's status: manifests + blocks on disk) after N = 1, 10, 100
  conversations, against the ideal: the bytes of one prefix and N conversations' own tokens
  (tensor bytes only), and the logical bytes (what whole entries would take);
- bytes the client writes for a new conversation (Client.stats.bytes_written: the manifest
  and the blocks the daemon does not hold) against that conversation's own tensor bytes,
  and the put's time against a whole entry's put of the same tokens (block size 0, v1);
- restore: Client.get of the first conversation (hot page cache, median of --repeat after a
  warm-up) against the get of a whole entry of the same tokens in the same daemon.

    .venv/bin/python bench/dedup.py [--conversations 1,10,100] [--block-tokens 64,256,1024]
        [--prefix 20000] [--own 500] [--repeat 5] [--dir PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from mlx_lm.models import cache as _mlx_lm_cache

mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes
MiB = 1 << 20
SETTLE_SECONDS = 600.0
DAEMON_FLAGS = ("--max-bytes", "64G")  # nothing is evicted under the measurement
SHARED = EngineIdentity("bench/dedup", "cfg", "tok")
WHOLE = EngineIdentity("bench/dedup-v1", "cfg", "tok")  # the same tokens as version 1 entries


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # keys and values, float16


class Conversations:
    """The prefix's rows, made once; each conversation's cache is them and rows of its own."""

    def __init__(self, shape: Shape, prefix: int, own: int) -> None:
        self.shape, self.prefix, self.own = shape, prefix, own
        mx.random.seed(0)
        self._rows = [self._random(prefix) for _ in range(2 * shape.layers)]
        mx.eval(self._rows)

    def _random(self, tokens: int) -> mx.array:
        shape = (1, self.shape.kv_heads, tokens, self.shape.head_dim)
        return mx.random.normal(shape).astype(mx.float16)

    def tokens(self, k: int) -> list[int]:
        own_start = 1 << 24  # conversation k's own token ids: apart from the prefix's
        return [
            *range(1, self.prefix + 1),
            *range(own_start + k * self.own, own_start + (k + 1) * self.own),
        ]

    def cache(self, k: int) -> list[Any]:
        mx.random.seed(1000 + k)
        layers = []
        for layer in range(self.shape.layers):
            keys, values = (
                mx.concatenate([self._rows[2 * layer + i], self._random(self.own)], axis=2)
                for i in range(2)
            )
            cache = mlc.KVCache()
            cache.state = (keys, values, self.prefix + self.own)
            layers.append(cache)
        mx.eval([c.state for c in layers])
        return layers

    @property
    def prefix_bytes(self) -> int:
        return self.prefix * self.shape.bytes_per_token()

    @property
    def own_bytes(self) -> int:
        return self.own * self.shape.bytes_per_token()


@dataclass
class Run:
    """One block size's measurements."""

    block_tokens: int
    stored: dict[int, dict[str, object]] = field(default_factory=dict)  # N -> status
    written: list[int] = field(default_factory=list)  # bytes per put, in order
    put_seconds: list[float] = field(default_factory=list)
    whole_written: int = 0
    whole_put_seconds: float = 0.0
    get_seconds: float = 0.0
    whole_get_seconds: float = 0.0
    blocks: int = 0


def put(
    client: Client, identity: EngineIdentity, conversations: Conversations, k: int
) -> tuple[int, float]:
    """Put conversation k and wait until stored: (bytes the client wrote, seconds of the put)."""
    cache, tokens = conversations.cache(k), conversations.tokens(k)
    before = client.stats.bytes_written
    start = time.perf_counter()
    ticket = client.put(identity, tokens, cache)
    seconds = time.perf_counter() - start
    if ticket.wait(SETTLE_SECONDS).state != "stored":
        raise RuntimeError(f"conversation {k} was not stored: {ticket.state}")
    return client.stats.bytes_written - before, seconds


def median_get(client: Client, identity: EngineIdentity, tokens: list[int], repeat: int) -> float:
    def get() -> None:
        restored = client.get(identity, [*tokens, 0])
        if restored is None or restored.matched != len(tokens):
            raise RuntimeError(f"the get missed: {client.stats.misses}")

    get()  # warm-up: the page cache and MLX's allocator
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        get()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    block_tokens: int,
    counts: Sequence[int],
    conversations: Conversations,
    repeat: int,
    folder: Path,
) -> Run:
    run = Run(block_tokens)
    with (
        running_daemon(folder, DAEMON_FLAGS) as daemon,
        Client.connect(
            daemon.socket_path, timeout=120.0, require=True, block_tokens=block_tokens
        ) as client,
        Client.connect(daemon.socket_path, timeout=120.0, require=True, block_tokens=0) as whole,
    ):
        for k in range(max(counts)):
            written, seconds = put(client, SHARED, conversations, k)
            run.written.append(written)
            run.put_seconds.append(seconds)
            if k + 1 in counts:
                run.stored[k + 1] = client.status()
        run.blocks = client.stats.blocks_written
        run.whole_written, run.whole_put_seconds = put(whole, WHOLE, conversations, 0)
        tokens = conversations.tokens(0)
        run.get_seconds = median_get(client, SHARED, tokens, repeat)
        run.whole_get_seconds = median_get(whole, WHOLE, tokens, repeat)
    return run


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def print_tables(runs: Sequence[Run], conversations: Conversations) -> None:
    print(
        "| block tokens | N | unique MiB | ideal MiB | unique / ideal | logical MiB | dedup ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        for n, status in run.stored.items():
            unique = float(status["unique_bytes"])  # type: ignore[arg-type]
            logical = float(status["logical_bytes"])  # type: ignore[arg-type]
            ideal = conversations.prefix_bytes + n * conversations.own_bytes
            print(
                f"| {run.block_tokens} | {n} | {mib(unique)} | {mib(ideal)} | {unique / ideal:.2f} "
                f"| {mib(logical)} | {logical / unique:.1f} |"
            )
    print()
    print(
        "| block tokens | blocks written | written per new conversation MiB | its own tokens MiB "
        "| written / own | put ms (new) | whole put ms | × whole put | get ms | whole get ms "
        "| get speed × whole |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    own = conversations.own_bytes
    for run in runs:
        later = run.written[1:] or run.written
        later_seconds = run.put_seconds[1:] or run.put_seconds
        written = statistics.median(later)
        put_ms = statistics.median(later_seconds) * 1e3
        print(
            f"| {run.block_tokens} | {run.blocks} | {mib(written)} | {mib(own)} "
            f"| {written / own:.2f} "
            f"| {put_ms:.1f} | {run.whole_put_seconds * 1e3:.1f} "
            f"| {put_ms / (run.whole_put_seconds * 1e3):.2f} "
            f"| {run.get_seconds * 1e3:.1f} | {run.whole_get_seconds * 1e3:.1f} "
            f"| {run.whole_get_seconds / run.get_seconds:.2f} |"
        )


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=ints, default=[1, 10, 100])
    parser.add_argument("--block-tokens", type=ints, default=[64, 256, 1024])
    parser.add_argument("--prefix", type=int, default=20_000)
    parser.add_argument("--own", type=int, default=500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the tiers go (default: a temp dir)")
    args = parser.parse_args()
    shape = Shape(args.layers, args.kv_heads, args.head_dim)
    conversations = Conversations(shape, args.prefix, args.own)
    runs = []
    for block_tokens in args.block_tokens:
        with tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work:
            runs.append(
                measure(block_tokens, args.conversations, conversations, args.repeat, Path(work))
            )
    per_token = shape.bytes_per_token()
    print(
        f"{args.layers} KVCache layers × (keys, values) float16 (1, {args.kv_heads}, tokens, "
        f"{args.head_dim}) = {per_token / 1024:.0f} KiB per token (scaled down: a 32-layer, "
        f"8-KV-head model has 128 KiB); conversations of a {args.prefix:,}-token shared prefix "
        f"({mib(conversations.prefix_bytes)} MiB) + {args.own} tokens of their own "
        f"({mib(conversations.own_bytes)} MiB); gets: median of {args.repeat}, hot page cache.\n"
    )
    print_tables(runs, conversations)


if __name__ == "__main__":
    main()
