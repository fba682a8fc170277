"""Prefill checkpoints on vllm-mlx's continuous batching (kvd-vllm-mlx).

vllm-mlx's scheduler inserts each request into mlx-lm's BatchGenerator as one prompt (the rest
its prefix cache's lookup left, with the caches the lookup returned), and reads only the
tokens each step generates. mlx-lm ends a segment of its own before a prompt's last token;
the prompt of caches that may become untrimmable is cut at its checkpoint positions too
(ColdTier.checkpoint_positions, batch_checkpoints.py). When a prefill step ends at one of them
or at that prompt boundary, the sequence's caches are taken from the batch and stored: prefill
checkpoints and the prompt boundary (a segment), as kvd-mlx-lm-server's prefill stores them.
The steps' prefill (mlx-lm's own counters of prompt tokens and time) is told to the tier.

Which request a sequence is: a fresh cache (or none) is prefilled with the whole prompt, and a
cache the lookup returned is a RequestCache (TieredMemoryCache.fetch) that knows its tokens.
Any other is stock's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final

from mlx_lm.generate import BatchGenerator as _BatchGenerator

from . import vllm_mlx_hooks
from .backlog import Kind
from .batch_checkpoints import BatchCheckpoints
from .mlx_lm_cache import ColdTier, may_become_untrimmable
from .request_cache import request_tokens
from .server_tier import ServerTier

stock_batch_generator: Any = _BatchGenerator  # mlx-lm ships no type hints for it

# The BatchGenerator's counters of the prompt tokens it computed and the seconds they took.
PREFILL_COUNTERS: Final = ("_prompt_tokens_counter", "_prompt_time_counter")


class TieredBatchGenerator(stock_batch_generator):  # type: ignore[misc]
    """mlx-lm's BatchGenerator as vllm-mlx drives it, storing the prefill checkpoints and the
    prompt boundary of the sequences of a model the tier serves, and measuring its prefill.
    Used from the thread that owns the model only."""

    def __init__(self, model: Any, *args: Any, tier: ServerTier, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        vllm_mlx_hooks.check_attributes(self, PREFILL_COUNTERS, "mlx-lm's BatchGenerator")
        self.tier = tier
        self._checkpoints = BatchCheckpoints()
        self._prompts: dict[int, list[int]] = {}  # by uid, while a cut is still to come

    def insert_segments(
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[Any] | None = None,
        all_tokens: list[list[int]] | None = None,
        *options: Any,
        **named: Any,
    ) -> list[int]:
        """mlx-lm's (vllm_mlx_hooks.HOOKS), options and named passed on as given."""
        stock = super().insert_segments
        cold = self.tier.serving(self.model)
        layers = caches or [None for _ in segments]
        if cold is None or all_tokens or len(layers) != len(segments):
            # stock's own, and its errors
            return list(stock(segments, max_tokens, caches, all_tokens, *options, **named))
        cuts = [self._cut(cold, s, cache) for s, cache in zip(segments, layers, strict=True)]
        cut_segments = [cut.segments for cut in cuts]
        uids: list[int] = stock(cut_segments, max_tokens, caches, all_tokens, *options, **named)
        for uid, cut in zip(uids, cuts, strict=True):
            if cut.at:
                self._checkpoints.inserted(uid, cut.start, cut.at)
                self._prompts[uid] = cut.tokens
        return uids

    def next(self) -> tuple[list[Any], list[Any]]:
        counted = self._prompt_tokens_counter, self._prompt_time_counter
        prompt_responses, generation_responses = super().next()
        cold = self.tier.serving(self.model)
        if cold is None:
            return prompt_responses, generation_responses
        tokens = self._prompt_tokens_counter - counted[0]
        if tokens:
            self._checkpoints.measured(cold, tokens, self._prompt_time_counter - counted[1])
        reached = self._checkpoints.reached(prompt_responses)
        if reached:
            for uid, (cache, held) in self.extract_cache(list(reached)).items():
                self._store(cold, uid, reached[uid], cache, held)
        return prompt_responses, generation_responses

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        self._checkpoints.forget(uids)
        for uid in uids:
            self._prompts.pop(uid, None)
        return super().remove(uids, return_prompt_caches)

    def _cut(self, cold: ColdTier, segments: list[list[int]], cache: Any) -> _Cut:
        """A sequence's segments cut at its checkpoint positions, and where it is stored:
        the positions that cut a segment, then the prompt boundary."""
        request = request_tokens(list(chain.from_iterable(segments)), cache or [])
        if request is None:
            return _Cut(segments, [], 0, [])
        tokens, start = request
        layers = self._make_new_cache() if cache is None else cache
        cut, at = self._checkpoints.cut(cold, segments, tokens[:start], layers)
        # mlx-lm ends a segment before the last token of a last segment of more than one.
        if may_become_untrimmable(layers) and len(cut[-1]) > 1:
            at.append(len(tokens) - 1)
        return _Cut(cut, tokens, start, at)

    def _store(
        self, cold: ColdTier, uid: int, position: int, cache: list[Any], held: Sequence[int]
    ) -> None:
        """The caches of sequence uid, which its prefill brought to position (held: the
        tokens the batch computed of it)."""
        tokens = self._prompts[uid]
        if position == len(tokens) - 1:  # the prompt boundary: the last of its positions
            del self._prompts[uid]
            kind = Kind.SEGMENT
        else:
            kind = Kind.PREFILL_CHECKPOINT
        if list(held) == tokens[position - len(held) : position]:
            cold.store(tokens[:position], cache, kind=kind)


@dataclass(frozen=True)
class _Cut:
    segments: list[list[int]]  # what is inserted
    tokens: list[int]  # the request's prompt
    start: int  # the tokens of it the caches inserted hold
    at: list[int]  # where the prefill stores the caches
