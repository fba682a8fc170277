"""Snapshots a cold tier drops from its full backlog reach the daemon's status: told with the
tier's next commit (kept over a put that gets no ticket), counted per identity and in total,
shown by `kvctl status` and `kvctl metrics`. A real daemon, a tiny real model."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from daemon_process import Daemon
from kvd_client.backlog import Kind
from kvd_client.client import Client
from kvd_client.drops import Drops
from kvd_client.mlx_lm_cache import ColdTier
from kvd_client.results import TicketState
from kvd_protocol.messages import MAX_REPORTED_BYTES, MAX_REPORTED_DROPS, DropReport
from test_metrics import kvctl_output, parse
from test_snapshots import SETTLE_SECONDS, _row_bytes, _stored, _tier
from tiny_engine import byte_tokenizer
from tiny_models import prefill, prompt, tiny_llama

from kvd.ops.kvctl_tables import _engine_drops

BLOCK = 16


def test_a_burst_s_drops_show_in_status_and_metrics_as_the_tier_counted_them(
    daemon: Daemon,
) -> None:
    """While the sending thread is held up: a repeat of a stored prompt (its put is skipped,
    so it tells nothing), then segments of three conversations and the finished turn of a
    fourth. The bound holds the repeat, a segment and the turn: the turn's coming drops the
    first segment, the third's the second. The repeat's put gets no ticket, so the drops
    wait for the turn's commit."""
    model = tiny_llama()
    conversations = [prompt(3 * BLOCK, seed=40 + i) for i in range(4)]
    row = _row_bytes(prefill(model, conversations[0][:1]))
    repeat = prompt(3, seed=98)
    bound = (3 + 2 * BLOCK + 3 * BLOCK) * row
    with _tier(daemon, model, backlog_bytes=bound) as (client, tier):
        _stored(tier, repeat, prefill(model, repeat))
        with tier._stores._lock:  # the sending thread waits on it: what comes queues up
            first = prompt(3, seed=99)
            in_flight = tier.store(first, prefill(model, first))
            while len(tier._backlog):  # until the sending thread holds it
                time.sleep(0.01)
            again = tier.store(repeat, prefill(model, repeat))
            segments = []
            for tokens in conversations[:2]:
                cut = tokens[: 2 * BLOCK + 8]
                segments.append(tier.store(cut, prefill(model, cut), kind=Kind.SEGMENT))
            turn = tier.store(conversations[3], prefill(model, conversations[3]))
            cut = conversations[2][: 2 * BLOCK + 8]
            last_segment = tier.store(cut, prefill(model, cut), kind=Kind.SEGMENT)
        assert in_flight.result(SETTLE_SECONDS).wait(SETTLE_SECONDS) == TicketState("stored")
        skipped = again.result(SETTLE_SECONDS)
        assert skipped.id is None  # no commit: nothing told with it
        assert turn.result(SETTLE_SECONDS).wait(SETTLE_SECONDS) == TicketState("stored")
        assert last_segment.result(SETTLE_SECONDS).wait(SETTLE_SECONDS) == TicketState("stored")
        assert tier.drain(SETTLE_SECONDS)
        status: dict[str, Any] = dict(client.status())
    assert all(future.cancelled() for future in segments)
    assert tier.stats.dropped == 2
    assert tier.stats.dropped_bytes == 2 * (2 * BLOCK) * row
    digest = tier.identity.to_protocol().digest()
    (mine,) = [i for i in status["identities"] if i["identity"] == digest]
    assert (mine["engine_dropped"], mine["engine_dropped_bytes"]) == (
        tier.stats.dropped,
        tier.stats.dropped_bytes,
    )
    assert (status["engine_dropped"], status["engine_dropped_bytes"]) == (
        tier.stats.dropped,
        tier.stats.dropped_bytes,
    )
    shown = json.loads(kvctl_output(daemon, "status", "--json"))
    assert shown["engine_dropped"] == tier.stats.dropped
    text = kvctl_output(daemon, "status")
    (line,) = [line for line in text.splitlines() if line.startswith("engine drops")]
    assert "2 snapshots" in line, line
    assert mine["name"] in line, line
    samples = parse(kvctl_output(daemon, "metrics"))
    assert samples[("kvd_engine_dropped_total", frozenset())] == tier.stats.dropped
    assert samples[("kvd_engine_dropped_bytes_total", frozenset())] == tier.stats.dropped_bytes
    (per_identity,) = [
        value
        for (name, labels), value in samples.items()
        if name == "kvd_identity_engine_dropped_bytes_total" and ("identity", digest) in labels
    ]
    assert per_identity == tier.stats.dropped_bytes


def test_an_engine_that_dropped_nothing_shows_none(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(20)
    with _tier(daemon, model) as (client, tier):
        _stored(tier, tokens, prefill(model, tokens))
        status: dict[str, Any] = dict(client.status())
    (mine,) = [i for i in status["identities"]]
    assert (mine["engine_dropped"], mine["engine_dropped_bytes"]) == (0, 0)
    assert status["engine_dropped"] == 0
    lines = kvctl_output(daemon, "status").splitlines()
    assert [line.split() for line in lines if line.startswith("engine drops")] == [
        ["engine", "drops", "none"]
    ]


@pytest.mark.parametrize(
    ("snapshots", "nbytes"),
    [(3, 1 << 20), (MAX_REPORTED_DROPS + 5, 1), (1, MAX_REPORTED_BYTES * 2 + 7)],
)
def test_untold_drops_are_told_within_the_protocol_s_bounds_and_the_rest_waits(
    snapshots: int, nbytes: int
) -> None:
    drops = Drops()
    assert drops.report() is None
    drops.add(snapshots, nbytes)
    told_snapshots = told_bytes = 0
    while (report := drops.report()) is not None:
        assert isinstance(report, DropReport)
        assert report.snapshots <= MAX_REPORTED_DROPS
        assert report.bytes <= MAX_REPORTED_BYTES
        drops.told(report)
        told_snapshots += report.snapshots
        told_bytes += report.bytes
    assert (told_snapshots, told_bytes) == (snapshots, nbytes)


def test_drops_go_with_the_first_put_of_a_connection_the_daemon_has_not_answered_yet(
    daemon: Daemon,
) -> None:
    """Before its hello the sending connection knows no feature of the daemon: the put is
    planned again once the daemon answers, and the drops go with that one's commit."""
    model = tiny_llama()
    tokens = prompt(20, seed=5)
    with (
        Client.connect(daemon.socket_path, block_tokens=BLOCK) as client,
        ColdTier(client, model, byte_tokenizer()) as tier,
    ):
        assert tier._stores._link.server is None  # the put says hello first
        with tier._changed:
            tier._untold.add(4, 4096)
        _stored(tier, tokens, prefill(model, tokens))
        status: dict[str, Any] = dict(client.status())
    assert status["engine_dropped"] == 4
    assert status["engine_dropped_bytes"] == 4096


def test_the_status_line_names_the_identities_that_dropped_most() -> None:
    identities = [
        {"identity": f"{n:032x}", "name": f"model-{n}", "engine_dropped": n} for n in range(6)
    ]
    status = {"engine_dropped": 15, "engine_dropped_bytes": 3 << 20, "identities": identities}
    ((row, text),) = _engine_drops(status)
    assert row == "engine drops"
    assert text == (
        "15 snapshots (3.0 MiB) dropped unsent: model-5 5, model-4 4, model-3 3 and 2 more"
    )
    assert _engine_drops({"identities": []}) == []  # a daemon that does not count them
