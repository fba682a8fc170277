"""A full header scan at start-up counts on a terminal, and stays quiet off one."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon_e2e import IDENTITY, put_stored
from daemon_process import isolated_environment, running_daemon, socket_folder
from kvd_client.client import Client
from kvd_protocol.limits import DEFAULT_LIMITS

from kvd.store import recovery, snapshot
from kvd.store.tier_dir import TierDir


def _tier_of_three(tmp_path: Path) -> Path:
    with (
        running_daemon(tmp_path / "first") as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        for first in (1, 2, 3):
            put_stored(client, IDENTITY, [first, 5, 6], seed=first)
    tier = tmp_path / "first" / "tier"
    (tier / "index.snapshot").unlink()  # every header must be read again
    return tier


def test_the_scan_reports_each_header_it_reads(tmp_path: Path) -> None:
    tier = _tier_of_three(tmp_path)
    counted: list[None] = []
    listed = recovery.list_against(
        TierDir(tier), DEFAULT_LIMITS, snapshot.EMPTY, lambda: counted.append(None)
    )
    assert (len(listed.found), len(counted)) == (3, 3)


def test_a_daemon_on_a_terminal_counts_the_headers_it_reads(tmp_path: Path) -> None:
    tier = _tier_of_three(tmp_path)
    terminal, its_end = pty.openpty()
    with socket_folder() as sockets:
        command = [sys.executable, "-m", "kvd", "serve", "--dir", str(tier)]
        command += ["--socket", os.path.join(sockets, "kvd.sock"), "--log-format", "json"]
        home = tmp_path / "home"
        home.mkdir()
        daemon = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=its_end,
            stderr=its_end,
            env=isolated_environment(home),
        )
        os.close(its_end)
        shown = b""
        deadline = time.monotonic() + 30
        try:
            while b'"serving"' not in shown and time.monotonic() < deadline:
                ready, _, _ = select.select([terminal], [], [], 0.5)
                if ready:
                    shown += os.read(terminal, 1 << 16)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
            os.close(terminal)
    assert b"reading entry headers: 3" in shown
