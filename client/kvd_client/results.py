"""What calls return: a put's ticket and its state, a lookup's hit, an eviction's count, a
presence answer.

TicketBase and LookupResultBase hold the state of a Ticket and a LookupResult, blocking or
async; api.py adds the methods that run calls (wait, release).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvd_protocol.entry import EntryHeader
from kvd_protocol.messages import EntrySummary

from . import entry_io


@dataclass(frozen=True)
class TicketState:
    """stored, dropped or failed (settled by the daemon), pending, or unavailable (the daemon
    could not be asked, so the outcome is unknown)."""

    state: str
    reason: str | None = None

    @property
    def settled(self) -> bool:
        return self.state != "pending"


@dataclass(frozen=True)
class PutOutcome:
    ticket: int | None  # None when the daemon never issued one
    state: TicketState
    epoch: int


class TicketBase:
    """What a put returns: the daemon's ticket for the entry and its last known state."""

    def __init__(self, outcome: PutOutcome) -> None:
        self._outcome = outcome
        self._state = outcome.state

    @property
    def id(self) -> int | None:
        return self._outcome.ticket

    @property
    def epoch(self) -> int:
        return self._outcome.epoch

    @property
    def state(self) -> TicketState:
        return self._state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self._state.state}>"


@dataclass(frozen=True)
class LookupHit:
    matched: int
    summary: EntrySummary
    lease: int
    epoch: int
    entry: entry_io.EntryFile


class LookupResultBase:
    """A usable entry: its header read from the file, and a read-only view per tensor
    (mapped on first use). Release it (or use it as a context manager) to close the file
    and end the lease. Of an entry stored in blocks (header.blocks) these are the
    manifest's: the tails of the cut tensors, the other tensors whole; a get reads the
    blocks."""

    def __init__(self, hit: LookupHit) -> None:
        self._hit = hit
        self._released = False

    @property
    def matched(self) -> int:
        """Tokens of the prompt this entry covers."""
        return self._hit.matched

    @property
    def summary(self) -> EntrySummary:
        return self._hit.summary

    @property
    def header(self) -> EntryHeader:
        return self._hit.entry.header

    @property
    def tensors(self) -> tuple[memoryview, ...]:
        """Views of a read-only mapping of the file, made now if not yet: EntryFormatError if
        the file shrank since the lookup. A file truncated while mapped faults (SIGBUS) when
        read past its end; the restore (Client.get) reads by pread and never does."""
        return self._hit.entry.tensors

    @property
    def released(self) -> bool:
        return self._released

    def verify(self) -> None:
        """Check every tensor's bytes (read by pread) against its checksum; raises
        EntryFormatError."""
        self._hit.entry.verify()

    def fills(self, *, verify: bool = True) -> list[Callable[[Sequence[memoryview]], None]]:
        """Per tensor, a reader of its bytes into given buffers by pread, checksummed unless
        not verify (what prompt_cache.decode restores from)."""
        return self._hit.entry.fills(verify=verify)

    def _close(self) -> LookupHit | None:
        """Close the file once; the hit whose lease to release, or None if already released."""
        if self._released:
            return None
        self._released = True
        self._hit.entry.close()
        return self._hit


@dataclass(frozen=True)
class Evicted:
    entries: int
    bytes: int


@dataclass(frozen=True)
class Presence:
    """How much of a prompt a daemon would restore now (matched, from entry) and why no more
    (miss, detail: a lookup's miss reason; None when all but the prompt's last token would);
    how many tokens past that its remote tier holds (remote; None without one) and why no
    more (remote_miss, remote_detail). Asking restored and counted nothing."""

    matched: int
    entry: str | None
    miss: str | None
    detail: str | None
    remote: int | None
    remote_miss: str | None
    remote_detail: str | None
