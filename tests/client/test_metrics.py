"""`kvctl metrics` against a real daemon with real traffic (tiny models): the exposition
parsed by prometheus_client's own parser, each value equal to `kvctl status --json`'s."""

from __future__ import annotations

import json
from typing import Any

from daemon_process import Daemon, kvctl
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import prefill, prompt, tiny_llama

SETTLE_SECONDS = 30.0
IDENTITY = EngineIdentity("tiny/metrics", "cfg", "tok", namespace="ops")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# metric sample -> the status key it shows (a path through the JSON)
TOP_LEVEL = {
    "kvd_entries": ("entries",),
    "kvd_bytes": ("bytes",),
    "kvd_max_bytes": ("max_bytes",),
    "kvd_min_free_bytes": ("min_free_bytes",),
    "kvd_leased_entries": ("leased_entries",),
    "kvd_staged_bytes": ("staged_bytes",),
    "kvd_written_24h_bytes": ("bytes_written_24h",),
    "kvd_hits_total": ("hits",),
    "kvd_misses_total": ("misses",),
    "kvd_evictions_total": ("evictions",),
    "kvd_evicted_bytes_total": ("evicted_bytes",),
    "kvd_superseded_total": ("superseded",),
    "kvd_quarantined_total": ("quarantined",),
    "kvd_deleting_bytes": ("deleting_bytes",),
    "kvd_deleted_files_total": ("deleted_files",),
    "kvd_written_bytes_total": ("bytes_written",),
    "kvd_leased_bytes": ("leased_bytes",),
    "kvd_leases_expired_total": ("leases_expired",),
    "kvd_restores_total": ("restores",),
    "kvd_tokens_restored_total": ("tokens_restored",),
    "kvd_writeback_pending_bytes": ("writeback", "pending_bytes"),
    "kvd_writeback_pending_entries": ("writeback", "pending_count"),
    "kvd_writeback_max_bytes": ("writeback", "max_bytes"),
    "kvd_writeback_stored_total": ("writeback", "stored"),
    "kvd_writeback_dropped_total": ("writeback", "dropped"),
    "kvd_writeback_failed_total": ("writeback", "failed"),
    "kvd_writeback_refused_total": ("writeback", "refused"),
}
PER_IDENTITY = {
    "kvd_identity_entries": "entries",
    "kvd_identity_bytes": "bytes",
    "kvd_identity_hits_total": "hits",
    "kvd_identity_restores_total": "restores",
    "kvd_identity_tokens_restored_total": "tokens_restored",
    "kvd_identity_written_bytes_total": "bytes_written",
}


def kvctl_output(daemon: Daemon, *args: str) -> str:
    result = kvctl(daemon, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def at(status: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        status = status[key]
    return status


def test_metrics_equal_the_status(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(64)
    with Client.connect(daemon.socket_path, require=True) as client:
        assert client.put(IDENTITY, tokens, prefill(model, tokens)).wait(SETTLE_SECONDS) == (
            TicketState("stored")
        )
        assert client.get(IDENTITY, [*tokens, 7], model=model) is not None
        assert client.get(IDENTITY, prompt(16, seed=9), model=model) is None
    # Both from one daemon at rest: only the daemon's memory and the disk may move between.
    samples = parse(kvctl_output(daemon, "metrics"))
    status = json.loads(kvctl_output(daemon, "status", "--json"))

    for name, path in TOP_LEVEL.items():
        assert samples[(name, frozenset())] == at(status, path), name
    (mine,) = status["identities"]
    assert (mine["model_id"], mine["namespace"]) == ("tiny/metrics", "ops")
    labels = {
        ("identity", mine["identity"]),
        ("name", "tiny/metrics"),  # the model's only identity: named by its model id
        ("model_id", "tiny/metrics"),
        ("namespace", "ops"),
    }
    for name, key in PER_IDENTITY.items():
        assert samples[(name, frozenset(labels))] == mine[key], name
    assert mine["tokens_restored"] == 64
    misses = {
        dict(label)["reason"]: value
        for (name, label), value in samples.items()
        if name == "kvd_identity_misses_total"
    }
    assert misses == mine["misses_by_reason"] == {"no entry": 1}
    for part, quantile in (("p50", "0.5"), ("p95", "0.95"), ("p99", "0.99")):
        quantile_labels = frozenset({*labels, ("quantile", quantile)})
        latency = samples[("kvd_identity_restore_seconds", quantile_labels)]
        assert latency == mine["restore_ms"][part] / 1000
    speed = samples[("kvd_identity_restore_bytes_per_second", frozenset(labels))]
    assert speed == mine["restore_gb_per_s"] * 1e9 > 0

    assert samples[("kvd_clients", frozenset())] == len(status["clients"]) == 1  # kvctl itself
    rss = samples[("kvd_resident_memory_bytes", frozenset())]
    assert 0.5 < rss / status["daemon"]["rss_bytes"] < 2
    assert samples[("kvd_disk_free_bytes", frozenset())] > 0
    info = {("version", status["daemon"]["version"]), ("writeback_policy", "drop-oldest")}
    assert samples[("kvd_info", frozenset(info))] == 1
