"""The records that messages carry inside them: an entry's summary (lookup and list replies),
an engine's restore report (release) and drop report (put_commit), with their bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from . import schema
from .fields import U32, _at_most, _bool, _name, _optional, _seconds, _token_count, _uint, wire
from .limits import Limits
from .record import Record

# Bounds of the numbers a client reports, checked at decoding so that a daemon never counts
# one it could not use (a running mean poisoned by 1e300):
MAX_REPORTED_MS: Final = 86_400_000.0  # store_ms and a restore report's ms: a day
MAX_REPORTED_BYTES: Final = 1 << 50  # bytes one restore read or a drop report held: a PiB
MAX_REPORTED_DROPS: Final = U32  # snapshots one drop report counts
# Bounds of a put's retention; the daemon's max_retention bounds its length further.
MAX_RETENTION_SECONDS: Final = 30 * 86_400.0  # thirty days
MAX_RETENTION_PRIORITY: Final = 255


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class EntrySummary(Record):
    """What the daemon tells about one stored entry (lookup and list replies)."""

    id: str = field(metadata=wire(_name))
    identity: str = field(metadata=wire(_name))  # Identity.digest()
    tokens: int = field(metadata=wire(_uint()))
    bytes: int = field(metadata=wire(_uint()))
    trimmable: bool = field(metadata=wire(_bool))
    created: float = field(metadata=wire(_seconds))  # seconds since the epoch
    durable: bool = field(metadata=wire(_bool))
    # Fields added within version 1 (left out at their defaults):
    used: float | None = field(default=None, metadata=wire(_optional(_seconds)))  # last lease
    leases: int = field(default=0, metadata=wire(_uint()))  # readers holding it now
    # A prefill checkpoint (FORMAT.md, meta prefill_checkpoint); trimmable is then false.
    prefill_checkpoint: bool = field(default=False, metadata=wire(_bool))
    # Its retention, while it lasts (Retention): until when (Unix seconds), and its priority.
    retained_until: float | None = field(default=None, metadata=wire(_optional(_seconds)))
    retention_priority: int = field(default=0, metadata=wire(_uint(0, MAX_RETENTION_PRIORITY)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class DropReport(Record):
    """Snapshots the engine dropped unsent (its backlog was full) and the bytes they held."""

    snapshots: int = field(metadata=wire(_uint(0, MAX_REPORTED_DROPS)))
    bytes: int = field(metadata=wire(_uint(0, MAX_REPORTED_BYTES)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Retention(Record):
    """How long a put asks the daemon to keep its entry before unretained ones (a soft
    retention): seconds from the put, and again from each use; and a priority among retained
    entries (the higher is kept longer when retained ones alone are over the cap)."""

    seconds: float = field(metadata=wire(_at_most(MAX_RETENTION_SECONDS)))
    priority: int = field(default=0, metadata=wire(_uint(0, MAX_RETENTION_PRIORITY)))


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class RestoreReport(Record):
    """How an engine's restore from a leased entry went, for the daemon's telemetry: restored
    (miss nil: tokens restored from bytes read) or not (miss: the engine's reason)."""

    miss: str | None = field(metadata=wire(_optional(_name)))
    ms: float = field(metadata=wire(_at_most(MAX_REPORTED_MS)))  # lookup's start to caches built
    bytes: int = field(metadata=wire(_uint(0, MAX_REPORTED_BYTES)))
    tokens: int = field(metadata=wire(_token_count))


def _entry(value: object, what: str, limits: Limits) -> EntrySummary:
    return EntrySummary.from_map(value, what, limits)


def _report(value: object, what: str, limits: Limits) -> RestoreReport:
    return RestoreReport.from_map(value, what, limits)


def _retention(value: object, what: str, limits: Limits) -> Retention:
    return Retention.from_map(value, what, limits)


def _drops(value: object, what: str, limits: Limits) -> DropReport:
    return DropReport.from_map(value, what, limits)


def _entries(value: object, what: str, limits: Limits) -> tuple[EntrySummary, ...]:
    items = schema.sequence(value, what, limits.max_frame_bytes)
    return tuple(_entry(item, what, limits) for item in items)
