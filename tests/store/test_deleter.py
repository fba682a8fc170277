"""Files leave the tier off the event loop (kvd/store/deleter.py): let go of at once, then
moved out of their place and unlinked on the deleter's own thread; never taken for the
tier's own meanwhile, a file placed at a leaving path is kept, the bytes count as pending
until freed, and what a stop left to delete is deleted at the next start."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from blocks_e2e import (
    BLOCK_TOKENS,
    Begun,
    assert_counts_equal_the_directory,
    begin,
    commit,
    look_up,
    put_v2,
    same,
    status,
    wait,
    write_blocks,
)
from daemon_e2e import IDENTITY as RAW_IDENTITY
from daemon_e2e import RawPeer, staging_files, wait_until
from daemon_process import running_daemon
from fault_shim import built_or_skip
from kvd_client import Client, TicketState
from kvd_protocol import Identity, LayerSpec, TensorSpec
from kvd_protocol import messages as m

from kvd.store.deleter import SUFFIX, Deleter

IDENTITY = Identity("deleter/model", "cfg", "tok", "codecs/1", "mlx/cpu")
SETTLE_SECONDS = 10.0  # how long the deleter's thread may take (an eventual result, not a speed)
RENAME_HOLD_SHIM = Path(__file__).with_name("rename_hold_shim.c")


def settled(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + SETTLE_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Gate(threading.Event):
    """Set: the deleter's thread renames. held: it has come to a rename and waits."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()


@contextmanager
def held_renames(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """The deleter's thread stops at each rename until the gate is set (then, at the end)."""
    gate = Gate()
    rename = os.rename

    def held_rename(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        if threading.current_thread().name == "kvd-deleter":
            gate.held.set()
            gate.wait(SETTLE_SECONDS)
        rename(source, target)

    monkeypatch.setattr(os, "rename", held_rename)
    try:
        yield gate
    finally:
        gate.set()


def test_a_deleted_file_is_let_go_of_at_once_then_moved_and_unlinked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "deleting"
    folder.mkdir()
    path = tmp_path / "entry.kve"
    path.write_bytes(b"x" * 4096)
    deleter = Deleter(folder)
    with held_renames(monkeypatch) as gate:
        deleter.delete(path)  # returns with the thread's rename held
        assert deleter.leaving(path)
        assert deleter.pending_files == 1
        assert deleter.pending_bytes == path.stat().st_blocks * 512
        gate.set()
        deleter.wait_idle()
    assert not path.exists()
    assert not deleter.leaving(path)
    assert (deleter.pending_files, deleter.pending_bytes, deleter.deleted) == (0, 0, 1)
    assert not any(folder.iterdir())


def test_a_file_placed_where_one_is_leaving_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks are named by content: the same name comes back at once. The placer reclaims the
    path first (moving the leaving file itself); the thread then leaves the new file alone."""
    folder = tmp_path / "deleting"
    folder.mkdir()
    first, path = tmp_path / "first.kvb", tmp_path / "block.kvb"
    first.write_bytes(b"first")
    path.write_bytes(b"old")
    deleter = Deleter(folder)
    with held_renames(monkeypatch) as gate:
        deleter.delete(first)  # the thread holds this one at its rename ...
        deleter.delete(path)  # ... so this one is still in its place, leaving
        deleter.reclaim(path)
        assert not path.exists()
        assert not deleter.leaving(path)
        path.write_bytes(b"new")
        gate.set()
        deleter.wait_idle()
        assert settled(lambda: not any(folder.iterdir()))
    assert path.read_bytes() == b"new"
    assert (deleter.pending_bytes, deleter.deleted) == (0, 2)


def test_a_placer_waits_for_the_rename_under_way_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread is renaming the very path: reclaim() returns once the file is out of it."""
    folder = tmp_path / "deleting"
    folder.mkdir()
    path = tmp_path / "block.kvb"
    path.write_bytes(b"old")
    deleter = Deleter(folder)
    with held_renames(monkeypatch) as gate:
        deleter.delete(path)
        assert gate.held.wait(SETTLE_SECONDS), "the deleter's thread never came to the rename"
        reclaimed = threading.Thread(target=deleter.reclaim, args=(path,))
        reclaimed.start()
        reclaimed.join(0.2)
        assert reclaimed.is_alive(), "reclaim() returned with the file still in its place"
        assert path.read_bytes() == b"old"
        gate.set()
        reclaimed.join(SETTLE_SECONDS)
        assert not reclaimed.is_alive()
        assert not path.exists()
        path.write_bytes(b"new")
        deleter.wait_idle()
    assert path.read_bytes() == b"new"
    assert (deleter.pending_bytes, deleter.deleted) == (0, 1)


def test_a_path_deleted_twice_is_let_go_of_once(tmp_path: Path) -> None:
    folder = tmp_path / "deleting"
    folder.mkdir()
    path = tmp_path / "entry.kve"
    path.write_bytes(b"x" * 4096)
    deleter = Deleter(folder)
    deleter.delete(path)
    deleter.delete(path)
    deleter.wait_idle()
    assert (deleter.pending_bytes, deleter.deleted) == (0, 1)


def test_a_path_already_gone_is_no_error(tmp_path: Path) -> None:
    folder = tmp_path / "deleting"
    folder.mkdir()
    deleter = Deleter(folder)
    deleter.delete(tmp_path / "never.kve")
    assert (deleter.pending_files, deleter.pending_bytes) == (0, 0)
    assert not any(folder.iterdir())


def test_the_folder_is_made_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "entry.kve"
    path.write_bytes(b"x")
    deleter = Deleter(tmp_path / "deleting")
    deleter.delete(path)
    deleter.wait_idle()
    assert not path.exists()
    assert not any((tmp_path / "deleting").iterdir())


def test_a_file_that_cannot_be_moved_stays(tmp_path: Path) -> None:
    """Another file system: rename cannot move it (EXDEV), so nothing is unlinked."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here to be another file system")
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same file system as the temp folder")
    folder = tmp_path / "deleting"
    folder.mkdir()
    path = Path("/dev/shm") / f"kvd-deleter-test-{os.getpid()}"
    path.write_bytes(b"x")
    try:
        deleter = Deleter(folder)
        deleter.delete(path)
        deleter.wait_idle()
        assert path.read_bytes() == b"x"
        assert (deleter.pending_bytes, deleter.deleted) == (0, 0)
        assert not deleter.leaving(path)
        assert not any(folder.iterdir())
    finally:
        path.unlink(missing_ok=True)


def test_reap_deletes_what_an_earlier_run_left(tmp_path: Path) -> None:
    folder = tmp_path / "deleting"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}{SUFFIX}").write_bytes(b"left")
    assert Deleter(folder).reap() == 3
    assert settled(lambda: not any(folder.iterdir()))
    assert Deleter(tmp_path / "never-made").reap() == 0


def test_a_daemon_evicts_through_the_deleter_and_reaps_at_start(tmp_path: Path) -> None:
    """Evicted entries leave entries/ once the deleter is idle, deleting/ empties, the same
    prompt put again straight after its eviction is stored and served, and a file left in
    deleting/ while the daemon was down is gone after its next start."""
    tokens = list(range(1, 40))
    spec = TensorSpec("float32", (1, 2, len(tokens), 4))
    tensors = [np.full(spec.shape, 3.0, np.float32) for _ in range(2)]
    layers = [LayerSpec("kv", (spec, spec), False)]
    with running_daemon(tmp_path) as daemon:
        deleting = daemon.tier / "deleting"
        with Client.connect(daemon.socket_path, require=True) as client:
            for _ in range(3):
                ticket = client.put_entry(IDENTITY, tokens, layers, tensors)
                assert ticket.wait(30) == TicketState("stored")
                assert len(list((daemon.tier / "entries").rglob("*.kve"))) == 1
                assert client.evict(all=True).entries == 1
                assert settled(lambda: client.status()["deleting_files"] == 0)
                assert not list((daemon.tier / "entries").rglob("*.kve"))
            ticket = client.put_entry(IDENTITY, tokens, layers, tensors)
            assert ticket.wait(30) == TicketState("stored")
            hit = client.lookup(IDENTITY, [*tokens, 7])
            assert hit is not None
            with hit:
                assert hit.summary.tokens == len(tokens)
            assert settled(lambda: client.status()["deleted_files"] == 3)  # through deleting/
        assert settled(lambda: not any(deleting.iterdir()))
        assert daemon.stop() == 0
        left = deleting / f"left{SUFFIX}"
        left.write_bytes(b"x" * 4096)
        daemon.start()
        assert settled(lambda: not left.exists())
        with Client.connect(daemon.socket_path, require=True) as client:
            assert client.status()["entries"] == 1


def test_moved_files_count_as_pending_until_unlinked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pending_bytes is what the free-disk floor counts on as freed: every file's allocated
    bytes from the moment it is let go of until unlinked; wait_idle() returns once all are."""
    folder = tmp_path / "deleting"
    folder.mkdir()
    gate = threading.Event()
    unlink = os.unlink

    def held_unlink(path: str | os.PathLike[str]) -> None:
        gate.wait(SETTLE_SECONDS)
        unlink(path)

    monkeypatch.setattr(os, "unlink", held_unlink)  # the deleter's thread, while the test runs
    deleter = Deleter(folder)
    paths = [tmp_path / f"{i}.kve" for i in range(20)]
    for path in paths:
        path.write_bytes(b"x" * (1 << 20))
    allocated = [path.stat().st_blocks * 512 for path in paths]
    for path in paths:
        deleter.delete(path)
    # The thread holds the first file at its unlink: all 20 still count until unlinked.
    assert deleter.pending_bytes == sum(allocated)
    assert deleter.deleted == 0
    gate.set()
    deleter.wait_idle()
    assert (deleter.pending_bytes, deleter.deleted) == (0, 20)
    assert not any(folder.iterdir())


def test_an_aborted_puts_staging_file_goes_through_the_deleter(tmp_path: Path) -> None:
    """Out of staging, then unlinked from deleting/, by the deleter's thread."""
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        put = peer.begin(RAW_IDENTITY, [1, 2, 3], seed=1)
        assert len(staging_files(daemon)) == 1
        reply = peer.call(m.PutAbort(id=peer.next_id(), put=put))
        assert isinstance(reply, m.PutAbortReply)
        with Client.connect(daemon.socket_path, require=True) as client:
            assert settled(lambda: client.status()["deleted_files"] == 1)
            assert staging_files(daemon) == []
            assert client.status()["deleting_bytes"] == 0
        assert not any((daemon.tier / "deleting").iterdir())


@pytest.fixture
def rename_hold_shim(tmp_path: Path) -> Path:
    return built_or_skip(tmp_path, RENAME_HOLD_SHIM, "HELD RENAME")


def test_a_held_rename_holds_up_no_request_and_brings_no_file_back(
    tmp_path: Path, rename_hold_shim: Path
) -> None:
    """Every rename into deleting/ held (as one waiting on a busy journal is) for as long as
    the test likes: lookups, puts and status are answered meanwhile (each within the peer's
    timeout; a rename on the event loop would hold them all); the evicted entry's files wait
    in their place, not served and not adopted back by a full reconcile; a put of the same
    prompt (its blocks at the very paths leaving) is stored once the renames go on, and
    served whole; and then every file the daemon let go of is gone."""
    gone_prompt = list(range(1, 1 + 2 * BLOCK_TOKENS + 3))
    kept_prompt = list(range(5000, 5000 + 2 * BLOCK_TOKENS + 3))
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, ["--reconcile-interval", "0.2"]) as daemon:
        assert daemon.stop() == 0
        daemon.start(
            {
                "LD_PRELOAD": str(rename_hold_shim),
                "HOLD_SHIM_DIR": os.path.realpath(daemon.tier / "deleting"),
                "HOLD_SHIM_FILE": str(hold),
            }
        )
        with RawPeer(daemon.socket_path) as peer:
            gone = put_v2(peer, RAW_IDENTITY, gone_prompt)
            placed = {p: p.read_bytes() for p in (daemon.tier / "entries").rglob("*.kv[be]")}
            hold.touch()
            with Client.connect(daemon.socket_path, require=True) as client:
                assert client.evict(all=True).entries == 1
            kept = put_v2(peer, RAW_IDENTITY, kept_prompt)
            assert look_up(peer, RAW_IDENTITY, [*gone_prompt, 7]) is None
            for _ in range(20):
                assert same(look_up(peer, RAW_IDENTITY, [*kept_prompt, 7]), kept)
            now = status(peer)
            assert now["entries"] == 1
            assert now["deleting_files"] == len(placed)  # the manifest and its blocks
            assert all(path.read_bytes() == data for path, data in placed.items())  # in place
            # An identity folder with nothing in it goes at a full reconcile: once it is gone,
            # one has listed the leaving files, and left them alone.
            marker = daemon.tier / "entries" / ("0" * 32)
            marker.mkdir()
            wait_until(lambda: not marker.exists(), "a full reconcile")
            assert look_up(peer, RAW_IDENTITY, [*gone_prompt, 7]) is None
            assert status(peer)["entries"] == 1
            again = begin(peer, RAW_IDENTITY, gone_prompt)
            assert isinstance(again, Begun)
            assert again.held == 0  # its blocks were collected: written again, same paths
            write_blocks(peer, again)
            ticket = commit(peer, again.put)
            assert isinstance(ticket, int), ticket
            assert same(look_up(peer, RAW_IDENTITY, [*kept_prompt, 7]), kept)  # still answered
            hold.unlink()
            assert wait(peer, ticket).state == "stored"
            assert same(look_up(peer, RAW_IDENTITY, [*gone_prompt, 7]), gone)
            assert_counts_equal_the_directory(peer, daemon.tier)
            assert status(peer)["entries"] == 2
        assert not any((daemon.tier / "deleting").iterdir())
