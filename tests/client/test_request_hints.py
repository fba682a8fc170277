"""A request's hints for kvd, read from its body (request_hints.py), and the stores that follow
them (prompt_hints.py)."""

from __future__ import annotations

from typing import Any

import pytest
from kvd_client.prompt_hints import NOTED, PLAIN, PromptHints, StoreHints
from kvd_client.request_hints import EPHEMERAL_SECONDS, NO_HINTS, Hints, duration, read_hints
from kvd_protocol.messages import Retention


def test_a_body_without_hints_reads_as_none() -> None:
    assert read_hints({"messages": [{"role": "user", "content": "hi"}], "stream": True}) == NO_HINTS


def test_each_hint_is_read() -> None:
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}},
            {"role": "user", "content": "u"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                    {
                        "type": "text",
                        "text": "b",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    },
                ],
            },
        ],
        "prompt_cache_retention": "24h",
        "kvd": {"retain": "2h", "priority": 3},
    }
    assert read_hints(body) == Hints(
        store=True,
        messages=((0, EPHEMERAL_SECONDS), (2, 3600.0)),
        prompt_seconds=86_400.0,
        priority=3,
    )
    assert read_hints({"kvd": {"store": False}}) == Hints(store=False)
    assert read_hints({"prompt_cache_retention": "in_memory"}) == NO_HINTS


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86_400.0)]
)
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert duration(text, "x") == seconds


@pytest.mark.parametrize("text", ["", "5", "m", "1.5h", "-1h", "0s", "31d", "5 m", 5, None])
def test_anything_else_is_no_duration(text: object) -> None:
    with pytest.raises(ValueError, match="x must be"):
        duration(text, "x")


def hints_of(prompt_seconds: float = 0.0, store: bool = True) -> Hints:
    return Hints(store=store, messages=((0, 60.0),), prompt_seconds=prompt_seconds, priority=2)


def test_a_store_follows_the_newest_prompt_it_extends_or_is_a_prefix_of() -> None:
    book = PromptHints()
    prompt = list(range(100))
    book.noted(prompt, hints_of(prompt_seconds=3600.0), through=lambda index: 40)
    turn = book.for_store([*prompt, 7, 8])
    assert turn == StoreHints(True, Retention(seconds=3600.0, priority=2))
    assert book.for_store(prompt[:50]) == StoreHints(True, Retention(seconds=60.0, priority=2))
    assert book.for_store(prompt[:30]) == StoreHints(True, None)  # short of the prefix
    assert book.for_store([5, *prompt]) == PLAIN  # another prompt
    book.noted(prompt, NO_HINTS, through=lambda index: 0)  # the same prompt, no hints now
    assert book.for_store([*prompt, 7]) == StoreHints(True, None)


def test_a_prompt_that_stores_nothing_is_forgotten_after_noted_others() -> None:
    book = PromptHints()
    book.noted([1, 2, 3], Hints(store=False), through=lambda index: 0)
    assert not book.for_store([1, 2, 3, 4]).store
    for n in range(NOTED):
        book.noted([100 + n], NO_HINTS, through=lambda index: 0)
    assert book.for_store([1, 2, 3, 4]) == PLAIN
