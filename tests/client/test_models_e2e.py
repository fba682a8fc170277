"""Tiny real models through a real daemon: prefill, put, get, continue greedy decoding; the
tokens and logits equal an uninterrupted run's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from daemon_process import Daemon
from kvd_client import prompt_cache
from kvd_client.async_client import AsyncClient
from kvd_client.client import Client
from kvd_client.codecs import CODEC_ID
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from mlx_lm.models import cache as _mlx_lm_cache
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import (
    greedy,
    prefill,
    prompt,
    tiny_falcon_h1,
    tiny_lfm2,
    tiny_llama,
    tiny_llama4,
    tiny_mamba2,
    tiny_nemotron_h,
    tiny_qwen3_next,
)

SETTLE_SECONDS = 30.0
STEPS = 4
mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes


MODELS = {
    "llama": tiny_llama,
    "sliding": lambda: tiny_llama(4, sliding_window=8),
    "lfm2": tiny_lfm2,
    "mamba2": tiny_mamba2,
    "llama4": tiny_llama4,  # ChunkedKVCache
    "falcon_h1": tiny_falcon_h1,  # CacheList
    "qwen3_next": tiny_qwen3_next,  # Gated DeltaNet and attention
    "nemotron_h": tiny_nemotron_h,  # Mamba-2 and attention
}


def _batched(template: Any) -> Any:
    """The batch cache of one sequence that batch generation makes in place of template."""
    if type(template) is mlc.RotatingKVCache:
        return mlc.BatchRotatingKVCache(template.max_size, left_padding=[0])
    return mlc.BatchKVCache(left_padding=[0])


# Caches an engine makes itself in place of the model's own (make_prompt_cache).
CACHES = {
    "concatenate": lambda model: [mlc.ConcatenateKVCache() for _ in make_prompt_cache(model)],
    "batch": lambda model: [_batched(c) for c in make_prompt_cache(model)],
}


def _identity(name: str) -> EngineIdentity:
    return EngineIdentity(f"tiny/{name}", "cfg", "tok")


def _stored(client: Client, identity: EngineIdentity, tokens: list[int], cache: list[Any]) -> None:
    ticket = client.put(identity, tokens, cache)
    assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")


def _assert_same_run(got: tuple[list[int], mx.array], want: tuple[list[int], mx.array]) -> None:
    assert got[0] == want[0]
    assert bool(mx.array_equal(got[1], want[1]).item())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_restored_cache_continues_like_the_original(daemon: Daemon, name: str) -> None:
    model = MODELS[name]()
    tokens = prompt(20)
    cache = prefill(model, tokens[:-1])
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity(name), tokens[:-1], cache)
        restored = client.get(_identity(name), tokens, model=model)
    assert restored is not None
    assert restored.matched == len(tokens) - 1
    assert [type(c) for c in restored.cache] == [type(c) for c in cache]
    _assert_same_run(
        greedy(model, restored.cache, tokens[-1:], STEPS), greedy(model, cache, tokens[-1:], STEPS)
    )


def test_a_chunked_cache_past_its_first_chunk_continues_like_the_original(daemon: Daemon) -> None:
    model = tiny_llama4()
    tokens = prompt(20)
    cache = prefill(model, tokens[:12])
    prefill(model, tokens[12:-1], cache)  # the chunked layers drop what is behind their chunk
    assert {c.start_position for c in cache if type(c) is mlc.ChunkedKVCache} != {0}
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity("llama4"), tokens[:-1], cache)
        restored = client.get(_identity("llama4"), tokens, model=model)
    assert restored is not None
    assert [c.state[2:] for c in restored.cache[:3]] == [c.state[2:] for c in cache[:3]]
    _assert_same_run(
        greedy(model, restored.cache, tokens[-1:], STEPS), greedy(model, cache, tokens[-1:], STEPS)
    )


@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_caches_an_engine_makes_itself_continue_like_the_original(
    daemon: Daemon, kind: str, sliding: bool
) -> None:
    model = tiny_llama(4, sliding_window=8) if sliding else tiny_llama()
    tokens = prompt(20)
    cache = prefill(model, tokens[:-1], CACHES[kind](model))
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity(kind), tokens[:-1], cache)
        restored = client.get(_identity(kind), tokens)  # not the model's own caches
    assert restored is not None
    assert restored.matched == len(tokens) - 1
    _assert_same_run(
        greedy(model, restored.cache, tokens[-1:], STEPS), greedy(model, cache, tokens[-1:], STEPS)
    )


def test_a_quantized_cache_continues_like_the_original(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(20)
    cache = [c.to_quantized(group_size=32, bits=8) for c in prefill(model, tokens[:-1])]
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity("llama-q8"), tokens[:-1], cache)
        restored = client.get(_identity("llama-q8"), tokens, model=model)
    assert restored is not None
    assert all(type(c).__name__ == "QuantizedKVCache" for c in restored.cache)
    _assert_same_run(
        greedy(model, restored.cache, tokens[-1:], STEPS), greedy(model, cache, tokens[-1:], STEPS)
    )


def test_a_longer_entry_serves_a_shorter_prompt_when_trimmable(daemon: Daemon) -> None:
    model = tiny_llama()
    stored, asked = prompt(30), prompt(30)[:16] + prompt(6, seed=5)
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity("llama"), stored, prefill(model, stored))
        restored = client.get(_identity("llama"), asked, model=model)
    assert restored is not None
    assert restored.matched == 16
    assert all(c.offset == 16 for c in restored.cache)
    got = greedy(model, restored.cache, asked[16:], STEPS)
    want = greedy(model, prefill(model, asked[:16]), asked[16:], STEPS)
    assert got[0] == want[0]
    assert mx.allclose(got[1], want[1], rtol=0.0, atol=1e-5).item()


def test_a_longer_entry_never_serves_a_shorter_prompt_when_untrimmable(daemon: Daemon) -> None:
    model = tiny_mamba2()
    stored, asked = prompt(30), prompt(30)[:16] + prompt(6, seed=5)
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity("mamba2"), stored, prefill(model, stored))
        assert client.get(_identity("mamba2"), asked, model=model) is None


def test_an_entry_of_another_geometry_is_a_miss(daemon: Daemon) -> None:
    tokens = prompt(12)
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity("x"), tokens[:-1], prefill(tiny_llama(), tokens[:-1]))
        other = tiny_llama(2, sliding_window=8)  # same identity (a mistake), other caches
        assert client.get(_identity("x"), tokens, model=other) is None
        assert client.stats.misses["model"] == 1


def test_the_async_client_puts_and_gets(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(12)
    cache = prefill(model, tokens[:-1])

    async def main() -> prompt_cache.Restored | None:
        async with await AsyncClient.connect(daemon.socket_path, require=True) as client:
            ticket = await client.put(_identity("llama"), tokens[:-1], cache)
            assert await ticket.wait(SETTLE_SECONDS) == TicketState("stored")
            return await client.get(_identity("llama"), tokens, model=model)

    restored = asyncio.run(main())
    assert restored is not None
    assert restored.matched == len(tokens) - 1
    _assert_same_run(
        greedy(model, restored.cache, tokens[-1:], STEPS), greedy(model, cache, tokens[-1:], STEPS)
    )


def test_another_process_restores_what_this_one_put(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(16)
    cache = prefill(model, tokens[:-1])
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, _identity("llama"), tokens[:-1], cache)
    want, _ = greedy(model, cache, tokens[-1:], STEPS)
    script = textwrap.dedent(f"""
        from kvd_client.client import Client
        from kvd_client.identity import EngineIdentity
        from tiny_models import greedy, prompt, tiny_llama
        model = tiny_llama()
        tokens = prompt(16)
        with Client.connect({daemon.socket_path!r}, require=True) as client:
            restored = client.get(EngineIdentity("tiny/llama", "cfg", "tok"), tokens, model=model)
        print(greedy(model, restored.cache, tokens[-1:], {STEPS})[0])
    """)
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=here, check=True
    )
    assert done.stdout.strip() == str(want)


def test_identity_for_model_covers_config_tokenizer_and_runtime(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"vocab": 1}')
    small, sliding = tiny_llama(), tiny_llama(2, sliding_window=8)
    first = EngineIdentity.for_model(small, tmp_path)
    assert first == EngineIdentity.for_model(tiny_llama(seed=3), tmp_path)  # weights are not hashed
    assert (
        first.config_fingerprint != EngineIdentity.for_model(sliding, tmp_path).config_fingerprint
    )
    (tmp_path / "tokenizer.json").write_text('{"vocab": 2}')
    assert first.tokenizer_hash != EngineIdentity.for_model(small, tmp_path).tokenizer_hash
    wire = first.to_protocol()
    assert wire.codec_id == CODEC_ID
    assert wire.runtime.startswith("mlx-")
    assert wire.model_id == str(tmp_path.resolve())
