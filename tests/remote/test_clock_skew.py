"""A refusal for the clock is said as one: "clock is off by N s", not "credentials refused", in
the client's error, the health's last_error and the log, whether the bucket says
RequestTimeTooSkewed or only answers 403 with a Date far from this machine's."""

from __future__ import annotations

import re
import socket
import time
from email.utils import formatdate
from pathlib import Path

import pytest
from daemon_e2e import RawPeer
from daemon_process import running_daemon
from fake_bucket import (
    FakeBucket,
    Request,
    error_xml,
    every_request,
    running_bucket,
    send,
    skewed,
    status,
)
from remote_e2e import logged, wait_remote

from kvd.remote.bucket import Bucket, BucketAuthError, BucketClockSkewed


def refused_with_date(fake_bucket: FakeBucket, code: str) -> None:
    """Every request answered 403 code, the Date from the bucket's clock."""

    def answer(connection: socket.socket, request: Request) -> None:
        date = formatdate(time.time() + fake_bucket.date_offset, usegmt=True)
        send(connection, 403, error_xml(code), date=date, head=request)

    fake_bucket.on(every_request, answer)


def off_by(message: str) -> int:
    found = re.search(r"clock is off by (\d+) s", message)
    assert found, message
    return int(found.group(1))


def test_request_time_too_skewed_says_by_how_much(
    fake_bucket: FakeBucket, bucket_client: Bucket
) -> None:
    fake_bucket.date_offset = -3600.0  # the bucket an hour behind: this machine an hour ahead
    fake_bucket.on(every_request, skewed(fake_bucket))
    with pytest.raises(BucketClockSkewed) as raised:
        bucket_client.head("k")
    message = str(raised.value)
    assert abs(off_by(message) - 3600) <= 2
    assert "(ahead)" in message
    assert "credentials refused" not in message
    assert raised.value.offset is not None
    assert abs(raised.value.offset + 3600) <= 2


def test_a_plain_refusal_with_a_far_date_is_put_to_the_clock(
    fake_bucket: FakeBucket, bucket_client: Bucket
) -> None:
    fake_bucket.date_offset = 1200.0
    refused_with_date(fake_bucket, "AccessDenied")
    with pytest.raises(BucketClockSkewed) as raised:
        bucket_client.list("p/", 1)
    assert abs(off_by(str(raised.value)) - 1200) <= 2
    assert "(behind)" in str(raised.value)


def test_a_refusal_with_a_near_date_is_the_credentials(
    fake_bucket: FakeBucket, bucket_client: Bucket
) -> None:
    fake_bucket.date_offset = 30.0  # off, but within what a bucket takes
    refused_with_date(fake_bucket, "SignatureDoesNotMatch")
    with pytest.raises(BucketAuthError) as raised:
        bucket_client.get("k", 10)
    assert not isinstance(raised.value, BucketClockSkewed)
    assert str(raised.value) == "GET k: HTTP 403 SignatureDoesNotMatch: credentials refused"
    fake_bucket.clear()
    fake_bucket.on(every_request, status(403, "RequestTimeTooSkewed"))  # the bucket's word alone
    with pytest.raises(BucketClockSkewed, match="this machine's clock is off from the bucket's"):
        bucket_client.get("k", 10)


def test_the_daemon_says_its_clock_is_off_not_its_credentials(tmp_path: Path) -> None:
    with running_bucket(date_offset=-3600.0) as fake_bucket:
        fake_bucket.on(every_request, skewed(fake_bucket))
        credentials = tmp_path / "credentials"
        credentials.write_text("[default]\naws_access_key_id = K\naws_secret_access_key = s\n")
        credentials.chmod(0o600)
        flags = [
            "--remote",
            f"s3://{fake_bucket.bucket}/p",
            "--remote-endpoint",
            fake_bucket.endpoint,
        ]
        flags += ["--remote-credentials-file", str(credentials)]
        with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
            down = wait_remote(peer, lambda r: r["state"] == "down", "the clock refused")
            error = down["last_error"]
            assert abs(off_by(error) - 3600) <= 2
            assert "credentials refused" not in error
            [warning] = logged(daemon, "remote_down")
            assert warning["error"] == error
