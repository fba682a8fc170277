"""The values of settings: each parser takes a TOML value or a string and raises ValueError.

Sizes are whole bytes, or a number with a unit: K, M, G, T, P, each a power of 1024, with
optional "i" and "B" and in any case ("16KiB" == "16K" == "16kb" == 16384; "1GB" == 2**30).
A fraction is allowed and rounded down to whole bytes ("1.5T"). Durations are seconds.
"""

from __future__ import annotations

import grp
import math
import re
from collections.abc import Callable, Collection, Mapping
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?))?(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
MAX_PORT = 65535


def parse_size(value: object) -> int:
    """Bytes from an integer or a size string (see the module docstring); ValueError if bad."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size (an integer or a string such as '64G'), got {value!r}")
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a size: expected bytes or a number with K, M, G, T or P "
            "(powers of 1024), such as '4096', '512M', '1.5T' or '16KiB'"
        )
    number, prefix, _, _ = match.groups()
    whole, _, fraction = number.partition(".")  # in integers, exact: no Decimal to import
    scale = 1 << 10 * _POWERS[(prefix or "").lower()]
    denominator: int = 10 ** len(fraction)  # typed: int ** int is Any to mypy
    return (int(whole or "0") * denominator + int(fraction or "0")) * scale // denominator


def above_zero(parse: Callable[[object], int]) -> Callable[[object], int]:
    """The parser that also refuses 0."""

    def parse_above_zero(value: object) -> int:
        number = parse(value)
        if number == 0:
            raise ValueError("must be greater than zero")
        return number

    return parse_above_zero


positive_size = above_zero(parse_size)


def duration(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{value!r} must be a positive, finite number of seconds")
    return seconds


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


def format_size(size: int) -> str:
    """A size as its largest exact unit: 64G, 512M, 4096."""
    for prefix, power in reversed(_POWERS.items()):
        if power and size and size % 1024**power == 0:
            return f"{size // 1024**power}{prefix.upper()}"
    return str(size)
