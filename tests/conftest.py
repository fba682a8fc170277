"""Fixtures shared by every part's tests."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from pathlib import Path

import daemon_process
import pytest
from daemon_process import Daemon, running_daemon
from fake_bucket import FakeBucket, running_bucket
from seaweed import Seaweed, running_seaweed, weed_binary

from kvd.remote.bucket import Bucket
from kvd.remote.credentials import Credentials

# kvd-vllm-mlx's tests run where vllm-mlx is installed, the virtualenv of make
# test-vllm-mlx-VERSION (.ci/vllm-mlx); elsewhere they are not collected, and the header says so.
VLLM_MLX = importlib.util.find_spec("vllm_mlx") is not None
collect_ignore = [] if VLLM_MLX else ["kvd_vllm_mlx"]


def pytest_report_header() -> str:
    if VLLM_MLX:
        return ""
    return "tests/kvd_vllm_mlx: not collected, vllm-mlx is not installed (make test-vllm-mlx-*)"


@pytest.fixture(autouse=True)
def daemons_are_checked() -> Iterator[None]:
    """Every daemon a test starts must end cleanly and log no error the test did not
    declare (Daemon.expect_errors)."""
    daemon_process.started.clear()
    yield
    daemon_process.check_started()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A real kvd with default settings on a temporary tier and socket."""
    with running_daemon(tmp_path) as running:
        yield running


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB file system of its own (tmpfs), for a disk that really fills up."""
    yield from _tmpfs(tmp_path / "disk", "size=48m")


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for bytes but for only 64 files: a disk that fills up where no
    reservation of bytes can help (a new folder, a new file)."""
    yield from _tmpfs(tmp_path / "disk", "size=48m,nr_inodes=64")


def _tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """A real S3 bucket (SeaweedFS `weed mini` on loopback, tests/remote/seaweed.py), one for a
    test module: it takes 1-3 s to start. A test that kills it starts it again."""
    assert weed_binary().exists(), f"{weed_binary()} is missing: install the dev extras"
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def seaweed_bucket(seaweed: Seaweed) -> Iterator[Bucket]:
    """A client of the test bucket, closed after the test."""
    if seaweed.process is None:  # a test before killed it and failed before restarting it
        seaweed.start()
    client = seaweed.bucket(timeout=5.0)
    yield client
    client.close()


@pytest.fixture
def s3_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of the test's own, so tests sharing a bucket do not see each other's
    objects."""
    return f"t/{request.node.name}"


@pytest.fixture
def fake_bucket() -> Iterator[FakeBucket]:
    """A fake bucket on loopback (tests/remote/fake_bucket.py), honest until a test scripts it."""
    with running_bucket() as fake:
        yield fake


@pytest.fixture
def bucket_client(fake_bucket: FakeBucket) -> Iterator[Bucket]:
    """The S3 client on the fake bucket, each call bounded by 2 s."""
    bucket = Bucket(
        fake_bucket.endpoint, fake_bucket.bucket, Credentials("AKID", "secret"), timeout=2.0
    )
    yield bucket
    bucket.close()
