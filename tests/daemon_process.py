"""A real `kvd serve` subprocess on a temporary tier and socket, for end-to-end tests."""

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

import pytest
from kvd_client.calls import DaemonUnavailable
from kvd_client.client import Client

START_SECONDS = 20.0  # bound on waiting for a starting daemon to answer ping
STOP_SECONDS = 30.0


class Daemon:
    """A `kvd serve` subprocess; start() waits until it answers ping."""

    def __init__(self, tier: Path, socket_path: str, log: Path, flags: Sequence[str] = ()) -> None:
        self.tier, self.socket_path, self.log = tier, socket_path, log
        self.flags = list(flags)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "kvd", "serve", "--dir", str(self.tier)]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [*command, "--socket", self.socket_path, "--log-format", "json", *self.flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"kvd serve exited with {self.process.returncode}:\n{self.logs()}")
            try:
                with Client.connect(self.socket_path, timeout=1.0, require=True) as client:
                    client.ping()
                    return
            except DaemonUnavailable:
                time.sleep(0.05)
        pytest.fail(f"kvd serve did not answer ping within {START_SECONDS} s:\n{self.logs()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM and wait; the exit code (0 for a clean stop)."""
        code = 0
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                pytest.fail(f"kvd serve ignored SIGTERM for {STOP_SECONDS} s:\n{self.logs()}")
        elif self.process is not None:
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
def running_daemon(tmp_path: Path, flags: Sequence[str] = ()) -> Iterator[Daemon]:
    # The socket lives in a short /tmp folder: the pytest temp path can outgrow sun_path.
    socket_dir = tempfile.mkdtemp(prefix="kvd-")
    daemon = Daemon(
        tmp_path / "tier", os.path.join(socket_dir, "kvd.sock"), tmp_path / "log", flags
    )
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
