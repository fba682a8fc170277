"""kvctl status's rows of what the tier is worth (engine-held, misses by reason, prefill saved,
restore percentiles, the clients' models), from a real daemon's status, and from the same
status as a daemon that predates them answers it (their keys taken out)."""

from __future__ import annotations

import json
import re
from typing import Any

from daemon_e2e import put_stored
from daemon_process import Daemon, kvctl
from identity_variants import variant
from kvd_client import Client

from kvd.ops.kvctl_tables import format_status, top_reasons

NEWER_KEYS = (
    "engine_held",
    "misses_by_reason",
    "restore_ms",
    "prefill_saved_s",
    "prefill_saved_s_24h",
    "prefill_saved_estimated_s",
    "prefill_saved_estimated_s_24h",
)


def _status(daemon: Daemon) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(kvctl(daemon, "status", "--json").stdout)
    return found


def test_an_estimate_is_said_in_the_total_and_marked_in_its_identitys_row(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, variant(source="Llama-tiny"), range(32), 1)
    status = _status(daemon)
    saved = {"prefill_saved_s": 90.0, "prefill_saved_s_24h": 30.0}
    saved |= {"prefill_saved_estimated_s": 6.0, "prefill_saved_estimated_s_24h": 0.0}
    status |= saved
    status["identities"][0] |= saved
    shown = format_status(status)
    assert re.search(
        r"^prefill saved +90\.0 s since start, 30\.0 s in 24 h: restored tokens x each model's "
        r"measured prefill cost; 6\.00 s of it estimated \(models no engine measured",
        shown,
        re.M,
    ), shown
    assert "saved s start/24h" in shown
    # Since start holds an estimate, the last 24 h none.
    assert re.search(r"^Llama-tiny +\S+ +1 +.* ~90\.00/30\.00 ", shown, re.M), shown


def test_a_daemon_that_predates_the_rows_is_shown_without_them(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, name="engine", require=True) as client:
        put_stored(client, variant(source="Llama-tiny"), range(32), 1)
        assert client.lookup(variant(source="Llama-tiny"), range(100, 108)) is None  # a miss
        newer = _status(daemon)
    (row,) = newer["identities"]
    shown = format_status(newer)
    assert re.search(r"^misses +no entry 1$", shown, re.M), shown
    assert re.search(r"^engine +Llama-tiny +\d+$", shown, re.M), shown  # once, with its model
    older = {k: v for k, v in newer.items() if k not in NEWER_KEYS}
    older["identities"] = [{k: v for k, v in row.items() if k not in NEWER_KEYS}]
    older["clients"] = [{k: c[k] for k in ("pid", "uid", "name")} for c in newer["clients"]]
    shown = format_status(older)
    assert re.search(r"^lookups +0 hits, 1 misses \(0\.0%\)$", shown, re.M), shown
    for gone in (r"engine-held \(", "prefill saved", "^misses", "restores, ms"):
        assert re.search(gone, shown, re.M) is None, gone
    assert re.search(r"^engine +- +\d+$", shown, re.M), shown


def test_the_top_reasons_are_the_most_frequent_and_the_rest_counted_as_other() -> None:
    counts = {"no entry": 3, "kv differs": 5, "model": 1, "unreadable": 1}
    assert top_reasons(counts) == "kv differs 5, no entry 3, model 1, other 1"
    assert top_reasons(counts, 1) == "kv differs 5, other 5"
    assert top_reasons({}) == top_reasons(None) == "-"
