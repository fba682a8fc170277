"""Prefill checkpoints of a hybrid model through the cold tier: the prefill a changed prompt
saves against the bytes each prompt writes, per checkpoint interval, and what checkpointing
costs decoding.

The model is a qwen3_next folder built in a temp dir (Gated DeltaNet layers, whose
ArraysCache cannot be trimmed, and one attention layer in four; random float32 weights),
loaded by mlx_lm.load; a real `kvd serve` holds the tier. Per --repeat, for each interval
(--intervals, multiples of the daemon's block size; 0 is no checkpoints) and for the interval
chosen by cost, on an emptied tier:

- first prompt: --tokens new random tokens through ColdTier.stream_generate (prefill, its
  checkpoints stored, --max-tokens decoded greedily), on a fresh client and ColdTier;
- second prompt: the same tokens but the last tenth changed, on a fresh client and ColdTier,
  so what it reuses comes from kvd only: the tokens it restored, its time to first token.

The anchor, measured in each rep: the second prompt through mlx_lm.stream_generate with no
tier, all of it recomputed. Bytes written are ColdTierStats.bytes_written (what the puts
wrote into the daemon's files). Medians of the reps, the spread in brackets.

Decoding, with checkpoints (the smallest interval) against without: --decode-pairs pairs of
first prompts (of 4 intervals, new tokens each, an emptied tier), the two of a pair run back
to back in alternating order, each decoding --max-tokens while its puts are sent. Tokens per
second of wall time (mlx-lm's generation_tps) swing with what else the machine runs; tokens
per second of the process's CPU time (the sending thread's included) less so. The ratio of
each pair, median and spread (target >= 0.95).

    .venv/bin/python bench/hybrid.py [--tokens 2048] [--repeat 3] [--intervals 256 512 1024]
        [--decode-pairs 6] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.mlx_lm_cache import ColdTier, ColdTierStats
from kvd_client.prefill_checkpoints import CheckpointSettings
from model_folders import VOCAB, build_model_folder  # on the path through _daemon

# Bigger than the tests' qwen3_next so that prefill takes real time on a CPU: its Gated
# DeltaNet runs token by token there (mlx-lm's ops path; Metal has a kernel).
SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
CHANGED = 0.1  # the share of the prompt the second one changes, at its end
BY_COST = -1  # in the list of intervals: the one ColdTier chooses by cost
SETTLE_SECONDS = 300.0


@dataclass(frozen=True)
class Prompted:
    """One prompt through the cold tier (or through mlx-lm alone: stats None)."""

    first_token: float  # seconds from the call to the first response
    decode_tps: float  # decode tokens per second of the process's CPU time (_timed)
    decode_wall_tps: float  # mlx-lm's generation_tps
    stats: ColdTierStats | None = None
    interval: int = 0  # the checkpoints' (the first position, or 0 when none was taken)


@dataclass(frozen=True)
class Rep:
    anchor: Prompted  # the second prompt recomputed, mlx-lm alone
    runs: dict[int, tuple[Prompted, Prompted]]  # interval: first and second prompt


def prompts(tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """A prompt of random tokens and the same with its last tenth changed (its first changed
    token differs)."""
    pick = random.Random(seed)
    first = [pick.randrange(VOCAB) for _ in range(tokens)]
    kept = tokens - max(1, int(tokens * CHANGED))
    tail = [pick.randrange(VOCAB) for _ in range(tokens - kept)]
    tail[0] = (first[kept] + 1) % VOCAB
    return first, first[:kept] + tail


def _timed(responses: Iterator[Any]) -> tuple[float, float, float]:
    """Seconds to the first response; decode tokens per second of this process's CPU time,
    from the first response to the last (what the engine spends per token, whatever else
    the machine runs); and mlx-lm's decode tokens per second of wall time."""
    started = time.perf_counter()
    first = last = next(responses)
    first_token = time.perf_counter() - started
    cpu, cpu_seconds = time.process_time(), 0.0
    for last in responses:  # noqa: B007 (the last one is kept)
        cpu_seconds = time.process_time() - cpu
    decoded = last.generation_tokens - first.generation_tokens
    return first_token, decoded / cpu_seconds if decoded else 0.0, last.generation_tps


def through_mlx_lm(model: Any, tokenizer: Any, tokens: list[int], max_tokens: int) -> Prompted:
    """The anchor: the prompt prefilled whole by mlx-lm, no tier."""
    return Prompted(*_timed(mlx_lm.stream_generate(model, tokenizer, mx.array(tokens), max_tokens)))


def through_tier(
    socket: str,
    loaded: tuple[Any, Any, EngineIdentity],
    tokens: list[int],
    interval: int,
    max_tokens: int,
) -> Prompted:
    """The prompt through a fresh client and ColdTier, with the checkpoint interval given
    (BY_COST: chosen by cost); closed, so every put was sent."""
    model, tokenizer, identity = loaded
    settings = CheckpointSettings(interval=None if interval == BY_COST else interval)
    with (
        Client.connect(socket, timeout=60.0, require=True) as client,
        ColdTier(client, model, tokenizer, identity=identity, checkpoints=settings) as tier,
    ):
        positions = tier.checkpoint_positions(tokens, 0)
        timed = _timed(tier.stream_generate(tokens, max_tokens))
        if not tier.drain(SETTLE_SECONDS):
            raise RuntimeError("the puts were not sent in time")
    return Prompted(*timed, tier.stats, positions[0] if positions else 0)


def one_rep(
    socket: str, loaded: tuple[Any, Any, EngineIdentity], args: argparse.Namespace, rep: int
) -> Rep:
    """Each interval's prompts are new tokens (no block of another interval's serves them),
    on an emptied tier; the anchor recomputes the first interval's second prompt."""
    runs = {}
    for number, interval in enumerate([0, *args.intervals, BY_COST]):
        first, second = prompts(args.tokens, seed=rep * 1000 + number)
        if number == 0:
            anchor = through_mlx_lm(loaded[0], loaded[1], second, args.max_tokens)
        emptied(socket)
        runs[interval] = (
            through_tier(socket, loaded, first, interval, args.max_tokens),
            through_tier(socket, loaded, second, interval, args.max_tokens),
        )
    return Rep(anchor, runs)


def emptied(socket: str) -> None:
    with Client.connect(socket, require=True) as client:
        client.evict(all=True)


def decode_pairs(
    socket: str, loaded: tuple[Any, Any, EngineIdentity], args: argparse.Namespace
) -> list[tuple[Prompted, Prompted]]:
    """Pairs of first prompts, without checkpoints and with the smallest interval, run back
    to back in alternating order."""
    interval = min(args.intervals)
    pairs = []
    for pair in range(args.decode_pairs):
        runs = {}
        for number, each in enumerate((0, interval) if pair % 2 == 0 else (interval, 0)):
            emptied(socket)
            tokens = prompts(4 * interval, seed=-1000 - 2 * pair - number)[0]
            runs[each] = through_tier(socket, loaded, tokens, each, args.max_tokens)
        pairs.append((runs[0], runs[interval]))
    return pairs


def _spread(values: Sequence[float], form: str = "{:,.0f}") -> str:
    median = form.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({form.format(min(values))}-{form.format(max(values))})"


def _mib(nbytes: Sequence[int]) -> str:
    return _spread([n / (1 << 20) for n in nbytes], "{:,.2f}")


def print_table(reps: list[Rep], args: argparse.Namespace) -> None:
    kept = args.tokens - max(1, int(args.tokens * CHANGED))
    print(
        f"\nqwen3_next {SHAPE['num_hidden_layers']} layers (hidden {SHAPE['hidden_size']}, 3 "
        f"Gated DeltaNet: 1 attention), float32, CPU; prompts of {args.tokens:,} tokens, the "
        f"second sharing {kept:,}; {args.max_tokens} tokens decoded; median (min-max) of "
        f"{len(reps)} reps.\n"
    )
    print(
        "| interval | checkpoints (1st prompt) | MiB written 1st / 2nd prompt "
        "| restored (2nd) | 2nd prompt to first token, ms | × recompute |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    anchor = [rep.anchor.first_token * 1e3 for rep in reps]
    print(f"| recompute: mlx-lm, no kvd (anchor) | | | 0 | {_spread(anchor)} | 1.00 |")
    for interval in [0, *args.intervals, BY_COST]:
        firsts = [rep.runs[interval][0] for rep in reps]
        seconds = [rep.runs[interval][1] for rep in reps]
        chosen = "/".join(str(n) for n in sorted({run.interval for run in firsts}))
        name = {0: "none (0)", BY_COST: f"by cost ({chosen})"}.get(interval, str(interval))
        times = [
            run.first_token / rep.anchor.first_token for run, rep in zip(seconds, reps, strict=True)
        ]
        print(
            f"| {name} | {_spread([_stats(run).checkpoints for run in firsts])} "
            f"| {_mib([_stats(run).bytes_written for run in firsts])} / "
            f"{_mib([_stats(run).bytes_written for run in seconds])} "
            f"| {_spread([_stats(run).restored_tokens for run in seconds])} "
            f"| {_spread([run.first_token * 1e3 for run in seconds])} "
            f"| {_spread(times, '{:.2f}')} |"
        )


def print_decoding(pairs: list[tuple[Prompted, Prompted]], args: argparse.Namespace) -> None:
    interval = min(args.intervals)
    print(
        f"\nDecoding {args.max_tokens} tokens after a prompt of {4 * interval:,} tokens "
        f"({_stats(pairs[0][1]).checkpoints} checkpoints, every {interval} "
        f"tokens) against none: {len(pairs)} pairs, median (min-max). What else runs on the "
        "machine only slows a run: the ratio of the fastest runs is the least disturbed.\n"
    )
    print(f"| decode | none (0) | every {interval} | × none, per pair | × none, fastest runs |")
    print("|---|---:|---:|---:|---:|")
    for name, field in (
        ("tok/s, wall (mlx-lm)", "decode_wall_tps"),
        ("tok/s per CPU-second", "decode_tps"),
    ):
        nones: list[float] = [getattr(none, field) for none, _ in pairs]
        withs: list[float] = [getattr(run, field) for _, run in pairs]
        ratios = [run / none for none, run in zip(nones, withs, strict=True)]
        print(
            f"| {name} | {_spread(nones, '{:,.1f}')} | {_spread(withs, '{:,.1f}')} "
            f"| {_spread(ratios, '{:.3f}')} | {max(withs) / max(nones):.3f} |"
        )


def _stats(run: Prompted) -> ColdTierStats:
    assert run.stats is not None, "a prompt through the cold tier has its stats"
    return run.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per prompt")
    parser.add_argument(
        "--intervals", type=int, nargs="+", default=[256, 512, 1024], help="fixed intervals"
    )
    parser.add_argument("--decode-pairs", type=int, default=6)
    args = parser.parse_args()
    if args.tokens < 16 or any(interval < 1 for interval in args.intervals):
        parser.error("prompts of 16 tokens or more, and intervals of 1 token or more")
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-") as work,
        running_daemon(Path(work)) as daemon,
    ):
        folder = build_model_folder(
            Path(work) / "model", seed=0, shape=SHAPE, model_type="qwen3_next"
        )
        model, tokenizer = mlx_lm.load(str(folder))[:2]
        loaded = (model, tokenizer, EngineIdentity.for_model(model, folder))
        through_mlx_lm(model, tokenizer, prompts(64, seed=-1)[0], 4)  # warm-up, untimed
        try:
            reps = [one_rep(daemon.socket_path, loaded, args, rep) for rep in range(args.repeat)]
            pairs = decode_pairs(daemon.socket_path, loaded, args)
        except ValueError as exc:  # an interval the daemon's block size does not divide
            parser.error(str(exc))
    print_table(reps, args)
    print_decoding(pairs, args)


if __name__ == "__main__":
    main()
