"""The lookup deadline and the circuit breaker against a real `kvd serve` that is stopped
(SIGSTOP: a hung daemon, a stuck disk) and resumed (SIGCONT)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import stat
import threading
import time

import numpy as np
import pytest
from daemon_process import Daemon
from kvd_client.async_client import AsyncClient
from kvd_client.breaker import Breaker
from kvd_client.client import Client
from kvd_client.results import TicketState
from kvd_protocol.entry import LayerSpec, TensorSpec
from kvd_protocol.identity import Identity

SETTLE_SECONDS = 30.0
LOOKUP_TIMEOUT = 0.1
# What a loaded 2-core machine may add to a wait on top of its deadline: scheduling, not
# the daemon (it is stopped), so far below the client's 5 s exchange timeout.
SLACK = 1.0

IDENTITY = Identity(
    model_id="breaker/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
PROMPT = list(range(2000, 2128))


def _kv(tokens: int, heads: int = 2) -> tuple[list[LayerSpec], list[np.ndarray]]:
    """One layer of keys and values, heads x tokens x 64 float16 each."""
    shape = (1, heads, tokens, 64)
    rng = np.random.default_rng(tokens)
    spec = TensorSpec("float16", shape)
    return [LayerSpec("kv", (spec, spec), trimmable=True)], [
        rng.standard_normal(shape).astype(np.float16) for _ in range(2)
    ]


def _stored(client: Client, tokens: list[int]) -> None:
    layers, tensors = _kv(len(tokens))
    state = client.put_entry(IDENTITY, tokens, layers, tensors).wait(SETTLE_SECONDS)
    assert state == TicketState("stored")


def _closes(breaker: Breaker) -> float:
    """Seconds until the breaker's probe finds the daemon answering and closes it."""
    started = time.monotonic()
    while breaker.is_open:
        assert time.monotonic() - started < SETTLE_SECONDS, "the breaker never closed"
        time.sleep(0.01)
    return time.monotonic() - started


def _open_files() -> set[int]:
    """This process's descriptors of regular files (not its sockets: connections come and go)."""
    files = set()
    for name in os.listdir("/dev/fd"):
        try:
            if stat.S_ISREG(os.fstat(int(name)).st_mode):
                files.add(int(name))
        except OSError:  # the listing's own descriptor, closed since
            pass
    return files


def _timed_lookup(client: Client, prompt: list[int]) -> tuple[bool, float]:
    """Whether a lookup hit (released at once), and the seconds it took."""
    started = time.monotonic()
    hit = client.lookup(IDENTITY, prompt)
    took = time.monotonic() - started
    if hit is not None:
        hit.release()
    return hit is not None, took


def test_a_hung_daemon_costs_one_lookup_its_deadline_then_is_skipped_until_it_answers(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True, lookup_timeout=LOOKUP_TIMEOUT) as client:
        _stored(client, PROMPT)
        breaker = client.breaker
        assert breaker is not None
        with daemon.paused():
            hit, first = _timed_lookup(client, [*PROMPT, 1])
            assert not hit
            assert LOOKUP_TIMEOUT <= first < LOOKUP_TIMEOUT + SLACK
            assert breaker.is_open
            waits = [_timed_lookup(client, [*PROMPT, 2]) for _ in range(20)]
            assert not any(hit for hit, _ in waits)
            assert max(took for _, took in waits) < LOOKUP_TIMEOUT  # none waited on the daemon
            layers, tensors = _kv(16)
            started = time.monotonic()
            ticket = client.put_entry(IDENTITY, PROMPT[:16], layers, tensors)
            assert time.monotonic() - started < LOOKUP_TIMEOUT
            assert ticket.state.state == "unavailable"
        assert breaker.stats.opened == 1
        assert breaker.stats.skipped_lookups == 20
        assert breaker.stats.skipped_puts == 1
        assert client.stats.failed_lookups == 21  # each a miss for want of the daemon
        assert client.stats.misses["unavailable"] == 21
        assert client.stats.unavailable_puts == 1

        _closes(breaker)
        hit, _ = _timed_lookup(client, [*PROMPT, 3])
        assert hit, "the daemon answers again, and the lookup asks it"
        assert breaker.stats.opened == 1


def test_a_put_stuck_in_a_hung_daemon_is_abandoned_and_never_holds_up_a_twins_lookup(
    daemon: Daemon,
) -> None:
    """The put's commit waits for a daemon stopped just after it handed out the staging file:
    the put gives up after its own timeout, closing that file; meanwhile a lookup on the twin
    client (its own connection) waits only its deadline, and after the put's failure the
    shared breaker skips the twin's lookups too."""
    timeout = 1.0
    with Client.connect(
        daemon.socket_path, timeout, require=True, block_tokens=0, lookup_timeout=LOOKUP_TIMEOUT
    ) as putter:
        lookups = putter.twin()
        _stored(putter, PROMPT)
        assert _timed_lookup(lookups, [*PROMPT, 1])[0]  # both connected before the stop
        layers, tensors = _kv(16384, heads=8)  # 32 MiB: a write long enough to stop during
        before = _open_files()
        stopped = threading.Event()
        outcome: list[TicketState] = []

        def stop_once_handed_a_file() -> None:
            while not outcome and _open_files() <= before:
                time.sleep(0.0002)
            if not outcome:
                os.kill(daemon.pid, signal.SIGSTOP)
                stopped.set()

        def put() -> None:
            outcome.append(putter.put_entry(IDENTITY, list(range(16384)), layers, tensors).state)

        watcher = threading.Thread(target=stop_once_handed_a_file)
        writer = threading.Thread(target=put)
        watcher.start()
        started = time.monotonic()
        writer.start()
        try:
            assert stopped.wait(SETTLE_SECONDS), f"the put ended first: {outcome}"
            hit, took = _timed_lookup(lookups, [*PROMPT, 2])
            assert not hit
            assert took < LOOKUP_TIMEOUT + SLACK  # not the put's timeout
            writer.join(SETTLE_SECONDS)
            put_took = time.monotonic() - started
            assert [state.state for state in outcome] == ["unavailable"]
            assert put_took < timeout + SLACK
            assert _open_files() == before, "the staging file was left open"
            assert putter.breaker is lookups.breaker
            assert lookups.breaker is not None
            assert lookups.breaker.is_open
            assert not _timed_lookup(lookups, [*PROMPT, 3])[0]
            assert lookups.breaker.stats.skipped_lookups >= 1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            watcher.join()
        _closes(lookups.breaker)
        assert _timed_lookup(lookups, [*PROMPT, 4])[0]
        _stored(putter, list(range(50000, 50016)))  # the put after the stuck one is stored
        lookups.close()


def test_a_daemon_that_is_down_is_skipped_and_found_again_when_it_starts(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        _stored(client, PROMPT)
        daemon.stop()
        assert client.lookup(IDENTITY, [*PROMPT, 1]) is None  # refused: opens the breaker
        assert client.breaker is not None
        assert client.breaker.is_open
        daemon.start()
        _closes(client.breaker)
        assert _timed_lookup(client, [*PROMPT, 1])[0]
        assert client.breaker.stats.opened == 1


def test_a_client_without_a_breaker_asks_the_hung_daemon_each_time(daemon: Daemon) -> None:
    with Client.connect(
        daemon.socket_path, require=True, lookup_timeout=LOOKUP_TIMEOUT, breaker=False
    ) as client:
        assert client.breaker is None
        with daemon.paused():
            waits = [_timed_lookup(client, [*PROMPT, n]) for n in range(3)]
        assert all(not hit and took >= LOOKUP_TIMEOUT for hit, took in waits)


def test_the_async_client_keeps_the_deadline_and_shares_the_breaker(daemon: Daemon) -> None:
    async def scenario() -> None:
        async with await AsyncClient.connect(
            daemon.socket_path, require=True, lookup_timeout=LOOKUP_TIMEOUT
        ) as client:
            layers, tensors = _kv(len(PROMPT))
            ticket = await client.put_entry(IDENTITY, PROMPT, layers, tensors)
            assert await ticket.wait(SETTLE_SECONDS) == TicketState("stored")
            twin = client.twin()
            with daemon.paused():
                started = time.monotonic()
                assert await client.lookup(IDENTITY, [*PROMPT, 1]) is None
                assert LOOKUP_TIMEOUT <= time.monotonic() - started < LOOKUP_TIMEOUT + SLACK
                assert twin.breaker is client.breaker
                assert client.breaker is not None
                assert client.breaker.is_open
                assert await twin.lookup(IDENTITY, [*PROMPT, 1]) is None
                assert client.breaker.stats.skipped_lookups == 1
            while client.breaker.is_open:
                await asyncio.sleep(0.01)
            hit = await twin.lookup(IDENTITY, [*PROMPT, 1])
            assert hit is not None
            await hit.release()
            await twin.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_a_lookup_timeout_that_is_not_a_positive_number_of_seconds_is_refused(
    seconds: float,
) -> None:
    with pytest.raises(ValueError, match="lookup_timeout must be a positive number"):
        Client.connect("/nonexistent/kvd.sock", lookup_timeout=seconds)
