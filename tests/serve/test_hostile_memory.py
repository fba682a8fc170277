"""The daemon's memory is bounded whatever clients name, and status and metrics stay sane.

A client that names a new identity with every request, reports hostile numbers, or invents
miss reasons must not grow the daemon without bound, make its status overflow a frame, or
put a number into status or metrics that strict JSON or the exposition format refuses.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from daemon_e2e import IDENTITY, RawPeer, put_stored, report, wait_until
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens
from prometheus_client.parser import text_string_to_metric_families

from kvd.serve.metrics import exposition
from kvd.serve.status import finite
from kvd.store import tickets
from kvd.store.admission import SecondHit
from kvd.store.telemetry import IDLE_IDENTITIES, MISS_REASONS, OTHER_REASON, Telemetry
from kvd.store.tickets import Tickets
from kvd.store.tier_report import STATUS_IDENTITIES

PROMPT = list(range(700, 764))
HOSTILE_FLOATS = (float("inf"), float("-inf"), float("nan"), -1.0, 1e300, 1.7976931348623157e308)
BATCH = 64  # requests in flight on one connection: the protocol's default max_in_flight


def _invented(number: int) -> Identity:
    """An identity nobody uses twice: a random model id, as a hostile client sends."""
    return Identity(f"random/{number}-{os.urandom(4).hex()}", "cfg", "tok", "codecs/1", "mlx/cpu")


def _lookups(peer: RawPeer, identities: Sequence[Identity]) -> None:
    """One lookup per identity, BATCH in flight at a time; every one a miss."""
    tokens = pack_tokens(range(1, 33))
    for start in range(0, len(identities), BATCH):
        batch = identities[start : start + BATCH]
        peer.send(*(m.Lookup(id=peer.next_id(), identity=i, tokens=tokens) for i in batch))
        for _ in batch:
            reply = peer.receive()
            assert isinstance(reply, m.LookupReply), reply
            assert reply.entry is None


def _rss(daemon: Daemon) -> int:
    return int(psutil.Process(daemon.pid).memory_info().rss)


def _strict(status: dict[str, Any]) -> dict[str, Any]:
    """status through strict JSON: Infinity or NaN anywhere raises."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    parsed: dict[str, Any] = json.loads(json.dumps(status), parse_constant=refuse)
    return parsed


@pytest.fixture
def witness(daemon: Daemon) -> Iterator[Client]:
    """An honest client with an entry stored before the trouble, found whole after (every
    tensor's checksum verified)."""
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, PROMPT, seed=5)
        yield client
        result = client.lookup(IDENTITY, [*PROMPT, 1])
        assert result is not None
        with result:
            result.verify()
            assert result.header.token_count == len(PROMPT)


def test_a_new_identity_per_request_does_not_grow_the_daemon(
    daemon: Daemon, witness: Client
) -> None:
    invented = [_invented(n) for n in range(24_000)]
    with RawPeer(daemon.socket_path) as peer:
        _lookups(peer, invented[:4_000])  # warm-up: the structures at their cap, if they have one
        before = _rss(daemon)
        _lookups(peer, invented[4_000:])
        after = _rss(daemon)
    status = report(witness)
    kept = status["kept"]
    # Unbounded, 20,000 identities' telemetry is ~50 MB (~2.5 KB each).
    assert after - before < 12 << 20, f"RSS {before >> 20} -> {after >> 20} MiB"
    assert kept["telemetry_identities"] <= 2 * IDLE_IDENTITIES + 1
    assert kept["telemetry_forgotten"] >= len(invented) - 2 * IDLE_IDENTITIES
    # The honest identity, which holds entries, keeps its telemetry and leads the status.
    listed = {i["identity"]: i for i in status["identities"]}
    assert listed[IDENTITY.digest()]["entries"] == 1
    assert listed[IDENTITY.digest()]["hits"] == 0
    assert status["misses"] == len(invented)


def test_an_identity_that_holds_nothing_leaves_no_folder_behind(tmp_path: Path) -> None:
    """A client naming a new identity with every put: each put made a folder under entries/
    (and a watch on it) that outlived the identity's last entry, for ever. The full
    reconcile removes the folders of identities the tier no longer holds; an identity put
    again gets its folder back."""
    flags = ["--max-bytes", str(256 << 10), "--min-free", "0", "--reconcile-interval", "0.5"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        invented = [_invented(n) for n in range(60)]
        for seed, identity in enumerate(invented):
            put_stored(client, identity, PROMPT, seed=seed)
        entries = daemon.tier / "entries"

        def folders_match_the_tier() -> bool:
            holding = {i["identity"] for i in report(client)["identities"] if i["entries"]}
            return set(os.listdir(entries)) == holding

        wait_until(folders_match_the_tier, "the empty identity folders were removed")
        assert 0 < len(os.listdir(entries)) < len(invented)  # the cap kept a few
        assert invented[-1].digest() in os.listdir(entries)  # the newest holds its entry
        first = invented[0]
        assert first.digest() not in os.listdir(entries)
        kept = put_stored(client, first, PROMPT, seed=99)  # its folder made again
        result = client.lookup(first, [*PROMPT, 1])
        assert result is not None
        with result:
            assert [bytes(v) for v in result.tensors] == [t.tobytes() for t in kept]
    assert "empty_identity_folders_removed" in daemon.logs()


def test_status_lists_at_most_its_cap_and_counts_the_rest(daemon: Daemon, witness: Client) -> None:
    count = STATUS_IDENTITIES + 200
    invented = [_invented(n) for n in range(count)]
    with RawPeer(daemon.socket_path) as peer:
        _lookups(peer, invented)
    status = report(witness)
    assert len(status["identities"]) == STATUS_IDENTITIES
    assert status["identities_left_out"] == count + 1 - STATUS_IDENTITIES
    digests = {i["identity"] for i in status["identities"]}
    assert IDENTITY.digest() in digests  # the one with bytes in the tier comes first
    assert invented[-1].digest() in digests  # then the most recently seen
    assert invented[0].digest() not in digests
    shown = kvctl(daemon, "status")
    assert shown.returncode == 0, shown.stderr
    assert f"in {count + 1} identities" in shown.stdout
    assert f"and {count + 1 - STATUS_IDENTITIES:,} more identities, not listed" in shown.stdout


def _answer(peer: RawPeer, request: m.Request) -> m.Reply:
    reply = peer.call(request)
    for fd in reply.fds:
        os.close(fd)
    return reply


def test_hostile_numbers_are_refused_and_never_reach_status_or_metrics(
    daemon: Daemon, witness: Client
) -> None:
    tokens = pack_tokens(range(1, 17))
    with RawPeer(daemon.socket_path) as peer:
        hit = _answer(
            peer, m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(PROMPT))
        )
        assert isinstance(hit, m.LookupReply)
        assert hit.lease is not None
        lease = hit.lease
        for value in HOSTILE_FLOATS:
            report_of = m.RestoreReport(miss=None, ms=value, bytes=1, tokens=1)
            hostile: list[m.Request] = [
                m.PutBegin(
                    id=peer.next_id(),
                    identity=IDENTITY,
                    tokens=tokens,
                    size=16384,
                    prefill_cost=value,
                ),
                m.PutCommit(id=peer.next_id(), put=1, store_ms=value),
                m.WaitTicket(id=peer.next_id(), ticket=1, timeout=value),
                m.Flush(id=peer.next_id(), timeout=value),
                m.Release(id=peer.next_id(), lease=lease, report=report_of),
            ]
            for request in hostile:
                reply = _answer(peer, request)
                assert isinstance(reply, m.ErrorReply), (request, reply)
                assert reply.code.value == "bad_message", reply
        too_many = m.RestoreReport(miss=None, ms=1.0, bytes=1 << 60, tokens=1)
        reply = _answer(peer, m.Release(id=peer.next_id(), lease=lease, report=too_many))
        assert isinstance(reply, m.ErrorReply)
        assert "bytes" in reply.message
        for snapshots, nbytes, named in ((-1, 1, "snapshots"), (1, 1 << 60, "bytes")):
            drops = m.DropReport(snapshots=snapshots, bytes=nbytes)
            reply = _answer(peer, m.PutCommit(id=peer.next_id(), put=1, dropped=drops))
            assert isinstance(reply, m.ErrorReply), reply
            assert reply.code.value == "bad_message", reply
            assert named in reply.message, reply
        # The connection went on, and the lease is still the peer's to release.
        assert isinstance(_answer(peer, m.Ping(id=peer.next_id())), m.PingReply)
        fine = m.RestoreReport(miss=None, ms=2.5, bytes=1 << 20, tokens=len(PROMPT))
        assert isinstance(
            _answer(peer, m.Release(id=peer.next_id(), lease=lease, report=fine)), m.ReleaseReply
        )
    status = _strict(report(witness))
    (mine,) = [i for i in status["identities"] if i["identity"] == IDENTITY.digest()]
    assert mine["prefill_ms_per_token"] is None  # no hostile cost was taken
    assert mine["restores"] == 1
    assert mine["tokens_restored"] == len(PROMPT)
    assert mine["engine_dropped"] == mine["engine_dropped_bytes"] == 0
    exposed = kvctl(daemon, "metrics")
    assert exposed.returncode == 0, exposed.stderr
    samples = [
        s for family in text_string_to_metric_families(exposed.stdout) for s in family.samples
    ]
    assert samples
    assert all(math.isfinite(s.value) for s in samples), [
        s for s in samples if not math.isfinite(s.value)
    ]


def test_invented_miss_reasons_are_counted_under_a_few_names(
    daemon: Daemon, witness: Client
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        for n in range(MISS_REASONS * 4):
            hit = _answer(
                peer, m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(PROMPT))
            )
            assert isinstance(hit, m.LookupReply)
            assert hit.lease is not None
            missed = m.RestoreReport(miss=f"reason-{n}-" + "x" * 900, ms=1.0, bytes=0, tokens=0)
            released = _answer(peer, m.Release(id=peer.next_id(), lease=hit.lease, report=missed))
            assert isinstance(released, m.ReleaseReply)
    (mine,) = [i for i in report(witness)["identities"] if i["identity"] == IDENTITY.digest()]
    reasons = mine["misses_by_reason"]
    assert len(reasons) == MISS_REASONS
    assert sum(reasons.values()) == MISS_REASONS * 4
    assert reasons[OTHER_REASON] == MISS_REASONS * 4 - (MISS_REASONS - 1)


def test_second_hit_forgets_sightings_older_than_its_window(tmp_path: Path) -> None:
    # Wide enough that the lookups all land within it on a loaded machine (2,000 of them
    # took over a second at a load of 10 on 2 cores).
    window = 3.0
    flags = ["--admission", "second-hit", "--admission-window", str(window)]
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        for n in range(300):
            prompt = pack_tokens([n + 1, *range(2, 20)])
            reply = peer.call(m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=prompt))
            assert isinstance(reply, m.LookupReply)
        with Client.connect(daemon.socket_path, require=True) as client:
            assert report(client)["kept"]["sightings"] == 600  # the prompt, and all but its last
            time.sleep(window * 1.5)
            peer.call(m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(PROMPT)))
            assert report(client)["kept"]["sightings"] == 2


# --- the kept structures' own policies, as pure state ---------------------------------------


def test_telemetry_keeps_identities_with_entries_and_caps_the_others() -> None:
    holding = {f"{n:064x}" for n in range(3)}
    telemetry = Telemetry(has_entries=holding.__contains__)
    for digest in sorted(holding):
        telemetry.of(digest).hits = 7
    for n in range(10 * IDLE_IDENTITIES):
        telemetry.of(f"{n + 100:064x}")
    assert holding <= telemetry.identities.keys()
    assert all(telemetry.identities[d].hits == 7 for d in holding)
    assert len(telemetry.identities) <= 2 * IDLE_IDENTITIES + len(holding)
    assert f"{10 * IDLE_IDENTITIES + 99:064x}" in telemetry.identities  # the latest stays
    assert f"{100:064x}" not in telemetry.identities  # the least recently seen went first


def test_a_forgotten_identity_takes_its_prefill_cost_out_of_the_mean() -> None:
    telemetry = Telemetry()
    slow = Identity("slow", "c", "t", "x", "r")
    telemetry.prefill_reported(slow, 0.5)
    assert telemetry.prefill_cost("anything") == 0.5
    for n in range(2 * IDLE_IDENTITIES + 2):
        telemetry.prefill_reported(Identity(f"m{n}", "c", "t", "x", "r"), 0.001)
    assert slow.digest() not in telemetry.identities
    assert telemetry.prefill_cost("anything") == pytest.approx(0.001)


def test_tickets_forget_settled_answers_by_count_and_age_never_pending_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tickets, "KEPT", 8)
    clock = [1000.0]

    async def main() -> None:
        kept = Tickets(clock=lambda: clock[0])
        pending = kept.issue()
        kept.mark_pending(pending)
        settled = [kept.issue() for _ in range(20)]
        for ticket in settled:
            kept.mark_pending(ticket)
            kept.settle(ticket, "stored", None)
        assert len(kept) == 8 + 1
        assert (await kept.wait(settled[-1], None)).state == "stored"
        assert (await kept.wait(pending, None)).state == "pending"
        clock[0] += tickets.KEPT_SECONDS + 1
        with pytest.raises(Exception, match="forgotten"):
            await kept.wait(settled[-1], None)
        assert len(kept) == 1
        kept.settle(pending, "dropped", "superseded")
        assert (await kept.wait(pending, None)).state == "dropped"

    anyio.run(main)


def test_second_hit_sightings_age_out_with_the_window() -> None:
    policy = SecondHit(window=10.0)
    digest = IDENTITY.digest()
    for n in range(100):
        policy.looked_up(digest, pack_tokens([n]), now=float(n) / 100)
    assert policy.sightings() == 100
    policy.looked_up(digest, pack_tokens([999]), now=20.0)
    assert policy.sightings() == 1
    assert (
        policy.admit(digest, pack_tokens([5]), now=21.0) is not None
    )  # forgotten: a first sighting


def test_status_reports_a_number_that_is_not_finite_as_null() -> None:
    overflowed = {"a": math.inf, "b": [1.5, -math.inf, {"c": math.nan}], "d": 2, "e": "inf"}
    cleaned = finite(overflowed)
    assert cleaned == {"a": None, "b": [1.5, None, {"c": None}], "d": 2, "e": "inf"}
    assert _strict(cleaned) == cleaned


def test_metrics_leave_out_numbers_that_are_not_finite() -> None:
    """As an older daemon's status may hold them (kvctl metrics reads any daemon's)."""
    identity = {
        "identity": "ab" * 32,
        "entries": 1,
        "restore_gb_per_s": math.inf,
        "misses_by_reason": {"damaged": math.nan, "no entry": 2},
        "restore_ms": {"p50": math.inf, "p95": 3.0},
    }
    status = {"entries": math.inf, "bytes": math.nan, "hits": 3, "identities": [identity]}
    text = exposition(lambda: status).decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert all(math.isfinite(s.value) for s in samples), text
    names = {s.name for s in samples}
    assert {"kvd_hits_total", "kvd_identity_entries", "kvd_identity_misses_total"} <= names
    assert "kvd_entries" not in names
    assert "kvd_identity_restore_bytes_per_second" not in names
