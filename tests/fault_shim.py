"""The fault shim (fault_shim.c) from Python: built with the system's C compiler, preloaded
into a daemon, steered and read through a shared control file while the daemon runs."""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

OPS = ("open", "read", "write", "pread", "pwrite", "fsync", "rename", "mkdir", "fallocate")
ERRNOS = ("EIO", "ENOSPC")
# struct control: enabled, per_million[OPS], calls[OPS], injected[OPS][ERRNOS], skip_faults,
# max_faults, synced_after_failure, placed_after_failure
CONTROL = struct.Struct(f"=i{len(OPS)}i{len(OPS)}q{len(OPS) * len(ERRNOS)}q4q")
COUNTS_AT = 1 + len(OPS)  # the first count among the unpacked values
INJECTED_AT = COUNTS_AT + len(OPS)
SKIP_FAULTS_AT = INJECTED_AT + len(OPS) * len(ERRNOS)
SOURCE = Path(__file__).with_name("fault_shim.c")


class FaultShimError(RuntimeError):
    """No C compiler, or the shim does not build here: the reason says which."""


def build(folder: Path, source: Path = SOURCE) -> Path:
    """Compile the shim (or another preloaded library's source) into folder; its path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FaultShimError("no C compiler (cc or gcc) to build the fault shim")
    library = folder / f"{source.stem}.so"
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        raise FaultShimError(f"the fault shim does not build: {built.stderr.strip()}")
    return library


def built_or_skip(folder: Path, source: Path, what: str) -> Path:
    """build, for a test fixture: the test named by what skips, saying why, off Linux (the
    shims are preloaded with LD_PRELOAD) or where the shim does not build."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"{what} NOT RUN: the LD_PRELOAD shim is for Linux")
    try:
        return build(folder, source)
    except FaultShimError as exc:
        pytest.skip(f"{what} NOT RUN: {exc}")


class Faults:
    """The control file of one preloaded process: turn faults on and off, read the counts."""

    def __init__(self, folder: Path, library: Path, root: Path) -> None:
        self.library, self.root = library, Path(os.path.realpath(root))
        self.path = folder / "fault_control"
        self.path.write_bytes(bytes(CONTROL.size))
        with self.path.open("r+b") as file:
            self._mapped = mmap.mmap(file.fileno(), CONTROL.size)

    def environment(self) -> dict[str, str]:
        """What the daemon's environment needs for the shim to act on root."""
        return {
            "LD_PRELOAD": str(self.library),
            "FAULT_SHIM_ROOT": str(self.root),
            "FAULT_SHIM_CONTROL": str(self.path),
        }

    def enable(
        self,
        probability: float,
        rarer_calls: dict[str, float] | None = None,
        *,
        skip_faults: int = 0,
        max_faults: int = 0,
    ) -> None:
        """Fail each call with probability; those in rarer_calls (by name) with theirs (a
        call made a few times in a run needs a higher one to fail at all); the first
        skip_faults faults drawn passed over, then no more than max_faults (0: no limit)."""
        chances = {op: probability for op in OPS} | (rarer_calls or {})
        per_million = [round(chances[op] * 1_000_000) for op in OPS]
        struct.pack_into("=2q", self._mapped, CONTROL.size - 4 * 8, skip_faults, max_faults)
        struct.pack_into(f"=i{len(OPS)}i", self._mapped, 0, 1, *per_million)

    def disable(self) -> None:
        struct.pack_into("=i", self._mapped, 0, 0)

    def calls(self) -> dict[str, int]:
        """Calls that could have failed (under root, while enabled), by function."""
        values = CONTROL.unpack_from(self._mapped)
        return dict(zip(OPS, values[COUNTS_AT : COUNTS_AT + len(OPS)], strict=True))

    def injected(self) -> dict[tuple[str, str], int]:
        """Faults injected, by function and errno."""
        values = CONTROL.unpack_from(self._mapped)[INJECTED_AT:SKIP_FAULTS_AT]
        keys = [(op, errno) for op in OPS for errno in ERRNOS]
        return dict(zip(keys, values, strict=True))

    def durable_after_failure(self) -> dict[str, int]:
        """How often a file whose fsync failed was then taken for durable: synced again with
        success ("synced"), or renamed into the tier's entries folder ("placed")."""
        synced, placed = CONTROL.unpack_from(self._mapped)[SKIP_FAULTS_AT + 2 :]
        return {"synced": synced, "placed": placed}

    def close(self) -> None:
        self._mapped.close()
