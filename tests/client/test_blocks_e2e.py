"""Conversations that share a prefix, through a real daemon offering blocks: the prefix's
blocks are written once, every conversation is restored from the shared blocks and its own
tail and continues greedy generation exactly as a fresh prefill of its tokens does; damaged
blocks are misses by rule; a client with blocks off (or a daemon without them) writes v1."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
from daemon_process import Daemon
from kvd_client.async_client import AsyncClient
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol.blocks import BLOCK_SUFFIX, block_hashes, block_name
from kvd_protocol.entry import PREFIX
from kvd_protocol.entry_reader import parse_block_head
from kvd_protocol.messages import BLOCKS_FEATURE, MAX_BLOCK_BATCH
from kvd_protocol.tokens import pack_tokens
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import greedy, prefill, prompt, tiny_llama

BLOCK = 16  # tokens per block: the smallest size, so that a tiny prompt spans several
PREFIX_TOKENS = 5 * BLOCK  # the shared system prompt: five whole blocks
OWN_TOKENS = 21  # each conversation's own tokens: one more whole block and a tail of 5
CONVERSATIONS = 8
STEPS = 4
SETTLE_SECONDS = 30.0


def _conversations(count: int = CONVERSATIONS) -> list[list[int]]:
    shared = prompt(PREFIX_TOKENS, seed=1)
    return [shared + prompt(OWN_TOKENS, seed=100 + i) for i in range(count)]


def _blocks(tier: Path) -> list[Path]:
    return sorted((tier / "entries").rglob(f"*{BLOCK_SUFFIX}"))


def _manifests(tier: Path) -> list[Path]:
    return sorted((tier / "entries").rglob("*.kve"))


def _version(path: Path) -> int:
    version: int = PREFIX.unpack(path.read_bytes()[: PREFIX.size])[1]
    return version


def _stored(client: Client, identity: EngineIdentity, tokens: list[int], cache: list[Any]) -> None:
    assert client.put(identity, tokens, cache).wait(SETTLE_SECONDS) == TicketState("stored")


@contextmanager
def _stored_conversations(
    daemon: Daemon,
    model: Any,
    name: str,
    count: int,
    *,
    caches: Callable[[Any], list[Any]] = make_prompt_cache,
    block_tokens: int = BLOCK,
) -> Iterator[tuple[Client, EngineIdentity, list[list[int]]]]:
    """A client that has stored count conversations of model under identity tiny/name."""
    identity = EngineIdentity(f"tiny/{name}", "cfg", "tok")
    conversations = _conversations(count)
    with Client.connect(daemon.socket_path, require=True, block_tokens=block_tokens) as client:
        for tokens in conversations:
            _stored(client, identity, tokens, prefill(model, tokens, caches(model)))
        yield client, identity, conversations


def _continues_like_a_fresh_prefill(
    model: Any, restored: list[Any], tokens: list[int], caches: Any = make_prompt_cache
) -> None:
    """restored (the caches of tokens[:-1]) decodes as a fresh prefill of tokens[:-1]."""
    fresh = prefill(model, tokens[:-1], caches(model))
    got, want = (
        greedy(model, restored, tokens[-1:], STEPS),
        greedy(model, fresh, tokens[-1:], STEPS),
    )
    assert got[0] == want[0]
    assert bool(mx.array_equal(got[1], want[1]).item())


def test_conversations_sharing_a_prefix_write_it_once_and_each_continues_exactly(
    daemon: Daemon,
) -> None:
    model = tiny_llama()
    identity = EngineIdentity("tiny/shared", "cfg", "tok")
    conversations = _conversations()
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client:
        assert BLOCKS_FEATURE in client._link.server.features  # type: ignore[union-attr]
        written = []
        for tokens in conversations:
            before = client.stats.bytes_written
            _stored(client, identity, tokens, prefill(model, tokens))
            written.append(client.stats.bytes_written - before)
        blocks, manifests = _blocks(daemon.tier), _manifests(daemon.tier)
        # One copy of the prefix's five blocks, and each conversation's own sixth block.
        assert len(blocks) == PREFIX_TOKENS // BLOCK + CONVERSATIONS
        assert len(manifests) == CONVERSATIONS
        assert {_version(m) for m in manifests} == {2}
        block_size = blocks[0].stat().st_size
        assert {b.stat().st_size for b in blocks} == {block_size}
        manifest_size = manifests[0].stat().st_size
        assert written[0] == manifest_size + 6 * block_size
        assert written[1:] == [manifest_size + block_size] * (CONVERSATIONS - 1)
        assert client.stats.blocks_held == 5 * (CONVERSATIONS - 1)
        status = client.status()
        assert status["dedup_saved_bytes"] == 5 * (CONVERSATIONS - 1) * block_size
        assert status["unique_bytes"] == len(blocks) * block_size + len(manifests) * manifest_size
        assert status["logical_bytes"] == CONVERSATIONS * (manifest_size + 6 * block_size)

        for tokens in conversations:
            restored = client.get(identity, [*tokens, 7], model=model)
            assert restored is not None
            assert restored.matched == len(tokens)
            _continues_like_a_fresh_prefill(model, restored.cache, [*tokens, 7])
        assert client.stats.restored == CONVERSATIONS
        assert not client.stats.misses


def test_a_shorter_match_is_restored_from_the_blocks_it_needs_and_trimmed(daemon: Daemon) -> None:
    model = tiny_llama()
    with _stored_conversations(daemon, model, "trim", 1) as (client, identity, [tokens]):
        asked = [*tokens[:50], 3, 4]  # diverges inside the fourth block
        restored = client.get(identity, asked, model=model)
    assert restored is not None
    assert restored.matched == 50
    _continues_like_a_fresh_prefill(model, restored.cache, tokens[:51])


def test_a_prompt_of_more_blocks_than_one_batch_restores_exactly(daemon: Daemon) -> None:
    model = tiny_llama()
    identity = EngineIdentity("tiny/long", "cfg", "tok")
    tokens = prompt((MAX_BLOCK_BATCH + 6) * BLOCK + 5, seed=3)  # a second batch of six blocks
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client:
        _stored(client, identity, tokens, prefill(model, tokens))
        assert client.stats.blocks_written == MAX_BLOCK_BATCH + 6
        restored = client.get(identity, [*tokens, 7], model=model)
    assert restored is not None
    _continues_like_a_fresh_prefill(model, restored.cache, [*tokens, 7])


def _block_file(tier: Path, tokens: list[int], index: int) -> Path:
    """The file of block index of an entry of tokens (in any identity's folder)."""
    name = block_name(block_hashes(pack_tokens(tokens), BLOCK)[index])
    [path] = (tier / "entries").rglob(name)
    return path


def test_a_damaged_shared_block_is_a_miss_by_rule_and_the_daemon_drops_its_entries(
    daemon: Daemon,
) -> None:
    model = tiny_llama()
    with _stored_conversations(daemon, model, "damaged", 2) as (client, identity, conversations):
        shared = _block_file(daemon.tier, conversations[0], 1)  # both conversations list it
        block = parse_block_head(shared.name, shared.read_bytes(), shared.stat().st_size)
        with shared.open("r+b") as f:  # one bit of a key, as a failing disk would
            f.seek(block.slots[0].start + 3)
            byte = f.read(1)
            f.seek(block.slots[0].start + 3)
            f.write(bytes([byte[0] ^ 1]))
        assert client.get(identity, [*conversations[0], 7], model=model) is None
        assert client.stats.misses == {"data_checksum": 1}
        assert client.stats.rejected_entries == 1
        # Reported: the daemon checked the block and dropped every entry that lists it.
        assert client.get(identity, [*conversations[1], 7], model=model) is None
        assert client.stats.misses == {"data_checksum": 1, "no entry": 1}
        assert not shared.exists()
        assert _manifests(daemon.tier) == []


def test_a_missing_block_is_a_miss_by_rule(daemon: Daemon) -> None:
    model = tiny_llama()
    with _stored_conversations(daemon, model, "missing", 1) as (client, identity, [tokens]):
        block = _block_file(daemon.tier, tokens, 2)
        os.truncate(block, block.stat().st_size // 2)  # the daemon opens no block of another size
        assert client.get(identity, [*tokens, 7], model=model) is None
        assert client.stats.misses == {"block_missing": 1}


def test_a_client_with_blocks_off_writes_whole_entries(daemon: Daemon) -> None:
    model = tiny_llama()
    stored = _stored_conversations(daemon, model, "v1", 2, block_tokens=0)
    with stored as (client, identity, conversations):
        assert _blocks(daemon.tier) == []
        assert {_version(m) for m in _manifests(daemon.tier)} == {1}
        assert client.stats.blocks_written == client.stats.blocks_held == 0
        restored = client.get(identity, [*conversations[1], 7], model=model)
        assert restored is not None
        _continues_like_a_fresh_prefill(model, restored.cache, [*conversations[1], 7])


def test_against_a_daemon_that_offers_no_blocks_the_client_writes_whole_entries(
    daemon: Daemon,
) -> None:
    model = tiny_llama()
    identity = EngineIdentity("tiny/no-feature", "cfg", "tok")
    [tokens] = _conversations(1)
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client:
        link = client._link
        assert link.server is not None
        # What the hello of a daemon without blocks says: every feature but that one.
        link.server = dataclasses.replace(
            link.server, features=tuple(f for f in link.server.features if f != BLOCKS_FEATURE)
        )
        _stored(client, identity, tokens, prefill(model, tokens))
        assert _blocks(daemon.tier) == []
        assert [_version(m) for m in _manifests(daemon.tier)] == [1]
        restored = client.get(identity, [*tokens, 7], model=model)
        assert restored is not None
        _continues_like_a_fresh_prefill(model, restored.cache, [*tokens, 7])


def _quantized(model: Any) -> list[Any]:
    return [cache.to_quantized(group_size=32, bits=8) for cache in make_prompt_cache(model)]


def test_quantized_kv_is_stored_in_blocks_and_continues_exactly(daemon: Daemon) -> None:
    model = tiny_llama()
    stored = _stored_conversations(daemon, model, "quantized", 2, caches=_quantized)
    with stored as (client, identity, conversations):
        assert client.stats.blocks_held == PREFIX_TOKENS // BLOCK
        for tokens in conversations:
            restored = client.get(identity, [*tokens, 7], model=model)
            assert restored is not None
            assert {type(c).__name__ for c in restored.cache} == {"QuantizedKVCache"}
            _continues_like_a_fresh_prefill(model, restored.cache, [*tokens, 7], _quantized)


def test_sliding_window_layers_stay_whole_in_the_manifest_beside_blocked_ones(
    daemon: Daemon,
) -> None:
    model = tiny_llama(4, sliding_window=8)  # rotating and plain KV layers in turn
    with _stored_conversations(daemon, model, "sliding", 2) as (client, identity, conversations):
        assert client.stats.blocks_held == PREFIX_TOKENS // BLOCK
        for tokens in conversations:
            restored = client.get(identity, [*tokens, 7], model=model)
            assert restored is not None
            kinds = [type(c).__name__ for c in restored.cache]
            assert kinds == ["RotatingKVCache", "KVCache"] * 2
            _continues_like_a_fresh_prefill(model, restored.cache, [*tokens, 7])


def test_the_async_client_shares_blocks_alike(daemon: Daemon) -> None:
    model = tiny_llama()
    identity = EngineIdentity("tiny/async", "cfg", "tok")
    conversations = _conversations(2)

    async def run() -> list[Any]:
        client = await AsyncClient.connect(daemon.socket_path, require=True, block_tokens=BLOCK)
        async with client:
            for tokens in conversations:
                ticket = await client.put(identity, tokens, prefill(model, tokens))
                assert await ticket.wait(SETTLE_SECONDS) == TicketState("stored")
            assert client.stats.blocks_held == PREFIX_TOKENS // BLOCK
            restored = await client.get(identity, [*conversations[1], 7], model=model)
            assert restored is not None
            return restored.cache

    _continues_like_a_fresh_prefill(model, asyncio.run(run()), [*conversations[1], 7])
