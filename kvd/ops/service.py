"""`kvctl service install | uninstall | status`: kvd as a user service of this platform.

systemd user units on Linux, a LaunchAgent on macOS, rendered for this installation (the
scripts next to the running interpreter, the user's home) by service_templates. Each action
is a Plan: commands before, files written or removed, commands after; `--dry-run` prints the
plan and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvd.config_values import port
from kvd.ops.service_templates import (
    LAUNCHD_LABEL,
    LAUNCHD_SERVER_LABEL,
    SYSTEMD_SERVER_UNIT,
    SYSTEMD_UNITS,
    Installation,
    launchd_agents,
    systemd_units,
)

COMMAND_SECONDS = 60.0
BOOTSTRAP_TRIES = 10  # launchd may still be removing the job a bootout just stopped
BOOTSTRAP_PAUSE = 0.5


class ServiceError(Exception):
    """The service cannot be installed here, or a step failed; the message says which."""


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    required: bool = True  # a step allowed to fail (stopping what may not be running) is not
    tries: int = 1


@dataclass
class Plan:
    before: list[Step] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)  # made before the files are written
    write: dict[Path, bytes] = field(default_factory=dict)
    remove: list[Path] = field(default_factory=list)
    after: list[Step] = field(default_factory=list)


class Manager(Protocol):
    name: str

    def install(self, server_model: str | None, metrics_port: int) -> Plan: ...
    def uninstall(self) -> Plan: ...
    def status(self) -> tuple[list[str], bool]: ...


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_SECONDS, check=False
        )
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: not found")


class Systemd:
    """User units in $XDG_CONFIG_HOME/systemd/user, started by the socket unit."""

    name = "systemd"

    def __init__(self, install: Installation, environ: Mapping[str, str]) -> None:
        self._install = install
        config_home = environ.get("XDG_CONFIG_HOME") or str(install.home / ".config")
        self.folder = Path(config_home) / "systemd" / "user"

    @staticmethod
    def _systemctl(*args: str) -> tuple[str, ...]:
        return ("systemctl", "--user", *args)

    def install(self, server_model: str | None, metrics_port: int) -> Plan:
        units = systemd_units(self._install, server_model, metrics_port)
        after = [
            Step(self._systemctl("daemon-reload")),
            Step(self._systemctl("enable", "--now", "kvd.socket")),
            # A reinstall: a running daemon picks up the new unit.
            Step(self._systemctl("try-restart", "kvd.service")),
        ]
        if server_model is not None:
            after += [
                Step(self._systemctl("enable", SYSTEMD_SERVER_UNIT)),
                Step(self._systemctl("restart", SYSTEMD_SERVER_UNIT)),
            ]
        return Plan(
            write={self.folder / name: text.encode() for name, text in units.items()},
            after=after,
        )

    def _installed(self) -> list[str]:
        names = [*SYSTEMD_UNITS, SYSTEMD_SERVER_UNIT]
        return [name for name in names if (self.folder / name).exists()]

    def uninstall(self) -> Plan:
        installed = self._installed()
        before = [Step(self._systemctl("disable", "--now", *installed), required=False)]
        return Plan(
            before=before if installed else [],
            remove=[self.folder / name for name in installed],
            after=[Step(self._systemctl("daemon-reload"), required=False)] if installed else [],
        )

    def _query(self, query: str, unit: str) -> str:
        """is-enabled / is-active: the state systemctl prints, or why it printed none."""
        result = _run(self._systemctl(query, unit))
        return result.stdout.strip() or f"unknown ({result.stderr.strip()})"

    def status(self) -> tuple[list[str], bool]:
        lines, running = [], False
        for name in [*SYSTEMD_UNITS, SYSTEMD_SERVER_UNIT]:
            path = self.folder / name
            if not path.exists():
                lines.append(f"{name}: not installed")
                continue
            enabled, active = (self._query(q, name) for q in ("is-enabled", "is-active"))
            lines.append(f"{name}: installed ({path}), {enabled}, {active}")
            running |= name == "kvd.socket" and active == "active"
        return lines, running


class Launchd:
    """LaunchAgents in ~/Library/LaunchAgents, in the user's gui domain."""

    name = "launchd"

    def __init__(self, install: Installation, uid: int) -> None:
        self._install = install
        self.folder = install.home / "Library" / "LaunchAgents"
        self._domain = f"gui/{uid}"

    def install(self, server_model: str | None, metrics_port: int) -> Plan:
        agents = launchd_agents(self._install, server_model, metrics_port)
        plan = Plan(
            folders=[self._install.home / "Library" / "Logs"],  # launchd opens, never makes it
            write={self.folder / name: data for name, data in agents.items()},
        )
        for name in agents:
            label = name.removesuffix(".plist")
            # A loaded job keeps its old definition: replace it.
            plan.before.append(Step(("launchctl", "bootout", f"{self._domain}/{label}"), False))
            bootstrap = ("launchctl", "bootstrap", self._domain, str(self.folder / name))
            plan.after.append(Step(bootstrap, tries=BOOTSTRAP_TRIES))
        return plan

    def _installed(self) -> list[str]:
        labels = [LAUNCHD_LABEL, LAUNCHD_SERVER_LABEL]
        return [label for label in labels if (self.folder / f"{label}.plist").exists()]

    def uninstall(self) -> Plan:
        installed = self._installed()
        return Plan(
            before=[
                Step(("launchctl", "bootout", f"{self._domain}/{label}"), required=False)
                for label in installed
            ],
            remove=[self.folder / f"{label}.plist" for label in installed],
        )

    def status(self) -> tuple[list[str], bool]:
        lines, running = [], False
        for label in (LAUNCHD_LABEL, LAUNCHD_SERVER_LABEL):
            path = self.folder / f"{label}.plist"
            if not path.exists():
                lines.append(f"{label}: not installed")
                continue
            shown = _run(("launchctl", "print", f"{self._domain}/{label}"))
            if shown.returncode != 0:
                lines.append(f"{label}: installed ({path}), not loaded")
                continue
            state = re.search(r"^\s*state = (.+)$", shown.stdout, re.MULTILINE)
            pid = re.search(r"^\s*pid = (\d+)$", shown.stdout, re.MULTILINE)
            described = state.group(1).strip() if state else "loaded"
            described += f", pid {pid.group(1)}" if pid else ""
            lines.append(f"{label}: installed ({path}), {described}")
            running |= label == LAUNCHD_LABEL and described.startswith("running")
        return lines, running


def this_installation(environ: Mapping[str, str]) -> Installation:
    """The scripts of the running environment (not resolved: a venv's python is a link)."""
    home = Path(environ.get("HOME") or Path.home())
    return Installation(home=home, bin_dir=Path(sys.executable).parent)


def manager_for(
    platform: str, install: Installation, environ: Mapping[str, str], uid: int
) -> Manager:
    if platform == "darwin":
        return Launchd(install, uid)
    if platform.startswith("linux"):
        return Systemd(install, environ)
    raise ServiceError(f"no service manager known on {platform} (launchd or systemd)")


def _check_scripts(install: Installation, server_model: str | None) -> None:
    needed = ["kvd", *(["kvd-mlx-lm-server"] if server_model is not None else [])]
    for script in needed:
        if not os.access(install.bin_dir / script, os.X_OK):
            extra = " (pip install 'kvd-client[mlx-lm]')" if script != "kvd" else ""
            raise ServiceError(f"no {script} script in {install.bin_dir}{extra}")


def _execute(step: Step) -> None:
    for attempt in range(step.tries):
        result = _run(step.argv)
        if result.returncode == 0 or not step.required:
            detail = (result.stderr or result.stdout).strip()
            ignored = f" (exit {result.returncode}, ignored: {detail})" if result.returncode else ""
            print(f"ran: {shlex.join(step.argv)}{ignored}")
            return
        if attempt + 1 < step.tries:
            time.sleep(BOOTSTRAP_PAUSE)
    detail = (result.stderr or result.stdout).strip()
    raise ServiceError(f"{shlex.join(step.argv)} failed ({result.returncode}): {detail}")


def carry_out(plan: Plan, dry_run: bool) -> None:
    """Run the plan, or with dry_run print every file and command it holds."""
    if dry_run:
        for step in plan.before:
            print(f"would run: {shlex.join(step.argv)}")
        for folder in plan.folders:
            print(f"would make {folder}")
        for path, data in plan.write.items():
            print(f"would write {path}:\n{data.decode()}")
        for path in plan.remove:
            print(f"would remove {path}")
        for step in plan.after:
            print(f"would run: {shlex.join(step.argv)}")
        return
    for step in plan.before:
        _execute(step)
    for folder in plan.folders:
        folder.mkdir(parents=True, exist_ok=True)
    for path, data in plan.write.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path}")
    for path in plan.remove:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    for step in plan.after:
        _execute(step)


def _port(value: str) -> int:
    try:
        return port(value)
    except ValueError as exc:  # argparse shows the message of this one only
        raise argparse.ArgumentTypeError(str(exc)) from None


EXIT_STATUS = (
    "exit status:\n  0    done (status: kvd runs)\n  1    a step failed (status: kvd does not "
    "run)\n  2    a bad argument"
)


def add_service_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    service = commands.add_parser("service", help="install kvd as a user service (or remove it)")
    actions = service.add_subparsers(dest="action", required=True)

    def action(name: str, text: str) -> argparse.ArgumentParser:
        return actions.add_parser(
            name,
            help=text,
            description=text,
            epilog=EXIT_STATUS,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    install = action("install", "write the service files and start kvd")
    install.add_argument(
        "--with-server",
        metavar="MODEL",
        help="also run kvd-mlx-lm-server on this model (folder or Hugging Face repository)",
    )
    install.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        metavar="PORT",
        help="kvd serves Prometheus metrics on 127.0.0.1:PORT (the unit then allows TCP; "
        "default: %(default)s, none)",
    )
    install.add_argument("--dry-run", action="store_true", help="print, change nothing")
    uninstall = action("uninstall", "stop the services, remove their files")
    uninstall.add_argument("--dry-run", action="store_true", help="print, change nothing")
    action("status", "what is installed and whether it runs")


def run_service(
    args: argparse.Namespace,
    environ: Mapping[str, str] = os.environ,
    platform: str = sys.platform,
) -> int:
    """`kvctl service ...`: 0 done (status: kvd runs), 1 a failed step (status: it does not)."""
    install = this_installation(environ)
    try:
        manager = manager_for(platform, install, environ, os.getuid())
        if args.action == "status":
            lines, running = manager.status()
            print("\n".join(lines))
            return 0 if running else 1
        if args.action == "install":
            _check_scripts(install, args.with_server)
            plan = manager.install(args.with_server, args.metrics_port)
        else:
            plan = manager.uninstall()
            if not plan.remove:
                print(f"nothing installed ({manager.name})")
                return 0
        carry_out(plan, args.dry_run)
    except ServiceError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 1
    return 0
