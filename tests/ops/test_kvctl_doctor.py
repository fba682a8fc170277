"""`kvctl doctor` run for real on temporary tiers: what holds, what does not, the exit status,
the --json shape, and a tier left as it was."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon, isolated_environment, running_daemon, socket_folder

from kvd.ops.doctor import CHECKS

NAMES = [check.name for check in CHECKS]
RESULTS = {"holds": True, "does not hold": False, "not applicable": None}
KEYS = {"check", "holds", "result", "detail", "assumes", "how"}
# A floor no disk here reaches: 1 EiB.
NO_DISK_HAS = str(1 << 60)
# Given the socket as descriptor 3 and its own pid (which exec keeps) in LISTEN_PID, as
# systemd starts a socket-activated service, then the command that follows.
ACTIVATED = (
    "import os, sys; os.dup2({fd}, 3); "
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="systemd's activation is Linux's")


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short private folder for the socket (sun_path holds about 100 bytes)."""
    with socket_folder() as folder:
        yield Path(folder)


def doctor(
    tier: Path | None,
    socket_path: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    command: tuple[str, ...] = (),
    pass_fds: tuple[int, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`kvctl --socket S doctor --dir D ARGS` (no --dir for no tier) in a process of its own
    (no KVD_* inherited, a HOME that is never made; a floor of 0 unless env names one, so the
    disk's own free space decides nothing)."""
    home = socket_path.parent / "home"
    environment = isolated_environment(home, {"KVD_MIN_FREE": "0", **(env or {})})
    kvctl = [sys.executable, "-m", "kvd.ops.kvctl", "--socket", str(socket_path), "doctor"]
    return subprocess.run(
        [*command, *kvctl, *(["--dir", str(tier)] if tier else []), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environment,
        pass_fds=pass_fds,
    )


def as_json(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    found = json.loads(result.stdout)
    assert isinstance(found, list)
    return {each["check"]: each for each in found}


def the_one_failing(result: subprocess.CompletedProcess[str], name: str) -> dict[str, Any]:
    """The JSON of check name, when it alone does not hold (and so the exit status is 1)."""
    assert result.returncode == 1, result.stdout + result.stderr
    found = as_json(result)
    assert {each for each, shown in found.items() if shown["holds"] is False} == {name}
    return found[name]


def everything_under(folder: Path) -> dict[str, tuple[int, float]]:
    return {
        str(path.relative_to(folder)): (path.lstat().st_mode, path.lstat().st_mtime)
        for path in folder.rglob("*")
    }


def test_a_daemons_tier_passes_and_is_left_as_it_was(daemon: Daemon) -> None:
    before = everything_under(daemon.tier)
    result = doctor(daemon.tier, Path(daemon.socket_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert everything_under(daemon.tier) == before  # no file made, changed or left behind
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"kvd 0.1.0 on {sys.platform}")
    assert lines[1] == f"settings: the daemon on {daemon.socket_path} (pid {daemon.pid})"
    rows = {line.split()[0]: line.split()[1] for line in lines[4 : 4 + len(NAMES)]}
    assert list(rows) == NAMES
    assert set(rows.values()) <= {"yes", "n/a"}
    assert rows["peer_credentials"] == rows["tier_folder"] == rows["socket_folder"] == "yes"
    assert "hold, 0 do not" in lines[-1]


def test_the_running_daemons_folder_and_settings_are_checked(tmp_path: Path) -> None:
    flags = ["--max-bytes", "3G", "--min-free", "1M"]
    with running_daemon(tmp_path, flags) as daemon:
        socket_path = Path(daemon.socket_path)
        # Its own settings (a default tier under HOME, a floor of 0) are not the daemon's.
        found = as_json(doctor(None, socket_path, "--json"))
        assert found["tier_folder"]["detail"] == f"{daemon.tier}, yours, mode 700"
        assert "floor min_free 1.0 MiB" in found["free_space"]["detail"]
        assert "cap max_bytes 3.0 GiB" in found["free_space"]["detail"]
        # A --dir given is checked as given; the other settings are still the daemon's.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        given = as_json(doctor(elsewhere, socket_path, "--json"))
        assert given["tier_folder"]["detail"] == f"{elsewhere}, yours, mode 700"
        assert "floor min_free 1.0 MiB" in given["free_space"]["detail"]
    alone = doctor(None, socket_path)
    assert f"settings: as kvd reads them here; no daemon answers on {socket_path}" in alone.stdout
    assert "floor min_free 0 B" in alone.stdout
    assert str(daemon.tier) not in alone.stdout


def test_json_is_one_object_per_check(tmp_path: Path, sockets: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    result = doctor(tier, sockets / "kvd.sock", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    found = as_json(result)
    assert list(found) == NAMES
    for each in found.values():
        assert each.keys() == KEYS
        assert RESULTS[each["result"]] is each["holds"]
        assert all(each[key] for key in ("detail", "assumes", "how"))
    assert str(tier) in found["tier_folder"]["detail"]
    assert found["durable_rename"]["holds"] is True
    assert list(tier.iterdir()) == []  # its temporary folder was inside the tier, and is gone


def test_a_tier_not_made_yet_is_not_made(tmp_path: Path, sockets: Path) -> None:
    tier = tmp_path / "not" / "yet" / "tier"
    result = doctor(tier, sockets / "kvd.sock", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not made yet" in as_json(result)["tier_folder"]["detail"]
    assert not (tmp_path / "not").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_shared_socket_folder_does_not_hold(tmp_path: Path, sockets: Path) -> None:
    os.chmod(sockets, 0o777)
    tier = tmp_path / "tier"
    found = the_one_failing(doctor(tier, sockets / "kvd.sock", "--json"), "socket_folder")
    assert "shared with other users (mode 777)" in found["detail"]
    assert (sockets.stat().st_mode & 0o777) == 0o777  # reported, not changed


def test_a_shared_tier_folder_does_not_hold(tmp_path: Path, sockets: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    os.chmod(tier, 0o1777)
    result = doctor(tier, sockets / "kvd.sock")
    assert result.returncode == 1
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("tier_folder")]
    assert row.split()[1] == "NO"
    assert "shared with other users" in row


def test_a_floor_above_the_free_space_does_not_hold(tmp_path: Path, sockets: Path) -> None:
    result = doctor(
        tmp_path / "tier", sockets / "kvd.sock", "--json", env={"KVD_MIN_FREE": NO_DISK_HAS}
    )
    assert "every put is refused" in the_one_failing(result, "free_space")["detail"]


@pytest.mark.skipif(sys.platform != "linux", reason="a tmpfs is mounted on Linux")
def test_a_floor_larger_than_the_disk_does_not_hold(small_disk: Path, sockets: Path) -> None:
    result = doctor(
        small_disk / "tier", sockets / "kvd.sock", "--json", env={"KVD_MIN_FREE": "64M"}
    )
    assert "under the floor min_free 64.0 MiB" in the_one_failing(result, "free_space")["detail"]
    assert as_json(result)["file_system"]["detail"].startswith(f"tmpfs at {small_disk.resolve()}")


def test_max_connections_beyond_the_open_file_limit_does_not_hold(
    tmp_path: Path, sockets: Path
) -> None:
    result = doctor(
        tmp_path / "tier", sockets / "kvd.sock", "--json", env={"KVD_MAX_CONNECTIONS": "1000000000"}
    )
    found = the_one_failing(result, "open_files")
    assert "max_connections 1000000000 needs 4000000064" in found["detail"]


def test_a_bad_setting_is_a_configuration_error(tmp_path: Path, sockets: Path) -> None:
    result = doctor(tmp_path / "tier", sockets / "kvd.sock", env={"KVD_MIN_FREE": "lots"})
    assert result.returncode == 2
    assert "configuration error: environment variable KVD_MIN_FREE" in result.stderr
    assert result.stdout == ""


@linux_only
def test_a_socket_passed_by_systemd_holds(tmp_path: Path, sockets: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(sockets / "kvd.sock"))
        listener.listen()
        result = activated(tmp_path, sockets, listener)
    assert result.returncode == 0, result.stdout + result.stderr
    found = as_json(result)["socket_activation"]
    assert found["holds"] is True
    assert found["detail"] == "systemd passed 1 listening Unix sockets"


@linux_only
def test_a_passed_socket_that_does_not_listen_does_not_hold(tmp_path: Path, sockets: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(sockets / "kvd.sock"))
        result = activated(tmp_path, sockets, bound)
    found = the_one_failing(result, "socket_activation")
    assert "not a listening Unix socket" in found["detail"]


def activated(
    tmp_path: Path, sockets: Path, sock: socket.socket
) -> subprocess.CompletedProcess[str]:
    """kvctl doctor started as systemd starts a socket-activated service: sock at fd 3."""
    return doctor(
        tmp_path / "tier",
        sockets / "kvd.sock",
        "--json",
        command=(sys.executable, "-c", ACTIVATED.format(fd=sock.fileno())),
        pass_fds=(sock.fileno(),),
    )
