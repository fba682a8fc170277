"""The read path end to end: two daemons on two tier folders ("two Macs") and one real SeaweedFS.

A prompt cache put on A goes to the bucket (A's uploads); B restores it exactly (its blocks
byte for byte A's) and generation continues token for token; with the bucket killed B
answers lookups within its usual time and stores locally, and with the bucket hung a get is
a miss in its usual time (the fetch goes on once the bucket answers); a block damaged in the
bucket is refused on B and leaves its tier as it was; a block missing mid-chain leaves the
blocks before it fetched when they reach remote_min_tokens past what is local; a prefix
shorter than remote_min_tokens past what is local is not fetched; a client that predates the
fetch field is answered at once (and the fetch goes on: its next lookup finds the entry
local); a daemon pointed at another prefix (another tenant) finds nothing of it.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from daemon_e2e import SETTLE_SECONDS, RawPeer, staging_files, wait_until
from daemon_process import Daemon, running_daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol import messages as m
from kvd_protocol.blocks import BLOCK_SUFFIX, block_hashes
from kvd_protocol.entry_reader import parse_block_head
from kvd_protocol.tokens import pack_tokens
from mlx_lm.models.cache import make_prompt_cache
from model_folders import SMALL_CONFIGS, VOCAB, small_model
from remote_e2e import remote_flags, remote_status, restart, stored
from remote_e2e import two_macs as sharing
from seaweed import Seaweed

from kvd.remote import keys
from kvd.remote.bucket import Bucket

BLOCK = 16  # tokens per block: a tiny prompt spans several
MIN_TOKENS = 32  # remote_min_tokens: two blocks
BLOCKS = 6
TOKENS = BLOCKS * BLOCK + 5  # six whole blocks (shared) and a tail of 5 (not shared)
STEPS = 4
FETCH_TIMEOUT = 20  # seconds: generous, on a loaded machine
LOOKUPS = 7  # timed lookups per daemon


@pytest.fixture(scope="module")
def model() -> Any:
    config = {**SMALL_CONFIGS["llama"], "model_type": "llama", "vocab_size": VOCAB}
    return small_model(config, seed=3)


@pytest.fixture
def two_macs(
    tmp_path: Path, seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str
) -> Iterator[tuple[Daemon, Daemon]]:
    """Daemons A and B on tiers of their own, sharing the bucket under the test's prefix."""
    with sharing(
        seaweed, tmp_path, s3_prefix, min_tokens=MIN_TOKENS, fetch_timeout=FETCH_TIMEOUT
    ) as macs:
        yield macs


def prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in mx.random.randint(0, VOCAB, (length,), key=mx.random.key(seed))]


def prefill(model: Any, tokens: Sequence[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def greedy(model: Any, cache: list[Any], last: Sequence[int]) -> tuple[list[int], mx.array]:
    """Feed last, then STEPS tokens greedily: the tokens and every step's logits."""
    logits = model(mx.array([list(last)]), cache=cache)[:, -1, :]
    tokens, every = [], [logits]
    for _ in range(STEPS):
        tokens.append(cast(int, mx.argmax(logits).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1, :]
        every.append(logits)
    return tokens, mx.concatenate(every)


def put_on(daemon: Daemon, identity: EngineIdentity, tokens: list[int], model: Any) -> None:
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client:
        ticket = client.put(identity, tokens, prefill(model, tokens))
        assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")


def uploaded(bucket: Bucket, prefix: str, identity: EngineIdentity, blocks: int) -> None:
    """Wait until the bucket holds the identity's layout and blocks (A's uploads)."""
    folder = keys.identity_key(prefix, identity.to_protocol().digest())

    def done() -> bool:
        held = stored(bucket, folder)
        return "layout" in held and sum(key.startswith("b/") for key in held) >= blocks

    wait_until(done, "the bucket holds A's blocks")


def fetched_get(
    client: Client, daemon: Daemon, identity: EngineIdentity, asked: list[int], model: Any
) -> Any:
    """client.get of a prompt whose blocks only the bucket holds, on daemon. The get waits for
    the daemon's fetch (the daemon said "fetching"), unless the daemon's probe of the bucket
    outlasted the brief wait a lookup allows it (on a loaded machine): then the fetch went on
    by itself, and once it ended the next get finds its entry local."""

    def ended() -> int:
        remote = remote_of(daemon)
        return int(remote["hits"] + remote["misses"])

    before = ended()
    restored = client.get(identity, asked, model=model)
    if restored is None and not client.stats.remote_fetches:
        wait_until(lambda: ended() > before, "a fetch")
        restored = client.get(identity, asked, model=model)
    return restored


def remote_of(daemon: Daemon) -> dict[str, Any]:
    with RawPeer(daemon.socket_path) as peer:
        return remote_status(peer)


def block_files(tier: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in (tier / "entries").rglob(f"*{BLOCK_SUFFIX}")}


def entry_files(tier: Path) -> list[Path]:
    return [path for path in (tier / "entries").rglob("*") if path.is_file()]


def test_a_prompt_cache_put_on_one_daemon_restores_exactly_on_another(
    two_macs: tuple[Daemon, Daemon], seaweed_bucket: Bucket, s3_prefix: str, model: Any
) -> None:
    a, b = two_macs
    identity = EngineIdentity("tiny/shared", "cfg", "tok")
    tokens = prompt(TOKENS, seed=1)
    put_on(a, identity, tokens, model)
    uploaded(seaweed_bucket, s3_prefix, identity, BLOCKS)
    asked = [*tokens, 7]
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        assert m.REMOTE_FETCH_FEATURE in client._link.server.features  # type: ignore[union-attr]
        restored = fetched_get(client, b, identity, asked, model)
        assert restored is not None
        assert restored.matched == BLOCKS * BLOCK  # whole blocks only: the tail stays on A
        got = greedy(model, restored.cache, asked[restored.matched :])
        assert client.flush(SETTLE_SECONDS)  # B's blocks in place, as A's are
    # B's blocks are A's, byte for byte; B's cache decodes as a fresh prefill of the same
    # tokens, and generation on B continues token for token as on A.
    assert block_files(b.tier) == block_files(a.tier)
    fresh = greedy(model, prefill(model, tokens[: BLOCKS * BLOCK]), asked[BLOCKS * BLOCK :])
    assert got[0] == fresh[0]
    assert bool(mx.array_equal(got[1], fresh[1]).item())
    on_a = greedy(model, prefill(model, tokens), asked[-1:])
    assert got[0] == on_a[0]
    remote = remote_of(b)
    assert remote["hits"] == 1
    assert remote["downloaded_blocks"] == BLOCKS
    assert remote["restore_gbps_p50"] > 0
    # B's entry, durable, is not sent back: its blocks are known to be in the bucket.
    assert remote["pending_uploads"] == remote["uploaded_blocks"] == 0
    # Asked again, B answers from its own tier: nothing more is fetched.
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        assert client.get(identity, asked, model=model) is not None
        assert client.stats.remote_fetches == 0
    assert remote_of(b)["downloaded_blocks"] == BLOCKS


def _lookup_seconds(
    daemon: Daemon, identity: EngineIdentity, prompts: list[list[int]]
) -> list[float]:
    """Each prompt's lookup (a miss: nothing local), timed; none failed."""
    wire = identity.to_protocol()
    seconds = []
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK) as client:
        for tokens in prompts:
            started = time.perf_counter()
            assert client.lookup(wire, tokens) is None
            seconds.append(time.perf_counter() - started)
        assert client.stats.failed_lookups == 0
    return seconds


def test_with_the_bucket_killed_lookups_answer_in_their_usual_time_and_puts_bucket_locally(
    two_macs: tuple[Daemon, Daemon], seaweed: Seaweed, tmp_path: Path, model: Any
) -> None:
    _, b = two_macs
    identity = EngineIdentity("tiny/down", "cfg", "tok")
    prompts = [prompt(8 * BLOCK, seed=100 + i) for i in range(LOOKUPS)]
    seaweed.kill()
    try:
        with running_daemon(tmp_path / "local-only") as local_only:
            usual = statistics.median(_lookup_seconds(local_only, identity, prompts))
        remote_down = statistics.median(_lookup_seconds(b, identity, prompts))
        # A generous bound: the point is that no lookup waits on the dead bucket.
        assert remote_down < 5 * usual + 0.05, (remote_down, usual)
        put_on(b, identity, prompts[0], model)
        with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
            found = client.lookup(identity.to_protocol(), [*prompts[0], 7])
            assert found is not None
            found.release()
        assert remote_of(b)["state"] in ("degraded", "down")
    finally:
        restart(seaweed)  # and the next test's uploads wait for no volume


def test_with_the_bucket_hung_a_get_is_a_miss_in_its_usual_time(
    two_macs: tuple[Daemon, Daemon],
    seaweed: Seaweed,
    seaweed_bucket: Bucket,
    s3_prefix: str,
    model: Any,
) -> None:
    a, b = two_macs
    identity = EngineIdentity("tiny/hung", "cfg", "tok")
    tokens = prompt(TOKENS, seed=7)
    put_on(a, identity, tokens, model)
    uploaded(seaweed_bucket, s3_prefix, identity, BLOCKS)
    assert seaweed.process is not None
    os.killpg(seaweed.process.pid, signal.SIGSTOP)  # it holds connections and answers nothing
    try:
        with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
            # B's probe cannot end: the get is a miss within the engine's lookup deadline
            # (past it, the client would count the daemon unavailable), never told to wait.
            assert client.get(identity, [*tokens, 7], model=model) is None
            assert client.stats.failed_lookups == 0
            assert client.stats.remote_fetches == 0
            assert client.stats.misses == {"no entry": 1}
    finally:
        os.killpg(seaweed.process.pid, signal.SIGCONT)
    # The probe goes on once the bucket answers, and its fetch with it: the next get is local.
    wait_until(lambda: remote_of(b)["hits"], "the fetch the hung probe began")
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        restored = client.get(identity, [*tokens, 7], model=model)
        assert restored is not None
        assert restored.matched == BLOCKS * BLOCK
        assert client.stats.remote_fetches == 0


def _damage(bucket: Bucket, key: str, name: str) -> None:
    """One bit of a key in the block object (as a failing disk or a hostile writer would)."""
    data = bytearray(bucket.get(key, 1 << 26) or b"")
    block = parse_block_head(name, data, len(data))
    data[block.slots[0].start + 3] ^= 1
    bucket.delete(key)
    assert bucket.put_if_absent(key, bytes(data))


def test_a_block_damaged_in_the_bucket_is_refused_and_leaves_the_tier_as_it_was(
    two_macs: tuple[Daemon, Daemon], seaweed_bucket: Bucket, s3_prefix: str, model: Any
) -> None:
    a, b = two_macs
    identity = EngineIdentity("tiny/damaged", "cfg", "tok")
    tokens = prompt(TOKENS, seed=2)
    put_on(a, identity, tokens, model)
    uploaded(seaweed_bucket, s3_prefix, identity, BLOCKS)
    digest = identity.to_protocol().digest()
    damaged = sorted(block_files(a.tier))[2]
    _damage(seaweed_bucket, f"{keys.identity_key(s3_prefix, digest)}/b/{damaged}", damaged)
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        assert fetched_get(client, b, identity, [*tokens, 7], model) is None
        assert client.list_entries() == []
    remote = remote_of(b)
    assert remote["hits"] == 0
    assert set(remote["misses_by_reason"]) == {"damaged"}
    assert remote["downloaded_blocks"] == BLOCKS  # once: a chain refused is not fetched again
    # No entry, no block, nothing quarantined; the staging files go (the deleter's work).
    wait_until(lambda: staging_files(b) == [], "the fetch's staging files are gone")
    assert entry_files(b.tier) == []
    assert not list((b.tier / "quarantine").iterdir())


def test_a_block_missing_mid_chain_leaves_the_blocks_before_it_fetched_when_worth_it(
    two_macs: tuple[Daemon, Daemon], seaweed_bucket: Bucket, s3_prefix: str, model: Any
) -> None:
    """Block 3 of 6 gone from the bucket (expired, say): B commits blocks 0-2, 48 tokens, at
    least remote_min_tokens (32) past its empty tier. Block 2 gone where B holds blocks 0-1:
    nothing before the hole is worth it, and the fetch is a miss ("missing")."""
    a, b = two_macs
    cut, early = EngineIdentity("tiny/hole", "cfg", "tok"), EngineIdentity("tiny/hole2", "c", "t")
    prompts = {cut: prompt(TOKENS, seed=6), early: prompt(TOKENS, seed=7)}
    for (identity, tokens), hole in zip(prompts.items(), (3, 2), strict=True):
        put_on(a, identity, tokens, model)
        uploaded(seaweed_bucket, s3_prefix, identity, BLOCKS)
        hashes = block_hashes(pack_tokens(tokens[: BLOCKS * BLOCK]), BLOCK)
        digest = identity.to_protocol().digest()
        seaweed_bucket.delete(keys.block_key(s3_prefix, digest, hashes[hole]))
    put_on(b, early, prompts[early][: 2 * BLOCK], model)
    # The early prompt first, while no other fetch is under way: its get starts one fetch,
    # and that fetch alone is counted (a later lookup of the cut prompt past its three local
    # blocks may start a fetch of its own, which finds the same hole).
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        assert client.flush(SETTLE_SECONDS)
        restored = client.get(early, [*prompts[early], 7], model=model)
        assert restored is not None
        assert restored.matched == 2 * BLOCK  # what B held; the fetch, if it ended, added none
    wait_until(lambda: remote_of(b)["misses_by_reason"], "the early prompt's fetch's end")
    remote = remote_of(b)
    assert remote["hits"] == 0
    assert remote["misses_by_reason"] == {"missing": 1}
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        before = set(block_files(b.tier))
        restored = fetched_get(client, b, cut, [*prompts[cut], 7], model)
        assert restored is not None
        assert restored.matched == 3 * BLOCK
        assert client.flush(SETTLE_SECONDS)  # B's blocks in place
    assert "remote_fetch_cut" in b.logs()  # the probe found block 6: the fetch found the hole
    theirs = block_files(a.tier)
    fetched = {name: data for name, data in block_files(b.tier).items() if name not in before}
    assert len(fetched) == 3
    assert all(theirs[name] == data for name, data in fetched.items())  # A's, byte for byte
    assert remote_of(b)["hits"] == 1
    wait_until(lambda: staging_files(b) == [], "the fetches' staging files are gone")
    assert len(block_files(b.tier)) == len(before) + 3


def test_a_prefix_shorter_than_remote_min_tokens_past_what_is_local_is_not_fetched(
    two_macs: tuple[Daemon, Daemon], seaweed_bucket: Bucket, s3_prefix: str, model: Any
) -> None:
    a, b = two_macs
    identity = EngineIdentity("tiny/short", "cfg", "tok")
    tokens = prompt(TOKENS, seed=4)
    put_on(a, identity, tokens, model)
    uploaded(seaweed_bucket, s3_prefix, identity, BLOCKS)
    local = 5 * BLOCK  # B holds the first five blocks itself
    put_on(b, identity, tokens[:local], model)
    with Client.connect(b.socket_path, require=True, block_tokens=BLOCK) as client:
        # The prompt runs 17 tokens past B's match: not worth asking the bucket.
        restored = client.get(identity, [*tokens[: BLOCKS * BLOCK], 7], model=model)
        assert restored is not None
        assert restored.matched == local
        # This one runs 49 past, but the bucket holds only one block (16 tokens) more.
        longer = [*tokens[: BLOCKS * BLOCK], *prompt(2 * BLOCK, seed=5), 7]
        restored = client.get(identity, longer, model=model)
        assert restored is not None
        assert restored.matched == local
        assert client.stats.remote_fetches == 0
    remote = remote_of(b)
    assert remote["downloaded_blocks"] == 0
    assert remote["misses_by_reason"] == {"short": 1}


def test_a_client_without_the_fetch_field_is_answered_at_once_and_the_fetch_goes_on(
    two_macs: tuple[Daemon, Daemon], seaweed_bucket: Bucket, s3_prefix: str, model: Any
) -> None:
    a, b = two_macs
    identity = EngineIdentity("tiny/old-client", "cfg", "tok").to_protocol()
    tokens = prompt(TOKENS, seed=6)
    put_on(a, EngineIdentity("tiny/old-client", "cfg", "tok"), tokens, model)
    uploaded(seaweed_bucket, s3_prefix, EngineIdentity("tiny/old-client", "cfg", "tok"), BLOCKS)
    asked = pack_tokens([*tokens, 7])
    with RawPeer(b.socket_path) as old:
        started = time.perf_counter()
        reply = old.call(m.Lookup(id=old.next_id(), identity=identity, tokens=asked))
        assert time.perf_counter() - started < 0.1  # an engine's lookup deadline
        assert isinstance(reply, m.LookupReply)
        assert reply.entry is None
        assert reply.fetching is None

        def hit() -> m.LookupReply | None:
            found = old.call(m.Lookup(id=old.next_id(), identity=identity, tokens=asked))
            assert isinstance(found, m.LookupReply)
            if found.entry is None:
                return None
            assert found.fd is not None
            os.close(found.fd)
            return found

        found = wait_until(hit, "the fetch the first lookup started is local")
        assert found is not None
        assert found.matched == BLOCKS * BLOCK
        assert found.lease is not None
        assert isinstance(old.call(m.Release(id=old.next_id(), lease=found.lease)), m.ReleaseReply)
    assert remote_of(b)["hits"] == 1


def test_another_prefix_is_another_tenant(
    tmp_path: Path, seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, model: Any
) -> None:
    """A daemon pointed at another prefix of the same bucket (another tenant) never finds
    what A uploaded: its get is a miss, it asks the bucket for nothing under A's prefix, and
    its tier stays empty."""
    flags = remote_flags(
        seaweed, tmp_path, s3_prefix, min_tokens=MIN_TOKENS, fetch_timeout=FETCH_TIMEOUT
    )
    other_flags = remote_flags(
        seaweed, tmp_path, f"{s3_prefix}-other", min_tokens=MIN_TOKENS, fetch_timeout=2
    )
    identity = EngineIdentity("tiny/tenant", "cfg", "tok")
    tokens = prompt(TOKENS, seed=7)
    with running_daemon(tmp_path / "a", flags) as a:
        put_on(a, identity, tokens, model)
        uploaded(seaweed_bucket, s3_prefix, identity, BLOCKS)
    with (
        running_daemon(tmp_path / "c", other_flags) as c,
        Client.connect(c.socket_path, require=True, block_tokens=BLOCK) as client,
    ):
        assert client.get(identity, [*tokens, 7], model=model) is None
        now = remote_of(c)
        assert (now["hits"], now["downloaded_blocks"]) == (0, 0)
    assert stored(seaweed_bucket, f"{s3_prefix}-other") == {}
    assert entry_files(tmp_path / "c") == []
