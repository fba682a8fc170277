"""The fake bucket the remote tier's hostile tests script: honest by default (the real client's
calls all answered as S3 would), hostile where a rule says, and closed whole."""

from __future__ import annotations

import time

import pytest
from fake_bucket import FakeBucket, hang, key_has, reset, status

from kvd.remote.bucket import Bucket, BucketUnavailable
from kvd.remote.credentials import Credentials


def test_honest_calls(bucket: FakeBucket, client: Bucket) -> None:
    assert client.head("a/x") is None
    assert client.put_if_absent("a/x", b"hello")
    assert not client.put_if_absent("a/x", b"other")  # If-None-Match: * honoured
    assert client.head("a/x") == 5
    assert client.get("a/x", 100) == b"hello"
    for index in range(5):
        client.put_if_absent(f"a/y{index}", b"z" * index)
    assert client.list("a/", 3) == [("a/x", 5), ("a/y0", 0), ("a/y1", 1)]
    assert len(client.list("a/", 100)) == 6
    client.delete("a/x")
    assert client.get("a/x", 100) is None
    assert bucket.asked("PUT", "a/x") == 2


def test_ignoring_if_none_match_overwrites(client: Bucket, bucket: FakeBucket) -> None:
    bucket.ignore_if_none_match = True
    assert client.put_if_absent("k", b"1")
    assert client.put_if_absent("k", b"2")
    assert bucket.objects["k"] == b"2"


def test_rules_fire_newest_first_and_expire(bucket: FakeBucket, client: Bucket) -> None:
    bucket.objects["k"] = b"v"
    bucket.on(key_has("k"), status(503, "SlowDown"), times=1)
    with pytest.raises(BucketUnavailable, match="503 SlowDown"):
        client.get("k", 10)
    assert client.get("k", 10) == b"v"  # the rule fired its one time


def test_close_ends_hung_answers(bucket: FakeBucket, client: Bucket) -> None:
    bucket.on(key_has("k"), hang(bucket))
    began = time.monotonic()
    with pytest.raises(BucketUnavailable, match="not done within"):
        client.get("k", 10)
    assert time.monotonic() - began < 5
    bucket.close()
    assert bucket.closed.is_set()


def test_reset_resets_the_connection(bucket: FakeBucket) -> None:
    """A reset, not a silence: the client learns of it long before its deadline."""
    patient = Bucket(bucket.endpoint, bucket.bucket, Credentials("AKID", "secret"), timeout=60)
    bucket.on(key_has("k"), reset, times=1)
    began = time.monotonic()
    with pytest.raises(BucketUnavailable, match=r"reset"):
        patient.get("k", 10)
    assert time.monotonic() - began < 30
    patient.close()
