"""The engine's stall per cold-tier snapshot: what ColdTier.store() costs the thread that runs
the model, against the whole copy every snapshot used to make of the same cache (the anchor,
prompt_cache.encode(copy=True), timed just before each store).

The cache is restore.py's: an 8B model's KV shape, 32 KVCache layers, keys and values float16
(1, 8, tokens, 128); 4,096 tokens = 512 MiB by default. Per rep, against a real `kvd serve`
that keeps blocks of 256 tokens, on a new ColdTier and new tokens:

- first turn: store() of the whole cache, copied a block at a time (nothing is held yet);
- user segment: the cache grown by a 256-token message, stored as a segment (cut at its last
  whole block: the blocks the first turn's put left the daemon, and one new);
- next turn: the cache grown by 64 generated tokens, stored: only the rows past the daemon's
  blocks are copied.
Each store is sent (drain) before the next, as a conversation's turns are. The median of
--repeat reps is printed, with the fastest and slowest.

    .venv/bin/python bench/snapshot_stall.py [--tokens 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from _daemon import running_daemon
from kvd_client import prompt_cache
from kvd_client.backlog import Kind
from kvd_client.client import Client
from kvd_client.mlx_lm_cache import ColdTier
from restore import DAEMON_FLAGS, HEAD_DIM, IDENTITY, KV_HEADS, LAYERS, TOKENS, realistic_cache

MESSAGE, GENERATED = 256, 64  # the next turn's user message and reply, in tokens
SETTLE_SECONDS = 600.0
ROWS = ("first turn", "user segment", "next turn")


def _grown(cache: list[Any], tokens: int) -> None:
    """The cache after tokens more rows, as a prefill chunk adds them."""
    shape = (1, KV_HEADS, tokens, HEAD_DIM)
    for layer in cache:
        keys = mx.random.normal(shape).astype(mx.float16)
        layer.update_and_fetch(keys, mx.random.normal(shape).astype(mx.float16))
        mx.eval(layer.state)


Row = tuple[float, float, int, int]  # seconds whole copy, seconds store, bytes of each


def one_rep(client: Client, tokens: int, rep: int) -> dict[str, Row]:
    """Each row's figures, for one conversation of new tokens."""
    cache = realistic_cache(tokens, seed=rep)
    ids = list(range(rep * 1_000_000, rep * 1_000_000 + tokens + MESSAGE + GENERATED))
    out: dict[str, Row] = {}
    with ColdTier(client, None, None, identity=IDENTITY) as tier:
        steps = [
            (ROWS[0], 0, tokens, Kind.TURN),
            (ROWS[1], MESSAGE, tokens + MESSAGE, Kind.SEGMENT),
        ]
        steps.append((ROWS[2], GENERATED, tokens + MESSAGE + GENERATED, Kind.TURN))
        for name, grow, length, kind in steps:
            if grow:
                _grown(cache, grow)
            start = time.perf_counter()
            prompt_cache.encode(cache, length, copy=True)  # its copies go at once
            whole = time.perf_counter() - start
            copied = tier.stats.bytes_copied
            start = time.perf_counter()
            tier.store(ids[:length], cache, kind=kind)
            took = time.perf_counter() - start
            nbytes = sum(layer.keys[..., :length, :].nbytes * 2 for layer in cache)
            out[name] = (whole, took, nbytes, tier.stats.bytes_copied - copied)
            if not tier.drain(SETTLE_SECONDS):
                raise RuntimeError("a snapshot was not sent in time")
        if tier.stats.stored != 3:
            raise RuntimeError(f"not every snapshot was stored: {tier.stats}")
    client.evict(all=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work), DAEMON_FLAGS) as daemon,
        Client.connect(daemon.socket_path, timeout=120.0, require=True) as client,
    ):
        one_rep(client, args.tokens, args.repeat)  # warm-up, untimed
        reps = [one_rep(client, args.tokens, rep) for rep in range(args.repeat)]
    nbytes = reps[0][ROWS[0]][2]
    print(
        f"{LAYERS} layers × (keys, values) float16 (1, {KV_HEADS}, {args.tokens:,}, {HEAD_DIM}) "
        f"= {nbytes / (1 << 20):,.0f} MiB; then +{MESSAGE} message, +{GENERATED} generated "
        f"tokens; blocks of 256 tokens; median (min-max) of {args.repeat} reps.\n"
    )
    print("| snapshot | whole copy ms (anchor) | store() ms | MiB: whole / copied | × anchor |")
    print("|---|---:|---:|---:|---:|")
    for name in ROWS:
        whole = [rep[name][0] * 1e3 for rep in reps]
        took = [rep[name][1] * 1e3 for rep in reps]
        ratio = statistics.median(t / w for t, w in zip(took, whole, strict=True))
        mib = [statistics.median(rep[name][k] for rep in reps) / (1 << 20) for k in (2, 3)]
        print(
            f"| {name} | {_spread(whole)} | {_spread(took)} | {mib[0]:,.0f} / {mib[1]:,.0f} "
            f"| {ratio:.3f} |"
        )


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    main()
