"""The upload queue: stored entries whose blocks go to the bucket, capped in bytes.

A pure state machine, like the write-behind queue (kvd/bucket/writeback.py): the uploader does
the sending. An upload joins with the blocks of its entry not known to be in the bucket, and
its bytes count until each block is known to be there (sent, or found there already); the
uploader takes one upload at a time, oldest first (next), and reports each block (sent) and
the end (done: sent whole, or dropped).

Over the cap the oldest queued uploads are dropped (counted, with their bytes); the upload in
flight and the one just added never are, so one upload larger than the cap still goes. Uploads
leave in the order they came (dropped oldest first, or taken oldest first), so "every upload
added up to this one has left" is a comparison of sequence numbers (a Mark: flush --remote).
An upload the uploader drops before it could join (the bucket down) is counted here too
(drop_at_once).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Upload:
    """One entry's blocks to send: those not known to be in the bucket when it was added."""

    entry: str  # the entry's id
    digest: str  # its identity's digest
    block_hashes: tuple[bytes, ...]  # in the entry's order
    block_size: int  # each block file's size
    seq: int = 0  # its place in the queue's order
    left: int = 0  # bytes of its blocks not known to be in the bucket yet


@dataclass(eq=False, slots=True)
class Mark:
    """The uploads added up to seq (every one while seq is None: an open mark)."""

    seq: int | None = None

    def holds(self, seq: int) -> bool:
        return self.seq is None or seq <= self.seq


class UploadQueue:
    """Uploads in the order they came, one in flight; pending bytes capped (drop-oldest)."""

    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, not {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._queued: OrderedDict[int, Upload] = OrderedDict()
        self._pending: set[str] = set()  # entry ids queued or in flight
        self.in_flight: Upload | None = None
        self.pending_bytes = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self._seq = itertools.count(1)
        self.last_seq = 0  # of the newest upload added

    @property
    def pending_count(self) -> int:
        return len(self._queued) + (self.in_flight is not None)

    def holds(self, entry: str) -> bool:
        """Whether the entry's upload is queued or in flight."""
        return entry in self._pending

    def add(
        self, entry: str, digest: str, block_hashes: tuple[bytes, ...], block_size: int
    ) -> list[Upload] | None:
        """Queue an entry's blocks behind the others; the uploads dropped for room (oldest
        first), or None when the entry is pending already (nothing changed)."""
        if block_size < 0:
            raise ValueError(f"entry {entry}: block_size must be >= 0, not {block_size}")
        if entry in self._pending:
            return None
        self.last_seq = next(self._seq)
        nbytes = len(block_hashes) * block_size
        upload = Upload(entry, digest, block_hashes, block_size, self.last_seq, nbytes)
        self._queued[upload.seq] = upload
        self._pending.add(entry)
        self.pending_bytes += upload.left
        dropped: list[Upload] = []
        while self.pending_bytes > self.cap_bytes:
            oldest = next(iter(self._queued.values()))
            if oldest is upload:
                break  # only the new upload is left to drop, and it never is
            del self._queued[oldest.seq]
            self._leave(oldest, dropped=True)
            dropped.append(oldest)
        return dropped

    def next(self) -> Upload | None:
        """The oldest queued upload, now in flight; None if none is queued or one is in
        flight."""
        if self.in_flight is not None or not self._queued:
            return None
        _, self.in_flight = self._queued.popitem(last=False)
        return self.in_flight

    def sent(self, upload: Upload, nbytes: int) -> None:
        """nbytes of the upload in flight are known to be in the bucket now."""
        if upload is not self.in_flight:
            raise ValueError(f"the upload of entry {upload.entry} is not in flight")
        nbytes = min(nbytes, upload.left)
        upload.left -= nbytes
        self.pending_bytes -= nbytes

    def done(self, upload: Upload, *, dropped: bool) -> None:
        """The uploader is finished with the upload in flight: sent whole, or dropped (the
        bucket down, a failure, the entry gone), its bytes left counted as dropped."""
        if upload is not self.in_flight:
            raise ValueError(f"the upload of entry {upload.entry} is not in flight")
        self.in_flight = None
        self._leave(upload, dropped=dropped)

    def drop_at_once(self, nbytes: int) -> None:
        """An upload of nbytes dropped before it joined, counted as one that did."""
        self.dropped += 1
        self.dropped_bytes += nbytes

    def close(self, mark: Mark) -> None:
        """The mark (open until now: Mark()) holds the uploads added so far, no later one."""
        mark.seq = self.last_seq

    def left_of(self, mark: Mark) -> tuple[int, int]:
        """The mark's uploads still pending, and their bytes; (0, 0) once every one of them
        is done or dropped."""
        pending = list(itertools.takewhile(lambda u: mark.holds(u.seq), self._queued.values()))
        if self.in_flight is not None and mark.holds(self.in_flight.seq):
            pending.append(self.in_flight)
        return len(pending), sum(u.left for u in pending)

    def _leave(self, upload: Upload, *, dropped: bool) -> None:
        self._pending.discard(upload.entry)
        self.pending_bytes -= upload.left
        if dropped:
            self.drop_at_once(upload.left)
