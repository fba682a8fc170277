"""What carrying an entry elsewhere costs: `kvctl export` of a 512 MiB entry to a bundle, and
`kvctl import` of it into a second daemon that holds none of its blocks, against a plain copy
of the same bytes on the same disk.

The entry: --tokens tokens of --layers KV layers (keys and values float16, 8 KV heads of
head dim 128: 16 KiB a token, 512 MiB at the defaults), put through Client.put_entry cut
into blocks of 256 tokens, so the bundle holds its manifest and every block. Each run is
in-process (kvctl's main, no interpreter start-up), the page cache hot (the entry was just
written; each import reads the bundle the export just wrote), the median of --repeat after
one warm-up:
- export: lease, read the manifest and every block, write the bundle (checksummed on the way)
  under a temporary name, fsync, rename;
- import: read the bundle, check it, a put into the second daemon (its staging files), its
  commit (the daemon checks every block and tensor), and its ticket stored (the daemon's fsync
  of every file); the daemon's entries are evicted between runs;
- anchors: shutil.copyfile of the bundle, without and with an fsync of the copy.

    .venv/bin/python bench/bundle.py [--tokens 32768] [--layers 4] [--repeat 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _daemon import running_daemon
from kvd_client.client import Client
from kvd_protocol import Identity, LayerSpec, TensorSpec

from kvd.ops import kvctl

MiB = 1 << 20
HEADS, HEAD_DIM = 8, 128
IDENTITY = Identity("bench/bundle", "cfg", "tok", "codecs/1", "mlx/cpu")
FLAGS = ("--max-bytes", "64G")


def _median(runs: int, work: Callable[[], object], between: Callable[[], object]) -> float:
    """The median seconds of work over runs, after one warm-up; between runs after each."""
    times = []
    for run in range(runs + 1):
        started = time.perf_counter()
        work()
        took = time.perf_counter() - started
        between()
        if run:
            times.append(took)
    return statistics.median(times)


def _kvctl(socket: str, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kvctl.main(["--socket", socket, "--timeout", "600", *args])
    if code:
        raise SystemExit(f"kvctl {args[0]} exited {code}: {out.getvalue()}")
    return out.getvalue()


def _put(socket: str, tokens: int, layers: int) -> tuple[str, int]:
    """The entry stored on the daemon: its id and bytes (manifest and blocks)."""
    rng = np.random.default_rng(0)
    shape = (1, HEADS, tokens, HEAD_DIM)
    spec = TensorSpec("float16", shape)
    specs = [LayerSpec("kv", (spec, spec), trimmable=True, blocked=True)] * layers
    tensors = [rng.standard_normal(shape, dtype=np.float32).astype(np.float16)]
    tensors *= 2 * layers  # the same rows in each: the bytes, not their values, are measured
    with Client.connect(socket, require=True, block_tokens=256) as client:
        state = client.put_entry(IDENTITY, list(range(tokens)), specs, tensors).wait(600)
        assert state.state == "stored", state
        (entry,) = client.list_entries(IDENTITY)
        return entry.id, entry.bytes


def _copy(source: Path, target: Path, *, sync: bool) -> None:
    shutil.copyfile(source, target)
    if sync:
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run(folder: Path, tokens: int, layers: int, repeat: int) -> None:
    bundle, copy = folder / "entry.kvdb", folder / "copy.kvdb"
    with running_daemon(folder / "a", FLAGS) as a, running_daemon(folder / "b", FLAGS) as b:
        entry, entry_bytes = _put(a.socket_path, tokens, layers)
        digest = IDENTITY.digest()

        def export() -> None:
            _kvctl(a.socket_path, "export", "--identity", digest, "--entry", entry,
                   "--output", str(bundle))  # fmt: skip

        export_s = _median(repeat, export, lambda: None)
        import_s = _median(
            repeat,
            lambda: _kvctl(b.socket_path, "import", str(bundle)),
            lambda: _kvctl(b.socket_path, "evict", "--all"),
        )
        copy_s = _median(repeat, lambda: _copy(bundle, copy, sync=False), copy.unlink)
        synced_s = _median(repeat, lambda: _copy(bundle, copy, sync=True), copy.unlink)
    size = bundle.stat().st_size
    print(f"entry: {tokens} tokens, {layers} layers, {entry_bytes / MiB:.1f} MiB on disk "
          f"(manifest and blocks); bundle {size / MiB:.1f} MiB "
          f"(+{size - entry_bytes} bytes: {(size - entry_bytes) / entry_bytes:.5%})")  # fmt: skip
    print(f"{'step':<28}{'seconds':>9}{'GB/s':>8}{'x copy':>8}{'x copy+fsync':>14}")
    for name, seconds in (
        ("export (kvctl export)", export_s),
        ("import (kvctl import)", import_s),
        ("copy (shutil.copyfile)", copy_s),
        ("copy + fsync", synced_s),
    ):
        print(
            f"{name:<28}{seconds:>9.3f}{size / seconds / 1e9:>8.2f}"
            f"{seconds / copy_s:>8.2f}{seconds / synced_s:>14.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where the tiers and the bundle go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        run(Path(folder), args.tokens, args.layers, args.repeat)


if __name__ == "__main__":
    main()
