"""The caches a stock server's prompt cache lookup returns for a request (kvd-mlx-lm-server,
kvd-vllm-mlx): the server passes them on to its generation, so they carry what the generation
continues (the request's tokens, of which the caches hold the first start) and nothing is
matched across calls."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .server_tier import storable


class RequestCache(list[Any]):
    """A request's caches (a list of layers, as the stock servers take them), with its tokens
    and how many of them the caches hold."""

    def __init__(self, layers: Iterable[Any], tokens: list[int], start: int) -> None:
        super().__init__(layers)
        self.tokens = tokens
        self.start = start


def request_tokens(prompt: Any, cache: Any) -> tuple[list[int], int] | None:
    """The tokens of the request whose rest prompt is, and how many of them cache holds: a
    cache the lookup returned knows its request; a fresh one (holding nothing) is prefilled
    with the whole of it. None when prompt is not that rest or the tokens are not kvd's."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if isinstance(cache, RequestCache):
        tokens, start = cache.tokens, cache.start
    elif isinstance(cache, list) and all(layer.empty() for layer in cache):
        tokens, start = prompt, 0
    else:
        return None
    return (tokens, start) if storable(tokens) and tokens[start:] == prompt else None
