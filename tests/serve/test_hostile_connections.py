"""Connections that push the daemon's bounds: requests pipelined past a per-connection limit,
descriptors asked for and never read, frames trickled or held part-way, leases never released,
checks asked for in a loop. Each is tried by a raw client against a real daemon, while an
honest client goes on being served."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from blocks_e2e import BLOCK_TOKENS, Begun, begin, look_up, put_v2, wait, write_block
from blocks_e2e import status as report_of
from daemon_e2e import (
    ENTRY_BYTES,
    IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    put_stored,
    raw_frame,
    read_frame,
    report,
    staging_files,
    wait_until,
)
from daemon_process import Daemon, running_daemon
from fault_shim import built_or_skip
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.blocks import block_hashes
from kvd_protocol.errors import ErrorCode
from kvd_protocol.tokens import pack_tokens

from kvd.serve.handouts import MAX_UNREAD_DESCRIPTORS

BATCH = m.MAX_BLOCK_BATCH
FALLOCATE_HOLD_SHIM = Path(__file__).with_name("fallocate_hold_shim.c")
HELLO = {"op": "hello", "id": 1, "protocol": 1, "client": "hostile", "pid": 1}


def _replies(peer: RawPeer, count: int) -> list[m.Reply]:
    """The next count replies, their descriptors closed (counted by the caller first)."""
    return [peer.receive() for _ in range(count)]


def _close_all(replies: list[m.Reply]) -> int:
    """Close every descriptor the replies carry; how many there were."""
    fds = [fd for reply in replies for fd in reply.fds]
    for fd in fds:
        os.close(fd)
    return len(fds)


def _codes(replies: list[m.Reply]) -> list[ErrorCode]:
    return [reply.code for reply in replies if isinstance(reply, m.ErrorReply)]


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- per-connection limits under pipelining ------------------------------------------------


def test_put_begins_pipelined_on_one_connection_hold_max_open_puts(tmp_path: Path) -> None:
    """Staging files over 32 MiB are made on a worker thread, so each put_begin waits after
    its check: pipelined, every one of them used to pass it."""
    size = 33 << 20
    asked = 12
    with (
        running_daemon(tmp_path, ["--max-open-puts", "2", "--min-free", "0"]) as daemon,
        RawPeer(daemon.socket_path) as peer,
        Client.connect(daemon.socket_path, require=True) as honest,
    ):
        requests = [
            m.PutBegin(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens([i, 1]), size=size)
            for i in range(asked)
        ]
        peer.send(*requests)
        replies = _replies(peer, asked)
        handed = _close_all(replies)
        assert handed == 2
        assert _codes(replies) == [ErrorCode.OVER_LIMIT] * (asked - 2)
        assert len(staging_files(daemon)) == 2
        assert report(honest)["staged_puts"] == 2
        put_stored(honest, IDENTITY, [7, 8, 9], seed=1)


def test_a_puts_block_files_are_handed_out_at_most_twice(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        began = begin(peer, IDENTITY, list(range(4 * BLOCK_TOKENS + 3)))
        assert isinstance(began, Begun)
        blocks = len(began.manifest.hashes)
        replies = [
            peer.call(m.PutBlocks(id=peer.next_id(), put=began.put, first=0, count=blocks))
            for _ in range(3)
        ]
        assert isinstance(replies[2], m.ErrorReply)
        assert replies[2].code is ErrorCode.OVER_LIMIT
        assert "at most 2 times" in replies[2].message
        # The put itself goes on, written through the second descriptors of its blocks.
        for index, fd in enumerate(replies[1].fds):
            write_block(fd, began.manifest, began.tensors, index)
        assert _close_all(replies) == 2 * blocks
        commit = peer.call(m.PutCommit(id=peer.next_id(), put=began.put))
        assert isinstance(commit, m.PutCommitReply)
        assert wait(peer, commit.ticket).state == "stored"


def test_block_files_made_for_a_put_aborted_meanwhile_leave_no_staging_file(
    tmp_path: Path,
) -> None:
    """A batch of block files over 32 MiB is made on a worker thread: a put_abort while it is
    removed the put's files before they were made, and they stayed in staging, uncounted,
    until a restart (a loop of them fills the disk). The shim holds the thread."""
    shim = built_or_skip(tmp_path, FALLOCATE_HOLD_SHIM, "HELD STAGING")
    tokens = list(range(40 * BLOCK_TOKENS + 1))
    packed = pack_tokens(tokens)
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, ["--min-free", "0"]) as daemon:
        daemon.stop()
        held = {"LD_PRELOAD": str(shim), "HOLD_SHIM_FILE": str(hold), "HOLD_SHIM_SIZE": "1048576"}
        daemon.start(held)
        with RawPeer(daemon.socket_path) as peer:
            began = peer.call(
                m.PutBegin(
                    id=peer.next_id(),
                    identity=IDENTITY,
                    tokens=packed,
                    size=ENTRY_BYTES,
                    blocks=b"".join(block_hashes(packed, BLOCK_TOKENS)),
                    block_tokens=BLOCK_TOKENS,
                    block_size=1 << 20,
                )
            )
            assert isinstance(began, m.PutBeginReply)
            _close_all([began])
            hold.touch()
            peer.send(m.PutBlocks(id=peer.next_id(), put=began.put, first=0, count=40))
            wait_until(lambda: len(staging_files(daemon)) == 2, "a block file begun")
            aborted = peer.call(m.PutAbort(id=peer.next_id(), put=began.put))
            assert isinstance(aborted, m.PutAbortReply)
            hold.unlink()
            late = peer.receive()
            assert isinstance(late, m.ErrorReply), late
            assert late.code is ErrorCode.NOT_FOUND
            wait_until(lambda: staging_files(daemon) == [], "no staging file left")


def test_open_blocks_asked_and_never_read_hand_out_a_bounded_number(tmp_path: Path) -> None:
    """A client that asks for batches of block descriptors on many leases and reads none of
    its replies gets MAX_UNREAD_DESCRIPTORS of them at most, then over_limit; once it has
    read them it may ask again. The daemon's own descriptors stay few, and another client is
    served."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counting a process's descriptors needs /proc")
    tokens = list(range(BATCH * BLOCK_TOKENS + 5))
    with (
        running_daemon(tmp_path) as daemon,
        RawPeer(daemon.socket_path) as peer,
        Client.connect(daemon.socket_path, require=True) as honest,
    ):
        put_v2(peer, IDENTITY, tokens)
        before = _open_descriptors(daemon.pid)
        leases = []
        for _ in range(8):
            hit = _leased(peer, tokens)
            _close_all([hit])
            assert hit.lease is not None  # _leased checked it: said again for the types
            leases.append(hit.lease)
        asked = [
            m.OpenBlocks(id=peer.next_id(), lease=lease, first=0, count=BATCH)
            for lease in leases
            for _ in range(2)
        ]
        peer.send(*asked)  # and nothing read until every one is answered
        wait_until(lambda: report(honest)["hits"] >= 8, "the honest client served meanwhile")
        assert _open_descriptors(daemon.pid) <= before + BATCH
        replies = _replies(peer, len(asked))
        handed = _close_all(replies)
        # Those of replies read before the burst count until the socket shows them read,
        # which it cannot while the burst's own replies sit unread: a batch or two fewer.
        assert MAX_UNREAD_DESCRIPTORS - 2 * BATCH <= handed <= MAX_UNREAD_DESCRIPTORS
        assert _codes(replies) == [ErrorCode.OVER_LIMIT] * (len(asked) - handed // BATCH)
        again = peer.call(m.OpenBlocks(id=peer.next_id(), lease=leases[-1], first=0, count=BATCH))
        assert _close_all([again]) == BATCH  # all read now: handed out again
        found = look_up(peer, IDENTITY, [*tokens, 2])
        assert found is not None
        assert found.tensors is not None


def test_a_leases_blocks_are_opened_at_most_twice(tmp_path: Path) -> None:
    tokens = list(range(3 * BLOCK_TOKENS + 1))
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        began = put_v2(peer, IDENTITY, tokens)
        blocks = len(began.manifest.hashes)
        hit = peer.call(
            m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens([*tokens, 1]))
        )
        assert isinstance(hit, m.LookupReply)
        assert hit.lease is not None
        _close_all([hit])
        for _ in range(2 * blocks):
            one = peer.call(m.OpenBlocks(id=peer.next_id(), lease=hit.lease, first=0, count=1))
            assert _close_all([one]) == 1
        over = peer.call(m.OpenBlocks(id=peer.next_id(), lease=hit.lease, first=1, count=1))
        assert isinstance(over, m.ErrorReply)
        assert over.code is ErrorCode.OVER_LIMIT


# --- frames: one deadline each, one budget for all ------------------------------------------


def test_a_frame_trickled_a_byte_at_a_time_is_closed_at_its_deadline(tmp_path: Path) -> None:
    """Each byte used to re-arm the frame's timer: a byte a fifth of a second held the
    connection (and its buffer) for as long as the peer liked."""
    with (
        running_daemon(tmp_path, ["--frame-timeout", "1"]) as daemon,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
    ):
        sock.settimeout(SETTLE_SECONDS)
        sock.connect(daemon.socket_path)
        sock.sendall(raw_frame(HELLO))
        assert read_frame(sock) is not None
        body = raw_frame({"op": "ping", "id": 2, "pad": "x" * 200})
        sent = 0
        while sent < len(body) and not select.select([sock], [], [], 0)[0]:
            try:
                sock.send(body[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            time.sleep(0.2)
        assert sent < len(body), "the trickled frame was read to its end"
        reply = read_frame(sock)
        assert reply is not None
        assert (reply["op"], reply["code"]) == ("error", "timeout"), reply
        assert read_frame(sock) is None


def test_partial_frames_of_all_connections_share_one_budget(tmp_path: Path) -> None:
    """24 clients each send 6 MiB of a 7 MiB frame and stop: past the 16 MiB budget each is
    closed (over_limit), the daemon's memory grows by the budget and the allocator's slack at
    most (it grew by all 144 MiB), and an honest client is served throughout."""
    frame, sent_of_it, clients = 7 << 20, 6 << 20, 24
    budget = 16 << 20
    flags = ["--frame-buffer-bytes", str(budget), "--frame-timeout", "60"]
    with (
        running_daemon(tmp_path, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as honest,
    ):
        rss_before = report(honest)["daemon"]["rss_bytes"]
        socks = []
        closed = 0
        for _ in range(clients):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(SETTLE_SECONDS)
            sock.connect(daemon.socket_path)
            sock.sendall(raw_frame(HELLO))
            assert read_frame(sock) is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed meanwhile
                sock.sendall(frame.to_bytes(4, "big") + b"\x00" * sent_of_it)
            socks.append(sock)
        try:
            for sock in socks:
                sock.settimeout(0.5)
                try:
                    reply = read_frame(sock)
                except TimeoutError:
                    continue  # held: within the budget
                assert reply is not None
                assert (reply["op"], reply["code"]) == ("error", "over_limit"), reply
                closed += 1
            # A partial frame counts its declared length from its first read on.
            assert clients - closed == budget // (frame + 4)
            rss = report(honest)["daemon"]["rss_bytes"]
            print(f"daemon RSS {rss_before} -> {rss} B with {clients - closed} held")
            assert rss - rss_before < 2 * budget, (rss_before, rss)
            put_stored(honest, IDENTITY, [4, 5, 6], seed=2)
        finally:
            for sock in socks:
                sock.close()


def test_a_small_frame_is_read_whole_though_others_fill_the_frame_budget(tmp_path: Path) -> None:
    """Two connections hold the whole budget with frames they never finish; a request of an
    honest engine that arrives in two pieces is still read and answered."""
    frame = 7 << 20
    flags = ["--frame-buffer-bytes", str(2 * (frame + 4)), "--frame-timeout", "60"]
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as honest:
        hogs = []
        for _ in range(2):
            hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            hog.connect(daemon.socket_path)
            hog.sendall(raw_frame(HELLO) + frame.to_bytes(4, "big") + b"\x00" * 1000)
            hogs.append(hog)
        try:
            for hog in hogs:  # answered: the frame read with it is held
                assert read_frame(hog) is not None
            request = honest.conn.send(
                m.Lookup(id=honest.next_id(), identity=IDENTITY, tokens=pack_tokens([1] * 2000))
            )
            honest.sock.sendall(request[:100])
            time.sleep(0.2)  # read apart: a partial frame, held between the two reads
            honest.sock.sendall(request[100:])
            reply = honest.receive()
            assert isinstance(reply, m.LookupReply), reply
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as third:  # a large one
                third.connect(daemon.socket_path)
                third.sendall(raw_frame(HELLO) + frame.to_bytes(4, "big") + b"\x00" * 1000)
                assert read_frame(third) is not None  # its hello
                refused = read_frame(third)
                assert refused is not None
                assert (refused["op"], refused["code"]) == ("error", "over_limit"), refused
        finally:
            for hog in hogs:
                hog.close()


# --- leases cannot freeze the tier ----------------------------------------------------------

PROMPTS = [[i, *range(100, 110)] for i in range(3)]


@contextlib.contextmanager
def _full_tier(
    tmp_path: Path, entries: int, flags: Sequence[str] = ()
) -> Iterator[tuple[Daemon, Client, RawPeer]]:
    """A daemon whose cap holds entries entries of ENTRY_BYTES, stored (PROMPTS[:entries]);
    with an honest client and a reader that takes leases."""
    cap = ["--max-bytes", str(entries * ENTRY_BYTES), "--min-free", "0"]
    with (
        running_daemon(tmp_path, [*cap, *flags]) as daemon,
        Client.connect(daemon.socket_path, require=True) as honest,
        RawPeer(daemon.socket_path) as reader,
    ):
        for seed, prompt in enumerate(PROMPTS[:entries]):
            put_stored(honest, IDENTITY, prompt, seed=seed)
        yield daemon, honest, reader


def _leased(reader: RawPeer, prompt: list[int]) -> m.LookupReply:
    """A lookup hit of prompt's entry, its lease held (its descriptor the caller's)."""
    hit = reader.call(
        m.Lookup(id=reader.next_id(), identity=IDENTITY, tokens=pack_tokens([*prompt, 1]))
    )
    assert isinstance(hit, m.LookupReply), hit
    assert hit.lease is not None
    return hit


def _committed(putter: RawPeer, put: int) -> m.TicketReply:
    """Commit a begun put and wait for its ticket's answer."""
    commit = putter.call(m.PutCommit(id=putter.next_id(), put=put))
    assert isinstance(commit, m.PutCommitReply), commit
    answer = putter.call(
        m.WaitTicket(id=putter.next_id(), ticket=commit.ticket, timeout=SETTLE_SECONDS)
    )
    assert isinstance(answer, m.TicketReply), answer
    return answer


def test_a_put_that_leased_entries_leave_no_room_for_is_refused_before_a_byte(
    tmp_path: Path,
) -> None:
    """With the cap full of leased entries, a put used to be written, answered stored and
    evicted at once; it is refused at put_begin, naming the leased bytes, and goes in once
    a lease ends."""
    with _full_tier(tmp_path, 3) as (daemon, honest, reader):
        hits = [_leased(reader, prompt) for prompt in PROMPTS]
        _close_all(list(hits))
        assert report(honest)["leased_bytes"] == 3 * ENTRY_BYTES
        with RawPeer(daemon.socket_path) as putter:
            refused = putter.try_begin(IDENTITY, [9, 9, 9], seed=9)
            assert isinstance(refused, m.ErrorReply)
            assert refused.code is ErrorCode.NO_SPACE
            assert f"leased entries hold {3 * ENTRY_BYTES} bytes" in refused.message
            assert staging_files(daemon) == []
            release = reader.call(m.Release(id=reader.next_id(), lease=hits[0].lease or 0))
            assert isinstance(release, m.ReleaseReply)
            put = putter.begin(IDENTITY, [9, 9, 9], seed=9)
            assert _committed(putter, put).state == "stored"
        assert report(honest)["entries"] == 3  # the one released made room


def test_leased_bytes_count_each_shared_block_once(tmp_path: Path) -> None:
    shared = list(range(4 * BLOCK_TOKENS))
    prompts = [[*shared, *range(1000 + i, 1000 + i + BLOCK_TOKENS + 3)] for i in range(2)]
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        for prompt in prompts:
            put_v2(peer, IDENTITY, prompt)
        leases = []
        for prompt in prompts:
            found = look_up(peer, IDENTITY, [*prompt, 1], release=False)
            assert found is not None
            leases.append(found.lease)
        status = report_of(peer)
        assert status["logical_bytes"] > status["unique_bytes"]  # the prefix's blocks shared
        assert status["leased_bytes"] == status["unique_bytes"]
        release = peer.call(m.Release(id=peer.next_id(), lease=leases[0]))
        assert isinstance(release, m.ReleaseReply)
        assert 0 < report_of(peer)["leased_bytes"] < status["unique_bytes"]
        release = peer.call(m.Release(id=peer.next_id(), lease=leases[1]))
        assert isinstance(release, m.ReleaseReply)
        assert report_of(peer)["leased_bytes"] == 0


def test_an_entry_evicted_as_soon_as_it_is_stored_is_not_answered_stored(tmp_path: Path) -> None:
    """Leases taken between a put's begin and its store fill the cap: holding the cap takes
    the new entry itself, and its ticket says so (it used to say stored)."""
    with (
        _full_tier(tmp_path, 2) as (daemon, honest, reader),
        RawPeer(daemon.socket_path) as putter,
    ):
        first = _leased(reader, PROMPTS[0])
        put = putter.begin(IDENTITY, [9, 9, 9], seed=9)  # room: one entry is leased
        second = _leased(reader, PROMPTS[1])
        assert _close_all([first, second]) == 2
        answer = _committed(putter, put)
        assert answer.state == "dropped"
        assert answer.reason is not None
        assert f"leased entries hold {2 * ENTRY_BYTES} bytes" in answer.reason
        assert report(honest)["entries"] == 2


def test_a_lease_held_past_lease_max_age_ends_and_frees_the_tier(tmp_path: Path) -> None:
    """A reader that never releases keeps its entries from eviction for lease_max_age at
    most; its descriptor stays readable, and its release is told why it is gone."""
    with _full_tier(tmp_path, 2, ["--lease-max-age", "1"]) as (daemon, honest, reader):
        hits = [_leased(reader, prompt) for prompt in PROMPTS[:2]]
        wait_until(lambda: report(honest)["leases_expired"] == 2, "the leases expire")
        status = report(honest)
        assert status["leased_entries"] == 0
        assert status["leased_bytes"] == 0
        put_stored(honest, IDENTITY, [7, *range(100, 110)], seed=7)  # evicts a former lease's
        for hit in hits:
            assert hit.fd is not None
            assert len(os.pread(hit.fd, 4096, 0)) == 4096  # still the reader's to read
            os.close(hit.fd)
            late = reader.call(m.Release(id=reader.next_id(), lease=hit.lease or 0))
            assert isinstance(late, m.ErrorReply)
            assert late.code is ErrorCode.NOT_FOUND
            assert "age limit" in late.message
        assert "leases_expired" in daemon.logs()


# --- checks clients can ask for ---------------------------------------------------------------


def test_verify_asked_in_a_loop_takes_turns_and_the_writer_goes_on(tmp_path: Path) -> None:
    connections, each = 12, 4
    with (
        running_daemon(tmp_path) as daemon,
        Client.connect(daemon.socket_path, require=True) as honest,
    ):
        put_stored(honest, IDENTITY, list(range(300)), seed=3)
        entry = honest.list_entries()[0].id
        peers = [RawPeer(daemon.socket_path) for _ in range(connections)]
        try:
            for peer in peers:
                peer.send(
                    *(m.Verify(id=peer.next_id(), entry=entry, repair=False) for _ in range(each))
                )
            put_stored(honest, IDENTITY, [5, *range(40)], seed=4)  # settles stored meanwhile
            replies = [reply for peer in peers for reply in _replies(peer, each)]
        finally:
            for peer in peers:
                peer.close()
        verified = [r for r in replies if isinstance(r, m.VerifyReply)]
        refused = _codes(replies)
        assert all(r.problem is None for r in verified)
        assert set(refused) <= {ErrorCode.OVER_LIMIT, ErrorCode.REFUSED}
        # One at a time per connection: at most one of each connection's pipelined four.
        assert len(verified) <= connections
        assert len(refused) >= connections * (each - 1)
        checks = report(honest)["checks"]
        assert checks["run"] == len(verified)
        assert checks["refused"] == len(refused)


def test_damage_reported_again_on_an_entry_found_intact_is_not_checked_again(
    tmp_path: Path,
) -> None:
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        tokens = list(range(2 * BLOCK_TOKENS + 3))
        put_v2(peer, IDENTITY, tokens)
        for _ in range(5):
            hit = _leased(peer, tokens)
            _close_all([hit])
            assert hit.lease is not None
            reply = peer.call(m.Release(id=peer.next_id(), lease=hit.lease, damaged="it lies"))
            assert isinstance(reply, m.ReleaseReply)
        status = peer.call(m.Status(id=peer.next_id()))
        assert isinstance(status, m.StatusReply)
        assert status.status["checks"] == {"run": 1, "refused": 0, "skipped": 4}
        assert status.status["entries"] == 1
