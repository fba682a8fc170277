"""A real `kvd serve` subprocess on a tier and socket of its own: the end-to-end tests' and
the benchmarks' one way to run the daemon (bench/_daemon.py puts this folder on the path)."""

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

START_SECONDS = 20.0  # bound on waiting for a starting daemon to answer ping
STOP_SECONDS = 30.0
POLL_SECONDS = 0.002  # between connect attempts while starting: the error on a start time


class DaemonProcessError(RuntimeError):
    """The daemon exited, did not answer, or ignored SIGTERM; the message holds its log."""


class Daemon:
    """A `kvd serve` subprocess; start() waits until it answers ping."""

    def __init__(self, tier: Path, socket_path: str, log: Path, flags: Sequence[str] = ()) -> None:
        self.tier, self.socket_path, self.log = tier, socket_path, log
        self.flags = list(flags)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None, timeout: float = START_SECONDS) -> float:
        """Spawn the daemon and wait for its first ping answer; the seconds that took."""
        command = [sys.executable, "-m", "kvd", "serve", "--dir", str(self.tier)]
        command += ["--socket", self.socket_path, "--log-format", "json", *self.flags]
        with self.log.open("ab") as log:
            started = time.perf_counter()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        while time.perf_counter() - started < timeout:
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
        raise DaemonProcessError(
            f"kvd serve did not answer ping within {timeout} s:\n{self.logs()}"
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM (the daemon flushes, then exits) and wait; the exit code (0: clean)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()
                raise DaemonProcessError(
                    f"kvd serve ignored SIGTERM for {STOP_SECONDS} s:\n{self.logs()}"
                ) from None
        code = self.process.returncode
        self.process = None
        return code

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def socket_folder() -> Iterator[str]:
    """A short private folder in /tmp for a Unix socket (sun_path holds about 100 bytes; a
    pytest or benchmark temp path can outgrow it)."""
    folder = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def running_daemon(folder: Path, flags: Sequence[str] = ()) -> Iterator[Daemon]:
    """A started daemon with its tier and log in folder; stopped after."""
    with socket_folder() as sockets:
        daemon = Daemon(folder / "tier", os.path.join(sockets, "kvd.sock"), folder / "log", flags)
        daemon.start()
        try:
            yield daemon
        finally:
            daemon.stop()
