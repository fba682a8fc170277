"""Fixtures shared by every part's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import Daemon, running_daemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A real kvd with default settings on a temporary tier and socket."""
    with running_daemon(tmp_path) as running:
        yield running
