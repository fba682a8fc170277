"""Per-identity telemetry: what the daemon sees of each model's traffic, and what the engines
report about their restores and stores. Pure state (no I/O, no clock of its own): callers
pass the time.

- Lookups: hits, engine-held (the engine's own memory had as much of the prompt as the tier
  did: miss_reasons' "below min_tokens", not a miss of the tier), and misses by reason ("no
  entry", "kv differs"...), counted by the daemon, per identity and for the tier. A hit the
  engine could not use is reported back with the release as a miss of the engine's reason
  (damaged, model, codec...).
- Restores: latency (a log-scale histogram: percentiles in constant memory, however many, and
  the same samples in EXPORT_BOUNDS_MS, a few fixed buckets that the metrics expose so that
  several daemons' histograms add up), bytes read, tokens restored (prefill the engines did
  not compute).
- Prefill saved: each restore's tokens times the identity's measured prefill cost at that
  moment, in seconds, since start and over the last 24 hours; a restore of an identity no
  engine measured yet is valued at the fallback cost (prefill_cost below) and counted apart,
  as an estimate.
- Stores: bytes written per identity and for the whole tier in the last 24 hours (a ring of
  per-minute sums), and the engines' time from handing caches over to the commit.
- Prefill checkpoints: lookups the daemon answered with one (hits), and the prompt tokens
  those matched (restored_tokens), per identity and for the tier.
- Engine drops: snapshots the engines dropped before sending them (their backlog was full)
  and their bytes, as they report them with their next commit.
- Prefill cost: the seconds a token of prefill takes, as the identity's engines measure it
  and report with each put; a running mean (each report weighs PREFILL_REPORT_WEIGHT), so one
  slow prefill (a model still loading, a busy GPU) moves it only a little. The cost eviction
  policy weighs an entry's tokens by it (prefill_cost): an identity no engine reported for
  weighs as the mean of those reported, and with no report at all every token weighs
  DEFAULT_PREFILL_COST, so that only reported differences between models rank them.

Each identity's telemetry keeps the Identity a request or an entry's header named last (its
names for people: model id, namespace, traits; status derives its name from them), and the
digests are indexed by model id (a miss looks at the other identities of its model).

Memory: an identity is whatever a client names, so the telemetry of identities that hold no
entry (a lookup's, a refused put's) is kept for at most IDLE_IDENTITIES of them, the least
recently seen forgotten first (their counts start again at zero if seen again); identities
with entries are kept while they have any. Miss reasons are the engines' words: at most
MISS_REASONS of them per identity, later ones counted as OTHER_REASON. The tier-wide totals
(restores, tokens restored, prefill checkpoint hits) outlive what is forgotten.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from kvd_protocol.identity import Identity
from kvd_protocol.messages import DropReport, RestoreReport

from kvd import identity_names

# Histogram buckets grow by this factor from FIRST_BOUND_MS: a percentile is within ~12% of
# the truth, and 100 buckets cover 0.05 ms to over 3 hours.
GROWTH: Final = 1.25
FIRST_BOUND_MS: Final = 0.05
BUCKETS: Final = 100
# The buckets the metrics expose (upper bounds, ms; +Inf beyond): the same on every daemon.
EXPORT_BOUNDS_MS: Final = (
    *(1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0),
    *(1000.0, 2500.0, 5000.0, 10_000.0, 30_000.0, 60_000.0),
)
DAY_SECONDS: Final = 86_400
MINUTE: Final = 60
IDENTITY_DAY_SLOT: Final = 600  # an identity's 24 h sums, by ten minutes: 144 slots at most
PREFILL_REPORT_WEIGHT: Final = 0.2
DEFAULT_PREFILL_COST: Final = 1e-3  # seconds per token: ~1k tokens/s, a mid-size model's prefill
IDLE_IDENTITIES: Final = 1024  # identities with no entry whose telemetry is kept (~2.6 KB each)
MISS_REASONS: Final = 16  # distinct miss reasons counted per identity, OTHER_REASON included
OTHER_REASON: Final = "other"


class LatencyHistogram:
    """Milliseconds in log-scale buckets; percentile() answers the bucket's geometric middle
    (within ~12% of the truth). exported: the counts in EXPORT_BOUNDS_MS' buckets."""

    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.exported = [0] * (len(EXPORT_BOUNDS_MS) + 1)  # the last: beyond every bound
        self.count = 0
        self.total_ms = 0.0

    def add(self, ms: float) -> None:
        index = 0 if ms <= FIRST_BOUND_MS else math.ceil(math.log(ms / FIRST_BOUND_MS, GROWTH))
        self.counts[min(index, BUCKETS - 1)] += 1
        self.exported[bisect.bisect_left(EXPORT_BOUNDS_MS, ms)] += 1
        self.count += 1
        self.total_ms += ms

    def buckets(self) -> list[int]:
        """The samples at or under each of EXPORT_BOUNDS_MS (cumulative, as Prometheus has
        them); count is the +Inf bucket's."""
        return list(itertools.accumulate(self.exported[:-1]))

    def percentile(self, share: float) -> float | None:
        """The value under which share (0..1) of the samples fall; None with no sample."""
        if not self.count:
            return None
        wanted = share * self.count
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if count and seen >= wanted:
                upper = FIRST_BOUND_MS * GROWTH**index
                return upper if index == 0 else upper / math.sqrt(GROWTH)
        raise AssertionError("the counts add up to count")

    def summary(self) -> dict[str, float | None]:
        return {name: _rounded(self.percentile(p)) for name, p in PERCENTILES.items()}


PERCENTILES: Final = {"p50": 0.50, "p95": 0.95, "p99": 0.99}


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


class DaySum:
    """A sum over the last 24 hours, kept as sums per slot of slot seconds (a minute: at most
    1440 of them); a sample leaves it when its whole slot is over 24 hours old."""

    def __init__(self, slot: int = MINUTE) -> None:
        self._slot = slot
        self._slots: deque[list[float]] = deque()  # [slot, sum], oldest first

    def add(self, amount: float, now: float) -> None:
        slot = now // self._slot
        if self._slots and self._slots[-1][0] == slot:
            self._slots[-1][1] += amount
        else:
            self._slots.append([slot, amount])
        self._forget(now)

    def total(self, now: float) -> float:
        self._forget(now)
        return sum(amount for _, amount in self._slots)

    def _forget(self, now: float) -> None:
        oldest = (now - DAY_SECONDS) // self._slot
        while self._slots and self._slots[0][0] <= oldest:
            self._slots.popleft()


class PrefillSaved:
    """Seconds of prefill the restores saved: since start and in the last 24 hours, and of
    each the part estimated (valued at the fallback cost: no engine had measured it)."""

    def __init__(self, slot: int) -> None:
        self.seconds = 0.0
        self.estimated = 0.0
        self._day = DaySum(slot)
        self._estimated_day = DaySum(slot)

    def add(self, seconds: float, *, estimated: bool, now: float) -> None:
        self.seconds += seconds
        self._day.add(seconds, now)
        if estimated:
            self.estimated += seconds
            self._estimated_day.add(seconds, now)

    def report(self, now: float) -> dict[str, float]:
        return {
            "prefill_saved_s": round(self.seconds, 3),
            "prefill_saved_s_24h": round(self._day.total(now), 3),
            "prefill_saved_estimated_s": round(self.estimated, 3),
            "prefill_saved_estimated_s_24h": round(self._estimated_day.total(now), 3),
        }


NOTHING_SAVED: Final = PrefillSaved(IDENTITY_DAY_SLOT)  # the report of an identity never restored


@dataclass
class IdentityTelemetry:
    # The identity as a request or an entry's header named it last (its names for people);
    # None for one known by digest only.
    identity: Identity | None = None
    hits: int = 0
    engine_held: int = 0  # lookups the engine's memory served as well as the tier could
    misses: Counter[str] = field(default_factory=Counter)
    restores: int = 0
    restore_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    restored_bytes: int = 0
    tokens_restored: int = 0
    bytes_written: int = 0
    dedup_saved_bytes: int = 0  # bytes of blocks held at put_begin, so never written
    stores_reported: int = 0
    store_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    prefill_cost: float | None = None  # seconds per token, as reported; None: never
    engine_dropped: int = 0  # snapshots the engines dropped unsent, as they reported
    engine_dropped_bytes: int = 0
    prefill_checkpoint_hits: int = 0  # lookups answered with a prefill checkpoint
    prefill_checkpoint_restored_tokens: int = 0  # the prompt tokens those matched
    saved: PrefillSaved | None = None  # made at the first restore (most identities have none)

    @property
    def model_id(self) -> str:
        return "" if self.identity is None else self.identity.model_id

    @property
    def namespace(self) -> str:
        return "" if self.identity is None else self.identity.namespace

    def report(self, now: float) -> dict[str, object]:
        seconds = self.restore_ms.total_ms / 1000
        return {
            "model_id": self.model_id,
            "namespace": self.namespace,
            "traits": "" if self.identity is None else self.identity.traits,
            "runtime": "" if self.identity is None else self.identity.runtime,
            "hits": self.hits,
            "engine_held": self.engine_held,
            "misses": sum(self.misses.values()),
            "misses_by_reason": dict(sorted(self.misses.items())),
            "restores": self.restores,
            "restore_ms": self.restore_ms.summary(),
            "restore_ms_buckets": self.restore_ms.buckets(),
            "restore_ms_sum": round(self.restore_ms.total_ms, 3),
            "restore_gb_per_s": round(self.restored_bytes / seconds / 1e9, 3) if seconds else None,
            "tokens_restored": self.tokens_restored,
            "bytes_written": self.bytes_written,
            "dedup_saved_bytes": self.dedup_saved_bytes,
            "store_ms": self.store_ms.summary(),
            "engine_dropped": self.engine_dropped,
            "engine_dropped_bytes": self.engine_dropped_bytes,
            "prefill_ms_per_token": (
                None if self.prefill_cost is None else round(self.prefill_cost * 1000, 6)
            ),
            **(self.saved or NOTHING_SAVED).report(now),
        }


class Telemetry:
    """Every identity's telemetry, by digest, least recently seen first, and the tier's bytes
    written in the last day. has_entries(digest): whether the identity has entries (then it is
    never forgotten); by default none has."""

    def __init__(self, has_entries: Callable[[str], bool] = lambda digest: False) -> None:
        self.identities: OrderedDict[str, IdentityTelemetry] = OrderedDict()
        # model id -> the digests of its identities known here (a miss's look at the others)
        self.by_model: dict[str, set[str]] = {}
        self._changes = 0  # identities learnt, renamed or forgotten: names() recomputes then
        self._named: tuple[object, dict[str, str]] = (None, {})
        self.written_today = DaySum()
        self.restores = 0  # tier-wide: outlive the identities forgotten
        self.restore_ms = LatencyHistogram()
        self.saved = PrefillSaved(MINUTE)
        self.engine_held = 0
        self.misses: Counter[str] = Counter()  # by reason, MISS_REASONS of them at most
        self.tokens_restored = 0
        self.engine_dropped = 0
        self.engine_dropped_bytes = 0
        self.prefill_checkpoint_hits = 0
        self.prefill_checkpoint_restored_tokens = 0
        self.forgotten = 0  # identities whose telemetry was forgotten
        self._has_entries = has_entries
        self._reported_costs: dict[str, float] = {}  # digest -> its prefill cost, if reported
        self._cost_sum = 0.0
        self._mean_cost = DEFAULT_PREFILL_COST
        self._sweep_at = IDLE_IDENTITIES  # size at which idle identities are next forgotten

    def of(self, digest: str) -> IdentityTelemetry:
        found = self.identities.get(digest)
        if found is None:
            found = self.identities[digest] = IdentityTelemetry()
            if len(self.identities) > self._sweep_at:
                self._forget_idle()
        else:
            self.identities.move_to_end(digest)
        return found

    def _forget_idle(self) -> None:
        """Forget the least recently seen identities with no entry beyond IDLE_IDENTITIES.
        O(identities), run once every IDLE_IDENTITIES new ones at most."""
        idle = [digest for digest in self.identities if not self._has_entries(digest)]
        for digest in idle[: max(0, len(idle) - IDLE_IDENTITIES)]:
            self._unlist(digest, self.identities.pop(digest).identity)
            self._changes += 1
            cost = self._reported_costs.pop(digest, None)
            if cost is not None:
                self._cost_sum -= cost
            self.forgotten += 1
        self._mean_costs()
        self._sweep_at = len(self.identities) + IDLE_IDENTITIES

    def seen(self, identity: Identity) -> IdentityTelemetry:
        """The telemetry of an identity a request named, with its names for people: the
        traits last said (an engine that says none leaves them as they were)."""
        digest = identity.digest()
        found = self.of(digest)
        known = found.identity
        if known is None:
            self.by_model.setdefault(identity.model_id, set()).add(digest)
        if known is not identity and (identity.traits or known is None or not known.traits):
            if known is None or known.traits != identity.traits:
                self._changes += 1
            found.identity = identity
        return found

    def names(self, digests: Iterable[str]) -> dict[str, str]:
        """The names of these identities (identity_names.names), by digest; computed again
        only when they or what the telemetry knows of them changed (a status at 2,000
        identities of one model spends 30 ms on them)."""
        wanted = frozenset(digests)
        key = (self._changes, wanted)
        if self._named[0] != key:
            known = self.identities
            named = identity_names.names(
                {d: None if d not in known else known[d].identity for d in wanted}
            )
            self._named = key, named
        return self._named[1]

    def _unlist(self, digest: str, identity: Identity | None) -> None:
        if identity is None:
            return
        digests = self.by_model.get(identity.model_id)
        if digests is not None:
            digests.discard(digest)
            if not digests:
                del self.by_model[identity.model_id]

    def lookup(self, identity: Identity, hit: bool, reason: str = "no entry") -> None:
        found = self.seen(identity)
        if hit:
            found.hits += 1
        else:
            _missed(found.misses, reason)
            _missed(self.misses, reason)

    def held_by_engine(self, identity: Identity) -> None:
        """A lookup whose engine had as much of the prompt in its memory as the tier did."""
        self.seen(identity).engine_held += 1
        self.engine_held += 1

    def prefill_checkpoint_hit(self, digest: str, matched: int) -> None:
        """A lookup answered with a prefill checkpoint, matched tokens of its prompt."""
        found = self.of(digest)
        found.prefill_checkpoint_hits += 1
        found.prefill_checkpoint_restored_tokens += matched
        self.prefill_checkpoint_hits += 1
        self.prefill_checkpoint_restored_tokens += matched

    def restored(self, digest: str, report: RestoreReport, now: float) -> None:
        """An engine's word on a hit it was leased: restored, or a miss after all."""
        found = self.of(digest)
        if report.miss is not None:
            # The daemon counted the hit the engine could not use (unless it has forgotten it).
            found.hits = max(0, found.hits - 1)
            _missed(found.misses, report.miss)
            _missed(self.misses, report.miss)
            return
        found.restores += 1
        found.restore_ms.add(report.ms)
        found.restored_bytes += report.bytes
        found.tokens_restored += report.tokens
        self.restores += 1
        self.restore_ms.add(report.ms)
        self.tokens_restored += report.tokens
        seconds = report.tokens * self.prefill_cost(digest)
        estimated = found.prefill_cost is None
        if found.saved is None:
            found.saved = PrefillSaved(IDENTITY_DAY_SLOT)
        found.saved.add(seconds, estimated=estimated, now=now)
        self.saved.add(seconds, estimated=estimated, now=now)

    def stored(self, digest: str, nbytes: int, now: float) -> None:
        self.of(digest).bytes_written += nbytes
        self.written_today.add(nbytes, now)

    def deduplicated(self, digest: str, nbytes: int) -> None:
        self.of(digest).dedup_saved_bytes += nbytes

    def store_reported(self, digest: str, ms: float) -> None:
        found = self.of(digest)
        found.stores_reported += 1
        found.store_ms.add(ms)

    def drops_reported(self, digest: str, report: DropReport) -> None:
        found = self.of(digest)
        found.engine_dropped += report.snapshots
        found.engine_dropped_bytes += report.bytes
        self.engine_dropped += report.snapshots
        self.engine_dropped_bytes += report.bytes

    def prefill_reported(self, identity: Identity, seconds_per_token: float) -> None:
        """A put named the identity, with the engine's measure of its prefill (finite and
        bounded: the protocol checks it); 0 (not measured) is ignored."""
        found = self.seen(identity)
        if not 0 < seconds_per_token < math.inf:
            return
        digest = identity.digest()
        previous = found.prefill_cost
        found.prefill_cost = (
            seconds_per_token
            if previous is None
            else previous + PREFILL_REPORT_WEIGHT * (seconds_per_token - previous)
        )
        self._cost_sum += found.prefill_cost - self._reported_costs.get(digest, 0.0)
        self._reported_costs[digest] = found.prefill_cost
        self._mean_costs()

    def _mean_costs(self) -> None:
        if not self._reported_costs:
            self._cost_sum, self._mean_cost = 0.0, DEFAULT_PREFILL_COST
        else:
            self._mean_cost = max(self._cost_sum, 0.0) / len(self._reported_costs)

    def prefill_cost(self, digest: str) -> float:
        """Seconds per token of prefill an entry of this identity saves (see the module)."""
        return self._reported_costs.get(digest, self._mean_cost)

    def report(self, now: float) -> dict[str, object]:
        """The tier's lookups, restores and prefill saved, beyond the forgotten identities."""
        return {
            "engine_held": self.engine_held,
            "misses_by_reason": dict(sorted(self.misses.items())),
            "restores": self.restores,
            "restore_ms": self.restore_ms.summary(),
            "restore_ms_bounds": list(EXPORT_BOUNDS_MS),
            "restore_ms_buckets": self.restore_ms.buckets(),
            "restore_ms_sum": round(self.restore_ms.total_ms, 3),
            "tokens_restored": self.tokens_restored,
            **self.saved.report(now),
        }


def _missed(misses: Counter[str], reason: str) -> None:
    """Count a miss by its reason, or as OTHER_REASON once MISS_REASONS - 1 others are named."""
    if reason not in misses and len(misses) >= MISS_REASONS - 1:
        reason = OTHER_REASON
    misses[reason] += 1
