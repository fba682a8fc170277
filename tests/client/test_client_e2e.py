"""Both clients against a real `kvd serve` subprocess: put, lookup, tickets, restart."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
from daemon_process import START_SECONDS, Daemon
from kvd_client.async_client import AsyncClient
from kvd_client.client import Client
from kvd_client.results import TicketState
from kvd_protocol.entry import LayerSpec, TensorSpec
from kvd_protocol.errors import DaemonUnavailableError
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens, unpack_tokens

SETTLE_SECONDS = 30.0  # bound on waiting for a ticket to settle

IDENTITY = Identity(
    model_id="test/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
OTHER_IDENTITY = Identity(
    model_id="test/other-model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
PROMPT = list(range(1000, 1128))


def _entry(tokens: int, seed: int) -> tuple[list[LayerSpec], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    tensors = [
        rng.standard_normal((1, 2, tokens, 8)).astype(np.float16) for _ in range(4)
    ]  # two layers, keys and values
    spec = TensorSpec("float16", (1, 2, tokens, 8))
    layers = [LayerSpec("kv", (spec, spec), trimmable=True, meta={"offset": tokens})] * 2
    return layers, tensors


def _put_stored(client: Client, tokens: list[int], seed: int) -> list[np.ndarray]:
    layers, tensors = _entry(len(tokens), seed)
    ticket = client.put_entry(IDENTITY, tokens, layers, tensors)
    assert ticket.state.state == "pending"
    assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
    return tensors


def test_put_then_lookup_returns_the_same_bytes(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        tensors = _put_stored(client, PROMPT, seed=1)
        result = client.lookup(IDENTITY, [*PROMPT, 7, 8, 9])
        assert result is not None
        with result:
            assert result.matched == len(PROMPT)
            assert result.header.identity == IDENTITY
            assert unpack_tokens(result.header.tokens) == PROMPT
            assert [bytes(view) for view in result.tensors] == [t.tobytes() for t in tensors]
            assert all(view.readonly for view in result.tensors)
            result.verify()
        assert result.released
        assert client.flush(SETTLE_SECONDS)
        assert client.stats.rejected_entries == 0


def test_a_duplicate_put_is_settled_at_once(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        _put_stored(client, PROMPT, seed=1)
        layers, tensors = _entry(len(PROMPT), seed=1)
        ticket = client.put_entry(IDENTITY, PROMPT, layers, tensors)
        assert ticket.state == TicketState("stored", "duplicate")


def test_waits_longer_than_the_wire_allows_are_asked_as_the_longest_it_does(
    daemon: Daemon,
) -> None:
    """A day is the longest wait the protocol takes: a caller's longer one is not a bad
    message (the flush raised, the ticket read unavailable)."""
    years = 1e9
    with Client.connect(daemon.socket_path, require=True) as client:
        layers, tensors = _entry(len(PROMPT), seed=1)
        ticket = client.put_entry(IDENTITY, PROMPT, layers, tensors)
        assert ticket.wait(years) == TicketState("stored")
        assert client.flush(years)
        client.measured_prefill(4096, years)  # a prefill no engine takes, bounded as sent
        _put_stored(client, [*PROMPT, 1], seed=2)
        identities = client.status()["identities"]
        assert isinstance(identities, list)
        assert identities[0]["prefill_ms_per_token"] == 60_000.0


def test_lookup_misses_other_identities_and_unrelated_prompts(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        _put_stored(client, PROMPT, seed=1)
        assert client.lookup(OTHER_IDENTITY, [*PROMPT, 1]) is None
        assert client.lookup(IDENTITY, [5, 6, 7, 8]) is None
        assert client.stats.failed_lookups == 0


def test_operator_calls(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        assert client.ping() >= 0.0
        assert isinstance(client.status(), dict)
        _put_stored(client, PROMPT, seed=1)
        assert client.flush(SETTLE_SECONDS)
        listed = client.list_entries(IDENTITY)
        assert [entry.tokens for entry in listed] == [len(PROMPT)]
        evicted = client.evict(all=True)
        assert evicted.entries == 1
        assert client.list_entries() == []
        assert client.lookup(IDENTITY, [*PROMPT, 1]) is None


def test_a_daemon_that_stops_answering_times_the_exchange_out(daemon: Daemon) -> None:
    """The socket's timeout is the kernel's (SO_RCVTIMEO): it still ends a wait for a reply
    that never comes, with the text a Python socket timeout gives."""
    timeout = 0.3
    with Client.connect(daemon.socket_path, timeout=timeout, require=True) as client:
        client.ping()
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(DaemonUnavailableError, match=r"^ping: timed out$"):
                client.ping()
            waited = time.monotonic() - started
            assert not client.connected
            assert client.lookup(IDENTITY, PROMPT) is None
            assert client.stats.misses["unavailable"] == 1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert timeout <= waited < timeout + 5  # generous: a loaded machine's scheduling
        assert client.ping() >= 0  # a new connection, once the daemon answers again
        assert client.stats.reconnects == 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # as Ctrl-C would, in the middle of an exchange


def test_an_exchange_interrupted_before_its_reply_never_answers_the_next_one(
    daemon: Daemon,
) -> None:
    """A lookup interrupted while its reply is on the way leaves that reply unread: the client
    drops the connection, so the next lookup gets its own answer (a miss), not the hit. (The
    lookup may wait longer than the interruption comes.)"""
    with Client.connect(daemon.socket_path, require=True, lookup_timeout=5.0) as client:
        _put_stored(client, PROMPT, seed=1)
        assert client.flush(SETTLE_SECONDS)
        os.kill(daemon.pid, signal.SIGSTOP)
        previous = signal.signal(signal.SIGALRM, _interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(KeyboardInterrupt):
                client.lookup(IDENTITY, [*PROMPT, 1])  # a hit, once the daemon goes on
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            os.kill(daemon.pid, signal.SIGCONT)
        assert not client.connected
        assert client.lookup(OTHER_IDENTITY, [*PROMPT, 1]) is None
        hit = client.lookup(IDENTITY, [*PROMPT, 1])
        assert hit is not None
        assert hit.matched == len(PROMPT)
        hit.release()


def test_client_survives_a_daemon_restart(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        _put_stored(client, PROMPT, seed=1)
        assert client.flush(SETTLE_SECONDS)
        daemon.stop()

        layers, tensors = _entry(16, seed=2)
        assert client.put_entry(IDENTITY, PROMPT[:16], layers, tensors).state.state == (
            "unavailable"
        )
        assert client.lookup(IDENTITY, [*PROMPT, 1]) is None
        with pytest.raises(DaemonUnavailableError):
            client.ping()
        assert client.stats.unavailable_puts == 1
        assert client.stats.failed_lookups == 1

        daemon.start()
        deadline = time.monotonic() + START_SECONDS  # the backoff may delay the first retry
        result = client.lookup(IDENTITY, [*PROMPT, 1])
        while result is None and time.monotonic() < deadline:
            time.sleep(0.05)
            result = client.lookup(IDENTITY, [*PROMPT, 1])
        assert result is not None, "the flushed entry did not survive the restart"
        with result:
            assert result.matched == len(PROMPT)
            result.verify()
        assert client.connected
        assert client.stats.reconnects >= 1


def test_async_client_put_and_lookup(daemon: Daemon) -> None:
    async def scenario() -> None:
        async with await AsyncClient.connect(daemon.socket_path, require=True) as client:
            layers, tensors = _entry(len(PROMPT), seed=3)
            ticket = await client.put_entry(IDENTITY, pack_tokens(PROMPT), layers, tensors)
            assert await ticket.wait(SETTLE_SECONDS) == TicketState("stored")
            result = await client.lookup(IDENTITY, [*PROMPT, 1])
            assert result is not None
            async with result:
                assert result.matched == len(PROMPT)
                assert [bytes(view) for view in result.tensors] == [t.tobytes() for t in tensors]
            assert await client.flush(SETTLE_SECONDS)
            pings = await asyncio.gather(*(client.ping() for _ in range(8)))
            assert len(pings) == 8

    asyncio.run(scenario())
