"""kvd-mlx-lm-server --kvd-warm-prompts FILE, end to end: a real kvd, real server processes of a
tiny model folder. The prompts are prefilled into kvd once the server answers; the first real
request with such a prefix restores from kvd; a second server given the file writes nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_e2e import report
from daemon_process import Daemon
from http_servers import SETTLE_SECONDS, http_server
from kvd_client.client import Client
from model_folders import build_model_folder, words
from test_server_hints import post

SYSTEM = {"role": "system", "content": words(300, 51)}
WARM: list[dict[str, Any]] = [
    {"messages": [SYSTEM, {"role": "user", "content": words(30, 52)}]},
    {"messages": [{"role": "user", "content": words(200, 53)}], "kvd": {"retain": "1h"}},
]
DONE = re.compile(r"kvd: warm-up done: (\d+) prompts, (\d+) held already, (\d+) prefilled")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "warm", seed=0)


def warm_file(folder: Path, bodies: list[dict[str, Any]]) -> Path:
    path = folder / "warm.jsonl"
    path.write_text("".join(json.dumps(body) + "\n" for body in bodies))
    return path


def warmed(log: str) -> tuple[int, int, int]:
    found = DONE.search(log)
    assert found is not None, log
    prompts, held, stored = map(int, found.groups())
    return prompts, held, stored


def test_warm_prompts_are_prefilled_once_and_the_first_real_request_restores_from_kvd(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    file = warm_file(tmp_path, WARM)
    flags = ["--kvd-warm-prompts", str(file)]
    with http_server(
        model, tmp_path / "one.log", kvd_socket=daemon.socket_path, extra=flags
    ) as one:
        one.wait_for_log("kvd: warm-up done", SETTLE_SECONDS * 4)
        logs = one.logs()
        assert warmed(logs) == (2, 0, 2)
        assert logs.index("Starting httpd") < logs.index("kvd: warm-up 1/2")  # it answered first
        with Client.connect(daemon.socket_path, require=True) as client:
            hits = report(client)["hits"]
            retained = [e for e in client.list_entries() if e.retained_until is not None]
        assert retained  # the second line's hint
        # Another question after the warmed system prompt: its prefix comes from kvd (the
        # warm-up kept nothing in the server's memory).
        question = {"role": "user", "content": words(30, 54)}
        status, answer = post(one, {"messages": [SYSTEM, question]})
        assert status == 200
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        with Client.connect(daemon.socket_path, require=True) as client:
            assert report(client)["hits"] == hits + 1
        assert one.stop() == 0  # what waits to be stored is sent first
    with Client.connect(daemon.socket_path, require=True) as client:
        assert client.flush(SETTLE_SECONDS)
        written = report(client)["bytes_written"]
    with http_server(
        model, tmp_path / "two.log", kvd_socket=daemon.socket_path, extra=flags
    ) as two:
        two.wait_for_log("kvd: warm-up done", SETTLE_SECONDS * 4)
        assert warmed(two.logs()) == (2, 2, 0)
        assert two.stop() == 0
    with Client.connect(daemon.socket_path, require=True) as client:
        assert client.flush(SETTLE_SECONDS)
        assert report(client)["bytes_written"] == written


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "line 2"),
        ('{"prompt": "text"}', "not a chat request body"),
        ('{"messages": [], "kvd": {"store": "no"}}', "kvd.store"),
    ],
)
def test_a_bad_warm_prompts_file_is_a_usage_error_at_start(
    model: Path, tmp_path: Path, line: str, says: str
) -> None:
    file = tmp_path / "warm.jsonl"
    file.write_text(json.dumps(WARM[0]) + "\n" + line + "\n")
    ran = started_with(model, file)
    assert ran.returncode == 2
    assert "--kvd-warm-prompts" in ran.stderr
    assert says in ran.stderr


def test_a_missing_warm_prompts_file_is_a_usage_error(model: Path, tmp_path: Path) -> None:
    ran = started_with(model, tmp_path / "none.jsonl")
    assert ran.returncode == 2
    assert "cannot be read" in ran.stderr


def started_with(model: Path, file: Path) -> subprocess.CompletedProcess[str]:
    """A server started with the warm prompts file (it stops at its usage error)."""
    command = ["-m", "kvd_client.mlx_lm_server", "--model", str(model)]
    return subprocess.run(
        [sys.executable, *command, "--kvd-warm-prompts", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
