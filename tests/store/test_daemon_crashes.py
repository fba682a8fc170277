"""Clients and the daemon killed at awkward moments; hostile files in the tier."""

from __future__ import annotations

import os
import shutil

from daemon_e2e import (
    ENTRY_BYTES,
    IDENTITY,
    OTHER_IDENTITY,
    SETTLE_SECONDS,
    files_on_disk,
    looked_up_tokens,
    put_stored,
    python_child,
    report,
    staging_files,
    wait_until,
)
from daemon_process import Daemon
from kvd_client.client import Client

HOLD_A_PUT = """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from daemon_e2e import IDENTITY, RawPeer
    from kvd_protocol import messages as m
    from kvd_protocol.tokens import pack_tokens

    peer = RawPeer(sys.argv[2])
    reply = peer.call(m.PutBegin(id=peer.next_id(), identity=IDENTITY,
                                 tokens=pack_tokens(range(64)), size=1 << 20))
    assert isinstance(reply, m.PutBeginReply) and reply.fd is not None, reply
    print("ready", flush=True)
    time.sleep(600)
"""

HOLD_A_LEASE = """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from daemon_e2e import IDENTITY
    from kvd_client.client import Client

    client = Client.connect(sys.argv[2], require=True)
    result = client.lookup(IDENTITY, list(range(64)) + [1])
    assert result is not None
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_putter_killed_before_commit_leaves_nothing_behind(daemon: Daemon) -> None:
    with python_child(HOLD_A_PUT, daemon.socket_path) as child:
        assert len(staging_files(daemon)) == 1
        child.kill()
        wait_until(lambda: not staging_files(daemon), "the staging file is reaped")
    with Client.connect(daemon.socket_path, require=True) as client:
        after = report(client)
    assert after["abandoned_puts"] == 1
    assert after["writeback"]["pending_bytes"] == 0
    assert (after["entries"], after["bytes"]) == (0, 0)


def test_a_reader_killed_while_holding_a_lease_releases_it(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, range(64), seed=1)
        assert client.flush(SETTLE_SECONDS)
        with python_child(HOLD_A_LEASE, daemon.socket_path) as child:
            assert report(client)["leased_entries"] == 1
            child.kill()
            wait_until(lambda: report(client)["leased_entries"] == 0, "the lease ends")
        evicted = client.evict(all=True)
        assert evicted.entries == 1
        assert files_on_disk(daemon) == (0, 0)  # not held: deleted at once
        assert report(client)["bytes"] == 0


def test_a_lease_of_a_killed_reader_lets_a_doomed_entry_go(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, range(64), seed=1)
        assert client.flush(SETTLE_SECONDS)
        with python_child(HOLD_A_LEASE, daemon.socket_path) as child:
            assert client.evict(all=True).entries == 1
            assert files_on_disk(daemon) == (1, ENTRY_BYTES)  # leased: kept
            child.kill()
            wait_until(lambda: files_on_disk(daemon) == (0, 0), "the file is deleted")
        assert report(client)["bytes"] == 0


STREAM_PUTS = """
    import sys
    sys.path.insert(0, sys.argv[1])
    from daemon_e2e import IDENTITY, entry
    from kvd_client.client import Client

    client = Client.connect(sys.argv[2], require=True)
    print("ready", flush=True)
    for i in range(1000, 100000):
        tokens = [i, *range(48)]
        layers, tensors = entry(len(tokens), seed=i)
        if client.put_entry(IDENTITY, tokens, layers, tensors).state.state == "unavailable":
            break
"""


def test_a_daemon_killed_mid_stream_restarts_consistent(daemon: Daemon) -> None:
    durable = list(range(8))
    with Client.connect(daemon.socket_path, require=True) as client:
        for first in durable:
            put_stored(client, IDENTITY, [first, *range(48)], seed=first)
        assert client.flush(SETTLE_SECONDS)
        with python_child(STREAM_PUTS, daemon.socket_path):
            wait_until(lambda: report(client)["entries"] >= 20, "the stream makes progress")
            daemon.kill()
    daemon.start()
    assert staging_files(daemon) == []
    with Client.connect(daemon.socket_path, require=True) as client:
        after = report(client)
        assert (after["entries"], after["bytes"]) == files_on_disk(daemon)
        for first in durable:  # flush said durable before the kill
            assert looked_up_tokens(client, IDENTITY, [first, *range(48), 1]) == 49
        served = 0
        for first in range(1000, 1000 + after["entries"] + 50):
            found = looked_up_tokens(client, IDENTITY, [first, *range(48), 1])  # verifies
            served += found is not None
        assert served == after["entries"] - len(durable)
        assert client.stats.rejected_entries == 0


def test_hostile_files_are_quarantined_at_start_and_never_served(daemon: Daemon) -> None:
    folder = daemon.tier / "entries" / IDENTITY.digest()
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, range(64), seed=1)
        assert client.flush(SETTLE_SECONDS)
        (good,) = folder.iterdir()
        put_stored(client, IDENTITY, [7, *range(64)], seed=2)
        assert client.flush(SETTLE_SECONDS)
        (flipped,) = set(folder.iterdir()) - {good}
    daemon.stop()
    data = bytearray(flipped.read_bytes())
    data[60] ^= 0xFF  # inside the msgpack header, in place: same name, same size
    flipped.write_bytes(bytes(data))
    (folder / f"{'a' * 32}.kve").write_bytes(os.urandom(3 * 16384))
    (folder / f"{'b' * 32}.kve").write_bytes(good.read_bytes()[: ENTRY_BYTES // 2])
    (folder / "notes.txt").write_text("not an entry")
    elsewhere = daemon.tier / "entries" / OTHER_IDENTITY.digest()
    elsewhere.mkdir()
    shutil.copy(good, elsewhere / f"{'c' * 32}.kve")

    daemon.start()
    assert len(list((daemon.tier / "quarantine").iterdir())) == 5
    with Client.connect(daemon.socket_path, require=True) as client:
        after = report(client)
        assert after["quarantined"] == 5
        assert after["entries"] == 1
        assert (after["entries"], after["bytes"]) == files_on_disk(daemon)
        assert looked_up_tokens(client, IDENTITY, [*range(64), 1]) == 64
        assert looked_up_tokens(client, IDENTITY, [7, *range(64), 1]) is None
        assert client.lookup(OTHER_IDENTITY, [*range(64), 1]) is None
        assert client.stats.rejected_entries == 0
