"""A daemon started from its snapshot serves before it has listed the directory: meanwhile it
hands out only files still as the snapshot recorded them, and what the listing finds (files
added while it was down, or changed) appears once the listing ends."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import numpy as np
import pytest
from daemon_process import OPENED, running_daemon
from entry_samples import write
from fault_shim import built_or_skip
from kvd_client import Client, TicketState
from kvd_protocol import Identity, LayerSpec, TensorSpec, plan_entry
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

from kvd.config import Config
from kvd.store.tier import Tier
from kvd.store.tier_dir import TierDir, new_entry_id

IDENTITY = Identity(
    model_id="listing/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
HOLD_SHIM = Path(__file__).with_name("hold_shim.c")


@pytest.fixture
def hold_shim(tmp_path: Path) -> Path:
    return built_or_skip(tmp_path, HOLD_SHIM, "HELD LISTING")


def prompt(first: int) -> list[int]:
    return [first, *range(100, 130)]


def put(client: Client, tokens: list[int]) -> Path:
    """Store an entry of tokens; its file's path under the tier."""
    spec = TensorSpec("float32", (1, 2, len(tokens), 4))
    tensors = [np.full(spec.shape, tokens[0], np.float32) for _ in range(2)]
    ticket = client.put_entry(IDENTITY, tokens, [LayerSpec("kv", (spec, spec), False)], tensors)
    assert ticket.wait(30) == TicketState("stored")
    hit = client.lookup(IDENTITY, [*tokens, 7])
    assert hit is not None
    with hit:
        return Path("entries") / IDENTITY.digest() / f"{hit.summary.id}.kve"


def served(client: Client, tokens: list[int]) -> bool:
    """Whether a lookup of tokens finds their entry (checked whole when it does)."""
    hit = client.lookup(IDENTITY, [*tokens, 7])
    if hit is None:
        return False
    with hit:
        assert hit.matched == len(tokens)
        hit.verify()
    return True


def test_before_the_listing_only_unchanged_files_are_served(
    tmp_path: Path, hold_shim: Path
) -> None:
    gone, changed, kept, added = prompt(1), prompt(2), prompt(3), prompt(4)
    with (
        running_daemon(tmp_path / "elsewhere") as other,  # the entry copied in later
        Client.connect(other.socket_path, require=True) as client,
    ):
        copied = other.tier / put(client, added)
    with running_daemon(tmp_path / "main") as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            named = {"gone": gone, "changed": changed, "kept": kept}
            files = {name: daemon.tier / put(client, tokens) for name, tokens in named.items()}
        assert daemon.stop() == 0

        # While it is down: one file removed, one touched (still valid), one copied in.
        files["gone"].unlink()
        info = files["changed"].stat()
        os.utime(files["changed"], ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
        shutil.copy(copied, files["kept"].parent / copied.name)

        hold = tmp_path / "hold"
        hold.touch()
        held = {
            "LD_PRELOAD": str(hold_shim),
            "HOLD_SHIM_DIR": os.path.realpath(daemon.tier / "entries"),
            "HOLD_SHIM_FILE": str(hold),
        }
        opened = daemon.logs().count(OPENED)
        daemon.start(held, settled=False)
        with Client.connect(daemon.socket_path, require=True) as client:
            assert client.status()["entries"] == 3  # the snapshot's, not checked yet
            assert not served(client, gone)  # a miss, and the entry dropped
            assert not served(client, changed)  # a miss, the entry forgotten ...
            assert files["changed"].exists()  # ... and its file kept, to be read again
            assert not served(client, added)  # not listed yet
            assert served(client, kept)
            assert client.status()["entries"] == 1
            assert daemon.logs().count(OPENED) == opened  # the listing is still held

            hold.unlink()
            daemon.wait_settled(opened, timeout=20)
            assert served(client, changed)
            assert served(client, added)
            assert served(client, kept)
            assert not served(client, gone)
            status = client.status()
            assert status["entries"] == 3
            assert status["quarantined"] == 0


def test_no_snapshot_is_written_before_the_listing_has_checked_the_last_one(
    tmp_path: Path,
) -> None:
    config = Config(dir=tmp_path / "tier", socket=tmp_path / "kvd.sock", min_free=0)
    dirs = TierDir(config.dir)
    dirs.create()
    spec = TensorSpec("float16", (1, 2, 16, 8))
    layer = LayerSpec("kv", (spec, spec), trimmable=False)
    plan = plan_entry(IDENTITY, pack_tokens(range(16)), [layer], created=1.0, min_reuse=0)
    path = dirs.entry_path(IDENTITY.digest(), new_entry_id())
    path.parent.mkdir(parents=True)
    path.write_bytes(write(plan)[0])

    async def scenario() -> None:
        first = Tier(config, DEFAULT_LIMITS)
        await first.life.open()  # a full scan: settled at once
        await first.life.save_snapshot()
        first.life.close()
        written = dirs.snapshot.stat().st_ino
        tier = Tier(config, DEFAULT_LIMITS)
        await tier.life.open()  # from the snapshot, its rows not checked yet
        try:
            await tier.life.save_snapshot()
            assert dirs.snapshot.stat().st_ino == written  # not replaced
            await tier.life.settle()
            await tier.life.save_snapshot()
            assert dirs.snapshot.stat().st_ino != written
            assert len(tier.catalog) == 1
        finally:
            tier.life.close()

    anyio.run(scenario)
