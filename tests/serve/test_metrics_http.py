"""`kvd serve --metrics-port N`: GET /metrics on 127.0.0.1 only, from a real daemon."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from pathlib import Path

import psutil
from daemon_process import Daemon, isolated_environment, kvctl, running_daemon
from prometheus_client.parser import text_string_to_metric_families
from test_kvctl import put_one

from kvd.serve.metrics import exposition


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read().decode()
    finally:
        connection.close()


def test_metrics_port_serves_the_status_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    with running_daemon(tmp_path, ["--metrics-port", str(port)]) as daemon:
        put_one(daemon, 32)
        code, content_type, body = get(port, "/metrics")
        status = json.loads(kvctl(daemon, "status", "--json").stdout)
        assert code == 200
        assert content_type.startswith("text/plain; version=0.0.4")
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
            if not s.labels
        }
        assert samples["kvd_entries"] == status["entries"] == 1
        assert samples["kvd_bytes"] == status["bytes"] > 0
        assert samples["kvd_writeback_stored_total"] == status["writeback"]["stored"]

        assert get(port, "/")[0] == 404
        assert get(port, "/metrics", "POST")[0] == 405
        head = get(port, "/metrics", "HEAD")
        assert (head[0], head[2]) == (200, "")
        listening = [
            c.laddr
            for c in psutil.Process(daemon.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening == [("127.0.0.1", port)]
        assert kvctl(daemon, "ping").returncode == 0  # the scrapes left the daemon serving


def test_no_metrics_port_by_default(daemon: Daemon) -> None:
    listening = psutil.Process(daemon.pid).net_connections(kind="inet")
    assert listening == []


def test_a_taken_metrics_port_stops_the_start_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        home = tmp_path / "home"
        home.mkdir()
        result = subprocess.run(
            [
                *(sys.executable, "-m", "kvd", "serve", "--dir", str(tmp_path / "tier")),
                *("--socket", str(tmp_path / "kvd.sock"), "--log-format", "json"),
                *("--metrics-port", str(port)),
            ],
            env=isolated_environment(home),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1, result.stderr
    logged = result.stdout + result.stderr
    (event,) = [json.loads(line) for line in logged.splitlines() if "not_started" in line]
    assert event["reason"].startswith(f"cannot listen on 127.0.0.1:{port} for metrics:")
    assert not (tmp_path / "kvd.sock").exists()


def test_a_bad_metrics_port_is_a_configuration_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--metrics-port", "70000"],
        env=isolated_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "flag --metrics-port: metrics_port: a TCP port is at most 65535" in result.stderr


def test_figures_an_older_daemon_lacks_are_left_out() -> None:
    """A status without telemetry: no per-identity latency or misses, no zeros made up."""
    status = {
        "entries": 2,
        "bytes": 10,
        "identities": [{"identity": "abc", "entries": 2, "bytes": 10}],
        "writeback": {"stored": 1},
        "daemon": {"version": "0.1.0"},
    }
    names = {
        (family.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(exposition(lambda: status).decode())
        for s in family.samples
    }
    assert names == {
        ("kvd_entries", (), 2),
        ("kvd_bytes", (), 10),
        ("kvd_writeback_stored", (), 1),
        ("kvd_identity_entries", (("identity", "abc"),), 2),
        ("kvd_identity_bytes", (("identity", "abc"),), 10),
        ("kvd_info", (("version", "0.1.0"),), 1),
    }
