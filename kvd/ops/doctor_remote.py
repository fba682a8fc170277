"""`kvctl doctor --remote`: what kvd assumes of its bucket, tried on the bucket itself.

With the settings doctor found (the running daemon's when one answers, else as kvd reads them
here) and the credentials as this process finds them (the same sources as the daemon's:
kvd/remote/credential_source.py), it writes a probe object of its own under the prefix, writes
it again with If-None-Match: * and expects the bucket to refuse (412: kvd's layouts are "the
first written wins", and some S3-compatible stores ignore the header), reads it back, compares
the bucket's clock (its answers' Date) with this machine's, and deletes it. Each finding is a
line: ok, warning (kvd works, not as well), or NO (kvd's remote tier is not safe or does not
work): exit status 1 when one is NO.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kvd.config import Config
from kvd.remote.bucket import SKEW_LIMIT_S, Bucket, BucketError
from kvd.remote.context import split_url
from kvd.remote.credential_source import CredentialSource
from kvd.remote.credentials import CredentialsError

CLOCK_OK_S: Final = 30.0  # a bucket's Date this close is as near as its one-second header tells
PROXY_VARIABLES: Final = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")


class Mark(StrEnum):
    OK = "ok"
    WARNING = "warning"
    NO = "NO"


@dataclass(frozen=True)
class Line:
    mark: Mark
    check: str
    detail: str

    def to_map(self) -> dict[str, str]:
        return {"check": self.check, "result": str(self.mark), "detail": self.detail}


def add_remote_flag(doctor: argparse.ArgumentParser) -> None:
    doctor.add_argument(
        "--remote",
        dest="try_remote",  # `remote` is the setting's name (config.load_config reads args)
        action="store_true",
        help="try the remote bucket instead: write a probe object twice (the second must be "
        "refused), read it, compare clocks, delete it",
    )


def check_remote(config: Config, whose: str, as_json: bool) -> int:
    """Print the remote checks' lines (or JSON); 1 when one says NO, else 0."""
    lines = remote_lines(config, dict(os.environ))
    if as_json:
        print(json.dumps([line.to_map() for line in lines], indent=2))
    else:
        width = max(len(line.check) for line in lines)
        print(whose)
        for line in lines:
            print(f"{line.mark:<7}  {line.check:<{width}}  {line.detail}")
    return 1 if any(line.mark is Mark.NO for line in lines) else 0


def remote_lines(config: Config, environ: dict[str, str]) -> list[Line]:
    """Every finding, in order; the probe object deleted whatever happened after its write."""
    if not config.remote:
        return [Line(Mark.NO, "remote", "the remote setting is empty: there is no bucket")]
    source = CredentialSource(config.remote_credentials_file, environ)
    bucket = Bucket.from_config(config, environ, credentials=source)
    try:
        lines = [_bucket_line(config, bucket), *_proxy_lines(environ)]
        try:
            credentials = source.current()
        except CredentialsError as error:
            return [*lines, Line(Mark.NO, "credentials", str(error))]
        found = f"{credentials.source} (as this process finds them)"
        return [*lines, Line(Mark.OK, "credentials", found), *_tried(bucket, config)]
    finally:
        bucket.close()


def _bucket_line(config: Config, bucket: Bucket) -> Line:
    style = "path-style" if config.remote_endpoint else "virtual-host"
    if not config.remote_endpoint and "." in bucket.name:
        style = "path-style (a bucket name with a dot)"
    return Line(
        Mark.OK, "store", f"{config.remote} at {bucket.endpoint} ({style}, {config.remote_region})"
    )


def _proxy_lines(environ: dict[str, str]) -> list[Line]:
    named = [name for name in PROXY_VARIABLES if environ.get(name)]
    if not named:
        return []
    return [
        Line(
            Mark.WARNING,
            "proxy",
            f"{', '.join(named)} set, and ignored: kvd connects to the bucket directly",
        )
    ]


def _tried(bucket: Bucket, config: Config) -> list[Line]:
    """Write, write again, read, the clock, delete: a line each."""
    _, prefix = split_url(config.remote)
    name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    key = f"{prefix}/doctor/{name}" if prefix else f"doctor/{name}"
    first, second = b"kvd doctor: first\n", b"kvd doctor: second\n"
    lines: list[Line] = []
    try:
        if not bucket.put_if_absent(key, first):
            return [Line(Mark.NO, "write", f"{key} was there already: a conditional create failed")]
    except BucketError as error:
        return [Line(Mark.NO, "write", str(error))]
    lines.append(Line(Mark.OK, "write", f"created {key}"))
    offset = bucket.clock_offset()
    try:
        lines += [
            _step("conditional create", lambda: _second_write(bucket, key, second)),
            _step("read back", lambda: _read_back(bucket, key, first, second)),
            _clock(offset),
        ]
    finally:
        lines.append(_step("delete", lambda: _delete(bucket, key)))
    return lines


def _step(check: str, run: Callable[[], Line]) -> Line:
    try:
        return run()
    except BucketError as error:
        return Line(Mark.NO, check, str(error))


def _second_write(bucket: Bucket, key: str, second: bytes) -> Line:
    if not bucket.put_if_absent(key, second):
        return Line(Mark.OK, "conditional create", "a second write with If-None-Match: * refused")
    return Line(
        Mark.NO,
        "conditional create",
        "the bucket wrote the object again: it ignores If-None-Match: *, so an identity's "
        "layout is the last written, not the first (daemons with other block sizes would "
        "replace it under each other's blocks)",
    )


def _read_back(bucket: Bucket, key: str, first: bytes, second: bytes) -> Line:
    found = bucket.get(key, 1 << 10)
    if found == first:
        return Line(Mark.OK, "read back", f"{len(first)} bytes, as first written")
    if found == second:
        return Line(Mark.NO, "read back", "the second write's bytes: the first was replaced")
    size = "nothing" if found is None else f"{len(found)} other bytes"
    return Line(Mark.NO, "read back", f"{size} where the object was written")


def _clock(offset: float | None) -> Line:
    if offset is None:
        return Line(Mark.WARNING, "clock", "the bucket's answers have no Date: not compared")
    off = f"{abs(offset):.0f} s {'behind' if offset > 0 else 'ahead of'} the bucket's"
    if abs(offset) <= CLOCK_OK_S:
        return Line(Mark.OK, "clock", f"this machine's is {off} (its Date is to the second)")
    if abs(offset) <= SKEW_LIMIT_S:
        return Line(Mark.WARNING, "clock", f"this machine's is {off}: set it (NTP)")
    return Line(
        Mark.NO,
        "clock",
        f"this machine's is {off}: stores refuse requests signed that far off (AWS past "
        "15 minutes); set it (NTP)",
    )


def _delete(bucket: Bucket, key: str) -> Line:
    bucket.delete(key)
    if bucket.head(key) is not None:
        return Line(Mark.WARNING, "delete", f"{key} is still there after its delete")
    return Line(Mark.OK, "delete", f"{key} deleted")
