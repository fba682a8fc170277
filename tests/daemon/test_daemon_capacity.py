"""The byte cap, the write-behind queue's cap under each policy, and leases, end to end."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from daemon_e2e import (
    ENTRY_BYTES,
    IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    files_on_disk,
    put_stored,
    report,
    staging_files,
)
from daemon_process import running_daemon
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode


def _tokens(first: int, count: int = 32) -> list[int]:
    """count tokens starting with first: entries with distinct firsts share no prefix."""
    return [first, *range(count - 1)]


def _listed_firsts(client: Client) -> list[int]:
    return sorted(e.tokens for e in client.list_entries())


def test_eviction_at_the_cap_is_least_recently_used_and_a_hit_is_a_use(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--max-bytes", str(5 * ENTRY_BYTES)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        ids = {}
        for first in range(5):
            put_stored(client, IDENTITY, _tokens(first, 32 + first), seed=first)
            ids[first] = {e.tokens: e.id for e in client.list_entries()}[32 + first]
        assert report(client)["bytes"] == 5 * ENTRY_BYTES
        result = client.lookup(IDENTITY, [*_tokens(0, 32), 1])  # entry 0 is now the newest
        assert result is not None
        result.release()
        put_stored(client, IDENTITY, _tokens(5, 37), seed=5)
        assert client.flush(SETTLE_SECONDS)
        kept = {e.id for e in client.list_entries()}
        assert ids[1] not in kept  # the least recently used
        assert {ids[0], ids[2], ids[3], ids[4]} <= kept
        put_stored(client, IDENTITY, _tokens(6, 38), seed=6)
        assert client.flush(SETTLE_SECONDS)
        assert ids[2] not in {e.id for e in client.list_entries()}
        status = report(client)
        assert status["bytes"] <= 5 * ENTRY_BYTES
        assert status["evictions"] == 2
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon.tier)


def test_a_leased_entry_outlives_evict_until_released(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path) as daemon,
        Client.connect(daemon.socket_path, require=True) as reader,
        Client.connect(daemon.socket_path, require=True) as admin,
    ):
        tensors = put_stored(reader, IDENTITY, _tokens(1), seed=1)
        assert reader.flush(SETTLE_SECONDS)
        result = reader.lookup(IDENTITY, [*_tokens(1), 9])
        assert result is not None
        path = next((daemon.tier / "entries").rglob("*.kve"))
        evicted = admin.evict(all=True)
        assert evicted.entries == 1
        assert admin.list_entries() == []
        assert admin.lookup(IDENTITY, [*_tokens(1), 9]) is None
        status = report(admin)
        assert status["bytes"] == ENTRY_BYTES  # still on disk, still counted
        assert (status["evictions"], status["evicted_bytes"]) == (1, ENTRY_BYTES)
        assert status["leased_entries"] == 1
        assert path.exists()
        assert [bytes(v) for v in result.tensors] == [t.tobytes() for t in tensors]
        result.verify()
        result.release()
        assert not path.exists()
        assert report(admin)["bytes"] == 0
        assert files_on_disk(daemon.tier) == (0, 0)


def test_eviction_at_the_cap_skips_a_leased_entry(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--max-bytes", str(2 * ENTRY_BYTES)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put_stored(client, IDENTITY, _tokens(1), seed=1)
        held = client.lookup(IDENTITY, [*_tokens(1), 9])
        assert held is not None
        put_stored(client, IDENTITY, _tokens(2), seed=2)
        other = client.lookup(IDENTITY, [*_tokens(2), 9])  # entry 2 is now the newest
        assert other is not None
        other.release()
        put_stored(client, IDENTITY, _tokens(3), seed=3)
        assert client.flush(SETTLE_SECONDS)
        # Entry 1 is the least recently used, but leased: entry 2 went instead.
        assert sorted(e.tokens for e in client.list_entries()) == [32, 32]
        assert client.lookup(IDENTITY, [*_tokens(2), 9]) is None
        held.verify()
        held.release()
        put_stored(client, IDENTITY, _tokens(4), seed=4)
        assert client.flush(SETTLE_SECONDS)
        assert client.lookup(IDENTITY, [*_tokens(1), 9]) is None  # evictable again: gone
        assert files_on_disk(daemon.tier) == (2, 2 * ENTRY_BYTES)


# --- the write-behind queue ------------------------------------------------------------------
#
# Whether the queue is full when a commit arrives depends on the writer's progress, which a
# test cannot stop without a hook into the daemon. What the tests control: all puts are begun
# and written first (a begun put holds no queue bytes), then every commit goes out in one write
# on one connection, so the daemon reads them together and queues them within a few header
# reads, while the writer needs a checksum pass and an fsync of several MiB per entry. The cap
# holds one entry, so every commit but the first finds the queue full unless the writer was
# faster than all of that. The accounting asserted (status against the replies and tickets
# the clients saw) holds whatever the interleaving; the overflow itself is asserted too.

BURST = 6
BIG_TOKENS = 512
BIG_WIDTH = 512  # 1 MiB per tensor, 4 MiB per entry


def _big_entry_bytes() -> int:
    return 16384 + 4 * BIG_TOKENS * BIG_WIDTH * 2


def _queue_flags(policy: str, *extra: str) -> list[str]:
    return ["--writeback-max-bytes", str(_big_entry_bytes()), "--writeback-policy", policy, *extra]


@pytest.mark.parametrize("policy", ["drop-oldest", "refuse", "block"])
def test_the_write_behind_cap_under_each_policy(tmp_path: Path, policy: str) -> None:
    with (
        running_daemon(tmp_path, _queue_flags(policy)) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        puts = []
        for i in range(BURST):
            puts.append(peer.begin(IDENTITY, _tokens(i, BIG_TOKENS), seed=i, width=BIG_WIDTH))
        assert status_of(peer)["writeback"]["pending_bytes"] == 0  # begun puts hold no queue
        peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
        replies = [peer.receive() for _ in puts]
        refused = [r for r in replies if isinstance(r, m.ErrorReply)]
        assert all(r.code is ErrorCode.REFUSED for r in refused), refused
        states = Counter[str]()
        for reply in replies:
            if isinstance(reply, m.PutCommitReply):
                answer = peer.call(
                    m.WaitTicket(id=peer.next_id(), ticket=reply.ticket, timeout=SETTLE_SECONDS)
                )
                assert isinstance(answer, m.TicketReply)
                states[answer.state] += 1
        flushed = peer.call(m.Flush(id=peer.next_id(), timeout=SETTLE_SECONDS))
        assert isinstance(flushed, m.FlushReply)
        assert flushed.pending == 0
        writeback = status_of(peer)["writeback"]
        assert writeback["pending_bytes"] == 0
        assert writeback["pending_count"] == 0
        assert writeback["stored"] == states["stored"]
        assert writeback["dropped"] == states["dropped"]
        assert writeback["refused"] == len(refused)
        assert states["stored"] + states["dropped"] + len(refused) == BURST
        if policy == "drop-oldest":
            assert not refused
            assert states["dropped"] >= 1
        elif policy == "refuse":
            assert len(refused) >= 1
            assert states["dropped"] == 0
        else:  # block: every putter waits its turn, nothing is lost
            assert not refused
            assert states == Counter(stored=BURST)
        status = status_of(peer)
        assert status["entries"] == states["stored"]
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon.tier)
        assert staging_files(daemon.tier) == []


def status_of(peer: RawPeer) -> dict[str, Any]:
    reply = peer.call(m.Status(id=peer.next_id()))
    assert isinstance(reply, m.StatusReply)
    return dict(reply.status)


def test_identical_puts_waiting_for_room_together_are_stored_once(tmp_path: Path) -> None:
    """Under the block policy two commits of the same tokens may both wait for room; the one
    that gets in second must find the first and settle as a duplicate."""
    tokens = [_tokens(i, BIG_TOKENS) for i in range(BURST)]
    tokens.insert(2, tokens[1])
    with (
        running_daemon(tmp_path, _queue_flags("block")) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        puts = [peer.begin(IDENTITY, t, seed=i, width=BIG_WIDTH) for i, t in enumerate(tokens)]
        peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
        replies = [peer.receive() for _ in puts]
        answers = Counter[tuple[str, str | None]]()
        for reply in replies:
            assert isinstance(reply, m.PutCommitReply), reply
            answer = peer.call(
                m.WaitTicket(id=peer.next_id(), ticket=reply.ticket, timeout=SETTLE_SECONDS)
            )
            assert isinstance(answer, m.TicketReply)
            answers[answer.state, answer.reason] += 1
        assert answers == Counter({("stored", None): BURST, ("stored", "duplicate"): 1})
        status = status_of(peer)
        assert (status["entries"], status["duplicates"]) == (BURST, 1)
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon.tier)
        assert staging_files(daemon.tier) == []
