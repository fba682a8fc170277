"""An entry file's slots checked at its commit on several threads at once: the commit's own
and the block checkers' (block_checks.py), so that a whole entry (version 1, one file) is
checked on the cores the block checkers have, not on one.

A whole entry's file can be checked only once it is sealed (sealing.py), that is at its
commit: a lease answers for the file, not for a range of it, and the engine holds its
descriptor until it has written the head, which holds the checksums, last. Each slot has a
checksum of its own: the commit's thread and helpers on the checkers' threads each take the
next slot no thread has taken, so a helper queued behind other puts' blocks leaves its share
to the threads that run, and the commit never waits for a helper that has not begun. Every
slot is checked once. No slot is taken after one fails; all before it were taken, and are
checked before the answer: the refusal names the first slot that fails, in file order, as a
check on one thread would.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Final

from kvd_protocol.entry import Slot

from kvd.store import block_checks, entry_files

# Below this many bytes a file's slots are checked on the commit's thread alone: a helper's
# wake-up and the core it shares cost more than they save on a small file (2 cores under
# other work: a 16 MiB entry's commit answered in 7.6 ms spread against 6.7 alone, medians;
# 64 MiB about the same; 256 MiB in 32-40 against 50-53 ms).
SPREAD_BYTES: Final = 64 << 20
# Helpers beside the commit's thread: the checkers' threads, a core each, are the cores the
# commit may take.
HELPERS: Final = block_checks.CHECKERS - 1


class _Turns:
    """The slots of one file handed out to the threads that check them, each once, in file
    order; the failures seen, by slot index (none is handed out once one failed)."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._next = 0
        self._lock = threading.Lock()
        self.failures: dict[int, Exception] = {}

    def take(self) -> int | None:
        with self._lock:
            if self.failures or self._next == self._count:
                return None
            self._next += 1
            return self._next - 1

    def failed(self, index: int, exc: Exception) -> None:
        with self._lock:
            self.failures[index] = exc


def verify_slots(fd: int, name: str, slots: Sequence[Slot]) -> None:
    """entry_files.verify_slots on the commit's thread and helpers on the checkers' threads:
    every slot's bytes in file fd against its checksum; EntryFormatError (or the OSError of a
    read) for the first that fails, in file order. fd is read by pread only, and by no helper
    once this returns."""
    turns = _Turns(len(slots))
    check = partial(_check_in_turn, turns, fd, name, slots)
    helpers = [block_checks.on_a_checker(check) for _ in range(_helpers(slots))]
    check()
    for helper in helpers:
        if not helper.cancel():
            helper.result()  # its slots ended; what failed is in turns
    if turns.failures:
        raise turns.failures[min(turns.failures)]


def _helpers(slots: Sequence[Slot]) -> int:
    if sum(slot.nbytes for slot in slots) < SPREAD_BYTES:
        return 0
    return min(HELPERS, len(slots) - 1)


def _check_in_turn(turns: _Turns, fd: int, name: str, slots: Sequence[Slot]) -> None:
    """Check slots as turns hands them out, until none is left or one failed."""
    buffer: memoryview | None = None
    while (index := turns.take()) is not None:
        if buffer is None:
            buffer = entry_files.slot_buffer(slots)
        try:
            entry_files.verify_slot(fd, name, slots[index], buffer)
        except Exception as exc:  # the commit's thread raises it, once every helper is done
            turns.failed(index, exc)
