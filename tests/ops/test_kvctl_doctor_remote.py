"""`kvctl doctor --remote` run for real against SeaweedFS and the fake bucket: a bucket that
honours If-None-Match passes, one that ignores it fails, a clock off is a warning or a failure,
the probe object is deleted every time, a proxy variable is said to be ignored (and is), and a
running daemon's settings are the ones tried."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import running_daemon, socket_folder
from fake_bucket import FakeBucket, running_bucket
from remote_e2e import stored
from seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, Seaweed
from test_kvctl_doctor import doctor

from kvd.remote.bucket import Bucket

CHECKS = ["store", "credentials", "write", "conditional create", "read back", "clock", "delete"]


@pytest.fixture
def sockets() -> Iterator[Path]:
    with socket_folder() as folder:
        yield Path(folder)


def credentials(folder: Path, secret: str = SECRET_KEY) -> Path:
    file = folder / "credentials"
    file.write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {secret}\n"
    )
    file.chmod(0o600)
    return file


def settings(url: str, endpoint: str, file: Path | None) -> dict[str, str]:
    found = {"KVD_REMOTE": url, "KVD_REMOTE_ENDPOINT": endpoint}
    return found | ({"KVD_REMOTE_CREDENTIALS_FILE": str(file)} if file else {})


def remote_doctor(
    sockets: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return doctor(None, sockets / "kvd.sock", "--remote", *args, env=env)


def marks(result: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """check -> (result, detail), from --json."""
    return {each["check"]: (each["result"], each["detail"]) for each in json.loads(result.stdout)}


def test_an_honest_bucket_passes_and_keeps_nothing(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path, sockets: Path
) -> None:
    env = settings(f"s3://{BUCKET}/{s3_prefix}", seaweed.endpoint, credentials(tmp_path))
    result = remote_doctor(sockets, env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("settings: as kvd reads them here; no daemon answers")
    assert [line.split()[0] for line in lines[1:]] == ["ok"] * len(CHECKS), result.stdout
    assert "path-style" in lines[1]
    assert "a second write with If-None-Match: * refused" in result.stdout
    assert SECRET_KEY not in result.stdout
    assert stored(seaweed_bucket, s3_prefix) == {}, "the probe object deleted"


def test_a_wrong_secret_fails_at_the_write(
    seaweed: Seaweed, s3_prefix: str, tmp_path: Path, sockets: Path
) -> None:
    file = credentials(tmp_path, secret="not-the-secret-5e1")
    result = remote_doctor(sockets, settings(f"s3://{BUCKET}/{s3_prefix}", seaweed.endpoint, file))
    assert result.returncode == 1
    found = marks(
        remote_doctor(sockets, settings(f"s3://{BUCKET}/x", seaweed.endpoint, file), "--json")
    )
    assert found["credentials"][0] == "ok"
    assert found["write"][0] == "NO"
    assert "403" in found["write"][1]
    assert "credentials refused" in found["write"][1]
    assert "not-the-secret-5e1" not in result.stdout


def fake(bucket: FakeBucket, tmp_path: Path) -> dict[str, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return settings(f"s3://{bucket.bucket}/team", bucket.endpoint, credentials(tmp_path))


def test_a_bucket_that_ignores_if_none_match_fails(tmp_path: Path, sockets: Path) -> None:
    with running_bucket(ignore_if_none_match=True) as bucket:
        result = remote_doctor(sockets, fake(bucket, tmp_path), "--json")
        assert result.returncode == 1
        found = marks(result)
        assert found["conditional create"][0] == "NO"
        assert "ignores If-None-Match" in found["conditional create"][1]
        assert found["read back"][0] == "NO"
        assert found["delete"][0] == "ok"
        assert bucket.objects == {}
        assert bucket.asked("PUT", "team/doctor/") == 2


@pytest.mark.parametrize(
    ("offset", "mark", "exit_status"), [(0.0, "ok", 0), (120.0, "warning", 0), (-1200.0, "NO", 1)]
)
def test_the_clock_is_compared_with_the_stores(
    tmp_path: Path, sockets: Path, offset: float, mark: str, exit_status: int
) -> None:
    with running_bucket(date_offset=offset) as bucket:
        result = remote_doctor(sockets, fake(bucket, tmp_path), "--json")
        assert result.returncode == exit_status, result.stdout
        found = marks(result)
        assert found["clock"][0] == mark
        said = re.search(r"is (\d+) s (behind|ahead of) the bucket's", found["clock"][1])
        assert said, found["clock"]
        assert abs(int(said.group(1)) - abs(offset)) <= 2, "the Date is to the second"
        if offset:
            assert said.group(2) == ("behind" if offset > 0 else "ahead of")
        assert bucket.objects == {}


def test_a_proxy_variable_is_said_to_be_ignored_and_is(tmp_path: Path, sockets: Path) -> None:
    """kvd's client connects to the endpoint itself: nothing listens at the proxy's port."""
    with running_bucket() as bucket:
        env = fake(bucket, tmp_path) | {
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
        }
        result = remote_doctor(sockets, env, "--json")
        assert result.returncode == 0, result.stdout
        found = marks(result)
        assert found["proxy"] == (
            "warning",
            "HTTPS_PROXY, HTTP_PROXY set, and ignored: kvd connects to the bucket directly",
        )
        assert found["write"][0] == "ok"
        assert bucket.asked("PUT") == 2


def test_no_credentials_and_no_remote_fail_before_any_request(
    tmp_path: Path, sockets: Path
) -> None:
    with running_bucket() as bucket:
        env = settings(f"s3://{bucket.bucket}/team", bucket.endpoint, None)
        found = marks(remote_doctor(sockets, env, "--json"))
        assert found["credentials"][0] == "NO"
        assert "no credentials for the remote bucket" in found["credentials"][1]
        assert "write" not in found
        assert sum(bucket.requests.values()) == 0
    nothing = remote_doctor(sockets, {})
    assert nothing.returncode == 1
    assert "the remote setting is empty" in nothing.stdout


def test_the_running_daemons_settings_are_tried(tmp_path: Path) -> None:
    with running_bucket() as bucket:
        env = fake(bucket, tmp_path / "store")
        flags = ["--remote", env["KVD_REMOTE"], "--remote-endpoint", bucket.endpoint]
        flags += ["--remote-credentials-file", env["KVD_REMOTE_CREDENTIALS_FILE"]]
        with running_daemon(tmp_path, flags) as daemon:
            result = doctor(None, Path(daemon.socket_path), "--remote")
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith(f"settings: the daemon on {daemon.socket_path}")
        assert f"s3://kvd/team at {bucket.endpoint}" in result.stdout
        assert bucket.asked("PUT", "team/doctor/") == 2
