"""Progress of a long operation on a terminal: one line redrawn in place, on stderr; nothing
at all when stderr is not a terminal (a service's log, a pipe, a test)."""

from __future__ import annotations

import sys
import time
from typing import Final, TextIO

REDRAW_SECONDS: Final = 0.1  # at most ten redraws a second, however fast the steps come
BAR_WIDTH: Final = 30


class Progress:
    """Steps done out of a total, shown as a bar with a count (a count alone when the total
    is not known in advance); close() clears the bar, or leaves the final count."""

    def __init__(self, label: str, total: int | None, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self._stream = stream if stream is not None else sys.stderr
        self._shown = self._stream.isatty()
        self._drawn_at = 0.0

    def step(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        last = self.total is not None and self.done >= self.total
        if self._shown and (now - self._drawn_at >= REDRAW_SECONDS or last):
            self._drawn_at = now
            self._stream.write(f"\r{self.line()}")
            self._stream.flush()

    def line(self) -> str:
        if self.total is None:
            return f"{self.label}: {self.done:,}"
        share = self.done / self.total if self.total else 1.0
        filled = round(BAR_WIDTH * share)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return f"{self.label} [{bar}] {self.done}/{self.total} ({100 * share:.0f}%)"

    def close(self) -> None:
        """Clear the bar; a count without a total stays, final, on its own line."""
        if self._shown:
            if self.total is None and self.done:
                self._stream.write(f"\r{self.line()}\n")
            else:
                self._stream.write("\r\033[K")
            self._stream.flush()
