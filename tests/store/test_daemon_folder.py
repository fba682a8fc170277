"""Whatever appears in the tier directory behind the daemon's back is adopted, quarantined or
ignored with a log line, and never stops the daemon; no file is handed out unchecked."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from daemon_e2e import (
    IDENTITY,
    OTHER_IDENTITY,
    RawPeer,
    put_stored,
    report,
    staging_files,
    wait_until,
)
from daemon_process import Daemon, running_daemon
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode
from kvd_protocol.tokens import pack_tokens

DATA_START = 16384  # the first tensor's offset in these small entries
SHORT, LONG = list(range(1, 41)), list(range(1, 81))  # untrimmable: LONG supersedes nothing


def entry_file(daemon: Daemon, identity_digest: str | None = None) -> list[Path]:
    folders = [identity_digest] if identity_digest else ["*"]
    return sorted(p for f in folders for p in (daemon.tier / "entries").glob(f"{f}/*.kve"))


@pytest.fixture
def watched(daemon: Daemon) -> Daemon:
    """The daemon, once its watch of the entries folder has begun."""
    wait_until(lambda: watch_runs(daemon, daemon.tier / "entries"), "the watch runs")
    return daemon


def raw_lookup(socket_path: str, tokens: list[int]) -> m.LookupReply:
    """A lookup as the daemon answers it, before any client-side check; the descriptor is
    closed and the lease released."""
    with RawPeer(socket_path) as peer:
        reply = peer.call(
            m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(tokens))
        )
        assert isinstance(reply, m.LookupReply), reply
        if reply.fd is not None:
            os.close(reply.fd)
        if reply.lease is not None:
            assert isinstance(
                peer.call(m.Release(id=peer.next_id(), lease=reply.lease)), m.ReleaseReply
            )
    return reply


def events(daemon: Daemon, name: str) -> list[dict[str, object]]:
    return [e for line in daemon.logs().splitlines() if (e := json.loads(line))["event"] == name]


def ignored(daemon: Daemon) -> set[str]:
    """The names of the files the daemon said it ignores."""
    return {Path(str(e["path"])).name for e in events(daemon, "foreign_file_ignored")}


def quarantined(daemon: Daemon) -> list[str]:
    return sorted(os.listdir(daemon.tier / "quarantine"))


def accounting_matches_directory(client: Client, daemon: Daemon) -> None:
    status = report(client)
    files = entry_file(daemon)
    assert (status["entries"], status["bytes"]) == (
        len(files),
        sum(f.stat().st_size for f in files),
    )


def test_a_copy_under_another_name_is_quarantined_as_a_duplicate(watched: Daemon) -> None:
    with Client.connect(watched.socket_path, require=True) as client:
        put_stored(client, IDENTITY, SHORT, seed=1, trimmable=False)
        (original,) = entry_file(watched)
        copy = original.parent / ("c" * 32 + ".kve")
        shutil.copy(original, original.parent / "copy.part")
        (original.parent / "copy.part").rename(copy)
        wait_until(lambda: copy.name in quarantined(watched), "the duplicate is quarantined")
        reasons = [e["reason"] for e in events(watched, "quarantined")]
        assert reasons == ["a duplicate of another entry"]
        assert entry_file(watched) == [original]
        assert raw_lookup(watched.socket_path, [*SHORT, 7]).matched == 40
        accounting_matches_directory(client, watched)


def test_a_symbolic_link_is_never_followed_or_handed_out(watched: Daemon, tmp_path: Path) -> None:
    with Client.connect(watched.socket_path, require=True) as client:
        put_stored(client, IDENTITY, SHORT, seed=1, trimmable=False)
        (original,) = entry_file(watched)
        outside = tmp_path / "outside.kve"
        shutil.copy(original, outside)  # a valid entry, but not the tier's file
        assert client.evict(all=True).entries == 1
        wait_until(lambda: not entry_file(watched), "the evicted file is gone")
        link = original.parent / ("a" * 32 + ".kve")
        link.symlink_to(outside)
        wait_until(lambda: link.name in quarantined(watched), "the link is quarantined")
        assert (watched.tier / "quarantine" / link.name).is_symlink()
        assert outside.exists()  # what it pointed to is not the tier's to move
        assert raw_lookup(watched.socket_path, [*SHORT, 7]).matched == 0
        # A linked identity folder is ignored, with a log line, and its entries never adopted.
        (original.parent.parent / ("b" * 64)).symlink_to(tmp_path, target_is_directory=True)
        wait_until(lambda: "b" * 64 in ignored(watched), "the linked folder is noted")
        assert report(client)["entries"] == 0


def test_files_that_are_not_entries_are_ignored_with_a_log_line(watched: Daemon) -> None:
    with Client.connect(watched.socket_path, require=True) as client:
        put_stored(client, IDENTITY, SHORT, seed=1, trimmable=False)
        (original,) = entry_file(watched)
        (original.parent / "notes.txt").write_text("not an entry")
        (original.parent.parent / "stray.bin").write_bytes(b"\0" * 100)
        wait_until(lambda: {"notes.txt", "stray.bin"} <= ignored(watched), "both are noted")
        assert (original.parent / "notes.txt").exists()  # left alone: not ours
        assert raw_lookup(watched.socket_path, [*SHORT, 7]).matched == 40
        accounting_matches_directory(client, watched)


def test_a_new_identity_folder_is_adopted_with_its_entries(watched: Daemon, tmp_path: Path) -> None:
    with Client.connect(watched.socket_path, require=True) as client:
        put_stored(client, OTHER_IDENTITY, SHORT, seed=1)
        put_stored(client, OTHER_IDENTITY, [9, *SHORT], seed=2)
        (folder,) = {p.parent for p in entry_file(watched)}
        saved = tmp_path / "saved"
        shutil.copytree(folder, saved)
        assert client.evict(all=True).entries == 2
        wait_until(lambda: not entry_file(watched), "the evicted files are gone")
        folder.rmdir()
        shutil.copytree(saved, folder)  # a restore from backup: the folder and its files at once
        wait_until(lambda: report(client)["entries"] == 2, "both entries are adopted")
        hit = client.lookup(OTHER_IDENTITY, [*SHORT, 7])
        assert hit is not None
        with hit:
            assert hit.matched == 40
            hit.verify()
        accounting_matches_directory(client, watched)


def test_a_file_truncated_in_place_is_quarantined_and_the_next_best_entry_answers(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, SHORT, seed=1, trimmable=False)
        put_stored(client, IDENTITY, LONG, seed=2, trimmable=False)
        longest = the_long_entry(daemon)
        os.truncate(longest, longest.stat().st_size // 2)
        # At once, before the watcher's batch: the daemon's own check of the descriptor.
        reply = raw_lookup(daemon.socket_path, [*LONG, 7])
        assert reply.matched == 40
        assert reply.entry is not None
        assert reply.entry.tokens == 40
        assert longest.name in quarantined(daemon)
        assert "file_size" in str(events(daemon, "quarantined")[0]["reason"])
        accounting_matches_directory(client, daemon)


def test_a_file_edited_in_place_is_checked_again_and_quarantined(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put_stored(client, IDENTITY, SHORT, seed=1, trimmable=False)
        # A fresh start, and a sign that its watch runs: the edit below is then an event of
        # its own, not merged into the watcher's batch for the file's arrival.
        assert daemon.stop() == 0
        daemon.start()
        (path,) = entry_file(daemon)
        wait_until(lambda: watch_runs(daemon, path.parent), "the watch runs")
        with path.open("r+b") as file:  # one flipped byte of the first tensor, size unchanged
            file.seek(DATA_START)
            first = file.read(1)
            file.seek(DATA_START)
            file.write(bytes([first[0] ^ 0xFF]))
        wait_until(lambda: path.name in quarantined(daemon), "the edited file is quarantined")
        assert events(daemon, "entry_modified_outside")
        assert raw_lookup(daemon.socket_path, [*SHORT, 7]).matched == 0
        with Client.connect(daemon.socket_path, require=True) as client:
            accounting_matches_directory(client, daemon)


def watch_runs(daemon: Daemon, folder: Path) -> bool:
    """Whether the daemon's watch has begun: it notes a file that is not an entry (one more
    such file each call, as one made before the watch began goes unseen)."""
    if events(daemon, "foreign_file_ignored"):
        return True
    (folder / f"sign-{len(list(folder.glob('sign-*')))}.txt").write_text("the watch runs?")
    time.sleep(0.2)
    return False


def the_long_entry(daemon: Daemon) -> Path:
    """The file of LONG (every small entry has the same size: found by a lookup)."""
    reply = raw_lookup(daemon.socket_path, [*LONG, 7])
    assert reply.entry is not None
    assert reply.matched == len(LONG)
    return daemon.tier / "entries" / reply.entry.identity / f"{reply.entry.id}.kve"


def test_the_snapshot_is_not_trusted_over_a_file_truncated_while_stopped(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put_stored(client, IDENTITY, SHORT, seed=1, trimmable=False)
            put_stored(client, IDENTITY, LONG, seed=2, trimmable=False)
            longest = the_long_entry(daemon)
        assert daemon.stop() == 0
        folder_mtime = longest.parent.stat().st_mtime_ns
        os.truncate(longest, 16384)
        os.utime(longest.parent, ns=(folder_mtime, folder_mtime))  # the folder looks unchanged
        daemon.start()
        assert raw_lookup(daemon.socket_path, [*LONG, 7]).matched == 40
        assert longest.name in quarantined(daemon)
        with Client.connect(daemon.socket_path, require=True) as client:
            accounting_matches_directory(client, daemon)


def test_a_removed_entries_folder_is_made_again_and_the_index_follows(watched: Daemon) -> None:
    with Client.connect(watched.socket_path, require=True) as client:
        put_stored(client, IDENTITY, SHORT, seed=1)
        shutil.rmtree(watched.tier / "entries")
        wait_until(lambda: report(client)["entries"] == 0, "the index empties")
        assert (watched.tier / "entries").is_dir()
        put_stored(client, IDENTITY, LONG, seed=2)
        assert raw_lookup(watched.socket_path, [*LONG, 7]).matched == 80
        # The watch runs again on the new folder: a file removed now is noticed.
        (path,) = entry_file(watched)
        path.unlink()
        wait_until(lambda: report(client)["entries"] == 0, "the removal is noticed")
        accounting_matches_directory(client, watched)


def test_a_failing_background_task_is_restarted_and_the_daemon_goes_on(watched: Daemon) -> None:
    watched.expect_errors("task_failed", "write_failed")  # provoked below
    with Client.connect(watched.socket_path, require=True) as client:
        put_stored(client, IDENTITY, SHORT, seed=1)
        shutil.rmtree(watched.tier / "entries")
        (watched.tier / "entries").write_bytes(b"")  # the watcher cannot make its folder again
        wait_until(lambda: len(events(watched, "task_failed")) >= 2, "the watcher fails again")
        assert {e["task"] for e in events(watched, "task_failed")} == {"watcher"}
        assert client.ping() >= 0
        (watched.tier / "entries").unlink()
        wait_until((watched.tier / "entries").is_dir, "the watcher runs again")
        wait_until(lambda: report(client)["entries"] == 0, "the index follows the folder")
        put_stored(client, IDENTITY, LONG, seed=2)
        assert raw_lookup(watched.socket_path, [*LONG, 7]).matched == 80
        accounting_matches_directory(client, watched)


def test_tensor_bytes_spoiled_before_the_commit_fail_it_and_the_writer_goes_on(
    daemon: Daemon,
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        put = peer.begin(IDENTITY, SHORT, seed=1)
        (staging,) = (daemon.tier / "staging").iterdir()
        with staging.open("r+b") as file:  # the header stays valid; a tensor's bytes do not
            file.seek(DATA_START)
            file.write(b"\xff\xff\xff\xff")
        refused = peer.call(m.PutCommit(id=peer.next_id(), put=put))
        assert isinstance(refused, m.ErrorReply), refused
        assert refused.code == ErrorCode.INVALID_ENTRY
        assert "data_checksum" in refused.message
    assert staging_files(daemon) == []
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, LONG, seed=2)  # the writer still writes
        accounting_matches_directory(client, daemon)
