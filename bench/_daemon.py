"""The benchmarks run kvd with the end-to-end tests' harness, tests/daemon_process.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_process import OPENED, Daemon, DaemonProcessError, running_daemon, socket_folder

__all__ = ["OPENED", "Daemon", "DaemonProcessError", "running_daemon", "socket_folder"]
