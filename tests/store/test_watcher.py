"""Entry files removed or added behind the daemon's back are noticed while it runs."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
from daemon_process import Daemon
from kvd_client import Client, TicketState
from kvd_protocol import Identity, LayerSpec, TensorSpec

IDENTITY = Identity(
    model_id="watch/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
WAIT_SECONDS = 20.0  # watchfiles batches changes for up to a couple of seconds


def put(client: Client, tokens: list[int]) -> None:
    spec = TensorSpec("float32", (1, 2, len(tokens), 4))
    tensors = [np.full(spec.shape, len(tokens), np.float32) for _ in range(2)]
    ticket = client.put_entry(IDENTITY, tokens, [LayerSpec("kv", (spec, spec), False)], tensors)
    assert ticket.wait(30) == TicketState("stored")


def wait_for_entries(client: Client, count: int) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while client.status()["entries"] != count:
        assert time.monotonic() < deadline, f"status never showed {count} entries"
        time.sleep(0.05)


def entry_files(daemon: Daemon) -> list[Path]:
    return sorted((daemon.tier / "entries").glob("*/*.kve"))


def test_a_deleted_file_leaves_the_index(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put(client, list(range(1, 41)))
        (path,) = entry_files(daemon)
        path.unlink()
        wait_for_entries(client, 0)
        assert client.lookup(IDENTITY, list(range(1, 45))) is None
        assert client.status()["bytes"] == 0


def test_a_copied_in_file_is_adopted_and_garbage_is_quarantined(
    daemon: Daemon, tmp_path: Path
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put(client, list(range(1, 41)))
        (path,) = entry_files(daemon)
        saved = tmp_path / path.name
        shutil.copy(path, saved)
        assert client.evict(all=True).entries == 1
        wait_for_entries(client, 0)

        shutil.copy(saved, path.parent.parent / "incoming.tmp")
        (path.parent.parent / "incoming.tmp").rename(path)  # appears whole, as rsync does
        wait_for_entries(client, 1)
        hit = client.lookup(IDENTITY, list(range(1, 45)))
        assert hit is not None
        with hit:
            assert hit.matched == 40
            hit.verify()

        (path.parent / ("0" * 32 + ".kve")).write_bytes(b"not an entry")
        deadline = time.monotonic() + WAIT_SECONDS
        while client.status()["quarantined"] != 1:
            assert time.monotonic() < deadline, "the garbage file was never quarantined"
            time.sleep(0.05)
        assert (daemon.tier / "quarantine" / ("0" * 32 + ".kve")).exists()
        assert client.status()["entries"] == 1
