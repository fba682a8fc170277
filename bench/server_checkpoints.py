"""Prefill checkpoints on kvd-mlx-lm-server's batched path: what they cost the generation and
what they give back. The generator is the server's (TieredBatchGenerator over a ServerTier, as
kvd-mlx-lm-server builds them), driven in process against a real `kvd serve`; the model is a
hybrid shape, qwen3_next with hidden 256 and 4 layers (three Gated DeltaNet layers, one of
attention), random float32 weights: small, as MLX runs Gated DeltaNet slowly on a CPU.

Per setting (checkpoints off, fixed intervals, the interval chosen by cost) and rep, on a
namespace of its own:
- first prompt: --tokens tokens prefilled (then DECODE tokens generated) by the tiered
  generator; its prefill time and decode tokens/s against mlx-lm's own BatchGenerator doing
  the same just before (the anchor: each setting has its own, as the machine's load drifts);
  the checkpoints taken and the bytes written;
- changed tail: the same prompt with its last tenth changed, on a new ServerTier (all reuse
  from kvd): the tokens restored, and the time to its first token (restore + the prefill
  left) against the anchor's prefill of the whole prompt.
The median of --repeat reps is printed, with the spread (min-max) of each ratio.

    .venv/bin/python bench/server_checkpoints.py [--tokens 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.mlx_lm_server import TieredBatchGenerator
from kvd_client.prefill_checkpoints import CheckpointSettings
from kvd_client.server_tier import ServerTier
from mlx_lm.generate import BatchGenerator
from model_folders import SMALL_CONFIGS, small_model

BLOCK = 128  # the server's default block
DECODE = 64  # tokens generated after each prompt
VOCAB = 1024
SETTINGS: dict[str, CheckpointSettings] = {
    "checkpoints off": CheckpointSettings(interval=0),
    "every 256": CheckpointSettings(interval=256),
    "every 1024": CheckpointSettings(interval=1024),
    "by cost": CheckpointSettings(),
}
SETTLE_SECONDS = 600.0


def hybrid_model() -> Any:
    """The tests' qwen3_next, wider: hidden 256, head_dim 64, a 512-wide feed-forward."""
    shape = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    config = {**SMALL_CONFIGS["qwen3_next"], **shape, "max_position_embeddings": 32768}
    return small_model({**config, "model_type": "qwen3_next", "vocab_size": VOCAB}, seed=0)


@dataclass
class Run:
    prefill: float  # seconds to the first token
    decode: float  # tokens/s after it


def generate(generator: Any, segments: list[list[int]], cache: Any, held: list[int]) -> Run:
    """One sequence through generator: the time to its first token, then DECODE more."""
    started = time.perf_counter()
    (uid,) = generator.insert_segments(
        [segments], max_tokens=[DECODE + 1], caches=[cache], all_tokens=[held]
    )
    first, done = 0.0, 0
    while done <= DECODE:
        _, generated = generator.next()
        for response in generated:
            if response.uid != uid:
                continue
            if not done:
                first = time.perf_counter()
            done += 1
            if response.finish_reason:
                done = DECODE + 1
    return Run(first - started, DECODE / (time.perf_counter() - first))


@dataclass
class Row:
    stock: Run  # the anchor: mlx-lm's BatchGenerator, just before
    tiered: Run
    checkpoints: int
    written: int
    restored: int = 0
    changed: float = 0.0  # seconds to the changed prompt's first token


def one_setting(
    client: Client, model: Any, name: str, prompt: list[int], changed: list[int], *, rep: int
) -> Row:
    stock = generate(BatchGenerator(model), [prompt], None, [])
    identity = EngineIdentity(f"bench/server-checkpoints/{name}/{rep}", "cfg", "tok")
    tier = ServerTier(client, checkpoints=SETTINGS[name])
    tier.model_loaded("first", model, None, identity)
    cold = tier.cold_tier("first")
    assert cold is not None
    run = generate(TieredBatchGenerator(model, tier=tier), [prompt], None, [])
    if not cold.drain(SETTLE_SECONDS):
        raise RuntimeError("the checkpoints were not sent in time")
    row = Row(stock, run, cold.stats.checkpoints, cold.stats.bytes_written)
    tier.model_loaded("fresh", model, None, identity)  # a new ColdTier: nothing in memory
    cold = tier.cold_tier("fresh")
    assert cold is not None
    started = time.perf_counter()
    restored = cold.restore(changed)
    took = time.perf_counter() - started
    held = restored.matched if restored is not None else 0
    cache = restored.cache if restored is not None else None
    generator = TieredBatchGenerator(model, tier=tier)
    rest = generate(generator, [changed[held:]], cache, changed[:held])
    row.restored, row.changed = held, took + rest.prefill
    tier.close()
    return row


def random_tokens(count: int, *, seed: int) -> list[int]:
    drawn = mx.random.randint(0, VOCAB, (count,), key=mx.random.key(seed))
    return [int(t) for t in cast(list[int], drawn.tolist())]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = hybrid_model()
    rows: dict[str, list[Row]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as folder, running_daemon(Path(folder)) as daemon:
        for rep in range(args.repeat):
            prompt = random_tokens(args.tokens, seed=100 + rep)
            tail = args.tokens // 10
            changed = [*prompt[:-tail], *random_tokens(tail, seed=200 + rep)]
            for name in SETTINGS:
                with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client:
                    rows[name].append(one_setting(client, model, name, prompt, changed, rep=rep))
    stock = [row.stock for runs in rows.values() for row in runs]
    print(
        f"{args.tokens}-token prompt, its last {args.tokens // 10} changed; {args.repeat} reps. "
        f"Stock BatchGenerator: prefill {statistics.median(r.prefill for r in stock):.2f} s, "
        f"decode {statistics.median(r.decode for r in stock):.0f} tokens/s"
    )
    print(
        "| setting | checkpoints | bytes written | prefill vs stock | decode vs stock "
        "| changed tail: restored | its first token vs stock's whole prefill |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in rows.items():
        prefill = [r.tiered.prefill / r.stock.prefill for r in runs]
        decode = [r.tiered.decode / r.stock.decode for r in runs]
        first_token = [r.changed / r.stock.prefill for r in runs]
        last = runs[-1]
        print(
            f"| {name} | {last.checkpoints} | {last.written:,} | {_spread(prefill)} "
            f"| {_spread(decode)} | {last.restored} | {_spread(first_token)} |"
        )


if __name__ == "__main__":
    main()
