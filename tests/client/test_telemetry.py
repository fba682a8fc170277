"""The engines' word on each restore and store reaches the daemon's status per identity: a
real daemon, tiny real models, Client.put and Client.get."""

from __future__ import annotations

from typing import Any

from daemon_process import Daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
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
        status = dict(client.status())
        mine = _identity_status(client)
    assert mine["model_id"] == "tiny/telemetry"
    assert (mine["entries"], mine["bytes_written"]) == (1, mine["bytes"])
    assert status["bytes_written_24h"] == mine["bytes"]
    assert mine["hits"] == 1  # the one the engine used; the rejected one became a miss
    assert mine["misses_by_reason"] == {"no entry": 1, "model": 1}
    assert (mine["restores"], mine["tokens_restored"]) == (1, 64)
    assert status["tokens_restored"] == 64
    p50 = mine["restore_ms"]["p50"]
    assert p50 is not None
    assert 0 < p50 <= mine["restore_ms"]["p99"]
    assert mine["restore_gb_per_s"] > 0
    assert mine["store_ms"]["p50"] is not None
