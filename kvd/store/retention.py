"""Soft retention: what a put asked to keep is evicted after its owner's other entries.

A put may carry a retention (kvd_protocol's Retention: seconds, and a priority). Its entry is
then retained until seconds from the put (cut to the max_retention setting), and each use (a
lease: a lookup's hit, a checkpoint found) starts those seconds again; a put skipped because
the tier holds its entry, or one covering it, gives its retention to that one (the later end
and the higher priority kept). A retention that ended is forgotten.

The rule, whatever the eviction policy ranks by (Retaining wraps the policy):

- **Retention decides which of an owner's entries go, never how many bytes an owner loses.**
  The policy names its victims as it would without retention; a retained one among them is
  replaced by the owner's unretained entries next in the policy's order. So unretained
  entries of the same size and use go first, and a tenant's retentions count against its own
  entries only: they never push out another owner's. An entry's owner is its identity's
  tenant (the namespace's "uid:<uid>/", see kvd.serve.peer; "" for the engines of the
  daemon's own user, who share one owner).
- **When an owner's retained entries alone are over, retained entries go**: the lowest
  priority first, then the one whose retention ends soonest, then the policy's order.
  Retention is soft: the cap and the free-disk floor hold whatever is retained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import accumulate

from kvd_protocol.messages import Retention

from kvd.store.eviction import EvictionPolicy, evictable
from kvd.store.records import EntryRecord, Retained


def owner_of(namespace: str | None) -> str:
    """The tenant an identity's namespace is under ("" for the daemon's own user's)."""
    if namespace is None or not namespace.startswith("uid:") or "/" not in namespace:
        return ""
    return namespace[: namespace.index("/") + 1]


def retained_order(record: EntryRecord) -> tuple[int, float]:
    """Among an owner's retained entries, the first to go sorts first: lowest priority, then
    the soonest end."""
    retained = record.retained
    assert retained is not None
    return retained.priority, retained.until


class Retaining:
    """An eviction policy (any of EVICTION_POLICIES) under the retention rule (see the module).

    It keeps the entries that have a retention apart (few: the others cost nothing), forgets
    the retentions that ended whenever it looks, and with no retention lasting is the policy
    alone.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        max_retention: float,
        namespace_of: Callable[[str], str | None] = lambda digest: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.max_retention = max_retention
        self._namespace_of = namespace_of
        self._clock = clock
        self._retained: dict[EntryRecord, None] = {}

    def granted(self, asked: Retention, held: Retained | None = None) -> Retained | None:
        """The retention a put asking for asked gets (None for one of no seconds), merged with
        held, the one its entry has (the later end, the longer renewal, the higher priority)."""
        seconds = min(asked.seconds, self.max_retention)
        if seconds <= 0:
            return held
        now = self._clock()
        granted = Retained(now + seconds, seconds, asked.priority)
        if held is None or held.until <= now:
            return granted
        return Retained(
            max(granted.until, held.until),
            max(granted.seconds, held.seconds),
            max(granted.priority, held.priority),
        )

    def retain(self, record: EntryRecord, asked: Retention) -> None:
        """Give an entry the tier holds the retention a put asked for (see granted)."""
        record.retained = self.granted(asked, record.retained)
        if record.retained is not None:
            self._retained[record] = None

    # --- the EvictionPolicy protocol -----------------------------------------------------------

    def add(self, record: EntryRecord) -> None:
        self.policy.add(record)
        if record.retained is not None:
            self._retained[record] = None

    def remove(self, record: EntryRecord) -> None:
        self.policy.remove(record)
        self._retained.pop(record, None)

    def touch(self, record: EntryRecord) -> None:
        """A use: the policy's, and a retention lasting starts its seconds again."""
        self.policy.touch(record)
        retained = record.retained
        if retained is not None:
            now = self._clock()
            if retained.until > now:
                retained.until = now + retained.seconds

    def select_victims(
        self, over_bytes: int, among: Callable[[EntryRecord], bool] | None = None
    ) -> list[EntryRecord]:
        """The policy's victims, each retained one replaced under the rule (see the module)."""
        now = self._clock()
        self._forget_ended(now)
        plain = self.policy.select_victims(over_bytes, among)
        if not any(victim in self._retained for victim in plain):
            return plain
        owners: dict[str, list[EntryRecord]] = {}  # in the order the policy named them
        for victim in plain:
            owners.setdefault(self._owner(victim), []).append(victim)
        victims: list[EntryRecord] = []
        for owner, named in owners.items():
            if not any(victim in self._retained for victim in named):
                victims += named
                continue
            victims += self._instead(owner, sum(v.nbytes for v in named), among)
        return victims

    # --- what status reads ---------------------------------------------------------------------

    def retained_bytes(self) -> dict[str, int]:
        """The bytes of the entries retained now (each its file and its blocks, as if stored
        alone: what its retention keeps), by identity digest."""
        self._forget_ended(self._clock())
        found: dict[str, int] = {}
        for record in self._retained:
            found[record.digest] = found.get(record.digest, 0) + record.logical_bytes
        return found

    # --- within ------------------------------------------------------------------------------

    def _instead(
        self, owner: str, need: int, among: Callable[[EntryRecord], bool] | None
    ) -> list[EntryRecord]:
        """need bytes of owner's entries: unretained ones in the policy's order, then
        retained ones in retained_order."""

        def unretained(record: EntryRecord) -> bool:
            return (
                record not in self._retained
                and self._owner(record) == owner
                and (among is None or among(record))
            )

        victims = self.policy.select_victims(need, unretained)
        freed = sum(victim.nbytes for victim in victims)
        if freed >= need:
            return victims
        retained = sorted(
            (
                record
                for record in self._retained
                if evictable(record)
                and self._owner(record) == owner
                and (among is None or among(record))
            ),
            key=lambda record: (*retained_order(record), record.last_used),
        )
        ends = accumulate(record.nbytes for record in retained)
        for record, total in zip(retained, ends, strict=True):
            victims.append(record)
            if freed + total >= need:
                break
        return victims

    def _owner(self, record: EntryRecord) -> str:
        return owner_of(self._namespace_of(record.digest))

    def _forget_ended(self, now: float) -> None:
        ended = [r for r in self._retained if r.retained is None or r.retained.until <= now]
        for record in ended:
            record.retained = None
            del self._retained[record]
