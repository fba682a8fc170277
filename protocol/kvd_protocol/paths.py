"""Where kvd keeps its configuration, its tier and its socket by default, per platform.

macOS: config  ~/Library/Application Support/kvd/kvd.toml
       tier    ~/Library/Caches/kvd
       socket  ~/Library/Caches/kvd/run/kvd.sock
Linux: config  $XDG_CONFIG_HOME/kvd/kvd.toml   (default ~/.config/kvd/kvd.toml)
       tier    $XDG_CACHE_HOME/kvd             (default ~/.cache/kvd)
       socket  $XDG_RUNTIME_DIR/kvd/kvd.sock   (else /tmp/kvd-<uid>/kvd.sock)

The macOS socket stays under ~/Library rather than in /tmp or $TMPDIR: macOS's periodic
cleaners delete files left unaccessed in /tmp and /var/folders for three days, $TMPDIR alone
is about 50 bytes and is not always set for a LaunchAgent, and /tmp is shared with other users.
Its `run` folder sits beside the tier's own folders (entries, staging, quarantine), inside the
0700 tier root. For /Users/firstname.lastname the path is 57 bytes, far below the limit.

The default-path function is pure (platform, home, environment and uid are arguments) so that
both platforms' branches run everywhere. It lives in kvd_protocol because the daemon and the
engine library must agree on the socket's default path without depending on each other.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath as Path

# sun_path is 104 bytes on macOS (103 usable: NUL-terminated) and 108 on Linux. The smaller
# bound applies everywhere, so a configuration that works on Linux also works on a Mac.
SOCKET_PATH_MAX_BYTES = 103


@dataclass(frozen=True)
class DefaultPaths:
    config_file: Path
    dir: Path
    socket: Path


def socket_path_fits(path: Path | str) -> bool:
    """Whether a Unix socket can be bound at `path` on every supported platform."""
    return len(str(path).encode("utf-8", "surrogateescape")) <= SOCKET_PATH_MAX_BYTES


def _xdg(environ: Mapping[str, str], name: str, fallback: Path) -> Path:
    # The XDG base-directory spec says relative values are invalid and must be ignored.
    value = environ.get(name, "")
    return Path(value) if posixpath.isabs(value) else fallback


def default_paths(platform: str, home: Path, environ: Mapping[str, str], uid: int) -> DefaultPaths:
    """The default locations for `platform` (a `sys.platform` value)."""
    if platform == "darwin":
        library = home / "Library"
        return DefaultPaths(
            config_file=library / "Application Support" / "kvd" / "kvd.toml",
            dir=library / "Caches" / "kvd",
            socket=library / "Caches" / "kvd" / "run" / "kvd.sock",
        )
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    # Without a runtime directory, a per-uid folder in /tmp; the daemon creates it 0700 and
    # must refuse one that another user created first.
    socket_dir = Path(runtime) / "kvd" if posixpath.isabs(runtime) else Path(f"/tmp/kvd-{uid}")
    return DefaultPaths(
        config_file=_xdg(environ, "XDG_CONFIG_HOME", home / ".config") / "kvd" / "kvd.toml",
        dir=_xdg(environ, "XDG_CACHE_HOME", home / ".cache") / "kvd",
        socket=socket_dir / "kvd.sock",
    )
