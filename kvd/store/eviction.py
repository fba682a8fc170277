"""Eviction's rules, all of them: which entries leave the tier, when, and in what order.

- **When.** The tier holds a byte cap (max_bytes: its entry files and unique blocks) and a
  free-disk floor (min_free) after every commit, at start-up, after an adoption and when leases
  expire: Eviction.to_cap() deletes what bytes_over() says must go. A disk that cannot say its
  free space is kept to the cap alone. A put may ask for a higher floor (room for its staging
  files), and a model's quota evicts within its own entries (Eviction.within).
- **Which.** Only durable, unleased entries (evictable()): a pending entry belongs to the
  write-behind queue, and a leased one is being read. An eviction by request (kvctl evict: an
  entry, an identity or all) takes the durable ones it names, leased ones included (their
  files go when the last lease ends), never pending ones (flush first).
- **How much.** A victim frees its file and the blocks no other entry lists, which the
  policy cannot know: the bytes really freed are measured after each victim, and the policy
  asked again while still over.
- **In what order.** A policy, named by a setting in EVICTION_POLICIES (the one table of
  them): LruPolicy is the default; CostPolicy keeps what saves the most prefill per byte, aged
  by disuse.
- **Retained.** Retention decides which of an owner's entries go, never how many bytes an
  owner loses: kvd.store.retention's Retaining wraps whichever policy is set with that rule
  (the retention's own terms are there).

Every policy keeps one rule, whatever it ranks by: **a prefill checkpoint no prompt has
restored from yet is evicted before whole entries of the same size and use.** A prefill
checkpoint (the caches part-way through a prompt's prefill) saves only the prefill up to a
point the next prompt may never reach, and a prompt's checkpoints are many; a whole entry is
a turn someone had. So until its first use such a checkpoint counts
PREFILL_CHECKPOINT_DISCOUNT times less: LruPolicy takes it as unused that many times as long,
CostPolicy as worth that many times less. A prompt restoring from it shows it is worth what a
whole entry is: from then on it ages as one, so a burst of prompts on one document keeps the
checkpoint they all restore from over the turns they leave behind. (Its first use since the
daemon started: after a restart a prefill checkpoint waits for a use again.)
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Final, Protocol

from kvd_protocol.errors import ErrorCode, ProtocolError

from kvd.store.counters import Counters
from kvd.store.records import EntryRecord

# How many times less an unused prefill checkpoint counts than a whole entry (the rule).
PREFILL_CHECKPOINT_DISCOUNT: Final = 2


def bytes_over(total_bytes: int, max_bytes: int | None, disk_free: int, min_free: int) -> int:
    """Bytes of entries to delete so that total_bytes <= max_bytes and disk_free >= min_free.

    max_bytes None means no cap; min_free 0 means no floor. Deleting an entry frees its bytes
    on the disk as well, so the larger of the two shortfalls satisfies both.
    """
    over_cap = 0 if max_bytes is None else total_bytes - max_bytes
    return max(0, over_cap, min_free - disk_free)


def evictable(record: EntryRecord) -> bool:
    """Whether eviction may take record now (see LruPolicy for why)."""
    return record.durable and record.leases == 0


class EvictionPolicy(Protocol):
    """The order in which entries are evicted.

    The tier calls add() when an entry is indexed, remove() whenever it leaves (evicted,
    superseded, purged, gone from disk), touch() on each use (a lookup hit), and
    select_victims() after each commit.
    """

    def add(self, record: EntryRecord) -> None: ...

    def remove(self, record: EntryRecord) -> None: ...

    def touch(self, record: EntryRecord) -> None: ...

    def select_victims(
        self, over_bytes: int, among: Callable[[EntryRecord], bool] | None = None
    ) -> list[EntryRecord]:
        """Evictable entries (of those among() accepts) whose bytes add up to over_bytes."""
        ...


class LruPolicy:
    """Least recently used first; a lookup hit is a use.

    Two kinds of entry are skipped, never chosen:
    - pending (not durable): the write-behind queue still owns it and its put has not been
      answered stored or dropped; deleting it would lose an accepted put behind the queue's
      back. It is the newest entry anyway.
    - leased: a reader is restoring from it right now, the surest sign it is worth keeping;
      and deleting its file would not free the disk until the reader lets go. Its bytes still
      count, so the others pay for them until the lease ends.

    Entries are kept in two OrderedDicts, oldest first: the prefill checkpoints not used yet
    (speculative), and the rest (touch moves one to the end of the rest), so a selection
    merges the two heads and visits its victims and the few skipped entries before them, not
    every entry. Between the heads, age decides: the ticks of the catalog's logical clock
    (record.last_used: each put and each hit takes one, in the order of adds and touches)
    since the entry's last use, plus one, a speculative checkpoint's counted
    PREFILL_CHECKPOINT_DISCOUNT times (the module's rule); of two of the same age, the
    speculative checkpoint goes. The newest entry's last use stands for now: the policy
    keeps nothing per entry but its place.
    """

    def __init__(self) -> None:
        self._used: OrderedDict[EntryRecord, None] = OrderedDict()
        self._speculative: OrderedDict[EntryRecord, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._used) + len(self._speculative)

    def _order(self, record: EntryRecord) -> OrderedDict[EntryRecord, None]:
        return self._speculative if record in self._speculative else self._used

    def add(self, record: EntryRecord) -> None:
        """Start tracking record as the most recently used; ValueError if already tracked."""
        if record in self._used or record in self._speculative:
            raise ValueError(f"entry {record.id} is already tracked")
        if record.prefill_checkpoint and not record.used_at:
            self._speculative[record] = None
        else:
            self._used[record] = None

    def remove(self, record: EntryRecord) -> None:
        """Stop tracking record; KeyError if it is not tracked."""
        del self._order(record)[record]

    def touch(self, record: EntryRecord) -> None:
        """Make record the most recently used (a speculative checkpoint is one no more);
        KeyError if it is not tracked."""
        if record in self._speculative:
            del self._speculative[record]
            self._used[record] = None
        else:
            self._used.move_to_end(record)

    def now(self) -> int:
        """The logical clock's value now: the newest entry's last use (0 with none)."""
        orders = (self._used, self._speculative)
        return max((next(reversed(order)).last_used for order in orders if order), default=0)

    def age(self, record: EntryRecord, now: int) -> int:
        """record's age at now (now()) as eviction weighs it (see the class)."""
        age = max(1, now + 1 - record.last_used)
        return age * PREFILL_CHECKPOINT_DISCOUNT if record in self._speculative else age

    def select_victims(
        self, over_bytes: int, among: Callable[[EntryRecord], bool] | None = None
    ) -> list[EntryRecord]:
        """The oldest evictable entries by age() (of those among() accepts: one model's, for
        its quota) whose bytes add up to over_bytes.

        Fewer if every evictable entry together is not enough. Nothing is removed: the caller
        deletes each victim's file and then calls remove().
        """
        now = self.now()
        used_ones = _evictable_in(self._used, among)
        speculative_ones = _evictable_in(self._speculative, among)
        used, speculative = next(used_ones, None), next(speculative_ones, None)
        victims: list[EntryRecord] = []
        freed = 0
        while freed < over_bytes:
            if speculative is not None and (
                used is None or self.age(speculative, now) >= self.age(used, now)
            ):
                victim, speculative = speculative, next(speculative_ones, None)
            elif used is not None:
                victim, used = used, next(used_ones, None)
            else:
                break
            victims.append(victim)
            freed += victim.nbytes
        return victims


def _evictable_in(
    order: Mapping[EntryRecord, None], among: Callable[[EntryRecord], bool] | None
) -> Iterator[EntryRecord]:
    """The entries of order, in order, that eviction may take now (and among() accepts)."""
    return (r for r in order if evictable(r) and (among is None or among(r)))


class CostPolicy:
    """What saves the least prefill per byte goes first, with ageing so nothing lives forever.

    An entry's worth is the prefill it saves per byte it holds: its tokens times what a token
    of prefill costs its identity (prefill_cost(identity digest), seconds as the engines
    report them: a token of a 70B model is worth more than one of a 1B model), over its bytes
    (a quantized or sliding-window cache holds more prompt per byte), divided by 1 + its time
    since last use (or since it was made) in HALF_LIFE units: an entry unused for an hour is
    worth half as much, for a day a twenty-fifth. Pending and leased entries are skipped as
    LruPolicy does. A prefill checkpoint not used since the daemon started (used_at 0) is
    worth PREFILL_CHECKPOINT_DISCOUNT times less than a whole entry of the same tokens, bytes
    and idle time (the module's rule). An entry's bytes
    are those it would take stored alone, its shared blocks included (logical_bytes):
    counting only its own file would rank a manifest with a short tail above its siblings,
    though evicting any of them leaves the shared blocks to the rest.

    A selection samples SAMPLE entries at random and takes the least worth among the
    evictable ones, as Redis approximates LRU: each victim costs O(SAMPLE), never a sort of
    the tier; a tier of SAMPLE entries or fewer is ranked exactly.
    """

    SAMPLE: Final = 64
    HALF_LIFE: Final = 3600.0  # seconds of disuse that halve an entry's worth

    def __init__(
        self,
        prefill_cost: Callable[[str], float] = lambda digest: 1.0,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
    ) -> None:
        self._records: list[EntryRecord] = []
        self._where: dict[EntryRecord, int] = {}
        self._prefill_cost = prefill_cost
        self._clock = clock
        self._random = random.Random(seed)

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: EntryRecord) -> None:
        if record in self._where:
            raise ValueError(f"entry {record.id} is already tracked")
        self._where[record] = len(self._records)
        self._records.append(record)

    def remove(self, record: EntryRecord) -> None:
        index = self._where.pop(record)
        last = self._records.pop()
        if last is not record:  # the last one fills the hole: O(1)
            self._records[index] = last
            self._where[last] = index

    def touch(self, record: EntryRecord) -> None:
        if record not in self._where:
            raise KeyError(record.id)  # uses are timed on the record itself (used_at)

    def worth(self, record: EntryRecord, now: float) -> float:
        idle = max(0.0, now - (record.used_at or record.created))
        saved = record.token_count * self._prefill_cost(record.digest)
        if record.prefill_checkpoint and not record.used_at:
            saved /= PREFILL_CHECKPOINT_DISCOUNT
        return saved / max(1, record.logical_bytes) / (1 + idle / self.HALF_LIFE)

    def select_victims(
        self, over_bytes: int, among: Callable[[EntryRecord], bool] | None = None
    ) -> list[EntryRecord]:
        """Among() narrows the choice to some entries (one model's, for its quota): those
        are ranked exactly, not sampled."""
        now = self._clock()
        victims: list[EntryRecord] = []
        chosen: set[EntryRecord] = set()
        freed = 0
        while freed < over_bytes:
            pool = self._sample() if among is None else filter(among, self._records)
            candidates = [r for r in pool if evictable(r) and r not in chosen]
            if not candidates:
                break
            victim = min(candidates, key=lambda r: self.worth(r, now))
            victims.append(victim)
            chosen.add(victim)
            freed += victim.nbytes
        return victims

    def _sample(self) -> list[EntryRecord]:
        if len(self._records) <= self.SAMPLE:
            return self._records
        return self._random.sample(self._records, self.SAMPLE)


# The eviction policies by setting value (the eviction_policy setting chooses one), each made
# from what a token of prefill costs per identity (Telemetry.prefill_cost): lru ignores it.
EVICTION_POLICIES: Mapping[str, Callable[[Callable[[str], float]], EvictionPolicy]] = {
    "lru": lambda prefill_cost: LruPolicy(),
    "cost": CostPolicy,
}


class Holdings(Protocol):
    """What eviction reads and changes of the tier's catalog (kvd.store.catalog.Catalog)."""

    policy: EvictionPolicy
    counters: Counters

    @property
    def total_bytes(self) -> int: ...

    @property
    def records(self) -> Mapping[str, EntryRecord]: ...

    def disk_free(self) -> int: ...

    def identity_bytes(self, digest: str) -> int: ...

    def of_identity(self, digest: str) -> list[EntryRecord]: ...

    def drop(self, record: EntryRecord) -> int: ...


class Eviction:
    """The rules above applied to one tier's catalog, under its cap and floor."""

    def __init__(self, catalog: Holdings, max_bytes: int | None, min_free: int) -> None:
        self._catalog = catalog
        self._max_bytes = max_bytes
        self._min_free = min_free

    def to_cap(self, floor: int | None = None) -> None:
        """Hold the byte cap and the free-disk floor (floor: a higher one, for a put's room),
        in the policy's order."""
        catalog, min_free = self._catalog, self._min_free if floor is None else floor

        def over() -> int:
            try:
                free = catalog.disk_free()
            except OSError:
                free = min_free  # unknown: act on the cap alone
            return bytes_over(catalog.total_bytes, self._max_bytes, free, min_free)

        self._while(over)

    def within(self, digest: str, over_bytes: int) -> None:
        """Evict over_bytes of one identity's entries, in the policy's order (its quota)."""
        if over_bytes <= 0:
            return
        catalog = self._catalog
        target = catalog.identity_bytes(digest) - over_bytes

        def mine(record: EntryRecord) -> bool:
            return record.digest == digest

        self._while(lambda: catalog.identity_bytes(digest) - target, mine)

    def by_request(
        self, entry: str | None, digest: str | None, everything: bool
    ) -> tuple[int, int]:
        """Evict an entry by id, an identity's (by its digest) or all of them, pending ones
        left to the queue; (count, bytes freed). NOT_FOUND for an id the tier lacks."""
        records = self._catalog.records
        if entry is not None:
            if entry not in records:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no entry {entry}")
            victims = [records[entry]]
        elif digest is not None:
            victims = self._catalog.of_identity(digest)
        else:
            victims = list(records.values()) if everything else []
        count = freed = 0
        for record in victims:
            if not record.durable:
                continue  # the queue owns it; flush first to evict it
            count += 1
            freed += self._evict(record)
        return count, freed

    def _while(
        self, over: Callable[[], int], among: Callable[[EntryRecord], bool] | None = None
    ) -> None:
        """Evict in the policy's order while over() is positive, measuring after each victim."""
        while (need := over()) > 0:
            victims = self._catalog.policy.select_victims(need, among)
            if not victims:
                return
            for victim in victims:
                self._evict(victim)
                if over() <= 0:
                    return

    def _evict(self, record: EntryRecord) -> int:
        """Drop an entry by eviction, counted as such; the bytes it freed."""
        counters = self._catalog.counters
        counters.evictions += 1
        freed = self._catalog.drop(record)
        counters.evicted_bytes += freed
        return freed
