"""The one-machine remote recipe (`make remote-demo`, scripts/remote_demo.py), run briefly:
it starts SeaweedFS with its bucket and two daemons on it, both answer with the remote tier
ok, and Ctrl-C stops all of it, leaving no process and no folder behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import psutil
from seaweed import ACCESS_KEY, BUCKET, SECRET_KEY

from kvd.remote.bucket import Bucket, BucketError
from kvd.remote.credentials import Credentials

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "remote_demo.py"
READY_SECONDS = 180.0  # the bucket and two daemons on a loaded machine
STOP_SECONDS = 60.0
LAST_LINE = "Ctrl-C here stops"


def _read_until_ready(out: IO[str], process: subprocess.Popen[str]) -> str:
    """What the demo printed up to its last line (its lines come at once, when all is up)."""
    printed = ""
    deadline = time.monotonic() + READY_SECONDS
    while LAST_LINE not in printed:
        line = out.readline()
        if not line:
            raise AssertionError(f"the demo ended ({process.wait()}) after:\n{printed}")
        printed += line
        assert time.monotonic() < deadline, printed
    return printed


@contextmanager
def _demo(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield process, _read_until_ready(process.stdout, process)
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()


def _bucket_answers(endpoint: str, name: str) -> bool:
    bucket = Bucket(endpoint, name, Credentials(ACCESS_KEY, SECRET_KEY, source="test"))
    try:
        bucket.list("demo/", 1)
        return True
    except BucketError:
        return False
    finally:
        bucket.close()


def _remote_status(socket_path: str) -> dict[str, object]:
    """The daemon's `remote` status, as `kvctl --socket PATH status --json` prints it."""
    shown = subprocess.run(
        [sys.executable, "-m", "kvd.ops.kvctl", "--socket", socket_path, "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    remote: dict[str, object] = json.loads(shown.stdout)["remote"]
    return remote


def test_the_demo_runs_a_bucket_and_two_daemons_sharing_it_then_stops_them_all() -> None:
    with _demo() as (process, printed):
        endpoint = re.search(r"SeaweedFS \(weed mini\) at (\S+),", printed)
        sockets = dict(re.findall(r"daemon (a|b): socket (\S+),", printed))
        folder = re.search(r"removes (\S+)\.$", printed.rstrip())
        assert endpoint is not None, printed
        assert folder is not None, printed
        assert set(sockets) == {"a", "b"}, printed
        assert _bucket_answers(endpoint[1], BUCKET)
        assert not _bucket_answers(endpoint[1], "absent-bucket")  # so the check can fail
        for socket_path in sockets.values():
            assert f"--socket {socket_path} status" in printed  # what to run next
            remote = _remote_status(socket_path)
            assert (remote["state"], remote["url"]) == ("ok", f"s3://{BUCKET}/demo")
            assert remote["endpoint"] == endpoint[1]
        running = psutil.Process(process.pid).children(recursive=True)
        assert {"weed"} <= {child.name() for child in running}
        assert sum("kvd" in " ".join(child.cmdline()) for child in running) >= 2
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(STOP_SECONDS) == 0
    assert not [child for child in running if child.is_running()]
    assert not Path(folder[1]).exists()
    assert not any(Path(path).exists() for path in sockets.values())


def test_a_folder_given_is_kept_with_the_tiers_and_the_logs(tmp_path: Path) -> None:
    with _demo("--folder", str(tmp_path / "demo")) as (process, printed):
        assert "removes" not in printed
        process.send_signal(signal.SIGTERM)
        assert process.wait(STOP_SECONDS) == 0
    for name in ("a", "b"):
        assert (tmp_path / "demo" / name / "tier").is_dir()
        assert '"event": "tier_opened"' in (tmp_path / "demo" / name / "log").read_text()


def test_the_demo_says_what_it_does() -> None:
    shown = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "two kvd daemons sharing it" in shown.stdout
