"""Folders the daemon makes private: created so, tightened when ours, never when shared."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvd.serve.listener import bind_socket, prepare_socket_folder
from kvd.store.tier_dir import TierDir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_missing_folder_is_created_private(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "run"
    prepare_socket_folder(folder)
    assert mode(folder) == 0o700


def test_an_open_folder_of_ours_is_tightened(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    prepare_socket_folder(folder)
    assert mode(folder) == 0o700


@pytest.mark.parametrize("shared_mode", [0o1777, 0o777, 0o1755])
def test_a_shared_folder_is_refused_and_left_as_it_was(tmp_path: Path, shared_mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, shared_mode)
    with pytest.raises(PermissionError, match="shared with other users"):
        bind_socket(folder / "kvd.sock")
    assert mode(folder) == shared_mode
    assert not (folder / "kvd.sock").exists()


def test_a_shared_folder_is_refused_as_the_tier(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    with pytest.raises(PermissionError, match="shared with other users"):
        TierDir(folder).create()
    assert mode(folder) == 0o1777
    assert list(folder.iterdir()) == []
