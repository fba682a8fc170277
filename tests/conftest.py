"""Fixtures shared by every part's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import daemon_process
import pytest
from daemon_process import Daemon, running_daemon


@pytest.fixture(autouse=True)
def daemons_are_checked() -> Iterator[None]:
    """Every daemon a test starts must end cleanly and log no error the test did not
    declare (Daemon.expect_errors)."""
    daemon_process.started.clear()
    yield
    daemon_process.check_started()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A real kvd with default settings on a temporary tier and socket."""
    with running_daemon(tmp_path) as running:
        yield running
