"""What sealing a staging file at commit costs, against a page-cache read of the same file.

At commit the daemon seals each file of the put (kvd/store/sealing.py): on Linux a read lease shows
that no writable descriptor is left (no copy); a client that kept one makes the daemon copy
the file: a reflink (FICLONE) where the file system has them, else copy_file_range, else a
pread/pwrite loop. Then the commit reads the file whole once for its checksums.

    .venv/bin/python bench/seal.py [--sizes 16 256 1024] [--repeat 3] [--dir PATH]

Every file is written just before (in the page cache). Prints a markdown table: per size, the
best time of each way and its ratio to the anchor measured in the same run (a pread of the
whole file into one buffer); a ratio under 1 means faster than that read.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import Slot

from kvd.store import sealing
from kvd.store.entry_files import VERIFY_CHUNK, verify_slots

MiB = 1 << 20


def best_seconds(run: Callable[[], object], repeat: int, after: Callable[[], object]) -> float:
    """The fastest of repeat runs, after() undoing each run's work off the clock."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        after()
    return min(times)


def written(path: Path, size: int) -> None:
    """A file of size random bytes, written now (its pages in the page cache)."""
    piece = os.urandom(16 * MiB)
    with path.open("wb") as file:
        for start in range(0, size, len(piece)):
            file.write(piece[: size - start])


def read_whole(source: Path, buffer: memoryview) -> None:
    """The anchor: the file into one buffer (made beforehand) by pread."""
    size = len(buffer)
    fd = os.open(source, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            done += os.preadv(fd, [buffer[done:]], done)
    finally:
        os.close(fd)


def lease_check(source: Path, target: Path, size: int) -> None:
    sealed = sealing.seal(source, size, target)
    os.close(sealed.fd)
    assert not sealed.copied  # no writer was left: sealed as it is


def copied(source: Path, target: Path, copy: Callable[[int, int], object]) -> None:
    fd = os.open(source, os.O_RDONLY)
    out = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        copy(fd, out)
    finally:
        os.close(fd)
        os.close(out)


def reflinked(fd: int, out: int) -> None:
    if not sealing.reflink(fd, out):
        raise NotImplementedError


def checksums(source: Path, slot: Slot) -> None:
    fd = os.open(source, os.O_RDONLY)
    try:
        verify_slots(fd, "bench", (slot,))
    finally:
        os.close(fd)


def measure(folder: Path, size: int, repeat: int) -> list[tuple[str, float | None]]:
    source, target = folder / "staging", folder / "copy"
    written(source, size)

    def timed(run: Callable[[], object]) -> float:
        return best_seconds(run, repeat, lambda: target.unlink(missing_ok=True))

    buffer = memoryview(bytearray(b"\x01") * size)  # its pages touched: no fault is timed
    rows: list[tuple[str, float | None]] = [
        ("pread of the whole file (anchor)", timed(partial(read_whole, source, buffer)))
    ]
    if sys.platform == "linux":
        rows.append(
            ("seal: lease check, no copy", timed(partial(lease_check, source, target, size)))
        )
        try:
            rows.append(("seal by FICLONE", timed(partial(copied, source, target, reflinked))))
        except NotImplementedError:
            target.unlink(missing_ok=True)
            rows.append(("seal by FICLONE (not on this file system)", None))
        by_range = partial(copied, source, target, partial(_range, size=size))
        rows.append(("seal by copy_file_range", timed(by_range)))
    plain = partial(copied, source, target, partial(_plain, size=size))
    rows.append(("seal by pread/pwrite copy", timed(plain)))
    slot = Slot("uint8", (size,), 0, size, checksum(source.read_bytes()), start=0)
    label = f"checksums in {VERIFY_CHUNK // MiB} MiB preads (every commit)"
    rows.append((label, timed(partial(checksums, source, slot))))
    source.unlink()
    return rows


def _range(fd: int, out: int, size: int) -> None:
    sealing.copy_range(fd, out, size)


def _plain(fd: int, out: int, size: int) -> None:
    sealing.copy_plain(fd, out, size)


def file_system(folder: Path) -> str:
    """The type of the file system folder is on (the longest mount point above it)."""
    mounts = [p for p in psutil.disk_partitions(all=True) if folder.is_relative_to(p.mountpoint)]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024], help="MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="a folder on the file system to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        print(f"{folder} on {file_system(folder)}, {sys.platform}")
        print("| size | way | ms (best) | ratio to anchor |")
        print("|---:|---|---:|---:|")
        for mib in args.sizes:
            rows = measure(folder, mib * MiB, args.repeat)
            anchor = rows[0][1]
            assert anchor is not None
            for name, seconds in rows:
                if seconds is None:
                    print(f"| {mib} MiB | {name} | - | - |")
                else:
                    print(f"| {mib} MiB | {name} | {seconds * 1e3:.2f} | {seconds / anchor:.3f} |")


if __name__ == "__main__":
    main()
