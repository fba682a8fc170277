"""What a flood of connections, stalled frames, greedy connections and puts left open cannot
do to a real daemon: wedge it, exhaust it, or hold bytes it does not count."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from daemon_e2e import (
    IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    entry,
    plan_for,
    put_stored,
    staging_files,
    wait_until,
)
from daemon_process import Daemon, running_daemon
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.connection import Connection, Role
from kvd_protocol.entry import LayerSpec, TensorSpec
from kvd_protocol.errors import DaemonUnavailableError, ErrorCode
from kvd_protocol.framing import FrameReader
from kvd_protocol.tokens import pack_tokens


def _events(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    events = []
    for line in daemon.logs().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            events.append(event)
    return events


def _status(daemon: Daemon) -> dict[str, Any]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return dict(client.status())


def _final_error(sock: socket.socket) -> m.ErrorReply:
    """The one frame a daemon says before it closes a connection."""
    sock.settimeout(SETTLE_SECONDS)
    conn = Connection(Role.CLIENT)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    conn.receive_data(data)
    conn.receive_data(b"")
    reply = conn.next_event()
    assert isinstance(reply, m.ErrorReply), reply
    return reply


# --- descriptors and connections -----------------------------------------------------------


def test_running_out_of_descriptors_pauses_accepting_and_it_resumes(tmp_path: Path) -> None:
    """With 64 descriptors and no connection cap to stop it first, a flood of connections
    exhausts the daemon: it logs that once, keeps serving the connections it has, and
    accepts again once the flood is gone."""
    flags = ["--max-connections", "1000"]
    with running_daemon(tmp_path, flags, open_files=64) as daemon:
        flood = []
        for _ in range(80):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(daemon.socket_path)  # the kernel's backlog takes what accept cannot
            flood.append(sock)
        wait_until(lambda: _events(daemon, "accept_paused"), "accepting paused")
        assert daemon.process is not None
        assert daemon.process.poll() is None
        for sock in flood:
            sock.close()
        with Client.connect(daemon.socket_path, timeout=SETTLE_SECONDS, require=True) as client:
            client.ping()
        wait_until(lambda: _events(daemon, "accept_resumed"), "accepting resumed")
        assert len(_events(daemon, "accept_paused")) == 1  # once, not once per retry
        put_stored(Client.connect(daemon.socket_path, require=True), IDENTITY, [1, 2, 3], seed=1)


def test_the_open_file_limit_is_raised_and_sizes_the_connection_cap(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        (limits,) = _events(daemon, "limits")
    # The test's own limit is what the daemon inherited; it raised the soft one to the hard.
    assert limits["open_files"] == resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert limits["max_connections"] == max(1, (limits["open_files"] - 64) // 4)


def test_one_connection_over_the_cap_is_told_and_closed(tmp_path: Path) -> None:
    with running_daemon(tmp_path, ["--max-connections", "2"]) as daemon:
        first = Client.connect(daemon.socket_path, require=True)
        second = Client.connect(daemon.socket_path, require=True)
        with pytest.raises(DaemonUnavailableError, match="too_many_connections"):
            Client.connect(daemon.socket_path, require=True)
        first.ping()
        second.ping()
        first.close()
        wait_until(lambda: len(_status_via(second)["clients"]) == 1, "the first one gone")
        with Client.connect(daemon.socket_path, require=True) as third:
            third.ping()
        second.close()
        assert _events(daemon, "connection_refused")


def _status_via(client: Client) -> dict[str, Any]:
    return dict(client.status())


# --- frames ----------------------------------------------------------------------------------


def test_a_stalled_frame_is_closed_after_the_timeout_and_holds_up_no_one(tmp_path: Path) -> None:
    with running_daemon(tmp_path, ["--frame-timeout", "0.5"]) as daemon:
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.connect(daemon.socket_path)
        stalled.sendall(struct.pack(">I", 100) + b"\x85")  # a length, then one byte of 100
        idle = RawPeer(daemon.socket_path)  # between frames: may idle as long as it likes
        started = time.monotonic()
        with Client.connect(daemon.socket_path, require=True) as other:
            other.ping()  # answered while the stalled frame waits
        reply = _final_error(stalled)
        assert reply.code is ErrorCode.TIMEOUT
        assert time.monotonic() - started < SETTLE_SECONDS
        time.sleep(0.6)
        assert isinstance(idle.call(m.Ping(id=idle.next_id())), m.PingReply)
        idle.close()
        stalled.close()


def test_a_peer_that_does_not_read_its_replies_holds_up_no_one_and_gets_them_whole(
    tmp_path: Path,
) -> None:
    """Its replies fill the socket: the daemon stops reading it until they drain, serves
    everyone else meanwhile, and then sends every reply whole, in the order asked."""
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as greedy:
        greedy.sock.setblocking(False)
        asked: list[int] = []
        pending = b""
        while not pending and len(asked) < 1_000_000:  # until the kernel takes no more
            request_id = greedy.next_id()
            body = msgpack.packb({"op": "status" if request_id % 2 else "ping", "id": request_id})
            frame = struct.pack(">I", len(body)) + body
            try:
                sent = greedy.sock.send(frame)
            except BlockingIOError:
                break  # none of it went
            asked.append(request_id)
            pending = frame[sent:]
        assert len(asked) < 1_000_000, "the daemon read on while its replies could not go"
        with Client.connect(daemon.socket_path, require=True) as other:
            other.ping()  # answered while the greedy peer's replies wait
            assert len(_status_via(other)["clients"]) == 2
        greedy.sock.settimeout(SETTLE_SECONDS)
        rest = threading.Thread(target=greedy.sock.sendall, args=(pending,))
        rest.start()  # the rest of a frame begun, while its replies are read
        reader, replies = FrameReader(1 << 20), list[dict[str, Any]]()
        while len(replies) < len(asked):
            reader.feed(greedy.sock.recv(1 << 16))
            while (view := reader.next_frame()) is not None:
                with view:
                    replies.append(msgpack.unpackb(view))
        rest.join()
        assert [reply["id"] for reply in replies] == asked
        assert [reply["op"] for reply in replies] == ["ping", "status"] * (len(asked) // 2) + [
            "ping"
        ] * (len(asked) % 2)


# --- per-connection bounds -------------------------------------------------------------------


def test_a_connection_may_hold_only_so_many_puts_begun(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--max-open-puts", "2"]) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        puts = [peer.begin(IDENTITY, [i, 1, 2], seed=i) for i in range(2)]
        over = peer.try_begin(IDENTITY, [9, 1, 2], seed=9)
        assert isinstance(over, m.ErrorReply)
        assert over.code is ErrorCode.OVER_LIMIT
        with RawPeer(daemon.socket_path) as other:  # a bound per connection, not for all
            assert isinstance(other.try_begin(IDENTITY, [8, 1, 2], seed=8), int)
        assert isinstance(peer.call(m.PutCommit(id=peer.next_id(), put=puts[0])), m.PutCommitReply)
        assert isinstance(peer.try_begin(IDENTITY, [9, 1, 2], seed=9), int)


def test_a_connection_may_hold_only_so_many_leases(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--max-leases", "2"]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put_stored(client, IDENTITY, [1, 2, 3, 4], seed=1)
        held = [client.lookup(IDENTITY, [1, 2, 3, 4, 5]) for _ in range(2)]
        assert all(h is not None for h in held)
        failed = client.stats.failed_lookups
        assert client.lookup(IDENTITY, [1, 2, 3, 4, 5]) is None  # over_limit: a miss here
        assert client.stats.failed_lookups == failed + 1
        assert held[0] is not None
        held[0].release()
        again = client.lookup(IDENTITY, [1, 2, 3, 4, 5])
        assert again is not None
        again.release()
        assert held[1] is not None
        held[1].release()


# --- staged bytes ----------------------------------------------------------------------------


def _entry_bytes(tokens: list[int], seed: int) -> int:
    layers, _ = entry(len(tokens), seed)
    return plan_for(IDENTITY, tokens, layers).file_size


@pytest.mark.parametrize("policy", ["drop-oldest", "refuse"])
def test_begun_puts_hold_their_bytes_against_the_write_behind_cap(
    tmp_path: Path, policy: str
) -> None:
    size = _entry_bytes([1, 2, 3], seed=1)
    flags = ["--writeback-max-bytes", str(2 * size), "--writeback-policy", policy]
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        first = peer.begin(IDENTITY, [1, 2, 3], seed=1)
        peer.begin(IDENTITY, [2, 2, 3], seed=2)
        assert (_status(daemon)["staged_bytes"], _status(daemon)["staged_puts"]) == (2 * size, 2)
        over = peer.try_begin(IDENTITY, [3, 2, 3], seed=3)
        assert isinstance(over, m.ErrorReply)
        assert over.code is ErrorCode.REFUSED
        assert _status(daemon)["writeback"]["refused_at_begin"] == 1
        assert isinstance(peer.call(m.PutAbort(id=peer.next_id(), put=first)), m.PutAbortReply)
        assert _status(daemon)["staged_bytes"] == size  # an abort gives its bytes back
        assert isinstance(peer.try_begin(IDENTITY, [3, 2, 3], seed=3), int)


def test_a_put_under_block_waits_for_staged_bytes_to_leave(tmp_path: Path) -> None:
    size = _entry_bytes([1, 2, 3], seed=1)
    flags = ["--writeback-max-bytes", str(size), "--writeback-policy", "block"]
    with running_daemon(tmp_path, flags) as daemon, RawPeer(daemon.socket_path) as peer:
        first = peer.begin(IDENTITY, [1, 2, 3], seed=1)
        layers, _ = entry(3, seed=2)
        plan = plan_for(IDENTITY, [2, 2, 3], layers)
        waiting = m.PutBegin(
            id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens([2, 2, 3]), size=plan.file_size
        )
        abort = m.PutAbort(id=peer.next_id(), put=first)
        peer.send(waiting, abort)  # the begin waits for room; the abort makes it
        replies = {reply.id: reply for reply in (peer.receive(), peer.receive())}
        assert isinstance(replies[abort.id], m.PutAbortReply)
        began = replies[waiting.id]
        assert isinstance(began, m.PutBeginReply), began
        assert began.fd is not None
        os.close(began.fd)


def test_a_put_not_committed_in_time_is_aborted_and_its_bytes_returned(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--put-timeout", "0.4"]) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        put = peer.begin(IDENTITY, [1, 2, 3], seed=1)
        assert _status(daemon)["staged_puts"] == 1
        wait_until(lambda: _status(daemon)["staged_puts"] == 0, "the put expired")
        status = _status(daemon)
        assert (status["staged_bytes"], status["abandoned_puts"]) == (0, 1)
        assert staging_files(daemon) == []
        late = peer.call(m.PutCommit(id=peer.next_id(), put=put))
        assert isinstance(late, m.ErrorReply)
        assert late.code is ErrorCode.NOT_FOUND
        assert _events(daemon, "put_expired")


def _allocate_past_the_end(fd: int, length: int) -> None:
    """fallocate(FALLOC_FL_KEEP_SIZE): disk taken beyond the end, the size unchanged."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, 1, 0, length) != 0:
        pytest.skip(f"fallocate: {os.strerror(ctypes.get_errno())}")


@pytest.mark.parametrize("how", ["written-past-the-end", "allocated-past-the-end"])
def test_a_put_whose_staging_file_outgrows_its_declaration_is_aborted(
    tmp_path: Path, how: str
) -> None:
    """Bytes past the declared size were never counted under the cap or the floor: the put
    is aborted within the expiry check's period (put_timeout / 4: 2 s here), its file removed."""
    if how == "allocated-past-the-end" and sys.platform != "linux":
        pytest.skip("FALLOC_FL_KEEP_SIZE is Linux's")
    declared = 1 << 16
    with (
        running_daemon(tmp_path, ["--put-timeout", "8"]) as daemon,
        RawPeer(daemon.socket_path) as peer,
    ):
        honest = peer.begin(IDENTITY, [4, 5, 6], seed=2)
        reply = peer.call(
            m.PutBegin(
                id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens([1, 2, 3]), size=declared
            )
        )
        assert isinstance(reply, m.PutBeginReply), reply
        assert reply.fd is not None
        try:
            if how == "written-past-the-end":
                os.pwrite(reply.fd, b"\xff" * (8 << 20), declared)
            else:
                _allocate_past_the_end(reply.fd, 64 << 20)
            wait_until(lambda: _status(daemon)["puts"]["outgrown"] == 1, "the put was aborted", 10)
        finally:
            os.close(reply.fd)
        late = peer.call(m.PutCommit(id=peer.next_id(), put=reply.put))
        assert isinstance(late, m.ErrorReply)
        assert late.code is ErrorCode.NOT_FOUND
        status = _status(daemon)
        assert status["staged_puts"] == 1  # the honest put is untouched
        assert len(staging_files(daemon)) == 1
        assert _events(daemon, "put_outgrown")
        committed = peer.call(m.PutCommit(id=peer.next_id(), put=honest))
        assert isinstance(committed, m.PutCommitReply), committed


# --- the free-disk floor ---------------------------------------------------------------------

MIB = 1 << 20


def _mib_entry(mib: int) -> tuple[list[LayerSpec], list[np.ndarray]]:
    """An entry of about mib MiB: two layers of keys and values of float32 zeros."""
    spec = TensorSpec("float32", (1, 1, mib * 64, 1024))  # mib / 4 MiB a tensor
    return [LayerSpec("kv", (spec, spec), True)] * 2, [np.zeros(spec.shape, np.float32)] * 4


def test_the_floor_evicts_for_a_put_begun_and_refuses_what_no_eviction_makes_room_for(
    small_disk: Path,
) -> None:
    """48 MiB of disk, a floor of 20 MiB: old entries make way for a new one; an entry that
    could not keep the floor even on an empty tier is refused, and nothing is evicted for it."""
    flags = ["--min-free", "20M", "--max-bytes", "1G"]
    with (
        running_daemon(small_disk, flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        for first in range(3):  # 24 MiB held: 24 free, over the floor
            layers, tensors = _mib_entry(8)
            ticket = client.put_entry(IDENTITY, [first, 1, 2], layers, tensors)
            assert ticket.wait(SETTLE_SECONDS).state == "stored"
        assert _status(daemon)["evictions"] == 0
        layers, tensors = _mib_entry(8)  # 24 - 8 < 20: the oldest entry makes way
        ticket = client.put_entry(IDENTITY, [9, 1, 2], layers, tensors)
        assert ticket.wait(SETTLE_SECONDS).state == "stored"
        status = _status(daemon)
        assert status["evictions"] >= 1
        assert client.lookup(IDENTITY, [0, 1, 2, 3]) is None  # the least recently used went
        for kept in (1, 2):  # and only it: the room its file frees counts before it is unlinked
            hit = client.lookup(IDENTITY, [kept, 1, 2, 3])
            assert hit is not None
            hit.release()
        assert status["disk_free_bytes"] >= 20 * MIB
        entries = status["entries"]
        layers, tensors = _mib_entry(32)  # 48 - 32 < 20 whatever goes: refused outright
        refused = client.put_entry(IDENTITY, [7, 1, 2], layers, tensors)
        assert refused.state.state != "pending"
        assert "no_space" in (refused.state.reason or "")
        status = _status(daemon)
        assert (status["entries"], status["staged_bytes"]) == (entries, 0)
        assert staging_files(daemon) == []


def test_a_snapshot_that_would_cross_the_floor_is_not_written(small_disk: Path) -> None:
    tier = small_disk / "tier"
    first_flags = ["--dir", str(tier), "--min-free", "0"]
    with (
        running_daemon(small_disk.parent / "first", first_flags) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        for first in range(4):
            put_stored(client, IDENTITY, [first, *range(1, 64)], seed=first)
    (tier / "index.snapshot").unlink()
    free = os.statvfs(tier).f_bavail * os.statvfs(tier).f_frsize
    # A floor 100 bytes under what is free: four rows of 64 tokens would cross it.
    flags = ["--dir", str(tier), "--min-free", str(free - 100)]
    with running_daemon(small_disk.parent / "second", flags) as daemon:
        assert _status(daemon)["entries"] == 4
    assert not (tier / "index.snapshot").exists()
    assert _events(daemon, "snapshot_skipped")


def test_a_lookup_with_no_descriptor_free_is_a_miss_and_the_entry_stays(tmp_path: Path) -> None:
    flags = ["--max-connections", "1000"]
    with (
        running_daemon(tmp_path, flags, open_files=64) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put_stored(client, IDENTITY, [1, 2, 3], seed=1)
        flood = []
        for _ in range(80):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(daemon.socket_path)
            flood.append(sock)
        wait_until(lambda: _events(daemon, "accept_paused"), "the descriptors used up")
        assert client.lookup(IDENTITY, [1, 2, 3, 4]) is None  # no descriptor for the file
        assert _events(daemon, "entry_unreadable")
        for sock in flood:
            sock.close()
        found = wait_until(lambda: client.lookup(IDENTITY, [1, 2, 3, 4]), "the entry served again")
        assert found is not None
        found.release()
