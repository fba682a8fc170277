"""Files leave the tier at once and are unlinked off the event loop (kvd/store/deleter.py): the
place is free for a new file straight away, the bytes go soon after, and what a stop left
to delete is deleted at the next start."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from daemon_e2e import IDENTITY as RAW_IDENTITY
from daemon_e2e import RawPeer, staging_files
from daemon_process import running_daemon
from kvd_client import Client, TicketState
from kvd_protocol import Identity, LayerSpec, TensorSpec
from kvd_protocol import messages as m

from kvd.store.deleter import SUFFIX, Deleter

IDENTITY = Identity("deleter/model", "cfg", "tok", "codecs/1", "mlx/cpu")
SETTLE_SECONDS = 10.0  # how long the deleter's thread may take (an eventual result, not a speed)


def settled(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + SETTLE_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_deleted_file_leaves_its_place_at_once_and_is_unlinked_after(tmp_path: Path) -> None:
    folder = tmp_path / "deleting"
    folder.mkdir()
    path = tmp_path / "entry.kve"
    path.write_bytes(b"x" * 4096)
    Deleter(folder).delete(path)
    assert not path.exists()
    assert settled(lambda: not any(folder.iterdir()))


def test_a_new_file_in_the_place_of_a_deleted_one_is_kept(tmp_path: Path) -> None:
    """Entries and blocks are named by content: the same name comes back at once."""
    folder = tmp_path / "deleting"
    folder.mkdir()
    path = tmp_path / "block.kvb"
    path.write_bytes(b"old")
    deleter = Deleter(folder)
    deleter.delete(path)
    path.write_bytes(b"new")
    assert settled(lambda: not any(folder.iterdir()))
    assert path.read_bytes() == b"new"


def test_a_path_already_gone_is_no_error(tmp_path: Path) -> None:
    folder = tmp_path / "deleting"
    folder.mkdir()
    Deleter(folder).delete(tmp_path / "never.kve")
    assert not any(folder.iterdir())


def test_the_folder_is_made_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "entry.kve"
    path.write_bytes(b"x")
    Deleter(tmp_path / "deleting").delete(path)
    assert not path.exists()
    assert settled(lambda: not any((tmp_path / "deleting").iterdir()))


def test_a_file_that_cannot_be_moved_stays(tmp_path: Path) -> None:
    """Another file system: rename cannot move it (EXDEV), so nothing is moved or queued."""
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
        assert path.read_bytes() == b"x"
        assert (deleter.pending_bytes, deleter.deleted) == (0, 0)
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
    """Evicted entries leave entries/ at once, deleting/ empties, the same prompt put again
    straight after its eviction is stored and served, and a file left in deleting/ while the
    daemon was down is gone after its next start."""
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
    """pending_bytes is what the free-disk floor counts on as freed: every moved file's
    allocated bytes, until the thread takes it; wait_idle() returns once all are unlinked."""
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
    """Out of staging at once, then unlinked from deleting/ by the deleter's thread."""
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        put = peer.begin(RAW_IDENTITY, [1, 2, 3], seed=1)
        assert len(staging_files(daemon.tier)) == 1
        reply = peer.call(m.PutAbort(id=peer.next_id(), put=put))
        assert isinstance(reply, m.PutAbortReply)
        assert staging_files(daemon.tier) == []
        with Client.connect(daemon.socket_path, require=True) as client:
            assert settled(lambda: client.status()["deleted_files"] == 1)
            assert client.status()["deleting_bytes"] == 0
        assert not any((daemon.tier / "deleting").iterdir())
