"""The upload queue: byte-capped, the oldest queued dropped for room (counted, with its bytes),
never the one in flight nor the one just added; an entry queued once; bytes leave as blocks
are known to be in the bucket; a mark waits for the uploads added before it and counts its
drops."""

from __future__ import annotations

import pytest

from kvd.remote.upload_queue import Mark, UploadQueue

B = 100  # bytes of a block


def blocks(n: int, tag: int = 0) -> tuple[bytes, ...]:
    return tuple(bytes([tag, i]) * 8 for i in range(n))


def test_over_the_cap_the_oldest_queued_go_never_the_one_in_flight() -> None:
    queue = UploadQueue(cap_bytes=3 * B)
    assert queue.add("e1", "id", blocks(2, 1), B) == []
    first = queue.next()
    assert first is not None
    assert first.entry == "e1"
    assert queue.add("e2", "id", blocks(1, 2), B) == []  # 3 blocks: at the cap
    dropped = queue.add("e3", "id", blocks(1, 3), B)
    assert dropped is not None
    assert [u.entry for u in dropped] == ["e2"]
    assert queue.in_flight is first
    assert (queue.dropped, queue.dropped_bytes) == (1, B)
    assert queue.pending_bytes == 3 * B
    assert queue.pending_count == 2


def test_one_upload_over_the_cap_still_goes() -> None:
    queue = UploadQueue(cap_bytes=B)
    assert queue.add("big", "id", blocks(5), B) == []
    upload = queue.next()
    assert upload is not None
    assert upload.left == 5 * B


def test_an_entry_pending_is_not_queued_twice() -> None:
    queue = UploadQueue(cap_bytes=10 * B)
    assert queue.add("e1", "id", blocks(2), B) == []
    assert queue.add("e1", "id", blocks(2), B) is None
    assert queue.pending_count == 1
    upload = queue.next()
    assert upload is not None
    assert queue.add("e1", "id", blocks(2), B) is None, "in flight: still pending"
    queue.done(upload, dropped=False)
    assert queue.add("e1", "id", blocks(2), B) == []


def test_bytes_leave_as_blocks_are_known_in_the_bucket() -> None:
    queue = UploadQueue(cap_bytes=10 * B)
    queue.add("e1", "id", blocks(3), B)
    upload = queue.next()
    assert upload is not None
    queue.sent(upload, B)
    assert queue.pending_bytes == 2 * B
    queue.done(upload, dropped=True)  # the rest dropped: its bytes counted as such
    assert (queue.pending_bytes, queue.dropped, queue.dropped_bytes) == (0, 1, 2 * B)


def test_a_mark_waits_for_the_uploads_until_closed() -> None:
    queue = UploadQueue(cap_bytes=2 * B)
    mark = Mark()  # open: what is added until it closes is its own too
    queue.add("e1", "id", blocks(1), B)
    in_flight = queue.next()
    assert in_flight is not None
    queue.add("e2", "id", blocks(1), B)
    queue.close(mark)
    queue.add("e3", "id", blocks(1), B)  # after the mark closed: drops e2, the mark's
    assert queue.left_of(mark) == (1, B)
    queue.done(in_flight, dropped=False)
    assert queue.left_of(mark) == (0, 0), "e3 is not the mark's"
    queue.drop_at_once(B)  # the bucket down: counted as an upload that joined
    assert (queue.dropped, queue.dropped_bytes) == (2, 2 * B)


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        UploadQueue(cap_bytes=-1)
    queue = UploadQueue(cap_bytes=B)
    queue.add("e1", "id", blocks(1), B)
    upload = queue.next()
    assert upload is not None
    queue.done(upload, dropped=False)
    with pytest.raises(ValueError, match="not in flight"):
        queue.done(upload, dropped=False)
    with pytest.raises(ValueError, match="not in flight"):
        queue.sent(upload, B)
