"""What kvd is worth, as a real daemon and real kvd-mlx-lm-server processes (tiny model
folders built here) tell it: lookups the server's own memory served are engine-held, not
misses; a restarted server's restores are hits, and the prefill seconds they saved match
them in the daemon's status and in the server's exit summary."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon, kvctl
from http_servers import chat, http_server, turn, wait_for_entry
from model_folders import build_model_folder, words

Messages = list[dict[str, str]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "Llama-tiny", seed=0)


def _status(daemon: Daemon) -> dict[str, Any]:
    done = kvctl(daemon, "status", "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def _only_identity(status: dict[str, Any]) -> dict[str, Any]:
    (found,) = status["identities"]
    return dict(found)


def _three_turns(server: Any, messages: Messages) -> Messages:
    """Three turns of one conversation on one server: the later two from its memory."""
    for number in range(3):
        answer = chat(server, messages, stream=False)
        if number:
            assert answer.cached_tokens > 0  # the server's memory held the conversation
        messages = [
            *messages,
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": words(40, seed=90 + number)},
        ]
    return messages


def test_a_conversation_served_from_the_servers_memory_is_engine_held_not_missed(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    with http_server(model, tmp_path / "server.log", kvd_socket=daemon.socket_path) as server:
        _three_turns(server, turn(seed=81, length=300))
        assert server.stop() == 0
    status = _status(daemon)
    mine = _only_identity(status)
    # The first turn found nothing anywhere; the next two, only what memory held already.
    assert (status["hits"], status["misses"], status["engine_held"]) == (0, 1, 2)
    assert status["misses_by_reason"] == {"no entry": 1}
    assert (mine["hits"], mine["misses"], mine["engine_held"]) == (0, 1, 2)
    assert mine["misses_by_reason"] == {"no entry": 1}
    shown = kvctl(daemon, "status").stdout
    assert re.search(r"^lookups +0 hits, 1 misses \(0\.0%\); 2 engine-held", shown, re.M), shown
    assert re.search(r"^misses +no entry 1$", shown, re.M), shown
    assert "hits  engine-held  misses  hit %" in shown
    # The identity's row: entries, bytes, then 0 hits, 2 engine-held, 1 miss, 0.0%.
    digest = mine["identity"][:12]
    row = rf"^\S+ +{digest} +\d+ +[\d.]+ \S+ +0 +2 +1 +0\.0% .* no entry 1$"
    assert re.search(row, shown, re.M), shown


def test_a_restarted_servers_restores_are_hits_and_the_prefill_they_saved(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    messages = turn(seed=83, length=1200)
    with http_server(model, tmp_path / "first.log", kvd_socket=daemon.socket_path) as first:
        answer = chat(first, messages, stream=False)  # its prefill is measured
        assert first.stop() == 0
    before = _only_identity(_status(daemon))
    cost_ms = before["prefill_ms_per_token"]
    assert cost_ms is not None
    assert cost_ms > 0
    assert (before["hits"], before["prefill_saved_s"]) == (0, 0)
    messages += [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": words(40, seed=84)},
    ]
    log = tmp_path / "second.log"
    with http_server(model, log, kvd_socket=daemon.socket_path) as second:
        restored = chat(second, messages, stream=False)
        assert restored.cached_tokens >= answer.prompt_tokens
        # A conversation of its own, so that this server times a prefill too.
        fresh = chat(second, turn(seed=85, length=600), stream=False)
        wait_for_entry(daemon.socket_path, fresh.prompt_tokens)
        assert second.stop() == 0
    status = _status(daemon)
    mine = _only_identity(status)
    assert mine["hits"] == mine["restores"] == status["restores"] == 1
    assert mine["tokens_restored"] == restored.cached_tokens
    saved = restored.cached_tokens * cost_ms / 1000
    assert mine["prefill_saved_s"] == pytest.approx(saved, abs=2e-3)
    assert status["prefill_saved_s"] == status["prefill_saved_s_24h"] == mine["prefill_saved_s"]
    assert mine["prefill_saved_estimated_s"] == 0
    shown = kvctl(daemon, "status").stdout
    assert re.search(rf"^prefill saved +{mine['prefill_saved_s']:.2f} s since start", shown, re.M)
    summary = re.search(
        r"kvd: 1 prompts restored \((\d+) tokens\), prefill saved ([\d.]+) s \(the tokens "
        r"restored at the ([\d.]+) ms a token this server last measured\)",
        log.read_text(),
    )
    assert summary is not None, log.read_text()
    tokens, seconds, per_token = int(summary[1]), float(summary[2]), float(summary[3])
    assert tokens == restored.cached_tokens
    assert seconds == pytest.approx(tokens * per_token / 1000, abs=0.01)
