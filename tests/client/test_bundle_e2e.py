"""An entry carried to a daemon that never saw it: `kvctl export` on one real daemon, `kvctl
import` on another with its own folder, and the restore there continues a tiny mlx-lm model
exactly as one from the first daemon does (tokens and logits equal)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol.blocks import BLOCK_SUFFIX
from tiny_models import greedy, prefill, prompt, tiny_llama

BLOCK = 16  # tokens per block: a tiny prompt spans several
STEPS = 4
SETTLE_SECONDS = 30.0
PATIENT: dict[str, Any] = {
    "require": True,
    "block_tokens": BLOCK,
    "lookup_timeout": SETTLE_SECONDS,
}


def _files(tier: Path) -> dict[str, bytes]:
    """The tier's entry and block files by name (an entry's name is its id: set aside)."""
    found = {}
    for path in (tier / "entries").rglob("*"):
        if path.is_file() and path.suffix in (BLOCK_SUFFIX, ".kve"):
            name = path.name if path.suffix == BLOCK_SUFFIX else "manifest"
            found[name] = path.read_bytes()
    return found


def test_an_exported_entry_restores_exactly_on_a_daemon_that_never_saw_it(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = tiny_llama()
    identity = EngineIdentity("tiny/carried", "cfg", "tok")
    tokens = prompt(5 * BLOCK + 7, seed=3)
    # Gets that may wait as long as a put: a loaded machine's slow one is no miss here.
    with Client.connect(daemon.socket_path, **PATIENT) as source:
        stored = source.put(identity, tokens, prefill(model, tokens)).wait(SETTLE_SECONDS)
        assert stored == TicketState("stored")
        (entry,) = source.list_entries()
        digest = source.scoped(identity.to_protocol()).digest()
        here = source.get(identity, [*tokens, 9], model=model)
        assert here is not None
        want = greedy(model, here.cache, [9], STEPS)
    bundle = tmp_path / "carried.kvdb"
    exported = kvctl(
        daemon, "export", "--identity", digest, "--entry", entry.id[:8], "--output", str(bundle)
    )
    assert exported.returncode == 0, exported.stderr
    assert entry.id in exported.stdout
    with running_daemon(tmp_path / "elsewhere") as other:
        imported = kvctl(other, "import", str(bundle))
        assert imported.returncode == 0, imported.stderr
        (new_id,) = imported.stdout.split()
        assert _files(other.tier) == _files(daemon.tier)  # byte for byte, blocks and manifest
        with Client.connect(other.socket_path, **PATIENT) as target:
            (listed,) = target.list_entries()
            assert listed.id == new_id
            assert (listed.tokens, listed.bytes) == (entry.tokens, entry.bytes)
            there = target.get(identity, [*tokens, 9], model=model)
            assert there is not None
            assert there.matched == len(tokens)
            got = greedy(model, there.cache, [9], STEPS)
        assert got[0] == want[0]
        assert bool(mx.array_equal(got[1], want[1]).item())
        again = kvctl(other, "import", str(bundle))
        assert again.returncode == 0, again.stderr
        assert again.stdout.split() == ["held", "already", "(duplicate):", new_id]
