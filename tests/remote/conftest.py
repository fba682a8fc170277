"""The remote tier's tests of the S3 client against the fake bucket share these two."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_bucket import FakeBucket, running_bucket

from kvd.remote.bucket import Bucket
from kvd.remote.credentials import Credentials


@pytest.fixture
def bucket() -> Iterator[FakeBucket]:
    """A fake bucket on loopback, honest until a test scripts it."""
    with running_bucket() as fake:
        yield fake


@pytest.fixture
def client(bucket: FakeBucket) -> Iterator[Bucket]:
    """The S3 client on the fake bucket, each call bounded by 2 s."""
    store = Bucket(bucket.endpoint, bucket.bucket, Credentials("AKID", "secret"), timeout=2.0)
    yield store
    store.close()
