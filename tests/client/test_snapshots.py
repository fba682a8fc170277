"""The cold tier's snapshots against a real daemon that keeps blocks (of 16 tokens here):
a snapshot copies only the rows no block of the daemon's or of a waiting snapshot holds,
a put whose left-out blocks were evicted meanwhile aborts and the next one copies in full,
segments of caches that always trim keep their whole blocks only, the backlog keeps its
byte bound and finished turns over segments, and every restored cache answers as an
uninterrupted run."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import mlx.core as mx
import pytest
from daemon_process import Daemon
from kvd_client.backlog import Kind
from kvd_client.block_io import BlocksNotHeld
from kvd_client.client import Client
from kvd_client.mlx_lm_cache import ColdTier
from kvd_client.results import TicketState
from tiny_engine import byte_tokenizer, uninterrupted
from tiny_models import greedy, prefill, prompt, tiny_llama

BLOCK = 16
STEPS = 6
SETTLE_SECONDS = 30.0


@contextmanager
def _tier(daemon: Daemon, model: Any, **kwargs: Any) -> Iterator[tuple[Client, ColdTier]]:
    with (
        Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client,
        ColdTier(client, model, byte_tokenizer(), **kwargs) as tier,
    ):
        yield client, tier


def _row_bytes(cache: Sequence[Any]) -> int:
    """The bytes of one token's rows in every layer's keys and values."""
    return sum(layer.keys[..., :1, :].nbytes + layer.values[..., :1, :].nbytes for layer in cache)


def _stored(tier: ColdTier, tokens: list[int], cache: list[Any], **kwargs: Any) -> None:
    ticket = tier.store(tokens, cache, **kwargs).result(SETTLE_SECONDS)
    assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")


def _copied(tier: ColdTier, tokens: list[int], cache: list[Any]) -> int:
    """The bytes a stored snapshot of cache copied."""
    before = tier.stats.bytes_copied
    _stored(tier, tokens, cache)
    return tier.stats.bytes_copied - before


@pytest.mark.parametrize("learned", ["stored", "restored"])
def test_the_next_turn_copies_only_the_rows_past_the_blocks_the_daemon_holds(
    daemon: Daemon, learned: str
) -> None:
    """The tier learns which blocks the daemon holds from its own put, or (a new tier) from
    the entry it restores the turn from."""
    model = tiny_llama()
    first = prompt(40)
    second = first + prompt(30, seed=2)
    with _tier(daemon, model) as (client, first_tier), ExitStack() as later:
        cache = prefill(model, first)
        row = _row_bytes(cache)
        assert _copied(first_tier, first, cache) == 40 * row  # the first: every row
        tier = first_tier
        if learned == "restored":
            tier = later.enter_context(ColdTier(client, model, byte_tokenizer()))
            cache, remaining = tier.prepare(second)
            assert len(remaining) == 30
        prefill(model, second[40:], cache)
        held = tier._stores.stats.blocks_held
        # Blocks 0 and 1 (rows 0..31) are the daemon's: rows 32..69 are copied.
        assert _copied(tier, second, cache) == (70 - 2 * BLOCK) * row
        assert tier._stores.stats.blocks_held - held == 2
        _restores_as_uninterrupted(client, tier, second, 7)


def test_a_put_whose_blocks_were_evicted_aborts_and_the_next_copies_in_full(
    daemon: Daemon,
) -> None:
    model = tiny_llama()
    first = prompt(40)
    second = first + prompt(10, seed=4)
    with _tier(daemon, model) as (client, tier):
        cache = prefill(model, first)
        row = _row_bytes(cache)
        _stored(tier, first, cache)
        assert client.evict(all=True).entries == 1
        prefill(model, second[40:], cache)
        aborted = tier.store(second, cache)
        with pytest.raises(BlocksNotHeld):
            aborted.result(SETTLE_SECONDS)
        assert tier.stats.aborted == 1
        assert tier.drain(SETTLE_SECONDS)  # the aborted snapshot's copies are gone
        status = client.status()
        assert status["staged_puts"] == status["staged_bytes"] == 0  # nothing left behind
        assert _copied(tier, second, cache) == 50 * row  # the memo forgot: every row again
        _restores_as_uninterrupted(client, tier, second, 5)


def test_a_segment_of_caches_that_trim_keeps_its_whole_blocks_only(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(40)
    with _tier(daemon, model) as (client, tier):
        cache = prefill(model, tokens)
        row = _row_bytes(cache)
        _stored(tier, tokens, cache, kind=Kind.SEGMENT)
        assert tier.stats.bytes_copied == 2 * BLOCK * row
        short = tier.store(tokens[:10], prefill(model, tokens[:10]), kind=Kind.SEGMENT)
        assert short.cancelled()  # not even a block: the finished turn will serve it
        (entry,) = client.list_entries(tier.identity.to_protocol())
        assert entry.tokens == 2 * BLOCK
        # The finished turn shares the segment's blocks: its put writes the tail alone.
        written = tier._stores.stats.blocks_written
        assert _copied(tier, tokens, cache) == (40 - 2 * BLOCK) * row
        assert tier._stores.stats.blocks_written == written


def test_a_segment_of_caches_that_may_not_trim_keeps_its_exact_length(daemon: Daemon) -> None:
    model = tiny_llama(4, sliding_window=8)
    tokens = prompt(40)
    with _tier(daemon, model) as (client, tier):
        _stored(tier, tokens, prefill(model, tokens), kind=Kind.SEGMENT)
        (entry,) = client.list_entries(tier.identity.to_protocol())
    assert entry.tokens == len(tokens)


def test_a_conversation_in_blocks_answers_as_an_uninterrupted_run(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(35)
    with _tier(daemon, model) as (_client, tier):
        for turn in range(3):
            got = [r.token for r in tier.stream_generate(tokens, STEPS)]
            assert tier.drain(SETTLE_SECONDS)
            assert got == uninterrupted(model, tier.tokenizer, tokens, STEPS)
            tokens = [*tokens, *got, *prompt(20, seed=10 + turn)]
    assert tier.stats.restored == 2
    assert tier.stats.stored == 3
    assert tier.stats.failed == tier.stats.aborted == 0
    # Each turn copied the rows past the blocks of the turn before: 41 rows (2 whole
    # blocks), then rows 32..67 (4 blocks), then 64..93.
    rows = 41 + (67 - 2 * BLOCK) + (93 - 4 * BLOCK)
    assert tier.stats.bytes_copied == rows * _row_bytes(prefill(model, tokens[:1]))


def test_a_burst_keeps_finished_turns_over_segments_within_the_byte_bound(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    """While the sending thread is held up, four conversations come in, each a system
    segment (1 block), a user segment (2 blocks) and a finished turn (3 blocks), which
    supersedes its segments. The bound holds two finished turns' copies: once full, the
    segments go first (the new ones, here), and a finished turn is dropped only for
    another finished turn, the oldest first."""
    model = tiny_llama()
    conversations = [prompt(3 * BLOCK, seed=20 + i) for i in range(4)]
    row = _row_bytes(prefill(model, conversations[0][:1]))
    turn = 3 * BLOCK * row
    bound = 2 * turn + row
    caplog.set_level(logging.WARNING, logger="kvd_client")
    with _tier(daemon, model, backlog_bytes=bound) as (_, tier):
        finished, segments = [], []
        with tier._stores._lock:  # the sending thread waits on it: what comes queues up
            first = prompt(3, seed=99)
            in_flight = tier.store(first, prefill(model, first))
            while len(tier._backlog):  # until the sending thread holds it
                time.sleep(0.01)
            for tokens in conversations:
                for length in (BLOCK + 4, 2 * BLOCK + 8):
                    segment = prefill(model, tokens[:length])
                    segments.append(tier.store(tokens[:length], segment, kind=Kind.SEGMENT))
                    assert tier._backlog.nbytes <= bound
                finished.append(tier.store(tokens, prefill(model, tokens)))
                assert tier._backlog.nbytes <= bound
        assert in_flight.result(SETTLE_SECONDS).wait(SETTLE_SECONDS) == TicketState("stored")
        states = [future.result(SETTLE_SECONDS).wait(SETTLE_SECONDS) for future in finished[2:]]
    assert all(future.cancelled() for future in [*segments, *finished[:2]])
    assert states == [TicketState("stored")] * 2
    assert tier.stats.superseded == 4  # the segments of the first two conversations
    assert tier.stats.dropped == 6  # those of the last two, then the first two turns
    assert tier.stats.dropped_bytes == 2 * (BLOCK + 2 * BLOCK + 3 * BLOCK) * row
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 6
    assert sum(f"({turn} bytes)" in message for message in dropped) == 2


def _restores_as_uninterrupted(
    client: Client, tier: ColdTier, tokens: list[int], last: int
) -> None:
    """tokens are restored whole, and decode from last as the caches of an uninterrupted
    prefill of them do: token for token, logits alike."""
    restored = client.get(tier.identity, [*tokens, last], model=tier.model)
    assert restored is not None
    assert restored.matched == len(tokens)
    got, got_logits = greedy(tier.model, restored.cache, [last], STEPS)
    want, want_logits = greedy(tier.model, prefill(tier.model, tokens), [last], STEPS)
    assert got == want
    assert bool(mx.allclose(got_logits, want_logits, atol=1e-5).item())
