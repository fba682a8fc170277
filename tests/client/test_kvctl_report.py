"""kvctl as an operator reads it, against a real daemon that tiny real models used: status
names the models and shows their restores, list and show describe the entries."""

from __future__ import annotations

import json
import re

from daemon_process import Daemon, kvctl
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from tiny_models import prefill, prompt, tiny_llama

IDENTITY = EngineIdentity("tiny/report", "cfg", "tok", namespace="tenant-a")


def _used(daemon: Daemon) -> tuple[str, str]:
    """Two entries of the model, one restored twice, and one miss; (restored id, other id)."""
    model = tiny_llama()
    with Client.connect(daemon.socket_path, require=True) as client:
        for first in (1, 2):
            tokens = [first, *prompt(48)]
            ticket = client.put(IDENTITY, tokens, prefill(model, tokens))
            assert ticket.wait(30) == TicketState("stored")
        for _ in range(2):
            assert client.get(IDENTITY, [1, *prompt(48), 5], model=model) is not None
        assert client.get(IDENTITY, [9, 9, 9], model=model) is None
        entries = client.list_entries()
    (restored,) = [e.id for e in entries if e.used]
    (other,) = [e.id for e in entries if e.id != restored]
    return restored, other


def test_status_names_each_model_with_its_hit_ratio_and_restore_times(daemon: Daemon) -> None:
    _used(daemon)
    shown = kvctl(daemon, "status")
    assert shown.returncode == 0, shown.stderr
    (row,) = [line for line in shown.stdout.splitlines() if line.startswith("tiny/report")]
    cells = row.split()
    # name (the model's only identity: its model id), digest, entries, bytes (2 cells), hits,
    # engine-held, misses, hit %, prefill saved start/24h, p50/p95/p99, tokens...
    assert cells[:2] == ["tiny/report", IDENTITY.to_protocol().digest()[:12]]
    assert cells[2] == "2"
    assert (cells[5], cells[6], cells[7], cells[8]) == ("2", "0", "1", "66.7%")
    assert re.fullmatch(r"~\d+\.\d\d/~\d+\.\d\d", cells[9])  # an estimate: no cost measured
    assert re.fullmatch(r"\d+\.\d/\d+\.\d/\d+\.\d", cells[10])
    assert cells[11] == "98"  # the whole 49-token entry, restored twice
    assert "98 prompt tokens not computed" in shown.stdout


def test_watch_refreshes_with_rates_per_second(daemon: Daemon) -> None:
    _used(daemon)
    watched = kvctl(daemon, "status", "--watch", "--interval", "0.2", "--count", "2")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count("daemon  ") == 2  # two tables, one after the other off a tty
    assert "per second" in watched.stdout.split("daemon  ")[-1]


def test_list_has_a_header_model_names_and_sorts(daemon: Daemon) -> None:
    restored, other = _used(daemon)
    listed = kvctl(daemon, "list")
    assert listed.returncode == 0, listed.stderr
    header, first, _ = listed.stdout.splitlines()
    assert header.split()[:4] == ["entry", "identity", "tokens", "bytes"]
    assert first.startswith(restored)  # by last use: the restored one first
    assert first.split()[1] == "tiny/report"
    leases_end = header.index("leases") + len("leases")  # a column flush right
    assert first[:leases_end].split()[-1] == "0"  # no lease on it now
    assert first[leases_end:].split()[0] == "-"  # not retained
    by_id = kvctl(daemon, "list", "--sort", "id").stdout.splitlines()[1:]
    assert [line.split()[0] for line in by_id] == sorted([restored, other])


def test_show_gives_the_header_layers_and_checksums(daemon: Daemon) -> None:
    restored, _ = _used(daemon)
    shown = kvctl(daemon, "show", restored)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^model id\s+tiny/report$", shown.stdout, re.MULTILINE)
    assert re.search(r"^namespace\s+tenant-a$", shown.stdout, re.MULTILINE)
    assert re.search(r"^tokens\s+49 ", shown.stdout, re.MULTILINE)
    assert re.search(r"^leases\s+0$", shown.stdout, re.MULTILINE)
    described = json.loads(kvctl(daemon, "show", restored, "--json").stdout)
    assert described["header"]["tokens"] == 49
    layers = described["header"]["layers"]
    assert len(layers) == 2  # the tiny llama's two layers
    assert all(len(s["xxh3_64"]) == 16 for layer in layers for s in layer["slots"])
    for slot in layers[0]["slots"]:
        assert slot["xxh3_64"] in shown.stdout
    missing = kvctl(daemon, "show", "0" * 32)
    assert missing.returncode == 1
    assert (
        missing.stderr.strip()
        == f"kvctl: no entry's id is or begins {'0' * 32}: `kvctl list` shows them"
    )
