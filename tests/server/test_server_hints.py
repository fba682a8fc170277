"""kvd-mlx-lm-server honours a request's hints for kvd (request_hints.py), end to end: a real
kvd, a real server process of a tiny model folder, raw HTTP requests. What to retain shows
in kvctl list; "do not store" writes nothing; a malformed hint is a 400 and stores nothing."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_e2e import report, wait_until
from daemon_process import Daemon, kvctl, running_daemon
from http_servers import SETTLE_SECONDS, HttpServer, http_server
from kvd_client.client import Client
from kvd_protocol.messages import EntrySummary
from model_folders import build_model_folder, words


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "hinted", seed=0)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("kvd")) as running:
        yield running


@pytest.fixture(scope="module")
def server(
    model: Path, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with http_server(model, log, kvd_socket=daemon.socket_path) as running:
        yield running


def post(
    server: HttpServer, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, dict[str, Any]]:
    """The status and the JSON answer of a request (greedy, a few tokens)."""
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps({"max_tokens": 4, "temperature": 0.0, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


STOCK_BAD_FIELD: dict[str, Any] = {"temperature": "hot"}  # a bad field of mlx_lm.server's own


def refusal(
    server: HttpServer, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, str] | None:
    """The status and error text of a request; None when the server closed the connection
    without an answer, as mlx-lm 0.32.0 does for any bad field (0.32.2 answers 400)."""
    try:
        status, answer = post(server, body, path)
    except http.client.RemoteDisconnected:
        return None
    return status, str(answer.get("error", ""))


def user(seed: int, length: int = 300, **extra: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": words(length, seed), **extra}]


def entries(daemon: Daemon) -> list[EntrySummary]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return list(client.list_entries())


def bytes_written(daemon: Daemon) -> int:
    with Client.connect(daemon.socket_path, require=True) as client:
        written: int = report(client)["bytes_written"]
        return written


def stored_after(daemon: Daemon, known: set[str], prompt_tokens: int) -> list[EntrySummary]:
    """The entries stored since known (ids) once one holds the whole prompt."""

    def new() -> list[EntrySummary]:
        found = [e for e in entries(daemon) if e.id not in known and e.durable]
        return found if any(e.tokens >= prompt_tokens for e in found) else []

    return wait_until(new, "the request's turn to be stored")


@pytest.mark.parametrize(
    ("hint", "says"),
    [
        ({"kvd": {"store": "no"}}, "kvd.store"),
        ({"kvd": {"keep": True}}, "kvd has no keep"),
        ({"kvd": {"retain": "2 hours"}}, "kvd.retain"),
        ({"kvd": {"retain": "2h", "priority": 300}}, "kvd.priority"),
        ({"kvd": {"store": False, "retain": "2h"}}, "stores nothing"),
        ({"kvd": []}, "kvd must be an object"),
        ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
        ({"messages": user(1, 20, cache_control={"type": "persistent"})}, "cache_control"),
        ({"messages": user(1, 20, cache_control={"type": "ephemeral", "ttl": "forever"})}, "ttl"),
    ],
)
def test_a_malformed_hint_is_a_400_and_stores_nothing(
    server: HttpServer, daemon: Daemon, hint: dict[str, Any], says: str
) -> None:
    written = bytes_written(daemon)
    stock = refusal(server, {"messages": user(seed=2, length=20), **STOCK_BAD_FIELD})
    ours = refusal(server, {"messages": user(seed=2, length=20), **hint})
    assert (ours is None) == (stock is None)  # mlx-lm 0.32.0 answers a bad field with none
    if ours is not None:
        assert stock is not None
        assert stock[0] == 400  # stock's answer to a bad field
        assert ours[0] == 400
        assert says in ours[1]
    assert bytes_written(daemon) == written


def test_a_text_completion_takes_the_hints_too(server: HttpServer) -> None:
    stock = refusal(server, {"prompt": "cache", **STOCK_BAD_FIELD}, "/v1/completions")
    ours = refusal(server, {"prompt": "cache", "kvd": {"retain": "soon"}}, "/v1/completions")
    assert (ours is None) == (stock is None)
    if ours is not None:
        assert (ours[0], "kvd.retain" in ours[1]) == (400, True)
    status, _ = post(server, {"prompt": words(50, 3), "kvd": {"retain": "1h"}}, "/v1/completions")
    assert status == 200


@pytest.mark.parametrize("path", ["batched", "single"])
def test_a_request_that_stores_nothing_writes_nothing_and_the_next_stores_as_usual(
    model: Path, tmp_path: Path, path: str
) -> None:
    """Counted once the server stopped (it sends what waits to be stored first) and the daemon
    flushed: nothing can come later. A request with a seed takes mlx_lm.server's
    single-request path, the others its batched one."""
    plain: dict[str, Any] = {"messages": user(seed=5), **({"seed": 1} if path == "single" else {})}
    unstored = {**plain, "kvd": {"store": False}}
    with running_daemon(tmp_path / "kvd") as kvd:
        assert served(model, kvd, tmp_path / "one.log", [unstored])[:2] == (0, 0)
        with Client.connect(kvd.socket_path, require=True) as client:
            assert report(client)["bytes_written"] == 0
        # The same prompt as usual next, on the same server: stored, and as something new.
        written, held, prompt = served(model, kvd, tmp_path / "two.log", [unstored, plain])
        assert written > 0
        assert held >= prompt
        with Client.connect(kvd.socket_path, require=True) as client:
            assert report(client)["duplicates"] == 0


def served(
    model: Path, kvd: Daemon, log: Path, bodies: list[dict[str, Any]]
) -> tuple[int, int, int]:
    """The bytes the daemon wrote for the requests a new server answered, and the most tokens
    an entry of them holds, once the server stopped and the daemon flushed; and the last
    request's prompt tokens."""
    with Client.connect(kvd.socket_path, require=True) as client:
        before = report(client)["bytes_written"]
        known = {e.id for e in client.list_entries()}
    with http_server(model, log, kvd_socket=kvd.socket_path) as server:
        for body in bodies:
            status, answer = post(server, body)
            assert status == 200
        assert server.stop() == 0
    with Client.connect(kvd.socket_path, require=True) as client:
        assert client.flush(SETTLE_SECONDS)
        written = report(client)["bytes_written"] - before
        tokens = [e.tokens for e in client.list_entries() if e.id not in known]
    return written, max(tokens, default=0), answer["usage"]["prompt_tokens"]


def test_cache_control_and_prompt_cache_retention_show_in_kvctl_list(
    server: HttpServer, daemon: Daemon
) -> None:
    known = {e.id for e in entries(daemon)}
    messages = [
        {
            "role": "system",
            "content": words(200, 7),
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        },
        {"role": "user", "content": [{"type": "text", "text": words(50, 8)}]},
    ]
    before = time.time()
    status, answer = post(server, {"messages": messages})
    assert status == 200
    stored = stored_after(daemon, known, answer["usage"]["prompt_tokens"])
    ends = [e.retained_until for e in stored if e.retained_until is not None]
    assert ends
    assert all(before + 3600 <= end <= time.time() + 3600 for end in ends)
    known |= {e.id for e in stored}
    status, answer = post(server, {"messages": user(seed=9), "prompt_cache_retention": "24h"})
    assert status == 200
    stored = stored_after(daemon, known, answer["usage"]["prompt_tokens"])
    turn = max(stored, key=lambda e: e.tokens)
    assert turn.retained_until is not None
    assert turn.retained_until >= before + 86_400 - 1
    shown = kvctl(daemon, "list")
    assert " p0 " in shown.stdout
    assert any(row.split()[0] == turn.id and "24h p0" in row for row in shown.stdout.splitlines())


def test_a_retention_asked_for_expires(server: HttpServer, daemon: Daemon) -> None:
    known = {e.id for e in entries(daemon)}
    status, answer = post(
        server, {"messages": user(seed=12), "kvd": {"retain": "5s", "priority": 9}}
    )
    assert status == 200
    stored = stored_after(daemon, known, answer["usage"]["prompt_tokens"])
    turn = max(stored, key=lambda e: e.tokens)
    assert turn.retention_priority == 9
    assert turn.retained_until is not None

    def ended() -> bool:
        return all(e.retained_until is None for e in entries(daemon) if e.id == turn.id)

    wait_until(ended, "the retention to end")


def test_a_retained_prompt_outlives_cap_pressure_that_evicts_an_unretained_one(
    model: Path, tmp_path: Path
) -> None:
    """Two prompts of about the same size, the retained one first (older): the daemon restarted
    with a cap that holds one of their turns only keeps the retained one, which the next
    server restores; least recently used alone would have kept the other."""
    with running_daemon(tmp_path / "kvd") as kvd:
        with http_server(model, tmp_path / "one.log", kvd_socket=kvd.socket_path) as one:
            status, kept = post(one, {"messages": user(seed=21), "kvd": {"retain": "1h"}})
            assert status == 200
            status, other = post(one, {"messages": user(seed=22)})
            assert status == 200
            assert abs(kept["usage"]["prompt_tokens"] - other["usage"]["prompt_tokens"]) < 10
            assert one.stop() == 0  # what waits to be stored is sent first
        listed = entries(kvd)
        (retained,) = [e for e in listed if e.retained_until is not None]
        unretained_turn = max(
            (e for e in listed if e.retained_until is None), key=lambda e: (e.tokens, e.created)
        )
        assert abs(unretained_turn.bytes - retained.bytes) < retained.bytes // 20
        assert kvd.stop() == 0
        kvd.flags += ["--max-bytes", str(retained.bytes + retained.bytes // 2)]
        kvd.start()
        left = {e.id for e in entries(kvd)}
        assert retained.id in left
        assert unretained_turn.id not in left
        with http_server(model, tmp_path / "two.log", kvd_socket=kvd.socket_path) as two:
            status, again = post(two, {"messages": user(seed=21)})
            assert status == 200
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
