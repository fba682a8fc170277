"""The byte cap, the write-behind queue's cap under each policy, and leases, end to end."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from daemon_e2e import (
    ENTRY_BYTES,
    IDENTITY,
    OTHER_IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    deleter_idle,
    entry,
    files_on_disk,
    put_stored,
    report,
    staging_files,
)
from daemon_process import running_daemon
from kvd_client.client import Client
from kvd_client.results import TicketState
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
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon)


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
        deleter_idle(daemon)
        assert not path.exists()
        assert report(admin)["bytes"] == 0
        assert files_on_disk(daemon) == (0, 0)


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
        assert files_on_disk(daemon) == (2, 2 * ENTRY_BYTES)


# --- the write-behind queue ------------------------------------------------------------------
#
# Whether the queue is full when a put arrives depends on the writer's progress, which a test
# cannot stop without a hook into the daemon. What the tests control: a first entry much larger
# than the cap (it fits, since one always does when nothing is held) keeps the writer busy with
# its checksum pass and fsync for tens of milliseconds, while a burst of small puts (begun,
# written and committed one by one, about a millisecond each) arrives behind it. A begun put
# holds its bytes against the cap as a queued one does. The accounting asserted (status
# against the replies and tickets the clients saw) holds whatever the interleaving; the
# overflow itself is asserted too.

BURST = 6
BIG_TOKENS = 512
BIG_WIDTH = 64  # 64 KiB per tensor, 256 KiB per entry: quick to make, as a burst should be
HUGE_WIDTH = 8192  # 64 MiB


def _big_entry_bytes() -> int:
    return 16384 + 4 * 2 * BIG_TOKENS * BIG_WIDTH * 2  # a header page, 4 tensors of 2 heads


def _queue_flags(policy: str, *extra: str) -> list[str]:
    cap = str(2 * _big_entry_bytes())
    return ["--writeback-max-bytes", cap, "--writeback-policy", policy, *extra]


def _commit(peer: RawPeer, put: int) -> m.Reply:
    return peer.call(m.PutCommit(id=peer.next_id(), put=put))


@pytest.mark.parametrize("policy", ["drop-oldest", "refuse", "block"])
def test_the_write_behind_cap_under_each_policy(tmp_path: Path, policy: str) -> None:
    with (
        running_daemon(tmp_path, _queue_flags(policy)) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        huge = peer.begin(IDENTITY, _tokens(99, BIG_TOKENS), seed=99, width=HUGE_WIDTH)
        assert status_of(peer)["staged_bytes"] > 2 * _big_entry_bytes()  # held from begin on
        replies = [_commit(peer, huge)]
        refused_at_begin: list[m.ErrorReply] = []
        for i in range(BURST):
            began = peer.try_begin(IDENTITY, _tokens(i, BIG_TOKENS), seed=i, width=BIG_WIDTH)
            if isinstance(began, m.ErrorReply):
                refused_at_begin.append(began)
            else:
                replies.append(_commit(peer, began))
        assert status_of(peer)["staged_bytes"] == 0
        assert all(r.code is ErrorCode.REFUSED for r in refused_at_begin), refused_at_begin
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
        assert writeback["refused_at_begin"] == len(refused_at_begin)
        assert states["stored"] + states["dropped"] + len(refused + refused_at_begin) == BURST + 1
        if policy == "drop-oldest":  # each begin sheds the small entry queued behind the huge
            assert not refused + refused_at_begin
            assert states["dropped"] >= 1
        elif policy == "refuse":  # the huge entry in flight leaves no room
            assert len(refused_at_begin) >= 1
            assert states["dropped"] == 0
        else:  # block: every putter waits its turn, nothing is lost
            assert not refused + refused_at_begin
            assert states == Counter(stored=BURST + 1)
        status = status_of(peer)
        assert status["entries"] == states["stored"]
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon)
        assert staging_files(daemon) == []


def status_of(peer: RawPeer) -> dict[str, Any]:
    reply = peer.call(m.Status(id=peer.next_id()))
    assert isinstance(reply, m.StatusReply)
    return dict(reply.status)


def test_identical_puts_waiting_for_room_together_are_stored_once(tmp_path: Path) -> None:
    """Under the block policy two put_begins of the same tokens may both wait for room (the
    queue full of the entries committed before them); the one committed second must find the
    first and settle as a duplicate."""
    fillers = [_tokens(i, BIG_TOKENS) for i in range(2)]
    twins = [_tokens(7, BIG_TOKENS)] * 2
    with (
        running_daemon(tmp_path, _queue_flags("block")) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        puts = [peer.begin(IDENTITY, t, seed=i, width=BIG_WIDTH) for i, t in enumerate(fillers)]
        peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in puts))
        replies = [peer.receive() for _ in puts]
        began = peer.begin_together(IDENTITY, twins, [7, 8], width=BIG_WIDTH)
        assert all(isinstance(put, int) for put in began), began
        peer.send(*(m.PutCommit(id=peer.next_id(), put=put) for put in began))  # type: ignore[arg-type]
        replies += [peer.receive() for _ in began]
        answers = Counter[tuple[str, str | None]]()
        for reply in replies:
            assert isinstance(reply, m.PutCommitReply), reply
            answer = peer.call(
                m.WaitTicket(id=peer.next_id(), ticket=reply.ticket, timeout=SETTLE_SECONDS)
            )
            assert isinstance(answer, m.TicketReply)
            answers[answer.state, answer.reason] += 1
        assert answers == Counter({("stored", None): 3, ("stored", "duplicate"): 1})
        status = status_of(peer)
        assert (status["entries"], status["duplicates"]) == (3, 1)
        assert (status["entries"], status["bytes"]) == files_on_disk(daemon)
        assert staging_files(daemon) == []


def test_the_cost_policy_evicts_the_least_prefill_per_byte_not_the_oldest(tmp_path: Path) -> None:
    """Three entries of one size, the oldest holding the most tokens (in fewer bytes per
    token, as a quantized cache does): over the cap, LRU would take the oldest; cost takes
    the one that saves the least prefill for its bytes."""
    many = list(range(1000, 1128))  # 128 tokens in the bytes others spend on 32
    flags = ["--max-bytes", str(3 * ENTRY_BYTES), "--eviction-policy", "cost"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        for tokens, width in ((many, 2), (_tokens(1), 8), (_tokens(2), 8)):
            layers, tensors = entry(len(tokens), seed=tokens[0], width=width)
            assert client.put_entry(IDENTITY, tokens, layers, tensors).wait(SETTLE_SECONDS) == (
                TicketState("stored")
            )
        put_stored(client, IDENTITY, _tokens(3), seed=3)
        assert client.flush(SETTLE_SECONDS)
        assert report(client)["evictions"] >= 1
        assert client.lookup(IDENTITY, [*many, 7]) is not None  # the oldest stayed
        assert (report(client)["entries"], report(client)["bytes"]) == files_on_disk(daemon)


def test_the_cost_policy_keeps_the_tokens_of_the_model_that_prefills_slowest(
    tmp_path: Path,
) -> None:
    """Entries alike in tokens and bytes: the model whose engine reports a prefill ten times
    slower keeps its older entries; the fast model's entry goes, though it is the newest."""
    flags = ["--max-bytes", str(3 * ENTRY_BYTES), "--eviction-policy", "cost"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as slow,
        Client.connect(daemon.socket_path, require=True) as fast,
    ):
        slow.measured_prefill(1000, 10.0)  # 10 ms a token
        fast.measured_prefill(1000, 1.0)
        put_stored(slow, IDENTITY, _tokens(1), seed=1)
        put_stored(slow, IDENTITY, _tokens(2), seed=2)
        put_stored(fast, OTHER_IDENTITY, _tokens(3), seed=3)
        put_stored(slow, IDENTITY, _tokens(4), seed=4)  # over the cap: one must go
        assert slow.flush(SETTLE_SECONDS)
        assert fast.lookup(OTHER_IDENTITY, [*_tokens(3), 7]) is None
        for first in (1, 2, 4):
            assert slow.lookup(IDENTITY, [*_tokens(first), 7]) is not None
        costs = {i["model_id"]: i["prefill_ms_per_token"] for i in report(slow)["identities"]}
        assert costs == {"e2e/model-a": pytest.approx(10.0), "e2e/model-b": pytest.approx(1.0)}
        assert (report(slow)["entries"], report(slow)["bytes"]) == files_on_disk(daemon)


def test_a_models_quota_makes_its_own_entries_give_way_and_no_one_elses(tmp_path: Path) -> None:
    flags = ["--quotas", f"e2e/model-a={2 * ENTRY_BYTES}"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put_stored(client, OTHER_IDENTITY, _tokens(9), seed=9)  # another model: no quota
        for first in (1, 2, 3):
            put_stored(client, IDENTITY, _tokens(first), seed=first)
        assert client.flush(SETTLE_SECONDS)
        mine = sorted(e.tokens for e in client.list_entries(IDENTITY.digest()))
        assert len(mine) == 2
        assert client.lookup(IDENTITY, [*_tokens(1), 7]) is None  # its oldest made way
        assert len(client.list_entries(OTHER_IDENTITY.digest())) == 1
        # An entry larger than the quota is refused before a byte of it is written.
        layers, tensors = entry(128, seed=4, width=512)  # 1 MiB
        refused = client.put_entry(IDENTITY, list(range(500, 628)), layers, tensors)
        assert refused.state.state == "failed"
        assert "over the quota of e2e/model-a" in (refused.state.reason or "")
        assert (report(client)["entries"], report(client)["bytes"]) == files_on_disk(daemon)
