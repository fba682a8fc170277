"""Restarts with the index snapshot: unchanged files come from it, the rest is scanned."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from daemon_process import Daemon, running_daemon
from kvd_client import Client, TicketState
from kvd_protocol import Identity, LayerSpec, TensorSpec

IDENTITY = Identity(
    model_id="snap/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)


def put(client: Client, tokens: list[int]) -> None:
    spec = TensorSpec("float32", (1, 2, len(tokens), 4))
    tensors = [np.full(spec.shape, tokens[0], np.float32) for _ in range(2)]
    ticket = client.put_entry(IDENTITY, tokens, [LayerSpec("kv", (spec, spec), False)], tensors)
    assert ticket.wait(30) == TicketState("stored")


def opened(daemon: Daemon) -> dict[str, object]:
    """The last tier_opened event in the daemon's JSON log."""
    events = [json.loads(line) for line in daemon.logs().splitlines() if "tier_opened" in line]
    event: dict[str, object] = events[-1]
    return event


def disk_bytes(daemon: Daemon) -> int:
    return sum(p.stat().st_size for p in (daemon.tier / "entries").glob("*/*.kve"))


def test_restart_uses_the_snapshot_and_checks_it_against_the_directory(tmp_path: Path) -> None:
    prompts = [[first, *range(100, 130)] for first in (1, 2, 3)]
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            for prompt in prompts:
                put(client, prompt)
        assert daemon.stop() == 0
        assert (daemon.tier / "index.snapshot").exists()

        # Behind the daemon's back: one entry deleted, one garbage file added.
        files = sorted((daemon.tier / "entries").glob("*/*.kve"))
        files[0].unlink()
        (files[1].parent / ("f" * 32 + ".kve")).write_bytes(b"garbage")

        daemon.start()
        event = opened(daemon)
        assert event["entries"] == 2
        assert event["from_snapshot"] == 2
        assert event["quarantined"] == 1
        with Client.connect(daemon.socket_path, require=True) as client:
            status = client.status()
            assert status["entries"] == 2
            assert status["bytes"] == disk_bytes(daemon)
            hits = [client.lookup(IDENTITY, [*prompt, 7]) for prompt in prompts]
            assert sum(hit is not None for hit in hits) == 2
            for hit in hits:
                if hit is not None:
                    with hit:
                        hit.verify()


def test_a_corrupt_snapshot_falls_back_to_a_full_scan(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put(client, list(range(1, 33)))
            put(client, list(range(50, 90)))
        assert daemon.stop() == 0
        snapshot = daemon.tier / "index.snapshot"
        data = bytearray(snapshot.read_bytes())
        data[-1] ^= 0xFF
        snapshot.write_bytes(bytes(data))

        daemon.start()
        event = opened(daemon)
        assert event["entries"] == 2
        assert event["from_snapshot"] == 0
        with Client.connect(daemon.socket_path, require=True) as client:
            assert client.status()["bytes"] == disk_bytes(daemon)
