"""Soft retention against a real daemon: a retained entry outlives cap pressure that takes an
unretained one, is counted in status, shown by kvctl list, renewed by a hit, given to the
entry a duplicate put finds, bounded by max_retention, kept across a restart, and ends."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from daemon_e2e import ENTRY_BYTES, IDENTITY, entry, looked_up_tokens, report, wait_until
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client import Client
from kvd_protocol.messages import EntrySummary, Retention

FIRST, SECOND, THIRD = list(range(100, 132)), list(range(200, 232)), list(range(300, 332))


def put(client: Client, tokens: Sequence[int], retention: Retention | None = None) -> None:
    layers, tensors = entry(len(tokens), seed=tokens[0])
    ticket = client.put_entry(IDENTITY, list(tokens), layers, tensors, retention=retention)
    assert ticket.wait(30).state == "stored"


def listed(client: Client, entry_id: str) -> EntrySummary:
    """The entry as a list page shows it (no use of it, unlike a lookup)."""
    (found,) = [e for e in client.list_entries() if e.id == entry_id]
    return found


def summary_of(client: Client, tokens: Sequence[int]) -> EntrySummary:
    hit = client.lookup(IDENTITY, [*tokens, 1])
    assert hit is not None
    with hit:
        return hit.summary


def test_a_retained_entry_outlives_cap_pressure_that_takes_an_unretained_one(
    tmp_path: Path,
) -> None:
    """The retained entry is the older of two of the same size: without its retention, the
    third put would evict it (lru); with it, the unretained one goes."""
    with (
        running_daemon(tmp_path, ["--max-bytes", str(2 * ENTRY_BYTES)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put(client, FIRST, Retention(seconds=600))
        put(client, SECOND)
        assert client.status()["retained_bytes"] == ENTRY_BYTES
        put(client, THIRD)
        status = report(client)
        assert status["evictions"] == 1
        assert looked_up_tokens(client, IDENTITY, [*FIRST, 1]) == len(FIRST)
        assert looked_up_tokens(client, IDENTITY, [*SECOND, 1]) is None
        assert looked_up_tokens(client, IDENTITY, [*THIRD, 1]) == len(THIRD)
        (row,) = status["identities"]
        assert (status["retained_bytes"], row["retained_bytes"]) == (ENTRY_BYTES, ENTRY_BYTES)


def test_retained_entries_alone_over_the_cap_go_lowest_priority_first(tmp_path: Path) -> None:
    """The cap holds whatever is retained: of the two retained entries the third put makes
    room among, the one of the lower priority goes though it is the newer."""
    with (
        running_daemon(tmp_path, ["--max-bytes", str(2 * ENTRY_BYTES)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put(client, FIRST, Retention(seconds=600, priority=2))
        put(client, SECOND, Retention(seconds=600, priority=1))
        put(client, THIRD, Retention(seconds=600, priority=2))
        assert client.status()["entries"] == 2
        assert looked_up_tokens(client, IDENTITY, [*SECOND, 1]) is None
        assert looked_up_tokens(client, IDENTITY, [*FIRST, 1]) == len(FIRST)
        assert client.status()["retained_bytes"] == 2 * ENTRY_BYTES


def test_kvctl_list_and_status_show_the_retention(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        before = time.time()
        put(client, FIRST, Retention(seconds=3600, priority=3))
        put(client, SECOND)
        retained = summary_of(client, FIRST)
        assert retained.retained_until is not None
        assert before + 3600 <= retained.retained_until <= time.time() + 3600
        assert retained.retention_priority == 3
        assert summary_of(client, SECOND).retained_until is None
    shown = kvctl(daemon, "list")
    assert shown.returncode == 0, shown.stderr
    header, *rows = shown.stdout.splitlines()
    assert "retained" in header.split()
    assert sorted(row.split()[-3] for row in rows if row.strip()) == ["-", "p3"]
    status = kvctl(daemon, "status")
    assert "retained" in status.stdout


def test_a_hit_renews_the_retention_and_a_duplicate_put_gives_its_own(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put(client, FIRST, Retention(seconds=60))
        first = summary_of(client, FIRST).retained_until
        time.sleep(0.05)
        renewed = summary_of(client, FIRST).retained_until  # the first lookup was a use
        assert first is not None
        assert renewed is not None
        assert renewed > first
        put(client, SECOND)
        put(client, SECOND, Retention(seconds=600, priority=4))  # held: skipped as duplicate
        given = summary_of(client, SECOND)
        assert given.retained_until is not None
        assert given.retained_until > time.time() + 500
        assert given.retention_priority == 4


def test_max_retention_bounds_a_retention(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--max-retention", "60"]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put(client, FIRST, Retention(seconds=86_400))
        until = summary_of(client, FIRST).retained_until
        assert until is not None
        assert until <= time.time() + 60


def test_a_retention_ends(tmp_path: Path) -> None:
    """Once ended, it is shown no more, counted no more, and eviction takes the entry in
    its turn (the oldest)."""
    with (
        running_daemon(tmp_path, ["--max-bytes", str(2 * ENTRY_BYTES)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put(client, FIRST, Retention(seconds=3))
        retained = summary_of(client, FIRST)
        assert retained.retained_until is not None
        put(client, SECOND)
        wait_until(lambda: report(client)["retained_bytes"] == 0, "the retention to end")
        assert listed(client, retained.id).retained_until is None
        put(client, THIRD)
        assert looked_up_tokens(client, IDENTITY, [*FIRST, 1]) is None
        assert looked_up_tokens(client, IDENTITY, [*SECOND, 1]) == len(SECOND)


def test_a_retention_is_kept_across_a_restart(tmp_path: Path) -> None:
    with running_daemon(tmp_path, ["--max-bytes", str(2 * ENTRY_BYTES)]) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put(client, FIRST, Retention(seconds=3600, priority=2))
            first = summary_of(client, FIRST)
            put(client, SECOND)
        assert daemon.stop() == 0
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            kept = listed(client, first.id)
            assert kept.retained_until == first.retained_until
            assert kept.retention_priority == 2
            put(client, THIRD)
            assert looked_up_tokens(client, IDENTITY, [*FIRST, 1]) == len(FIRST)
            assert looked_up_tokens(client, IDENTITY, [*SECOND, 1]) is None
