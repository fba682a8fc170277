"""kvctl verify against a real daemon: every durable entry checked whole, each damaged one
named, the exit code saying whether any was, and --repair quarantining them."""

from __future__ import annotations

import io
import os
from pathlib import Path

from daemon_e2e import IDENTITY, OTHER_IDENTITY, put_stored
from daemon_process import Daemon, kvctl
from kvd_client.client import Client
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS

from kvd.progress import Progress
from kvd.store.entry_files import read_header


def _put(daemon: Daemon, identity: Identity, first: int) -> str:
    """A stored entry of 32 tokens starting with first (no two share a prefix); its id."""
    with Client.connect(daemon.socket_path, require=True) as client:
        before = {e.id for e in client.list_entries()}
        put_stored(client, identity, [first, *range(1, 32)], seed=first)
        (entry,) = {e.id for e in client.list_entries()} - before
        return entry


def _spoil(daemon: Daemon, identity: Identity, entry: str) -> Path:
    """Bit rot: one bit flipped in the middle of the entry's first tensor while the daemon is
    stopped, the file's times kept, so that nothing but reading the data can tell."""
    path = daemon.tier / "entries" / identity.digest() / f"{entry}.kve"
    slot = read_header(path, DEFAULT_LIMITS).layers[0].slots[0]
    daemon.stop()
    times = path.stat()
    with path.open("r+b") as file:
        file.seek(slot.start + slot.nbytes // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x40]))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    daemon.start()
    return path


def test_verify_names_each_damaged_entry_and_repair_quarantines_it(daemon: Daemon) -> None:
    ids = [_put(daemon, IDENTITY, first) for first in (100, 200, 300)]
    clean = kvctl(daemon, "verify")
    assert (clean.returncode, clean.stdout.strip()) == (0, "3 entries verified, 0 damaged")

    spoiled = _spoil(daemon, IDENTITY, ids[1])
    found = kvctl(daemon, "verify")
    assert found.returncode == 1
    assert f"damaged {ids[1]}" in found.stdout
    assert ids[0] not in found.stdout
    assert found.stdout.strip().endswith("3 entries verified, 1 damaged")
    assert spoiled.exists()  # no repair: only named

    repaired = kvctl(daemon, "verify", "--repair")
    assert repaired.returncode == 1
    assert f"damaged {ids[1]}" in repaired.stdout
    assert "(quarantined)" in repaired.stdout
    assert not spoiled.exists()
    assert (daemon.tier / "quarantine" / spoiled.name).exists()
    with Client.connect(daemon.socket_path, require=True) as client:
        assert sorted(e.id for e in client.list_entries()) == sorted([ids[0], ids[2]])
    after = kvctl(daemon, "verify")
    assert (after.returncode, after.stdout.strip()) == (0, "2 entries verified, 0 damaged")


def test_verify_of_one_identity_checks_only_its_entries(daemon: Daemon) -> None:
    _put(daemon, IDENTITY, 100)
    _spoil(daemon, OTHER_IDENTITY, _put(daemon, OTHER_IDENTITY, 200))
    mine = kvctl(daemon, "verify", "--identity", IDENTITY.digest())
    assert (mine.returncode, mine.stdout.strip()) == (0, "1 entries verified, 0 damaged")
    assert kvctl(daemon, "verify").returncode == 1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_only() -> None:
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress("verifying", 4, stream)
        for _ in range(4):
            progress.step()
        progress.close()
    assert "verifying [" in terminal.getvalue()
    assert "4/4 (100%)" in terminal.getvalue()
    assert terminal.getvalue().endswith("\r\033[K")  # the line is cleared at the end
    assert pipe.getvalue() == ""
