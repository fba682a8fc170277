"""The daemon's settings, each declared once (a field of Config), and where they come from.

Every setting can come from four sources; a later one wins:

    defaults  <  TOML file  <  environment variable KVD_<KEY>  <  flag --<key>

A setting is a field of `Config`: its name is the file's key, its default and type are the
field's, and its metadata (setting()) holds its parser, its flag's metavar and its help. The
flags, the variables, the keys of the file and the table in docs/operations.md
(settings_table()) all derive from those fields. The file is `--config FILE`, else
`$KVD_CONFIG`, else the platform's default file (kvd_protocol.paths); a missing default file
is fine, a missing named one is an error. Every value a source gives is checked, even one a
later source overrides, and a bad one raises ConfigError naming the source and the key.
Values: see config_values, and kvd_protocol.quantities for sizes and durations.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from kvd_protocol import quantities
from kvd_protocol.paths import SOCKET_PATH_MAX_BYTES, default_paths, socket_path_fits

from kvd import config_values as values
from kvd.logs import LogFormat

GIB = 1 << 30


# The names each policy setting accepts. What a name does is its policy module's business
# (eviction.EVICTION_POLICIES, admission.ADMISSION_POLICIES, writeback.OVERFLOW_RULES, each
# keyed by these names), where the tier and the writer resolve the chosen one: the settings
# never import policy code.
EVICTION_POLICY_NAMES = ("lru", "cost")
ADMISSION_POLICY_NAMES = ("always", "min-tokens", "second-hit")
REMOTE_UPLOAD_POLICY_NAMES = ("always", "second-hit", "never")


class Overflow(StrEnum):
    """The write-behind queue's overflow policies, by setting value (what each does:
    writeback.OVERFLOW_RULES)."""

    DROP_OLDEST = "drop-oldest"
    BLOCK = "block"
    REFUSE = "refuse"


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
DEFAULT_SNAPSHOT_INTERVAL = 60.0  # a crash costs at most this much of header reads at start
DEFAULT_RECONCILE_INTERVAL = 300.0
DEFAULT_ADMISSION_MIN_TOKENS = 256
DEFAULT_ADMISSION_WINDOW = 3600.0
DEFAULT_FRAME_TIMEOUT = 10.0
DEFAULT_PUT_TIMEOUT = 300.0  # an engine writes a GiB in well under a second; generous
DEFAULT_MAX_OPEN_PUTS = 16  # per connection; an engine has one or two under way
DEFAULT_MAX_LEASES = 1024  # per connection; an engine has a lease for one restore
# A restore keeps its lease for seconds (a 30k-token prefix reads in about one): minutes are
# generous, and bound how long a reader that never releases keeps entries from eviction.
DEFAULT_LEASE_MAX_AGE = 300.0
# A put's retention lasts at most this long (a hit starts it again): a day, so that a prompt
# a team uses daily stays, and one nobody asks for again leaves within a day.
DEFAULT_MAX_RETENTION = 86_400.0
# Partial frames of all connections together: 32 frames of the largest size at once.
DEFAULT_FRAME_BUFFER_BYTES = 256 << 20
# A get waits this long at most for blocks only the remote bucket holds: a 32k-token prefix of
# an 8B-shaped model is ~4 GiB, a few seconds over 10 GbE, while its prefill takes minutes.
DEFAULT_REMOTE_FETCH_TIMEOUT = 5.0
DEFAULT_REMOTE_MIN_TOKENS = 256  # fewer tokens recompute faster than a round trip pays
DEFAULT_REMOTE_REQUEST_TIMEOUT = 10.0
DEFAULT_REMOTE_UPLOAD_BYTES = 1 * GIB
DEFAULT_REMOTE_UPLOAD_RATE = 128 << 20  # about 1 Gbit/s: fills a gigabit link, not 10 GbE
DEFAULT_REMOTE_REQUESTS = 8


def setting(
    parse: Callable[[object], Any], metavar: str, help_text: str, shown_default: str = ""
) -> dict[str, Any]:
    """The metadata that makes a Config field a setting; shown_default, for the settings table, when
    the default is not a plain value (a per-platform path)."""
    return {"parse": parse, "metavar": metavar, "help": help_text, "shown": shown_default}


@dataclass(frozen=True)
class Config:
    dir: Path = field(
        metadata=setting(
            values.path,
            "DIR",
            "the tier directory",
            "macOS `~/Library/Caches/kvd`; Linux `$XDG_CACHE_HOME/kvd`",
        )
    )
    socket: Path = field(
        metadata=setting(
            values.path,
            "PATH",
            f"the Unix socket, at most {SOCKET_PATH_MAX_BYTES} bytes (the macOS limit)",
            "macOS `~/Library/Caches/kvd/run/kvd.sock`; Linux `$XDG_RUNTIME_DIR/kvd/kvd.sock` "
            "(else `/tmp/kvd-<uid>/kvd.sock`)",
        )
    )
    max_bytes: int = field(
        default=DEFAULT_MAX_BYTES,
        metadata=setting(
            quantities.positive_size, "SIZE", "byte cap of the whole tier, across identities"
        ),
    )
    min_free: int = field(
        default=DEFAULT_MIN_FREE,
        metadata=setting(quantities.parse_size, "SIZE", "free-disk floor the tier never eats into"),
    )
    writeback_max_bytes: int = field(
        default=DEFAULT_WRITEBACK_MAX_BYTES,
        metadata=setting(quantities.positive_size, "SIZE", "write-behind queue cap"),
    )
    writeback_policy: Overflow = field(
        default=Overflow.DROP_OLDEST,
        metadata=setting(
            values.choice(Overflow),
            "|".join(Overflow),
            "over the queue cap: drop the oldest pending entry, block the putter (up to "
            "`writeback_block_timeout`), or refuse",
        ),
    )
    writeback_block_timeout: float = field(
        default=DEFAULT_WRITEBACK_BLOCK_TIMEOUT,
        metadata=setting(quantities.duration, "SECONDS", "longest wait of a put under `block`"),
    )
    eviction_policy: str = field(
        default="lru",
        metadata=setting(
            values.one_of(EVICTION_POLICY_NAMES),
            "|".join(EVICTION_POLICY_NAMES),
            "which entries go first when the tier is over its cap: lru (least recently used) "
            "or cost (the least prefill saved per byte, by the prefill cost the engines "
            "measure, aged by disuse); either takes a prefill checkpoint no prompt restored "
            "from yet before whole entries of the same size and use",
        ),
    )
    max_retention: float = field(
        default=DEFAULT_MAX_RETENTION,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "the longest retention a put may give its entry (a longer one is cut to this): "
            "while it lasts, eviction takes its owner's unretained entries first",
        ),
    )
    admission: str = field(
        default="always",
        metadata=setting(
            values.one_of(ADMISSION_POLICY_NAMES),
            "|".join(ADMISSION_POLICY_NAMES),
            "which puts are written (wear): always, only those of `admission_min_tokens` "
            "tokens or more, or a prefix seen a second time within `admission_window`",
        ),
    )
    admission_min_tokens: int = field(
        default=DEFAULT_ADMISSION_MIN_TOKENS,
        metadata=setting(values.count, "N", "the shortest put written under `min-tokens`"),
    )
    admission_window: float = field(
        default=DEFAULT_ADMISSION_WINDOW,
        metadata=setting(
            quantities.duration, "SECONDS", "how long a first sighting counts under `second-hit`"
        ),
    )
    quotas: tuple[tuple[str, int], ...] = field(
        default=(),
        metadata=setting(
            values.quotas,
            "PATTERN=SIZE,...",
            "byte caps per model: the first shell-style pattern matching a model id applies; "
            "at commit the model's own entries make way, else the put is refused (no_space)",
            "none",
        ),
    )
    shutdown_deadline: float = field(
        default=DEFAULT_SHUTDOWN_DEADLINE,
        metadata=setting(quantities.duration, "SECONDS", "seconds to flush after SIGTERM"),
    )
    snapshot_interval: float = field(
        default=DEFAULT_SNAPSHOT_INTERVAL,
        metadata=setting(
            quantities.duration, "SECONDS", "seconds between index snapshots (a start-up shortcut)"
        ),
    )
    reconcile_interval: float = field(
        default=DEFAULT_RECONCILE_INTERVAL,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "seconds between full checks of the directory against the index",
        ),
    )
    socket_group: str | None = field(
        default=None,
        metadata=setting(
            values.group,
            "GROUP",
            "a group also allowed to connect: the socket's folder becomes 0750 and the socket "
            "0660, owned by that group (owner only otherwise)",
            "none",
        ),
    )
    max_connections: int = field(
        default=0,
        metadata=setting(
            values.count,
            "N",
            "connections served at once; one more is answered `too_many_connections` and closed "
            "(0: sized to the open-file limit, which kvd raises to the hard limit at start)",
            "0 (auto)",
        ),
    )
    frame_timeout: float = field(
        default=DEFAULT_FRAME_TIMEOUT,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "a frame not whole this long after its first byte closes its connection",
        ),
    )
    max_open_puts: int = field(
        default=DEFAULT_MAX_OPEN_PUTS,
        metadata=setting(values.count, "N", "puts begun and not committed one connection may hold"),
    )
    max_leases: int = field(
        default=DEFAULT_MAX_LEASES,
        metadata=setting(values.count, "N", "leases one connection may have"),
    )
    put_timeout: float = field(
        default=DEFAULT_PUT_TIMEOUT,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "a put not committed this long after put_begin is aborted and its bytes returned",
        ),
    )
    quarantine_max_bytes: int = field(
        default=DEFAULT_QUARANTINE_MAX_BYTES,
        metadata=setting(
            quantities.parse_size, "SIZE", "files that failed validation kept for inspection"
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=setting(
            values.port,
            "PORT",
            "serve Prometheus metrics at http://127.0.0.1:PORT/metrics (loopback only; 0: off)",
            "0 (off)",
        ),
    )
    log_format: LogFormat = field(
        default=LogFormat.AUTO,
        metadata=setting(
            values.choice(LogFormat), "|".join(LogFormat), "JSON off a terminal, readable on one"
        ),
    )
    lease_max_age: float = field(
        default=DEFAULT_LEASE_MAX_AGE,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "a lease kept this long ends: its entry may be evicted (its reader's descriptors "
            "stay valid), and the lease's open_blocks and release are answered not_found",
        ),
    )
    frame_buffer_bytes: int = field(
        default=DEFAULT_FRAME_BUFFER_BYTES,
        metadata=setting(
            quantities.positive_size,
            "SIZE",
            "bytes of partial frames all connections together may hold; the connection that "
            "would go over is closed (over_limit)",
        ),
    )
    share_between_users: bool = field(
        default=False,
        metadata=setting(
            values.boolean,
            "BOOL",
            "members of `socket_group` share the daemon's identities (every member trusted); "
            "otherwise a peer of another uid reaches only identities whose namespace starts "
            "with its tenant, `uid:<uid>/`",
            "false",
        ),
    )
    remote: str = field(
        default="",
        metadata=setting(
            values.remote_url,
            "s3://BUCKET/PREFIX",
            "a remote tier in an S3-compatible store, shared by every kvd pointed at the same "
            "bucket and prefix (the prefix keeps tenants apart); empty: local only",
            "none",
        ),
    )
    remote_endpoint: str = field(
        default="",
        metadata=setting(
            values.endpoint_url,
            "URL",
            "the S3 server, http(s)://HOST[:PORT] (SeaweedFS, MinIO, Garage, Ceph RGW...); "
            "empty: AWS S3 in `remote_region`",
            "AWS",
        ),
    )
    remote_region: str = field(
        default="us-east-1",
        metadata=setting(values.text, "REGION", "the region requests are signed for"),
    )
    remote_credentials_file: Path | None = field(
        default=None,
        metadata=setting(
            values.optional_path,
            "FILE",
            "an AWS-style credentials file, which must be 0600; unset: the environment "
            "(`AWS_ACCESS_KEY_ID`, ...), then `~/.aws/credentials` (`AWS_PROFILE`), then the "
            "profile's `credential_process` in `~/.aws/config`; read again when it changes",
            "none",
        ),
    )
    remote_fetch_timeout: float = field(
        default=DEFAULT_REMOTE_FETCH_TIMEOUT,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "longest a get waits for blocks only the remote holds; then it answers with what "
            "is local",
        ),
    )
    remote_min_tokens: int = field(
        default=DEFAULT_REMOTE_MIN_TOKENS,
        metadata=setting(
            values.count,
            "N",
            "a get asks the remote only for a prefix at least this many tokens beyond what "
            "the tier holds",
        ),
    )
    remote_request_timeout: float = field(
        default=DEFAULT_REMOTE_REQUEST_TIMEOUT,
        metadata=setting(
            quantities.duration,
            "SECONDS",
            "a request to the bucket not done within this (connect, send, the whole answer) "
            "fails, and counts against the bucket's health",
        ),
    )
    remote_requests: int = field(
        default=DEFAULT_REMOTE_REQUESTS,
        metadata=setting(
            values.positive_count,
            "N",
            "requests to the bucket at once, fetches and uploads in the order asked; an upload "
            "takes at most half",
        ),
    )
    remote_upload: str = field(
        default="always",
        metadata=setting(
            values.one_of(REMOTE_UPLOAD_POLICY_NAMES),
            "|".join(REMOTE_UPLOAD_POLICY_NAMES),
            "which stored entries' blocks go to the remote: always, once a lookup has hit "
            "the entry (second-hit), or never (fetch only); prefill checkpoints never do",
        ),
    )
    remote_upload_bytes: int = field(
        default=DEFAULT_REMOTE_UPLOAD_BYTES,
        metadata=setting(
            quantities.positive_size,
            "SIZE",
            "upload queue cap; over it the oldest queued upload is dropped (counted)",
        ),
    )
    remote_upload_rate: int = field(
        default=DEFAULT_REMOTE_UPLOAD_RATE,
        metadata=setting(
            quantities.parse_size, "SIZE", "bytes per second uploads may send (0: no cap)"
        ),
    )
    config_file: Path | None = None  # the file that was read, if any (not itself a setting)


def quota_for(quotas: tuple[tuple[str, int], ...], model_id: str) -> int | None:
    """The byte cap of a model's entries, if a quota pattern matches its id."""
    return next((size for pattern, size in quotas if fnmatch.fnmatchcase(model_id, pattern)), None)


@dataclass(frozen=True)
class Setting:
    """One setting, as declared by its Config field."""

    name: str
    parse: Callable[[object], Any]
    metavar: str
    help: str
    default: object
    shown: str

    @property
    def shown_default(self) -> str:
        if self.shown:
            return self.shown
        if isinstance(self.default, float):
            return f"{self.default:g}"
        if isinstance(self.default, int) and self.metavar == "SIZE":
            return quantities.format_size(self.default)
        return str(self.default)


SETTINGS: Mapping[str, Setting] = {
    f.name: Setting(f.name, default=None if f.default is MISSING else f.default, **f.metadata)
    for f in fields(Config)
    if f.metadata
}


class ConfigError(Exception):
    """A configuration value that cannot be used, with where it came from."""

    def __init__(self, source: str, key: str, detail: str) -> None:
        super().__init__(f"{source}: {key}: {detail}")
        self.source = source
        self.key = key
        self.detail = detail


def env_var(key: str) -> str:
    return f"KVD_{key.upper()}"


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config and one flag per setting. Values stay strings: load_config checks them,
    so a bad flag gives the same ConfigError as a bad file or variable."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for key, each in SETTINGS.items():
        parser.add_argument(flag(key), dest=key, metavar=each.metavar, help=each.help)


def settings_table() -> str:
    """The table of settings (docs/operations.md), in Markdown."""
    rows = [
        "| key | flag / variable | default | meaning |",
        "|---|---|---|---|",
        *(
            f"| `{key}` | `{flag(key)}` / `{env_var(key)}` | {each.shown_default} | {each.help} |"
            for key, each in SETTINGS.items()
        ),
    ]
    return "\n".join(rows)


# ---- loading -------------------------------------------------------------------------------


def settings_of(config: Config) -> dict[str, object]:
    """config's settings as a TOML table holds them (paths and choices as strings, quotas as a
    table; a setting that is off, None, left out): what a daemon reports of itself, which
    with_settings reads back."""
    table = {name: getattr(config, name) for name in SETTINGS}
    return {
        name: dict(value) if name == "quotas" else _plain(value)
        for name, value in table.items()
        if value is not None
    }


def _plain(value: object) -> object:
    """A setting's value as TOML holds it: a path or a choice as its string."""
    return str(value) if isinstance(value, Path | StrEnum) else value


def with_settings(config: Config, table: Mapping[str, object], source: str) -> Config:
    """config with the settings of table (settings_of's) in place of its own; a key it does
    not know (a newer daemon's) is left out. Raises ConfigError naming source."""
    root = Path("/")  # the paths of a daemon's settings are absolute already
    return replace(
        config,
        **{
            key: _parse(source, key, value, root, root)
            for key, value in table.items()
            if key in SETTINGS
        },
    )


def _expand(path: Path, home: Path, base: Path) -> Path:
    """`~` is the configured home; a relative path is relative to `base`."""
    if path.parts[:1] == ("~",):
        path = home.joinpath(*path.parts[1:])
    elif str(path).startswith("~"):
        path = Path(os.path.expanduser(path))
    return path if path.is_absolute() else base / path


def _parse(source: str, key: str, value: object, home: Path, base: Path) -> Any:
    try:
        parsed = SETTINGS[key].parse(value)
    except ValueError as error:
        raise ConfigError(source, key, str(error)) from None
    return _expand(parsed, home, base) if isinstance(parsed, Path) else parsed


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
    import tomllib  # noqa: PLC0415 - most starts read no file, and it costs ~10 ms

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
        if key not in SETTINGS:
            known = ", ".join(SETTINGS)
            raise ConfigError(f"file {file_path}", key, f"unknown key (known keys: {known})")
        take(f"file {file_path}", key, raw, file_path.parent)
    for key in SETTINGS:
        if environ.get(env_var(key)) is not None:
            take(f"environment variable {env_var(key)}", key, environ[env_var(key)], cwd)
    for key in SETTINGS:
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
