"""The service definitions shipped in kvd/services/, rendered for one installation.

The files in kvd/services/ are both what the manual steps (docs/operations.md) copy and the
templates `kvctl service install` renders: their placeholders are those steps' (kvd in a virtual
environment at ~/.local/share/kvd/venv, the home /Users/USERNAME in a plist, the model
%h/models/MODEL), and rendering replaces exactly those.
"""

from __future__ import annotations

import plistlib
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

SERVICES = files("kvd") / "services"
SYSTEMD_UNITS = ("kvd.socket", "kvd.service")
SYSTEMD_SERVER_UNIT = "kvd-mlx-lm-server.service"
LAUNCHD_LABEL = "local.kvd"
LAUNCHD_SERVER_LABEL = "local.kvd-mlx-lm-server"

# The placeholders, as the manual steps write them.
README_BIN = ".local/share/kvd/venv/bin"
SYSTEMD_BIN = f"%h/{README_BIN}"
SYSTEMD_MODEL = "%h/models/MODEL"
PLIST_HOME = "/Users/USERNAME"
PLIST_BIN = f"{PLIST_HOME}/{README_BIN}"
PLIST_MODEL = f"{PLIST_HOME}/models/MODEL"

SYSTEMD_SPECIAL = re.compile(r"[\s\"'\\;]")


@dataclass(frozen=True)
class Installation:
    """What the service files point at: this environment's scripts and the user's home."""

    home: Path
    bin_dir: Path  # the folder holding the kvd and kvd-mlx-lm-server scripts


def template(platform_folder: str, name: str) -> str:
    return (SERVICES / platform_folder / name).read_text()


def _exec_argument(value: str) -> str:
    """One ExecStart= word: `%` and `$` escaped, quoted when it holds a space or a quote."""
    value = value.replace("%", "%%").replace("$", "$$")
    if SYSTEMD_SPECIAL.search(value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _render_word(word: str, install: Installation, model: str | None) -> str:
    if word.startswith(SYSTEMD_BIN + "/"):
        return _exec_argument(str(install.bin_dir / word.removeprefix(SYSTEMD_BIN + "/")))
    if word == SYSTEMD_MODEL and model is not None:
        return _exec_argument(model)
    return word


def _render_unit(text: str, install: Installation, model: str | None) -> str:
    """The template with its ExecStart= pointing at this installation (and the model)."""
    lines = []
    for line in text.splitlines(keepends=True):
        if line.startswith("ExecStart="):
            words = line.removeprefix("ExecStart=").split()
            rendered = " ".join(_render_word(w, install, model) for w in words)
            lines.append(f"ExecStart={rendered}\n")
        else:
            lines.append(line)
    return "".join(lines)


def _serving_metrics(line: str, port: int) -> str:
    if line.startswith("ExecStart="):
        return f"{line.rstrip()} --metrics-port {port}\n"
    if line.startswith("RestrictAddressFamilies="):
        return f"{line.rstrip()} AF_INET\n"  # the metrics listener is TCP on 127.0.0.1
    return line


def systemd_units(
    install: Installation, server_model: str | None = None, metrics_port: int = 0
) -> dict[str, str]:
    """Unit file name -> text: kvd's socket and service, and the server's when a model is
    given. %h stays where the templates use it: systemd expands it to the same home."""
    names = [*SYSTEMD_UNITS, *([SYSTEMD_SERVER_UNIT] if server_model is not None else [])]
    units = {name: _render_unit(template("systemd", name), install, server_model) for name in names}
    if metrics_port:
        service = units["kvd.service"].splitlines(keepends=True)
        units["kvd.service"] = "".join(_serving_metrics(line, metrics_port) for line in service)
    return units


def _render_plist_value(value: Any, install: Installation, model: str | None) -> Any:
    if isinstance(value, str):
        if value == PLIST_MODEL and model is not None:
            return model
        if value.startswith(PLIST_BIN + "/"):
            return str(install.bin_dir / value.removeprefix(PLIST_BIN + "/"))
        if value.startswith(PLIST_HOME + "/"):
            return str(install.home / value.removeprefix(PLIST_HOME + "/"))
        return value
    if isinstance(value, list):
        return [_render_plist_value(v, install, model) for v in value]
    if isinstance(value, dict):
        return {k: _render_plist_value(v, install, model) for k, v in value.items()}
    return value


def launchd_agents(
    install: Installation, server_model: str | None = None, metrics_port: int = 0
) -> dict[str, bytes]:
    """Plist file name -> contents (XML): kvd's agent, and the server's when a model is given.
    launchd expands neither ~ nor $HOME, so every path is absolute."""
    labels = [LAUNCHD_LABEL, *([LAUNCHD_SERVER_LABEL] if server_model is not None else [])]
    agents = {}
    for label in labels:
        plist = plistlib.loads(template("launchd", f"{label}.plist").encode())
        rendered = _render_plist_value(plist, install, server_model)
        if label == LAUNCHD_LABEL and metrics_port:
            rendered["ProgramArguments"] += ["--metrics-port", str(metrics_port)]
        agents[f"{label}.plist"] = plistlib.dumps(rendered, fmt=plistlib.FMT_XML)
    return agents
