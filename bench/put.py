"""Put cost: on the engine's side against memcpy, on the daemon's side against write + fsync.

An entry is 32 layers of keys and values in float16, shaped (1, 8, tokens, 128) as in an
8-KV-head, 128-dim model, with the token count chosen to give each size. Each size is put in
both formats, against a real `kvd serve` on a tier in --dir:

- whole: version 1, one file (a client made with block_tokens=0);
- blocks: version 2, the default path (block_tokens=256): the tokens cut into 256-token block
  files, written several at once, and a manifest. An entry of fewer tokens than one block
  (16 MiB here: 128 tokens) is stored whole on the default path too: no blocks row.

Two measurements per put:

- engine side: from the put_entry call to the commit answer (plan, put_begin, [put_blocks],
  one copy of every tensor into the daemon's staging files, checksummed on the way, the
  heads, commit: the daemon seals the files and checks every checksum before it answers,
  a put's blocks mostly while later ones are written). Anchor: a memcpy of the same tensors
  into a preallocated buffer (memoryview slice assignment), in the same run. Goal: put
  within 1.5× memcpy. To tell the daemon's part from the file system's, the same writes
  without the daemon are also timed ("staging write alone": plan, new preallocated files,
  kvd_client's writers into them), each right after a put; goal: put within 1.5× of that,
  as the median of the pairs' ratios (each pair shares its moment's load).
- daemon side: from the commit answer to the ticket answering stored (the writer syncs,
  renames into place, syncs the folder). Anchor: a dd-style write of
  the same bytes to a new file in the tier's directory, then fsync, in the same run.

Each put waits for its ticket before the next, so the writer never runs under a timed put,
and its entry is evicted once stored, so the next put writes into recycled page-cache memory
(a machine in steady state) rather than into pages the system never used (on a virtual
machine whose host backs memory on first touch, those cost several times more).
The fastest of --repeat runs is printed, with the CPU time of the process over that put
(more than the wall time where the block files were written on several threads). 1 GiB
puts need about 4 GiB of memory (the tensors, the memcpy target, the page cache of the
file); --quick leaves them out.

    .venv/bin/python bench/put.py [--quick | --sizes MIB ...] [--formats whole blocks]
        [--repeat 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from _daemon import running_daemon
from kvd_client.block_io import BlockWriter
from kvd_client.client import Client
from kvd_client.entry_io import tensor_views, views_of, write_entry
from kvd_client.workers import Descriptors
from kvd_protocol.blocks import BLOCK_TOKENS
from kvd_protocol.entry import LayerSpec, TensorSpec, plan_entry, plan_manifest
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

from kvd.store.entry_files import create_staging

MiB = 1 << 20
IDENTITY = Identity("bench/put", "cfg", "tok", "codecs/1", "mlx/cpu")
LAYERS = 32
KV_HEADS, HEAD_DIM, ITEMSIZE = 8, 128, 2  # float16
SIZES_MIB = (16, 256, 1024)
QUICK_SIZES_MIB = (16, 256)
FORMATS = {"whole": 0, "blocks": BLOCK_TOKENS}  # the client's block_tokens for each
GOAL = 1.5  # put within this many times memcpy, and within this many times the staging write
SETTLE_SECONDS = 600.0

Timing = tuple[float, float]  # (wall, CPU) seconds
Entry = tuple[int, list[LayerSpec], list[np.ndarray]]  # tokens, layers, tensors


def build_entry(size: int) -> Entry:
    """(tokens, layers, tensors) of an entry whose tensors hold size bytes in all."""
    tokens = size // (2 * LAYERS * KV_HEADS * HEAD_DIM * ITEMSIZE)
    shape = (1, KV_HEADS, tokens, HEAD_DIM)
    spec = TensorSpec("float16", shape)
    meta = {"offset": tokens}
    layers = [LayerSpec("kv", (spec, spec), trimmable=True, meta=meta, blocked=True)] * LAYERS
    # One array, every page touched (np.zeros could leave them unmapped), cut into tensors.
    flat = np.arange(size // ITEMSIZE, dtype=np.uint16).view(np.float16)
    tensors = list(flat.reshape(2 * LAYERS, *shape))
    return tokens, layers, tensors


def best(run: Callable[[], Timing], repeat: int) -> Timing:
    return min(run() for _ in range(repeat))


def in_turn(
    first: Callable[[], Timing], second: Callable[[], Timing], repeat: int
) -> tuple[list[Timing], list[Timing]]:
    """first and second run in turn, repeat times each: a pair shares the machine's load of
    its moment, so the ratio of a pair holds where their times drift."""
    pairs = [(first(), second()) for _ in range(repeat)]
    return [pair[0] for pair in pairs], [pair[1] for pair in pairs]


def timed(run: Callable[[], object]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def memcpy_seconds(tensors: list[np.ndarray], repeat: int) -> float:
    """The fastest of repeat copies of the tensors, back to back, into one buffer whose
    pages exist before the first timed copy."""
    views = [t.data.cast("B") for t in tensors]
    target = memoryview(bytearray(sum(v.nbytes for v in views)))

    def copy() -> Timing:
        start = time.perf_counter()
        pos = 0
        for view in views:
            target[pos : pos + view.nbytes] = view
            pos += view.nbytes
        return time.perf_counter() - start, 0.0

    copy()
    return best(copy, repeat)[0]


def staging_write(putter: Putter, folder: Path) -> Timing:
    """The engine's writes alone, without the daemon: plan, new preallocated files as the
    daemon makes them, kvd_client's writers into them (copy, checksums, heads)."""
    paths: list[Path] = []

    def staging(size: int) -> int:
        paths.append(folder / f"staging-anchor-{len(paths)}.tmp")
        return create_staging(paths[-1], size)

    fds: list[int] = []

    def write() -> None:
        tokens = putter.next_tokens()
        if putter.blocked:
            manifest = plan_manifest(
                IDENTITY, tokens, putter.layers, block_tokens=BLOCK_TOKENS, created=0, min_reuse=0
            )
            whole = [tensor for layer in putter.layers for tensor in layer.tensors]
            writer = BlockWriter(manifest, views_of(whole, putter.tensors))
            with Descriptors([staging(manifest.block_size) for _ in manifest.hashes]) as blocks:
                writer.write_blocks(0, blocks)
            fds.append(staging(manifest.entry.file_size))
            writer.write_manifest(fds[-1])
        else:
            plan = plan_entry(IDENTITY, tokens, putter.layers, created=0.0, min_reuse=0)
            fds.append(staging(plan.file_size))
            write_entry(fds[-1], plan, tensor_views(plan, putter.tensors))

    try:
        return timed(write)
    finally:
        for fd in fds:
            os.close(fd)
        for path in paths:
            path.unlink()


def write_fsync_seconds(tensors: list[np.ndarray], folder: Path) -> Timing:
    """A new file, written front to back with the tensors' bytes, then fsync: dd conv=fsync."""
    path = folder / "write-fsync-anchor.tmp"

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for tensor in tensors:
                view = tensor.data.cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        return timed(write)
    finally:
        path.unlink()


class Putter:
    """Puts of one entry's tensors, each under fresh tokens (a repeat is not a duplicate)."""

    def __init__(self, client: Client, block_tokens: int, entry: Entry) -> None:
        self.client = client
        self.tokens, self.layers, self.tensors = entry
        # put_entry's rule, for these layers (all blocked): a block of tokens at least.
        self.blocked = 0 < block_tokens <= self.tokens
        self.count = 0
        self.durable: list[float] = []

    def next_tokens(self) -> bytes:
        self.count += 1
        first = self.count * 1_000_000  # disjoint token ranges: no entry is another's prefix
        return pack_tokens(range(first, first + self.tokens))

    def put(self) -> Timing:
        prompt = self.next_tokens()
        took = timed(lambda: self._answered(prompt))
        state = self.ticket.wait(SETTLE_SECONDS)
        self.durable.append(time.perf_counter() - self.answered)
        if state.state != "stored":
            raise RuntimeError(f"the put was not stored: {state}")
        # Its files leave the page cache: the next put writes into recycled memory, as on a
        # machine in steady state, not into pages the system has never used.
        self.client.evict(all=True)
        return took

    def _answered(self, prompt: bytes) -> None:
        self.ticket = self.client.put_entry(IDENTITY, prompt, self.layers, self.tensors)
        self.answered = time.perf_counter()
        if self.ticket.state.state != "pending":
            raise RuntimeError(f"the put was not accepted: {self.ticket.state}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="leave out the 1 GiB entry")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the tier goes (default: a temp dir)")
    parser.add_argument("--sizes", type=int, nargs="+", help="entry sizes in MiB (not --quick)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    args = parser.parse_args()
    sizes = args.sizes or (QUICK_SIZES_MIB if args.quick else SIZES_MIB)

    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.dir) as work,
        running_daemon(Path(work)) as daemon,
    ):
        clients = {
            name: Client.connect(
                daemon.socket_path, timeout=60.0, require=True, block_tokens=block_tokens
            )
            for name, block_tokens in FORMATS.items()
        }
        for mib in sizes:
            entry = build_entry(mib * MiB)
            memcpy = memcpy_seconds(entry[2], args.repeat)
            anchor = partial(write_fsync_seconds, entry[2], daemon.tier)
            written = best(anchor, args.repeat)[0]
            for name in args.formats:
                block_tokens = FORMATS[name]
                putter = Putter(clients[name], block_tokens, entry)
                if name != "whole" and not putter.blocked:
                    continue  # fewer tokens than a block: the default path stores it whole
                puts, stagings = in_turn(
                    putter.put, partial(staging_write, putter, daemon.tier), args.repeat
                )
                ratio = statistics.median(p[0] / w[0] for p, w in zip(puts, stagings, strict=True))
                put, staged, durable = min(puts), min(stagings), min(putter.durable)
                rows.append((mib, name, entry[0], memcpy, staged, put, ratio, durable, written))
            del entry, anchor, putter  # the tensors go before the next size's are made
        for client in clients.values():
            client.close()

    print(
        f"32 layers × (keys, values), float16 (1, 8, tokens, 128); best of {args.repeat}; "
        "put / staging write: the median of the pairs' ratios.\n"
    )
    print(
        "| entry | format | tokens | memcpy ms (anchor) | staging write alone ms | put ms "
        f"(CPU ms) | put / memcpy | goal: put ≤ {GOAL:g}× memcpy | put / staging write "
        f"| goal: put ≤ {GOAL:g}× staging write | write+fsync ms (anchor) | to durable ms "
        "| durable / write+fsync |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|")
    for mib, name, tokens, memcpy, staged, put, ratio, durable, written in rows:
        goal = "met" if put[0] <= GOAL * memcpy else "not met"
        staged_goal = "met" if ratio <= GOAL else "not met"
        print(
            f"| {mib} MiB | {name} | {tokens:,} | {memcpy * 1e3:.1f} | {staged[0] * 1e3:.1f} "
            f"| {put[0] * 1e3:.1f} ({put[1] * 1e3:.1f}) | {put[0] / memcpy:.2f} | {goal} "
            f"| {ratio:.2f} | {staged_goal} | {written * 1e3:.1f} "
            f"| {durable * 1e3:.1f} | {durable / written:.2f} |"
        )


if __name__ == "__main__":
    main()
