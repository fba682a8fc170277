"""Restored KV caches join mlx-lm's batched generation without a copy.

mlx-lm's BatchGenerator takes a request's caches into its batch with the caches' `merge`
(`KVCache.merge` is `BatchKVCache.merge`): a new buffer of exactly the tokens held, zeroed,
then every layer copied in, and the first token the batch appends finds no room, so it copies
the whole cache again. For a restored cache both copies are waste: its buffers are fresh, the
cache's alone, and have room for the next tokens (restore.with_room). A layer marked here
becomes the batch's cache of one sequence as is: the same buffers, the tokens held as the
batch counts them, the room beyond for the appends.

This changes no value: MLX writes into a buffer in place only when no other array holds it,
and copies otherwise, so a marked layer that was copied meanwhile (a memory tier's deep copy)
is still right. A merge of several requests' caches at once, or of a layer not marked, is
mlx-lm's own.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlx_lm_cache

mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes


def merge_in_place(cache: list[Any]) -> None:
    """Mark the plain KV layers of one sequence in cache to join a batch as they are."""
    for layer in cache:
        if type(layer) is mlc.KVCache and layer.keys is not None and layer.keys.shape[0] == 1:
            layer.merge = partial(_merged, layer)  # before the class's method on this object


def _merged(layer: Any, caches: list[Any]) -> Any:
    """The batch cache of caches: layer's own buffers when it is the one cache merged."""
    del layer.merge  # once: the buffers go to the batch
    if len(caches) != 1 or caches[0] is not layer:
        return mlc.BatchKVCache.merge(caches)
    batch = mlc.BatchKVCache([0])  # one sequence, no left padding
    batch.keys, batch.values = layer.keys, layer.values
    batch.offset = mx.array([layer.offset])
    batch._idx = layer.offset  # the tokens held: the rest of the buffer is room
    return batch
