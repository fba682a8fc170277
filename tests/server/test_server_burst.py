"""kvd-mlx-lm-server under a burst: many conversations at once on the batched path, then a
restart; and the single-request path (a request with a seed). Real kvd, real server
processes, tiny model folders built here, the openai client at temperature 0.

"Resumed from its whole last turn" is exact: the tokens restored for a conversation's next
turn are the common prefix of the new prompt and the last turn's prompt + answer, as the
model's own tokenizer and chat template make them (all but the prompt's last token at most)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon
from http_servers import Answer, HttpServer, chat, http_server
from mlx_lm.tokenizer_utils import load as load_tokenizer
from model_folders import build_model_folder, words

Messages = list[dict[str, str]]
BURST = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("models") / "m", seed=0)


def _opening(i: int) -> Messages:
    return [
        {"role": "system", "content": words(200, seed=100 + i)},
        {"role": "user", "content": words(250, seed=200 + i)},
    ]


def _next_turn(messages: Messages, answer: Answer, i: int) -> Messages:
    return [
        *messages,
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": words(30, seed=300 + i)},
    ]


def _prompt_ids(model: Path, messages: Messages) -> list[int]:
    tokenizer: Any = load_tokenizer(model)  # mlx-lm ships no type hints
    ids: list[int] = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return ids


def _whole_turn_restored(model: Path, last: Messages, answer: Answer, now: Messages) -> int:
    """The tokens a restore of the last turn's whole cache (prompt + answer) gives now."""
    assert answer.tokens is not None
    held = [*_prompt_ids(model, last), *answer.tokens]
    asked = _prompt_ids(model, now)
    common = next(
        (k for k, (a, b) in enumerate(zip(held, asked, strict=False)) if a != b),
        min(len(held), len(asked)),
    )
    return min(common, len(asked) - 1)


def _all_at_once(
    server: HttpServer, conversations: Sequence[Messages], **kwargs: object
) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(conversations)
    failures: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            answers[i] = chat(server, list(conversations[i]), stream=False, **kwargs)  # type: ignore[arg-type]
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    return [answer for answer in answers if answer is not None]


def test_after_a_burst_of_conversations_a_restarted_server_resumes_each_from_its_whole_last_turn(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    openings = [_opening(i) for i in range(BURST)]
    with http_server(model, tmp_path / "first.log", kvd_socket=daemon.socket_path) as first:
        answers = _all_at_once(first, openings)
        assert first.stop() == 0  # SIGTERM: what waits to be stored is sent first
    turns = [
        _next_turn(opening, answer, i)
        for i, (opening, answer) in enumerate(zip(openings, answers, strict=True))
    ]
    with http_server(model, tmp_path / "second.log", kvd_socket=daemon.socket_path) as second:
        resumed = [chat(second, turn, stream=False) for turn in turns]
    wanted = [
        _whole_turn_restored(model, opening, answer, turn)
        for opening, answer, turn in zip(openings, answers, turns, strict=True)
    ]
    assert [answer.cached_tokens for answer in resumed] == wanted


def test_a_request_on_the_single_request_path_is_restored_by_a_restarted_server(
    daemon: Daemon, model: Path, tmp_path: Path
) -> None:
    opening = _opening(BURST)
    with http_server(model, tmp_path / "first.log", kvd_socket=daemon.socket_path) as first:
        answer = chat(first, opening, stream=False, seed=7)
        assert first.stop() == 0
    turn = _next_turn(opening, answer, BURST)
    with http_server(model, tmp_path / "second.log", kvd_socket=daemon.socket_path) as second:
        again = chat(second, turn, stream=False, seed=7)
    assert again.cached_tokens == _whole_turn_restored(model, opening, answer, turn)
