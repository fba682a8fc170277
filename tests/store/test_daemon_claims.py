"""The caps and the crash cases, measured while they happen: the write-behind cap sampled
during a burst under each policy, the tier cap across identities and after a restart with a
lower cap, a disk that fills in the middle of a write, and clients killed while committing
and while waiting for room."""

from __future__ import annotations

import errno
import json
import os
import select
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
    entry,
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
from kvd_protocol.errors import ErrorCode
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
def sampled(socket_path: str, *keys: str) -> Iterator[list[int]]:
    """Samples of the sum of status figures (dotted keys), taken as fast as the daemon
    answers on a connection of their own, until the block ends."""
    samples: list[int] = []
    done = threading.Event()

    def figure(status: object, key: str) -> int:
        for part in key.split("."):
            assert isinstance(status, dict)
            status = status[part]
        assert isinstance(status, int)
        return status

    def sample() -> None:
        with Client.connect(socket_path, require=True) as client:
            while not done.is_set():
                status = client.status()
                samples.append(sum(figure(status, key) for key in keys))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield samples
    finally:
        done.set()
        sampler.join()


def _putter(socket_path: str, firsts: range, replies: list[m.Reply]) -> None:
    """Begin, write and commit one entry after another; every refusal and commit reply."""
    with RawPeer(socket_path) as peer:
        for first in firsts:
            began = peer.try_begin(IDENTITY, _tokens(first, BIG_TOKENS), first, width=BIG_WIDTH)
            if isinstance(began, m.ErrorReply):
                replies.append(began)  # refused, as the policy allows
                continue
            replies.append(peer.call(m.PutCommit(id=peer.next_id(), put=began)))


@pytest.mark.parametrize("policy", ["drop-oldest", "refuse", "block"])
def test_the_write_behind_cap_holds_all_through_a_burst(tmp_path: Path, policy: str) -> None:
    """Queued and staged bytes (puts begun, not committed) together, sampled while four
    putters burst. Drop-oldest never drops the entry in flight: its cap is soft by one."""
    cap = 2 * BIG_BYTES
    bound = cap + BIG_BYTES if policy == "drop-oldest" else cap
    flags = ["--writeback-max-bytes", str(cap), "--writeback-policy", policy]
    replies: list[m.Reply] = []
    with running_daemon(tmp_path, flags) as daemon:
        putters = [
            threading.Thread(target=_putter, args=(daemon.socket_path, range(n, 16, 4), replies))
            for n in range(4)
        ]
        with sampled(daemon.socket_path, "writeback.pending_bytes", "staged_bytes") as held:
            for putter in putters:
                putter.start()
            for putter in putters:
                putter.join()
        with Client.connect(daemon.socket_path, require=True) as client:
            assert client.flush(SETTLE_SECONDS)
            status = report(client)
        assert len(held) > 10, "too few samples to see the burst"
        assert max(held) > BIG_BYTES, "the burst never held more than one entry"
        assert max(held) <= bound, f"held bytes over the cap: {max(held)} > {bound}"
        refused = [r for r in replies if isinstance(r, m.ErrorReply)]
        assert all(r.code is ErrorCode.REFUSED for r in refused), refused
        if policy == "block":
            assert not refused  # every putter waited its turn
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon)
        assert staging_files(daemon) == []


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
            assert (after["entries"], after["bytes"]) == files_on_disk(daemon)
            for first in range(9, 12):  # the three most recent stay
                assert looked_up_tokens(client, identities[first % 3], [*_tokens(first), 1])
            for first in range(9):
                assert not looked_up_tokens(client, identities[first % 3], [*_tokens(first), 1])


def _fill_inodes(folder: Path, leave: int) -> list[Path]:
    """Files in folder until the disk has no inode left, then `leave` of them removed."""
    folder.mkdir()
    made: list[Path] = []
    with pytest.raises(OSError, match="No space left") as full:  # noqa: PT012 - the loop fills it
        while True:
            path = folder / str(len(made))
            path.touch()
            made.append(path)
    assert full.value.errno == errno.ENOSPC
    for path in made[len(made) - leave :]:
        path.unlink()
    return made[: len(made) - leave]


def test_a_disk_full_in_the_middle_of_a_write_fails_that_put_only(few_inodes: Path) -> None:
    flags = ["--min-free", "0", "--max-bytes", "1G"]
    with socket_folder() as sockets:
        socket_path = os.path.join(sockets, "kvd.sock")
        daemon = Daemon(few_inodes / "tier", socket_path, few_inodes.parent / "log", flags)
        daemon.expect_errors("write_failed")  # provoked: the new identity's folder
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            kept = put_stored(client, IDENTITY, _tokens(1), seed=1)
            filler = _fill_inodes(few_inodes / "filler", leave=1)  # the staging file's
            layers, tensors = entry(32, seed=2)
            ticket = client.put_entry(OTHER_IDENTITY, _tokens(2), layers, tensors)
            state = ticket.wait(SETTLE_SECONDS)
            assert state.state == "failed"
            assert "No space left on device" in str(state.reason)
            assert staging_files(daemon) == []  # its file went: the inode is free again
            hit = client.lookup(IDENTITY, [*_tokens(1), 7])  # the entry before: intact
            assert hit is not None
            with hit:
                assert [bytes(v) for v in hit.tensors] == [t.tobytes() for t in kept]
            status = report(client)
            assert (status["entries"], status["bytes"]) == files_on_disk(daemon)
            filler += _fill_inodes(few_inodes / "more", leave=0)
            # The snapshot at shutdown meets the full disk too: still a clean stop.
        assert daemon.stop() == 0
        snapshot_failures = [x for x in daemon.logs().splitlines() if "snapshot_failed" in x]
        assert snapshot_failures
        assert all("No space left" in json.loads(x)["error"] for x in snapshot_failures)
        assert not (few_inodes / "tier" / "index.snapshot.tmp").exists()
        for path in filler:
            path.unlink()
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            assert report(client)["entries"] == 1
            put_stored(client, OTHER_IDENTITY, _tokens(2), seed=2)  # room again: it goes in
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
    wait_until(lambda: not staging_files(daemon), "nothing is left in staging")
    assert client.flush(SETTLE_SECONDS)
    status = report(client)
    assert status["writeback"]["pending_bytes"] == 0
    assert (status["entries"], status["bytes"]) == files_on_disk(daemon)
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


WAIT_FOR_ROOM = """
    import sys
    sys.path.insert(0, sys.argv[1])
    from daemon_e2e import IDENTITY, RawPeer
    from kvd_protocol import messages as m
    from kvd_protocol.tokens import pack_tokens

    peer = RawPeer(sys.argv[2])
    peer.send(m.PutBegin(id=peer.next_id(), identity=IDENTITY,
                         tokens=pack_tokens([9, *range(511)]), size=int(sys.argv[3])))
    print("ready", flush=True)
    print("answered", peer.receive(), flush=True)
"""


def test_a_client_killed_while_waiting_for_room_leaves_nothing_behind(tmp_path: Path) -> None:
    flags = ["--writeback-max-bytes", str(BIG_BYTES), "--writeback-policy", "block"]
    flags += ["--writeback-block-timeout", "60"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        RawPeer(daemon.socket_path) as holder,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        held = holder.begin(IDENTITY, _tokens(1, BIG_TOKENS), seed=1, width=BIG_WIDTH)
        assert report(client)["staged_bytes"] == BIG_BYTES  # the whole cap, staged
        with python_child(WAIT_FOR_ROOM, daemon.socket_path, str(BIG_BYTES)) as child:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            assert not ready, "the put_begin was answered: it did not wait for room"
            child.kill()
        wait_until(lambda: len(report(client)["clients"]) == 2, "the dead client is gone")
        status = report(client)
        assert status["staged_bytes"] == BIG_BYTES  # the holder's alone
        assert len(staging_files(daemon)) == 1
        commit = holder.call(m.PutCommit(id=holder.next_id(), put=held))
        assert isinstance(commit, m.PutCommitReply), commit
        assert client.flush(SETTLE_SECONDS)
        status = report(client)
        assert (status["staged_bytes"], status["writeback"]["pending_bytes"]) == (0, 0)
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon)
        assert staging_files(daemon) == []
        put_stored(client, IDENTITY, _tokens(100), seed=100)  # room for the next one at once
