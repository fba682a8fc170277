"""Sizes and durations as kvd takes them, in its settings and in the engines' flags alike.

Sizes are whole bytes, or a number with a unit: K, M, G, T, P, each a power of 1024, with
optional "i" and "B" and in any case ("16KiB" == "16K" == "16kb" == 16384; "1GB" == 2**30).
A fraction is allowed and rounded down to whole bytes ("1.5T"). Durations are seconds.
Each parser takes a TOML value or a string and raises ValueError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?))?(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


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
    """Seconds, a positive and finite number ("0.1", 30, 2.5)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{value!r} must be a positive, finite number of seconds")
    return seconds


def format_size(size: int) -> str:
    """A size as its largest exact unit: 64G, 512M, 4096."""
    for prefix, power in reversed(_POWERS.items()):
        if power and size and size % 1024**power == 0:
            return f"{size // 1024**power}{prefix.upper()}"
    return str(size)
