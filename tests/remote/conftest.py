"""Fixtures of the remote tier's tests: a real S3 store (SeaweedFS on loopback, seaweed.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from seaweed import Seaweed, running_seaweed, weed_binary

from kvd.remote.s3 import S3Store


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """One `weed mini` for a test module (it takes 1-3 s to start); tests that kill it
    start it again before they end."""
    assert weed_binary().exists(), f"{weed_binary()} is missing: install the dev extras"
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def store(seaweed: Seaweed) -> Iterator[S3Store]:
    """A client of the test bucket, closed after the test."""
    if seaweed.process is None:  # a test before killed it and failed before restarting it
        seaweed.start()
    client = seaweed.store(timeout=5.0)
    yield client
    client.close()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of the test's own, so tests sharing the store do not see each other's
    objects."""
    return f"t/{request.node.name}"
