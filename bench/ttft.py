"""Time to first token with a restored prefix against recomputing the prefill, 8k and 32k.

Per model and prefix length T, a prompt of T + --new-tokens random tokens:

- recompute (anchor): the prefill of the first T tokens as mlx-lm's generate_step runs it
  (chunks of --prefill-step, every layer evaluated), then one forward step of the remaining
  tokens and the greedy first token;
- restored: Client.get of the prompt from a real `kvd serve` holding the T-token cache (put
  beforehand), then the same forward step and first token. Hot: median of --repeat gets from
  the page cache; cold: the page cache dropped before each of --cold-repeat gets (root only).

Models, random weights, float32 (the dtype whose matmuls the BLAS runs; float16 matmuls on
the CPU build do not use it): the tests' tiny llama (hidden 64, 2 layers), and a llama of an
8B model's shape (hidden 4096, 32 heads, 8 KV heads, head dim 128, intermediate 14336,
vocabulary 32000) with --layers layers (default 1: 32 would need 28 GB of float32 weights and
about half an hour per 8k prefill here). Prefill and restore both grow linearly with layers.

Prefills longer than --max-prefill tokens are not run: the chunks up to that length are
timed, a straight line fitted to chunk time against context length (weights: constant per
chunk; attention: linear in the context), and summed over the chunks up to T. Such rows say
"extrapolated"; their cache is random KV of the right shape (a restore's cost does not depend
on the values).

The mlx CPU wheel links the reference BLAS; when OpenBLAS is installed
(apt-get install libopenblas0-pthread), the script re-runs itself with it in LD_PRELOAD
(--reference-blas: not). The BLAS that ran is printed.

    .venv/bin/python bench/ttft.py [--lengths 8192 32768] [--max-prefill 8192] [--layers 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity, config_fingerprint
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from restore import DAEMON_FLAGS, can_drop_page_cache, drop_page_cache, mlc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "client"))
from tiny_models import tiny_llama  # the tests' tiny model, through its folder

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
SETTLE_SECONDS = 600.0


def use_openblas() -> None:
    """Re-run this script with OpenBLAS preloaded, if installed and not preloaded yet."""
    if os.path.exists(OPENBLAS) and OPENBLAS not in os.environ.get("LD_PRELOAD", ""):
        preload = " ".join(filter(None, [OPENBLAS, os.environ.get("LD_PRELOAD")]))
        os.environ["LD_PRELOAD"] = preload
        os.execv(sys.executable, [sys.executable, *sys.argv])


def blas_in_use() -> str:
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "blas" in line.lower()}
    if any("libopenblas" in path for path in libraries if "numpy" not in path):
        return f"OpenBLAS (LD_PRELOAD={OPENBLAS})"
    return "the reference BLAS bundled with the mlx wheel"


def realistic_llama(layers: int) -> Any:
    """An 8B llama's shape with layers layers, random float32 weights."""
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=layers,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@dataclass(frozen=True)
class Prefill:
    seconds: float
    measured_tokens: int  # < the prefix length: seconds is extrapolated
    cache: list[Any]


def prefill(model: Any, tokens: Sequence[int], step: int, max_tokens: int) -> Prefill:
    """Prefill as generate_step does, chunk by chunk; past max_tokens, extrapolated."""
    cache = make_prompt_cache(model)
    chunks: list[tuple[int, float]] = []  # (context before the chunk, seconds)
    measured = min(len(tokens), max_tokens)
    for start in range(0, measured, step):
        chunk = mx.array([list(tokens[start : min(start + step, measured)])])
        began = time.perf_counter()
        mx.eval(model.model(chunk, cache=cache))  # every layer, not only the KV it feeds
        chunks.append((start, time.perf_counter() - began))
    seconds = sum(t for _, t in chunks)
    if measured == len(tokens):
        return Prefill(seconds, measured, cache)
    return Prefill(
        extrapolate(chunks, len(tokens), step), measured, synthetic_cache(model, len(tokens))
    )


def extrapolate(chunks: list[tuple[int, float]], length: int, step: int) -> float:
    """The sum over chunks up to length of a least-squares line through (context, seconds) of
    the full measured chunks (the first is left out: it pays one-time allocations)."""
    points = [(c, t) for c, t in chunks[1:]] or chunks
    mean_c = statistics.fmean(c for c, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    spread = sum((c - mean_c) ** 2 for c, _ in points)
    slope = sum((c - mean_c) * (t - mean_t) for c, t in points) / spread if spread else 0.0
    return sum(mean_t + slope * (c - mean_c) for c in range(0, length, step))


def synthetic_cache(model: Any, tokens: int) -> list[Any]:
    """KVCache layers holding tokens of random keys and values, shaped as the model's."""
    args = model.args
    shape = (1, args.num_key_value_heads, tokens, args.head_dim)
    cache = []
    for _ in range(args.num_hidden_layers):
        layer = mlc.KVCache()
        layer.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval(layer.state)
        cache.append(layer)
    return cache


def first_token(model: Any, cache: list[Any], remaining: Sequence[int]) -> int:
    logits = model(mx.array([list(remaining)]), cache=cache)[:, -1, :]
    return cast(int, mx.argmax(logits, axis=-1).item())  # one sequence: a vocabulary index


def restored_seconds(
    client: Client, model: Any, identity: EngineIdentity, prompt: list[int], prefix: int
) -> tuple[float, float]:
    """(get, forward + first token) seconds of one restored start."""
    began = time.perf_counter()
    restored = client.get(identity, prompt)
    got = time.perf_counter()
    if restored is None or restored.matched != prefix:
        raise RuntimeError(f"the get did not restore {prefix} tokens: {restored}")
    first_token(model, restored.cache, prompt[restored.matched :])
    done = time.perf_counter()
    del restored
    gc.collect()
    return got - began, done - got


@dataclass(frozen=True)
class Row:
    model: str
    layers: int
    prefix: int
    kv_mib: float
    prefill: Prefill
    step: float  # forward of the remaining tokens + first token, after the prefill
    hot: tuple[float, float]  # medians of (get, step)
    cold: tuple[float, float] | None


def measure(
    client: Client, name: str, model: Any, prefix: int, *, cap: int, args: argparse.Namespace
) -> Row:
    """One row: prefill (measured up to cap tokens), put, then restored starts."""
    vocab = model.args.vocab_size
    key = mx.random.key(prefix)
    prompt = [int(t) for t in mx.random.randint(0, vocab, (prefix + args.new_tokens,), key=key)]
    identity = EngineIdentity(f"bench/ttft/{name}", config_fingerprint(model), "random tokens")
    done = prefill(model, prompt[:prefix], args.prefill_step, cap)
    ticket = client.put(identity, prompt[:prefix], done.cache)
    if ticket.wait(SETTLE_SECONDS).state != "stored":
        raise RuntimeError(f"the put was not stored: {ticket.state}")
    kv_mib = sum(a.nbytes for c in done.cache for a in c.state[:2]) / (1 << 20)
    began = time.perf_counter()
    first_token(model, done.cache, prompt[prefix:])
    step = time.perf_counter() - began
    del done.cache[:]
    gc.collect()

    restored_seconds(client, model, identity, prompt, prefix)  # warm-up
    hot = [restored_seconds(client, model, identity, prompt, prefix) for _ in range(args.repeat)]
    cold = None
    if args.cold_repeat and can_drop_page_cache():
        runs = []
        for _ in range(args.cold_repeat):
            drop_page_cache()
            runs.append(restored_seconds(client, model, identity, prompt, prefix))
        cold = medians(runs)
    client.evict(all=True)
    return Row(name, model.args.num_hidden_layers, prefix, kv_mib, done, step, medians(hot), cold)


def medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(g for g, _ in runs), statistics.median(s for _, s in runs)


def print_table(rows: list[Row], args: argparse.Namespace, blas: str) -> None:
    print(
        f"BLAS: {blas}. Random float32 weights; {args.new_tokens} new tokens after the prefix; "
        f"prefill in chunks of {args.prefill_step}; restored: median of {args.repeat} hot, "
        f"{args.cold_repeat} cold gets. TTFT = prefill (or get) + forward of the new tokens "
        "+ first token.\n"
    )
    print(
        "| model | layers | prefix tokens | KV MiB | prefill s | recompute TTFT s "
        "| get ms (hot) | restored TTFT s (hot) | speed-up (hot) "
        "| get ms (cold) | restored TTFT s (cold) | speed-up (cold) |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        recompute = row.prefill.seconds + row.step
        if row.prefill.measured_tokens < row.prefix:
            how = f"{row.prefill.seconds:.2f} (extrapolated from {row.prefill.measured_tokens:,})"
        else:
            how = f"{row.prefill.seconds:.2f} (measured)"
        hot = sum(row.hot)
        cells = [
            row.model,
            str(row.layers),
            f"{row.prefix:,}",
            f"{row.kv_mib:,.0f}",
            how,
            f"{recompute:.2f}",
            f"{row.hot[0] * 1e3:.0f}",
            f"{hot:.3f}",
            f"{recompute / hot:.0f}×",
        ]
        if row.cold is None:
            cells += ["–", "–", "–"]
        else:
            cold = sum(row.cold)
            cells += [f"{row.cold[0] * 1e3:.0f}", f"{cold:.3f}", f"{recompute / cold:.0f}×"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument(
        "--max-prefill", type=int, default=8192, help="longest prefill of the 8B-shaped model"
    )
    parser.add_argument("--layers", type=int, default=1, help="layers of the 8B-shaped model")
    parser.add_argument(
        "--models", nargs="+", choices=["tiny", "8b-shape"], default=["tiny", "8b-shape"]
    )
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cold-repeat", type=int, default=1)
    parser.add_argument("--reference-blas", action="store_true", help="do not preload OpenBLAS")
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    args = parser.parse_args()
    if not args.reference_blas:
        use_openblas()

    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work), DAEMON_FLAGS) as daemon,
        Client.connect(daemon.socket_path, timeout=120.0, require=True) as client,
    ):
        for name in args.models:
            if name == "tiny":
                model, cap = tiny_llama(), max(args.lengths)  # its prefills are short: all run
            else:
                model, cap = realistic_llama(args.layers), args.max_prefill
            for prefix in args.lengths:
                rows.append(measure(client, name, model, prefix, cap=cap, args=args))
                print(f"done: {name} {prefix}", file=sys.stderr, flush=True)
            del model
            gc.collect()
    print_table(rows, args, blas_in_use())


if __name__ == "__main__":
    main()
