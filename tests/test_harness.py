"""The daemon harness holds each daemon to a clean run in an environment of its own."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from daemon_e2e import IDENTITY, RawPeer, report
from daemon_process import DaemonProcessError, running_daemon
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode
from kvd_protocol.tokens import pack_tokens


def test_the_daemon_ignores_the_tests_kvd_variables_and_home_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".config" / "kvd").mkdir(parents=True)
    (home / ".config" / "kvd" / "kvd.toml").write_text("max_bytes = 4096\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("KVD_MAX_BYTES", "8192")
    monkeypatch.setenv("KVD_WRITEBACK_POLICY", "refuse")
    with running_daemon(tmp_path) as daemon, Client.connect(daemon.socket_path) as client:
        status = report(client)
    assert status["max_bytes"] == 64 << 30  # the default, from neither source
    assert status["writeback"]["policy"] == "drop-oldest"


def _provoke_request_failed(socket_path: str, tier: Path) -> None:
    """A staging folder that became a file: put_begin fails inside the daemon."""
    shutil.rmtree(tier / "staging")
    (tier / "staging").write_bytes(b"")
    with RawPeer(socket_path) as peer:
        request = m.PutBegin(
            id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(range(8)), size=1 << 16
        )
        reply = peer.call(request)
    assert isinstance(reply, m.ErrorReply)
    assert reply.code is ErrorCode.INTERNAL


def test_an_error_the_test_did_not_declare_fails_the_check(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        _provoke_request_failed(daemon.socket_path, daemon.tier)
        daemon.stop()
        with pytest.raises(DaemonProcessError, match="request_failed"):
            daemon.check()
        daemon.expect_errors("request_failed")
        daemon.check()  # declared: the same log passes


def test_a_daemon_that_died_by_itself_fails_the_check(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait()
        assert daemon.stop() == -signal.SIGKILL
        with pytest.raises(DaemonProcessError, match=f"exited with {-signal.SIGKILL}"):
            daemon.check()
        daemon.bad_exits.clear()  # this test's own doing
