"""Sizes and durations as kvd takes them: one parser for the daemon's settings and the engines'
flags (kvd_protocol.quantities)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvd_protocol.quantities import duration, format_size, parse_size, positive_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("4096B", 4096),
        ("16KiB", 16 << 10),
        ("16K", 16 << 10),
        ("16kb", 16 << 10),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("200G", 200 << 30),
        ("1GB", 1 << 30),
        ("1 GiB", 1 << 30),
        ("1.5T", 3 << 39),
        ("2P", 2 << 50),
        (".5K", 512),
        ("1.1K", 1126),  # 1126.4 bytes, rounded down
        ("3.", 3),
        ("0.0009765625K", 1),  # 2**-10 K, exactly one byte
        ("123456789012345678901234567890.5P", (123456789012345678901234567890 << 50) + (1 << 49)),
        ("0", 0),
    ],
)
def test_size_forms(text: str, size: int) -> None:
    assert parse_size(text) == size


@given(st.integers(min_value=0, max_value=1 << 60))
def test_plain_and_unit_sizes_are_exact(n: int) -> None:
    assert parse_size(n) == parse_size(str(n)) == n
    assert parse_size(f"{n}K") == parse_size(f"{n}KiB") == n * 1024


@pytest.mark.parametrize(
    "bad", ["", "G", "12Q", "-1", "1e3", "1,5G", "inf", "1.5.5G", "5 G B", "4096iB", True, -1, 2.5]
)
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match=r"size|negative"):
        parse_size(bad)


def test_a_positive_size_refuses_zero_and_takes_the_rest() -> None:
    assert positive_size("1G") == 1 << 30
    with pytest.raises(ValueError, match="greater than zero"):
        positive_size("0K")


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (64 << 30, "64G"),
        (512 << 20, "512M"),
        (1 << 30, "1G"),
        (4096, "4K"),
        (4097, "4097"),
        (0, "0"),
    ],
)
def test_a_size_is_shown_in_its_largest_exact_unit(size: int, text: str) -> None:
    assert format_size(size) == text


@given(st.integers(min_value=0, max_value=1 << 60))
def test_a_shown_size_reads_back_as_itself(n: int) -> None:
    assert parse_size(format_size(n)) == n


# ---- durations -----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [("0.1", 0.1), ("30", 30.0), (2, 2.0), (2.5, 2.5)])
def test_durations_are_seconds(value: object, seconds: float) -> None:
    assert duration(value) == seconds


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ("0", "must be a positive, finite number of seconds"),
        ("-1", "must be a positive, finite number of seconds"),
        ("inf", "must be a positive, finite number of seconds"),
        ("nan", "must be a positive, finite number of seconds"),
        ("soon", "is not a number of seconds"),
        ("100ms", "is not a number of seconds"),
        (True, "expected a number of seconds"),
        (None, "expected a number of seconds"),
    ],
)
def test_bad_durations_say_what_a_duration_is(bad: object, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        duration(bad)
