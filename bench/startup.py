"""Daemon start-up time against the number of entries in the tier.

Start-up is the time from spawning `kvd serve` to its first ping answered: the daemon reaps
staging, reads and validates every entry header (or loads its index snapshot) and indexes
them before it listens. Anchor: a bare `python -c "import kvd.server"`, spawn to exit, in
the same run: what any start costs before the tier is touched. Goal: 100k entries in 1 s.

The tier is filled directly with valid entry files, a few identities, each entry shaped as
a real one (32 layers of keys and values, float16 (1, 8, tokens, 128)) with its own tokens.
Each file holds its head and is extended to its full size without writing the data (a
sparse file reads as zeros, and the slot checksums are those of zeros), so 100k entries
take 1.6 GB of disk, not terabytes; the daemon runs with a cap that holds them all.

With an index snapshot (kvd/snapshot.py: tier/index.snapshot, written periodically and at
a clean stop), each size is started both ways: without the snapshot (a full scan) and with
it. Without that module only the full scan is measured. The page cache is warm for every
start (dropping it needs root); a first start after a reboot reads the headers from disk.
A full scan of 100k entries takes minutes while headers cost about a millisecond each to
validate: --sizes 1000,10000 is the quick run.

    .venv/bin/python bench/startup.py [--sizes 1000,10000,100000] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from _daemon import Daemon, socket_folder
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

from kvd.entry_files import read_header, verify_data
from kvd.tier_dir import ENTRY_SUFFIX, TierDir

IDENTITIES = 4
FULL_SCAN_SECONDS = 600.0  # a full header scan of 100k entries takes minutes
LAYERS = 32
SHAPE = (1, 8, 128)  # (batch, KV heads, head dim); tokens go in as the third dimension
DAEMON_FLAGS = ("--max-bytes", "1P", "--min-free", "0")  # sparse files: sizes, not disk
REPEAT_UNDER_SECONDS = 10.0  # a start slower than this is not repeated
GOAL_ENTRIES, GOAL_SECONDS = 100_000, 1.0


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


def best_seconds(run: Callable[[], float], repeat: int) -> float:
    """The fastest of up to repeat runs; a run over REPEAT_UNDER_SECONDS ends the series."""
    times = [run()]
    while len(times) < repeat and times[-1] < REPEAT_UNDER_SECONDS:
        times.append(run())
    return min(times)


def import_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kvd.server"], check=True)
    return time.perf_counter() - start


@dataclass
class Starter:
    """Starts and stops of the daemon on one tier, each checked to have indexed them all."""

    tier: TierDir
    socket_path: str
    log: Path
    entries: int = 0

    def start_seconds(self, *, snapshot: bool) -> float:
        if not snapshot:
            self.tier.snapshot.unlink(missing_ok=True)
        elif not self.tier.snapshot.exists():
            raise RuntimeError("no index snapshot to start from")
        daemon = Daemon(self.tier.root, self.socket_path, self.log, DAEMON_FLAGS)
        seconds = daemon.start(timeout=FULL_SCAN_SECONDS)
        try:
            with Client.connect(self.socket_path, require=True) as client:
                status = client.status()
        finally:
            daemon.stop()
        if status["entries"] != self.entries or status["quarantined"] != 0:
            raise RuntimeError(
                f"the daemon indexed {status['entries']} of {self.entries} entries and "
                f"quarantined {status['quarantined']}; see {self.log}"
            )
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="entries, ascending")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per entry")
    parser.add_argument("--repeat", type=int, default=3, help="starts per cell (at most)")
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))
    has_snapshot = importlib.util.find_spec("kvd.snapshot") is not None

    anchor = best_seconds(import_seconds, 5)
    rows = []
    snapshot_note = ""
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        socket_folder() as sockets,
    ):
        tier = TierDir(Path(work) / "tier")
        tier.create()
        identities = [
            Identity(f"bench/model-{i}", "cfg", "tok", "codecs/1", "mlx/cpu")
            for i in range(IDENTITIES)
        ]
        makers = [EntryMaker(tier, identity, args.tokens) for identity in identities]
        starter = Starter(tier, os.path.join(sockets, "kvd.sock"), Path(work) / "kvd.log")
        for size in sizes:
            started = time.perf_counter()
            fill(tier, makers, starter.entries, size)
            built = time.perf_counter() - started
            if starter.entries == 0:
                check_valid(next((tier.entries / identities[0].digest()).iterdir()))
            starter.entries = size
            full = best_seconds(lambda: starter.start_seconds(snapshot=False), args.repeat)
            with_snapshot = None
            if has_snapshot and tier.snapshot.exists():
                with_snapshot = best_seconds(
                    lambda: starter.start_seconds(snapshot=True), args.repeat
                )
            elif has_snapshot:
                snapshot_note = "kvd.snapshot exists but no index.snapshot was written at stop."
            rows.append((size, built, full, with_snapshot))
    if not has_snapshot:
        snapshot_note = "kvd has no index snapshot (kvd/snapshot.py): full scans only."

    print(
        f"{IDENTITIES} identities; entries of {args.tokens} tokens, {LAYERS} layers × "
        f"(keys, values); best of up to {args.repeat} starts; warm page cache; "
        f'anchor `python -c "import kvd.server"`: {anchor * 1e3:.0f} ms.\n'
    )
    print(
        "| entries | files made in s | start, full scan s | full scan / anchor "
        f"| start, with snapshot s | snapshot / anchor | goal: ≤ {GOAL_SECONDS:g} s "
        f"at {GOAL_ENTRIES // 1000}k |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for size, built, full, with_snapshot in rows:
        best = full if with_snapshot is None else min(full, with_snapshot)
        goal = ""
        if size == GOAL_ENTRIES:
            goal = "met" if best <= GOAL_SECONDS else "not met"
        snap = "—" if with_snapshot is None else f"{with_snapshot:.2f}"
        snap_ratio = "—" if with_snapshot is None else f"{with_snapshot / anchor:.1f}"
        print(
            f"| {size:,} | {built:.1f} | {full:.2f} | {full / anchor:.1f} | {snap} "
            f"| {snap_ratio} | {goal} |"
        )
    if snapshot_note:
        print(f"\n{snapshot_note}")


if __name__ == "__main__":
    main()
