"""The upload queue across restarts, end to end: real daemons, a real SeaweedFS. Uploads
still queued when the daemon stops (kill -9, SIGTERM) are offered again at the next start and
reach the bucket; those whose entry went meanwhile are counted dropped and flush --remote says
so; a damaged journal is a warning, never a crash; the journal stays small."""

from __future__ import annotations

import json
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, Begun, look_up, manifest_plan, put_v2, read_manifest
from daemon_e2e import IDENTITY, RawPeer
from daemon_process import Daemon, kvctl, running_daemon
from remote_e2e import (
    dropped_since,
    flush_remote,
    flush_said,
    remote_flags,
    remote_status,
    stored,
    wait_remote,
)
from seaweed import Seaweed

from kvd.remote import journal_format, keys
from kvd.remote.bucket import Bucket
from kvd.store.tier_dir import TierDir

DIGEST = IDENTITY.digest()


def prompt(n: int, blocks: int) -> list[int]:
    """A prompt of its own (no block shared with another n), of whole blocks and a tail."""
    return [n * 10_000 + i for i in range(blocks * BLOCK_TOKENS + 3)]


BLOCK_SIZE = manifest_plan(IDENTITY, prompt(0, 1)).block_size


def missing_blocks(bucket: Bucket, prefix: str, entries: list[Begun]) -> list[str]:
    objects = stored(bucket, prefix)
    return [
        key
        for begun in entries
        for key in (keys.block_key("", DIGEST, block) for block in begun.manifest.hashes)
        if key not in objects
    ]


def events(daemon: Daemon, name: str) -> list[dict[str, object]]:
    found = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    return [e for e in found if e.get("event") == name]


def queue_slowly(daemon: Daemon, peer: RawPeer, count: int) -> list[Begun]:
    """count entries of three blocks each, put into a daemon that sends one block a second:
    returned once the journal holds every upload still pending (at least two)."""
    entries = [put_v2(peer, IDENTITY, prompt(n, 3)) for n in range(1, count + 1)]
    wait_remote(
        peer,
        lambda r: r["journal_uploads"] == r["pending_uploads"] >= 2,
        "the pending uploads written to the journal",
    )
    return entries


def test_uploads_a_kill_cut_off_are_offered_again_at_the_next_start_and_all_arrive(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    slow = remote_flags(seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE)
    with running_daemon(tmp_path, slow) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            entries = queue_slowly(daemon, peer, 4)
            pending = remote_status(peer)["pending_uploads"]
        daemon.kill()
        assert missing_blocks(seaweed_bucket, s3_prefix, entries), "the kill cut uploads off"
        daemon.flags = remote_flags(seaweed, tmp_path, s3_prefix)  # an honest, fast bucket
        daemon.start()
        with RawPeer(daemon.socket_path) as peer:
            done = flush_remote(daemon)
            assert done.returncode == 0, done.stdout + done.stderr
            assert done.stdout.strip() == "durable and uploaded"
            now = remote_status(peer)
            assert now["restart_uploads"] >= pending - 1  # the one in flight may have ended
            assert now["restart_reoffered"] == now["restart_uploads"]
            assert now["restart_gone"] == 0
            assert (now["journal_uploads"], now["pending_uploads"]) == (0, 0)
    assert missing_blocks(seaweed_bucket, s3_prefix, entries) == []
    (resumed,) = events(daemon, "remote_uploads_resumed")
    assert resumed["reoffered"] == resumed["pending"]


def test_uploads_a_sigterm_cut_off_are_offered_again_at_the_next_start(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    slow = remote_flags(seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE)
    with running_daemon(tmp_path, slow) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            entries = queue_slowly(daemon, peer, 4)
        assert daemon.stop() == 0
        assert missing_blocks(seaweed_bucket, s3_prefix, entries), "the stop cut uploads off"
        daemon.flags = remote_flags(seaweed, tmp_path, s3_prefix)
        daemon.start()
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
    assert missing_blocks(seaweed_bucket, s3_prefix, entries) == []


def test_second_hit_uploads_a_kill_cut_off_go_without_another_hit(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    slow = remote_flags(seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE, upload="second-hit")
    with running_daemon(tmp_path, slow) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            entries = [put_v2(peer, IDENTITY, prompt(n, 3)) for n in (1, 2, 3)]
            for n in (1, 2, 3):
                assert look_up(peer, IDENTITY, prompt(n, 3)) is not None
            wait_remote(
                peer,
                lambda r: r["journal_uploads"] == r["pending_uploads"] >= 2,
                "the hit entries' uploads written to the journal",
            )
        daemon.kill()
        daemon.flags = remote_flags(seaweed, tmp_path, s3_prefix, upload="second-hit")
        daemon.start()
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
    assert missing_blocks(seaweed_bucket, s3_prefix, entries) == []


def test_an_entry_gone_before_the_restart_is_counted_dropped_and_flush_says_so(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    slow = remote_flags(seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE)
    with running_daemon(tmp_path, slow) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            entries = queue_slowly(daemon, peer, 4)
        assert daemon.stop() == 0
        journal = TierDir(daemon.tier).upload_journal
        pending = journal_format.replay(journal.read_bytes()).pending
        last = TierDir(daemon.tier).entry_path(DIGEST, list(pending)[-1])  # queued, not sent
        hashes = read_manifest(last).block_hashes
        (gone,) = [b for b in entries if b.manifest.hashes == hashes]
        last.unlink()  # the entry removed while the daemon was stopped
        daemon.flags = remote_flags(seaweed, tmp_path, s3_prefix)
        daemon.start()
        with RawPeer(daemon.socket_path) as peer:
            done = flush_remote(daemon)
            assert done.returncode == 1, done.stdout + done.stderr
            assert flush_said(done) == [
                f"not done: 0 puts not durable, 0 uploads (0 B) still pending, {dropped_since(1)}"
            ]
            now = remote_status(peer)
            assert (now["restart_uploads"], now["restart_gone"]) == (len(pending), 1)
            assert now["restart_reoffered"] == len(pending) - 1
            assert now["upload_drops"] == 1
            again = flush_remote(daemon)
            assert again.returncode == 0, "said once"
            metrics = kvctl(daemon, "metrics").stdout
            assert "kvd_remote_restart_gone 1.0" in metrics
            assert f"kvd_remote_restart_uploads {len(pending)}.0" in metrics
            shown = kvctl(daemon, "status").stdout
            (row,) = [line for line in shown.splitlines() if line.startswith("upload journal")]
            assert row.endswith(
                f"; from before the restart {len(pending)}: {len(pending) - 1} offered again, "
                "1 gone"
            ), row
    kept = [b for b in entries if b is not gone]
    assert missing_blocks(seaweed_bucket, s3_prefix, kept) == []
    (dropped,) = events(daemon, "remote_upload_dropped")
    assert (dropped["entry"], dropped["why"]) == (last.stem, "gone")


def test_a_damaged_journal_is_a_warning_and_the_newest_entries_are_offered_again(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    slow = remote_flags(seaweed, tmp_path, s3_prefix, upload_rate=BLOCK_SIZE)
    with running_daemon(tmp_path, slow) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            entries = queue_slowly(daemon, peer, 4)
        assert daemon.stop() == 0
        journal = TierDir(daemon.tier).upload_journal
        journal.write_bytes(b"\x89PNG not a journal at all" * 40)
        daemon.flags = remote_flags(seaweed, tmp_path, s3_prefix)
        daemon.start()
        with RawPeer(daemon.socket_path) as peer:
            done = flush_remote(daemon)
            assert done.returncode == 0, done.stdout + done.stderr
            now = remote_status(peer)
            assert now["journal_problem"].startswith("not an upload journal")
            assert now["restart_uploads"] == 0
        (warned,) = events(daemon, "remote_upload_journal_damaged")
        assert warned["level"] == "warning"
    assert missing_blocks(seaweed_bucket, s3_prefix, entries) == []
    assert journal.read_bytes().startswith(journal_format.MAGIC), "written anew"


def test_the_journal_stays_small_however_many_uploads_pass(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """Every upload is two records (joined, left); the journal is compacted when the records
    left behind dominate, so after 300 uploads it holds at most the smallest journal worth
    compacting, not 600 records."""
    count = 300
    flags = remote_flags(seaweed, tmp_path, s3_prefix)
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        for n in range(1, count + 1):
            put_v2(peer, IDENTITY, prompt(n, 1))
        done = flush_remote(daemon, wait_s=120)
        assert done.returncode == 0, done.stdout + done.stderr
        now = wait_remote(peer, lambda r: r["journal_uploads"] == 0, "the journal emptied")
        assert now["uploaded_blocks"] == count
        size = TierDir(daemon.tier).upload_journal.stat().st_size
        bound = len(journal_format.MAGIC) + journal_format.COMPACT_MIN * journal_format.RECORD.size
        assert size <= bound < 2 * count * journal_format.RECORD.size


def test_a_journal_that_cannot_be_read_or_written_is_said_and_the_uploads_go_on(
    seaweed: Seaweed, seaweed_bucket: Bucket, s3_prefix: str, tmp_path: Path
) -> None:
    """A folder where the journal's file should be: start-up says it cannot read it, every
    write says it cannot write it (once), and the uploads reach the bucket all the same."""
    journal = TierDir(tmp_path / "tier").upload_journal
    journal.mkdir(parents=True)
    flags = remote_flags(seaweed, tmp_path, s3_prefix)
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        entries = [put_v2(peer, IDENTITY, prompt(n, 2)) for n in (1, 2)]
        done = flush_remote(daemon)
        assert done.returncode == 0, done.stdout + done.stderr
        now = wait_remote(peer, lambda r: "cannot write" in (r["journal_problem"] or ""), "said")
        assert now["uploaded_blocks"] == 4
        (unreadable,) = events(daemon, "remote_upload_journal_damaged")
        assert str(unreadable["why"]).startswith("unreadable: ")
        (failed,) = events(daemon, "remote_upload_journal_failed")
        assert failed["level"] == "warning"
    assert missing_blocks(seaweed_bucket, s3_prefix, entries) == []
