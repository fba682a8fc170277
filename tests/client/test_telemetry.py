"""The engines' word on each restore and store reaches the daemon's status per identity: a
real daemon, tiny real models, Client.put and Client.get."""

from __future__ import annotations

from typing import Any

from daemon_process import Daemon, kvctl
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import prefill, prompt, tiny_llama

SETTLE_SECONDS = 30.0
IDENTITY = EngineIdentity("tiny/telemetry", "cfg", "tok")


def _identity_status(client: Client) -> dict[str, Any]:
    (found,) = [
        i
        for i in client.status()["identities"]  # type: ignore[attr-defined]
        if i["identity"] == IDENTITY.to_protocol().digest()
    ]
    return dict(found)


def test_restores_misses_and_stores_are_counted_per_identity(daemon: Daemon) -> None:
    model = tiny_llama()
    tokens = prompt(64)
    with Client.connect(daemon.socket_path, require=True) as client:
        ticket = client.put(IDENTITY, tokens, prefill(model, tokens))
        assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
        restored = client.get(IDENTITY, [*tokens, 7], model=model)
        assert restored is not None
        assert client.get(IDENTITY, prompt(16, seed=9), model=model) is None  # nothing shares it
        # Another geometry: the daemon offers the entry, the engine cannot use it.
        assert client.get(IDENTITY, [*tokens, 7], model=tiny_llama(layers=3)) is None
        status: dict[str, Any] = dict(client.status())
        mine = _identity_status(client)
    assert mine["model_id"] == "tiny/telemetry"
    assert (mine["entries"], mine["bytes_written"]) == (1, mine["bytes"])
    assert status["bytes_written_24h"] == mine["bytes"]
    assert mine["hits"] == 1  # the one the engine used; the rejected one became a miss
    assert mine["misses_by_reason"] == {"no entry": 1, "model": 1}
    # The tier's counts agree with the model's.
    assert (status["hits"], status["misses"]) == (1, 2)
    assert status["misses_by_reason"] == {"no entry": 1, "model": 1}
    assert (mine["restores"], mine["tokens_restored"]) == (1, 64)
    assert status["tokens_restored"] == 64
    p50 = mine["restore_ms"]["p50"]
    assert p50 is not None
    assert 0 < p50 <= mine["restore_ms"]["p99"]
    assert mine["restore_gb_per_s"] > 0
    assert mine["store_ms"]["p50"] is not None


UNMEASURED = EngineIdentity("tiny/unmeasured", "cfg", "tok")
MEASURED_MS = 5.0  # a token's prefill, as the engine of the tests below says


def _restored(client: Client, restores: int, identity: EngineIdentity = IDENTITY) -> None:
    """A 64-token entry stored under identity, then restored restores times."""
    model = tiny_llama()
    tokens = prompt(64)
    ticket = client.put(identity, tokens, prefill(model, tokens))
    assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
    for _ in range(restores):
        assert client.get(identity, [*tokens, 7], model=model) is not None


def test_prefill_saved_is_the_restored_tokens_at_the_measured_cost_and_estimates_say_so(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        client.measured_prefill(100, MEASURED_MS / 10)  # sent with the puts
        _restored(client, 2)
        mine = _identity_status(client)
        assert mine["prefill_ms_per_token"] == MEASURED_MS
        assert mine["prefill_saved_s"] == mine["prefill_saved_s_24h"] == 2 * 64 * 0.005
        assert mine["prefill_saved_estimated_s"] == 0
        # An identity no engine measured: valued at the measured ones' mean, an estimate.
        with Client.connect(daemon.socket_path, require=True) as unmeasured:
            _restored(unmeasured, 1, UNMEASURED)
        status: dict[str, Any] = dict(client.status())
    digest = UNMEASURED.to_protocol().digest()
    (other,) = [i for i in status["identities"] if i["identity"] == digest]
    assert other["prefill_ms_per_token"] is None
    assert other["prefill_saved_s"] == other["prefill_saved_estimated_s"] == 64 * 0.005
    assert status["prefill_saved_s"] == status["prefill_saved_s_24h"] == 3 * 64 * 0.005
    assert status["prefill_saved_estimated_s"] == 64 * 0.005


def test_restore_latencies_are_counted_in_the_same_buckets_on_every_daemon(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        _restored(client, 3)
        status: dict[str, Any] = dict(client.status())
        mine = _identity_status(client)
    bounds = status["restore_ms_bounds"]
    assert bounds == sorted(bounds)
    assert (bounds[0], bounds[-1]) == (1.0, 60_000.0)
    for figures in (mine, status):
        buckets = figures["restore_ms_buckets"]
        assert len(buckets) == len(bounds)
        assert buckets == sorted(buckets)  # cumulative
        assert buckets[-1] <= figures["restores"] == 3
        assert figures["restore_ms_sum"] > 0
        # The median's estimate (log buckets, within 12%) lies under the bound of the
        # exported bucket that holds the second sample.
        second = next(i for i, count in enumerate(buckets) if count >= 2)
        assert figures["restore_ms"]["p50"] <= bounds[second] * 1.12


def test_the_metrics_say_engine_held_prefill_saved_and_restore_buckets(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        client.measured_prefill(100, MEASURED_MS / 10)
        _restored(client, 1)
        assert client.get(IDENTITY, [*prompt(64), 7], model=tiny_llama(), min_tokens=65) is None
    families = {f.name: f for f in text_string_to_metric_families(kvctl(daemon, "metrics").stdout)}

    def value(name: str, **labels: str) -> float:
        (found,) = [
            s.value
            for f in families.values()
            for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]
        return found

    digest = IDENTITY.to_protocol().digest()
    assert value("kvd_engine_held_total") == value("kvd_identity_engine_held_total") == 1
    assert value("kvd_misses_total") == 0
    assert value("kvd_prefill_saved_seconds_total") == 64 * 0.005
    assert value("kvd_identity_prefill_saved_seconds_total", identity=digest) == 64 * 0.005
    assert value("kvd_identity_prefill_seconds_per_token", identity=digest) == 0.005
    assert families["kvd_restore_duration_seconds"].type == "histogram"
    assert value("kvd_restore_duration_seconds_count") == 1
    assert value("kvd_restore_duration_seconds_bucket", le="+Inf") == 1
    assert value("kvd_restore_duration_seconds_bucket", le="60.0") == 1
    assert value("kvd_identity_restore_duration_seconds_count", identity=digest) == 1
    assert value("kvd_identity_restore_duration_seconds_sum", identity=digest) > 0
