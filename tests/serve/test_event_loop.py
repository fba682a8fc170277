"""The daemon's event loop (kvd/serve/event_loop.py): uvloop's where it can be imported,
asyncio's otherwise, and it says which; either serves."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from daemon_process import Daemon, socket_folder
from kvd_client.client import Client


def _serving_loop(daemon: Daemon) -> str:
    for line in daemon.logs().splitlines():
        if '"serving"' in line:
            loop: str = json.loads(line)["loop"]
            return loop
    raise AssertionError(f"no serving line in the log:\n{daemon.logs()}")


def test_the_daemon_runs_on_uvloop_where_it_is_installed(daemon: Daemon) -> None:
    installed = importlib.util.find_spec("uvloop") is not None
    assert _serving_loop(daemon) == ("uvloop" if installed else "asyncio")
    with Client.connect(daemon.socket_path, require=True) as client:
        client.ping()


def test_a_daemon_that_cannot_import_uvloop_serves_on_asyncio(tmp_path: Path) -> None:
    hidden = tmp_path / "no-uvloop"
    hidden.mkdir()
    (hidden / "uvloop.py").write_text('raise ImportError("uvloop is not installed here")\n')
    path = os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])
    with socket_folder() as sockets:
        daemon = Daemon(tmp_path / "tier", os.path.join(sockets, "kvd.sock"), tmp_path / "log")
        daemon.start(env={"PYTHONPATH": path})
        try:
            with Client.connect(daemon.socket_path, require=True) as client:
                client.ping()
        finally:
            assert daemon.stop() == 0
    daemon.check()
    assert _serving_loop(daemon) == "asyncio"
