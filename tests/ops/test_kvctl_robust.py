"""kvctl never shows a traceback, against a real daemon: every sub-command given bad values
(negative, zero, non-numeric, huge, empty, unknown), its output closed before it writes
(`kvctl list | head -1`), and Ctrl-C during --watch and during a call the daemon does not
answer. Each ends with a one-line reason (or none, for a pipe or Ctrl-C) and its exit status."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import psutil
import pytest
from daemon_e2e import IDENTITY, SETTLE_SECONDS, put_stored, wait_until
from daemon_process import Daemon, kvctl, socket_folder
from kvd_client import Client

INTERRUPTED = 130
PIPE_CLOSED = 141
NO_DAEMON = 3
WEEK = str(7 * 86400)

# (arguments, exit status): values no sub-command takes.
BAD_VALUES: list[tuple[Sequence[str], int]] = [
    *(
        (["status", "--watch", "--interval", value], 2)
        for value in ("-1", "0", "abc", "nan", "inf", "1e300", "")
    ),
    (["status", "--watch", "--count", "-1"], 2),
    (["status", "--count", "many"], 2),
    *((["--timeout", value, "status"], 2) for value in ("0", "-5", "x", "1e300")),
    *((["flush", "--wait", value], 2) for value in ("-1", "nan", "1e300", "soon")),
    (["list", "--sort", "size"], 2),
    (["list", "--identity", ""], 2),
    (["list", "--identity", "mistral-7b"], 2),
    (["list", "--identity", "x" * 100_000], 2),
    (["verify", "--identity", ""], 2),
    (["evict", "--identity", "ffff"], 2),
    (["evict", "--entry", ""], 1),
    (["evict", "--entry", "f" * 32], 1),
    (["evict", "--entry", "x" * 100_000], 1),
    (["evict", "--entry", "\udcff"], 2),  # a byte not UTF-8 in argv: no message carries it
    (["evict"], 2),
    (["show", ""], 2),
    (["show", "not-hex"], 2),
    (["show", "0" * 33], 2),
    (["show", "f" * 32], 1),
    (["show", "x" * 100_000], 2),
    (["metrics", "extra"], 2),
    (["--socket", "", "status"], 2),
    (["--config", "/nonexistent/kvd.toml", "status"], 2),
    (["doctor", "--dir", ""], 2),
    (["service", "install", "--metrics-port", "-1", "--dry-run"], 2),
    (["service", "install", "--metrics-port", "70000", "--dry-run"], 2),
    (["service", "restart"], 2),
    (["nonsense"], 2),
]


def _kvctl(
    *args: str, stdout: int = subprocess.PIPE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvctl ARGS` in a process of its own, its stderr (and by default stdout) captured."""
    return subprocess.run(
        [sys.executable, "-m", "kvd.ops.kvctl", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def _run(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """kvctl on the daemon's socket unless args name another (--socket comes first)."""
    return _kvctl(*args) if args and args[0] == "--socket" else kvctl(daemon, *args)


def _quiet(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert "Error:" not in result.stderr.replace("kvctl: error:", ""), result.stderr


@pytest.fixture
def stocked(daemon: Daemon) -> Daemon:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, range(32), seed=1)
    return daemon


def test_bad_values_end_with_a_reason_and_no_traceback(stocked: Daemon) -> None:
    for args, status in BAD_VALUES:
        result = _run(stocked, *args)
        _quiet(result)
        assert (result.returncode, bool(result.stderr.strip())) == (status, True), (args, result)
    # The bounds themselves are taken.
    most = kvctl(stocked, "status", "--watch", "--interval", WEEK, "--count", "1")
    assert most.returncode == 0, most.stderr
    assert kvctl(stocked, "flush", "--wait", "0").returncode == 0


def test_help_shows_defaults_and_exit_codes(daemon: Daemon) -> None:
    for command in ("status", "flush", "list", "show", "evict", "verify", "metrics"):
        shown = kvctl(daemon, command, "--help")
        assert shown.returncode == 0
        assert "exit status:\n  0    done\n  1    " in shown.stdout
        assert "  3    no daemon answers on the socket\n" in shown.stdout
    for words in (["doctor"], ["service", "install"], ["service", "status"]):
        shown = kvctl(daemon, *words, "--help")
        assert shown.returncode == 0
        assert "exit status:\n  0    " in shown.stdout
    assert "(default: 2.0)" in kvctl(daemon, "status", "--help").stdout
    assert "(default: used)" in kvctl(daemon, "list", "--help").stdout


def test_no_daemon_names_the_socket_and_how_to_start_one(tmp_path: os.PathLike[str]) -> None:
    socket_path = os.path.join(tmp_path, "kvd.sock")
    result = _kvctl("list", env={**os.environ, "KVD_SOCKET": socket_path})
    _quiet(result)
    assert result.returncode == NO_DAEMON
    assert f"no kvd answers on {socket_path} (from KVD_SOCKET)" in result.stderr
    for way in ("kvd serve", "make run", "--socket", "KVD_SOCKET"):
        assert way in result.stderr


def _status_against(
    answer: Callable[[socket.socket], None],
) -> tuple[str, subprocess.CompletedProcess[str]]:
    """`kvctl status` on a socket whose listener answers its connection with answer."""
    with socket_folder() as folder:
        path = os.path.join(folder, "kvd.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen()
            answering = threading.Thread(target=answer, args=(listener,), daemon=True)
            answering.start()
            result = _kvctl("--socket", path, "status")
            answering.join(SETTLE_SECONDS)
    _quiet(result)
    return path, result


def test_another_program_on_the_socket_is_no_daemon() -> None:
    """Something that answers the hello with what is not kvd's protocol (an HTTP server)."""
    path, result = _status_against(_answer_http)
    assert result.returncode == NO_DAEMON
    assert f"what answers on {path} did not take kvctl's hello" in result.stderr


def _answer_http(listener: socket.socket) -> None:
    connection, _ = listener.accept()
    with connection:
        connection.recv(4096)
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def test_a_listener_that_hangs_up_after_the_hello_is_no_daemon() -> None:
    """Something that takes kvctl's hello and closes without a word: said as such, once."""
    _, result = _status_against(_hang_up)
    assert result.returncode == NO_DAEMON
    assert result.stderr.strip().endswith("the daemon closed the connection")
    assert "failed" not in result.stderr


def _hang_up(listener: socket.socket) -> None:
    connection, _ = listener.accept()
    with connection:
        connection.recv(4096)


def _closed_output(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """kvctl writing into a pipe whose reader is gone before it writes a byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return _kvctl("--socket", daemon.socket_path, *args, stdout=write_end)
    finally:
        os.close(write_end)


def test_a_closed_output_ends_quietly(stocked: Daemon) -> None:
    [entry] = json_entries(stocked)
    for args in (
        ["list"],
        ["list", "--json"],
        ["status"],
        ["status", "--json"],
        ["status", "--watch", "--interval", "0.1"],
        ["show", entry[:6]],
        ["metrics"],
        ["verify"],
        ["ping"],
        ["flush"],
        ["doctor"],
        ["service", "status"],
    ):
        result = _closed_output(stocked, *args)
        assert (result.returncode, result.stderr) == (PIPE_CLOSED, ""), (args, result.stderr)
    helped = _closed_output(stocked, "--help")  # argparse prints it and exits 0 itself
    assert (helped.returncode, helped.stderr) == (0, "")


def json_entries(daemon: Daemon) -> list[str]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return [e.id for e in client.list_entries(IDENTITY)]


@pytest.fixture
def interruptible(daemon: Daemon) -> Iterator[list[subprocess.Popen[str]]]:
    """kvctl processes to start, each killed at the end if the test left it running."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


# kvctl as a terminal's foreground job runs it: Ctrl-C raises KeyboardInterrupt. A suite run
# as a background job (`make test &`) ignores SIGINT, and Python started with SIGINT ignored
# keeps ignoring it: the handler is put back before kvctl's module runs.
AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'kvctl'; runpy.run_module('kvd.ops.kvctl', run_name='__main__')"
)


def _start(
    daemon: Daemon, started: list[subprocess.Popen[str]], *args: str
) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, "--socket", daemon.socket_path, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(process)
    return process


def test_ctrl_c_during_watch_exits_130_quietly(
    daemon: Daemon, interruptible: list[subprocess.Popen[str]]
) -> None:
    watching = _start(daemon, interruptible, "status", "--watch", "--interval", "0.2")
    assert watching.stdout is not None
    assert watching.stdout.readline().startswith("daemon ")  # its first table is out
    watching.send_signal(signal.SIGINT)
    _, stderr = watching.communicate(timeout=SETTLE_SECONDS)
    assert (watching.returncode, stderr) == (INTERRUPTED, "")


def test_ctrl_c_during_an_unanswered_call_exits_130_quietly(
    daemon: Daemon, interruptible: list[subprocess.Popen[str]]
) -> None:
    assert daemon.process is not None
    os.kill(daemon.process.pid, signal.SIGSTOP)  # it accepts (the backlog), answers nothing
    try:
        waiting = _start(daemon, interruptible, "--timeout", "600", "status")
        kvctl_process = psutil.Process(waiting.pid)
        wait_until(lambda: kvctl_process.net_connections(kind="unix"), "kvctl connected")
        time.sleep(0.5)  # its hello sent, its answer awaited
        waiting.send_signal(signal.SIGINT)
        _, stderr = waiting.communicate(timeout=SETTLE_SECONDS)
        assert (waiting.returncode, stderr) == (INTERRUPTED, "")
        # Without Ctrl-C, --timeout ends the wait: no daemon answers.
        timed_out = kvctl(daemon, "--timeout", "0.5", "status")
        _quiet(timed_out)
        assert timed_out.returncode == NO_DAEMON
        assert "the daemon did not answer in time" in timed_out.stderr
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
