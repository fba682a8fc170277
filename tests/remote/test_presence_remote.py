"""Presence with a remote tier, end to end: two daemons on tiers of their own and one real
SeaweedFS. A prompt put on A is uploaded; B's presence says how much of it the bucket holds
past B's own tier without downloading a byte or counting anything, and a get on B then
restores exactly that much (its fetch); afterwards B's own tier holds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from daemon_e2e import SETTLE_SECONDS, wait_until
from daemon_process import Daemon, kvctl
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from mlx_lm.models.cache import make_prompt_cache
from model_folders import SMALL_CONFIGS, VOCAB, small_model
from remote_e2e import stored, two_macs
from seaweed import Seaweed

from kvd.remote import keys
from kvd.remote.bucket import Bucket

BLOCK = 16
MIN_TOKENS = 32  # remote_min_tokens: two blocks
BLOCKS = 6
TOKENS = BLOCKS * BLOCK + 5  # six whole blocks in the bucket, a tail of 5 that never is
FETCH_TIMEOUT = 20  # seconds: generous, on a loaded machine


def _counted(client: Client) -> tuple[Any, ...]:
    """Every count a lookup or a fetch moves: the tier's and the remote tier's."""
    status = client.status()
    remote: dict[str, Any] = status["remote"]  # type: ignore[assignment]
    return (
        status["hits"],
        status["misses"],
        status.get("engine_held"),
        remote["hits"],
        remote["misses"],
        remote["downloaded_blocks"],
        status["entries"],
    )


def test_presence_says_what_the_bucket_adds_and_a_get_then_restores_it(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    settings = {"min_tokens": MIN_TOKENS, "fetch_timeout": FETCH_TIMEOUT}
    with two_macs(seaweed, tmp_path, s3_prefix, **settings) as (a, b):
        _presence_then_get(a, b, seaweed_bucket, s3_prefix, tmp_path)


def _presence_then_get(
    a: Daemon, b: Daemon, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    model = small_model(
        {**SMALL_CONFIGS["llama"], "model_type": "llama", "vocab_size": VOCAB}, seed=3
    )
    identity = EngineIdentity("remote/presence", "cfg", "tok")
    tokens = [int(t) for t in mx.random.randint(0, VOCAB, (TOKENS,), key=mx.random.key(5))]
    with Client.connect(a.socket_path, require=True, block_tokens=BLOCK) as client:
        cache = make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])
        assert client.put(identity, tokens, cache).wait(SETTLE_SECONDS) == TicketState("stored")
    folder = keys.identity_key(s3_prefix, identity.to_protocol().digest())
    wait_until(
        lambda: sum(k.startswith("b/") for k in stored(seaweed_bucket, folder)) >= BLOCKS,
        "the bucket holds A's blocks",
    )
    asked = [*tokens, 1]
    with Client.connect(
        b.socket_path, require=True, block_tokens=BLOCK, lookup_timeout=SETTLE_SECONDS
    ) as client:
        before = _counted(client)
        answer = client.presence(identity, asked)
        assert (answer.matched, answer.entry, answer.miss) == (0, None, "no entry")
        assert answer.remote == BLOCKS * BLOCK
        assert answer.remote_miss == "short"  # the tail is no block: never in the bucket
        assert _counted(client) == before  # nothing restored, downloaded or counted
        nothing = client.presence(EngineIdentity("remote/never", "cfg", "tok"), asked)
        assert (nothing.matched, nothing.remote, nothing.remote_miss) == (0, 0, "no_layout")

        restored = client.get(identity, asked, model=model)
        if restored is None:  # the probe outlasted a lookup's brief wait: the fetch went on
            wait_until(lambda: _counted(client)[3], "B's fetch")
            restored = client.get(identity, asked, model=model)
        assert restored is not None
        assert restored.matched == answer.matched + answer.remote

        after = client.presence(identity, asked)
        assert after.matched == BLOCKS * BLOCK
        assert after.remote == 0  # the bucket holds nothing past what B now holds
    prompt_file = tmp_path / "prompt.json"
    prompt_file.write_text(json.dumps(asked))
    digest = identity.to_protocol().digest()
    shown = kvctl(a, "match", "--identity", digest, "--tokens", str(prompt_file))
    assert shown.returncode == 0, shown.stderr
    assert f"local     {TOKENS} tokens from entry" in shown.stdout
    assert "remote    0 more tokens in the bucket" in shown.stdout
