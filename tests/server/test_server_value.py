"""What kvd is worth, as a real daemon and real kvd-mlx-lm-server processes (tiny model
folders built here) tell it: lookups the server's own memory served are engine-held, not
misses; a restarted server's restores are hits, and the prefill seconds they saved match
them in the daemon's status and in the server's exit summary; models are named by where they
came from, and the README's ColdTier sample keys a model as the server does."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import mlx_lm
import pytest
from daemon_process import Daemon, kvctl
from http_servers import chat, http_server, turn, wait_for_entry
from kvd_client.client import Client
from kvd_client.mlx_lm_cache import ColdTier
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
    log = tmp_path / "server.log"
    with http_server(model, log, kvd_socket=daemon.socket_path) as server:
        _three_turns(server, turn(seed=81, length=300))
        assert server.stop() == 0
    # The server's own account says the same.
    assert (
        "3 lookups found nothing longer than memory (0 with the daemon unavailable, 2 while "
        "memory held part of the prompt: engine-held)"
    ) in log.read_text()
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


@pytest.mark.parametrize("own_prefill", [False, True], ids=["daemons-cost", "own-cost"])
def test_a_restarted_servers_restores_are_hits_and_the_prefill_they_saved(
    daemon: Daemon, model: Path, tmp_path: Path, own_prefill: bool
) -> None:
    """The exit summary values the restores at the prefill cost the server measured, or,
    when it timed none (its restore left a few tokens to compute), at the daemon's."""
    messages = turn(seed=83, length=1200)
    with http_server(model, tmp_path / "first.log", kvd_socket=daemon.socket_path) as first:
        answer = chat(first, messages, stream=False)  # its prefill is measured
        assert first.stop() == 0
    assert (
        "kvd: 0 prompts restored (0 tokens), no prefill saved;"
        in (tmp_path / "first.log").read_text()
    )
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
        if own_prefill:  # a conversation of its own, so that this server times a prefill too
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
    whose = (
        "this server last measured" if own_prefill else "the daemon has from this model's engines"
    )
    summary = re.search(
        r"kvd: 1 prompts restored \((\d+) tokens\), prefill saved ([\d.]+) s \(the tokens "
        rf"restored at the ([\d.]+) ms a token {whose}\)",
        log.read_text(),
    )
    assert summary is not None, log.read_text()
    tokens, seconds, per_token = int(summary[1]), float(summary[2]), float(summary[3])
    assert tokens == restored.cached_tokens
    assert seconds == pytest.approx(tokens * per_token / 1000, abs=0.01)
    if not own_prefill:  # the daemon's figure, as its status had it at the restore
        assert per_token == pytest.approx(cost_ms, abs=1e-3)
        assert seconds == pytest.approx(mine["prefill_saved_s"], abs=0.01)


@pytest.fixture(scope="module")
def models(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model; a copy of its folder elsewhere (the same files: the same identity); another."""
    root = tmp_path_factory.mktemp("more-models")
    copy = root / "elsewhere" / model.name
    shutil.copytree(model, copy)
    return {"model": model, "copy": copy, "other": build_model_folder(root / "Other-tiny", seed=1)}


def test_models_are_named_by_their_source_in_status_list_show_metrics_and_the_log(
    daemon: Daemon, models: dict[str, Path], tmp_path: Path
) -> None:
    logs = {name: tmp_path / f"{name}.log" for name in models}
    messages = turn(seed=87, length=300)
    with (
        http_server(models["model"], logs["model"], kvd_socket=daemon.socket_path) as one,
        http_server(models["other"], logs["other"], kvd_socket=daemon.socket_path) as other,
    ):
        for server in (one, other):
            wait_for_entry(daemon.socket_path, chat(server, messages, stream=False).prompt_tokens)
        status = _status(daemon)
        shown = kvctl(daemon, "status").stdout
        pids = {"model": one.process.pid, "other": other.process.pid}
    with http_server(models["copy"], logs["copy"], kvd_socket=daemon.socket_path) as copy:
        restored = chat(copy, messages, stream=False)  # the same files: the same entries
        assert restored.cached_tokens == restored.prompt_tokens - 1
    names = {i["name"]: i for i in _status(daemon)["identities"]}
    assert sorted(names) == ["Llama-tiny", "Other-tiny"]
    assert names["Llama-tiny"]["hits"] == 1
    # Each server once among the clients, with the model it serves.
    for name, source in (("model", "Llama-tiny"), ("other", "Other-tiny")):
        (client,) = [c for c in status["clients"] if c["pid"] == pids[name]]
        assert client["connections"] == 2  # its lookups' and its puts'
        assert client["identities"] == [names[source]["identity"]]
        assert re.search(rf"^kvd-mlx-lm-server +{source} +{pids[name]}$", shown, re.M), shown
        model_id = names[source]["model_id"]
        assert f"kvd: model {source} ({model_id}) is served from" in logs[name].read_text()
    assert f"kvd: model Llama-tiny ({names['Llama-tiny']['model_id']})" in logs["copy"].read_text()
    listed = json.loads(kvctl(daemon, "list", "--json").stdout)
    assert sorted({e["name"] for e in listed}) == ["Llama-tiny", "Other-tiny"]
    assert {line.split()[1] for line in kvctl(daemon, "list").stdout.splitlines()[1:]} == set(names)
    entry = next(e for e in listed if e["name"] == "Other-tiny")
    assert re.search(r"^name +Other-tiny$", kvctl(daemon, "show", entry["id"]).stdout, re.M)
    assert json.loads(kvctl(daemon, "show", entry["id"], "--json").stdout)["name"] == "Other-tiny"
    metrics = kvctl(daemon, "metrics").stdout
    assert re.search(r"^kvd_clients 1\.0$", metrics, re.M)  # kvctl, the servers gone
    assert re.search(r"^kvd_client_connections 1\.0$", metrics, re.M)
    assert 'name="Llama-tiny"' in metrics
    assert 'name="Other-tiny"' in metrics


def test_the_readme_samples_identity_is_the_servers_for_the_same_model(
    daemon: Daemon, models: dict[str, Path], tmp_path: Path
) -> None:
    """`ColdTier(client, model, tokenizer)` keys by the folder's content, as the server does:
    the same identity from the folder and from its copy, named by its source."""
    with http_server(models["model"], tmp_path / "server.log", kvd_socket=daemon.socket_path) as s:
        wait_for_entry(
            daemon.socket_path, chat(s, turn(seed=88, length=200), stream=False).prompt_tokens
        )
    (served,) = _status(daemon)["identities"]
    for folder in (models["model"], models["copy"]):
        model, tokenizer = mlx_lm.load(str(folder))[:2]
        with (
            Client.connect(daemon.socket_path) as client,
            ColdTier(client, model, tokenizer) as tier,
        ):
            identity = tier.identity.to_protocol()
        assert identity.digest() == served["identity"]
        assert identity.trait_map()["source"] == "Llama-tiny"
