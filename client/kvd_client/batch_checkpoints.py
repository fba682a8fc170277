"""Prefill checkpoints on mlx-lm's batched path (BatchGenerator, mlx_lm_server.py).

mlx_lm.server's batched generation prefills each sequence segment by segment (its system and
user segments, whose caches it keeps) and stops a sequence at every segment end, which its
next() reports. The checkpoint positions of a prompt (ColdTier.checkpoint_positions) become
segment ends of their own: when a prefill step ends at one, the sequence's cache is taken from
the batch and stored as a prefill checkpoint, and the server is told no segment ended there
(it keeps the caches of its own segments, one per end it sees).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from .link import MIN_MEASURED_PREFILL
from .mlx_lm_cache import ColdTier


@dataclass
class _Cuts:
    cached: int  # the tokens the sequence's cache had when it was inserted
    at: deque[int]  # the checkpoint positions its prefill has still to reach


class BatchCheckpoints:
    """The checkpoint cuts of the sequences of one BatchGenerator, and the batched prefill
    rate it measures. Used from the generation thread only."""

    def __init__(self) -> None:
        self._cuts: dict[int, _Cuts] = {}
        self._tokens = 0  # prefill measured and not yet told to the tier
        self._seconds = 0.0

    def cut(
        self, cold: ColdTier, segments: list[list[int]], cached: Sequence[int], cache: Any
    ) -> tuple[list[list[int]], list[int]]:
        """A sequence's segments (what follows the cached tokens its cache holds; None: a
        fresh one) cut at the prompt's checkpoint positions, and the positions that cut a
        segment (one that ends a segment is the server's own)."""
        prompt = [*cached, *chain.from_iterable(segments)]
        if min(prompt, default=0) < 0:  # image patches: not stored
            return segments, []
        return cut_segments(
            segments, len(cached), cold.checkpoint_positions(prompt, len(cached), cache)
        )

    def inserted(self, uid: int, cached: int, at: list[int]) -> None:
        if at:
            self._cuts[uid] = _Cuts(cached, deque(at))

    def reached(self, responses: Sequence[Any]) -> dict[int, int]:
        """Of the prompt responses of a step, those whose segment ended at a checkpoint
        position, by uid with the position; each is set to no segment end."""
        found: dict[int, int] = {}
        for response in responses:
            cuts = self._cuts.get(response.uid)
            if cuts is None or not response.end_of_segment or response.end_of_prompt:
                continue
            if cuts.cached + response.progress[0] == cuts.at[0]:
                found[response.uid] = cuts.at.popleft()
                response.end_of_segment = False
                if not cuts.at:
                    del self._cuts[response.uid]
        return found

    def forget(self, uids: Sequence[int]) -> None:
        """Sequences removed from the batch."""
        for uid in uids:
            self._cuts.pop(uid, None)

    def measured(self, cold: ColdTier, tokens: int, seconds: float) -> None:
        """A step's prefill: told to the tier once enough was measured to be a rate."""
        self._tokens += tokens
        self._seconds += seconds
        if self._tokens >= MIN_MEASURED_PREFILL:
            cold.measured_prefill_time(self._tokens, self._seconds)
            self._tokens, self._seconds = 0, 0.0


def cut_segments(
    segments: list[list[int]], start: int, at: Sequence[int]
) -> tuple[list[list[int]], list[int]]:
    """segments (the prompt from token start on) cut at the positions of at (ascending)
    inside them, and those positions."""
    cut: list[list[int]] = []
    inside: list[int] = []
    position = start
    for segment in segments:
        end = position + len(segment)
        begin = 0
        for point in at:
            if position < point < end:
                cut.append(segment[begin : point - position])
                inside.append(point)
                begin = point - position
        cut.append(segment[begin:])
        position = end
    return cut, inside
