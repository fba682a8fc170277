"""A put's new block files checked on threads of their own, each as soon as it is sealed, so
that the put's commit waits only for what is left.

A block is checked whole (check_block_file: its size, head and checksums) once no client can
change it. The engine library writes a put's blocks in batches and closes a batch's
descriptors before it asks for the next (put_blocks): when that next put_blocks arrives, the
blocks handed out before it are checked early, each one whose file no writer is left of
(sealing.sealed_as_it_is: a read lease on Linux, refused while any descriptor or shared
mapping can write it). Such a check holds only while no writer can be made again, and only
the daemon can make one (the file and its 0700 folder are the daemon's): it does so for a
block asked for again (put_blocks), which first withdraws the block's check. The check's
lease and the withdrawal take the put's lock, so the daemon never opens a file to write
while a lease of its own is held on it (the lease break would signal the daemon).

At commit every block not checked early (a writer was left, a system without leases, a check
withdrawn or failed) is sealed then, a copy if need be, and checked on the same threads, the
commit's own thread checking the manifest meanwhile. Only a check that passed is trusted:
any other is made again at commit, where its refusal is the put's.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvd_protocol.entry import BlockHeader
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

from kvd.store import entry_files, sealing

# Threads that check block files, shared by every put: a core each, up to four (as many as
# the engine library writes blocks on), while the commit's own thread checks the manifest.
CHECKERS: Final = min(4, os.cpu_count() or 1)


class _Checkers:
    """The threads that check block files, and how many early checks passed on them."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=CHECKERS, thread_name_prefix="kvd-block-check")
        self._lock = threading.Lock()
        self.passed = 0

    def count_pass(self) -> None:
        with self._lock:
            self.passed += 1


@functools.cache
def _checkers() -> _Checkers:
    return _Checkers()


def on_a_checker(work: Callable[[], None]) -> Future[None]:
    """work run on one of the checkers' threads, when one is free."""
    return _checkers().pool.submit(work)


def passed_early() -> int:
    """How many blocks passed their check early, before their put's commit."""
    return _checkers().passed


def check_block_file(fd: int, name: str, size: int, limits: Limits) -> BlockHeader:
    """A sealed block file, checked whole: of the size its put_begin declared (the tier
    counts it so), its head valid, every slot's bytes those its head's checksum says; its
    head (the caller checks its place in the manifest). Raises EntryFormatError."""
    actual = os.fstat(fd).st_size
    if actual != size:
        raise EntryFormatError(
            name, Rule.FILE_SIZE, f"{actual} bytes, where put_begin declared {size} a block"
        )
    head = entry_files.block_head(fd, name, limits)
    entry_files.verify_slots(fd, name, head.slots)
    return head


@dataclass(eq=False)
class _Early:
    """One block's early check, run by future; withdrawn: its file was handed out again
    (set under the put's lock)."""

    withdrawn: bool = False
    future: Future[BlockHeader | None] | None = None


class BlockChecks:
    """The early checks of one put's new block files, by block index."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._early: dict[int, _Early] = {}

    def begin(self, blocks: Iterable[tuple[int, Path, str]], size: int, limits: Limits) -> None:
        """Check each of blocks (index, file, name for errors) on the checkers' threads, if no
        writer of it is left by the time its turn comes: each not begun yet, or whose check
        ended without passing (a writer was left then: a client that writes several batches
        at once, the daemon's own fetches)."""
        for index, path, name in blocks:
            if not _worth_beginning(self._early.get(index)):
                continue
            early = _Early()
            self._early[index] = early
            early.future = _checkers().pool.submit(self._check, early, path, name, size, limits)

    def _check(
        self, early: _Early, path: Path, name: str, size: int, limits: Limits
    ) -> BlockHeader | None:
        """On a checker's thread: the block's head, checked whole; None when it could not be
        sealed as it is (a writer left, no leases here, or handed out again meanwhile)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            with self._lock:
                if early.withdrawn or not sealing.sealed_as_it_is(fd):
                    return None
            head = check_block_file(fd, name, size, limits)
        finally:
            os.close(fd)
        _checkers().count_pass()
        return head

    def withdraw(self, indexes: Iterable[int]) -> None:
        """Before the blocks at indexes are handed out again: their checks no longer hold."""
        with self._lock:
            for index in indexes:
                early = self._early.pop(index, None)
                if early is not None:
                    early.withdrawn = True
                    if early.future is not None:
                        early.future.cancel()

    def cancel(self) -> None:
        """The put ended uncommitted: checks not begun are not begun."""
        self.withdraw(list(self._early))

    def at_commit(
        self, checks: Mapping[int, Callable[[], BlockHeader]]
    ) -> dict[int, Future[BlockHeader]]:
        """On the commit's thread, once none of the put's blocks can be handed out again:
        every block's head as a future, its early check's if that passed, else its check
        (checks: index -> seal the block and check it) run on the checkers' threads now."""
        early, pool = self._early, _checkers().pool
        heads = {i: pool.submit(check) for i, check in checks.items() if i not in early}
        for index in sorted(early):
            head = _passed(early[index])
            heads[index] = _done(head) if head is not None else pool.submit(checks[index])
        return heads


def _worth_beginning(early: _Early | None) -> bool:
    """Whether a block's check is to begin (again): none begun, or one ended not passed."""
    if early is None:
        return True
    return early.future is not None and early.future.done() and _passed(early) is None


def _passed(early: _Early) -> BlockHeader | None:
    """An early check's head once it has ended; None unless it passed."""
    if early.future is None:
        return None
    try:
        return early.future.result()
    except Exception:  # refused or failed on a file a writer may still have changed: again
        return None


def _done(head: BlockHeader) -> Future[BlockHeader]:
    future: Future[BlockHeader] = Future()
    future.set_result(head)
    return future
