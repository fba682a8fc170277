"""Presence against a bucket scripted to misbehave (the fake bucket on loopback), with a real
daemon: the answer says how far the bucket's blocks reach with HEADs alone (no block is
downloaded), and a bucket that fails or hangs costs the answer its reason, never more than
remote_fetch_timeout, nor the local part; nothing is counted."""

from __future__ import annotations

import time
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, kv_tensors
from daemon_e2e import IDENTITY, SETTLE_SECONDS
from fake_bucket import FakeBucket, hang, running_bucket, status
from kvd_client import Client, TicketState
from test_fetch_hostile import FETCH_TIMEOUT, daemon_on, prompt, seed

ENDED_WITHIN = 10.0  # seconds past the deadline an answer may take, on a loaded machine


def _presence(client: Client, tokens: list[int]) -> tuple[object, ...]:
    answer = client.presence(IDENTITY, [*tokens, 1])
    return answer.matched, answer.remote, answer.remote_miss


def _counted(client: Client) -> tuple[object, ...]:
    status_ = client.status()
    remote = status_["remote"]
    assert isinstance(remote, dict)
    return status_["hits"], status_["misses"], remote["hits"], remote["misses"]


def test_presence_asks_heads_only_and_survives_a_failing_or_hung_bucket(tmp_path: Path) -> None:
    tokens = prompt(1, blocks=4)
    local = tokens[: 2 * BLOCK_TOKENS]
    with running_bucket() as bucket, daemon_on(bucket, tmp_path) as daemon:
        block_keys = seed(bucket, tokens)
        with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK_TOKENS) as client:
            layers, tensors = kv_tensors(local)
            ticket = client.put_entry(IDENTITY, local, layers, tensors)
            assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
            before = _counted(client)
            # Two blocks local, four in the bucket: two more, and the tail of 3 is no block.
            assert _presence(client, tokens) == (2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS, "short")
            assert sum(bucket.asked("GET", key) for key in block_keys) == 0
            assert _counted(client) == before
            _failing(bucket, client, tokens)
            assert _counted(client) == before


def _failing(bucket: FakeBucket, client: Client, tokens: list[int]) -> None:
    """The bucket hanging on every HEAD, then failing them: the local part answered as ever."""
    other = prompt(2, blocks=4)  # blocks not known to be there: they are asked about
    seed(bucket, other)
    bucket.on(lambda request: request.method == "HEAD", hang(bucket))
    started = time.monotonic()
    hung = _presence(client, other)
    took = time.monotonic() - started
    assert hung == (0, 0, "timeout")
    assert took < FETCH_TIMEOUT + ENDED_WITHIN
    bucket.clear()
    bucket.on(lambda request: request.method == "HEAD", status(500, "InternalError"))
    assert _presence(client, other) == (0, 0, "store_error")
    assert _presence(client, tokens)[0] == 2 * BLOCK_TOKENS
