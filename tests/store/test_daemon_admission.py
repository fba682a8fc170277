"""Write admission against a real daemon: each policy of the table writes what it should,
refuses the rest at put_begin with its reason, and counts what it saved."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from daemon_e2e import IDENTITY, SETTLE_SECONDS, entry, files_on_disk, put_stored
from daemon_process import running_daemon
from kvd_client.client import Client


def _put(client: Client, tokens: list[int], seed: int = 1) -> tuple[str, str | None]:
    layers, tensors = entry(len(tokens), seed)
    state = client.put_entry(IDENTITY, tokens, layers, tensors).wait(SETTLE_SECONDS)
    return state.state, state.reason


def _admission(client: Client) -> dict[str, Any]:
    status: dict[str, Any] = dict(client.status())
    return dict(status["admission"])


def test_always_writes_every_put(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon, Client.connect(daemon.socket_path) as client:
        assert _put(client, [1, 2, 3]) == ("stored", None)
        assert _admission(client) == {"policy": "always", "refused": 0, "saved_bytes": 0}


def test_min_tokens_writes_only_long_prefixes(tmp_path: Path) -> None:
    flags = ["--admission", "min-tokens", "--admission-min-tokens", "64"]
    with running_daemon(tmp_path, flags) as daemon, Client.connect(daemon.socket_path) as client:
        state, reason = _put(client, list(range(100, 132)))
        assert state == "failed"
        assert reason is not None
        assert "not admitted: 32 tokens, fewer than 64" in reason
        assert _put(client, list(range(100, 164))) == ("stored", None)
        admission = _admission(client)
        assert (admission["refused"], admission["policy"]) == (1, "min-tokens")
        assert admission["saved_bytes"] > 0
        assert files_on_disk(daemon)[0] == 1


def test_second_hit_writes_a_prefix_put_twice_or_asked_for_first(tmp_path: Path) -> None:
    flags = ["--admission", "second-hit"]
    with running_daemon(tmp_path, flags) as daemon, Client.connect(daemon.socket_path) as client:
        once = list(range(10, 42))
        state, reason = _put(client, once)
        assert state == "failed"
        assert reason is not None
        assert "first sighting" in reason
        assert _put(client, once) == ("stored", None)  # seen before: written
        asked = list(range(50, 82))
        assert client.lookup(IDENTITY, [*asked, 7]) is None  # a lookup is a sighting too
        assert _put(client, asked) == ("stored", None)
        assert _admission(client)["refused"] == 1
        assert files_on_disk(daemon)[0] == 2


def test_second_hit_forgets_a_sighting_after_its_window(tmp_path: Path) -> None:
    flags = ["--admission", "second-hit", "--admission-window", "0.3"]
    with running_daemon(tmp_path, flags) as daemon, Client.connect(daemon.socket_path) as client:
        tokens = list(range(10, 42))
        assert _put(client, tokens)[0] == "failed"
        time.sleep(0.5)
        assert _put(client, tokens)[0] == "failed"  # too late: a first sighting again
        assert _put(client, tokens) == ("stored", None)
        put_stored(client, IDENTITY, tokens, seed=2)  # now a duplicate: kept as it is
        assert _admission(client)["refused"] == 2
