"""Work handed to a pool of threads and waited for as one: the restore's reads, a put's block
writes; and the descriptors such work writes into. No MLX here: the raw put path uses it too."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


def settle(pending: Sequence[Future[None]]) -> None:
    """Wait for every one of pending, then raise the first failure: nothing is left running
    on the buffers or descriptors they use once this returns or raises."""
    wait(pending)
    for future in pending:
        future.result()


def run_all(pool: ThreadPoolExecutor, jobs: Sequence[Callable[[], None]]) -> None:
    """Run jobs on pool's threads and settle them; a single job runs on this thread."""
    if len(jobs) == 1:
        jobs[0]()
        return
    settle([pool.submit(job) for job in jobs])


class Descriptors:
    """Descriptors that jobs on other threads write into, closed once the last of their users
    is done: the holder (the call that received them) and every job lent them.

    A holder may give up while a job still writes (an async put cancelled, its thread left
    running; a wait interrupted): closing then would let the next open anywhere in the
    process reuse the number, and the job's write would land in that file. So the holder's
    release closes only if no job is under way, and the last job to end closes otherwise. A
    job that starts after the release does nothing (OSError)."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.fds = tuple(fds)
        self._lock = threading.Lock()
        self._users = 1  # the holder
        self._released = False  # by the holder

    def lent(self, job: Callable[[], T]) -> Callable[[], T]:
        """job, run as a user of the descriptors (on any thread)."""

        def run() -> T:
            with self._lock:
                if self._released:
                    raise OSError(f"descriptors {list(self.fds)} were given up before the write")
                self._users += 1
            try:
                return job()
            finally:
                self._leave()

        return run

    def release(self) -> None:
        """The holder is done (again: nothing): close now, or when the last job ends."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._leave()

    def __enter__(self) -> Descriptors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
        for fd in self.fds:
            os.close(fd)
