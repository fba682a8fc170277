"""The status report: what `kvctl status` shows and the status request answers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import psutil

from kvd import __version__
from kvd.catalog import Catalog
from kvd.durability import disk_free
from kvd.session import Peer
from kvd.telemetry import Telemetry
from kvd.tier import Tier

_process = psutil.Process()


def status_report(tier: Tier, peers: Iterable[Peer]) -> dict[str, Any]:
    """O(identities + peers): every figure is a count the tier keeps up as entries change."""
    catalog = tier.catalog
    queue = tier.writer.queue
    counters = catalog.counters
    telemetry = tier.telemetry
    try:
        free = disk_free(tier.dirs.root)
    except OSError:
        free = -1
    unique = catalog.total_bytes
    return {
        "entries": len(catalog),
        "bytes": unique,
        # Shared blocks (format v2): what the disk holds, what v1 files would hold, their
        # ratio, the blocks themselves, and the bytes puts did not write for blocks held.
        "unique_bytes": unique,
        "logical_bytes": catalog.logical_bytes,
        "dedup_ratio": round(catalog.logical_bytes / unique, 3) if unique else 1.0,
        "blocks": {"count": len(catalog.blocks), "bytes": catalog.blocks.bytes},
        "dedup_saved_bytes": tier.puts.dedup_saved_bytes,
        "max_bytes": tier.config.max_bytes,
        "min_free_bytes": tier.config.min_free,
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
        "deleted_files": catalog.deleter.deleted,
        "bytes_written": counters.bytes_written,
        "leased_entries": catalog.leased,
        "leased_bytes": catalog.leased_bytes,  # what eviction cannot free while they last
        "leases_expired": tier.leases.expired,
        "checks": tier.checks.counts(),  # verify and damage reports: run, refused, skipped
        "admission": {
            "policy": tier.config.admission,
            "refused": tier.puts.not_admitted,
            "saved_bytes": tier.puts.not_admitted_bytes,
        },
        "staged_bytes": tier.puts.staged_bytes,
        "staged_puts": len(tier.puts),
        "puts": {
            # Files a client still held writable at commit (the daemon went on with a copy),
            # and commits refused for files that were not what their put_begin declared.
            "sealed_by_copy": tier.puts.sealed_by_copy,
            "refused_at_commit": tier.puts.refused_at_commit,
        },
        "writeback": {
            "pending_bytes": queue.pending_bytes,
            "pending_count": queue.pending_count,
            "max_bytes": queue.cap_bytes,
            "policy": tier.config.writeback_policy.value,
            "stored": queue.stored,
            "dropped": queue.dropped + queue.cancelled,
            "failed": queue.failed,
            "refused": queue.refused,  # at commit
            "refused_at_begin": tier.puts.refused,
        },
        "identities": _identities(catalog, telemetry, tier.puts.dedup_saved),
        "bytes_written_24h": telemetry.written_today.total(time.time()),
        "tokens_restored": sum(t.tokens_restored for t in telemetry.identities.values()),
        "restores": sum(t.restores for t in telemetry.identities.values()),
        "clients": [
            {"pid": p.credentials.pid, "uid": p.credentials.uid, "name": p.name or _name(p)}
            for p in peers
        ],
        "daemon": {
            "pid": os.getpid(),
            "rss_bytes": _process.memory_info().rss,
            "uptime_s": round(time.time() - tier.started, 3),
            "version": __version__,
            "dir": str(tier.dirs.root),
            "socket": str(tier.config.socket),
        },
    }


def _identities(
    catalog: Catalog, telemetry: Telemetry, dedup_saved: Mapping[str, int]
) -> list[dict[str, Any]]:
    """Every identity with entries or traffic, by digest: its share of the tier (entry files
    and unique blocks) and its telemetry. O(identities)."""
    entries = {digest: counts.entries for digest, counts in catalog.identities()}
    return [
        {
            "identity": digest,
            "entries": entries.get(digest, 0),
            "bytes": catalog.identity_bytes(digest),
            "block_bytes": catalog.blocks.identity_bytes(digest),
            "dedup_saved_bytes": dedup_saved.get(digest, 0),
            **telemetry.of(digest).report(),
        }
        for digest in sorted(entries.keys() | telemetry.identities.keys())
    ]


def _name(peer: Peer) -> str:
    """The client's process name, when it did not say (psutil may be denied on macOS)."""
    try:
        return str(psutil.Process(peer.credentials.pid).name())
    except (psutil.Error, OSError):
        return ""
