"""A `kvd serve` subprocess for the benchmarks: start it (timing the start), stop it.

Shared by bench/roundtrip.py, bench/put.py and bench/startup.py; not a benchmark itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvd_client.calls import DaemonUnavailable
from kvd_client.client import Client

START_SECONDS = 600.0  # bound on a start: a full scan of 100k entries may take minutes
STOP_SECONDS = 60.0
POLL_SECONDS = 0.002  # between connect attempts while starting: the error on a start time


class DaemonProcessError(RuntimeError):
    """The daemon exited, or did not answer, while the benchmark needed it."""


class Daemon:
    """A `kvd serve` subprocess on tier and socket_path; logs (JSON) go to log."""

    def __init__(self, tier: Path, socket_path: str, log: Path, flags: Sequence[str] = ()) -> None:
        self.tier, self.socket_path, self.log = tier, socket_path, log
        self.flags = list(flags)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Spawn the daemon and wait for its first ping answer; the seconds that took."""
        command = [sys.executable, "-m", "kvd", "serve", "--dir", str(self.tier)]
        command += ["--socket", self.socket_path, "--log-format", "json", *self.flags]
        with self.log.open("ab") as log:
            started = time.perf_counter()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while time.perf_counter() - started < START_SECONDS:
            if self.process.poll() is not None:
                raise DaemonProcessError(
                    f"kvd serve exited with {self.process.returncode}:\n{self.logs()}"
                )
            if os.path.exists(self.socket_path):  # cheaper than a failing connect
                try:
                    with Client.connect(self.socket_path, timeout=5.0, require=True) as client:
                        client.ping()
                        return time.perf_counter() - started
                except DaemonUnavailable:
                    pass
            time.sleep(POLL_SECONDS)
        self.kill()
        raise DaemonProcessError(f"kvd serve did not answer ping within {START_SECONDS} s")

    def stop(self) -> None:
        """SIGTERM (the daemon flushes, then exits) and wait."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()
                raise DaemonProcessError(
                    f"kvd serve ignored SIGTERM for {STOP_SECONDS} s"
                ) from None
        self.process = None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def socket_folder() -> Iterator[str]:
    """A short private folder in /tmp for a Unix socket (sun_path holds about 100 bytes)."""
    folder = tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def running_daemon(tier: Path, flags: Sequence[str] = ()) -> Iterator[Daemon]:
    """A started daemon on tier (created if needed), its log beside the tier; stopped after."""
    with socket_folder() as folder:
        log = tier.parent / f"{tier.name}.log"
        daemon = Daemon(tier, os.path.join(folder, "kvd.sock"), log, flags)
        daemon.start()
        try:
            yield daemon
        finally:
            daemon.stop()
