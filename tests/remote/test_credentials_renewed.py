"""Credentials read again by a running daemon: a credentials file fixed or rotated, a session
about to expire, a key the bucket stopped taking, a credential_process that fails and is fixed.
No restart in any of them; no secret in the log or the status."""

from __future__ import annotations

import json
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, put_v2, status
from daemon_e2e import IDENTITY, RawPeer, wait_until
from daemon_process import Daemon, running_daemon
from fake_bucket import FakeBucket, Request, running_bucket, signed_by
from fake_bucket import status as answer_status
from remote_e2e import flush_remote, logged, remote_flags, remote_status, stored, wait_remote
from seaweed import SECRET_KEY, Seaweed

from kvd.remote.bucket import Bucket

RENEWED_S = 15.0  # a fixed file brings the remote up within this (a refusal's retry is 60 s)
PROCESS = """#!{python}
import json, sys, time
count_file, lifetime = sys.argv[1], float(sys.argv[2])
try:
    count = int(open(count_file).read()) + 1
except FileNotFoundError:
    count = 1
open(count_file, "w").write(str(count))
if lifetime < 0:
    sys.stderr.write("starting\\nthe session expired: run sso login\\n")
    sys.exit(3)
expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + lifetime))
print(json.dumps({{"Version": 1, "AccessKeyId": f"KEY{{count}}",
    "SecretAccessKey": f"process-secret-{{count}}", "SessionToken": f"token-{{count}}",
    "Expiration": expires}}))
"""


def prompt(n: int) -> list[int]:
    return [n * 10_000 + i for i in range(2 * BLOCK_TOKENS + 3)]


@contextmanager
def fake_remote_daemon(folder: Path, bucket: FakeBucket, *flags: str) -> Iterator[Daemon]:
    with running_daemon(
        folder,
        ["--remote", f"s3://{bucket.bucket}/p", "--remote-endpoint", bucket.endpoint, *flags],
    ) as daemon:
        yield daemon


def credential_process(folder: Path, lifetime: float) -> Path:
    """The daemon's ~/.aws/config naming a process (its path has a space: quoted) that says
    KEY<n> at its n-th run, valid for lifetime seconds (negative: it fails); the file counting
    its runs."""
    scripts = folder / "the helper"
    scripts.mkdir(parents=True, exist_ok=True)
    script = scripts / "issue-credentials"
    script.write_text(PROCESS.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    runs = folder / "runs"
    aws = folder / "daemon-home" / ".aws"
    aws.mkdir(parents=True, exist_ok=True)
    (aws / "config").write_text(
        f"[default]\ncredential_process = '{script}' {runs} {lifetime}\nregion = us-east-1\n"
    )
    return runs


def runs_of(runs: Path) -> int:
    return int(runs.read_text()) if runs.exists() else 0


class Refusals:
    """The bucket refusing an access key (403 InvalidAccessKeyId), counting what it refused."""

    def __init__(self, bucket: FakeBucket, access_key: str) -> None:
        self.count = 0
        self._lock = threading.Lock()
        bucket.on(signed_by(access_key), self._answer)

    def _answer(self, connection: socket.socket, request: Request) -> None:
        with self._lock:
            self.count += 1
        answer_status(403, "InvalidAccessKeyId")(connection, request)


def test_a_fixed_credentials_file_brings_the_remote_up_without_a_restart(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    wrong = "not-the-secret-77b1"
    flags = remote_flags(seaweed, tmp_path, s3_prefix, secret=wrong)
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        down = wait_remote(peer, lambda r: r["state"] == "down", "the wrong secret refused")
        assert "403" in down["last_error"]
        assert "credentials refused" in down["last_error"]
        remote_flags(seaweed, tmp_path, s3_prefix)  # the same file, the right secret
        fixed = time.monotonic()
        wait_until(lambda: remote_status(peer)["state"] == "ok", "the remote up again", RENEWED_S)
        assert time.monotonic() - fixed < RENEWED_S
        put_v2(peer, IDENTITY, prompt(1))
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
        assert remote_status(peer)["uploaded_blocks"] == 2
        logs = daemon.logs()
    assert len(stored(seaweed_bucket, s3_prefix)) == 3  # the layout and two blocks
    assert wrong not in logs
    assert SECRET_KEY not in logs


def test_a_key_rotated_in_the_file_is_used_at_the_next_request(tmp_path: Path) -> None:
    with running_bucket() as bucket:
        credentials = tmp_path / "credentials"
        credentials.write_text("[default]\naws_access_key_id = OLDKEY\naws_secret_access_key = a\n")
        credentials.chmod(0o600)
        flags = ["--remote-credentials-file", str(credentials)]
        with (
            fake_remote_daemon(tmp_path, bucket, *flags) as daemon,
            RawPeer(daemon.socket_path) as peer,
        ):
            put_v2(peer, IDENTITY, prompt(1))
            assert flush_remote(daemon).returncode == 0
            credentials.write_text(
                "[default]\naws_access_key_id = NEWKEY\naws_secret_access_key = b\n"
            )
            refused = Refusals(bucket, "OLDKEY")  # the old key revoked
            time.sleep(1.5)  # past the least time between two looks at the file
            put_v2(peer, IDENTITY, prompt(2))
            done = flush_remote(daemon)
            assert done.returncode == 0, done.stdout + done.stderr
            now = remote_status(peer)
            assert (now["state"], now["uploaded_blocks"]) == ("ok", 4)
            assert refused.count == 0, "the new key was read before any request"


def test_a_session_is_renewed_before_it_expires(tmp_path: Path) -> None:
    """Credentials of 8 s: run again past half their life, before the bucket would refuse
    them (here it refuses KEY1 from then on)."""
    runs = credential_process(tmp_path, lifetime=8)
    with running_bucket() as bucket, fake_remote_daemon(tmp_path, bucket) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            wait_until(lambda: runs_of(runs) == 1, "the process run for the first probe")
            first = time.monotonic()
            time.sleep(4.5)
            refused = Refusals(bucket, "KEY1")
            put_v2(peer, IDENTITY, prompt(1))
            done = flush_remote(daemon)
            assert done.returncode == 0, done.stdout + done.stderr
            assert remote_status(peer)["uploaded_blocks"] == 2
            assert refused.count == 0, "KEY1 was replaced before it expired"
            assert runs_of(runs) >= 2
            assert time.monotonic() - first < 60
            report = json.dumps(status(peer))
        logs = daemon.logs()
    for text in (report, logs):
        assert "process-secret-" not in text
        assert "token-1" not in text


def test_a_key_the_bucket_refuses_mid_life_is_read_again_at_once(tmp_path: Path) -> None:
    """The bucket stops taking KEY1 long before its Expiration: the refused request makes the
    daemon run the process again, and goes again with KEY2; the bucket is never down."""
    runs = credential_process(tmp_path, lifetime=3600)
    with running_bucket() as bucket, fake_remote_daemon(tmp_path, bucket) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            put_v2(peer, IDENTITY, prompt(1))
            assert flush_remote(daemon).returncode == 0
            assert runs_of(runs) == 1
            refused = Refusals(bucket, "KEY1")
            put_v2(peer, IDENTITY, prompt(2))
            done = flush_remote(daemon)
            assert done.returncode == 0, done.stdout + done.stderr
            now = remote_status(peer)
            assert (now["state"], now["uploaded_blocks"], now["upload_drops"]) == ("ok", 4, 0)
            # The entry's two blocks go at once: each request signed with KEY1 is refused,
            # and together they cost one run.
            assert 1 <= refused.count <= 2
            assert runs_of(runs) == 2
        assert logged(daemon, "remote_down") == []


def test_a_failing_process_is_said_in_last_error_and_fixing_it_brings_the_remote_up(
    tmp_path: Path,
) -> None:
    credential_process(tmp_path, lifetime=-1)
    with (
        running_bucket() as bucket,
        fake_remote_daemon(tmp_path, bucket) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        down = wait_remote(peer, lambda r: r["state"] == "down", "no credentials")
        error = down["last_error"]
        assert "credential_process issue-credentials" in error
        assert "exited with status 3: the session expired: run sso login" in error
        assert "starting" not in error, "only the last line of its stderr"
        [warning] = logged(daemon, "remote_down")
        assert warning["error"] == error
        credential_process(tmp_path, lifetime=3600)  # the helper fixed
        wait_until(lambda: remote_status(peer)["state"] == "ok", "the remote up again", RENEWED_S)
        put_v2(peer, IDENTITY, prompt(1))
        assert flush_remote(daemon).returncode == 0
        assert bucket.asked("PUT", "/b/") == 2
