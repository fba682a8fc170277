"""The upload journal's file (<tier>/uploads.journal, format in journal_format.py): the uploads
pending in the queue, kept on disk so that a restart finds those a stop (SIGTERM, kill -9, a
reboot) cut off.

load() reads it once, at start. The uploader notes each upload that joins the queue (added)
and leaves it (left) on the event loop; run() writes what was noted in a worker thread, a
batch at a time with one fsync, and writes the journal anew (compacted, renamed over it) when
the records left behind dominate, after the file was found damaged, and after a write failed
(tried again every RETRY_S until one succeeds). A failure to read or write is a problem said
at warning (and in status), never the daemon's end: the uploads go on without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import anyio

from kvd.logs import get_logger
from kvd.remote import journal_format as fmt
from kvd.store.durability import replace_durably, sync_file

log = get_logger("kvd.remote.upload_journal")

RETRY_S: Final = 5.0  # a failed write is tried again (the whole journal) this often


class UploadJournal:
    """The journal of one tier: load() once at start, then added/left, and run()."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0  # the file's bytes, as last written
        self.written = 0  # uploads pending in the file, as last written
        self.problem: str | None = None  # the last failure to read or write it
        self._pending: dict[str, int] = {}  # entry id -> bytes, in order, as noted
        self._unwritten: list[bytes] = []  # records noted, not written yet
        self._records = 0  # records in the file
        self._rewrite = False  # the next write writes the journal anew
        self._noted = anyio.Event()
        self._fd = -1

    def load(self) -> fmt.Replay:
        """The uploads the file holds (pending from before this start): read once, at start,
        before the daemon serves (the file is bounded: module docstring). A file that cannot
        be read, or not whole, is said at warning and written anew with what could be."""
        try:
            data = _read(self.path)
        except OSError as exc:
            found = fmt.Replay(damage=f"unreadable: {exc}")
        else:
            found = fmt.replay(data)
            self.size = len(data)
        self._pending = dict(found.pending)
        self._records = found.records
        self.written = len(found.pending)
        if found.damage is not None:
            self.problem = f"{found.damage}; written anew"
            self._rewrite = True
            self._noted.set()
            log.warning("remote_upload_journal_damaged", path=str(self.path), why=found.damage)
        return found

    def added(self, entry: str, nbytes: int) -> None:
        """An upload of nbytes joined the queue."""
        if entry not in self._pending:
            self._pending[entry] = nbytes
            self._note(fmt.record(fmt.ADDED, entry, nbytes))

    def left(self, entry: str) -> None:
        """An upload left the queue: sent whole, or counted dropped."""
        if self._pending.pop(entry, None) is not None:
            self._note(fmt.record(fmt.LEFT, entry))

    def _note(self, record: bytes) -> None:
        self._unwritten.append(record)
        self._noted.set()

    async def run(self) -> None:
        """Write what is noted, a batch at a time (one fsync each). Runs forever."""
        while True:
            await self._noted.wait()
            self._noted = anyio.Event()
            batch, self._unwritten = b"".join(self._unwritten), []
            records = self._records + len(batch) // fmt.RECORD.size
            whole = None
            if self._rewrite or fmt.worth_compacting(records, len(self._pending)):
                whole = fmt.compacted(self._pending.items())
                records = len(self._pending)
            pending = len(self._pending)
            try:
                self.size = await anyio.to_thread.run_sync(self._write, batch, whole)
            except OSError as exc:
                self._fail(f"cannot write: {exc}")
                await anyio.sleep(RETRY_S)  # then the whole journal, even if nothing is noted
                self._noted.set()
                continue
            self._records, self._rewrite, self.written = records, False, pending

    def _write(self, batch: bytes, whole: bytes | None) -> int:
        """Append the batch, or put the whole journal in the file's place; synced. The
        file's size after it."""
        if whole is not None:
            self._close_file()
            staged = self.path.with_name(self.path.name + ".tmp")
            staged.write_bytes(whole)
            replace_durably(staged, self.path)
        if self._fd < 0:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o600)
            if os.fstat(self._fd).st_size == 0:
                batch = fmt.MAGIC + batch  # a new file
        if whole is None:
            view = memoryview(batch)
            while view:
                view = view[os.write(self._fd, view) :]
            sync_file(self._fd)
        return os.fstat(self._fd).st_size

    def _fail(self, why: str) -> None:
        """A write failed: said at warning once per new reason; the next write rewrites."""
        self._rewrite = True
        self._close_file()
        if why != self.problem:
            log.warning("remote_upload_journal_failed", path=str(self.path), error=why)
        self.problem = why

    def close(self) -> None:
        """At the daemon's stop: what is noted and not written yet goes to the file (a
        little, at once), then the file is closed."""
        if self._unwritten or self._rewrite:
            batch, self._unwritten = b"".join(self._unwritten), []
            whole = fmt.compacted(self._pending.items()) if self._rewrite else None
            try:
                self._write(batch, whole)
            except OSError as exc:
                log.warning("remote_upload_journal_failed", path=str(self.path), error=str(exc))
        self._close_file()

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
