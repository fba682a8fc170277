"""Prefill checkpoints through the cold tier and a real daemon: a hybrid model's prompt is
stored along its prefill, so a prompt whose end changed restores all but the last interval
and answers as a run without kvd; caches that always trim take none; the interval rule."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import pytest
from daemon_process import Daemon
from kvd_client import snapshots
from kvd_client.backlog import Kind
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.mlx_lm_cache import ColdTier
from kvd_client.prefill_checkpoints import (
    COST_SHARE,
    WRITE_RATE,
    CheckpointedModel,
    CheckpointSettings,
    choose_interval,
    positions,
)
from kvd_client.snapshots import Memo
from kvd_protocol.entry import PREFILL_CHECKPOINT_META
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from tiny_engine import byte_tokenizer, uninterrupted
from tiny_models import prefill, prompt, tiny_lfm2, tiny_llama, tiny_nemotron_h, tiny_qwen3_next

BLOCK = 64
STEPS = 6
SETTLE_SECONDS = 30.0


@contextmanager
def _tier(daemon: Daemon, model: Any, **kwargs: Any) -> Iterator[ColdTier]:
    """A fresh client and cold tier: what a new engine process would have."""
    with (
        Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client,
        ColdTier(client, model, byte_tokenizer(), **kwargs) as tier,
    ):
        yield tier


def _generate(tier: ColdTier, tokens: list[int]) -> list[int]:
    got = [response.token for response in tier.stream_generate(tokens, STEPS)]
    assert tier.drain(SETTLE_SECONDS)
    return got


@pytest.mark.parametrize("make", [tiny_lfm2, tiny_qwen3_next, tiny_nemotron_h])
def test_a_prompt_whose_end_changed_restores_from_the_last_checkpoint_before_it(
    daemon: Daemon, make: Callable[[], Any]
) -> None:
    model = make()
    interval = 2 * BLOCK
    first = prompt(700, seed=3)
    changed = first[:610] + prompt(90, seed=4)  # leaves the first at token 610
    with _tier(daemon, model, checkpoints=CheckpointSettings(interval=interval)) as tier:
        _generate(tier, first)
        assert tier.stats.checkpoints == len(positions(0, len(first) - 1, interval))  # 5
    with _tier(daemon, model, checkpoints=CheckpointSettings(interval=interval)) as tier:
        got = _generate(tier, changed)
        assert tier.stats.restored_tokens == 512  # the checkpoint at 4 intervals <= 610
        assert tier.stats.checkpoint_restores == 1
        assert tier.stats.checkpoint_restored_tokens == 512
        # Its own prefill stored checkpoints from there on: one, at 640.
        assert tier.stats.checkpoints == 1
        counted = tier.client.status()["prefill_checkpoints"]
    assert got == uninterrupted(model, byte_tokenizer(), changed, STEPS)
    # The daemon keeps them as prefill checkpoints: 128, 256, ..., 640; one hit, 512 tokens.
    assert isinstance(counted, dict)
    assert counted["entries"] == 6
    assert counted["hits"] == 1
    assert counted["restored_tokens"] == 512


def test_without_checkpoints_a_changed_end_restores_nothing_of_a_hybrid(daemon: Daemon) -> None:
    model = tiny_lfm2()
    first = prompt(400, seed=5)
    changed = first[:350] + prompt(50, seed=6)
    off = CheckpointSettings(interval=0)
    with _tier(daemon, model, checkpoints=off) as tier:
        _generate(tier, first)
        assert tier.stats.checkpoints == 0
    with _tier(daemon, model, checkpoints=off) as tier:
        _generate(tier, changed)
        assert tier.stats.restored_tokens == 0


def test_an_exact_repeat_restores_the_prompt_boundary(daemon: Daemon) -> None:
    model = tiny_lfm2()
    tokens = prompt(300, seed=7)
    with _tier(daemon, model) as tier:
        _generate(tier, tokens)
    with _tier(daemon, model) as tier:
        got = _generate(tier, tokens)
        assert tier.stats.restored_tokens == len(tokens) - 1
        assert tier.stats.checkpoint_restores == 0  # the boundary is a segment, not one
    assert got == uninterrupted(model, byte_tokenizer(), tokens, STEPS)


def test_caches_that_always_trim_take_no_checkpoints(daemon: Daemon) -> None:
    model = tiny_llama()
    first = prompt(600, seed=8)
    changed = first[:500] + prompt(100, seed=9)
    with _tier(daemon, model, checkpoints=CheckpointSettings(interval=BLOCK)) as tier:
        _generate(tier, first)
        assert tier.stats.checkpoints == 0
        assert tier.checkpoint_positions(first, 0) == []
    with _tier(daemon, model) as tier:
        _generate(tier, changed)
        assert tier.stats.restored_tokens == 500  # the finished turn, trimmed
        assert tier.stats.checkpoint_restores == 0


def test_a_sliding_window_takes_checkpoints_too(daemon: Daemon) -> None:
    model = tiny_llama(sliding_window=64)
    first = prompt(400, seed=10)
    changed = first[:300] + prompt(100, seed=11)
    settings = CheckpointSettings(interval=BLOCK)
    with _tier(daemon, model, checkpoints=settings) as tier:
        _generate(tier, first)
        assert tier.stats.checkpoints == len(positions(0, len(first) - 1, BLOCK))
    with _tier(daemon, model, checkpoints=settings) as tier:
        got = _generate(tier, changed)
        assert tier.stats.restored_tokens == 256  # the last multiple of 64 <= 300 but 300
    assert got == uninterrupted(model, byte_tokenizer(), changed, STEPS)


def test_a_fixed_interval_must_be_a_multiple_of_the_block(daemon: Daemon) -> None:
    with (
        Client.connect(daemon.socket_path, block_tokens=BLOCK) as client,
        pytest.raises(ValueError, match="not a multiple of 64 tokens"),
    ):
        ColdTier(client, tiny_lfm2(), byte_tokenizer(), checkpoints=CheckpointSettings(96))
    with pytest.raises(ValueError, match="interval of -1"):
        CheckpointSettings(interval=-1)
    with pytest.raises(ValueError, match="may not take 0 bytes"):
        CheckpointSettings(prompt_bytes=0)


def test_the_interval_by_cost_is_the_block_times_a_power_of_two() -> None:
    # A tiny state: one block, whatever the rate.
    assert (
        choose_interval(state_bytes=4096, prefill_rate=5000, prompt_tokens=10**5, unit=128) == 128
    )
    # 74 MiB of state at 1,000 tokens/s: writing it must cost at most COST_SHARE of the
    # prefill it saves, so at least 16 * 77.6e6 * 1000 / 1e9 = 1,241 tokens: 2,048.
    state = 74 << 20
    wanted = state * 1000 / (COST_SHARE * WRITE_RATE)
    assert 1024 < wanted <= 2048
    assert (
        choose_interval(state_bytes=state, prefill_rate=1000, prompt_tokens=8192, unit=128) == 2048
    )
    # A faster prefill saves less per token: the interval grows.
    assert (
        choose_interval(state_bytes=state, prefill_rate=4000, prompt_tokens=8192, unit=128) == 8192
    )
    # A prompt's checkpoints together within prompt_bytes: 60,000 tokens, 1 GiB, 74 MiB each
    # make at most 13.8 of them, one every 4,340 tokens or more: 8,192.
    by_room = choose_interval(
        state_bytes=state, prefill_rate=1000, prompt_tokens=60_000, unit=128, prompt_bytes=1 << 30
    )
    assert by_room == 8192


def test_positions_are_the_multiples_after_the_start_before_the_boundary() -> None:
    assert positions(0, 1000, 256) == [256, 512, 768]
    assert positions(256, 1000, 256) == [512, 768]
    assert positions(300, 1024, 256) == [512, 768]  # 1024 is the boundary: a segment
    assert positions(900, 1000, 256) == []


def test_a_checkpointed_model_cuts_only_the_prefill_and_leaves_the_same_caches() -> None:
    model = tiny_lfm2()
    tokens = prompt(300, seed=12)
    taken: list[int] = []
    wrapped = CheckpointedModel(model, 0, [64, 128, 256], lambda at, cache: taken.append(at))
    cache = make_prompt_cache(model)
    wrapped(mx.array([tokens[:200]]), cache=cache)  # a chunk: cut at 64 and 128
    assert taken == [64, 128]
    wrapped(mx.array([tokens[200:299]]), cache=cache)  # the next: cut at 256
    assert taken == [64, 128, 256]
    logits = wrapped(mx.array([tokens[299:]]), cache=cache)  # past the positions: as it is
    whole = make_prompt_cache(model)
    expected = model(mx.array([tokens]), cache=whole)
    assert mx.allclose(logits[:, -1, :], expected[:, -1, :], atol=1e-4).item()
    assert wrapped.layers is model.layers  # everything but the call is the model's


def test_a_prefill_checkpoint_is_never_trimmable_whatever_its_layers() -> None:
    model = tiny_llama()
    tokens = prompt(128, seed=13)
    cache = prefill(model, tokens)
    turn = snapshots.plan(Memo(), tokens, cache, block_tokens=BLOCK)
    checkpoint = snapshots.plan(
        Memo(), tokens, cache, block_tokens=BLOCK, kind=Kind.PREFILL_CHECKPOINT
    )
    assert turn is not None
    assert turn.trimmable
    assert checkpoint is not None
    assert not checkpoint.trimmable
    assert snapshots.take(checkpoint).meta[PREFILL_CHECKPOINT_META] is True
    assert PREFILL_CHECKPOINT_META not in snapshots.take(turn).meta


def test_caches_without_a_codec_turn_checkpoints_off_after_one_try(daemon: Daemon) -> None:
    """A cache class kvd has no codec for cannot be stored: the one-token forward that
    weighs the state is tried once, and no prompt is cut for checkpoints."""

    class Unknown(ArraysCache):
        """Not ArraysCache itself: codecs match classes exactly."""

    class Model:
        def __init__(self) -> None:
            self.inner = tiny_lfm2()
            self.layers = self.inner.layers
            self.calls = 0

        def make_cache(self) -> list[Any]:
            return [
                Unknown(2) if isinstance(c, ArraysCache) else c for c in self.inner.make_cache()
            ]

        def __call__(self, inputs: mx.array, cache: Any = None) -> Any:
            self.calls += 1
            return self.inner(inputs, cache=cache)

    model = Model()
    with _tier(daemon, model, identity=EngineIdentity("tiny/unknown-cache", "cfg", "tok")) as tier:
        tokens = prompt(600, seed=14)
        assert tier.checkpoint_positions(tokens, 0) == []
        assert model.calls == 1
        assert tier.checkpoint_positions(tokens, 0) == []
        assert model.calls == 1
