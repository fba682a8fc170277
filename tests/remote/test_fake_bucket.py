"""The fake bucket the remote tier's hostile tests script: honest by default (the real client's
calls all answered as S3 would), hostile where a rule says, and closed whole."""

from __future__ import annotations

import time

import pytest
from fake_bucket import FakeBucket, hang, key_has, reset, status

from kvd.remote.bucket import Bucket, BucketUnavailable
from kvd.remote.credentials import Credentials


def test_honest_calls(fake_bucket: FakeBucket, bucket_client: Bucket) -> None:
    assert bucket_client.head("a/x") is None
    assert bucket_client.put_if_absent("a/x", b"hello")
    assert not bucket_client.put_if_absent("a/x", b"other")  # If-None-Match: * honoured
    assert bucket_client.head("a/x") == 5
    assert bucket_client.get("a/x", 100) == b"hello"
    for index in range(5):
        bucket_client.put_if_absent(f"a/y{index}", b"z" * index)
    assert bucket_client.list("a/", 3) == [("a/x", 5), ("a/y0", 0), ("a/y1", 1)]
    assert len(bucket_client.list("a/", 100)) == 6
    bucket_client.delete("a/x")
    assert bucket_client.get("a/x", 100) is None
    assert fake_bucket.asked("PUT", "a/x") == 2


def test_ignoring_if_none_match_overwrites(bucket_client: Bucket, fake_bucket: FakeBucket) -> None:
    fake_bucket.ignore_if_none_match = True
    assert bucket_client.put_if_absent("k", b"1")
    assert bucket_client.put_if_absent("k", b"2")
    assert fake_bucket.objects["k"] == b"2"


def test_rules_fire_newest_first_and_expire(fake_bucket: FakeBucket, bucket_client: Bucket) -> None:
    fake_bucket.objects["k"] = b"v"
    fake_bucket.on(key_has("k"), status(503, "SlowDown"), times=1)
    with pytest.raises(BucketUnavailable, match="503 SlowDown"):
        bucket_client.get("k", 10)
    assert bucket_client.get("k", 10) == b"v"  # the rule fired its one time


def test_close_ends_hung_answers(fake_bucket: FakeBucket, bucket_client: Bucket) -> None:
    fake_bucket.on(key_has("k"), hang(fake_bucket))
    began = time.monotonic()
    with pytest.raises(BucketUnavailable, match="not done within"):
        bucket_client.get("k", 10)
    assert time.monotonic() - began < 5
    fake_bucket.close()
    assert fake_bucket.closed.is_set()


def test_reset_resets_the_connection(fake_bucket: FakeBucket) -> None:
    """A reset, not a silence: the client learns of it long before its deadline."""
    patient = Bucket(
        fake_bucket.endpoint, fake_bucket.bucket, Credentials("AKID", "secret"), timeout=60
    )
    fake_bucket.on(key_has("k"), reset, times=1)
    began = time.monotonic()
    with pytest.raises(BucketUnavailable, match=r"reset"):
        patient.get("k", 10)
    assert time.monotonic() - began < 30
    patient.close()
