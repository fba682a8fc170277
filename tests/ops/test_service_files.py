"""The service definitions: systemd user units checked by systemd-analyze, and the launchd
plist checked key by key; both consistent with the configuration's defaults."""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from kvd_protocol.paths import default_paths, socket_path_fits

from kvd.config import DEFAULT_SHUTDOWN_DEADLINE

SERVICES = Path(__file__).resolve().parents[2] / "kvd" / "services"
SOCKET_UNIT = SERVICES / "systemd/kvd.socket"
SERVICE_UNIT = SERVICES / "systemd/kvd.service"
SERVER_UNIT = SERVICES / "systemd/kvd-mlx-lm-server.service"
PLIST = SERVICES / "launchd/local.kvd.plist"
SERVER_PLIST = SERVICES / "launchd/local.kvd-mlx-lm-server.plist"
SERVER_CLOSE_SECONDS = 10  # kvd_client.mlx_lm_server.CLOSE_SECONDS (importing it loads mlx)
PLIST_HOME = "/Users/USERNAME"  # the placeholder the install steps replace

Unit = dict[str, dict[str, list[str]]]


def read_unit(path: Path) -> Unit:
    """Sections of a unit file, each key with all its values (keys may repeat)."""
    unit: Unit = {}
    section: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = unit.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key, []).append(value)
    return unit


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, f"unexpected time span {value!r}"
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


# ---- systemd -------------------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (it ships with systemd)"
)


def verify(home: Path, runtime: Path, *units: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify --user`, with %h and %t pointing at temporary folders. It needs
    no running systemd, but does need $XDG_RUNTIME_DIR, and checks that ExecStart exists."""
    assert SYSTEMD_ANALYZE is not None
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(runtime), "PATH": os.environ["PATH"]}
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--user", "--man=no", *map(str, units)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def user_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """A home holding an executable where each ExecStart expects one, and a runtime directory."""
    home, runtime = tmp_path / "home", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    for unit in (SERVICE_UNIT, SERVER_UNIT):
        exec_start = read_unit(unit)["Service"]["ExecStart"][0].split()[0]
        assert exec_start.startswith("%h/")
        program = home / exec_start.removeprefix("%h/")
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    return home, runtime


@needs_systemd_analyze
def test_units_verify_without_any_warning(user_dirs: tuple[Path, Path]) -> None:
    result = verify(*user_dirs, SOCKET_UNIT, SERVICE_UNIT, SERVER_UNIT)
    # Unknown keys and bad values are warnings with exit status 0: any output is a failure.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@needs_systemd_analyze
def test_the_verification_catches_a_misspelt_key(
    user_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "units"
    broken.mkdir()
    shutil.copy(SOCKET_UNIT, broken)
    text = SERVICE_UNIT.read_text().replace("NoNewPrivileges=", "NoNewPrivilege=")
    (broken / "kvd.service").write_text(text)
    result = verify(*user_dirs, broken / "kvd.socket", broken / "kvd.service")
    assert "NoNewPrivilege" in result.stderr


def test_socket_unit() -> None:
    socket = read_unit(SOCKET_UNIT)["Socket"]
    assert socket["ListenStream"] == ["%t/kvd/kvd.sock"]
    assert socket["SocketMode"] == ["0600"]
    assert socket["DirectoryMode"] == ["0700"]  # the socket unit creates the private folder
    assert read_unit(SOCKET_UNIT)["Install"]["WantedBy"] == ["sockets.target"]


def test_service_unit() -> None:
    unit = read_unit(SERVICE_UNIT)
    service = unit["Service"]
    assert unit["Unit"]["Requires"] == ["kvd.socket"]
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["Restart"] == ["on-failure"]
    assert seconds(service["WatchdogSec"][0]) > 0
    assert service["ExecStart"][0].endswith(" serve")
    assert unit["Install"]["WantedBy"] == ["default.target"]
    # It would delete %t/kvd, and the socket unit's listening socket with it, at every stop.
    assert "RuntimeDirectory" not in service


def test_service_waits_longer_than_the_shutdown_deadline() -> None:
    stop = seconds(read_unit(SERVICE_UNIT)["Service"]["TimeoutStopSec"][0])
    assert stop >= DEFAULT_SHUTDOWN_DEADLINE + 3


def test_units_agree_with_the_default_paths() -> None:
    """Socket at %t/kvd/kvd.sock and tier at %C/kvd: the defaults without the units."""
    home, runtime = PurePosixPath("/home/ada"), "/run/user/1000"
    defaults = default_paths("linux", home, {"XDG_RUNTIME_DIR": runtime}, 1000)
    listen = read_unit(SOCKET_UNIT)["Socket"]["ListenStream"][0]
    assert PurePosixPath(listen.replace("%t", runtime)) == defaults.socket
    cache = read_unit(SERVICE_UNIT)["Service"]["CacheDirectory"][0]
    assert home / ".cache" / cache == defaults.dir


# ---- launchd -------------------------------------------------------------------------------


def load_plist(path: Path = PLIST) -> dict[str, object]:
    with path.open("rb") as file:
        plist: dict[str, object] = plistlib.load(file)
    return plist


def test_plist_keys_and_types() -> None:
    plist = load_plist()
    assert plist["Label"] == PLIST.stem == "local.kvd"
    arguments = plist["ProgramArguments"]
    assert isinstance(arguments, list)
    assert all(isinstance(argument, str) for argument in arguments)
    assert arguments[0].startswith(f"{PLIST_HOME}/")
    assert arguments[1:] == ["serve"]
    assert plist["RunAtLoad"] is True
    # Restart after a crash or a failing exit; stay down after a clean exit.
    assert plist["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    throttle = plist["ThrottleInterval"]
    assert isinstance(throttle, int)
    assert throttle >= 10
    assert plist["ProcessType"] in ("Standard", "Interactive")
    assert plist["Umask"] == 0o077
    assert plist["EnvironmentVariables"] == {"KVD_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    for key in ("StandardOutPath", "StandardErrorPath"):
        value = plist[key]
        assert isinstance(value, str)
        assert value.startswith(f"{PLIST_HOME}/Library/Logs/")


def test_plist_waits_longer_than_the_shutdown_deadline() -> None:
    exit_timeout = load_plist()["ExitTimeOut"]
    assert isinstance(exit_timeout, int)
    assert exit_timeout >= DEFAULT_SHUTDOWN_DEADLINE + 3


@pytest.mark.parametrize("path", [PLIST, SERVER_PLIST], ids=["kvd", "server"])
def test_plist_survives_a_binary_round_trip(path: Path) -> None:
    plist = load_plist(path)
    assert plistlib.loads(plistlib.dumps(plist, fmt=plistlib.FMT_BINARY)) == plist


@pytest.mark.parametrize("path", [PLIST, SERVER_PLIST], ids=["kvd", "server"])
def test_plist_paths_share_one_placeholder(path: Path) -> None:
    """Replacing /Users/USERNAME installs it: no other absolute path is left to edit."""
    text = path.read_text()
    strings = re.findall(r"<string>(/[^<]*)</string>", text)
    assert strings
    assert all(value.startswith(f"{PLIST_HOME}/") for value in strings)


def test_server_plist_runs_the_server_and_waits_for_it_to_send_what_waits() -> None:
    plist = load_plist(SERVER_PLIST)
    assert plist["Label"] == SERVER_PLIST.stem == "local.kvd-mlx-lm-server"
    arguments = plist["ProgramArguments"]
    assert isinstance(arguments, list)
    assert arguments[0] == f"{PLIST_HOME}/.local/share/kvd/venv/bin/kvd-mlx-lm-server"
    assert arguments[1] == "--model"
    assert plist["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    exit_timeout = plist["ExitTimeOut"]
    assert isinstance(exit_timeout, int)
    assert exit_timeout >= SERVER_CLOSE_SECONDS + 5
    assert plist["StandardOutPath"] == f"{PLIST_HOME}/Library/Logs/kvd-mlx-lm-server.log"


def test_server_unit_wants_the_socket_and_waits_for_what_waits() -> None:
    unit = read_unit(SERVER_UNIT)
    assert unit["Unit"]["Wants"] == ["kvd.socket"]
    assert "Requires" not in unit["Unit"]  # without kvd the server still answers
    service = unit["Service"]
    assert service["ExecStart"][0].split()[:2] == [
        "%h/.local/share/kvd/venv/bin/kvd-mlx-lm-server",
        "--model",
    ]
    assert seconds(service["TimeoutStopSec"][0]) >= SERVER_CLOSE_SECONDS + 5


def test_default_macos_socket_fits_for_a_long_home() -> None:
    home = PurePosixPath("/Users/firstname.lastname")
    assert socket_path_fits(default_paths("darwin", home, {}, 501).socket)
