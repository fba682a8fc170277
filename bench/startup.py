"""Daemon start-up time against the number of entries in the tier.

Start-up is the time from spawning `kvd serve` to its first ping answered: the daemon reaps
staging, reads and validates every entry header (or loads its index snapshot) and indexes
them before it listens. Anchor: a bare `python -c "import kvd.serve.server"`, spawn to exit, in
the same run: what any start costs before the tier is touched. Goal: 100k entries in 1 s.

The tier is filled directly with valid entry files, a few identities, each entry shaped as
a real one (32 layers of keys and values, float16 (1, 8, tokens, 128)) with its own tokens.
Each file holds its head and is extended to its full size without writing the data (a
sparse file reads as zeros, and the slot checksums are those of zeros), so 100k entries
take 1.6 GB of disk, not terabytes; the daemon runs with a cap that holds them all.

With the index snapshot (kvd/store/snapshot.py: tier/index.snapshot, written periodically and at
a clean stop), each size is started both ways: without the snapshot (a full scan) and with
it. The page cache is warm for every start (dropping it needs root); a first start after a
reboot reads the headers from disk. A full scan of 100k entries takes minutes while headers
cost about a millisecond each to validate: --sizes 1000,10000 is the quick run, and --keep
DIR keeps the tier (files and snapshot) for the next run, which then starts from the
snapshot only.

A start from the snapshot answers ping before it has listed the directory against it: each
cell also has the end of that listing, and the daemon's CPU time by its first ping (steadier
than the wall clock on a shared machine) and by the listing's end. Its RSS after both, per
entry beyond the entry's own tokens, of the whole process and beyond what the same daemon
takes on an empty tier (the interpreter and its imports, ~35 MiB, which no entry adds): the
memory goal is at most 1 KB per entry beyond both at 100k. --phases adds the CPU time of each
part of a start from the snapshot, measured in this process (loading it, building the
catalog from it, listing the directory against it).

    .venv/bin/python bench/startup.py [--sizes 1000,10000,100000] [--tokens 1024] [--keep DIR]
        [--phases]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import psutil
from _daemon import OPENED, Daemon, socket_folder
from kvd_client.client import Client
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import (
    CHECKSUMMED_PREFIX_BYTES,
    PREFIX_BYTES,
    LayerSpec,
    TensorSpec,
    header_checksum,
    plan_entry,
)
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import TOKEN_BYTES

from kvd.config import Config
from kvd.store import snapshot
from kvd.store.entry_files import read_header, verify_data
from kvd.store.tier import Tier
from kvd.store.tier_dir import ENTRY_SUFFIX, TierDir

IDENTITIES = 4
FULL_SCAN_SECONDS = 600.0  # a full header scan of 100k entries takes minutes
LAYERS = 32
SHAPE = (1, 8, 128)  # (batch, KV heads, head dim); tokens go in as the third dimension
DAEMON_FLAGS = ("--max-bytes", "1P", "--min-free", "0")  # sparse files: sizes, not disk
REPEAT_UNDER_SECONDS = 10.0  # a start slower than this is not repeated
GOAL_ENTRIES, GOAL_SECONDS = 100_000, 1.0
GOAL_BYTES = 1000  # per entry beyond its tokens and the empty daemon's RSS, at 100k


class EntryMaker:
    """Valid entry files of one identity, fast: the head is planned and encoded once, and
    each file's head is that one with its own tokens in place and its checksum redone."""

    def __init__(self, tier: TierDir, identity: Identity, tokens: int) -> None:
        self.folder = tier.entries / identity.digest()
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.token_bytes = tokens * TOKEN_BYTES
        spec = TensorSpec("float16", (SHAPE[0], SHAPE[1], tokens, SHAPE[2]))
        layers = [LayerSpec("kv", (spec, spec), trimmable=True, meta={"offset": tokens})] * LAYERS
        self.placeholder = os.urandom(self.token_bytes)
        plan = plan_entry(identity, self.placeholder, layers, created=time.time(), min_reuse=0)
        zeros = checksum(bytes(plan.slots[0].nbytes))  # a sparse file's data reads as zeros
        head = plan.head([zeros] * len(plan.slots))
        self.covered = head[:CHECKSUMMED_PREFIX_BYTES]
        self.header = head[PREFIX_BYTES : PREFIX_BYTES + plan.header_length]
        self.pad = head[PREFIX_BYTES + plan.header_length :]
        # Same-length tokens encode to the same bytes at the same place in the header.
        self.at = self.header.index(self.placeholder)
        self.file_size = plan.file_size

    def write(self, entry_id: str) -> Path:
        tokens = os.urandom(self.token_bytes)
        header = self.header[: self.at] + tokens + self.header[self.at + self.token_bytes :]
        head = self.covered + header_checksum(self.covered, header) + header + self.pad
        path = self.folder / f"{entry_id}{ENTRY_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, head)
            os.ftruncate(fd, self.file_size)
        finally:
            os.close(fd)
        return path


def fill(tier: TierDir, makers: list[EntryMaker], start: int, stop: int) -> None:
    """Entries start..stop-1 (ids from the counter), spread over the identities."""
    for n in range(start, stop):
        makers[n % len(makers)].write(f"{n:032x}")


def check_valid(path: Path) -> None:
    """Read a made file back as the daemon does (raises EntryFormatError if it is not valid)."""
    verify_data(path, read_header(path, DEFAULT_LIMITS))


@dataclass(frozen=True)
class Start:
    """One start: spawn to first ping (wall clock) and the daemon's CPU time by then; spawn
    to the end of start-up's listing of the directory (a start from the snapshot serves
    before that) with its CPU time by then; its RSS after both."""

    seconds: float
    cpu_seconds: float
    listed_seconds: float
    listed_cpu_seconds: float
    rss: int


@dataclass(frozen=True)
class Cell:
    """The starts of one cell: the fastest, the slowest, and the least CPU and memory."""

    starts: list[Start]

    @property
    def best(self) -> float:
        return min(s.seconds for s in self.starts)

    @property
    def spread(self) -> str:
        worst = max(s.seconds for s in self.starts)
        return f"{self.best:.2f}–{worst:.2f}" if len(self.starts) > 1 else f"{self.best:.2f}"

    @property
    def cpu(self) -> float:
        return min(s.cpu_seconds for s in self.starts)

    @property
    def listed(self) -> float:
        return min(s.listed_seconds for s in self.starts)

    @property
    def listed_cpu(self) -> float:
        return min(s.listed_cpu_seconds for s in self.starts)

    @property
    def rss(self) -> int:
        return min(s.rss for s in self.starts)


def measured(run: Callable[[], Start], repeat: int) -> Cell:
    """Up to repeat runs; a run over REPEAT_UNDER_SECONDS ends the series."""
    starts = [run()]
    while len(starts) < repeat and starts[-1].seconds < REPEAT_UNDER_SECONDS:
        starts.append(run())
    return Cell(starts)


def import_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kvd.serve.server"], check=True)
    return time.perf_counter() - start


@dataclass
class Starter:
    """Starts and stops of the daemon on one tier, each checked to have indexed them all."""

    tier: TierDir
    socket_path: str
    log: Path
    entries: int = 0

    def start(self, *, snapshot: bool) -> Start:
        if not snapshot:
            self.tier.snapshot.unlink(missing_ok=True)
        elif not self.tier.snapshot.exists():
            raise RuntimeError("no index snapshot to start from")
        daemon = Daemon(self.tier.root, self.socket_path, self.log, DAEMON_FLAGS)
        opened = daemon.logs().count(OPENED)
        spawned = time.perf_counter()
        seconds = daemon.start(timeout=FULL_SCAN_SECONDS, settled=False)
        try:
            process = psutil.Process(daemon.pid)
            cpu = process.cpu_times()
            daemon.wait_settled(opened, FULL_SCAN_SECONDS)
            listed = time.perf_counter() - spawned
            listed_cpu = process.cpu_times()
            with Client.connect(self.socket_path, require=True) as client:
                status = client.status()
            rss = process.memory_info().rss
        finally:
            daemon.stop()
        if status["entries"] != self.entries or status["quarantined"] != 0:
            raise RuntimeError(
                f"the daemon indexed {status['entries']} of {self.entries} entries and "
                f"quarantined {status['quarantined']}; see {self.log}"
            )
        return Start(
            seconds, cpu.user + cpu.system, listed, listed_cpu.user + listed_cpu.system, rss
        )


def phase_seconds(tier: TierDir) -> list[tuple[str, float]]:
    """CPU seconds of each part of the start, in this process, from the kept tier's snapshot:
    what the daemon does between its imports and its first ping, then while it serves."""

    def cpu(run: Callable[[], object]) -> float:
        gc.disable()  # as the daemon starts: LifeCycle.open's own is off too
        started = time.process_time()  # every thread's: the listing runs in a worker
        run()
        seconds = time.process_time() - started
        gc.enable()
        return seconds

    # The least of three: the first touches the mapped file's pages, and a shared machine
    # varies; the catalog's part is the rest of LifeCycle.open, which loads it once more.
    load = min(cpu(lambda: snapshot.load_snapshot(tier.snapshot)) for _ in range(3))
    config = Config(dir=tier.root, socket=tier.root / "unused.sock", max_bytes=2**50, min_free=0)
    opened = Tier(config, DEFAULT_LIMITS)
    parts: list[float] = []

    async def start() -> None:
        for step in (opened.life.open, opened.life.settle):
            started = time.process_time()
            await step()
            parts.append(time.process_time() - started)

    anyio.run(start)
    opened.life.close()
    return [
        ("LifeCycle.open in all", parts[0]),
        ("of which loading the snapshot (the least of three loads)", load),
        ("and building the catalog from it (the rest)", parts[0] - load),
        ("then, while serving: listing the directory against it (LifeCycle.settle)", parts[1]),
    ]


def empty_daemon_rss() -> int:
    """The RSS of a daemon serving an empty tier: the process's own, which no entry adds."""
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as work, socket_folder() as sockets:
        starter = Starter(TierDir(Path(work) / "tier"), f"{sockets}/kvd.sock", Path(work) / "log")
        return min(starter.start(snapshot=False).rss for _ in range(2))


def existing_entries(tier: TierDir) -> int:
    return sum(1 for _ in tier.entries.glob(f"*/*{ENTRY_SUFFIX}"))


Row = tuple[int, float, Cell | None, Cell | None]  # entries, files made in s, full scan, snapshot


def print_table(rows: list[Row], anchor: float, empty_rss: int, tokens: int, repeat: int) -> None:
    print(
        f"{IDENTITIES} identities; entries of {tokens} tokens, {LAYERS} layers × "
        f"(keys, values); up to {repeat} starts per cell (best, and best–worst); warm "
        f'page cache; anchor `python -c "import kvd.serve.server"`: '
        f"{anchor * 1e3:.0f} ms (best of 5). "
        "CPU: the daemon's own, spawn to first ping; listed by: spawn to the end of start-up's "
        "listing of the directory (a start from the snapshot serves before it), and the CPU by "
        "then; RSS after both, and per entry beyond the entry's tokens "
        f"({tokens * TOKEN_BYTES:,} bytes): of the whole process, and beyond the process's own "
        f"{empty_rss / 2**20:.0f} MiB on an empty tier (the memory goal: ≤ {GOAL_BYTES:,} B).\n"
    )
    print(
        "| entries | files made in s | start, full scan s | start, with snapshot s "
        "| snapshot / anchor | daemon CPU s | listed by s (CPU s) | RSS MiB "
        "| RSS per entry beyond tokens | beyond the empty daemon too "
        f"| goal: ≤ {GOAL_SECONDS:g} s at {GOAL_ENTRIES // 1000}k |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for size, built, full, with_snapshot in rows:
        cells = [cell for cell in (full, with_snapshot) if cell is not None]
        goal = ""
        if size == GOAL_ENTRIES:
            goal = "met" if min(cell.best for cell in cells) <= GOAL_SECONDS else "not met"
        last = cells[-1]  # from the snapshot when there is one
        beyond = last.rss / size - tokens * TOKEN_BYTES
        own = (last.rss - empty_rss) / size - tokens * TOKEN_BYTES
        ratio = f"{with_snapshot.best / anchor:.1f}" if with_snapshot else "—"
        print(
            f"| {size:,} | {built:.1f} | {full.spread if full else '—'} "
            f"| {with_snapshot.spread if with_snapshot else '—'} | {ratio} | {last.cpu:.2f} "
            f"| {last.listed:.2f} ({last.listed_cpu:.2f}) | {last.rss / 2**20:.0f} "
            f"| {beyond:,.0f} B | {own:,.0f} B | {goal} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="entries, ascending")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per entry")
    parser.add_argument("--repeat", type=int, default=3, help="starts per cell (at most)")
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    parser.add_argument(
        "--keep",
        default=None,
        help="a folder to keep the tier in and take it from next time (made entries and the "
        "snapshot are reused; the full scan is then measured only with --full-scan)",
    )
    parser.add_argument("--full-scan", action="store_true", help="with --keep: scan anyway")
    parser.add_argument(
        "--phases", action="store_true", help="then the CPU time of each part of a start"
    )
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))

    anchor = min(import_seconds() for _ in range(5))
    empty_rss = empty_daemon_rss()
    rows: list[Row] = []
    snapshot_note = ""
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.keep)
            if args.keep
            else Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir))
            )
        )
        sockets = stack.enter_context(socket_folder())
        tier = TierDir(work / "tier")
        tier.create()
        identities = [
            Identity(f"bench/model-{i}", "cfg", "tok", "codecs/1", "mlx/cpu")
            for i in range(IDENTITIES)
        ]
        makers = [EntryMaker(tier, identity, args.tokens) for identity in identities]
        starter = Starter(tier, os.path.join(sockets, "kvd.sock"), work / "kvd.log")
        starter.entries = existing_entries(tier) if args.keep else 0
        for size in sizes:
            if size < starter.entries:
                continue  # a kept tier holds more already
            started = time.perf_counter()
            fill(tier, makers, starter.entries, size)
            built = time.perf_counter() - started
            if starter.entries == 0:
                check_valid(next((tier.entries / identities[0].digest()).iterdir()))
            scan = not args.keep or args.full_scan or starter.entries < size
            scan = scan or not tier.snapshot.exists()
            starter.entries = size
            full = measured(lambda: starter.start(snapshot=False), args.repeat) if scan else None
            with_snapshot = None
            if tier.snapshot.exists():
                with_snapshot = measured(lambda: starter.start(snapshot=True), args.repeat)
            else:
                snapshot_note = "No index.snapshot was written at stop."
            rows.append((size, built, full, with_snapshot))
        phases = phase_seconds(tier) if args.phases and tier.snapshot.exists() else []

    print_table(rows, anchor, empty_rss, args.tokens, args.repeat)
    if snapshot_note:
        print(f"\n{snapshot_note}")
    if phases:
        print(f"\nIn this process, from the snapshot of {starter.entries:,} entries (CPU s):\n")
        for name, seconds in phases:
            print(f"- {name}: {seconds:.2f}")


if __name__ == "__main__":
    main()
