"""Restore bandwidth of a realistic prompt cache: kvd_client's get against memcpy, mx.load and
mlx-lm's load_prompt_cache of the same tensors, hot (page cache) and cold (dropped caches).

The cache is 32 mlx-lm KVCache layers, keys and values float16 of shape (1, 8, tokens, 128)
as in an 8-KV-head, 128-dim model: 4,096 tokens = 512 MiB by default, --full for 16,384
tokens = 2 GiB. It is put once into a real `kvd serve`; then, per rep:

- get: Client.get of a prompt one token longer than the entry (lookup, read, decode,
  release), timed around the call as an engine sees it; every tensor checksummed as it is
  copied (the default), and again by a client made with verify=False: the "checksums"
  column is what verification adds to the restore (goal: at most 10%). The default client
  stores the KV in blocks shared between entries (a manifest and a file per block); the same
  cache is also put and got whole by clients made with block_tokens=0;
- decode alone: prompt_cache.decode of the whole entry looked up once beforehand, both ways;
- + first decode step: the restore, then what an engine's first decode step does to the
  cache: update_and_fetch of one token in every layer, evaluated. load_prompt_cache's
  caches hold no room, so mlx-lm copies the whole cache there; kvd's grow in place
  (goal: get + step no slower than load_prompt_cache + step);
- anchors, same bytes, same run: memcpy (np.copyto into a preallocated buffer), readinto of
  the entry file into a preallocated page-aligned buffer by one thread (raw sequential read),
  mx.load of a safetensors file of the 64 tensors + mx.eval (on the CPU build: a pread of
  each tensor into a fresh MLX buffer, by MLX's loader threads, when evaluated), and
  load_prompt_cache of the cache saved by save_prompt_cache (+ mx.eval of every state).

The restores of one temperature are taken in turn within each rep, so a busy machine slows
them alike. Hot: the files are read once before the reps, so every rep reads from the page
cache. Cold (--no-cold skips it): before each run the files' pages leave the page cache, by
`sync; echo 1 > /proc/sys/vm/drop_caches` as root, else by posix_fadvise(DONTNEED) of each
file (Linux, any user); elsewhere cold needs root.
A restore allocates fresh MLX memory each time, as an engine does; MLX's buffer cache keeps
its default limit unless --mlx-cache-limit is given. Whether fresh memory is new pages (a
page fault per 4 KiB, several times the cost of the copy) or pages the allocator kept is
up to glibc's malloc and MLX's cache: the faults column is the median count per run. The
median of --repeat reps after one untimed warm-up is printed (cold: no warm-up) with the
best and worst, GB/s as 10^9 bytes of tensor data per second at the median.

--tokens takes several sizes, each measured in turn; --plot FILE.png also draws kvd get's
GB/s by entry size against mx.load and the raw read, hot and cold (docs/figures/restore.png).
--breakdown also takes a get of the entry in blocks apart into its phases (lookup, lease,
allocation, room for growth, MLX arrays, reads, checksums, release), each run alone, hot and
cold, with their page faults (bench/_restore_phases.py).

    .venv/bin/python bench/restore.py [--full | --tokens N ...] [--repeat 5] [--cold-repeat 3]
        [--no-cold] [--mlx-cache-limit BYTES] [--plot FILE.png] [--breakdown]
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _daemon import running_daemon
from _plot import Figure, Panel, Series, machine_caption, save
from _restore_phases import PHASES, Breakdown, breakdown
from kvd_client import prompt_cache
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from mlx_lm.models import cache as _mlx_lm_cache

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS, FULL_TOKENS = 4096, 16384
IDENTITY = EngineIdentity("bench/restore", "cfg", "tok")
WHOLE = EngineIdentity("bench/restore-whole", "cfg", "tok")  # the same cache, put whole
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


@dataclass(frozen=True)
class Sample:
    """One timed run: its seconds and the page faults it took (new pages touched)."""

    seconds: float
    faults: int


@dataclass(frozen=True)
class Timing:
    """The runs of one path: their median, best and worst, and the median page faults."""

    runs: tuple[Sample, ...]

    @property
    def seconds(self) -> float:
        return statistics.median(run.seconds for run in self.runs)

    @property
    def best(self) -> float:
        return min(run.seconds for run in self.runs)

    @property
    def worst(self) -> float:
        return max(run.seconds for run in self.runs)

    @property
    def faults(self) -> int:
        return int(statistics.median(run.faults for run in self.runs))


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(run: Callable[[], object]) -> Sample:
    faults = _faults()
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    faults = _faults() - faults
    del result
    gc.collect()  # the restored arrays go before the next rep, not during it
    return Sample(elapsed, faults)


def timings(
    runs: Sequence[Callable[[], object]], repeat: int, before: Callable[[], None] | None = None
) -> list[Timing]:
    """Per run, repeat timed runs, the runs taken in turn in each rep (so that a busy machine
    slows twins alike); before (untimed) precedes each; one untimed warm-up of each first
    unless before is given (it drops the page cache: a warm-up is wasted)."""
    if before is None:
        for run in runs:
            timed(run)
    samples: list[list[Sample]] = [[] for _ in runs]
    for _ in range(repeat):
        for run, taken in zip(runs, samples, strict=True):
            if before is not None:
                before()
            taken.append(timed(run))
    return [Timing(tuple(taken)) for taken in samples]


def read_into(path: Path, target: memoryview) -> None:
    with path.open("rb", buffering=0) as f:
        view = target
        while view:
            n = f.readinto(view)
            if not n:
                raise EOFError(f"{path} is shorter than {len(target)} bytes")
            view = view[n:]


def first_step(cache: list[Any]) -> list[Any]:
    """What an engine's first decode step does to a restored cache: one more token in every
    layer (update_and_fetch), evaluated."""
    shape = (1, KV_HEADS, 1, HEAD_DIM)
    token = mx.ones(shape, mx.float16)
    mx.eval(token)
    mx.eval([layer.update_and_fetch(token, token) for layer in cache])
    return cache


@dataclass(frozen=True)
class Clients:
    """The bench's clients of one daemon: the default ones (KV in shared blocks), and ones
    that store and read entries whole (block_tokens=0); each verifying or not."""

    blocks: Client
    blocks_unverified: Client
    whole: Client
    whole_unverified: Client


class Restores:
    """Every timed restore path over one cache and its files in folder."""

    def __init__(
        self, clients: Clients, cache: list[Any], tokens: int, folder: Path, tier: Path
    ) -> None:
        self.clients, self.tokens = clients, tokens
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
        for client, identity in ((clients.blocks, IDENTITY), (clients.whole, WHOLE)):
            ticket = client.put(identity, prompt(tokens), cache)
            if ticket.wait(600.0).state != "stored":
                raise RuntimeError(f"the put was not stored: {ticket.state}")
        self.entry_file = max(  # the whole entry: the blocks' files are a fraction of it
            (p for p in (tier / "entries").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size,
        )
        # Page-aligned: the kernel copies into a bytearray (16 bytes into a cache line) about
        # three times slower here, see kvd_client.entry_io.LINE.
        self.entry_buffer = memoryview(mmap.mmap(-1, self.entry_file.stat().st_size))

    def get(self, client: Client, identity: EngineIdentity = IDENTITY) -> Any:
        restored = client.get(identity, prompt(self.tokens + 1))
        if restored is None or restored.matched != self.tokens:
            raise RuntimeError(f"the get missed: {client.stats}")
        return restored

    def get_and_step(self) -> object:
        return first_step(self.get(self.clients.blocks).cache)

    def decode_timings(self, repeat: int) -> list[Timing]:
        """Decode alone, verified and not, of the whole entry looked up once."""
        result = self.clients.whole.lookup(WHOLE.to_protocol(), prompt(self.tokens + 1))
        if result is None:
            raise RuntimeError("the lookup missed")
        with result:
            header, matched = result.header, result.matched
            runs = [
                partial(prompt_cache.decode, header, result.fills(verify=verify), matched)
                for verify in (True, False)
            ]
            return timings(runs, repeat)

    def memcpy(self) -> None:
        np.copyto(self.target, self.source)

    def raw_read(self) -> None:
        read_into(self.entry_file, self.entry_buffer)

    def mx_load(self) -> object:
        arrays = mx.load(str(self.safetensors))
        mx.eval(arrays)
        return arrays

    def mlx_lm_load(self) -> list[Any]:
        cache: list[Any] = mlc.load_prompt_cache(str(self.mlx_lm_file))
        mx.eval([layer.state for layer in cache])
        return cache

    def mlx_lm_load_and_step(self) -> object:
        return first_step(self.mlx_lm_load())

    @property
    def files(self) -> list[Path]:
        return [self.entry_file, self.safetensors, self.mlx_lm_file]

    def warm(self) -> None:
        for path in self.files:
            with path.open("rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


MX_LOAD = "mx.load safetensors + eval (anchor)"
MLX_LM_LOAD = "mlx-lm load_prompt_cache (anchor)"
RAW_READ = "raw read of the entry file, one thread (anchor)"
MEMCPY = "memcpy (anchor)"
GET = "kvd get (lookup + decode + release)"
GET_WHOLE = "kvd get of the entry stored whole (block_tokens=0)"
STEP = " + first decode step"


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


def goals(rows: dict[tuple[str, str], Timing], temperature: str, name: str) -> str:
    """The goals a row is held to, each met or not (medians against medians)."""
    seconds = rows[(temperature, name)].seconds
    if name == GET + STEP:
        anchor = rows.get((temperature, MLX_LM_LOAD + STEP))
        return (
            ""
            if anchor is None
            else f"≤ load_prompt_cache + step: {_verdict(seconds <= anchor.seconds)}"
        )
    if not (name.startswith("kvd get") or name.startswith("decode")) or UNVERIFIED in name:
        return ""
    verdicts = [
        f"≥ mx.load: {_verdict(seconds <= rows[(temperature, MX_LOAD)].seconds / GOAL_MX_LOAD)}"
    ]
    if temperature == "hot":
        met = seconds <= rows[("hot", MEMCPY)].seconds / GOAL_MEMCPY
        verdicts.append(f"≥ {GOAL_MEMCPY}× memcpy: {_verdict(met)}")
    twin = rows.get((temperature, name + UNVERIFIED))
    if twin is not None:
        met = seconds / twin.seconds - 1 <= GOAL_CHECKSUMS
        verdicts.append(f"checksums ≤ {GOAL_CHECKSUMS:.0%}: {_verdict(met)}")
    return "; ".join(verdicts)


def print_table(rows: dict[tuple[str, str], Timing], nbytes: int) -> None:
    """rows: by (temperature, path), with the anchors among them, in the order to print."""
    print(
        "| page cache | path | ms | best–worst ms | GB/s | × memcpy | × mx.load "
        "| × load_prompt_cache | × raw read | faults | checksums | goals |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    memcpy = rows[("hot", MEMCPY)].seconds
    for (temperature, name), timing in rows.items():
        seconds = timing.seconds

        def ratio(anchor: str, temperature: str = temperature, seconds: float = seconds) -> str:
            base = rows.get((temperature, anchor))
            return "–" if base is None else f"{base.seconds / seconds:.2f}"

        twin = rows.get((temperature, name + UNVERIFIED))
        checksums = "–" if twin is None else f"{seconds / twin.seconds - 1:+.1%}"
        print(
            f"| {temperature} | {name} | {seconds * 1e3:.1f} "
            f"| {timing.best * 1e3:.1f}–{timing.worst * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} "
            f"| {memcpy / seconds:.2f} | {ratio(MX_LOAD)} | {ratio(MLX_LM_LOAD)} "
            f"| {ratio(RAW_READ)} | {timing.faults:,} | {checksums} "
            f"| {goals(rows, temperature, name)} |"
        )


def print_breakdown(phases: dict[str, Breakdown], rows: dict[tuple[str, str], Timing]) -> None:
    """The phases of a get, by page cache, against the get itself and mx.load."""
    temperatures = list(phases)
    print("\n| phase | " + " | ".join(f"{t} ms | {t} faults" for t in temperatures) + " |")
    print("|---|" + "---:|---:|" * len(temperatures))
    for name in PHASES:
        cells = [f"{b.seconds(name) * 1e3:.2f} | {b.faults(name):,}" for b in phases.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    sums = [f"**{b.total * 1e3:.2f}** | " for b in phases.values()]
    print("| sum of the phases | " + " | ".join(sums) + " |")
    for name in (GET, MX_LOAD):
        cells = [
            f"{rows[(t, name)].seconds * 1e3:.2f} | {rows[(t, name)].faults:,}"
            for t in temperatures
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


@dataclass(frozen=True)
class Measured:
    """One entry size's timings, by (page cache, path), and its get's phases by page cache."""

    tokens: int
    nbytes: int
    rows: dict[tuple[str, str], Timing]
    phases: dict[str, Breakdown]

    def gb_per_s(self, temperature: str, path: str) -> float:
        return self.nbytes / self.rows[(temperature, path)].seconds / 1e9


def measure(clients: Clients, tokens: int, work: Path, args: argparse.Namespace) -> Measured:
    """Every path's timings over a cache of tokens tokens, hot and (unless args say not) cold;
    its files, and its entries in the tier, are gone afterwards."""
    folder = work / f"cache-{tokens}"
    folder.mkdir()
    cache = realistic_cache(tokens)
    bench = Restores(clients, cache, tokens, folder, work / "tier")
    del cache
    gc.collect()
    bench.warm()
    restores: dict[str, Callable[[], object]] = {  # taken in turn in each rep
        MX_LOAD: bench.mx_load,
        MLX_LM_LOAD: bench.mlx_lm_load,
        GET: partial(bench.get, clients.blocks),
        GET + UNVERIFIED: partial(bench.get, clients.blocks_unverified),
        GET_WHOLE: partial(bench.get, clients.whole, WHOLE),
        GET_WHOLE + UNVERIFIED: partial(bench.get, clients.whole_unverified, WHOLE),
        MLX_LM_LOAD + STEP: bench.mlx_lm_load_and_step,
        GET + STEP: bench.get_and_step,
    }
    groups: list[dict[str, Callable[[], object]]] = [
        {MEMCPY: bench.memcpy},
        {RAW_READ: bench.raw_read},
        restores,
    ]
    rows: dict[tuple[str, str], Timing] = {}
    for group in groups:
        rows.update(
            (("hot", name), timing)
            for name, timing in zip(group, timings([*group.values()], args.repeat), strict=True)
        )
    decode = "decode alone (entry looked up)"
    verified, unverified = bench.decode_timings(args.repeat)
    rows[("hot", decode)], rows[("hot", decode + UNVERIFIED)] = verified, unverified
    drop = drop_page_cache if can_drop_page_cache() else partial(evict_files, bench.files)
    if args.cold:
        for group in groups[1:]:
            cold_timings = timings([*group.values()], args.cold_repeat, drop)
            rows.update((("cold", name), t) for name, t in zip(group, cold_timings, strict=True))
    phases: dict[str, Breakdown] = {}
    if args.breakdown:
        asked = prompt(tokens + 1)
        bench.warm()
        phases["hot"] = breakdown(clients.blocks, IDENTITY, asked, args.repeat)
        if args.cold and can_drop_page_cache():  # the blocks' files too: every page dropped
            phases["cold"] = breakdown(clients.blocks, IDENTITY, asked, args.cold_repeat, drop)
    shutil.rmtree(folder)
    clients.blocks.evict(all=True)  # the next size's whole entry is then the tier's largest file
    return Measured(tokens, bench.nbytes, rows, phases)


# The figure's lines: kvd's default restore against the two anchors a restore is held to.
FIGURE_PATHS = {
    GET: "kvd get (verified, blocks)",
    MX_LOAD: "mx.load + eval of the same tensors",
    RAW_READ: "raw read of the entry file, one thread",
}


def figure(sizes: list[Measured], args: argparse.Namespace) -> Figure:
    """Restore GB/s against entry size, hot and cold side by side."""
    temperatures = {"hot": "page cache hot", "cold": "page cache dropped (cold)"}
    panels = [
        Panel(
            title,
            [
                Series(label, [(m.nbytes, m.gb_per_s(temperature, path)) for m in sizes])
                for path, label in FIGURE_PATHS.items()
            ],
        )
        for temperature, title in temperatures.items()
        if (temperature, GET) in sizes[0].rows
    ]
    reps = f"medians of {args.repeat} hot" + (
        f", {args.cold_repeat} cold reps" if args.cold else " reps"
    )
    return Figure(
        title="Restore rate by entry size: kvd get against mx.load and a raw read",
        x_label="entry size (32 layers of float16 keys and values)",
        y_label="GB/s (10⁹ bytes of tensors a second)",
        panels=panels,
        caption=machine_caption(reps),
        x_tick=lambda x: f"{x / (1 << 30):g} GiB" if x >= 1 << 30 else f"{x / (1 << 20):g} MiB",
        log_y=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help=f"{FULL_TOKENS} tokens (2 GiB)")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None, help=f"entry sizes (default {TOKENS})"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cold-repeat", type=int, default=3)
    parser.add_argument("--no-cold", dest="cold", action="store_false")
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    parser.add_argument(
        "--mlx-cache-limit",
        type=int,
        default=None,
        help="bytes MLX may keep of freed buffers for reuse (mx.set_cache_limit), as an engine "
        "would set it; default: MLX's own",
    )
    parser.add_argument("--plot", type=Path, help="also draw GB/s by entry size into this PNG")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time a get's phases one at a time"
    )
    args = parser.parse_args()
    if args.mlx_cache_limit is not None:
        mx.set_cache_limit(args.mlx_cache_limit)
    sizes = args.tokens or [FULL_TOKENS if args.full else TOKENS]
    args.cold = args.cold and (can_drop_page_cache() or hasattr(os, "posix_fadvise"))

    # A lookup may take its time here (a cold daemon on a loaded machine): the bench times
    # restores, not the engine's deadline, which would make a slow lookup a miss.
    connect = partial(Client.connect, timeout=120.0, require=True, lookup_timeout=60.0)
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work), DAEMON_FLAGS) as daemon,
        connect(daemon.socket_path) as client,
        connect(daemon.socket_path, verify=False) as plain,
        connect(daemon.socket_path, block_tokens=0) as whole,
        connect(daemon.socket_path, verify=False, block_tokens=0) as whole_plain,
    ):
        clients = Clients(client, plain, whole, whole_plain)
        measured = [measure(clients, tokens, Path(work), args) for tokens in sizes]

    limit = (
        "MLX's default cache limit"
        if args.mlx_cache_limit is None
        else f"MLX cache limit {args.mlx_cache_limit:,} bytes"
    )
    for size in measured:
        print(
            f"\n{LAYERS} layers × (keys, values) float16 (1, {KV_HEADS}, {size.tokens:,}, "
            f"{HEAD_DIM}) = {size.nbytes / (1 << 20):,.0f} MiB, {limit}; median of {args.repeat} "
            "hot reps"
            + (
                f", {args.cold_repeat} cold reps"
                if args.cold
                else "; cold not run (needs root here)"
            )
            + ".\n"
        )
        print_table(size.rows, size.nbytes)
        if size.phases:
            print_breakdown(size.phases, size.rows)
    if args.plot is not None:
        save(figure(measured, args), args.plot)


if __name__ == "__main__":
    main()
