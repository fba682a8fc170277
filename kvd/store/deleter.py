"""Deleting the tier's files off the event loop: let go of now, moved and unlinked on a thread.

Neither an unlink nor a rename may run on the daemon's event loop. Unlinking a large file can
stop its caller for most of a second: the file system frees the file's extents inside unlink
(ext4 with the `discard` mount option also trims them there: 0.7 s for 1 GiB measured on the
development machine). A rename is quick on its own but waits on the file system's journal,
which the writer's syncs keep busy (stalls of 100-300 ms measured under the soak). So
delete() only notes the path as leaving and counts its bytes; one thread of the deleter's own
renames it into the tier's deleting folder under a random name, then unlinks it there.

The rule this keeps: a file the tier has let go of is never taken for one of its own again.
Until its rename, a leaving file is still in its place, so
- the watcher's adoption and start-up's listing skip leaving paths (leaving(): an evicted
  entry is not adopted back);
- a file about to be placed at a leaving path first takes the leaving one out of the way
  (reclaim(), on the placer's worker thread): entry and staging files have fresh random
  names, but blocks are named by content, and a put of the same prompt straight after its
  eviction places a block at the very path that is leaving. The deleter's thread moves a
  path only while it is still leaving, so it never moves the file placed there after it.

Files let go of count as pending_bytes (their allocated size) from delete() until unlinked:
what the free-disk floor may count on as freed, and wait_idle() waits for them. What a crash
or a stop leaves in the deleting folder is deleted by reap() at the next start. What it
leaves in place (a rename still pending; after a power cut also a rename done, as renames are
not synced, like the unlinks they replace) start-up treats as any file it finds: an evicted
entry or block may be indexed again, valid as it is, and eviction or orphan collection takes
it again as need be.
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
    """Lets go of files at once; moves them out of their place and unlinks them on a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Work for the thread: (a leaving path, None) to move then unlink, or (a file in
        # the folder, its allocated bytes) to unlink.
        self._queue: queue.SimpleQueue[tuple[Path, int | None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()  # guards the state below
        self._leaving: dict[Path, int] = {}  # let go of, still in place: allocated bytes
        self._moving: Path | None = None  # the leaving path the thread is renaming now
        self.pending_bytes = 0  # allocated bytes let go of and not unlinked yet
        self._queued = 0  # work handed to the thread since start
        self._done = 0  # work the thread is done with since start
        self.deleted = 0  # files unlinked since start

    def delete(self, path: Path) -> None:
        """Let go of path now (a path already gone, or let go of already, is no error); it
        leaves its place soon after and its bytes are freed. On the event loop: no rename."""
        with self._changed:
            if path in self._leaving:
                return
        try:
            size = os.lstat(path).st_blocks * 512
        except FileNotFoundError:
            return
        except OSError:
            size = 0
        with self._changed:
            self._leaving[path] = size
            self.pending_bytes += size
        self._hand((path, None))

    def leaving(self, path: Path) -> bool:
        """Whether path is a file the tier let go of, still in its place: not one to adopt."""
        with self._changed:
            return path in self._leaving

    def reclaim(self, path: Path) -> None:
        """Blocking (a worker thread's): a file is about to be placed at path, so a file
        leaving from there is moved out of the way first (rarely: the same block put again
        straight after it was collected). If it cannot be moved, the placing replaces it."""
        with self._changed:
            self._changed.wait_for(lambda: self._moving != path)
            size = self._leaving.pop(path, None)
        if size is None:
            return
        target = self._move(path)
        if target is not None:
            self._hand((target, size))
            return
        with self._changed:  # freed by the placing's rename over it
            self.pending_bytes -= size

    def reap(self) -> int:
        """Delete what an earlier run left in the folder (in the background); how many."""
        try:
            with os.scandir(self.folder) as found:
                left = [Path(entry.path) for entry in found]
        except FileNotFoundError:
            return 0
        for path in left:
            try:
                size = os.lstat(path).st_blocks * 512
            except OSError:
                size = 0
            with self._changed:
                self.pending_bytes += size
            self._hand((path, size))
        return len(left)

    @property
    def pending_files(self) -> int:
        """Files let go of and not unlinked yet."""
        with self._changed:
            return self._queued - self._done

    def wait_moved(self) -> None:
        """Blocking: wait until no file let go of is still in its place (at a stop: what a
        next start finds in place it indexes again)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._leaving)

    def wait_idle(self) -> None:
        """Blocking: wait until every file let go of before this call is unlinked (the
        free-disk floor needs the room now); files let go of meanwhile are not waited for."""
        with self._changed:
            target = self._queued
            self._changed.wait_for(lambda: self._done >= target)

    def _hand(self, work: tuple[Path, int | None]) -> None:
        with self._changed:
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvd-deleter", daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _move(self, path: Path) -> Path | None:
        """Rename path into the folder; where it went, or None (gone, or not movable)."""
        target = self.folder / f"{secrets.token_hex(8)}{SUFFIX}"
        try:
            try:
                os.rename(path, target)
            except FileNotFoundError:
                if not os.path.lexists(path):
                    return None  # gone already
                self.folder.mkdir(mode=0o700, exist_ok=True)  # made by TierDir.create, unless not
                os.rename(path, target)
        except OSError as exc:
            log.warning("unlink_failed", path=str(path), error=str(exc))
            return None
        return target

    def _run(self) -> None:
        while True:
            path, size = self._queue.get()
            if size is None:
                with self._changed:
                    size = self._leaving.get(path)
                    if size is not None:
                        self._moving = path
                if size is None:  # reclaimed meanwhile: its placer moved it
                    self._settle(0, unlinked=False)
                    continue
                target = self._move(path)
                with self._changed:
                    del self._leaving[path]
                    self._moving = None
                    self._changed.notify_all()
                if target is None:
                    self._settle(size, unlinked=False)
                    continue
                path = target
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # left for the next start's reap()
                log.warning("unlink_failed", path=str(path), error=str(exc))
            self._settle(size, unlinked=True)

    def _settle(self, size: int, *, unlinked: bool) -> None:
        # Uncounted once unlinked: while one file is being unlinked its bytes may show as
        # pending and already free, a floor overstated by that file for that moment.
        # Uncounted before, they would show as neither, and an eviction for the floor would
        # take further entries for room that is on its way.
        with self._changed:
            self.pending_bytes -= size
            self.deleted += unlinked
            self._done += 1
            self._changed.notify_all()
