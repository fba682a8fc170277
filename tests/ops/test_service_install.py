"""`kvctl service install | uninstall | status` into a temporary home.

The service manager's command (systemctl, launchctl) is a script on PATH that records its
arguments and answers as the real one would; what kvctl writes is checked with the real
tools: systemd-analyze verify for the units, plistlib (and plutil on a Mac) for the plist.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_service_files import needs_systemd_analyze, read_unit, verify

from kvd.ops.service import run_service
from kvd.ops.service_templates import PLIST_HOME, SYSTEMD_BIN, template

BIN = Path(sys.executable).parent  # where the tests' kvd and kvd-mlx-lm-server scripts are
# Records each call, one line of arguments; answers is-enabled / is-active as a running unit.
FAKE_MANAGER = """#!/bin/sh
echo "$*" >> "{log}"
case "$*" in
  *is-enabled*) echo enabled ;;
  *is-active*) echo active ;;
  *"{fail}"*) echo "refused: $*" >&2; exit 1 ;;
esac
exit 0
"""


class Home:
    """A temporary home with a fake service manager first on PATH."""

    def __init__(self, root: Path, manager: str, fail: str = "no such call") -> None:
        self.home = root / "home"
        self.home.mkdir()
        self.calls_log = root / "calls"
        fake_bin = root / "bin"
        fake_bin.mkdir()
        script = fake_bin / manager
        script.write_text(FAKE_MANAGER.format(log=self.calls_log, fail=fail))
        script.chmod(0o755)
        self.env = {
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "PATH": f"{fake_bin}:{os.environ['PATH']}",
            # A checkout tested with another's virtualenv runs its own code.
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
        }
        self.units = self.home / ".config/systemd/user"

    def kvctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvd.ops.kvctl", "service", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def calls(self) -> list[str]:
        if not self.calls_log.exists():
            return []
        return self.calls_log.read_text().splitlines()


def service_args(
    action: str, with_server: str | None = None, metrics_port: int = 0
) -> argparse.Namespace:
    return argparse.Namespace(
        action=action, dry_run=False, with_server=with_server, metrics_port=metrics_port
    )


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd")


@pytest.fixture
def systemd_home(tmp_path: Path) -> Home:
    return Home(tmp_path, "systemctl")


def files_in(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


@linux_only
def test_install_writes_the_units_and_enables_the_socket(systemd_home: Home) -> None:
    result = systemd_home.kvctl("install")
    assert result.returncode == 0, result.stderr
    assert files_in(systemd_home.units) == {"kvd.socket", "kvd.service"}
    assert systemd_home.calls() == [
        "--user daemon-reload",
        "--user enable --now kvd.socket",
        "--user try-restart kvd.service",
    ]
    service = read_unit(systemd_home.units / "kvd.service")
    assert service["Service"]["ExecStart"] == [f"{BIN}/kvd serve"]
    # Everything but ExecStart is the shipped template's.
    shipped = template("systemd", "kvd.service").replace(f"{SYSTEMD_BIN}/kvd", f"{BIN}/kvd")
    assert (systemd_home.units / "kvd.service").read_text() == shipped
    assert (systemd_home.units / "kvd.socket").read_text() == template("systemd", "kvd.socket")
    assert f"wrote {systemd_home.units / 'kvd.service'}" in result.stdout


@linux_only
@needs_systemd_analyze
def test_installed_units_verify_without_any_warning(systemd_home: Home, tmp_path: Path) -> None:
    model = tmp_path / "my models" / "tiny 100%"  # a space and a % to escape
    result = systemd_home.kvctl("install", "--with-server", str(model))
    assert result.returncode == 0, result.stderr
    server = read_unit(systemd_home.units / "kvd-mlx-lm-server.service")["Service"]
    assert server["ExecStart"][0].startswith(
        f'{BIN}/kvd-mlx-lm-server --model "{tmp_path}/my models/tiny 100%%" '
    )
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    units = [systemd_home.units / n for n in sorted(files_in(systemd_home.units))]
    assert len(units) == 3
    checked = verify(systemd_home.home, runtime, *units)
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", "")
    assert systemd_home.calls()[-2:] == [
        "--user enable kvd-mlx-lm-server.service",
        "--user restart kvd-mlx-lm-server.service",
    ]


@linux_only
@needs_systemd_analyze
def test_a_metrics_port_is_served_under_the_unit(systemd_home: Home, tmp_path: Path) -> None:
    result = systemd_home.kvctl("install", "--metrics-port", "9464")
    assert result.returncode == 0, result.stderr
    service = read_unit(systemd_home.units / "kvd.service")["Service"]
    assert service["ExecStart"] == [f"{BIN}/kvd serve --metrics-port 9464"]
    assert service["RestrictAddressFamilies"] == ["AF_UNIX AF_INET"]  # else the bind fails
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    units = [systemd_home.units / "kvd.socket", systemd_home.units / "kvd.service"]
    checked = verify(systemd_home.home, runtime, *units)
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", "")
    bad = systemd_home.kvctl("install", "--metrics-port", "65536")
    assert bad.returncode == 2
    assert "a TCP port is at most 65535" in bad.stderr


@linux_only
def test_dry_run_prints_what_install_writes_and_changes_nothing(
    systemd_home: Home, tmp_path: Path
) -> None:
    dry = systemd_home.kvctl("install", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert not systemd_home.home.joinpath(".config").exists()
    assert systemd_home.calls() == []
    assert "would run: systemctl --user enable --now kvd.socket" in dry.stdout
    assert systemd_home.kvctl("install").returncode == 0
    for name in ("kvd.socket", "kvd.service"):
        path = systemd_home.units / name
        assert f"would write {path}:\n{path.read_text()}" in dry.stdout


@linux_only
def test_uninstall_removes_what_install_wrote(systemd_home: Home, tmp_path: Path) -> None:
    assert systemd_home.kvctl("install", "--with-server", str(tmp_path)).returncode == 0
    installed = len(systemd_home.calls())
    dry = systemd_home.kvctl("uninstall", "--dry-run")
    assert files_in(systemd_home.units) == {
        "kvd.socket",
        "kvd.service",
        "kvd-mlx-lm-server.service",
    }
    assert f"would remove {systemd_home.units / 'kvd.service'}" in dry.stdout
    result = systemd_home.kvctl("uninstall")
    assert result.returncode == 0, result.stderr
    assert files_in(systemd_home.units) == set()
    assert systemd_home.calls()[installed:] == [
        "--user disable --now kvd.socket kvd.service kvd-mlx-lm-server.service",
        "--user daemon-reload",
    ]
    again = systemd_home.kvctl("uninstall")
    assert (again.returncode, again.stdout) == (0, "nothing installed (systemd)\n")


@linux_only
def test_status_says_what_is_installed_and_running(systemd_home: Home) -> None:
    before = systemd_home.kvctl("status")
    assert before.returncode == 1
    assert "kvd.socket: not installed" in before.stdout
    systemd_home.kvctl("install")
    after = systemd_home.kvctl("status")
    assert after.returncode == 0, after.stdout
    path = systemd_home.units / "kvd.socket"
    assert f"kvd.socket: installed ({path}), enabled, active" in after.stdout
    assert "kvd-mlx-lm-server.service: not installed" in after.stdout


@linux_only
def test_a_failing_step_is_a_clear_error(tmp_path: Path) -> None:
    home = Home(tmp_path, "systemctl", fail="enable")
    result = home.kvctl("install")
    assert result.returncode == 1
    assert (
        "kvctl: systemctl --user enable --now kvd.socket failed (1): refused: --user enable"
        in result.stderr
    )


def test_server_needs_its_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An environment without kvd-mlx-lm-server: refused before anything is written."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    shutil.copy(BIN / "kvd", venv_bin / "kvd")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    home = Home(tmp_path, "systemctl")
    monkeypatch.setenv("PATH", home.env["PATH"])
    args = service_args("install", with_server="some/model")
    assert run_service(args, {"HOME": str(home.home)}, platform="linux") == 1
    assert f"no kvd-mlx-lm-server script in {venv_bin}" in capsys.readouterr().err
    assert home.calls() == []
    assert not home.units.exists()


# ---- launchd (its installer runs here too; launchctl and plutil only on a Mac) ---------------


def test_launch_agent_install_and_uninstall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = Home(tmp_path, "launchctl")
    monkeypatch.setenv("PATH", home.env["PATH"])
    environ = {"HOME": str(home.home)}
    assert run_service(service_args("install"), environ, platform="darwin") == 0
    agents = home.home / "Library/LaunchAgents"
    path = agents / "local.kvd.plist"
    assert files_in(agents) == {"local.kvd.plist"}
    uid = os.getuid()
    assert home.calls() == [f"bootout gui/{uid}/local.kvd", f"bootstrap gui/{uid} {path}"]

    with path.open("rb") as file:
        plist = plistlib.load(file)
    assert plistlib.loads(plistlib.dumps(plist, fmt=plistlib.FMT_BINARY)) == plist
    assert plist["ProgramArguments"] == [f"{BIN}/kvd", "serve"]
    assert (
        plist["StandardOutPath"]
        == plist["StandardErrorPath"]
        == f"{home.home}/Library/Logs/kvd.log"
    )
    assert (home.home / "Library/Logs").is_dir()  # launchd does not make it
    shipped = plistlib.loads(template("launchd", "local.kvd.plist").encode())
    changed = {"ProgramArguments", "StandardOutPath", "StandardErrorPath"}
    assert {k: v for k, v in plist.items() if k not in changed} == {
        k: v for k, v in shipped.items() if k not in changed
    }
    assert PLIST_HOME not in path.read_text()
    if shutil.which("plutil"):
        lint = subprocess.run(["plutil", "-lint", str(path)], capture_output=True, check=False)
        assert lint.returncode == 0, lint.stdout

    assert run_service(service_args("status"), environ, platform="darwin") == 1
    assert f"local.kvd: installed ({path}), " in capsys.readouterr().out

    calls = len(home.calls())
    assert run_service(service_args("uninstall"), environ, platform="darwin") == 0
    assert files_in(agents) == set()
    assert home.calls()[calls:] == [f"bootout gui/{uid}/local.kvd"]


def test_launch_agents_for_the_server_and_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = Home(tmp_path, "launchctl")
    monkeypatch.setenv("PATH", home.env["PATH"])
    environ = {"HOME": str(home.home)}
    args = service_args("install", with_server="mlx-community/Tiny-4bit", metrics_port=9464)
    assert run_service(args, environ, platform="darwin") == 0
    with (home.home / "Library/LaunchAgents/local.kvd.plist").open("rb") as file:
        daemon = plistlib.load(file)
    assert daemon["ProgramArguments"] == [f"{BIN}/kvd", "serve", "--metrics-port", "9464"]
    path = home.home / "Library/LaunchAgents/local.kvd-mlx-lm-server.plist"
    with path.open("rb") as file:
        plist = plistlib.load(file)
    arguments = plist["ProgramArguments"]
    assert arguments[:3] == [f"{BIN}/kvd-mlx-lm-server", "--model", "mlx-community/Tiny-4bit"]
    assert plist["StandardOutPath"] == f"{home.home}/Library/Logs/kvd-mlx-lm-server.log"
