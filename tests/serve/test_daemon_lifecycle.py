"""Stopping, restarting and refusing to start twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from daemon_e2e import (
    IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    files_on_disk,
    looked_up_tokens,
    put_stored,
    report,
    staging_files,
)
from daemon_process import Daemon
from kvd_client.client import Client
from kvd_protocol import messages as m

BIG_WIDTH = 256  # 2 MiB entries: the writer is still busy when SIGTERM comes


def _serve(tier: Path, socket_path: str) -> subprocess.CompletedProcess[str]:
    """A second `kvd serve`, expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--dir", str(tier), "--socket", socket_path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_sigterm_flushes_pending_puts_and_exits_0(daemon: Daemon) -> None:
    tokens = [[first, *range(511)] for first in range(8)]
    with RawPeer(daemon.socket_path) as peer:
        puts = [peer.begin(IDENTITY, t, seed=i, width=BIG_WIDTH) for i, t in enumerate(tokens)]
        peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
        assert all(isinstance(peer.receive(), m.PutCommitReply) for _ in puts)
        assert daemon.stop() == 0
    flushed = [json.loads(line) for line in daemon.logs().splitlines() if '"flushed"' in line]
    assert [(f["durable"], f["pending"]) for f in flushed] == [(True, 0)]
    daemon.start()
    with Client.connect(daemon.socket_path, require=True) as client:
        for t in tokens:
            assert looked_up_tokens(client, IDENTITY, [*t, 1]) == len(t)
        after = report(client)
        assert after["entries"] == len(tokens)
        assert (after["entries"], after["bytes"]) == files_on_disk(daemon)
    assert staging_files(daemon) == []


def test_a_second_daemon_on_the_same_socket_refuses_to_start(
    daemon: Daemon, tmp_path: Path
) -> None:
    second = _serve(tmp_path / "other-tier", daemon.socket_path)
    assert second.returncode == 1
    assert "another kvd is already serving" in second.stdout + second.stderr
    with Client.connect(daemon.socket_path, require=True) as client:
        client.ping()  # the first daemon's socket is untouched


def test_a_second_daemon_on_the_same_directory_refuses_to_start(
    daemon: Daemon, tmp_path: Path
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, range(32), seed=1)
        assert client.flush(SETTLE_SECONDS)
        second = _serve(daemon.tier, str(tmp_path / "second.sock"))
        assert second.returncode == 1
        assert "another kvd is using the tier directory" in second.stdout + second.stderr
        assert report(client)["entries"] == 1
        assert looked_up_tokens(client, IDENTITY, [*range(32), 1]) == 32
    assert files_on_disk(daemon)[0] == 1


def test_a_stale_socket_of_a_killed_daemon_is_replaced(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, range(32), seed=1)
        assert client.flush(SETTLE_SECONDS)
    daemon.kill()
    assert Path(daemon.socket_path).exists()
    daemon.start()
    with Client.connect(daemon.socket_path, require=True) as client:
        assert looked_up_tokens(client, IDENTITY, [*range(32), 1]) == 32
