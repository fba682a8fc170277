"""kvd-mlx-lm-server end to end: a real kvd, real server processes on loopback ports, tiny
model folders built here, and the openai client at temperature 0. Every answer is compared
with stock mlx_lm.server's for the same request."""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon
from http_servers import (
    SETTLE_SECONDS,
    Answer,
    HttpServer,
    chat,
    http_server,
    turn,
    wait_for_entry,
)
from kvd_client.client import Client
from model_folders import build_model_folder, words


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a: a model; a_copy: the same files in another folder; b: same architecture and
    tokenizer, other weights."""
    root = tmp_path_factory.mktemp("models")
    a = build_model_folder(root / "a", seed=0)
    a_copy = root / "elsewhere" / "a"
    shutil.copytree(a, a_copy)
    return {"a": a, "a_copy": a_copy, "b": build_model_folder(root / "b", seed=1)}


@pytest.fixture(scope="module")
def stock_a(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Stock mlx_lm.server of model a, without kvd: the answers to match."""
    with http_server(models["a"], tmp_path_factory.mktemp("stock") / "a.log", kvd_socket=None) as s:
        yield s


def _kvd_status(daemon: Daemon) -> dict[str, Any]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return dict(client.status())


def _same_answer(answer: Answer, expected: Answer) -> None:
    assert answer.text == expected.text
    if answer.tokens is not None and expected.tokens is not None:
        assert answer.tokens == expected.tokens
    assert answer.prompt_tokens == expected.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_restarted_server_restores_the_prompt_from_kvd_and_answers_as_stock(
    daemon: Daemon, models: dict[str, Path], stock_a: HttpServer, tmp_path: Path, stream: bool
) -> None:
    messages = turn(seed=11, length=1500)
    expected = chat(stock_a, messages, stream=False)
    with http_server(models["a"], tmp_path / "first.log", kvd_socket=daemon.socket_path) as first:
        answer = chat(first, messages, stream=False)
        _same_answer(answer, expected)
        assert answer.cached_tokens == 0
        assert first.stop() == 0  # SIGTERM: what waits to be stored is sent first
    hits = _kvd_status(daemon)["hits"]
    with http_server(models["a"], tmp_path / "second.log", kvd_socket=daemon.socket_path) as second:
        again = chat(second, messages, stream=stream)
        _same_answer(again, expected)
        # All of the prompt but the token whose logits give the first answer token.
        assert again.cached_tokens == again.prompt_tokens - 1
        assert second.stop() == 0
    assert _kvd_status(daemon)["hits"] > hits


def test_the_second_turn_sent_to_another_server_of_the_same_model_is_restored(
    daemon: Daemon, models: dict[str, Path], stock_a: HttpServer, tmp_path: Path
) -> None:
    """Two processes at once; the second of another folder holding the same files."""
    turn1 = turn(seed=21, length=800)
    with (
        http_server(models["a"], tmp_path / "one.log", kvd_socket=daemon.socket_path) as one,
        http_server(models["a_copy"], tmp_path / "two.log", kvd_socket=daemon.socket_path) as two,
    ):
        first = chat(one, turn1, stream=False)
        wait_for_entry(daemon.socket_path, first.prompt_tokens)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": words(200, seed=22)},
        ]
        hits = _kvd_status(daemon)["hits"]
        second = chat(two, turn2, stream=True)
        _same_answer(second, chat(stock_a, turn2, stream=True))
        assert second.cached_tokens >= first.prompt_tokens  # the whole first turn's prompt
        assert _kvd_status(daemon)["hits"] == hits + 1


def test_a_model_with_other_weights_is_never_served_the_first_models_entries(
    daemon: Daemon, models: dict[str, Path], tmp_path: Path
) -> None:
    messages = turn(seed=31, length=600)
    with http_server(models["a"], tmp_path / "a.log", kvd_socket=daemon.socket_path) as a:
        stored = chat(a, messages, stream=False)
        wait_for_entry(daemon.socket_path, stored.prompt_tokens)
    hits = _kvd_status(daemon)["hits"]
    with (
        http_server(models["b"], tmp_path / "stock-b.log", kvd_socket=None) as stock_b,
        http_server(models["b"], tmp_path / "b.log", kvd_socket=daemon.socket_path) as b,
    ):
        answer = chat(b, messages, stream=False)
        _same_answer(answer, chat(stock_b, messages, stream=False))
        assert answer.cached_tokens == 0
        wait_for_entry(daemon.socket_path, answer.prompt_tokens)
    status = _kvd_status(daemon)
    assert status["hits"] == hits
    assert len(status["identities"]) == 2


def test_requests_are_answered_correctly_while_kvd_is_killed_and_restarted(
    daemon: Daemon, models: dict[str, Path], stock_a: HttpServer, tmp_path: Path
) -> None:
    long_turn = turn(seed=41, length=3000)
    expected = chat(stock_a, long_turn, stream=False)
    log = tmp_path / "server.log"
    with http_server(models["a"], log, kvd_socket=daemon.socket_path) as server:
        answers: list[Answer] = []
        request = threading.Thread(
            target=lambda: answers.append(chat(server, long_turn, stream=False))
        )
        request.start()
        server.wait_for_log("Prompt processing progress", SETTLE_SECONDS)  # the prefill is on
        daemon.kill()
        request.join(SETTLE_SECONDS)
        assert answers, "the request in flight when kvd died was never answered"
        _same_answer(answers[0], expected)

        while_down = turn(seed=42, length=400)
        _same_answer(chat(server, while_down, stream=True), chat(stock_a, while_down, stream=True))

        daemon.start()
        server.wait_for_log("answers again", SETTLE_SECONDS)  # skipped until the probe finds it
        after = turn(seed=43, length=400)
        answer = chat(server, after, stream=False)
        _same_answer(answer, chat(stock_a, after, stream=False))
        wait_for_entry(daemon.socket_path, answer.prompt_tokens)  # the server reconnected by itself
        assert server.stop() == 0
    with http_server(models["a"], tmp_path / "next.log", kvd_socket=daemon.socket_path) as next_:
        restored = chat(next_, after, stream=False)
        assert restored.cached_tokens == restored.prompt_tokens - 1
        _same_answer(restored, answer)


def test_an_entry_evicted_from_memory_is_restored_from_kvd(
    daemon: Daemon, models: dict[str, Path], stock_a: HttpServer, tmp_path: Path
) -> None:
    first, other = turn(seed=51, length=500), turn(seed=52, length=500)
    log = tmp_path / "server.log"
    with http_server(
        models["a"], log, kvd_socket=daemon.socket_path, extra=["--prompt-cache-size", "1"]
    ) as server:
        stored = chat(server, first, stream=False)
        wait_for_entry(daemon.socket_path, stored.prompt_tokens)
        chat(server, other, stream=False)  # memory holds one cache: this one, now
        again = chat(server, first, stream=False)
    assert again.cached_tokens == again.prompt_tokens - 1
    _same_answer(again, chat(stock_a, first, stream=False))
    assert "kvd: restored" in log.read_text()


def test_a_miss_beside_the_entries_of_other_kv_bits_says_so_at_debug_and_names_both(
    daemon: Daemon, models: dict[str, Path], stock_a: HttpServer, tmp_path: Path
) -> None:
    messages = turn(seed=71, length=400)
    with http_server(
        models["a"], tmp_path / "kv8.log", kvd_socket=daemon.socket_path, extra=["--kv-bits", "8"]
    ) as quantised:
        stored = chat(quantised, messages, stream=False)
        wait_for_entry(daemon.socket_path, stored.prompt_tokens)
    log = tmp_path / "plain.log"
    with http_server(
        models["a"], log, kvd_socket=daemon.socket_path, extra=["--log-level", "DEBUG"]
    ) as plain:
        answer = chat(plain, messages, stream=False)
        _same_answer(answer, chat(stock_a, messages, stream=False))
        assert answer.cached_tokens == 0
    missed = re.search(
        r"lookup missed \(kv differs\): identity ([0-9a-f]{12}) of the same model \((\S+)\) "
        r"holds (\d+) tokens of this (\d+)-token prompt, this one \(([0-9a-f]{12})\) 0: "
        r"they differ by kv (8bit-g64-from\d+), not none",
        log.read_text(),
    )
    assert missed is not None, log.read_text()
    other, model_id, held, prompt, mine, bits = missed.groups()
    assert int(held) == int(prompt) - 1 == answer.prompt_tokens - 1
    identities = {i["identity"][:12]: i for i in _kvd_status(daemon)["identities"]}
    source = models["a"].name  # the folder's name: where the model came from
    assert identities[other]["name"] == f"{source},kv={bits}"
    assert identities[mine]["name"] == f"{source},kv=none"
    assert identities[other]["model_id"] == identities[mine]["model_id"] == model_id
    assert identities[mine]["misses_by_reason"] == {"kv differs": 1}


def test_with_no_daemon_the_server_answers_as_stock(
    models: dict[str, Path], stock_a: HttpServer, tmp_path: Path
) -> None:
    messages = turn(seed=61, length=300)
    nowhere = str(tmp_path / "no-daemon.sock")
    with http_server(models["a"], tmp_path / "server.log", kvd_socket=nowhere) as server:
        expected = chat(stock_a, messages, stream=False)
        for stream in (False, True, False):
            _same_answer(chat(server, messages, stream=stream), expected)
        other = turn(seed=62, length=300)
        _same_answer(chat(server, other, stream=False), chat(stock_a, other, stream=False))
        assert server.stop() == 0
    # The tier's account at exit: the two lookups (the repeats hit memory) and every store
    # were skipped for want of a daemon.
    summary = re.search(
        r"(\d+) lookups found nothing longer than memory \((\d+) with the daemon unavailable, "
        r"0 while memory held part of the prompt: engine-held\); "
        r"0 caches stored, (\d+) skipped",
        (tmp_path / "server.log").read_text(),
    )
    assert summary is not None
    looked, unavailable, skipped = map(int, summary.groups())
    assert looked == unavailable == 2
    assert skipped >= 4


def test_a_conversation_copies_its_rows_about_once_and_the_summary_counts_it(
    daemon: Daemon, models: dict[str, Path], stock_a: HttpServer, tmp_path: Path
) -> None:
    """Three turns after a system message, batched (system and user segments, then the
    finished turn), in blocks of 16 tokens: every answer is stock's, the snapshots copied
    little more than the final context's KV (a row kvd's blocks hold is not copied again,
    segments keep whole blocks), and the exit summary accounts for them."""
    messages = [{"role": "system", "content": words(300, seed=71)}]
    log = tmp_path / "server.log"
    with http_server(
        models["a"], log, kvd_socket=daemon.socket_path, extra=["--kvd-block-tokens", "16"]
    ) as server:
        for turn in range(3):
            messages.append({"role": "user", "content": words(120, seed=72 + turn)})
            answer = chat(server, messages, stream=True)
            _same_answer(answer, chat(stock_a, messages, stream=True))
            messages.append({"role": "assistant", "content": answer.text})
        assert server.stop() == 0
    with Client.connect(daemon.socket_path, require=True) as client:
        listed = client.list_entries()
    # the last turn, which superseded all before it
    assert len(listed) == 1, (
        [(e.tokens, e.trimmable, e.durable, e.leases, e.created) for e in listed],
        [line for line in log.read_text().splitlines() if "kvd" in line][-40:],
    )
    (entry,) = listed
    assert entry.tokens > answer.prompt_tokens
    summary = re.search(
        r"snapshots: (\d+) taken in [\d.]+ ms \(max [\d.]+ ms\), (\d+) bytes copied, (\d+) "
        r"bytes written \((\d+) per request, (\d+) requests\), (\d+) dropped \((\d+) bytes\), "
        r"(\d+) aborted",
        log.read_text(),
    )
    assert summary is not None
    taken, copied, written, per_request, requests, dropped, _, aborted = map(int, summary.groups())
    assert requests == 3
    assert taken >= 3 * 2  # a user segment and a finished turn each, the system segment once
    kv_per_token = 2 * 2 * 2 * 32 * 4  # the model folder's layers, KV heads, head_dim, float32
    assert entry.tokens * kv_per_token <= copied <= 1.25 * entry.tokens * kv_per_token
    assert per_request == written // requests > 0
    assert dropped == aborted == 0
