"""The caps and the crash cases, measured while they happen: the write-behind cap sampled
during a burst under each policy, the tier cap across identities and after a restart with a
lower cap, a disk that fills in the middle of a write, and clients killed while committing
and while waiting for room."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_e2e import (
    ENTRY_BYTES,
    IDENTITY,
    OTHER_IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    files_on_disk,
    looked_up_tokens,
    put_stored,
    python_child,
    report,
    staging_files,
    wait_until,
)
from daemon_process import Daemon, running_daemon, socket_folder
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.identity import Identity

BURST = 8
BIG_TOKENS = 512
BIG_WIDTH = 512  # 1 MiB per tensor, 4 MiB per entry
BIG_BYTES = 16384 + 4 * 2 * BIG_TOKENS * BIG_WIDTH * 2  # 4 float16 tensors of (1, 2, 512, 512)
THIRD_IDENTITY = Identity(
    model_id="e2e/model-c",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)


def _tokens(first: int, count: int = 32) -> list[int]:
    return [first, *range(count - 1)]


@contextmanager
def sampled(socket_path: str, key: str) -> Iterator[list[int]]:
    """Samples of a status figure (a dotted key), taken as fast as the daemon answers on a
    connection of their own, until the block ends."""
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with Client.connect(socket_path, require=True) as client:
            while not done.is_set():
                value: object = client.status()
                for part in key.split("."):
                    assert isinstance(value, dict)
                    value = value[part]
                assert isinstance(value, int)
                samples.append(value)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield samples
    finally:
        done.set()
        sampler.join()


def _begin_big(peer: RawPeer, first: int) -> int:
    return peer.begin(IDENTITY, _tokens(first, BIG_TOKENS), seed=first, width=BIG_WIDTH)


@pytest.mark.parametrize("policy", ["drop-oldest", "refuse", "block"])
def test_the_write_behind_cap_holds_all_through_a_burst(tmp_path: Path, policy: str) -> None:
    cap = 2 * BIG_BYTES  # the one in flight and one more: drop-oldest has a queued one to drop
    flags = ["--writeback-max-bytes", str(cap), "--writeback-policy", policy]
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        puts = [_begin_big(peer, i) for i in range(BURST)]
        with sampled(daemon.socket_path, "writeback.pending_bytes") as pending:
            peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
            replies = [peer.receive() for _ in puts]
            flushed = peer.call(m.Flush(id=peer.next_id(), timeout=SETTLE_SECONDS))
        assert isinstance(flushed, m.FlushReply)
        assert flushed.pending == 0
        assert len(pending) > 10, "too few samples to see the burst"
        assert max(pending) > 0, "the burst never showed in the queue"
        assert max(pending) <= cap, f"pending bytes over the cap: {max(pending)} > {cap}"
        committed = [r for r in replies if isinstance(r, m.PutCommitReply)]
        if policy == "block":
            assert len(committed) == BURST  # every putter waited its turn
        with Client.connect(daemon.socket_path, require=True) as client:
            status = report(client)
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon.tier)


def test_the_tier_cap_holds_across_identities_and_after_a_restart_with_a_lower_cap(
    tmp_path: Path,
) -> None:
    identities = [IDENTITY, OTHER_IDENTITY, THIRD_IDENTITY]
    cap = 6 * ENTRY_BYTES
    with running_daemon(tmp_path, ["--max-bytes", str(cap)]) as daemon:
        with (
            Client.connect(daemon.socket_path, require=True) as client,
            sampled(daemon.socket_path, "bytes") as tier_bytes,
        ):
            for first in range(12):  # round robin: each identity's oldest goes first
                put_stored(client, identities[first % 3], _tokens(first), seed=first)
            assert client.flush(SETTLE_SECONDS)
            status = report(client)
            kept = {e.id for e in client.list_entries()}
        assert max(tier_bytes) <= cap
        assert status["bytes"] == cap
        assert status["evictions"] == 6
        assert len(status["identities"]) == 3  # the cap spans them all: two of each kept
        assert {i["entries"] for i in status["identities"]} == {2}
        assert len(kept) == 6
        assert daemon.stop() == 0

        daemon.flags = ["--max-bytes", str(3 * ENTRY_BYTES)]
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            after = report(client)
            assert after["bytes"] <= 3 * ENTRY_BYTES
            assert (after["entries"], after["bytes"]) == files_on_disk(daemon.tier)
            for first in range(9, 12):  # the three most recent stay
                assert looked_up_tokens(client, identities[first % 3], [*_tokens(first), 1])
            for first in range(9):
                assert not looked_up_tokens(client, identities[first % 3], [*_tokens(first), 1])


def test_a_disk_that_fills_in_the_middle_of_a_write_stops_nothing(small_disk: Path) -> None:
    """Staging files are reserved whole at put_begin, so the write that meets a full disk
    mid-way is the daemon's own: the snapshot (here, tokens make it several hundred KiB)."""
    flags = ["--min-free", "0", "--max-bytes", "1G", "--snapshot-interval", "0.2"]
    with socket_folder() as sockets:
        daemon = Daemon(
            small_disk / "tier", os.path.join(sockets, "kvd.sock"), small_disk.parent / "log", flags
        )
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            prompts = [[first, *range(4000, 8000)] for first in range(24)]  # 16 KiB of tokens
            for seed, prompt in enumerate(prompts):
                put_stored(client, IDENTITY, prompt, seed=seed)
            put_stored(client, IDENTITY, [99, *range(40)], seed=99)
            filler = small_disk / "filler"
            with filler.open("wb") as file:  # the rest of the disk, but 64 KiB
                try:
                    while True:
                        file.write(b"\0" * 65536)
                        file.flush()
                except OSError:
                    pass
            os.truncate(filler, max(0, filler.stat().st_size - 65536))
            # A change to snapshot that takes no space: the snapshot needs more than is free.
            small = next(e for e in client.list_entries() if e.tokens == 41)
            assert client.evict(entry=small.id).entries == 1
            wait_until(lambda: '"snapshot_failed"' in daemon.logs(), "the snapshot meets ENOSPC")
            assert client.ping() >= 0
            for prompt in prompts:  # every entry still served, and whole
                assert looked_up_tokens(client, IDENTITY, [*prompt, 1]) == len(prompt)
            status = report(client)
            assert (status["entries"], status["bytes"]) == files_on_disk(small_disk / "tier")
        assert daemon.stop() == 0  # the snapshot at shutdown fails too: still a clean stop
        assert not (small_disk / "tier" / "index.snapshot.tmp").exists()
        failures = [json.loads(x) for x in daemon.logs().splitlines() if "snapshot_failed" in x]
        assert all("No space left" in f["error"] for f in failures)
        filler.unlink()
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            assert report(client)["entries"] == len(prompts)
        daemon.stop()


COMMIT_AND_VANISH = """
    import sys
    sys.path.insert(0, sys.argv[1])
    from daemon_e2e import IDENTITY, RawPeer
    from kvd_protocol import messages as m

    peer = RawPeer(sys.argv[2])
    puts = [peer.begin(IDENTITY, [i, *range(511)], seed=i, width=512) for i in range(6)]
    peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
    print("ready", flush=True)
    input()
"""


def _settled_and_consistent(daemon: Daemon, client: Client) -> int:
    """After the dead client's commits settled: nothing staged, the status equal to the
    directory, every entry whole; how many of its entries were stored."""
    # A staged file is a put queued or still being committed: none left means all settled
    # (a flush alone would not wait for commits that join the queue after it).
    wait_until(lambda: not staging_files(daemon.tier), "nothing is left in staging")
    assert client.flush(SETTLE_SECONDS)
    status = report(client)
    assert status["writeback"]["pending_bytes"] == 0
    assert (status["entries"], status["bytes"]) == files_on_disk(daemon.tier)
    stored = 0
    for i in range(6):
        found = looked_up_tokens(client, IDENTITY, [i, *range(511), 1])  # verified if found
        stored += found is not None
    assert stored == status["entries"]
    return stored


def test_a_client_killed_while_committing_leaves_whole_entries_or_none(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        with python_child(COMMIT_AND_VANISH, daemon.socket_path) as child:
            child.kill()  # its commits are in the daemon's hands, some not yet answered
        _settled_and_consistent(daemon, client)
        put_stored(client, IDENTITY, _tokens(100), seed=100)  # the daemon goes on


def test_a_client_killed_while_waiting_for_room_leaves_nothing_behind(tmp_path: Path) -> None:
    flags = ["--writeback-max-bytes", str(BIG_BYTES), "--writeback-policy", "block"]
    flags += ["--writeback-block-timeout", "60"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        with python_child(COMMIT_AND_VANISH, daemon.socket_path) as child:

            def commits_waiting() -> bool:
                # Staged files not in the queue: commits taken and waiting for room.
                queued: int = report(client)["writeback"]["pending_count"]
                return len(staging_files(daemon.tier)) - queued >= 2

            wait_until(commits_waiting, "commits wait for room in the queue")
            child.kill()
        stored = _settled_and_consistent(daemon, client)
        assert stored < 6  # those that waited never joined the queue
        put_stored(client, IDENTITY, _tokens(100), seed=100)
