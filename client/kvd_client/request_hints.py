"""What a request to kvd-mlx-lm-server asks of kvd for its prompt's caches, read from its body.

Chat and text completions may carry, as other servers' clients already send them:
- `cache_control` on a chat message, or on one of its content parts: `{"type": "ephemeral"}`,
  with `"ttl": "5m"` (the default), `"1h"` or any duration: retain the prompt's prefix
  through that message for the ttl;
- `prompt_cache_retention`: `"24h"` retains the request's prompt for 24 hours; `"in_memory"`
  asks nothing of kvd (the server's memory keeps it as it would);
- `kvd`, this server's own: `{"store": false}` stores nothing of the request (no entry, no
  checkpoint, no segment); `{"retain": "2h"}` retains the prompt as the others do, with
  `"priority": N` (0..255, default 0) ranking it among retained entries.

A duration is a whole number and a unit, `s`, `m`, `h` or `d` ("90s", "5m", "2h"). A hint of
any other form raises ValueError, which the server answers with the 400 it gives any bad
field; a request with none reads as NO_HINTS. The daemon cuts a retention to its
max_retention.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, overload

from kvd_protocol.messages import Retention
from kvd_protocol.summaries import MAX_RETENTION_PRIORITY, MAX_RETENTION_SECONDS

EPHEMERAL_SECONDS: Final = 300.0  # cache_control without a ttl: Anthropic's five minutes
PROMPT_CACHE_RETENTION: Final = {"in_memory": 0.0, "24h": 86_400.0}
KVD_KEYS: Final = frozenset({"store", "retain", "priority"})
_DURATION = re.compile(r"(\d+)([smhd])")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


@dataclass(frozen=True)
class Hints:
    """A request's hints: whether its caches are stored at all; the messages whose prefix
    is retained, each with its seconds (by message index); the seconds the whole prompt is
    retained (0: not); the priority of its retentions. memory: whether the server's memory
    keeps its caches as well (the warm-up's requests, warm_up.py, fill kvd alone)."""

    store: bool = True
    messages: tuple[tuple[int, float], ...] = ()
    prompt_seconds: float = 0.0
    priority: int = 0
    memory: bool = True


NO_HINTS: Final = Hints()


def read_hints(body: Mapping[str, object]) -> Hints:
    """The hints of a chat or text completion request's body; ValueError for a malformed one."""
    store, retain, priority = _kvd(body.get("kvd"))
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in PROMPT_CACHE_RETENTION:
        raise ValueError(
            f"prompt_cache_retention must be one of {', '.join(PROMPT_CACHE_RETENTION)}"
        )
    prompt_seconds = max(retain, PROMPT_CACHE_RETENTION.get(str(retention), 0.0))
    messages = _cache_controls(body.get("messages"))
    if not store and (prompt_seconds or messages):
        raise ValueError("kvd.store false stores nothing: it cannot be retained as well")
    return Hints(store, messages, prompt_seconds, priority)


@overload
def longer(one: Retention, other: Retention | None) -> Retention: ...


@overload
def longer(one: Retention | None, other: Retention | None) -> Retention | None: ...


def longer(one: Retention | None, other: Retention | None) -> Retention | None:
    """The retention that keeps an entry as long as both would: the longer seconds, the
    higher priority."""
    if one is None or other is None:
        return one or other
    return Retention(
        seconds=max(one.seconds, other.seconds), priority=max(one.priority, other.priority)
    )


def duration(text: object, what: str) -> float:
    """Seconds of a duration such as "5m" (see the module); ValueError naming what."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{what} must be a duration such as 90s, 5m, 2h or 1d, not {text!r}")
    seconds = float(int(match[1]) * _UNITS[match[2]])
    if not 0 < seconds <= MAX_RETENTION_SECONDS:
        raise ValueError(f"{what} must be more than 0 and at most 30d")
    return seconds


def _kvd(value: object) -> tuple[bool, float, int]:
    """The kvd extension's store, retain (seconds, 0 for none) and priority."""
    if value is None:
        return True, 0.0, 0
    if not isinstance(value, dict):
        raise ValueError("kvd must be an object")
    unknown = sorted(set(value) - KVD_KEYS)
    if unknown:
        named = ", ".join(map(str, unknown))
        raise ValueError(f"kvd has no {named}: it takes store, retain, priority")
    store = value.get("store", True)
    if not isinstance(store, bool):
        raise ValueError("kvd.store must be true or false")
    retain = duration(value["retain"], "kvd.retain") if "retain" in value else 0.0
    priority = value.get("priority", 0)
    if type(priority) is not int or not 0 <= priority <= MAX_RETENTION_PRIORITY:
        raise ValueError(f"kvd.priority must be a whole number from 0 to {MAX_RETENTION_PRIORITY}")
    return store, retain, priority


def _cache_controls(messages: object) -> tuple[tuple[int, float], ...]:
    """(message index, seconds) of each message that has a cache_control, on itself or on
    one of its content parts (the longest of them)."""
    if not isinstance(messages, list):
        return ()
    found: list[tuple[int, float]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        parts = [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []
        asked = [
            _cache_control(holder["cache_control"], f"messages[{index}]")
            for holder in (message, *parts)
            if "cache_control" in holder
        ]
        if asked:
            found.append((index, max(asked)))
    return tuple(found)


def _cache_control(value: object, where: str) -> float:
    """The seconds one cache_control asks for."""
    what = f"{where}: cache_control"
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise ValueError(f'{what} must be {{"type": "ephemeral"}}, with a ttl or none')
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise ValueError(f"{what} has no {', '.join(map(str, unknown))}: it takes type, ttl")
    return duration(value["ttl"], f"{what}.ttl") if "ttl" in value else EPHEMERAL_SECONDS
