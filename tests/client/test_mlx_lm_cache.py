"""The mlx-lm integration against a real daemon, with tiny models: a prompt that extends an
earlier one restores its prefix and generates exactly what stock mlx-lm generates; with no
daemon the engine generates all the same."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from daemon_process import Daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.mlx_lm_cache import ColdTier
from kvd_client.results import TicketState
from mlx_lm.models.cache import RotatingKVCache
from tiny_engine import byte_tokenizer, uninterrupted
from tiny_models import prefill, prompt, tiny_lfm2, tiny_llama

STEPS = 6
SETTLE_SECONDS = 30.0

MODELS: dict[str, Callable[[], Any]] = {
    "llama": tiny_llama,
    "lfm2": tiny_lfm2,
    "sliding": lambda: tiny_llama(4, sliding_window=8),
}


def _tier(client: Client, model: Any) -> ColdTier:
    return ColdTier(client, model, byte_tokenizer())


def _generated(tier: ColdTier, tokens: list[int]) -> list[int]:
    return [response.token for response in tier.stream_generate(tokens, STEPS)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_extended_prompt_restores_the_prefix_and_generates_the_same(
    daemon: Daemon, name: str
) -> None:
    model = MODELS[name]()
    first = prompt(30)
    with Client.connect(daemon.socket_path, require=True) as client, _tier(client, model) as tier:
        reply = _generated(tier, first)
        assert tier.drain(SETTLE_SECONDS)
        second = first + reply + prompt(7, seed=2)
        got = _generated(tier, second)
        assert tier.drain(SETTLE_SECONDS)
    assert reply == uninterrupted(model, tier.tokenizer, first, STEPS)
    assert got == uninterrupted(model, tier.tokenizer, second, STEPS)
    assert tier.stats.restored == 1
    # The first conversation turn, its reply included, came from the daemon.
    assert tier.stats.computed_tokens == len(first) + len(second) - len(first + reply)
    assert tier.stats.failed == tier.stats.unavailable == 0


@pytest.mark.parametrize("name", ["lfm2", "sliding"])
def test_caches_that_may_not_trim_are_stored_at_the_prompt_boundary(
    daemon: Daemon, name: str
) -> None:
    model = MODELS[name]()
    tokens = prompt(30)
    with Client.connect(daemon.socket_path, require=True) as client, _tier(client, model) as tier:
        first = _generated(tier, tokens)
        assert tier.drain(SETTLE_SECONDS)
        again = _generated(tier, tokens)  # the same prompt: served by the boundary entry
    assert tier.stats.restored == 1
    assert tier.stats.computed_tokens == len(tokens) + 1
    assert again == first == uninterrupted(model, tier.tokenizer, tokens, STEPS)
    # The boundary and prompt + reply; then only prompt + reply: the boundary was restored.
    assert tier.stats.stored == 3


def test_trimmable_caches_are_stored_once_and_serve_the_prompt_by_trimming(
    daemon: Daemon,
) -> None:
    model = tiny_llama()
    tokens = prompt(30)
    with Client.connect(daemon.socket_path, require=True) as client, _tier(client, model) as tier:
        first = _generated(tier, tokens)
        assert tier.drain(SETTLE_SECONDS)
        assert tier.stats.stored == 1
        cache, remaining = tier.prepare(tokens)
    assert remaining == tokens[-1:]
    assert all(layer.offset == len(tokens) - 1 for layer in cache)
    assert first == uninterrupted(model, tier.tokenizer, tokens, STEPS)


def test_prepare_leaves_at_least_one_token_to_compute(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(12)
    with Client.connect(daemon.socket_path, require=True) as client, _tier(client, model) as tier:
        ticket = tier.store(tokens, prefill(model, tokens)).result(SETTLE_SECONDS)
        assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
        cache, remaining = tier.prepare(tokens)
    assert remaining == tokens[-1:]
    assert all(layer.offset == len(tokens) - 1 for layer in cache)


def test_a_store_is_not_changed_by_decoding_that_follows_it(daemon: Daemon) -> None:
    # A full ring is snapshotted without a copy, and decoding writes into full rings in place.
    model = tiny_llama(4, sliding_window=8)
    tokens = prompt(20)
    with Client.connect(daemon.socket_path, require=True) as client, _tier(client, model) as tier:
        cache = prefill(model, tokens[:-3])
        for token in tokens[-3:]:  # single steps: the ring is now written in place
            prefill(model, [token], cache)
        assert any(isinstance(layer, RotatingKVCache) for layer in cache)
        with tier._stores._lock:  # the puts cannot reach the daemon: the put waits while we decode
            stored = tier.store(tokens, cache)
            want = _decode(model, cache)
        ticket = stored.result(SETTLE_SECONDS)
        assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
        restored = client.get(tier.identity, [*tokens, 0], model=model)
    assert restored is not None
    assert restored.matched == len(tokens)
    assert bool(mx.array_equal(_decode(model, restored.cache), want).item())


def _decode(model: Any, cache: list[Any]) -> mx.array:
    """The logits of STEPS greedy steps from cache (which advances), starting from token 0."""
    token, steps = 0, []
    for _ in range(STEPS):
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        token = cast(int, mx.argmax(logits).item())
        steps.append(logits)
    return mx.concatenate(steps)


def test_without_a_daemon_the_engine_still_generates() -> None:
    model = tiny_llama()
    tokens = prompt(20)
    socket_path = str(Path(tempfile.mkdtemp(prefix="kvd-")) / "absent.sock")
    with Client.connect(socket_path) as client, _tier(client, model) as tier:
        first = _generated(tier, tokens)
        assert tier.drain(SETTLE_SECONDS)
        second = _generated(tier, tokens)
        assert tier.drain(SETTLE_SECONDS)
    want = uninterrupted(model, tier.tokenizer, tokens, STEPS)
    assert first == second == want
    assert tier.stats.fresh == 2
    assert tier.stats.lookups_unavailable == 2
    assert tier.stats.unavailable == 2
    assert tier.stats.computed_tokens == 2 * len(tokens)


def test_an_identity_given_is_the_one_used(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(16)
    named = EngineIdentity("tiny/llama", "cfg", "tok")
    with Client.connect(daemon.socket_path, require=True) as client:
        with ColdTier(client, model, byte_tokenizer(), identity=named) as tier:
            _generated(tier, tokens)
            assert tier.drain(SETTLE_SECONDS)
        assert len(client.list_entries(named.to_protocol())) == 1
        other = EngineIdentity.for_model(model, byte_tokenizer())
        assert client.list_entries(other.to_protocol()) == []


def test_the_engines_prefill_cost_reaches_the_daemon_per_identity(daemon: Daemon) -> None:
    """A prefill long enough to time sets the client's cost per token, and the puts after it
    carry it: the daemon reports it for the identity (the cost eviction policy weighs by it).
    A prefill of a few tokens is mostly fixed cost and changes nothing."""
    model = tiny_llama()
    named = EngineIdentity("tiny/prefill-cost", "cfg", "tok")
    with Client.connect(daemon.socket_path, require=True) as client:
        with ColdTier(client, model, byte_tokenizer(), identity=named) as tier:
            _generated(tier, prompt(8))
            assert tier.drain(SETTLE_SECONDS)
            assert _prefill_ms_per_token(client, named) is None
            _generated(tier, prompt(200, seed=3))
            assert tier.drain(SETTLE_SECONDS)
        measured = client._link.prefill_cost
        assert measured > 0
        assert _prefill_ms_per_token(client, named) == pytest.approx(measured * 1000, rel=1e-3)


def _prefill_ms_per_token(client: Client, identity: EngineIdentity) -> float | None:
    digest = identity.to_protocol().digest()
    status = client.status()
    (mine,) = [i for i in status["identities"] if i["identity"] == digest]  # type: ignore[attr-defined]
    value = mine["prefill_ms_per_token"]
    assert value is None or isinstance(value, float)
    return value
