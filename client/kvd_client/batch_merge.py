"""Restored KV caches join mlx-lm's batched generation without a copy.

mlx-lm's BatchGenerator takes a request's caches into its batch with the caches' `merge`
(`KVCache.merge` is `BatchKVCache.merge`): a new buffer of exactly the cache's tokens, zeroed,
then every layer copied in, and the first token the batch appends finds no room, so it copies
the whole cache again. For a restored cache both copies are waste: its buffers are fresh, the
cache's alone, and have room for the next tokens (restore.with_room). A layer marked here
becomes the batch's cache of one sequence as is: the same buffers, its tokens as the
batch counts them, the room beyond for the appends.

This changes no value: MLX writes into a buffer in place only when no other array holds it,
and copies otherwise, so a marked layer that was copied meanwhile (a memory tier's deep copy)
is still right. A merge of several requests' caches at once, or of a layer not marked, is
mlx-lm's own. The batch cache is set through its public state (mlx_lm_hooks.py checks the
names used), whose meaning mlx-lm could still change: once per process a small cache is
merged both ways and a token appended to each, and unless the two agree nothing is
marked (a warning names the mlx-lm version), so another mlx-lm costs the copies, never a
wrong answer.
"""

from __future__ import annotations

import functools
import logging
from functools import partial
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models import cache as _mlx_lm_cache

mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes

log = logging.getLogger("kvd_client")


def merge_in_place(cache: list[Any]) -> None:
    """Mark the plain KV layers of one sequence in cache to join a batch as they are (when
    this mlx-lm's batch cache takes them so)."""
    if not _agrees_with_mlx_lm():
        return
    for layer in cache:
        if type(layer) is mlc.KVCache and layer.keys is not None and layer.keys.shape[0] == 1:
            layer.merge = partial(_merged, layer)  # before the class's method on this object


def _merged(layer: Any, caches: list[Any]) -> Any:
    """The batch cache of caches: layer's own buffers when it is the one cache merged."""
    del layer.merge  # once: the buffers go to the batch
    if len(caches) != 1 or caches[0] is not layer:
        return mlc.BatchKVCache.merge(caches)
    batch = mlc.BatchKVCache([0])  # one sequence, no left padding
    # keys, values, each sequence's offset, the left padding, and the tokens in the buffers
    # (the rest of them is room)
    batch.state = (
        layer.keys,
        layer.values,
        mx.array([layer.offset]),
        batch.left_padding,
        layer.offset,
    )
    return batch


@functools.cache
def _agrees_with_mlx_lm() -> bool:
    """Whether a layer merged in place holds what mlx-lm's own merge holds, before and after
    a token is appended; if not, a warning says so once."""
    problem = ""
    try:
        ours, theirs = mlc.KVCache(), mlc.KVCache()
        rows = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
        for layer in (ours, theirs):
            layer.update_and_fetch(rows, rows + 1)
        token = mx.ones((1, 2, 1, 4))
        states = []
        ours.merge = partial(_merged, ours)  # as merge_in_place marks it
        for batch in (ours.merge([ours]), mlc.BatchKVCache.merge([theirs])):
            before = batch.keys_and_values()
            states.append([*before, *batch.update_and_fetch(token, token), *batch.state[2:]])
        if any(not bool(mx.array_equal(a, b).item()) for a, b in zip(*states, strict=True)):
            problem = "its merge holds other values"
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        log.warning(
            "kvd: mlx-lm %s: restored caches are copied into the batch (%s)",
            mlx_lm.__version__,
            problem,
        )
    return not problem
