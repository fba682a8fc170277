"""The snapshots a cold tier holds until its sending thread takes them: bounded in bytes,
and when a new one comes, what it makes unnecessary or what is worth least goes.

- A snapshot covers another when its entry serves the other's tokens: the same tokens, or
  more of them when it trims. A new snapshot that a waiting one covers is not taken; one it
  covers (an earlier turn of its conversation, its own request's segments) are superseded.
- Over max_bytes, what is worth least goes first (Kind: prefill checkpoints, then segments,
  then finished turns), the oldest first within each, the new one included (it is the
  newest). A finished turn is thus never dropped while a segment or a checkpoint is kept. A
  snapshot larger than max_bytes alone is still taken when nothing else waits.

Bytes are counted by owner (InMemory.bytes_by_owner): a block copy several snapshots share once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, Protocol, TypeVar


class Kind(IntEnum):
    """What a snapshot is, in the order the backlog drops them (the least worth first)."""

    PREFILL_CHECKPOINT = 0  # part-way through a prompt's prefill (prefill_checkpoints.py)
    SEGMENT = 1  # a prefix on the way to a longer entry: the prompt boundary, a system prompt
    TURN = 2  # a finished turn: prompt and generation


class InMemory(Protocol):
    """What the backlog weighs of a snapshot (planned or taken)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def kind(self) -> Kind: ...

    @property
    def trimmable(self) -> bool: ...

    def bytes_by_owner(self) -> Mapping[object, int]:
        """The bytes it keeps in memory, by owner (a shared block copy is its own owner)."""
        ...


T = TypeVar("T", bound=InMemory)


def covers(entry: InMemory, other: InMemory) -> bool:
    """Whether entry's tokens serve other's: equal, or longer and trimmable."""
    tokens, wanted = entry.tokens, other.tokens
    if len(tokens) < len(wanted) or (len(tokens) > len(wanted) and not entry.trimmable):
        return False
    return tokens[: len(wanted)] == wanted


def memory_bytes(items: Iterable[InMemory]) -> int:
    owners: dict[object, int] = {}
    for item in items:
        owners.update(item.bytes_by_owner())
    return sum(owners.values())


@dataclass
class Admission(Generic[T]):
    """What admitting a new snapshot decided. taken: whether the new one is kept; covered:
    it is not, since a waiting one covers it."""

    taken: bool
    covered: bool = False
    superseded: list[T] = field(default_factory=list)
    dropped: list[T] = field(default_factory=list)


class Backlog(Generic[T]):
    """Waiting snapshots, oldest first (with what goes with each). Not thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a backlog of {max_bytes} bytes holds nothing")
        self.max_bytes = max_bytes
        self._waiting: list[T] = []

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def nbytes(self) -> int:
        return memory_bytes(self._waiting)

    def popleft(self) -> T:
        return self._waiting.pop(0)

    def admit(self, new: InMemory) -> Admission[T]:
        """Make room for new (not added yet: append it once taken) by the rules above; the
        superseded and dropped leave the backlog."""
        if any(covers(waiting, new) for waiting in self._waiting):
            return Admission(taken=False, covered=True)
        superseded = [waiting for waiting in self._waiting if covers(new, waiting)]
        kept = [waiting for waiting in self._waiting if waiting not in superseded]
        dropped: list[T] = []
        taken = True
        while kept and memory_bytes([*kept, new]) > self.max_bytes:
            victim = _least_worth([*kept, new])
            if victim is new:
                taken = False
                break
            kept.remove(victim)  # type: ignore[arg-type]
            dropped.append(victim)  # type: ignore[arg-type]
        self._waiting = kept
        return Admission(taken, superseded=superseded, dropped=dropped)

    def append(self, item: T) -> None:
        self._waiting.append(item)


def _least_worth(items: Sequence[InMemory]) -> InMemory:
    """The first to drop: the least worth by kind, the oldest first (items are in age
    order)."""
    return min(items, key=lambda item: item.kind)
