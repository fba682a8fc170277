"""The settings `kvctl doctor` checks: the running daemon's when one answers on the socket
(its folder, its caps, its socket group: what it was started with, which another
configuration file, environment or flags may have set), else those kvd would read here."""

from __future__ import annotations

from collections.abc import Collection

from kvd_protocol import messages as m
from kvd_protocol.errors import DaemonUnavailableError, ProtocolError

from kvd.config import Config, with_settings
from kvd.ops.control import Control


def running_daemons_config(
    config: Config, timeout: float, given: Collection[str] = ()
) -> tuple[Config, str]:
    """config with the settings of the daemon answering on config.socket in place of its own
    (but those given as flags to doctor), and a line saying whose the settings are. Raises
    ConfigError for a daemon's setting this kvd cannot read."""
    socket = config.socket
    try:
        control = Control(str(socket), timeout)
    except DaemonUnavailableError:
        return config, f"settings: as kvd reads them here; no daemon answers on {socket}"
    try:
        reply = control.call(m.Status)
    except (DaemonUnavailableError, ProtocolError) as exc:
        return config, f"settings: as kvd reads them here; the daemon on {socket}: {exc}"
    finally:
        control.close()
    assert isinstance(reply, m.StatusReply)
    daemon = reply.status["daemon"]
    table = daemon.get("settings") or {"dir": daemon["dir"]}  # an older daemon: its folder
    theirs = {key: value for key, value in table.items() if key not in given}
    whose = f"the daemon on {socket}"
    return with_settings(config, theirs, whose), f"settings: {whose} (pid {daemon['pid']})"
