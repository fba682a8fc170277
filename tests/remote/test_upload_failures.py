"""The write path when things go wrong, end to end: the upload queue over its cap, the bucket
paused, killed or refusing the credentials. Puts and lookups answer as before; uploads are
dropped and counted; the health says down with the last error, warned once; the bucket back,
the health is ok again within its backoff and uploads resume."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, look_up, manifest_plan, put_v2, status
from daemon_e2e import IDENTITY, RawPeer
from daemon_process import Daemon, running_daemon
from remote_e2e import (
    dropped_since,
    flush_remote,
    flush_said,
    remote_flags,
    remote_status,
    restart,
    stored,
    wait_remote,
)
from seaweed import SECRET_KEY, Seaweed

from kvd.remote import keys
from kvd.remote.bucket import Bucket

DIGEST = IDENTITY.digest()
LOOKUP_BOUND_S = 1.0  # a lookup with the bucket gone answers far within this (it never asks)
RATE_PERIOD_S = 10.0  # kvd.logs.RateLimited's: one line per event this often


def prompt(n: int, blocks: int) -> list[int]:
    """A prompt of its own (no block shared with another n), of whole blocks and a tail."""
    return [n * 10_000 + i for i in range(blocks * BLOCK_TOKENS + 3)]


BLOCK_SIZE = manifest_plan(IDENTITY, prompt(0, 1)).block_size


def logged(daemon: Daemon, name: str) -> list[dict[str, object]]:
    events = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == name]


def down_warnings(daemon: Daemon) -> list[dict[str, object]]:
    return logged(daemon, "remote_down")


def dropped_lines(daemon: Daemon) -> list[dict[str, object]]:
    return logged(daemon, "remote_upload_dropped")


def timed_lookup(peer: RawPeer, tokens: list[int]) -> float:
    began = time.monotonic()
    assert look_up(peer, IDENTITY, tokens) is not None
    return time.monotonic() - began


@contextmanager
def bucket_paused(seaweed: Seaweed) -> Iterator[None]:
    """The bucket stops answering (its processes stopped), then goes on."""
    assert seaweed.process is not None
    os.killpg(seaweed.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(seaweed.process.pid, signal.SIGCONT)


def test_over_its_cap_the_queue_drops_the_oldest_never_the_one_in_flight(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """At one block a second, the first entry's five blocks take seconds to go; three more
    come meanwhile into a queue of one block's bytes: the two older ones are dropped."""
    flags = remote_flags(
        seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE, upload_bytes=BLOCK_SIZE
    )
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        entries = [put_v2(peer, IDENTITY, prompt(1, 5))]
        entries += [put_v2(peer, IDENTITY, prompt(n, 2)) for n in (2, 3, 4)]
        now = remote_status(peer)
        assert (now["upload_drops"], now["upload_dropped_bytes"]) == (2, 4 * BLOCK_SIZE)
        said = flush_remote(daemon)
        assert said.returncode == 1, "not everything went"
        assert flush_said(said)[0].endswith(dropped_since(2)), said.stdout
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
        now = remote_status(peer)
        assert now["uploaded_blocks"] == 5 + 2
        assert now["upload_drops"] == 2
    objects = stored(seaweed_bucket, s3_prefix)
    for begun, kept in zip(entries, (True, False, False, True), strict=True):
        for block in begun.manifest.hashes:
            key = keys.block_key("", DIGEST, block)
            assert (key in objects) is kept, key


def test_flush_remote_says_what_is_left_when_the_bucket_stops_answering_or_is_killed(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    flags = remote_flags(seaweed, tmp_path, s3_prefix)
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        with bucket_paused(seaweed):
            put_v2(peer, IDENTITY, prompt(1, 2))
            left = flush_remote(daemon, wait_s=0.5)
            assert left.returncode == 1
            assert flush_said(left) == [
                f"not done: 0 puts not durable, 1 uploads ({2 * BLOCK_SIZE / 1024:.1f} KiB) "
                f"still pending, {dropped_since(0)}"
            ], left.stdout
        resumed = flush_remote(daemon)  # the bucket goes on: the upload waiting for it ends
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        seaweed.kill()
        try:
            put_v2(peer, IDENTITY, prompt(2, 2))
            began = time.monotonic()
            killed = flush_remote(daemon, wait_s=20)
            assert time.monotonic() - began < 10, "a refused connection fails fast"
            assert killed.returncode == 1
            assert flush_said(killed)[0].endswith(
                f"0 uploads (0 B) still pending, {dropped_since(1)}"
            ), killed.stdout
        finally:
            restart(seaweed)


def test_the_bucket_killed_puts_and_lookups_go_on_uploads_drop_and_resume_when_it_is_back(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    flags = remote_flags(seaweed, tmp_path, s3_prefix)
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        put_v2(peer, IDENTITY, prompt(1, 2))
        assert flush_remote(daemon).returncode == 0
        seaweed.kill()
        try:
            for n in range(2, 7):
                put_v2(peer, IDENTITY, prompt(n, 2))
                assert timed_lookup(peer, prompt(n, 2)) < LOOKUP_BOUND_S
            down = wait_remote(peer, lambda r: r["state"] == "down", "the bucket down")
            assert down["last_error"]
            assert down["upload_drops"] >= 1
            assert status(peer)["entries"] == 6, "every put stored locally"
            flush_remote(daemon, wait_s=10)
            assert len(down_warnings(daemon)) == 1, "said once"
        finally:
            restart(seaweed)
        back = wait_remote(peer, lambda r: r["state"] == "ok", "the bucket back: ok again")
        before = back["uploaded_blocks"]
        put_v2(peer, IDENTITY, prompt(7, 2))
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
        assert remote_status(peer)["uploaded_blocks"] == before + 2, "uploads resumed"
        assert len(down_warnings(daemon)) == 1


def test_wrong_credentials_run_local_only_and_say_so_once_without_the_secret(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    wrong = "not-the-secret-0f3c9"
    flags = remote_flags(seaweed, tmp_path, s3_prefix, secret=wrong)
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        down = wait_remote(peer, lambda r: r["state"] == "down", "credentials refused")
        assert "403" in down["last_error"]
        for n in range(1, 4):
            put_v2(peer, IDENTITY, prompt(n, 2))
            assert timed_lookup(peer, prompt(n, 2)) < LOOKUP_BOUND_S
        now = remote_status(peer)
        assert now["state"] == "down"
        assert (now["upload_drops"], now["uploaded_blocks"]) == (3, 0)
        report = json.dumps(status(peer))
        warnings = down_warnings(daemon)
        assert len(warnings) == 1
        assert warnings[0]["level"] == "warning"
        assert "403" in str(warnings[0]["error"])
        logs = daemon.logs()
    for text in (report, logs):
        assert wrong not in text
        assert SECRET_KEY not in text
    assert stored(seaweed_bucket, s3_prefix) == {}


def test_flush_remote_is_not_done_while_the_bucket_is_down_even_with_nothing_to_send(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """Nothing queued, nothing dropped: with the bucket down (credentials refused), `flush
    --remote` still says what it could not do, and exits 1."""
    flags = remote_flags(seaweed, tmp_path, s3_prefix, secret="not-the-secret-77d1")
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        wait_remote(peer, lambda r: r["state"] == "down", "credentials refused")
        said = flush_remote(daemon, wait_s=5)
        assert said.returncode == 1, said.stdout + said.stderr
        first, down = flush_said(said)
        assert first == (
            f"not done: 0 puts not durable, 0 uploads (0 B) still pending, {dropped_since(0)}"
        )
        assert down.startswith("the remote bucket is down: ")
        assert "403" in down
        assert "durable and uploaded" not in said.stdout


def test_drops_a_slow_bucket_provokes_are_logged_once_a_period_with_the_count_left_out(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """One block a second into a queue of one block's bytes: every entry put meanwhile drops
    the one queued before it. Five drops in a moment are one line; the next drop, a period
    later, is a line that counts the four left out."""
    flags = remote_flags(
        seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE, upload_bytes=BLOCK_SIZE
    )
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        put_v2(peer, IDENTITY, prompt(1, 30))  # in flight for about 30 s
        for n in range(2, 8):
            put_v2(peer, IDENTITY, prompt(n, 2))
        assert remote_status(peer)["upload_drops"] == 5
        (first,) = dropped_lines(daemon)
        time.sleep(RATE_PERIOD_S + 0.5)
        put_v2(peer, IDENTITY, prompt(8, 2))  # drops the seventh
        now = remote_status(peer)
        assert (now["upload_drops"], now["pending_uploads"]) == (6, 2), "the first in flight still"
        lines = dropped_lines(daemon)
    assert len(lines) == 2
    assert "suppressed" not in first
    assert lines[1]["suppressed"] == 4
    assert lines[1]["why"] == "cap"
