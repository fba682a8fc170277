"""The tier's figures for the status report, gathered from its rooms' counts (the puts and
the entry checks hand theirs as dicts).

It fits in a frame whatever clients did: at most STATUS_IDENTITIES identities are listed (those
with the most bytes in the tier first, then the most recently seen), with a count of those left
out. Every figure is a count the rooms keep up as entries change: O(identities).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kvd.config import Config
from kvd.store.admission import Admission
from kvd.store.catalog import Catalog, IdentityCounts
from kvd.store.durability import disk_free
from kvd.store.leases import Leases
from kvd.store.telemetry import IdentityTelemetry, Telemetry
from kvd.store.tickets import Tickets
from kvd.store.writeback import WritebackQueue

STATUS_IDENTITIES: Final = 1000  # ~0.7 MB of a status's msgpack, well within a frame


def tier_report(
    *,
    config: Config,
    catalog: Catalog,
    puts: Mapping[str, int],
    queue: WritebackQueue[Any],
    telemetry: Telemetry,
    leases: Leases,
    checks: Mapping[str, int],
    tickets: Tickets,
    admission: Admission,
    retained: Mapping[str, int],
    started: float,
) -> dict[str, Any]:
    """Everything the status report says of the tier; of the daemon, how long it has served
    (since started) and where (the status report adds its process). puts: Puts.counts();
    checks: EntryChecks.counts(); retained: the bytes of the entries retained now, by
    identity (kvd.store.retention)."""
    counters, root = catalog.counters, catalog.dirs.root
    try:
        free = disk_free(root)
    except OSError:
        free = -1
    unique = catalog.total_bytes
    now = time.time()
    return {
        "entries": len(catalog),
        "bytes": unique,
        # Shared blocks (format v2): what the disk holds, what v1 files would hold, their
        # ratio, the blocks themselves, and the bytes puts did not write for blocks held.
        "unique_bytes": unique,
        "logical_bytes": catalog.logical_bytes,
        "dedup_ratio": round(catalog.logical_bytes / unique, 3) if unique else 1.0,
        "blocks": {"count": len(catalog.block_store), "bytes": catalog.block_store.bytes},
        "dedup_saved_bytes": puts["dedup_saved_bytes"],
        "max_bytes": config.max_bytes,
        "min_free_bytes": config.min_free,
        "disk_free_bytes": free,
        "hits": counters.hits,
        "misses": counters.misses,
        "evictions": counters.evictions,
        "evicted_bytes": counters.evicted_bytes,
        "superseded": counters.superseded,
        "duplicates": counters.duplicates,
        "quarantined": counters.quarantined,
        "abandoned_puts": counters.abandoned,
        # Files taken out of the tier: being unlinked off the event loop, and unlinked.
        "deleting_bytes": catalog.deleter.pending_bytes,
        "deleting_files": catalog.deleter.pending_files,
        "deleted_files": catalog.deleter.deleted,
        "bytes_written": counters.bytes_written,
        "leased_entries": catalog.leased,
        "leased_bytes": catalog.leased_bytes,  # what eviction cannot free while they last
        "leases_expired": leases.expired,
        "checks": dict(checks),  # verify and damage reports: run, refused, skipped
        "admission": {
            "policy": config.admission,
            "refused": puts["not_admitted"],
            "saved_bytes": puts["not_admitted_bytes"],
        },
        "staged_bytes": puts["staged_bytes"],
        "staged_puts": puts["staged_puts"],
        "puts": {
            # Files a client still had open for writing at commit (the daemon went on with a copy),
            # new blocks checked whole before their put's commit, commits refused for files
            # that were not what their put_begin declared, and puts aborted for staging files
            # grown past it.
            "sealed_by_copy": puts["sealed_by_copy"],
            "checked_early": puts["checked_early"],
            "refused_at_commit": puts["refused_at_commit"],
            "outgrown": puts["outgrown"],
        },
        "writeback": {
            "pending_bytes": queue.pending_bytes,
            "pending_count": queue.pending_count,
            "max_bytes": queue.cap_bytes,
            "policy": config.writeback_policy.value,
            "stored": queue.stored,
            "dropped": queue.dropped + queue.cancelled,
            "failed": queue.failed,
            "refused": queue.refused,  # at commit
            "refused_at_begin": puts["refused"],
        },
        # Entries kept before unretained ones (kvd.store.retention): each its file and blocks.
        "retained_bytes": sum(retained.values()),
        **_identities(catalog, telemetry, retained, now),
        "bytes_written_24h": telemetry.written_today.total(now),
        # Lookups the engines' memory served (not misses of the tier), misses by reason,
        # restores and their latency buckets, tokens restored and the prefill seconds saved.
        **telemetry.report(now),
        # Snapshots the engines dropped unsent (their backlogs were full), as they reported.
        "engine_dropped": telemetry.engine_dropped,
        "engine_dropped_bytes": telemetry.engine_dropped_bytes,
        # Prefill checkpoints: entries of their own kind (kvd.store.eviction's rule), counted apart.
        "prefill_checkpoints": _prefill_checkpoints(
            (counts for _, counts in catalog.identities()), telemetry
        ),
        # What the daemon keeps of what clients named: each capped or aged (see its module).
        "kept": {
            "telemetry_identities": len(telemetry.identities),
            "telemetry_forgotten": telemetry.forgotten,
            "tickets": len(tickets),
            "sightings": admission.sightings(),
        },
        "daemon": {
            "uptime_s": round(now - started, 3),
            "dir": str(root),
            "socket": str(config.socket),
        },
    }


def _identities(
    catalog: Catalog, telemetry: Telemetry, retained: Mapping[str, int], now: float
) -> dict[str, Any]:
    """The identities with entries or traffic, at most STATUS_IDENTITIES of them (the most
    bytes first, then the most recently seen), by digest: each one's name (unique among all
    of them, listed or not), its share of the tier (entry files and unique blocks) and its
    telemetry; and how many were left out. O(identities)."""
    held = dict(catalog.identities())
    entries = {digest: counts.entries for digest, counts in held.items()}
    recency = {digest: rank for rank, digest in enumerate(reversed(telemetry.identities))}
    known = entries.keys() | telemetry.identities.keys()
    size = {digest: catalog.identity_bytes(digest) for digest in known}
    ranked = sorted(known, key=lambda d: (-size[d], recency.get(d, len(recency)), d))
    shown = sorted(ranked[:STATUS_IDENTITIES])
    named = telemetry.names(known)
    return {
        "identities": [
            {
                "identity": digest,
                "name": named[digest],
                "entries": entries.get(digest, 0),
                "bytes": size[digest],
                "block_bytes": catalog.block_store.identity_bytes(digest),
                "retained_bytes": retained.get(digest, 0),
                **_telemetry_report(telemetry, digest, now),
                "prefill_checkpoints": _prefill_checkpoints(
                    [held[digest]] if digest in held else [],
                    telemetry.identities.get(digest) or IdentityTelemetry(),
                ),
            }
            for digest in shown
        ],
        "identities_left_out": len(known) - len(shown),
    }


def _prefill_checkpoints(
    counts: Iterable[IdentityCounts], telemetry: Telemetry | IdentityTelemetry
) -> dict[str, int]:
    """The prefill checkpoints of these identities' counts (entries, their files' bytes), and
    the hits and restored tokens the telemetry counted (of the tier, or of one identity)."""
    entries = nbytes = 0
    for counted in counts:
        entries += counted.prefill_checkpoints
        nbytes += counted.prefill_checkpoint_bytes
    return {
        "entries": entries,
        "bytes": nbytes,
        "hits": telemetry.prefill_checkpoint_hits,
        "restored_tokens": telemetry.prefill_checkpoint_restored_tokens,
    }


def _telemetry_report(telemetry: Telemetry, digest: str, now: float) -> dict[str, object]:
    """An identity's telemetry, without making one for it (a report is not a sighting)."""
    found = telemetry.identities.get(digest)
    return (found or IdentityTelemetry()).report(now)
