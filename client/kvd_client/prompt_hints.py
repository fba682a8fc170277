"""Which request's hints (request_hints.py) a store of kvd-mlx-lm-server's caches follows.

mlx_lm.server stores a request's caches on its generation thread, knowing their tokens only:
the finished turn (prompt and generation), the segments the batched path cuts (prefixes of
the prompt), prefill checkpoints (prefixes too). So each request's prompt is noted with its
hints as it is tokenized, and a store follows the newest noted prompt it extends or is a
prefix of. A request without hints is noted too, so that it never follows an earlier
request's hints for the same prompt. Used from the generation thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvd_protocol.messages import Retention

from .request_hints import Hints, longer

NOTED: Final = 64  # prompts noted: more than the server has under way at once


@dataclass(frozen=True)
class StoreHints:
    """What a store does: whether it is made at all, and the retention it asks for; whether
    the server's memory keeps the caches too."""

    store: bool = True
    retention: Retention | None = None
    memory: bool = True


PLAIN: Final = StoreHints()


@dataclass(frozen=True)
class _Noted:
    prompt: Sequence[int]
    store: bool
    retained: tuple[tuple[int, Retention], ...]  # (the prefix's tokens, its retention)
    memory: bool

    @property
    def hinted(self) -> bool:
        return not self.store or bool(self.retained) or not self.memory

    def related(self, tokens: Sequence[int]) -> bool:
        """Whether tokens extend the prompt or are a prefix of it."""
        length = min(len(tokens), len(self.prompt))
        return tokens[:length] == self.prompt[:length]


class PromptHints:
    """The hints of the last NOTED prompts, looked up by the tokens of a store."""

    def __init__(self) -> None:
        self._noted: deque[_Noted] = deque()
        self._hinted = 0  # of those noted, the ones with hints: none, and a store looks no further

    def noted(self, prompt: Sequence[int], hints: Hints, through: Callable[[int], int]) -> None:
        """A request's prompt and its hints; through(i): the tokens of the prompt's prefix
        through message i."""
        retained = [(through(i), seconds) for i, seconds in hints.messages]
        if hints.prompt_seconds:
            retained.append((len(prompt), hints.prompt_seconds))
        note = _Noted(
            list(prompt),
            hints.store,
            tuple((n, Retention(seconds=s, priority=hints.priority)) for n, s in retained),
            hints.memory,
        )
        if len(self._noted) == NOTED:
            self._hinted -= self._noted.popleft().hinted
        self._noted.append(note)
        self._hinted += note.hinted

    def for_store(self, tokens: Sequence[int]) -> StoreHints:
        """The hints a store of caches holding tokens follows: those of the newest noted
        prompt it extends or is a prefix of; of its retentions, the longest of those whose
        prefix it holds whole."""
        if not self._hinted:
            return PLAIN
        note = next((n for n in reversed(self._noted) if n.related(tokens)), None)
        if note is None:
            return PLAIN
        retention = None
        for prefix, asked in note.retained:
            if prefix <= len(tokens):
                retention = longer(asked, retention)
        return StoreHints(note.store, retention, note.memory)
