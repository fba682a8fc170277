"""Write admission: which puts are worth the SSD's wear. On a Mac the SSD is soldered in and
its writes are its life; a prefix seen once may never be asked for again.

One table of policies (ADMISSION_POLICIES), chosen by the `admission` setting; a policy
decides at put_begin, before a byte is written, and a put it refuses is answered at once
(refused, with the reason) and counted with its bytes (what admission saved).

- always: every put (the default).
- min-tokens: only puts of at least `admission_min_tokens` tokens: a short prefix costs
  little to recompute.
- second-hit: a prefix is persisted the second time it is seen within `admission_window`
  seconds: put again, or asked for by a lookup (the prompt, or all of it but its last token,
  which is what an engine stores at a prompt boundary). The first sighting keeps only a
  16-byte hash of the identity and tokens, for the window at most and at most SIGHTINGS of
  them, the oldest forgotten first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Final, Protocol

from kvd_protocol.tokens import TOKEN_BYTES, token_count

SIGHTINGS: Final = 100_000  # second-hit's memory: 100k hashes, ~15 MB at most


class Admission(Protocol):
    def admit(self, digest: str, tokens: bytes, now: float) -> str | None:
        """None: write it; else why not."""

    def looked_up(self, digest: str, tokens: bytes, now: float) -> None:
        """A lookup asked for tokens (a sighting, to policies that count them)."""

    def sightings(self) -> int:
        """How many sightings it keeps."""


class Always:
    def admit(self, digest: str, tokens: bytes, now: float) -> str | None:
        return None

    def looked_up(self, digest: str, tokens: bytes, now: float) -> None:
        pass

    def sightings(self) -> int:
        return 0


class MinTokens:
    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens

    def admit(self, digest: str, tokens: bytes, now: float) -> str | None:
        count = token_count(tokens)
        if count < self.min_tokens:
            return f"not admitted: {count} tokens, fewer than {self.min_tokens}"
        return None

    def looked_up(self, digest: str, tokens: bytes, now: float) -> None:
        pass

    def sightings(self) -> int:
        return 0


class SecondHit:
    def __init__(self, window: float, capacity: int = SIGHTINGS) -> None:
        self.window = window
        self.capacity = capacity
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # hash -> last sighting

    def admit(self, digest: str, tokens: bytes, now: float) -> str | None:
        key = _key(digest, tokens)
        last = self._seen.get(key)
        if last is not None and now - last <= self.window:
            del self._seen[key]  # persisted now: a later put is a duplicate anyway
            return None
        self._sighted(key, now)
        return "not admitted: the first sighting of this prefix (second-hit)"

    def looked_up(self, digest: str, tokens: bytes, now: float) -> None:
        self._sighted(_key(digest, tokens), now)
        if len(tokens) > TOKEN_BYTES:
            self._sighted(_key(digest, tokens[:-TOKEN_BYTES]), now)

    def sightings(self) -> int:
        return len(self._seen)

    def _sighted(self, key: bytes, now: float) -> None:
        """Keep a sighting; forget those past the capacity or out of the window."""
        seen = self._seen
        seen[key] = now
        seen.move_to_end(key)
        while len(seen) > self.capacity or next(iter(seen.values())) < now - self.window:
            seen.popitem(last=False)


def _key(digest: str, tokens: bytes) -> bytes:
    return hashlib.blake2b(tokens, digest_size=16, key=bytes.fromhex(digest)[:64]).digest()


# Each policy made from the settings (min_tokens, window) it reads.
ADMISSION_POLICIES: Final[Mapping[str, Callable[[int, float], Admission]]] = {
    "always": lambda min_tokens, window: Always(),
    "min-tokens": lambda min_tokens, window: MinTokens(min_tokens),
    "second-hit": lambda min_tokens, window: SecondHit(window),
}
