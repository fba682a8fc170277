"""The quarantine folder: a file moved aside is counted once, whoever asks how many times."""

from __future__ import annotations

from pathlib import Path

import anyio

from kvd.store.counters import Counters
from kvd.store.quarantine import Quarantine
from kvd.store.tier_dir import TierDir


def test_a_file_two_checks_quarantine_at_once_is_counted_once(tmp_path: Path) -> None:
    dirs = TierDir(tmp_path)
    dirs.create()
    spoiled = dirs.entries / "0123" / "e.kve"
    spoiled.parent.mkdir()
    spoiled.write_bytes(b"not an entry")
    counters = Counters()
    quarantine = Quarantine(dirs, 1 << 20, counters)

    async def both() -> None:
        await quarantine.file(spoiled, "the watcher found it bad")
        await quarantine.file(spoiled, "a client reported it")  # gone already: not again
        quarantine.now(spoiled, "a lookup found it bad")

    anyio.run(both)
    assert counters.quarantined == 1
    assert [p.name for p in dirs.quarantine.iterdir()] == ["e.kve"]
