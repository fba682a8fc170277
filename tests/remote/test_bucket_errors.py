"""How the client's failures are classed, each caused for real: a wrong key or secret, a bucket
that does not exist, a bucket killed, a port nothing listens on, a listener that never
answers, and a TLS endpoint the client does not trust. No message holds the secret."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from certificates import Certificates, make_certificates
from seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, Seaweed, free_ports, running_seaweed

from kvd.config import Config
from kvd.remote.bucket import (
    Bucket,
    BucketAuthError,
    BucketError,
    BucketRefused,
    BucketUnavailable,
)
from kvd.remote.credentials import Credentials


def calls(bucket: Bucket, key: str, fd: int) -> list[tuple[str, Callable[[], object]]]:
    """Every call of the client, ready to run (the file ones on `fd`, 100 bytes)."""
    return [
        ("head", lambda: bucket.head(key)),
        ("get", lambda: bucket.get(key, 100)),
        ("get_to_file", lambda: bucket.get_to_file(key, fd, 100)),
        ("put_if_absent", lambda: bucket.put_if_absent(key, b"v")),
        ("put_file_if_absent", lambda: bucket.put_file_if_absent(key, fd, 100)),
        ("delete", lambda: bucket.delete(key)),
        ("list", lambda: bucket.list(key, 10)),
    ]


def assert_every_call_raises(
    bucket: Bucket, error: type[BucketError], tmp_path: Path, skip: tuple[str, ...] = ()
) -> list[str]:
    body = tmp_path / "body"
    body.write_bytes(b"z" * 100)
    messages = []
    with body.open("r+b") as file:
        for name, call in calls(bucket, "t/errors/key", file.fileno()):
            if name in skip:
                continue
            with pytest.raises(error) as raised:
                call()
            assert type(raised.value) is error, name
            messages.append(str(raised.value))
            assert SECRET_KEY not in messages[-1]
    return messages


def test_a_wrong_secret_is_an_auth_error(seaweed: Seaweed, tmp_path: Path) -> None:
    bucket = seaweed.bucket(secret_key="not-" + SECRET_KEY)
    messages = assert_every_call_raises(bucket, BucketAuthError, tmp_path)
    assert "HTTP 403 SignatureDoesNotMatch" in messages[1]  # from the GET's error body
    assert "HTTP 403" in messages[0]  # a HEAD's answer has no body


def test_an_unknown_access_key_is_an_auth_error(seaweed: Seaweed, tmp_path: Path) -> None:
    credentials = Credentials("nosuchkey", SECRET_KEY)
    bucket = Bucket(seaweed.endpoint, BUCKET, credentials)
    messages = assert_every_call_raises(bucket, BucketAuthError, tmp_path)
    assert "InvalidAccessKeyId" in messages[1]


def test_a_missing_bucket_is_a_refusal(seaweed: Seaweed, tmp_path: Path) -> None:
    """Every call but HEAD says NoSuchBucket; a HEAD's 404 has no body to tell a missing
    bucket from a missing key, so it answers None (the layout's GET tells them apart)."""
    bucket = Bucket(seaweed.endpoint, "no-such-bucket", Credentials(ACCESS_KEY, SECRET_KEY))
    messages = assert_every_call_raises(bucket, BucketRefused, tmp_path, skip=("head",))
    assert all("NoSuchBucket" in message for message in messages)
    assert bucket.head("t/errors/key") is None


def test_a_killed_bucket_is_unavailable_and_recovers(
    seaweed: Seaweed, seaweed_bucket: Bucket, tmp_path: Path
) -> None:
    seaweed_bucket.put_if_absent("t/killed/k", b"kept")
    seaweed.kill()
    try:
        messages = assert_every_call_raises(seaweed_bucket, BucketUnavailable, tmp_path)
        assert "Connection refused" in messages[0]
    finally:
        seaweed.start()
    assert seaweed_bucket.get("t/killed/k", 4) == b"kept"


def test_a_port_nothing_listens_on_is_unavailable(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    bucket = Bucket(f"http://127.0.0.1:{port}", BUCKET, Credentials(ACCESS_KEY, SECRET_KEY))
    messages = assert_every_call_raises(bucket, BucketUnavailable, tmp_path)
    assert all("Connection refused" in message for message in messages)


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A server that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_bucket_that_never_answers_times_out(silent_listener: str, tmp_path: Path) -> None:
    bucket = Bucket(silent_listener, BUCKET, Credentials(ACCESS_KEY, SECRET_KEY), timeout=0.3)
    started = time.monotonic()
    messages = assert_every_call_raises(bucket, BucketUnavailable, tmp_path)
    elapsed = time.monotonic() - started
    assert all("not done within 0.3 s" in message for message in messages)
    assert elapsed < len(messages) * 0.3 + 2.0  # one timeout each: a timeout is not retried


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


@pytest.fixture(scope="module")
def tls_seaweed(
    tmp_path_factory: pytest.TempPathFactory, certificates: Certificates
) -> Iterator[Seaweed]:
    with running_seaweed(tmp_path_factory.mktemp("tls-seaweed"), tls=certificates) as server:
        yield server


def test_an_https_endpoint_works_with_its_ca_from_aws_ca_bundle(
    tls_seaweed: Seaweed, certificates: Certificates, tmp_path: Path
) -> None:
    config = Config(
        dir=tmp_path,
        socket=tmp_path / "kvd.sock",
        remote=f"s3://{BUCKET}/tenant",
        remote_endpoint=tls_seaweed.endpoint,
    )
    environ = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_CA_BUNDLE": str(certificates.ca),
    }
    bucket = Bucket.from_config(config, environ)
    body = tmp_path / "block"
    body.write_bytes(b"b" * (1 << 20))
    with body.open("rb") as file:  # unsigned payload over TLS, sent through the TLS socket
        assert bucket.put_file_if_absent("t/tls/block", file.fileno(), 1 << 20) is True
    assert bucket.put_if_absent("t/tls/layout", b"layout") is True
    assert bucket.get("t/tls/block", 1 << 20) == b"b" * (1 << 20)
    assert bucket.list("t/tls/", 10) == [("t/tls/block", 1 << 20), ("t/tls/layout", 6)]


def test_an_untrusted_certificate_is_unavailable(tls_seaweed: Seaweed, tmp_path: Path) -> None:
    """Without the CA the system's roots do not vouch for the bucket: the client refuses it
    (BucketUnavailable: TLS failed), as for any endpoint whose certificate does not verify."""
    bucket = Bucket(tls_seaweed.endpoint, BUCKET, Credentials(ACCESS_KEY, SECRET_KEY))
    messages = assert_every_call_raises(bucket, BucketUnavailable, tmp_path)
    assert all("TLS: " in message for message in messages)


def test_plain_http_to_a_tls_port_is_not_a_success(tls_seaweed: Seaweed, tmp_path: Path) -> None:
    endpoint = tls_seaweed.endpoint.replace("https://", "http://")
    bucket = Bucket(endpoint, BUCKET, Credentials(ACCESS_KEY, SECRET_KEY))
    with pytest.raises(BucketRefused, match="HTTP 400"):
        bucket.get("t/tls/block", 10)


def test_from_config_uses_the_configured_endpoint_bucket_and_timeout(
    seaweed: Seaweed, tmp_path: Path
) -> None:
    config = Config(dir=tmp_path, socket=tmp_path / "kvd.sock", remote=f"s3://{BUCKET}/p/q")
    config = replace(config, remote_endpoint=seaweed.endpoint, remote_request_timeout=2.5)
    environ = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    bucket = Bucket.from_config(config, environ)
    assert (bucket.endpoint, bucket.name, bucket.timeout) == (seaweed.endpoint, BUCKET, 2.5)
    assert bucket.head("t/config/absent") is None
    without = Bucket.from_config(config, {"HOME": str(tmp_path)})
    with pytest.raises(BucketAuthError, match="no credentials"):
        without.head("t/config/absent")  # read at the first request, as at every later one
