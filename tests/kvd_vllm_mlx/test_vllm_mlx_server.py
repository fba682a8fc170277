"""kvd-vllm-mlx end to end: a real kvd, real vllm-mlx server processes on loopback ports, a tiny
model folder built here, and the openai client at temperature 0. Answers are compared with
stock vllm-mlx's for the same request."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon, kvctl
from http_servers import SETTLE_SECONDS, free_port, http_server, wait_for_entry
from kvd_client.client import Client
from model_folders import build_model_folder, words
from vllm_servers import chat, command, environment, vllm_server

REPOSITORY = Path(__file__).resolve().parents[2]
LOOKUP_TIMEOUT = 0.1  # the server's default
MARGIN = 1.5  # what a loaded 2-core machine may add to a request beside stock's time


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "a", seed=0)


def _status(daemon: Daemon) -> dict[str, Any]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return dict(client.status())


def test_a_restarted_server_restores_the_prompt_from_kvd_and_answers_as_stock(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    text = words(600, seed=11)
    with vllm_server(model, tmp_path / "stock.log", kvd_socket=None) as stock:
        expected = chat(stock, text)
    with vllm_server(model, tmp_path / "first.log", kvd_socket=daemon.socket_path) as first:
        assert chat(first, text) == expected
        assert first.stop() == 0  # SIGTERM: what waits to be stored is sent first
    assert "kvd: 0 prompts restored" in first.logs()
    hits = _status(daemon)["hits"]
    with vllm_server(model, tmp_path / "second.log", kvd_socket=daemon.socket_path) as second:
        assert chat(second, text) == expected
        assert second.stop() == 0
    # All of the prompt but the token whose logits give the first answer token.
    restored = f"kvd: restored {expected.prompt_tokens - 1} of {expected.prompt_tokens} prompt"
    assert restored in second.logs()
    assert _status(daemon)["hits"] == hits + 1


def test_the_server_times_its_prefill_for_the_daemons_cost_policy(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    """The batch's prefill steps are timed: the puts after them carry the model's cost per
    token, which the daemon keeps for the identity."""
    with vllm_server(model, tmp_path / "server.log", kvd_socket=daemon.socket_path) as server:
        chat(server, words(600, seed=18))
        assert server.stop() == 0
    (identity,) = _status(daemon)["identities"]
    assert identity["prefill_ms_per_token"] > 0


def test_two_servers_on_one_daemon_share_their_prompts(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    text = words(500, seed=12)
    with (
        vllm_server(model, tmp_path / "a.log", kvd_socket=daemon.socket_path) as a,
        vllm_server(model, tmp_path / "b.log", kvd_socket=daemon.socket_path) as b,
    ):
        answer = chat(a, text)
        wait_for_entry(daemon.socket_path, answer.prompt_tokens)
        assert chat(b, text) == answer
        b.wait_for_log(f"kvd: restored {answer.prompt_tokens - 1} of {answer.prompt_tokens}")
        status = kvctl(daemon, "status", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        servers = {c["pid"] for c in report["clients"] if c["name"] == "kvd-vllm-mlx"}
        assert servers == {a.process.pid, b.process.pid}
        (identity,) = report["identities"]
        assert identity["name"] == model.name  # the folder it was served from
        assert identity["hits"] == 1


def test_an_entry_kvd_mlx_lm_server_stored_restores_on_kvd_vllm_mlx(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    """The same mlx and the same model folder: one identity, whichever server made it."""
    mlx_lm_python = REPOSITORY / ".venv" / "bin" / "python"
    assert mlx_lm_python.exists(), f"{mlx_lm_python} is missing: make test creates it"
    text = words(500, seed=13)
    with http_server(
        model,
        tmp_path / "mlx_lm.log",
        kvd_socket=daemon.socket_path,
        python=str(mlx_lm_python),
    ) as mlx_lm_server:
        stored = mlx_lm_server.client().chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": text}],
            temperature=0.0,
            max_tokens=12,
        )
        assert stored.usage is not None
        prompt_tokens = stored.usage.prompt_tokens
        wait_for_entry(daemon.socket_path, prompt_tokens)
    with vllm_server(model, tmp_path / "vllm.log", kvd_socket=daemon.socket_path) as vllm:
        reply = chat(vllm, text)
        assert reply.prompt_tokens == prompt_tokens
        vllm.wait_for_log(f"kvd: restored {prompt_tokens - 1} of {prompt_tokens} prompt tokens")


def test_a_hung_daemon_costs_a_request_at_most_the_lookup_deadline(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    with (
        vllm_server(model, tmp_path / "stock.log", kvd_socket=None) as stock,
        vllm_server(model, tmp_path / "kvd.log", kvd_socket=daemon.socket_path) as server,
    ):
        for warm in (stock, server):
            chat(warm, words(200, seed=14))
        with daemon.paused():
            for seed in (15, 16, 17):
                text = words(400, seed=seed)
                started = time.perf_counter()
                expected = chat(stock, text)
                stock_seconds = time.perf_counter() - started
                started = time.perf_counter()
                assert chat(server, text) == expected
                seconds = time.perf_counter() - started
                assert seconds < stock_seconds + LOOKUP_TIMEOUT + MARGIN, (
                    f"{seconds:.2f} s against stock's {stock_seconds:.2f} s"
                )
        assert server.stop() == 0
    assert "the daemon was skipped" in server.logs()


def test_without_continuous_batching_it_refuses_to_start_and_says_why(
    model: Path, tmp_path: Path
) -> None:
    served = command(model, free_port(), str(tmp_path / "kvd.sock"))
    argv = [a for a in served if a != "--continuous-batching"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=environment(tmp_path / "home"),
        timeout=SETTLE_SECONDS * 2,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "kvd-vllm-mlx: error: the tier is under the prefix cache of --continuous-batching: add it"
    )
