"""Deleting the tier's files off the event loop: moved out of their place now, unlinked later.

Unlinking a large file can stop its caller for most of a second: the file system frees the
file's extents inside unlink (ext4 with the `discard` mount option also trims them there:
0.7 s for 1 GiB measured on the development machine), and the daemon's event loop must not
stop for an eviction. So delete() renames the file into the tier's deleting folder under a
random name (a rename within one file system is quick and atomic, and frees the file's place
at once: entries and blocks are named by content, so a put of the same prompt straight after
its eviction reuses the path), and one thread of the deleter's own unlinks it there.

Until its thread has unlinked them, the files moved count as pending_bytes (their allocated
size): what the free-disk floor may count on as freed, and wait_idle() waits for them. What a
crash or a stop leaves in the folder is deleted by reap() at the next start. A rename
is not synced, like the unlink it replaces: after a power cut a deleted file may be found in
its old place again, where start-up treats it as any file it finds.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
from pathlib import Path

from kvd.logs import get_logger

log = get_logger("kvd.store.deleter")

SUFFIX = ".gone"


class Deleter:
    """Moves files out of their place at once and unlinks them on a thread of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._queue: queue.SimpleQueue[tuple[Path, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()  # guards the counts below
        self.pending_bytes = 0  # allocated bytes moved here and not unlinked yet
        self._queued = 0  # files handed to the thread since start
        self.deleted = 0  # files the thread is done with since start

    def delete(self, path: Path) -> None:
        """Take path out of its place now (a path already gone is no error); its bytes are
        freed soon after. A path that cannot be moved stays, with a log line: the tier has
        let go of it either way."""
        target = self.folder / f"{secrets.token_hex(8)}{SUFFIX}"
        try:
            try:
                os.rename(path, target)
            except FileNotFoundError:
                if not os.path.lexists(path):
                    return  # gone already
                self.folder.mkdir(mode=0o700, exist_ok=True)  # made by TierDir.create, unless not
                os.rename(path, target)
        except OSError as exc:
            log.warning("unlink_failed", path=str(path), error=str(exc))
            return
        self._unlink_later(target)

    def reap(self) -> int:
        """Delete what an earlier run left in the folder (in the background); how many."""
        try:
            with os.scandir(self.folder) as found:
                left = [Path(entry.path) for entry in found]
        except FileNotFoundError:
            return 0
        for path in left:
            self._unlink_later(path)
        return len(left)

    def wait_idle(self) -> None:
        """Blocking: wait until every file moved before this call is unlinked (the free-disk
        floor needs the room now); files moved meanwhile are not waited for."""
        with self._changed:
            target = self._queued
            self._changed.wait_for(lambda: self.deleted >= target)

    def _unlink_later(self, path: Path) -> None:
        try:
            size = os.lstat(path).st_blocks * 512
        except OSError:
            size = 0
        with self._changed:
            self.pending_bytes += size
            self._queued += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvd-deleter", daemon=True)
            self._thread.start()
        self._queue.put((path, size))

    def _run(self) -> None:
        while True:
            path, size = self._queue.get()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # left for the next start's reap()
                log.warning("unlink_failed", path=str(path), error=str(exc))
            # Uncounted once unlinked: while one file is being unlinked its bytes may show
            # as pending and already free, a floor overstated by that file for that moment.
            # Uncounted before, they would show as neither, and an eviction for the floor
            # would take further entries for room that is on its way.
            with self._changed:
                self.pending_bytes -= size
                self.deleted += 1
                self._changed.notify_all()
