"""Restore bandwidth of a realistic prompt cache: kvd_client's get against memcpy, mx.load and
mlx-lm's load_prompt_cache of the same tensors, hot (page cache) and cold (dropped caches).

The cache is 32 mlx-lm KVCache layers, keys and values float16 of shape (1, 8, tokens, 128)
as in an 8-KV-head, 128-dim model: 4,096 tokens = 512 MiB by default, --full for 16,384
tokens = 2 GiB. It is put once into a real `kvd serve`; then, per rep:

- get: Client.get of a prompt one token longer than the entry (lookup, read, decode,
  release), timed around the call as an engine sees it; every tensor checksummed as it is
  copied (the default), and again by a client made with verify=False: the "checksums"
  column is what verification adds to the restore (goal: at most 10%);
- decode alone: prompt_cache.decode of an entry looked up once beforehand, both ways;
- anchors, same bytes, same run: memcpy (np.copyto into a preallocated buffer), readinto of
  the entry file into a preallocated buffer (raw sequential read), mx.load of a safetensors
  file of the 64 tensors + mx.eval, and load_prompt_cache of the cache saved by
  save_prompt_cache (+ mx.eval of every state).

Hot: the files are read once before the reps, so every rep reads from the page cache. Cold
(--no-cold skips it): before each rep the files' pages leave the page cache, by
`sync; echo 1 > /proc/sys/vm/drop_caches` as root, else by posix_fadvise(DONTNEED) of each
file (Linux, any user); elsewhere cold needs root.
A restore allocates fresh MLX memory each time, as an engine does; MLX's buffer cache keeps
its default limit. The median of --repeat reps after one untimed warm-up is printed (cold:
no warm-up), GB/s as 10^9 bytes of tensor data per second.

    .venv/bin/python bench/restore.py [--full] [--repeat 5] [--cold-repeat 3] [--no-cold]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _daemon import running_daemon
from kvd_client import prompt_cache
from kvd_client.client import Client
from kvd_client.identity import Identity
from mlx_lm.models import cache as _mlx_lm_cache

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS, FULL_TOKENS = 4096, 16384
IDENTITY = Identity("bench/restore", "cfg", "tok")
mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes
DAEMON_FLAGS = ("--writeback-max-bytes", "8G")  # the default 2 GiB cap is below a full entry
GOAL_MX_LOAD = 1.0  # get at least as fast as mx.load
GOAL_MEMCPY = 0.6  # get at least this fraction of memcpy's rate
GOAL_CHECKSUMS = 0.10  # verifying every tensor adds at most this fraction to the restore
UNVERIFIED = ", not verified"  # the suffix of a path's twin without checksums


def realistic_cache(tokens: int, seed: int = 0) -> list[Any]:
    """32 KVCache layers filled as a prefill fills them (update_and_fetch), float16."""
    mx.random.seed(seed)
    shape = (1, KV_HEADS, tokens, HEAD_DIM)
    cache = []
    for _ in range(LAYERS):
        layer = mlc.KVCache()
        keys = mx.random.normal(shape).astype(mx.float16)
        values = mx.random.normal(shape).astype(mx.float16)
        layer.update_and_fetch(keys, values)
        mx.eval(layer.state)
        cache.append(layer)
    return cache


def cache_arrays(cache: list[Any]) -> list[mx.array]:
    return [array for layer in cache for array in layer.state[:2]]


def cache_bytes(cache: list[Any]) -> int:
    return sum(array.nbytes for array in cache_arrays(cache))


def prompt(tokens: int) -> list[int]:
    return list(range(1, tokens + 1))


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def can_drop_page_cache() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def evict_files(files: Sequence[Path]) -> None:
    """Take these files' pages out of the page cache, as any user may (Linux)."""
    subprocess.run(["sync"], check=True)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    del result
    gc.collect()  # the restored arrays go before the next rep, not during it
    return elapsed


def median_seconds(
    runs: Sequence[Callable[[], object]], repeat: int, before: Callable[[], None] | None = None
) -> list[float]:
    """Per run, the median of repeat timed runs, the runs taken in turn in each rep (so that
    a busy machine slows twins alike); before (untimed) precedes each; one untimed warm-up
    of each first unless before is given (it drops the page cache: a warm-up is wasted)."""
    if before is None:
        for run in runs:
            timed(run)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for run, taken in zip(runs, times, strict=True):
            if before is not None:
                before()
            taken.append(timed(run))
    return [statistics.median(taken) for taken in times]


def read_into(path: Path, target: memoryview) -> None:
    with path.open("rb", buffering=0) as f:
        view = target
        while view:
            n = f.readinto(view)
            if not n:
                raise EOFError(f"{path} is shorter than {len(target)} bytes")
            view = view[n:]


class Restores:
    """Every timed restore path over one cache and its files in folder."""

    def __init__(
        self, client: Client, unverified: Client, cache: list[Any], tokens: int, folder: Path
    ) -> None:
        self.client, self.unverified, self.tokens = client, unverified, tokens
        self.nbytes = cache_bytes(cache)
        self.safetensors = folder / "cache.safetensors"
        mx.save_safetensors(
            str(self.safetensors), {str(i): a for i, a in enumerate(cache_arrays(cache))}
        )
        self.mlx_lm_file = folder / "cache-mlx-lm.safetensors"
        mlc.save_prompt_cache(str(self.mlx_lm_file), cache)
        self.source = np.concatenate([np.array(a).reshape(-1) for a in cache_arrays(cache)])
        self.target = np.empty_like(self.source)
        np.copyto(self.target, self.source)  # the target's pages exist before any timed copy
        ticket = client.put(IDENTITY, prompt(tokens), cache)
        if ticket.wait(600.0).state != "stored":
            raise RuntimeError(f"the put was not stored: {ticket.state}")
        self.entry_file = max(
            (p for p in (folder / "tier").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
        )
        self.entry_buffer = memoryview(bytearray(self.entry_file.stat().st_size))

    def get(self, client: Client) -> object:
        restored = client.get(IDENTITY, prompt(self.tokens + 1))
        if restored is None or restored.matched != self.tokens:
            raise RuntimeError(f"the get missed: {client.stats}")
        return restored

    def decode_seconds(self, repeat: int) -> list[float]:
        """Decode alone, verified and not, of an entry looked up once."""
        result = self.client.lookup(IDENTITY.to_protocol(), prompt(self.tokens + 1))
        if result is None:
            raise RuntimeError("the lookup missed")
        with result:
            header, matched = result.header, result.matched
            runs = [
                partial(prompt_cache.decode, header, result.fills(verify=verify), matched)
                for verify in (True, False)
            ]
            return median_seconds(runs, repeat)

    def memcpy(self) -> None:
        np.copyto(self.target, self.source)

    def raw_read(self) -> None:
        read_into(self.entry_file, self.entry_buffer)

    def mx_load(self) -> object:
        arrays = mx.load(str(self.safetensors))
        mx.eval(arrays)
        return arrays

    def mlx_lm_load(self) -> object:
        cache = mlc.load_prompt_cache(str(self.mlx_lm_file))
        mx.eval([layer.state for layer in cache])
        return cache

    @property
    def files(self) -> list[Path]:
        return [self.entry_file, self.safetensors, self.mlx_lm_file]

    def warm(self) -> None:
        for path in self.files:
            with path.open("rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def print_table(rows: list[tuple[str, str, float]], nbytes: int) -> None:
    """rows: (temperature, path, seconds), with the anchors among them."""
    print(
        "| page cache | path | ms | GB/s | × memcpy | × mx.load | × load_prompt_cache "
        "| × raw read | checksums | goals |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    anchors = {(t, name): s for t, name, s in rows}
    memcpy = anchors[("hot", "memcpy (anchor)")]
    for temperature, name, seconds in rows:

        def ratio(anchor: str, temperature: str = temperature, seconds: float = seconds) -> str:
            base = anchors.get((temperature, anchor))
            return "–" if base is None else f"{base / seconds:.2f}"

        goals, checksums = "", "–"
        twin = anchors.get((temperature, name + UNVERIFIED))
        if twin is not None:
            cost = seconds / twin - 1
            checksums = f"{cost:+.1%}"
        if (name.startswith("kvd get") or name.startswith("decode")) and UNVERIFIED not in name:
            mx_load = anchors[(temperature, "mx.load safetensors + eval (anchor)")]
            verdicts = [f"≥ mx.load: {'met' if seconds <= mx_load / GOAL_MX_LOAD else 'not met'}"]
            if temperature == "hot":
                met = seconds <= memcpy / GOAL_MEMCPY
                verdicts.append(f"≥ {GOAL_MEMCPY}× memcpy: {'met' if met else 'not met'}")
            if twin is not None:
                met = seconds / twin - 1 <= GOAL_CHECKSUMS
                verdicts.append(f"checksums ≤ {GOAL_CHECKSUMS:.0%}: {'met' if met else 'not met'}")
            goals = "; ".join(verdicts)
        print(
            f"| {temperature} | {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} "
            f"| {memcpy / seconds:.2f} | {ratio('mx.load safetensors + eval (anchor)')} "
            f"| {ratio('mlx-lm load_prompt_cache (anchor)')} "
            f"| {ratio('raw read of the entry file (anchor)')} | {checksums} | {goals} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help=f"{FULL_TOKENS} tokens (2 GiB)")
    parser.add_argument("--tokens", type=int, default=None, help=f"default {TOKENS}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cold-repeat", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true")
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    parser.add_argument(
        "--mlx-cache-limit",
        type=int,
        default=None,
        help="bytes MLX may keep of freed buffers for reuse (mx.set_cache_limit), as an engine "
        "would set it; default: MLX's own",
    )
    args = parser.parse_args()
    if args.mlx_cache_limit is not None:
        mx.set_cache_limit(args.mlx_cache_limit)
    tokens = args.tokens or (FULL_TOKENS if args.full else TOKENS)
    cold = not args.no_cold and (can_drop_page_cache() or hasattr(os, "posix_fadvise"))

    rows: list[tuple[str, str, float]] = []  # (temperature, path, seconds)
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work), DAEMON_FLAGS) as daemon,
        Client.connect(daemon.socket_path, timeout=120.0, require=True) as client,
        Client.connect(daemon.socket_path, timeout=120.0, require=True, verify=False) as plain,
    ):
        cache = realistic_cache(tokens)
        bench = Restores(client, plain, cache, tokens, Path(work))
        del cache
        gc.collect()
        bench.warm()
        get = "kvd get (lookup + decode + release)"
        groups: list[dict[str, Callable[[], object]]] = [  # a group's runs are taken in turn
            {"memcpy (anchor)": bench.memcpy},
            {"raw read of the entry file (anchor)": bench.raw_read},
            {"mx.load safetensors + eval (anchor)": bench.mx_load},
            {"mlx-lm load_prompt_cache (anchor)": bench.mlx_lm_load},
            {get: partial(bench.get, client), get + UNVERIFIED: partial(bench.get, plain)},
        ]
        for group in groups:
            rows.extend(
                zip(
                    ["hot"] * len(group),
                    group,
                    median_seconds([*group.values()], args.repeat),
                    strict=True,
                )
            )
        decode = "decode alone (entry looked up)"
        seconds = bench.decode_seconds(args.repeat)
        rows.extend([("hot", decode, seconds[0]), ("hot", decode + UNVERIFIED, seconds[1])])
        if cold:
            drop = drop_page_cache if can_drop_page_cache() else partial(evict_files, bench.files)
            for group in groups[1:]:
                seconds = median_seconds([*group.values()], args.cold_repeat, drop)
                rows.extend(zip(["cold"] * len(group), group, seconds, strict=True))
        nbytes = bench.nbytes

    print(
        f"{LAYERS} layers × (keys, values) float16 (1, {KV_HEADS}, {tokens:,}, {HEAD_DIM}) = "
        f"{nbytes / (1 << 20):,.0f} MiB; median of {args.repeat} hot reps"
        + (f", {args.cold_repeat} cold reps" if cold else "; cold not run (needs root here)")
        + ".\n"
    )
    print_table(rows, nbytes)


if __name__ == "__main__":
    main()
