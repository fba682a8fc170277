"""SIGTERM with an upload stuck in a bucket that never answers: the daemon ends within
`shutdown_deadline` and a small fixed margin, exit 0, and the upload it cut off is in the
journal for the next start (a real daemon, the fake bucket hanging the block PUTs)."""

from __future__ import annotations

import time
from pathlib import Path

from blocks_e2e import BLOCK_TOKENS, put_v2
from daemon_e2e import IDENTITY, RawPeer, wait_until
from daemon_process import running_daemon
from fake_bucket import hang, key_has, running_bucket
from remote_e2e import remote_flags, remote_status

from kvd.remote import journal_format
from kvd.store.tier_dir import TierDir

SHUTDOWN_DEADLINE_S = 1.0
STOP_MARGIN_S = 5.0  # generous: the machine is loaded; the bucket's hang is 600 s


def test_sigterm_ends_the_daemon_on_time_while_an_upload_hangs_in_the_bucket(
    tmp_path: Path,
) -> None:
    with running_bucket() as bucket:
        bucket.on(key_has("/b/", "PUT"), hang(bucket))
        flags = remote_flags(bucket, tmp_path, "team", request_timeout=600)
        flags += ["--shutdown-deadline", str(SHUTDOWN_DEADLINE_S)]
        with running_daemon(tmp_path, flags) as daemon:
            with RawPeer(daemon.socket_path) as peer:
                put_v2(peer, IDENTITY, list(range(2 * BLOCK_TOKENS + 3)))
                wait_until(lambda: bucket.asked("PUT", "/b/") >= 1, "a block PUT in the bucket")
                assert remote_status(peer)["pending_uploads"] == 1
            began = time.monotonic()
            assert daemon.stop() == 0
            took = time.monotonic() - began
            journal = TierDir(daemon.tier).upload_journal
            pending = journal_format.replay(journal.read_bytes()).pending
    assert took < SHUTDOWN_DEADLINE_S + STOP_MARGIN_S, f"stopped after {took:.1f} s"
    assert len(pending) == 1, "the upload cut off waits in the journal for the next start"
