"""kvctl against a real daemon: the status table, --json, and the operator commands."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from daemon_process import Daemon, kvctl
from kvd_client import Client, TicketState
from kvd_protocol import Identity, LayerSpec, TensorSpec

IDENTITY = Identity(
    model_id="kvctl/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)

# The keys `status` promises (README, kvctl status --json); more are welcome.
STATUS_KEYS = {
    "entries",
    "bytes",
    "max_bytes",
    "min_free_bytes",
    "disk_free_bytes",
    "hits",
    "misses",
    "evictions",
    "quarantined",
    "writeback",
    "identities",
    "clients",
    "daemon",
}
WRITEBACK_KEYS = {"pending_bytes", "pending_count", "max_bytes", "policy", "stored", "dropped"}
DAEMON_KEYS = {"pid", "rss_bytes", "uptime_s", "version"}


def put_one(daemon: Daemon, tokens: int) -> None:
    spec = TensorSpec("float32", (1, 2, tokens, 4))
    tensors = [np.ones(spec.shape, np.float32) for _ in range(2)]
    with Client.connect(daemon.socket_path, require=True) as client:
        ticket = client.put_entry(
            IDENTITY, list(range(tokens)), [LayerSpec("kv", (spec, spec), True)], tensors
        )
        assert ticket.wait(30) == TicketState("stored")


def test_status_json_has_every_documented_key(daemon: Daemon) -> None:
    put_one(daemon, 32)
    result = kvctl(daemon, "status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status.keys() >= STATUS_KEYS
    assert status["writeback"].keys() >= WRITEBACK_KEYS
    assert status["daemon"].keys() >= DAEMON_KEYS
    assert status["entries"] == 1
    (identity,) = status["identities"]
    assert {key: identity[key] for key in ("identity", "entries", "bytes")} == {
        "identity": IDENTITY.digest(),
        "entries": 1,
        "bytes": status["bytes"],
    }
    assert (identity["model_id"], identity["bytes_written"]) == ("kvctl/model", status["bytes"])
    assert status["daemon"]["pid"] == daemon.pid
    assert any(client["name"] == "kvctl" for client in status["clients"])


def test_status_table_shows_the_tier(daemon: Daemon) -> None:
    put_one(daemon, 32)
    result = kvctl(daemon, "status")
    assert result.returncode == 0, result.stderr
    assert "1 in 1 identities" in result.stdout
    # Models are named as people know them, not by digest.
    assert any(line.startswith("kvctl/model ") for line in result.stdout.splitlines())
    assert IDENTITY.digest() not in result.stdout
    assert f"pid {daemon.pid}" in result.stdout


def test_list_flush_and_evict(daemon: Daemon) -> None:
    put_one(daemon, 16)
    put_one(daemon, 48)  # a trimmable descendant: supersedes the 16-token entry once stored
    assert kvctl(daemon, "flush").stdout.strip() == "durable"
    listed = json.loads(kvctl(daemon, "list", "--json").stdout)
    assert [entry["tokens"] for entry in listed] == [48]
    evicted = kvctl(daemon, "evict", "--all")
    assert evicted.returncode == 0
    assert evicted.stdout.startswith("evicted 1 entries")
    assert json.loads(kvctl(daemon, "list", "--json").stdout) == []


def test_a_missing_daemon_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvd.ops.kvctl", "--socket", "/tmp/kvd-no-such/kvd.sock", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3
    assert "no kvd answers on /tmp/kvd-no-such/kvd.sock" in result.stderr


def test_show_takes_a_unique_prefix_of_an_entry_id(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        for n in range(17):  # 17 ids: two of them begin with the same hex digit
            spec = TensorSpec("float32", (1, 2, 8, 4))
            tensors = [np.full(spec.shape, n, np.float32) for _ in range(2)]
            layers = [LayerSpec("kv", (spec, spec), True)]
            tokens = list(range(100 * n, 100 * n + 8))
            assert client.put_entry(IDENTITY, tokens, layers, tensors).wait(30).state == "stored"
        ids = [e.id for e in client.list_entries(IDENTITY)]
    first = {i[0]: [j for j in ids if j[0] == i[0]] for i in ids}
    alone = next(i for i in ids if len({j for j in ids if j.startswith(i[:6])}) == 1)
    shown = kvctl(daemon, "show", alone[:6].upper(), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == alone
    digit, sharing = next((d, group) for d, group in first.items() if len(group) > 1)
    ambiguous = kvctl(daemon, "show", digit)
    assert ambiguous.returncode == 2
    assert f"'{digit}' begins {len(sharing)} entries' ids" in ambiguous.stderr
    assert all(f"  {i}  {IDENTITY.digest()}" in ambiguous.stderr for i in sharing)
    unknown = kvctl(daemon, "show", "0" * 32 if "0" * 32 not in ids else "f" * 32)
    assert unknown.returncode == 1
    assert "no entry's id is or begins" in unknown.stderr
