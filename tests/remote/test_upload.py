"""The write path end to end: real daemons, a real SeaweedFS. A stored entry's blocks and its
identity's layout reach the bucket byte for byte; blocks the bucket holds are not sent again;
checkpoints, hybrids and `never` send nothing; `second-hit` waits for a lookup's hit."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, look_up, put_v2, read_manifest
from daemon_e2e import IDENTITY, RawPeer
from daemon_process import Daemon, kvctl, running_daemon
from kvd_protocol.entry import PREFILL_CHECKPOINT_META, Checkpoint, LayerSpec, TensorSpec
from kvd_protocol.entry import plan_manifest as plan
from kvd_protocol.tokens import pack_tokens
from remote_e2e import flush_remote, put_plan, remote_flags, remote_status, stored
from seaweed import BUCKET, SECRET_KEY, Seaweed

from kvd.remote import keys
from kvd.remote.bucket import Bucket
from kvd.remote.layout import encode_layout, layout_of
from kvd.store.tier_dir import TierDir

SHARED = list(range(1000, 1000 + 4 * BLOCK_TOKENS))  # four whole blocks the entries share
DIGEST = IDENTITY.digest()


def conversation(n: int, own_blocks: int = 1) -> list[int]:
    """The shared s3_prefix, own_blocks blocks of this conversation's own, and a tail of 5."""
    return SHARED + [n * 100 + i for i in range(own_blocks * BLOCK_TOKENS + 5)]


def test_an_entry_reaches_the_bucket_byte_for_byte_and_a_second_sends_only_its_new_blocks(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    with (
        running_daemon(tmp_path, remote_flags(seaweed, tmp_path, s3_prefix)) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        first = put_v2(peer, IDENTITY, conversation(1))
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == "durable and uploaded"
        tier = TierDir(daemon.tier)
        size = first.manifest.block_size
        for block in first.manifest.hashes:
            key = keys.block_key(s3_prefix, DIGEST, block)
            assert seaweed_bucket.get(key, size) == tier.block_path(DIGEST, block).read_bytes()
        (manifest,) = tier.entries.glob(f"{DIGEST}/*.kve")
        expected = encode_layout(layout_of(read_manifest(manifest)))
        assert seaweed_bucket.get(keys.layout_key(s3_prefix, DIGEST), 1 << 20) == expected
        now = remote_status(peer)
        assert (now["uploaded_blocks"], now["uploaded_bytes"]) == (5, 5 * size)
        assert (now["pending_uploads"], now["pending_bytes"]) == (0, 0)
        assert (now["already_there_blocks"], now["upload_drops"]) == (0, 0)
        assert now["state"] == "ok"

        put_v2(peer, IDENTITY, conversation(2))
        assert flush_remote(daemon).returncode == 0
        now = remote_status(peer)
        assert now["uploaded_blocks"] == 6, "only the second conversation's own block went"
        assert now["already_there_blocks"] == 0, "the shared blocks were not even asked about"
        objects = stored(seaweed_bucket, s3_prefix)
        assert len(objects) == 6 + 1  # six blocks and the layout


def test_a_block_the_bucket_holds_is_not_sent_again(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """A second daemon (its own tier: another Mac) stores the same conversation: every
    conditional create finds the block there (412), counted, nothing rewritten."""
    flags = remote_flags(seaweed, tmp_path, s3_prefix)
    with running_daemon(tmp_path / "a", flags) as a, RawPeer(a.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(1))
        assert flush_remote(a).returncode == 0
    before = stored(seaweed_bucket, s3_prefix)
    with running_daemon(tmp_path / "b", flags) as b, RawPeer(b.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(1))
        done = flush_remote(b)
        assert done.returncode == 0, done.stdout + done.stderr
        now = remote_status(peer)
        assert now["uploaded_blocks"] == 0
        assert now["already_there_blocks"] == 5
        assert now["upload_drops"] == 0
    assert stored(seaweed_bucket, s3_prefix) == before


def test_checkpoints_and_hybrids_upload_nothing(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    def kv(count: int) -> LayerSpec:
        spec = TensorSpec("float16", (1, 2, count, 8))
        return LayerSpec("kv", (spec, spec), trimmable=True, meta={"offset": count}, blocked=True)

    def tokens(count: int) -> bytes:
        return pack_tokens(range(5000, 5000 + count))

    ssm = LayerSpec("ssm", (TensorSpec("float32", (1, 3, 5)),), trimmable=False)
    planned = partial(plan, IDENTITY, block_tokens=BLOCK_TOKENS, created=time.time(), min_reuse=0)
    n = 3 * BLOCK_TOKENS + 5
    checkpoint = Checkpoint("g", 1, 2, False, 3, 1)
    entries = [
        planned(tokens(n), [kv(n), ssm]),  # a hybrid: its state is not in blocks
        planned(tokens(n + 1), [kv(n + 1)], meta={PREFILL_CHECKPOINT_META: True}),
        planned(tokens(n + 2), [kv(n + 2)], checkpoint=checkpoint),
    ]
    with (
        running_daemon(tmp_path, remote_flags(seaweed, tmp_path, s3_prefix)) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        for seed, entry in enumerate(entries):
            put_plan(peer, entry, seed)
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
        now = remote_status(peer)
        assert now["not_shareable"] == 3
        assert (now["uploaded_blocks"], now["pending_uploads"]) == (0, 0)
    assert stored(seaweed_bucket, s3_prefix) == {}


def test_never_uploads_nothing(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    flags = remote_flags(seaweed, tmp_path, s3_prefix, upload="never")
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(1))
        assert look_up(peer, IDENTITY, conversation(1)) is not None
        assert flush_remote(daemon).returncode == 0
        now = remote_status(peer)
        assert (now["upload_policy"], now["uploaded_blocks"], now["not_shareable"]) == (
            "never",
            0,
            0,
        )
    assert stored(seaweed_bucket, s3_prefix) == {}


def test_second_hit_uploads_once_a_lookup_hits_the_entry(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    flags = remote_flags(seaweed, tmp_path, s3_prefix, upload="second-hit")
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(1))
        assert flush_remote(daemon).returncode == 0
        assert stored(seaweed_bucket, s3_prefix) == {}, "stored once: not yet"
        assert look_up(peer, IDENTITY, conversation(1)) is not None
        assert look_up(peer, IDENTITY, conversation(1)) is not None  # queued once, not twice
        assert flush_remote(daemon).returncode == 0
        now = remote_status(peer)
        assert now["uploaded_blocks"] == 5
        assert now["upload_drops"] == 0
    assert len(stored(seaweed_bucket, s3_prefix)) == 5 + 1


def test_kvctl_shows_the_remote_tier_and_never_its_secret(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    with (
        running_daemon(tmp_path, remote_flags(seaweed, tmp_path, s3_prefix)) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        put_v2(peer, IDENTITY, conversation(1))
        assert flush_remote(daemon).returncode == 0
        table = kvctl(daemon, "status").stdout
        rows = {line.split()[0]: line for line in table.splitlines() if line.strip()}
        assert rows["remote"].split(None, 1)[1] == (
            f"ok; s3://{BUCKET}/{s3_prefix} at {seaweed.endpoint}"
        )
        assert "5 blocks (400.0 KiB) sent, 0 there already; 0 dropped" in rows["uploads"]
        assert rows["downloads"].split(None, 1)[1].startswith("0 blocks (0 B); 0 hits, 0 misses")
        section = json.loads(kvctl(daemon, "status", "--json").stdout)["remote"]
        assert section["state"] == "ok"
        assert section["last_error"] is None
        assert (section["url"], section["endpoint"]) == (
            f"s3://{BUCKET}/{s3_prefix}",
            seaweed.endpoint,
        )
        assert (section["uploaded_blocks"], section["pending_uploads"]) == (5, 0)
        metrics = kvctl(daemon, "metrics").stdout
        assert 'kvd_remote_state{state="ok"} 1.0' in metrics
        assert 'kvd_remote_state{state="down"} 0.0' in metrics
        assert "kvd_remote_uploaded_blocks_total 5.0" in metrics
        assert "kvd_remote_pending_bytes 0.0" in metrics
        logs = daemon.logs()
    for text in (table, json.dumps(section), metrics, logs):
        assert SECRET_KEY not in text


def test_a_daemon_without_a_remote_tier_says_so(daemon: Daemon) -> None:
    assert json.loads(kvctl(daemon, "status", "--json").stdout)["remote"] is None
    assert "remote" not in kvctl(daemon, "status").stdout.split()
    refused = kvctl(daemon, "flush", "--remote")
    assert refused.returncode == 1
    assert "no remote tier" in refused.stderr


def test_entries_unlike_the_stored_layout_upload_nothing_and_say_so_once(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """Daemon A's entries fix the identity's layout; daemon B's engine writes the same
    identity's KV with other shapes: B keeps its blocks local, warns once, counts each."""
    flags = remote_flags(seaweed, tmp_path, s3_prefix)
    with running_daemon(tmp_path / "a", flags) as a, RawPeer(a.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(1))
        assert flush_remote(a).returncode == 0
    before = stored(seaweed_bucket, s3_prefix)
    with running_daemon(tmp_path / "b", flags) as b, RawPeer(b.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(2), width=16)
        put_v2(peer, IDENTITY, conversation(3), width=16)
        assert flush_remote(b).returncode == 0
        now = remote_status(peer)
        assert (now["layout_mismatch"], now["uploaded_blocks"]) == (2, 0)
        warned = [line for line in b.logs().splitlines() if "remote_layout_mismatch" in line]
        assert len(warned) == 1
        assert '"level": "warning"' in warned[0]
    assert stored(seaweed_bucket, s3_prefix) == before
