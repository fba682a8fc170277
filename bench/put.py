"""Put cost: on the engine's side against memcpy, on the daemon's side against write + fsync.

An entry is 32 layers of keys and values in float16, shaped (1, 8, tokens, 128) as in an
8-KV-head, 128-dim model, with the token count chosen to give each size. Two measurements
per put, against a real `kvd serve` on a tier in --dir:

- engine side: from the put_entry call to the commit answer (plan, put_begin, one copy of
  every tensor into the daemon's staging file, checksummed on the way, the head, commit).
  Anchor: a memcpy of the same tensors into a preallocated buffer (memoryview slice
  assignment), in the same run. Goal: put within 1.5× memcpy. To tell the daemon's part
  from the file system's, the same write without the daemon is also timed ("staging write
  alone": plan, a new preallocated file, kvd_client's write_entry into it).
- daemon side: from the commit answer to the ticket answering stored (the writer verifies
  the checksums, syncs, renames into place, syncs the folder). Anchor: a dd-style write of
  the same bytes to a new file in the tier's directory, then fsync, in the same run.

Each put waits for its ticket before the next, so the writer never runs under a timed put,
and its entry is evicted once stored, so the next put writes into recycled page-cache memory
(a machine in steady state) rather than into pages the system never used (on a virtual
machine whose host backs memory on first touch, those cost several times more).
The fastest of --repeat runs is printed. 1 GiB puts need about 4 GiB of memory (the tensors,
the memcpy target, the page cache of the file); --quick leaves them out.

    .venv/bin/python bench/put.py [--quick] [--repeat 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol.entry import LayerSpec, TensorSpec, plan_entry
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

from kvd.entry_files import create_staging

MiB = 1 << 20
IDENTITY = Identity("bench/put", "cfg", "tok", "codecs/1", "mlx/cpu")
LAYERS = 32
KV_HEADS, HEAD_DIM, ITEMSIZE = 8, 128, 2  # float16
SIZES_MIB = (16, 256, 1024)
QUICK_SIZES_MIB = (16, 256)
GOAL = 1.5  # put within this many times memcpy
SETTLE_SECONDS = 600.0


def build_entry(size: int) -> tuple[int, list[LayerSpec], list[np.ndarray]]:
    """(tokens, layers, tensors) of an entry whose tensors hold size bytes in all."""
    tokens = size // (2 * LAYERS * KV_HEADS * HEAD_DIM * ITEMSIZE)
    shape = (1, KV_HEADS, tokens, HEAD_DIM)
    spec = TensorSpec("float16", shape)
    layers = [LayerSpec("kv", (spec, spec), trimmable=True, meta={"offset": tokens})] * LAYERS
    # One array, every page touched (np.zeros could leave them unmapped), cut into tensors.
    flat = np.arange(size // ITEMSIZE, dtype=np.uint16).view(np.float16)
    tensors = list(flat.reshape(2 * LAYERS, *shape))
    return tokens, layers, tensors


def best_seconds(run: Callable[[], float], repeat: int) -> float:
    return min(run() for _ in range(repeat))


def memcpy_seconds(tensors: list[np.ndarray], repeat: int) -> float:
    """The fastest of repeat copies of the tensors, back to back, into one buffer whose
    pages exist before the first timed copy."""
    views = [t.data.cast("B") for t in tensors]
    target = memoryview(bytearray(sum(v.nbytes for v in views)))

    def copy() -> float:
        start = time.perf_counter()
        pos = 0
        for view in views:
            target[pos : pos + view.nbytes] = view
            pos += view.nbytes
        return time.perf_counter() - start

    copy()
    return best_seconds(copy, repeat)


def staging_write_seconds(putter: Putter, folder: Path) -> float:
    """The engine's copy alone, without the daemon: plan, a new preallocated file as the
    daemon makes it, write_entry into it (copy, checksums, head)."""
    path = folder / "staging-anchor.tmp"
    start = time.perf_counter()
    plan = plan_entry(IDENTITY, putter.next_tokens(), putter.layers, created=0.0, min_reuse=0)
    fd = create_staging(path, plan.file_size)
    try:
        write_entry(fd, plan, tensor_views(plan, putter.tensors))
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def write_fsync_seconds(tensors: list[np.ndarray], folder: Path) -> float:
    """A new file, written front to back with the tensors' bytes, then fsync: dd conv=fsync."""
    path = folder / "write-fsync-anchor.tmp"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for tensor in tensors:
            view = tensor.data.cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


class Putter:
    """Puts of one entry's tensors, each under fresh tokens (a repeat is not a duplicate)."""

    def __init__(self, client: Client, size: int) -> None:
        self.client = client
        self.tokens, self.layers, self.tensors = build_entry(size)
        self.count = 0
        self.durable: list[float] = []

    def next_tokens(self) -> bytes:
        self.count += 1
        first = self.count * 1_000_000  # disjoint token ranges: no entry is another's prefix
        return pack_tokens(range(first, first + self.tokens))

    def put_seconds(self) -> float:
        prompt = self.next_tokens()
        start = time.perf_counter()
        ticket = self.client.put_entry(IDENTITY, prompt, self.layers, self.tensors)
        answered = time.perf_counter()
        if ticket.state.state != "pending":
            raise RuntimeError(f"the put was not accepted: {ticket.state}")
        state = ticket.wait(SETTLE_SECONDS)
        self.durable.append(time.perf_counter() - answered)
        if state.state != "stored":
            raise RuntimeError(f"the put was not stored: {state}")
        # Its file leaves the page cache: the next put writes into recycled memory, as on a
        # machine in steady state, not into pages the system has never used.
        self.client.evict(all=True)
        return answered - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="leave out the 1 GiB entry")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    args = parser.parse_args()
    sizes = QUICK_SIZES_MIB if args.quick else SIZES_MIB

    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work)) as daemon,
        Client.connect(daemon.socket_path, timeout=60.0, require=True) as client,
    ):
        for mib in sizes:
            putter = Putter(client, mib * MiB)
            memcpy = memcpy_seconds(putter.tensors, args.repeat)
            put = best_seconds(putter.put_seconds, args.repeat)
            staged = best_seconds(partial(staging_write_seconds, putter, daemon.tier), args.repeat)
            durable = min(putter.durable)
            anchor = partial(write_fsync_seconds, putter.tensors, daemon.tier)
            written = best_seconds(anchor, args.repeat)
            rows.append((mib, putter.tokens, memcpy, staged, put, durable, written))
            del putter, anchor  # the tensors go before the next size's are made

    print(f"32 layers × (keys, values), float16 (1, 8, tokens, 128); best of {args.repeat}.\n")
    print(
        "| entry | tokens | memcpy ms (anchor) | staging write alone ms | put ms "
        f"| put / memcpy | goal: put ≤ {GOAL:g}× memcpy | put / staging write "
        "| write+fsync ms (anchor) | to durable ms | durable / write+fsync |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for mib, tokens, memcpy, staged, put, durable, written in rows:
        goal = "met" if put <= GOAL * memcpy else "not met"
        print(
            f"| {mib} MiB | {tokens:,} | {memcpy * 1e3:.1f} | {staged * 1e3:.1f} "
            f"| {put * 1e3:.1f} | {put / memcpy:.2f} | {goal} | {put / staged:.2f} "
            f"| {written * 1e3:.1f} | {durable * 1e3:.1f} | {durable / written:.2f} |"
        )


if __name__ == "__main__":
    main()
