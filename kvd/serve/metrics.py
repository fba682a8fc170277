"""The status report as Prometheus metrics: `kvctl metrics` and the daemon's /metrics.

A collector over one status dict (status.status_report's): every figure a gauge or a
counter, per identity with an `identity` label (and `name`, `model_id`, `namespace` when the
status names them); restore latencies also as histograms, in buckets that are the same on every
daemon (so that a fleet's add up). Figures the status lacks (an older daemon) are left out,
not reported as zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Status = Mapping[str, Any]

# (status key, metric name, help); counters are exposed with the suffix _total.
GAUGES = (
    ("entries", "kvd_entries", "entries in the tier"),
    ("bytes", "kvd_bytes", "bytes of the tier's entries"),
    ("max_bytes", "kvd_max_bytes", "byte cap of the tier"),
    ("min_free_bytes", "kvd_min_free_bytes", "free-disk floor the tier never eats into"),
    ("disk_free_bytes", "kvd_disk_free_bytes", "free bytes on the tier's disk"),
    ("leased_entries", "kvd_leased_entries", "entries leased to a client now"),
    ("staged_bytes", "kvd_staged_bytes", "bytes of puts begun and not committed"),
    ("staged_puts", "kvd_staged_puts", "puts begun and not committed"),
    ("bytes_written_24h", "kvd_written_24h_bytes", "bytes written in the last 24 hours"),
    ("unique_bytes", "kvd_unique_bytes", "bytes on disk: entry files and unique blocks"),
    ("logical_bytes", "kvd_logical_bytes", "bytes the entries would take without shared blocks"),
    ("deleting_bytes", "kvd_deleting_bytes", "bytes of files taken out, not yet unlinked"),
    ("leased_bytes", "kvd_leased_bytes", "bytes eviction cannot free while leases last"),
    ("identities_left_out", "kvd_identities_left_out", "identities the status does not list"),
    ("prefill_saved_s_24h", "kvd_prefill_saved_24h_seconds", "prefill restores saved in 24 h"),
    (
        "prefill_saved_estimated_s_24h",
        "kvd_prefill_saved_estimated_24h_seconds",
        "of the prefill saved in 24 h, the part valued at the fallback cost",
    ),
)
COUNTERS = (
    ("hits", "kvd_hits", "lookups that found an entry"),
    ("engine_held", "kvd_engine_held", "lookups the engine's memory served as well: not misses"),
    ("misses", "kvd_misses", "lookups that found none the engine could use"),
    ("evictions", "kvd_evictions", "entries evicted"),
    ("evicted_bytes", "kvd_evicted_bytes", "bytes evicted"),
    ("superseded", "kvd_superseded", "entries replaced by a longer one"),
    ("duplicates", "kvd_duplicates", "puts of an entry already held"),
    ("quarantined", "kvd_quarantined", "files moved to quarantine"),
    ("abandoned_puts", "kvd_abandoned_puts", "puts aborted or expired"),
    ("deleted_files", "kvd_deleted_files", "files unlinked by the deleter"),
    ("bytes_written", "kvd_written_bytes", "bytes written to the tier"),
    ("leases_expired", "kvd_leases_expired", "leases ended by the lease age limit"),
    ("restores", "kvd_restores", "restores the engines reported"),
    ("tokens_restored", "kvd_tokens_restored", "prefill tokens restored, not computed"),
    ("dedup_saved_bytes", "kvd_dedup_saved_bytes", "bytes not written: blocks already held"),
    ("engine_dropped", "kvd_engine_dropped", "snapshots engines dropped unsent: backlog full"),
    ("engine_dropped_bytes", "kvd_engine_dropped_bytes", "bytes of the snapshots engines dropped"),
    ("prefill_saved_s", "kvd_prefill_saved_seconds", "prefill restores saved: tokens x cost"),
    (
        "prefill_saved_estimated_s",
        "kvd_prefill_saved_estimated_seconds",
        "of the prefill saved, the part valued at the fallback cost (not measured)",
    ),
)
WRITEBACK_GAUGES = (
    ("pending_bytes", "kvd_writeback_pending_bytes", "bytes waiting to be written"),
    ("pending_count", "kvd_writeback_pending_entries", "entries waiting to be written"),
    ("max_bytes", "kvd_writeback_max_bytes", "write-behind queue cap"),
)
WRITEBACK_COUNTERS = (
    ("stored", "kvd_writeback_stored", "entries written and made durable"),
    ("dropped", "kvd_writeback_dropped", "pending entries dropped or cancelled"),
    ("failed", "kvd_writeback_failed", "entries whose write failed"),
    ("refused", "kvd_writeback_refused", "puts refused at commit (queue full)"),
    ("refused_at_begin", "kvd_writeback_refused_at_begin", "puts refused at put_begin"),
)
KEPT_GAUGES = (
    ("telemetry_identities", "kvd_kept_telemetry_identities", "identities with telemetry kept"),
    ("tickets", "kvd_kept_tickets", "tickets pending or settled and kept for late waits"),
    ("sightings", "kvd_kept_sightings", "first sightings the admission policy keeps"),
)
KEPT_COUNTERS = (
    ("telemetry_forgotten", "kvd_telemetry_forgotten", "identities whose telemetry was forgotten"),
)
IDENTITY_GAUGES = (
    ("entries", "kvd_identity_entries", "entries of one identity"),
    ("bytes", "kvd_identity_bytes", "bytes of one identity's entries"),
    ("block_bytes", "kvd_identity_block_bytes", "bytes of one identity's shared blocks"),
    ("prefill_saved_s_24h", "kvd_identity_prefill_saved_24h_seconds", "prefill saved in 24 h"),
    (
        "prefill_saved_estimated_s_24h",
        "kvd_identity_prefill_saved_estimated_24h_seconds",
        "of the prefill saved in 24 h, the part valued at the fallback cost",
    ),
)
IDENTITY_COUNTERS = (
    ("hits", "kvd_identity_hits", "restores of one identity the engines reported"),
    ("engine_held", "kvd_identity_engine_held", "lookups the engine's memory served as well"),
    ("restores", "kvd_identity_restores", "restores of one identity, with their timing"),
    ("tokens_restored", "kvd_identity_tokens_restored", "prefill tokens restored, not computed"),
    ("bytes_written", "kvd_identity_written_bytes", "bytes written for one identity"),
    ("dedup_saved_bytes", "kvd_identity_dedup_saved_bytes", "bytes not written: blocks held"),
    ("engine_dropped", "kvd_identity_engine_dropped", "snapshots engines dropped unsent"),
    ("engine_dropped_bytes", "kvd_identity_engine_dropped_bytes", "bytes engines dropped"),
    ("prefill_saved_s", "kvd_identity_prefill_saved_seconds", "prefill restores saved"),
    (
        "prefill_saved_estimated_s",
        "kvd_identity_prefill_saved_estimated_seconds",
        "of the prefill saved, the part valued at the fallback cost (not measured)",
    ),
)
# The status's "remote" section (kvd.remote.remote.Remote.status), when the remote tier is on.
REMOTE_GAUGES = (
    ("pending_uploads", "kvd_remote_pending_uploads", "entries waiting to upload their blocks"),
    ("pending_bytes", "kvd_remote_pending_bytes", "bytes of blocks waiting to upload"),
    ("journal_uploads", "kvd_remote_journal_uploads", "uploads the upload journal holds"),
    ("journal_bytes", "kvd_remote_journal_bytes", "the upload journal's size"),
    ("restart_uploads", "kvd_remote_restart_uploads", "uploads pending at the last start"),
    ("restart_reoffered", "kvd_remote_restart_reoffered", "of them, offered again"),
    ("restart_gone", "kvd_remote_restart_gone", "of them, dropped: their entry gone"),
)
REMOTE_COUNTERS = (
    ("uploaded_blocks", "kvd_remote_uploaded_blocks", "blocks written to the remote bucket"),
    ("uploaded_bytes", "kvd_remote_uploaded_bytes", "bytes written to the remote bucket"),
    ("already_there_blocks", "kvd_remote_already_there_blocks", "blocks already in the bucket"),
    ("upload_drops", "kvd_remote_upload_drops", "uploads dropped: queue cap, store down, error"),
    ("upload_dropped_bytes", "kvd_remote_upload_dropped_bytes", "bytes of the uploads dropped"),
    ("not_shareable", "kvd_remote_not_shareable", "entries kept local: checkpoints, hybrids"),
    ("layout_mismatch", "kvd_remote_layout_mismatch", "entries unlike their stored layout"),
    ("downloaded_blocks", "kvd_remote_downloaded_blocks", "blocks fetched from the bucket"),
    ("downloaded_bytes", "kvd_remote_downloaded_bytes", "bytes fetched from the bucket"),
    ("hits", "kvd_remote_hits", "fetches from the bucket committed"),
    ("abandoned_requests", "kvd_remote_abandoned_requests", "store requests cut off mid-way"),
)
REMOTE_STATES = ("ok", "degraded", "down")
# The status's "prefill_checkpoints" map, of the tier (kvd_prefill_checkpoint_*) and of each
# identity (kvd_identity_prefill_checkpoint_*, labelled as the other identity metrics).
PREFILL_CHECKPOINT_GAUGES = (
    ("entries", "prefill_checkpoint_entries", "prefill checkpoints held"),
    ("bytes", "prefill_checkpoint_bytes", "bytes of the prefill checkpoints' files"),
)
PREFILL_CHECKPOINT_COUNTERS = (
    ("hits", "prefill_checkpoint_hits", "lookups answered with a prefill checkpoint"),
    ("restored_tokens", "prefill_checkpoint_restored_tokens", "prompt tokens those matched"),
)
# (status key, metric name, help): {p50, p95, p99} in milliseconds, exposed in seconds.
IDENTITY_LATENCIES = (
    ("restore_ms", "kvd_identity_restore_seconds", "restore latency of one identity"),
    ("store_ms", "kvd_identity_store_seconds", "store latency of one identity (engine side)"),
)
# Labels beside `identity`, when the status has them: `name` (kvd.identity_names) may change
# as identities of its model come and go; the digest never does.
IDENTITY_NAMES = ("name", "model_id", "namespace")
QUANTILES = {"p50": "0.5", "p95": "0.95", "p99": "0.99"}


def _number(value: object) -> bool:
    """A value to expose: an int, or a finite float (an older daemon's status may hold inf)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _flat(table: Mapping[str, Any], gauges: Any, counters: Any) -> Iterator[Metric]:
    for key, name, text in gauges:
        if _number(table.get(key)):
            yield GaugeMetricFamily(name, text, value=table[key])
    for key, name, text in counters:
        if _number(table.get(key)):
            yield CounterMetricFamily(name, text, value=table[key])


def _buckets(bounds: object, figures: Mapping[str, Any]) -> list[tuple[str, float]] | None:
    """The (le, cumulative count) of figures' restore latency buckets, in seconds, +Inf last
    (the restores); None from a daemon that keeps none."""
    counts, total = figures.get("restore_ms_buckets"), figures.get("restores")
    if not isinstance(bounds, list) or not isinstance(counts, list) or not _number(total):
        return None
    if len(counts) != len(bounds) or not _number(figures.get("restore_ms_sum")):
        return None
    found = [(repr(bound / 1000), count) for bound, count in zip(bounds, counts, strict=True)]
    return [*found, ("+Inf", total)]


def _identity_metrics(identities: list[Mapping[str, Any]], bounds: object) -> Iterator[Metric]:
    names = [n for n in IDENTITY_NAMES if any(n in i for i in identities)]
    labels = ["identity", *names]

    def values(identity: Mapping[str, Any]) -> list[str]:
        return [str(identity["identity"]), *(str(identity.get(n) or "") for n in names)]

    def labelled(
        table_of: Callable[[Mapping[str, Any]], Mapping[str, Any]], gauges: Any, counters: Any
    ) -> Iterator[Metric]:
        for make, figures in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for key, name, text in figures:
                family = make(name, text, labels=labels)
                for i in identities:
                    table = table_of(i)
                    if _number(table.get(key)):
                        family.add_metric(values(i), table[key])
                yield family

    families: list[Metric] = [
        *labelled(lambda i: i, IDENTITY_GAUGES, IDENTITY_COUNTERS),
        *labelled(
            lambda i: i.get("prefill_checkpoints") or {},
            _named("kvd_identity_", PREFILL_CHECKPOINT_GAUGES),
            _named("kvd_identity_", PREFILL_CHECKPOINT_COUNTERS),
        ),
    ]
    misses = CounterMetricFamily(
        "kvd_identity_misses",
        "lookups of one identity the engines reported as misses, by reason",
        labels=[*labels, "reason"],
    )
    families.append(misses)
    for i in identities:
        by_reason = i.get("misses_by_reason")
        if not isinstance(by_reason, Mapping):  # a daemon that counts no reasons
            by_reason = {"": i.get("misses")}
        for reason, count in by_reason.items():
            if _number(count):
                misses.add_metric([*values(i), str(reason)], count)
    speed = GaugeMetricFamily(
        "kvd_identity_restore_bytes_per_second", "restore throughput of one identity", labels=labels
    )
    families.append(speed)
    for i in identities:
        if _number(i.get("restore_gb_per_s")):
            speed.add_metric(values(i), i["restore_gb_per_s"] * 1e9)
    cost = GaugeMetricFamily(
        "kvd_identity_prefill_seconds_per_token",
        "prefill cost of one identity, as its engines measured it",
        labels=labels,
    )
    families.append(cost)
    for i in identities:
        if _number(i.get("prefill_ms_per_token")):
            cost.add_metric(values(i), i["prefill_ms_per_token"] / 1000)
    restores = HistogramMetricFamily(
        "kvd_identity_restore_duration_seconds", "restore latency of one identity", labels=labels
    )
    families.append(restores)
    for i in identities:
        buckets = _buckets(bounds, i)
        if buckets is not None:
            restores.add_metric(values(i), buckets, i["restore_ms_sum"] / 1000)
    for key, name, text in IDENTITY_LATENCIES:
        latency = GaugeMetricFamily(name, f"{text}, by quantile", labels=[*labels, "quantile"])
        families.append(latency)
        for i in identities:
            summary = i.get(key)
            for part, quantile in QUANTILES.items():
                if isinstance(summary, Mapping) and _number(summary.get(part)):
                    latency.add_metric([*values(i), quantile], summary[part] / 1000)
    yield from (family for family in families if family.samples)


def _remote_metrics(remote: Mapping[str, Any]) -> Iterator[Metric]:
    """The remote tier's figures: its state (1 for the one it is in), its counts, its misses
    by reason and its fetch rate."""
    yield from _flat(remote, REMOTE_GAUGES, REMOTE_COUNTERS)
    state = GaugeMetricFamily(
        "kvd_remote_state", "the remote bucket's health (1: the state it is in)", labels=["state"]
    )
    for name in REMOTE_STATES:
        state.add_metric([name], float(remote.get("state") == name))
    yield state
    misses = CounterMetricFamily(
        "kvd_remote_misses", "remote probes and fetches that restored nothing", labels=["reason"]
    )
    for reason, count in (remote.get("misses_by_reason") or {}).items():
        if _number(count):
            misses.add_metric([str(reason)], count)
    yield misses
    if _number(remote.get("restore_gbps_p50")):
        yield GaugeMetricFamily(
            "kvd_remote_restore_bytes_per_second",
            "median speed of the recent fetches from the bucket (probe to commit)",
            value=remote["restore_gbps_p50"] * 1e9,
        )


def _named(prefix: str, figures: Any) -> list[tuple[str, str, str]]:
    """(key, prefix + name, help) of each of figures."""
    return [(key, prefix + name, text) for key, name, text in figures]


def status_metrics(status: Status) -> Iterator[Metric]:
    """Every metric of one status report."""
    yield from _flat(status, GAUGES, COUNTERS)
    yield from _flat(
        status.get("prefill_checkpoints", {}),
        _named("kvd_", PREFILL_CHECKPOINT_GAUGES),
        _named("kvd_", PREFILL_CHECKPOINT_COUNTERS),
    )
    yield from _flat(status.get("writeback", {}), WRITEBACK_GAUGES, WRITEBACK_COUNTERS)
    yield from _flat(status.get("kept", {}), KEPT_GAUGES, KEPT_COUNTERS)
    bounds = status.get("restore_ms_bounds")
    buckets = _buckets(bounds, status)
    if buckets is not None:
        yield HistogramMetricFamily(
            "kvd_restore_duration_seconds",
            "restore latency, every identity's (the engines' reports)",
            buckets=buckets,
            sum_value=status["restore_ms_sum"] / 1000,
        )
    yield from _identity_metrics(status.get("identities", []), bounds)
    if isinstance(status.get("remote"), Mapping):
        yield from _remote_metrics(status["remote"])
    clients = status.get("clients")
    if isinstance(clients, list):
        yield GaugeMetricFamily("kvd_clients", "client processes connected", value=len(clients))
        connections: list[Any] = [c.get("connections") for c in clients if isinstance(c, Mapping)]
        if connections and all(_number(n) for n in connections):  # a daemon that counts them
            yield GaugeMetricFamily(
                "kvd_client_connections", "connections of the clients", value=sum(connections)
            )
    daemon = status.get("daemon", {})
    if _number(daemon.get("rss_bytes")):
        yield GaugeMetricFamily(
            "kvd_resident_memory_bytes", "the daemon's resident memory", value=daemon["rss_bytes"]
        )
    if _number(daemon.get("uptime_s")):
        uptime = daemon["uptime_s"]
        yield GaugeMetricFamily("kvd_uptime_seconds", "seconds since start", value=uptime)
    info = {"version": str(daemon.get("version", ""))}
    if "policy" in status.get("writeback", {}):
        info["writeback_policy"] = str(status["writeback"]["policy"])
    yield InfoMetricFamily("kvd", "the daemon's version and write-behind policy", value=info)


class StatusCollector(Collector):
    """Metrics of a fresh status report at each collection."""

    def __init__(self, status: Callable[[], Status]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        return status_metrics(self._status())


def exposition(status: Callable[[], Status]) -> bytes:
    """The Prometheus text format of one status report."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return generate_latest(registry)
