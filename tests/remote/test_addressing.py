"""Which URL a bucket is asked at: path-style for a configured endpoint, virtual-host for AWS
(path-style for a bucket name with a dot), as docs/remote.md says."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvd.config import Config
from kvd.remote.bucket import Bucket, endpoint_for


def test_a_configured_endpoint_is_path_style() -> None:
    assert endpoint_for("https://store.lan:8333", "eu-west-1", "kvd") == (
        "https://store.lan:8333",
        "/kvd",
    )


def test_aws_is_virtual_host_but_for_a_bucket_with_a_dot() -> None:
    assert endpoint_for("", "eu-west-1", "kvd") == ("https://kvd.s3.eu-west-1.amazonaws.com", "")
    assert endpoint_for("", "eu-west-1", "kv.d") == ("https://s3.eu-west-1.amazonaws.com", "/kv.d")


def test_the_settings_choose_it(tmp_path: Path) -> None:
    config = Config(dir=tmp_path, socket=tmp_path / "kvd.sock", remote="s3://kvd/team")
    aws = Bucket.from_config(replace(config, remote_region="us-west-2"), {})
    assert aws.endpoint == "https://kvd.s3.us-west-2.amazonaws.com"
    local = Bucket.from_config(replace(config, remote_endpoint="http://127.0.0.1:8333"), {})
    assert local.endpoint == "http://127.0.0.1:8333"
