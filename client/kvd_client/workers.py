"""Work handed to a pool of threads and waited for as one: the restore's reads, a put's block
writes. No MLX here: the raw put path uses it too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait


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
