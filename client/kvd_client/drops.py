"""The snapshots an engine dropped and has not told the daemon of yet: told with its next
commit (put_commit's dropped), kept until a commit carries them. Not thread-safe."""

from __future__ import annotations

from kvd_protocol.messages import MAX_REPORTED_BYTES, MAX_REPORTED_DROPS, DropReport


class Drops:
    def __init__(self) -> None:
        self.snapshots = 0
        self.bytes = 0

    def add(self, snapshots: int, nbytes: int) -> None:
        self.snapshots += snapshots
        self.bytes += nbytes

    def report(self) -> DropReport | None:
        """What to tell with the next commit (at most the protocol's bounds: the rest waits
        for the one after), or None when nothing was dropped."""
        if not (self.snapshots or self.bytes):
            return None
        return DropReport(
            snapshots=min(self.snapshots, MAX_REPORTED_DROPS),
            bytes=min(self.bytes, MAX_REPORTED_BYTES),
        )

    def told(self, report: DropReport | None) -> None:
        """report reached the daemon (or one that takes no report: it is not kept for it)."""
        if report is not None:
            self.snapshots -= report.snapshots
            self.bytes -= report.bytes
