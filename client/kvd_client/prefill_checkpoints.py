"""Prefill checkpoints: a prompt's caches stored part-way through its prefill, so that a
later prompt that leaves this one at token t restores from the last checkpoint at or before t.

Caches that cannot be trimmed (the recurrent state of Qwen3.5, Qwen3-Next, Nemotron-H, LFM2
and kin; a sliding window that wraps) make an entry serve only prompts that hold all of it:
the entry a turn ends with serves no prompt whose end changed, and re-prefilling 60,000
tokens takes minutes. So while such caches are prefilled, they are stored at every multiple
of an interval N along the prompt (the daemon keeps them as prefill checkpoints: untrimmable
prefixes, evicted before whole turns), and at the prompt boundary as before.

N is the block size times a power of two. So the KV layers of successive checkpoints are whole
blocks the tier shares (each checkpoint copies and writes only the rows since the last one,
snapshots.py), and the positions of prompts with different intervals nest: every multiple of
2N is one of N.

How N is chosen (choose_interval), by cost: a checkpoint writes S bytes of its own (the
untrimmable state: recurrent state, a wrapped window), and a later prompt that diverges past
it saves up to N tokens of prefill over the checkpoint before it, N / R seconds at the
engine's measured prefill rate R. N is the smallest interval for which writing S, at an
assumed WRITE_RATE, costs at most COST_SHARE of that prefill time, and for which a prompt's
checkpoints together write at most prompt_bytes (a setting). For Qwen3-Next-80B (about 74
MiB of state) at 1,000 tokens/s that is 2,048 tokens; a tiny model's few kilobytes make it
one block. An interval given as a setting replaces the rule; 0 turns checkpoints off.

S is measured: once per model by a one-token forward on a scratch cache (for the positions a
prompt's prefill is cut at before any checkpoint of it is taken), then as the largest state
a snapshot of the model's caches took (a sliding window grows to its size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import mlx.core as mx

# The rate an SSD writes a checkpoint's state at, in bytes per second: well under what Apple
# SSDs sustain (3-7 GB/s), leaving room for the rest of the tier's work.
WRITE_RATE: Final = 1e9
# What writing a checkpoint may cost, as a share of the prefill time it saves.
COST_SHARE: Final = 1 / 16
# Tokens per second of prefill assumed until the engine measured its own.
ASSUMED_PREFILL_RATE: Final = 2000.0
# What one prompt's checkpoints may write of their own, by default: 1 GiB holds 14 of
# Qwen3-Next-80B's, a checkpoint every ~4,300 tokens of a 60,000-token prompt.
PROMPT_BYTES: Final = 1 << 30
# The interval's unit when the daemon keeps no blocks (whole entries).
UNIT_TOKENS: Final = 256


@dataclass(frozen=True)
class CheckpointSettings:
    """interval: tokens between prefill checkpoints; None: chosen by cost (choose_interval),
    0: none, else a multiple of the block size. prompt_bytes: what one prompt's checkpoints
    may write of their own (their state), with the interval chosen by cost."""

    interval: int | None = None
    prompt_bytes: int = PROMPT_BYTES

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 0:
            raise ValueError(f"a checkpoint interval of {self.interval} tokens")
        if self.prompt_bytes < 1:
            raise ValueError(f"checkpoints of a prompt may not take {self.prompt_bytes} bytes")

    def check_unit(self, unit: int) -> None:
        """Raises ValueError unless a fixed interval is a multiple of unit (the block size)."""
        if self.interval and self.interval % unit:
            raise ValueError(
                f"the checkpoint interval {self.interval} is not a multiple of {unit} tokens"
            )


BY_COST: Final = CheckpointSettings()  # the defaults: the interval chosen by cost, 1 GiB


def choose_interval(
    *,
    state_bytes: int,
    prefill_rate: float,
    prompt_tokens: int,
    unit: int,
    prompt_bytes: int = PROMPT_BYTES,
) -> int:
    """The smallest unit * 2**k at which a checkpoint of state_bytes costs at most COST_SHARE
    of the prefill it saves (at prefill_rate tokens/s), and prompt_tokens' checkpoints
    together at most prompt_bytes."""
    by_cost = state_bytes * prefill_rate / (COST_SHARE * WRITE_RATE)
    by_room = prompt_tokens * state_bytes / prompt_bytes
    interval = unit
    while interval < max(by_cost, by_room):
        interval *= 2
    return interval


def positions(start: int, end: int, interval: int) -> list[int]:
    """The multiples of interval after start and before end: where a prefill from start to
    end stores checkpoints (end, the prompt boundary, is stored as a segment)."""
    return list(range((start // interval + 1) * interval, end, interval))


def state_bytes(layers: Sequence[Any], arrays: Sequence[Any]) -> int:
    """What a snapshot (prompt_cache.snapshot_layers) holds outside blocks: the bytes of the
    layers not cut into blocks, which a checkpoint writes of its own."""
    own = [not layer.blocked for layer in layers for _ in layer.tensors]
    return sum(int(a.nbytes) for a, counted in zip(arrays, own, strict=True) if counted)


class CheckpointedModel:
    """The model as mlx-lm's generate_step calls it, its prefill cut at the checkpoint
    positions: after the piece that ends at one, the caches are evaluated and handed to
    take(position, cache). It starts at start tokens (what the caches hold). Calls that
    reach no position (decoding, the last prompt token) and calls with more than the token
    inputs (input embeddings) go straight to the model; so does everything but the call."""

    def __init__(
        self,
        model: Any,
        start: int,
        at: Sequence[int],
        take: Callable[[int, Sequence[Any]], None],
    ) -> None:
        self._model = model
        self._position = start
        self._at = list(at)
        self._take = take

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: mx.array, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
        end = self._position + inputs.shape[-1]
        if args or kwargs or inputs.ndim != 2 or not self._at or self._at[0] >= end:
            self._position = end
            return self._model(inputs, *args, cache=cache, **kwargs)
        while self._at and self._at[0] < end:  # each piece leaves some input after it
            at = self._at.pop(0)
            self._model(inputs[:, : at - self._position], cache=cache)
            mx.eval([layer.state for layer in cache])
            inputs, self._position = inputs[:, at - self._position :], at
            self._take(at, cache)
        self._position = end
        return self._model(inputs, cache=cache)
