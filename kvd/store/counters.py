"""What happened to the tier's entries since start, counted where it happens (the catalog,
the puts, the writer, the quarantine, the reads), for status."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    """What happened to entries since start, for status."""

    hits: int = 0
    misses: int = 0
    engine_held: int = 0  # lookups the engine's own memory served as well (miss_reasons)
    evictions: int = 0
    evicted_bytes: int = 0
    superseded: int = 0
    quarantined: int = 0
    duplicates: int = 0
    abandoned: int = 0
    bytes_written: int = 0

    def hit_unused(self) -> None:
        """A hit the engine could not use (its restore report says why): a miss, as per model."""
        self.hits, self.misses = max(0, self.hits - 1), self.misses + 1
