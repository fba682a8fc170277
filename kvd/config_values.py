"""The values of settings: each parser takes a TOML value or a string and raises ValueError.

Sizes and durations are kvd_protocol.quantities' (the engines' flags take them the same way).
"""

from __future__ import annotations

import grp
import re
from collections.abc import Callable, Collection, Mapping
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from kvd_protocol.quantities import above_zero, positive_size

MAX_PORT = 65535


def count(value: object) -> int:
    """A whole number, zero or more (a TOML integer or a string of digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return value


positive_count = above_zero(count)


def port(value: object) -> int:
    """A TCP port, 0 to 65535 (0: none)."""
    number = count(value)
    if number > MAX_PORT:
        raise ValueError(f"a TCP port is at most {MAX_PORT}, got {number}")
    return number


def text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def boolean(value: object) -> bool:
    """A TOML boolean, or a string: true, yes, on, 1 or false, no, off, 0 (in any case)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in _TRUE | _FALSE:
        raise ValueError(f"expected true or false, got {value!r}")
    return word in _TRUE


def choice(kind: type[StrEnum]) -> Callable[[object], StrEnum]:
    def parse(value: object) -> StrEnum:
        try:
            return kind(text(value))
        except ValueError:
            allowed = ", ".join(member.value for member in kind)
            raise ValueError(f"{value!r} is not one of: {allowed}") from None

    return parse


def one_of(names: Collection[str]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        name = text(value)
        if name not in names:
            raise ValueError(f"{value!r} is not one of: {', '.join(names)}")
        return name

    return parse


def quotas(value: object) -> tuple[tuple[str, int], ...]:
    """Per-model byte caps: a TOML table {pattern = size}, or "pattern=size,pattern=size"."""
    if isinstance(value, Mapping):
        pairs = [(str(pattern), size) for pattern, size in value.items()]
    else:
        pairs = []
        for part in filter(None, (p.strip() for p in text(value).split(","))):
            pattern, sep, size = part.rpartition("=")
            if not sep or not pattern:
                raise ValueError(f"{part!r} is not pattern=size, such as 'mlx-community/*=20G'")
            pairs.append((pattern.strip(), size.strip()))
    return tuple((pattern, positive_size(size)) for pattern, size in pairs)


def group(value: object) -> str | None:
    name = text(value)
    if not name:
        return None  # an empty value means the owner only, as when unset
    try:
        grp.getgrnam(name)
    except KeyError:
        raise ValueError(f"no group named {name!r} on this system") from None
    return name


def path(value: object) -> Path:
    name = text(value)
    if not name:
        raise ValueError("must not be empty")
    return Path(name)


def optional_path(value: object) -> Path | None:
    """A path, or None for an empty value (the setting is off)."""
    name = text(value)
    return Path(name) if name else None


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_KEY_PREFIX = re.compile(r"[A-Za-z0-9._/-]*")


def remote_url(value: object) -> str:
    """`s3://BUCKET/PREFIX` (the prefix optional), or "" for none: the bucket an S3 bucket
    name, the prefix path segments of letters, digits and `._-`; kept without a trailing /."""
    url = text(value).strip()
    if not url:
        return ""
    scheme, sep, rest = url.partition("://")
    if scheme != "s3" or not sep:
        raise ValueError(f"{url!r} is not s3://BUCKET/PREFIX")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"{bucket!r} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
    segments = prefix.split("/") if prefix else []
    if not _KEY_PREFIX.fullmatch(prefix) or any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"{prefix!r} is not a key prefix (segments of A-Z, a-z, 0-9, '._-')")
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def endpoint_url(value: object) -> str:
    """`http://HOST[:PORT]` or `https://HOST[:PORT]`, or "" for AWS's own endpoint."""
    url = text(value).strip().rstrip("/")
    if not url:
        return ""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError:
        raise ValueError(f"{url!r} has no valid port") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"{url!r} is not http(s)://HOST[:PORT] (no path, no user)")
    return url
