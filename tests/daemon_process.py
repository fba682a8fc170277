"""A real `kvd serve` subprocess on a tier and socket of its own: the end-to-end tests' and
the benchmarks' one way to run the daemon (bench/_daemon.py puts this folder on the path).

The daemon runs in an environment of its own (no inherited `KVD_*` variable, HOME and the XDG
folders inside the test's folder, so no configuration file from the real HOME), and is held
to a clean run: check() fails when it exited non-zero by itself or logged an error-level event
that the test did not declare with expect_errors (a test that provokes a failure on purpose
names the events it provokes). running_daemon checks on a clean exit; tests/conftest.py checks
every daemon a test started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvd_client.client import Client
from kvd_protocol.errors import DaemonUnavailableError

START_SECONDS = 20.0  # bound on waiting for a starting daemon to answer ping
STOP_SECONDS = 30.0
POLL_SECONDS = 0.002  # between connect attempts while starting: the error on a start time
ERROR_LEVELS = frozenset({"error", "critical"})
OPENED = '"event": "tier_opened"'  # start-up is done (the directory listed), as logged
# What the daemon inherits from the test's environment; everything else is left behind.
# PYTHONPATH: a checkout run against another's virtualenv runs its own daemon too.
INHERITED = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ")

# `python -m kvd` under an open-file limit, soft and hard (preexec_fn is unsafe with threads).
LIMITED_START = (
    "import resource, runpy; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, ({open_files}, {open_files})); "
    "runpy.run_module('kvd', run_name='__main__', alter_sys=True)"
)

started: list[Daemon] = []  # every daemon made since the last clear (tests/conftest.py)


class DaemonProcessError(RuntimeError):
    """The daemon exited, did not answer, ignored SIGTERM or logged an unexpected error; the
    message holds its log."""


def isolated_environment(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The daemon's environment: a few basics of ours, a HOME and XDG folders of its own."""
    env = {key: os.environ[key] for key in INHERITED if key in os.environ}
    env |= {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_RUNTIME_DIR": str(home / "run"),
    }
    return env | dict(extra or {})


class Daemon:
    """A `kvd serve` subprocess; start() waits until it answers ping."""

    def __init__(
        self,
        tier: Path,
        socket_path: str,
        log: Path,
        flags: Sequence[str] = (),
        expected_errors: Iterable[str] = (),
        *,
        open_files: int | None = None,
    ) -> None:
        """open_files: the daemon's open-file limit, soft and hard (None: as inherited)."""
        self.tier, self.socket_path, self.log = tier, socket_path, log
        self.flags = list(flags)
        self.open_files = open_files
        self.home = log.parent / "daemon-home"
        self.expected_errors = set(expected_errors)
        self.bad_exits: list[int] = []  # exit codes of runs that ended badly by themselves
        self.checked = False
        self.process: subprocess.Popen[bytes] | None = None
        started.append(self)

    def expect_errors(self, *events: str) -> None:
        """Declare error-level events this test provokes on purpose (by event name)."""
        self.expected_errors.update(events)

    def start(
        self,
        env: Mapping[str, str] | None = None,
        timeout: float = START_SECONDS,
        *,
        settled: bool = True,
    ) -> float:
        """Spawn the daemon and wait for its first ping answer; the seconds that took.

        env: variables set on top of the isolated environment (NOTIFY_SOCKET, say).
        settled: then also wait until start-up has listed the directory (a daemon started
        from its snapshot serves before that: its `tier_opened` event says it is done).
        """
        opened = self.logs().count(OPENED)
        command = [sys.executable, "-m", "kvd"]
        if self.open_files:
            command[1:] = ["-c", LIMITED_START.format(open_files=self.open_files)]
        command += ["serve", "--dir", str(self.tier)]
        command += ["--socket", self.socket_path, "--log-format", "json", *self.flags]
        self.home.mkdir(parents=True, exist_ok=True)
        environment = isolated_environment(self.home, env)
        with self.log.open("ab") as log:
            started = time.perf_counter()
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=environment
            )
        while time.perf_counter() - started < timeout:
            if self.process.poll() is not None:
                raise DaemonProcessError(
                    f"kvd serve exited with {self.process.returncode}:\n{self.logs()}"
                )
            if os.path.exists(self.socket_path):  # cheaper than a failing connect
                try:
                    with Client.connect(self.socket_path, timeout=5.0, require=True) as client:
                        client.ping()
                    seconds = time.perf_counter() - started
                    if settled:
                        self.wait_settled(opened, started + timeout - time.perf_counter())
                    return seconds
                except DaemonUnavailableError:
                    pass
            time.sleep(POLL_SECONDS)
        self.kill()
        raise DaemonProcessError(
            f"kvd serve did not answer ping within {timeout} s:\n{self.logs()}"
        )

    def wait_settled(self, opened: int, timeout: float) -> None:
        """Wait for `tier_opened` events beyond the first `opened` of the log."""
        deadline = time.perf_counter() + timeout
        while self.logs().count(OPENED) <= opened:
            if time.perf_counter() > deadline or (self.process and self.process.poll() is not None):
                raise DaemonProcessError(f"kvd serve did not finish start-up:\n{self.logs()}")
            time.sleep(POLL_SECONDS)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The daemon stopped (SIGSTOP: hung, as on a stuck disk) for the block, then resumed."""
        os.kill(self.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> int:
        """SIGTERM (the daemon flushes, then exits) and wait; the exit code (0: clean).

        A daemon that had already exited non-zero by itself counts as a bad exit for check().
        """
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
        if code != 0:
            self.bad_exits.append(code)
        self.process = None
        return code

    def kill(self) -> None:
        """SIGKILL: the crash case (not a bad exit: the test asked for it)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def unexpected_errors(self) -> list[str]:
        """Log lines at error level whose event was not declared, and lines that are not
        structured events at all (a traceback Python printed, say)."""
        found = []
        for line in self.logs().splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict) or (
                event.get("level") in ERROR_LEVELS
                and event.get("event") not in self.expected_errors
            ):
                found.append(line)
        return found

    def check(self) -> None:
        """Raise DaemonProcessError if the daemon exited badly or logged an unexpected error."""
        self.checked = True
        problems = [f"exited with {code}" for code in self.bad_exits]
        unexpected = self.unexpected_errors()
        if unexpected:
            problems.append("logged what the test did not expect:\n" + "\n".join(unexpected))
        if problems:
            raise DaemonProcessError(f"kvd serve {'; '.join(problems)}\nlog:\n{self.logs()}")


def check_started() -> None:
    """Stop and check every daemon made since the last call, then forget them."""
    daemons = list(started)
    started.clear()
    for daemon in daemons:
        daemon.stop()
    for daemon in daemons:
        if not daemon.checked:
            daemon.check()


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
def running_daemon(
    folder: Path,
    flags: Sequence[str] = (),
    expected_errors: Iterable[str] = (),
    *,
    open_files: int | None = None,
) -> Iterator[Daemon]:
    """A started daemon with its tier and log in folder; stopped, then checked (when the
    body succeeded: a failing body's own error comes first)."""
    with socket_folder() as sockets:
        socket_path = os.path.join(sockets, "kvd.sock")
        daemon = Daemon(
            folder / "tier",
            socket_path,
            folder / "log",
            flags,
            expected_errors,
            open_files=open_files,
        )
        daemon.start()
        try:
            yield daemon
        finally:
            daemon.stop()
    daemon.check()


def kvctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvctl --socket <the daemon's> ARGS` in a process of its own, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "kvd.ops.kvctl", "--socket", daemon.socket_path, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
