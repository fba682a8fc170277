"""The daemon's configuration: defaults, a TOML file, environment variables and flags.

Every key can come from four sources; a later one wins:

    defaults  <  TOML file  <  environment variable KVD_<KEY>  <  flag --<key>

The file is `--config FILE`, else `$KVD_CONFIG`, else the platform's default file (see
kvd.paths); a missing default file is fine, a missing named one is an error. Its keys are the
field names of `Config`, at the top level. Every value a source gives is checked, even one a
later source overrides, and a bad one raises ConfigError naming the source and the key.

Sizes are whole bytes, or a number with a unit: K, M, G, T, P, each a power of 1024, with
optional "i" and "B" and in any case ("16KiB" == "16K" == "16kb" == 16384; "1GB" == 2**30).
A fraction is allowed and rounded down to whole bytes ("1.5T"). Durations are seconds.
"""

from __future__ import annotations

import argparse
import grp
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from kvd_protocol.paths import SOCKET_PATH_MAX_BYTES, default_paths, socket_path_fits

from kvd.eviction import EVICTION_POLICIES
from kvd.writeback import Overflow

GIB = 1 << 30


class LogFormat(StrEnum):
    JSON = "json"
    CONSOLE = "console"
    AUTO = "auto"  # console on a terminal, JSON otherwise


# The tier cannot size itself from the disk at configuration time (the disk may be shared and
# its free space changes), so the cap is a fixed 64 GiB; min_free guards the disk itself.
DEFAULT_MAX_BYTES = 64 * GIB
DEFAULT_MIN_FREE = 10 * GIB
DEFAULT_WRITEBACK_MAX_BYTES = 2 * GIB
DEFAULT_WRITEBACK_BLOCK_TIMEOUT = 5.0
# The service files give the service manager a few seconds more than this before SIGKILL
# (systemd TimeoutStopSec=, launchd ExitTimeOut).
DEFAULT_SHUTDOWN_DEADLINE = 15.0
DEFAULT_QUARANTINE_MAX_BYTES = 1 * GIB


@dataclass(frozen=True)
class Config:
    dir: Path  # the tier directory
    socket: Path
    max_bytes: int = DEFAULT_MAX_BYTES  # cap on the tier's bytes, across identities
    min_free: int = DEFAULT_MIN_FREE  # free-disk floor the tier never eats into
    writeback_max_bytes: int = DEFAULT_WRITEBACK_MAX_BYTES
    writeback_policy: Overflow = Overflow.DROP_OLDEST
    eviction_policy: str = "lru"  # a name in EVICTION_POLICIES
    writeback_block_timeout: float = DEFAULT_WRITEBACK_BLOCK_TIMEOUT  # for policy "block"
    shutdown_deadline: float = DEFAULT_SHUTDOWN_DEADLINE  # seconds to flush after SIGTERM
    log_format: LogFormat = LogFormat.AUTO
    socket_group: str | None = None  # a group allowed to connect; None: the owner only
    quarantine_max_bytes: int = DEFAULT_QUARANTINE_MAX_BYTES
    config_file: Path | None = None  # the file that was read, if any (not itself a key)


class ConfigError(Exception):
    """A configuration value that cannot be used, with where it came from."""

    def __init__(self, source: str, key: str, detail: str) -> None:
        super().__init__(f"{source}: {key}: {detail}")
        self.source = source
        self.key = key
        self.detail = detail


# ---- value parsers: each takes a TOML value or a string and raises ValueError -------------

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?))?(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: object) -> int:
    """Bytes from an integer or a size string (see the module docstring); ValueError if bad."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size (an integer or a string such as '64G'), got {value!r}")
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a size: expected bytes or a number with K, M, G, T or P "
            "(powers of 1024), such as '4096', '512M', '1.5T' or '16KiB'"
        )
    number, prefix, _, _ = match.groups()
    return int(Decimal(number) * 1024 ** _POWERS[(prefix or "").lower()])


def _positive_size(value: object) -> int:
    size = parse_size(value)
    if size == 0:
        raise ValueError("must be greater than zero")
    return size


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{value!r} must be a positive, finite number of seconds")
    return seconds


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _choice(kind: type[StrEnum]) -> Callable[[object], StrEnum]:
    def parse(value: object) -> StrEnum:
        try:
            return kind(_text(value))
        except ValueError:
            allowed = ", ".join(member.value for member in kind)
            raise ValueError(f"{value!r} is not one of: {allowed}") from None

    return parse


def _one_of(table: Mapping[str, object]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        name = _text(value)
        if name not in table:
            raise ValueError(f"{value!r} is not one of: {', '.join(table)}")
        return name

    return parse


def _group(value: object) -> str | None:
    name = _text(value)
    if not name:
        return None  # an empty value means the owner only, as when unset
    try:
        grp.getgrnam(name)
    except KeyError:
        raise ValueError(f"no group named {name!r} on this system") from None
    return name


def _path(value: object) -> Path:
    text = _text(value)
    if not text:
        raise ValueError("must not be empty")
    return Path(text)


_PARSERS: dict[str, Callable[[object], Any]] = {
    "dir": _path,
    "socket": _path,
    "max_bytes": _positive_size,
    "min_free": parse_size,
    "writeback_max_bytes": _positive_size,
    "writeback_policy": _choice(Overflow),
    "eviction_policy": _one_of(EVICTION_POLICIES),
    "writeback_block_timeout": _seconds,
    "shutdown_deadline": _seconds,
    "log_format": _choice(LogFormat),
    "socket_group": _group,
    "quarantine_max_bytes": parse_size,
}
_PATH_KEYS = frozenset({"dir", "socket"})
_FLAG_HELP = {
    "dir": ("DIR", "tier directory"),
    "socket": ("PATH", f"Unix socket path (at most {SOCKET_PATH_MAX_BYTES} bytes)"),
    "max_bytes": ("SIZE", "cap on the tier's bytes, e.g. 200G (K/M/G/T are powers of 1024)"),
    "min_free": ("SIZE", "free space to leave on the disk"),
    "writeback_max_bytes": ("SIZE", "cap on the bytes waiting to be written"),
    "writeback_policy": ("drop-oldest|block|refuse", "what a put does over that cap"),
    "eviction_policy": ("lru", "which entries go first when the tier is over its cap"),
    "writeback_block_timeout": ("SECONDS", "longest wait of a put under the block policy"),
    "shutdown_deadline": ("SECONDS", "time to flush pending writes after SIGTERM"),
    "log_format": ("json|console|auto", "log format (auto: console on a terminal)"),
    "socket_group": ("GROUP", "group allowed to connect (default: the owner only)"),
    "quarantine_max_bytes": ("SIZE", "cap on the bytes of quarantined files"),
}


def env_var(key: str) -> str:
    return f"KVD_{key.upper()}"


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config and one flag per key. Values stay strings: load_config checks them, so a
    bad flag gives the same ConfigError as a bad file or variable."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for key, (metavar, help_text) in _FLAG_HELP.items():
        parser.add_argument(flag(key), dest=key, metavar=metavar, help=help_text)


# ---- loading -------------------------------------------------------------------------------


def _expand(path: Path, home: Path, base: Path) -> Path:
    """`~` is the configured home; a relative path is relative to `base`."""
    if path.parts[:1] == ("~",):
        path = home.joinpath(*path.parts[1:])
    elif str(path).startswith("~"):
        path = Path(os.path.expanduser(path))
    return path if path.is_absolute() else base / path


def _parse(source: str, key: str, value: object, home: Path, base: Path) -> Any:
    try:
        parsed = _PARSERS[key](value)
    except ValueError as error:
        raise ConfigError(source, key, str(error)) from None
    return _expand(parsed, home, base) if key in _PATH_KEYS else parsed


def _config_file(
    args: argparse.Namespace, environ: Mapping[str, str], default: Path
) -> tuple[Path, str | None]:
    """The file to read and, when it was named explicitly, by which source."""
    named = getattr(args, "config", None)
    if named:
        return Path(named), f"flag {flag('config')}"
    if environ.get("KVD_CONFIG"):
        return Path(environ["KVD_CONFIG"]), "environment variable KVD_CONFIG"
    return default, None


def _read_file(path: Path, named_by: str | None) -> dict[str, Any] | None:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        if named_by is None:
            return None
        raise ConfigError(named_by, "config", f"no such file: {path}") from None
    except OSError as error:
        raise ConfigError(f"file {path}", "config", f"cannot be read: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"file {path}", "config", f"not valid TOML: {error}") from None


def load_config(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    platform: str = sys.platform,
) -> Config:
    """The configuration from defaults, the file, `environ` and the flags parsed into `args`
    (by a parser given add_config_arguments; attributes it lacks count as not given)."""
    home = Path(environ.get("HOME") or Path.home())
    cwd = Path.cwd()
    defaults = default_paths(platform, PurePosixPath(home), environ, os.getuid())
    values: dict[str, Any] = {"dir": Path(defaults.dir), "socket": Path(defaults.socket)}
    sources = {"dir": "default", "socket": "default"}

    def take(source: str, key: str, raw: object, base: Path) -> None:
        values[key] = _parse(source, key, raw, home, base)
        sources[key] = source

    file_path, named_by = _config_file(args, environ, Path(defaults.config_file))
    file_path = _expand(file_path, home, cwd)
    table = _read_file(file_path, named_by)
    for key, raw in (table or {}).items():
        if key not in _PARSERS:
            known = ", ".join(_PARSERS)
            raise ConfigError(f"file {file_path}", key, f"unknown key (known keys: {known})")
        take(f"file {file_path}", key, raw, file_path.parent)
    for key in _PARSERS:
        if environ.get(env_var(key)) is not None:
            take(f"environment variable {env_var(key)}", key, environ[env_var(key)], cwd)
    for key in _PARSERS:
        if getattr(args, key, None) is not None:
            take(f"flag {flag(key)}", key, getattr(args, key), cwd)

    socket = values["socket"]
    if not socket_path_fits(socket):
        raise ConfigError(
            sources["socket"],
            "socket",
            f"{socket} is {len(os.fsencode(socket))} bytes; a Unix socket path must be at most "
            f"{SOCKET_PATH_MAX_BYTES} bytes (the macOS limit): choose a shorter one",
        )
    return Config(**values, config_file=file_path if table is not None else None)
