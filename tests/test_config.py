"""Configuration: defaults per platform, the four sources and their order, sizes, bad values."""

from __future__ import annotations

import argparse
import grp
import os
from pathlib import Path, PurePosixPath

import pytest
from kvd_protocol.paths import DefaultPaths, default_paths, socket_path_fits

from kvd.config import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MIN_FREE,
    DEFAULT_QUARANTINE_MAX_BYTES,
    DEFAULT_SHUTDOWN_DEADLINE,
    DEFAULT_WRITEBACK_BLOCK_TIMEOUT,
    DEFAULT_WRITEBACK_MAX_BYTES,
    GIB,
    Config,
    ConfigError,
    Overflow,
    add_config_arguments,
    env_var,
    flag,
    load_config,
    settings_table,
)
from kvd.logs import LogFormat

MAC_HOME = PurePosixPath("/Users/firstname.lastname")
OWN_GROUP = grp.getgrgid(os.getgid()).gr_name


def parse_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def environ(home: Path) -> dict[str, str]:
    # A short runtime directory keeps the default socket path under the limit.
    return {"HOME": str(home), "XDG_RUNTIME_DIR": "/run/user/1000"}


def load(argv: list[str], environ: dict[str, str], platform: str = "linux") -> Config:
    return load_config(parse_flags(argv), environ, platform=platform)


def write_toml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- default paths -------------------------------------------------------------------------


def test_linux_default_paths_follow_xdg() -> None:
    environ = {
        "XDG_CONFIG_HOME": "/h/cfg",
        "XDG_CACHE_HOME": "/h/cache",
        "XDG_RUNTIME_DIR": "/run/user/1000",
    }
    assert default_paths("linux", PurePosixPath("/h"), environ, 1000) == DefaultPaths(
        config_file=PurePosixPath("/h/cfg/kvd/kvd.toml"),
        dir=PurePosixPath("/h/cache/kvd"),
        socket=PurePosixPath("/run/user/1000/kvd/kvd.sock"),
    )


def test_linux_default_paths_without_xdg_variables() -> None:
    assert default_paths("linux", PurePosixPath("/home/ada"), {}, 1000) == DefaultPaths(
        config_file=PurePosixPath("/home/ada/.config/kvd/kvd.toml"),
        dir=PurePosixPath("/home/ada/.cache/kvd"),
        socket=PurePosixPath("/tmp/kvd-1000/kvd.sock"),
    )


def test_linux_default_paths_ignore_relative_xdg_values() -> None:
    environ = {"XDG_CONFIG_HOME": "cfg", "XDG_CACHE_HOME": "cache", "XDG_RUNTIME_DIR": "run"}
    assert default_paths("linux", PurePosixPath("/home/ada"), environ, 7) == default_paths(
        "linux", PurePosixPath("/home/ada"), {}, 7
    )


def test_macos_default_paths() -> None:
    # The XDG variables mean nothing on macOS, even when set.
    environ = {"XDG_RUNTIME_DIR": "/run/user/501", "XDG_CACHE_HOME": "/elsewhere"}
    assert default_paths("darwin", MAC_HOME, environ, 501) == DefaultPaths(
        config_file=MAC_HOME / "Library/Application Support/kvd/kvd.toml",
        dir=MAC_HOME / "Library/Caches/kvd",
        socket=MAC_HOME / "Library/Caches/kvd/run/kvd.sock",
    )


def test_socket_path_limit_is_103_bytes() -> None:
    assert socket_path_fits("/" + "s" * 102)
    assert not socket_path_fits("/" + "s" * 103)
    assert not socket_path_fits("/" + "é" * 52)  # 105 bytes in 53 characters


# ---- defaults and sources ------------------------------------------------------------------


def test_defaults_on_linux(environ: dict[str, str], home: Path) -> None:
    assert load([], environ) == Config(
        dir=home / ".cache/kvd",
        socket=Path("/run/user/1000/kvd/kvd.sock"),
        max_bytes=DEFAULT_MAX_BYTES,
        min_free=DEFAULT_MIN_FREE,
        writeback_max_bytes=DEFAULT_WRITEBACK_MAX_BYTES,
        writeback_policy=Overflow.DROP_OLDEST,
        writeback_block_timeout=DEFAULT_WRITEBACK_BLOCK_TIMEOUT,
        shutdown_deadline=DEFAULT_SHUTDOWN_DEADLINE,
        log_format=LogFormat.AUTO,
        socket_group=None,
        quarantine_max_bytes=DEFAULT_QUARANTINE_MAX_BYTES,
        config_file=None,
    )
    assert (DEFAULT_MAX_BYTES, DEFAULT_MIN_FREE, DEFAULT_WRITEBACK_MAX_BYTES) == (
        64 * GIB,
        10 * GIB,
        2 * GIB,
    )


def test_defaults_on_macos() -> None:
    config = load([], {"HOME": str(MAC_HOME)}, platform="darwin")
    assert config.dir == Path(MAC_HOME, "Library/Caches/kvd")
    assert config.socket == Path(MAC_HOME, "Library/Caches/kvd/run/kvd.sock")


def test_precedence_defaults_file_environment_flags(environ: dict[str, str], home: Path) -> None:
    write_toml(
        home / ".config/kvd/kvd.toml",
        'min_free = "1G"\nwriteback_max_bytes = "1G"\nquarantine_max_bytes = "1G"\n',
    )
    environ |= {"KVD_WRITEBACK_MAX_BYTES": "2G", "KVD_QUARANTINE_MAX_BYTES": "2G"}
    config = load(["--quarantine-max-bytes", "3G"], environ)
    assert config.max_bytes == DEFAULT_MAX_BYTES  # only the default
    assert config.min_free == 1 * GIB  # the file over the default
    assert config.writeback_max_bytes == 2 * GIB  # the environment over the file
    assert config.quarantine_max_bytes == 3 * GIB  # the flag over the environment


def test_default_file_is_read_and_recorded(environ: dict[str, str], home: Path) -> None:
    path = write_toml(home / ".config/kvd/kvd.toml", 'writeback_policy = "block"\n')
    config = load([], environ)
    assert config.writeback_policy is Overflow.BLOCK
    assert config.config_file == path


def test_xdg_config_home_locates_the_default_file(environ: dict[str, str], tmp_path: Path) -> None:
    write_toml(tmp_path / "cfg/kvd/kvd.toml", "shutdown_deadline = 3\n")
    environ["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    assert load([], environ).shutdown_deadline == 3.0


def test_missing_default_file_is_fine(environ: dict[str, str]) -> None:
    assert load([], environ).config_file is None


def test_flag_config_beats_environment_config(environ: dict[str, str], tmp_path: Path) -> None:
    by_flag = write_toml(tmp_path / "flag.toml", "min_free = 1\n")
    by_env = write_toml(tmp_path / "env.toml", "min_free = 2\n")
    environ["KVD_CONFIG"] = str(by_env)
    assert load([], environ).min_free == 2
    config = load(["--config", str(by_flag)], environ)
    assert (config.min_free, config.config_file) == (1, by_flag)


@pytest.mark.parametrize(
    ("argv", "env", "source"),
    [
        (["--config", "{missing}"], {}, "flag --config"),
        ([], {"KVD_CONFIG": "{missing}"}, "environment variable KVD_CONFIG"),
    ],
)
def test_missing_explicit_file_is_an_error(
    environ: dict[str, str],
    tmp_path: Path,
    argv: list[str],
    env: dict[str, str],
    source: str,
) -> None:
    missing = str(tmp_path / "absent.toml")
    environ |= {k: v.format(missing=missing) for k, v in env.items()}
    with pytest.raises(ConfigError) as raised:
        load([a.format(missing=missing) for a in argv], environ)
    assert (raised.value.source, raised.value.key) == (source, "config")
    assert missing in str(raised.value)


# One valid raw value per key, with what it loads as (paths relative to a base: see below).
VALID = {
    "dir": ("/srv/kvd", Path("/srv/kvd")),
    "socket": ("/run/kvd/kvd.sock", Path("/run/kvd/kvd.sock")),
    "max_bytes": ("200G", 200 * GIB),
    "min_free": ("0", 0),
    "writeback_max_bytes": ("512M", 512 << 20),
    "writeback_policy": ("refuse", Overflow.REFUSE),
    "eviction_policy": ("lru", "lru"),
    "max_retention": ("7200", 7200.0),
    "writeback_block_timeout": ("2.5", 2.5),
    "shutdown_deadline": ("30", 30.0),
    "snapshot_interval": ("0.5", 0.5),
    "reconcile_interval": ("600", 600.0),
    "log_format": ("console", LogFormat.CONSOLE),
    "socket_group": (OWN_GROUP, OWN_GROUP),
    "quarantine_max_bytes": ("16KiB", 16384),
    "max_connections": ("200", 200),
    "frame_timeout": ("2.5", 2.5),
    "max_open_puts": ("4", 4),
    "max_leases": ("64", 64),
    "put_timeout": ("60", 60.0),
    "admission": ("second-hit", "second-hit"),
    "admission_min_tokens": ("1024", 1024),
    "admission_window": ("600", 600.0),
    "quotas": ("e2e/*=1G,big=2M", (("e2e/*", 1 << 30), ("big", 2 << 20))),
    "metrics_port": ("9464", 9464),
    "lease_max_age": ("120", 120.0),
    "frame_buffer_bytes": ("64MiB", 64 << 20),
    "share_between_users": ("true", True),
    "remote": ("s3://kvd-cache/team-a/", "s3://kvd-cache/team-a"),
    "remote_endpoint": ("https://127.0.0.1:8333/", "https://127.0.0.1:8333"),
    "remote_region": ("eu-west-1", "eu-west-1"),
    "remote_credentials_file": ("/etc/kvd/s3.ini", Path("/etc/kvd/s3.ini")),
    "remote_fetch_timeout": ("2.5", 2.5),
    "remote_min_tokens": ("512", 512),
    "remote_request_timeout": ("3", 3.0),
    "remote_requests": ("16", 16),
    "remote_upload": ("second-hit", "second-hit"),
    "remote_upload_bytes": ("256M", 256 << 20),
    "remote_upload_rate": ("0", 0),
}


def test_every_key_is_a_field() -> None:
    assert set(VALID) | {"config_file"} == set(Config.__dataclass_fields__)


@pytest.mark.parametrize("key", sorted(VALID))
@pytest.mark.parametrize("source", ["file", "environment", "flag"])
def test_every_key_can_come_from_every_source(
    environ: dict[str, str], tmp_path: Path, key: str, source: str
) -> None:
    raw, expected = VALID[key]
    argv = []
    if source == "file":
        path = write_toml(tmp_path / "kvd.toml", f'{key} = "{raw}"\n')
        argv = ["--config", str(path)]
    elif source == "environment":
        environ[env_var(key)] = raw
    else:
        argv = [flag(key), raw]
    assert getattr(load(argv, environ), key) == expected


def test_toml_numbers_are_accepted_for_sizes_and_durations(
    environ: dict[str, str], tmp_path: Path
) -> None:
    path = write_toml(tmp_path / "kvd.toml", "max_bytes = 4096\nshutdown_deadline = 2.5\n")
    config = load(["--config", str(path)], environ)
    assert (config.max_bytes, config.shutdown_deadline) == (4096, 2.5)


def test_a_switch_takes_a_toml_boolean_or_a_word(environ: dict[str, str], tmp_path: Path) -> None:
    path = write_toml(tmp_path / "kvd.toml", "share_between_users = true\n")
    assert load(["--config", str(path)], environ).share_between_users is True
    assert load(["--share-between-users", "Off"], environ).share_between_users is False
    with pytest.raises(ConfigError, match="expected true or false"):
        load(["--share-between-users", "maybe"], environ)


def test_empty_socket_group_means_owner_only(environ: dict[str, str]) -> None:
    environ["KVD_SOCKET_GROUP"] = ""
    assert load([], environ).socket_group is None


# ---- paths in values -----------------------------------------------------------------------


def test_file_paths_expand_home_and_are_relative_to_the_file(
    environ: dict[str, str], home: Path, tmp_path: Path
) -> None:
    path = write_toml(tmp_path / "etc/kvd.toml", 'dir = "~/tier"\nsocket = "run/kvd.sock"\n')
    config = load(["--config", str(path)], environ)
    assert config.dir == home / "tier"
    assert config.socket == tmp_path / "etc/run/kvd.sock"


def test_flag_and_environment_paths_are_relative_to_the_working_directory(
    environ: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    environ["KVD_DIR"] = "tier"
    config = load(["--socket", "s.sock"], environ)
    assert (config.dir, config.socket) == (tmp_path / "tier", tmp_path / "s.sock")


# ---- bad values name their source ----------------------------------------------------------

BAD = [
    ("max_bytes", "12Q"),
    ("max_bytes", "0"),
    ("min_free", "-5G"),
    ("writeback_max_bytes", "0"),
    ("writeback_policy", "drop_oldest"),
    ("eviction_policy", "random"),
    ("writeback_block_timeout", "0"),
    ("writeback_block_timeout", "soon"),
    ("shutdown_deadline", "-1"),
    ("shutdown_deadline", "inf"),
    ("shutdown_deadline", "nan"),
    ("snapshot_interval", "0"),
    ("reconcile_interval", "often"),
    ("log_format", "xml"),
    ("socket_group", "kvd-no-such-group"),
    ("quarantine_max_bytes", "lots"),
    ("metrics_port", "65536"),
    ("metrics_port", "-1"),
    ("dir", ""),
    ("socket", "/" + "s" * 103),
    ("remote", "https://kvd-cache/team"),
    ("remote", "s3://Upper/team"),
    ("remote", "s3://kvd-cache/a/../b"),
    ("remote_endpoint", "ftp://127.0.0.1"),
    ("remote_endpoint", "http://user@127.0.0.1:8333"),
    ("remote_endpoint", "http://127.0.0.1:99999"),
    ("remote_endpoint", "http://127.0.0.1:8333/bucket"),
    ("remote_requests", "0"),
    ("remote_upload", "sometimes"),
    ("remote_upload_bytes", "0"),
]


@pytest.mark.parametrize(("key", "raw"), BAD)
@pytest.mark.parametrize("source", ["file", "environment", "flag"])
def test_bad_values_name_their_source_and_key(
    environ: dict[str, str], tmp_path: Path, key: str, raw: str, source: str
) -> None:
    argv: list[str] = []
    if source == "file":
        path = write_toml(tmp_path / "kvd.toml", f'{key} = "{raw}"\n')
        argv = ["--config", str(path)]
        expected_source = f"file {path}"
    elif source == "environment":
        environ[env_var(key)] = raw
        expected_source = f"environment variable {env_var(key)}"
    else:
        argv = [f"{flag(key)}={raw}"]  # "=" so that argparse takes "-5G" as a value
        expected_source = f"flag {flag(key)}"
    with pytest.raises(ConfigError) as raised:
        load(argv, environ)
    assert (raised.value.source, raised.value.key) == (expected_source, key)
    assert str(raised.value).startswith(f"{expected_source}: {key}: ")


def test_a_bad_file_value_is_an_error_even_when_a_flag_overrides_it(
    environ: dict[str, str], tmp_path: Path
) -> None:
    path = write_toml(tmp_path / "kvd.toml", 'max_bytes = "huge"\n')
    with pytest.raises(ConfigError, match="max_bytes"):
        load(["--config", str(path), "--max-bytes", "1G"], environ)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("max_bytes = true\n", "max_bytes"),
        ("dir = 5\n", "dir"),
        ("shutdown_deadline = [1]\n", "shutdown_deadline"),
        ("log_format = 1\n", "log_format"),
        ("max_byts = 1\n", "max_byts"),  # unknown key
        ("[kvd]\nmax_bytes = 1\n", "kvd"),  # no tables
        ("max_bytes = \n", "config"),  # not TOML
    ],
)
def test_bad_files(environ: dict[str, str], tmp_path: Path, text: str, key: str) -> None:
    path = write_toml(tmp_path / "kvd.toml", text)
    with pytest.raises(ConfigError) as raised:
        load(["--config", str(path)], environ)
    assert (raised.value.source, raised.value.key) == (f"file {path}", key)


def test_unreadable_default_file_is_an_error(environ: dict[str, str], home: Path) -> None:
    (home / ".config/kvd/kvd.toml").mkdir(parents=True)  # a directory where the file goes
    with pytest.raises(ConfigError, match="cannot be read"):
        load([], environ)


def test_too_long_default_socket_names_the_default(environ: dict[str, str]) -> None:
    environ["XDG_RUNTIME_DIR"] = "/run/" + "r" * 100
    with pytest.raises(ConfigError) as raised:
        load([], environ)
    assert (raised.value.source, raised.value.key) == ("default", "socket")
    assert "103 bytes" in str(raised.value)


def test_a_short_flag_socket_rescues_a_too_long_default(environ: dict[str, str]) -> None:
    environ["XDG_RUNTIME_DIR"] = "/run/" + "r" * 100
    assert load(["--socket", "/tmp/k.sock"], environ).socket == Path("/tmp/k.sock")


def test_the_operations_table_is_the_settings_table() -> None:
    readme = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    lines = readme.splitlines()
    start = lines.index("| key | flag / variable | default | meaning |")
    end = lines.index("", start)
    assert "\n".join(lines[start:end]) == settings_table(), (
        "docs/operations.md's settings table is out of date: replace it with the output of "
        "python -c 'from kvd.config import settings_table; print(settings_table())'"
    )
