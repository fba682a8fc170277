"""platform_memory.zero_rooms on real mappings: a room reads as zeros, the bytes around it
stay, and (Linux, private anonymous memory) pages never touched are left out of memory."""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterator

import pytest
from kvd_client.platform_memory import PAGE, _resident, probe, zero_rooms

PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as malloc's memory


@pytest.fixture
def mapping() -> Iterator[tuple[int, mmap.mmap]]:
    """Eight pages never touched, and where they start."""
    with mmap.mmap(-1, 8 * PAGE, flags=PRIVATE) as memory:
        yield ctypes.addressof((ctypes.c_char * (8 * PAGE)).from_buffer(memory)), memory


@pytest.mark.parametrize("private", [True, False])
def test_rooms_over_old_bytes_and_fresh_pages_read_as_zeros(
    mapping: tuple[int, mmap.mmap], private: bool
) -> None:
    base, memory = mapping
    ctypes.memset(base, 0x5A, 3 * PAGE)  # in memory, old bytes; the rest never touched
    rooms = [(base + 10, 2 * PAGE), (base + 2 * PAGE + 100, 5 * PAGE), (base + 8 * PAGE - 1, 0)]
    zero_rooms((base, 8 * PAGE), rooms, private=private)
    data = memory[:]
    assert data[:10] == b"\x5a" * 10
    assert data[10 : 10 + 2 * PAGE] == bytes(2 * PAGE)
    assert data[10 + 2 * PAGE : 2 * PAGE + 100] == b"\x5a" * (90)
    assert data[2 * PAGE + 100 : 7 * PAGE + 100] == bytes(5 * PAGE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's promise: Linux")
def test_zeroing_leaves_pages_never_touched_out_of_memory(
    mapping: tuple[int, mmap.mmap],
) -> None:
    base, _ = mapping
    ctypes.memset(base, 0x5A, PAGE)
    zero_rooms((base, 8 * PAGE), [(base + 100, 8 * PAGE - 200)], private=True)
    assert _resident(base, 8 * PAGE) == bytes([1, 0, 0, 0, 0, 0, 0, 1])  # the edges' pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's promise: Linux")
def test_a_fresh_buffers_rooms_touch_no_page_but_the_buffers_first(
    mapping: tuple[int, mmap.mmap],
) -> None:
    base, memory = mapping
    rooms = [(base + 1000, PAGE), (base + 3 * PAGE + 10, 2 * PAGE)]
    zero_rooms((base + 8, 8 * PAGE - 8), rooms, private=True)
    # The whole pages of the buffer dropped at once; the first one it holds only in part.
    assert _resident(base, 8 * PAGE) == bytes([1, 0, 0, 0, 0, 0, 0, 0])
    assert memory[:] == bytes(8 * PAGE)


def test_the_doctor_probe_holds_here() -> None:
    assert probe()
