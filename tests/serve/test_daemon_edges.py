"""The daemon at its edges: a second signal, systemd's notify socket, a full disk."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from daemon_e2e import IDENTITY, SETTLE_SECONDS, RawPeer, put_stored, report, staging_files
from daemon_process import Daemon, running_daemon
from kvd_client.client import Client
from kvd_protocol import LayerSpec, TensorSpec
from kvd_protocol import messages as m


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    with running_daemon(tmp_path, ["--shutdown-deadline", "600"]) as daemon:
        process = daemon.process
        assert process is not None
        with RawPeer(daemon.socket_path) as peer:
            # 8 x 64 MiB committed at once: the writer verifies and syncs for seconds here.
            puts = [peer.begin(IDENTITY, [i, *range(4095)], seed=i, width=2048) for i in range(8)]
            peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
            assert all(isinstance(peer.receive(), m.PutCommitReply) for _ in puts)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + SETTLE_SECONDS
        while '"stopping"' not in daemon.logs():  # the first signal is being handled
            assert time.monotonic() < deadline, "the daemon never logged stopping"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        assert process.wait(SETTLE_SECONDS) == 1  # not the 600 s flush deadline
        assert '"exiting_now"' in daemon.logs()
        daemon.process = None


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    folder = tempfile.mkdtemp(prefix="kvd-notify-")
    path = os.path.join(folder, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(SETTLE_SECONDS)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_daemon_tells_systemd_ready_and_stopping(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    socket_dir = tempfile.mkdtemp(prefix="kvd-")
    daemon = Daemon(tmp_path / "tier", os.path.join(socket_dir, "kvd.sock"), tmp_path / "log")
    try:
        daemon.start(env={"NOTIFY_SOCKET": path})
        ready = sock.recv(4096).decode()
        assert "READY=1" in ready.splitlines()
        assert daemon.stop() == 0
        stopping = sock.recv(4096).decode()
        assert "STOPPING=1" in stopping.splitlines()
    finally:
        daemon.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_a_full_disk_refuses_the_put_and_loses_nothing(small_disk: Path) -> None:
    socket_dir = tempfile.mkdtemp(prefix="kvd-")
    flags = ["--min-free", "0", "--max-bytes", "1G"]
    socket_path = os.path.join(socket_dir, "kvd.sock")
    daemon = Daemon(small_disk / "tier", socket_path, small_disk.parent / "log", flags)
    try:
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            kept = put_stored(client, IDENTITY, list(range(1, 65)), seed=1)
            spec = TensorSpec("float32", (1, 8, 4096, 128))  # 16 MiB a tensor, 64 MiB in all
            tensors = [np.zeros(spec.shape, np.float32) for _ in range(4)]
            layers = [LayerSpec("kv", (spec, spec), True)] * 2
            ticket = client.put_entry(IDENTITY, list(range(100, 4196)), layers, tensors)
            state = ticket.wait(SETTLE_SECONDS)
            assert state.state == "failed"
            assert state.reason is not None
            assert "no_space" in state.reason
            # Nothing left behind, the earlier entry intact, the daemon still serving.
            assert staging_files(daemon) == []
            hit = client.lookup(IDENTITY, [*range(1, 65), 7])
            assert hit is not None
            with hit:
                assert [bytes(v) for v in hit.tensors] == [t.tobytes() for t in kept]
            assert report(client)["entries"] == 1
            assert client.ping() >= 0
    finally:
        daemon.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
