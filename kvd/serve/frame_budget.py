"""The bytes all connections together hold in partial frames, against one budget.

A connection buffers a frame until its last byte is in (up to max_frame_bytes); a thousand
connections each holding most of a large frame would take gigabytes. Each session says what
it holds after every read (hold); one whose growth takes the total over the budget is to be
closed, and the others go on. Small frames are not counted (SMALL_FRAME_BYTES).
"""

from __future__ import annotations

from typing import Final

# A partial frame up to this size is kept outside the budget: a connection keeps that much
# at most (max_connections of them), and an engine's usual request (a lookup of 60k tokens)
# is never refused because others filled the budget with frames they never finish.
SMALL_FRAME_BYTES: Final = 256 << 10


class FrameBudget:
    """Bytes of partial frames buffered by every connection, the most they may be, and how
    long (seconds) a connection may take to finish a frame it began (frame_timeout)."""

    def __init__(self, limit: int, timeout: float) -> None:
        self.limit = limit
        self.timeout = timeout
        self.buffered = 0

    def hold(self, was: int, now: int) -> bool:
        """A connection buffered was bytes and buffers now: whether that fits (a connection
        that buffers less never goes over, even when others already did)."""
        self.buffered += now - was
        return now <= was or self.buffered <= self.limit
