"""kvd-mlx-lm-server's own flags follow the daemon's conventions (sizes as `1G`, durations in
seconds, refused in the daemon's words), and `--help` never asks the daemon anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_process import Daemon
from http_servers import chat, http_server, turn, wait_for_entry
from kvd_client.server_flags import kvd_flags, parse_flags
from kvd_protocol.quantities import duration, positive_size
from model_folders import build_model_folder

SERVER = [sys.executable, "-m", "kvd_client.mlx_lm_server"]


def _run(args: list[str], kvd_socket: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env["KVD_SOCKET"] = kvd_socket
    return subprocess.run(
        [*SERVER, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def test_help_shows_both_sets_of_flags_and_never_connects_to_the_daemon(tmp_path: Path) -> None:
    """A socket that listens, as a daemon's does: --help must not connect to it, and says
    nothing on stderr (no warning between its usage blocks)."""
    path = str(tmp_path / "kvd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        listener.setblocking(False)
        shown = _run(["--help"], path)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody knocked
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == ""
    kvd_part, _, mlx_lm_part = shown.stdout.partition("\n\nusage: ")
    for flag in (
        "--kvd-socket PATH",
        "--kvd-namespace NAME",
        "--kvd-lookup-timeout SECONDS",
        "--kvd-block-tokens N",
        "--kvd-backlog-bytes SIZE",
        "--kvd-checkpoint-interval N",
        "--kvd-checkpoint-bytes SIZE",
        "--kvd-warm-prompts FILE",
    ):
        assert flag in kvd_part
    assert "(default: 1G)" in kvd_part  # sizes shown as the daemon's help shows them
    for flag in ("--model", "--prompt-cache-size", "--port"):
        assert flag in mlx_lm_part


def test_help_with_no_daemon_at_all_says_nothing_of_it(tmp_path: Path) -> None:
    shown = _run(["-h"], str(tmp_path / "absent.sock"))
    assert shown.returncode == 0
    assert shown.stderr == ""
    assert "--kvd-backlog-bytes" in shown.stdout
    assert "--model" in shown.stdout


@pytest.mark.parametrize(
    ("flag", "text", "size"),
    [
        ("--kvd-backlog-bytes", "1G", 1 << 30),
        ("--kvd-backlog-bytes", "512MiB", 512 << 20),
        ("--kvd-backlog-bytes", "1.5G", 3 << 29),
        ("--kvd-backlog-bytes", "65536", 65536),
        ("--kvd-checkpoint-bytes", "256M", 256 << 20),
        ("--kvd-checkpoint-bytes", "16kb", 16 << 10),
    ],
)
def test_sizes_take_the_daemons_forms(flag: str, text: str, size: int) -> None:
    args, rest = parse_flags(kvd_flags(), [flag, text, "--model", "m"])
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == size
    assert rest == ["--model", "m"]  # mlx_lm.server's, passed on


def test_the_lookup_timeout_is_seconds_as_the_daemons_durations_are() -> None:
    args, _ = parse_flags(kvd_flags(), ["--kvd-lookup-timeout", "0.25"])
    assert args.kvd_lookup_timeout == 0.25


def _daemons_words(parse: Callable[[object], object], text: str) -> str:
    try:
        parse(text)
    except ValueError as refused:
        return str(refused)
    raise AssertionError(f"{text!r} was taken")


@pytest.mark.parametrize(
    ("flag", "text", "parse"),
    [
        ("--kvd-backlog-bytes", "1X", positive_size),
        ("--kvd-backlog-bytes", "0", positive_size),
        ("--kvd-backlog-bytes", "-5G", positive_size),
        ("--kvd-checkpoint-bytes", "lots", positive_size),
        ("--kvd-lookup-timeout", "100ms", duration),
        ("--kvd-lookup-timeout", "0", duration),
        ("--kvd-lookup-timeout", "-1", duration),
        ("--kvd-lookup-timeout", "soon", duration),
        ("--kvd-lookup-timeout", "nan", duration),
        ("--kvd-lookup-timeout", "inf", duration),
    ],
)
def test_a_bad_size_or_duration_is_refused_at_start_in_the_daemons_words(
    flag: str, text: str, parse: Callable[[object], object], tmp_path: Path
) -> None:
    refused = _run([f"{flag}={text}"], str(tmp_path / "absent.sock"))  # = takes "-5G" too
    assert refused.returncode == 2
    assert f"argument {flag}: {_daemons_words(parse, text)}" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "does not answer" not in refused.stderr  # refused before any daemon is asked


def test_a_server_started_with_size_strings_serves_and_stores(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = build_model_folder(tmp_path / "model", seed=0)
    sizes = ["--kvd-backlog-bytes", "1G", "--kvd-checkpoint-bytes", "256M"]
    extra = [*sizes, "--kvd-lookup-timeout", "0.5"]
    log = tmp_path / "server.log"
    with http_server(model, log, kvd_socket=daemon.socket_path, extra=extra) as server:
        answer = chat(server, turn(seed=3, length=300), stream=False)
        wait_for_entry(daemon.socket_path, answer.prompt_tokens)
        assert server.stop() == 0
