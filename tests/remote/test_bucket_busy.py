"""A bucket that asks to slow down (503 SlowDown, 429 with Retry-After) is busy, not down: the
health says degraded, never down; uploads and fetches wait and go on once the storm ends;
lookups answer in their usual time meanwhile; the asks are logged at a bounded rate."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from blocks_e2e import BLOCK_TOKENS, look_up, put_v2
from daemon_e2e import IDENTITY, RawPeer, wait_until
from daemon_process import Daemon, running_daemon
from fake_bucket import Answer, FakeBucket, every_request, running_bucket, status
from remote_e2e import flush_remote, logged, remote_status

from kvd.remote.bucket import Bucket, BucketBusy, BucketUnavailable
from kvd.remote.credentials import Credentials

STORM_S = 4.0
LOOKUP_BOUND_S = 1.0  # a lookup answers far within this whatever the bucket says


def prompt(n: int, blocks: int = 2) -> list[int]:
    return [n * 10_000 + i for i in range(blocks * BLOCK_TOKENS + 3)]


@contextmanager
def daemon_on(folder: Path, bucket: FakeBucket, *flags: str) -> Iterator[Daemon]:
    credentials = folder / "credentials"
    folder.mkdir(parents=True, exist_ok=True)
    credentials.write_text("[default]\naws_access_key_id = K\naws_secret_access_key = s\n")
    credentials.chmod(0o600)
    remote = ["--remote", f"s3://{bucket.bucket}/p", "--remote-endpoint", bucket.endpoint]
    remote += ["--remote-credentials-file", str(credentials)]
    with running_daemon(folder, [*remote, *flags]) as daemon:
        yield daemon


class States:
    """The remote states the status said, polled in a thread of its own while a storm lasts."""

    def __init__(self, daemon: Daemon) -> None:
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(daemon,), daemon=True)
        self._thread.start()

    def _poll(self, daemon: Daemon) -> None:
        with RawPeer(daemon.socket_path) as peer:
            while not self._stop.wait(0.05):
                self.seen.add(remote_status(peer)["state"])

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join()
        return self.seen


def test_a_slow_down_storm_slows_uploads_and_never_takes_the_bucket_down(tmp_path: Path) -> None:
    with (
        running_bucket() as bucket,
        daemon_on(tmp_path, bucket) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        wait_until(lambda: bucket.asked("GET") >= 1, "the first probe")
        bucket.on(every_request, status(503, "SlowDown"))
        before = sum(bucket.requests.values())
        states = States(daemon)
        put_v2(peer, IDENTITY, prompt(1))
        storm_began = time.monotonic()
        for n in range(2, 5):  # lookups, a remote one among them, answer in their usual time
            began = time.monotonic()
            look_up(peer, IDENTITY, prompt(n, blocks=20))
            assert time.monotonic() - began < LOOKUP_BOUND_S
        time.sleep(max(0.0, STORM_S - (time.monotonic() - storm_began)))
        asked = sum(bucket.requests.values()) - before
        bucket.clear()
        done = flush_remote(daemon, wait_s=60)
        seen = states.stop()
        assert done.returncode == 0, done.stdout + done.stderr
        now = remote_status(peer)
        assert (now["uploaded_blocks"], now["upload_drops"]) == (2, 0)
        assert "down" not in seen
        assert "degraded" in seen
        assert now["state"] == "degraded", "the storm was within 30 s"
        assert "503 SlowDown: the bucket asks for fewer requests" in now["last_error"]
        # Backing off 0.5 s doubling (and jittered), a few rounds of at most a few requests;
        # asked again at once, it would have been hundreds.
        assert asked < 40, asked
        said = logged(daemon, "remote_slow_down")
        assert 1 <= len(said) <= 2, "at most one line per 10 s"
        assert logged(daemon, "remote_down") == []


def test_429_with_retry_after_is_honoured(tmp_path: Path) -> None:
    with (
        running_bucket() as bucket,
        daemon_on(tmp_path, bucket) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        wait_until(lambda: bucket.asked("GET") >= 1, "the first probe")
        bucket.on(every_request, status(429, "", headers={"Retry-After": "2"}))
        put_v2(peer, IDENTITY, prompt(1))
        wait_until(lambda: bucket.asked("PUT") >= 1, "the upload's first request (its layout)")
        began, before = time.monotonic(), sum(bucket.requests.values())
        time.sleep(5.0)
        asked = sum(bucket.requests.values()) - before
        seconds = time.monotonic() - began
        bucket.clear()
        assert flush_remote(daemon, wait_s=60).returncode == 0
        now = remote_status(peer)
        assert (now["state"], now["uploaded_blocks"]) == ("degraded", 2)
        # Asked again every 2 s, at most two requests a round (the layout, then two blocks).
        assert 2 <= asked <= 2 * (seconds / 2 + 1), (asked, seconds)
        [said] = logged(daemon, "remote_slow_down")
        assert said["pause_s"] == 2.0


def test_a_fetch_waits_out_a_short_storm_and_completes(tmp_path: Path) -> None:
    tokens = prompt(1, blocks=4)
    with running_bucket() as bucket:
        with daemon_on(tmp_path / "a", bucket) as a, RawPeer(a.socket_path) as peer:
            put_v2(peer, IDENTITY, tokens)
            assert flush_remote(a).returncode == 0
        gets = bucket.asked("GET")
        flags = ("--remote-min-tokens", str(BLOCK_TOKENS), "--remote-fetch-timeout", "30")
        with daemon_on(tmp_path / "b", bucket, *flags) as b, RawPeer(b.socket_path) as peer:
            wait_until(lambda: bucket.asked("GET") > gets, "b's first probe")
            bucket.on(every_request, status(503, "SlowDown"), times=4)
            began = time.monotonic()
            assert look_up(peer, IDENTITY, tokens) is None  # answered now; the fetch goes on
            assert time.monotonic() - began < LOOKUP_BOUND_S
            fetched = wait_until(
                lambda: remote_status(peer)["hits"] == 1 and remote_status(peer),
                "the fetch committed after the storm",
            )
            assert fetched["misses"] == 0
            assert fetched["downloaded_blocks"] == 4
            assert fetched["state"] == "degraded"
            assert look_up(peer, IDENTITY, tokens) is not None


@pytest.mark.parametrize(
    ("call", "answer", "busy"),
    [
        ("get", status(503, "SlowDown"), True),
        ("get", status(503, "", headers={"Retry-After": "0"}), True),
        ("get", status(429, "TooManyRequests"), True),
        ("head", status(503), True),  # a HEAD's answer has no body to say SlowDown in
        ("get", status(503, "ServiceUnavailable"), False),
        ("get", status(503), False),  # a proxy's or a load balancer's 503: the bucket failing
        ("get", status(500, "InternalError"), False),
    ],
)
def test_which_answers_ask_to_slow_down(call: str, answer: Answer, busy: bool) -> None:
    with running_bucket() as bucket:
        bucket.on(every_request, answer)
        client = Bucket(bucket.endpoint, bucket.bucket, Credentials("K", "s"), timeout=2.0)
        with pytest.raises(BucketUnavailable) as raised:
            client.head("k") if call == "head" else client.get("k", 10)
        client.close()
    assert isinstance(raised.value, BucketBusy) is busy, raised.value
