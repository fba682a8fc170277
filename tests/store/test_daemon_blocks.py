"""Shared blocks (format v2) end to end: stored once, held at put_begin, collected with the
last manifest that lists them, never served missing or bad, counted as the directory holds
them; bad requests about blocks refused with nothing lost."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from blocks_e2e import (
    BLOCK_TOKENS,
    Begun,
    Found,
    assert_counts_equal_the_directory,
    begin,
    block_files,
    commit,
    deleter_idle,
    end_lease,
    kv_tensors,
    look_up,
    manifest_files,
    manifest_plan,
    put_blocks,
    put_v2,
    read_manifest,
    same,
    status,
    wait,
    write_block,
    write_blocks,
)
from daemon_e2e import IDENTITY, RawPeer, put_stored, python_child, wait_until
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client.client import Client
from kvd_client.put_calls import batch_blocks
from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode

PREFIX = list(range(1000, 1000 + 4 * BLOCK_TOKENS))  # four whole blocks every entry shares


def conversation(n: int, own_blocks: int = 1) -> list[int]:
    """The shared prefix, own_blocks blocks of this conversation's own, and a tail of 5."""
    return PREFIX + [n * 100 + i for i in range(own_blocks * BLOCK_TOKENS + 5)]


def test_a_shared_prefix_is_stored_once_and_each_entry_served_whole(daemon: Daemon) -> None:
    with RawPeer(daemon.socket_path) as peer:
        first = put_v2(peer, IDENTITY, conversation(1))
        assert first.held == 0
        size = first.manifest.block_size
        second = begin(peer, IDENTITY, conversation(2))
        assert isinstance(second, Begun)
        assert second.held == 4, "the shared prefix is held: not written again"
        assert write_blocks(peer, second) == 1, "only its own block is written"
        ticket = commit(peer, second.put)
        assert isinstance(ticket, int)
        assert wait(peer, ticket).state == "stored"
        now = status(peer)
        assert now["blocks"]["count"] == 6  # 4 shared + 1 + 1
        assert now["dedup_saved_bytes"] == 4 * size
        manifests = sum(manifest_files(daemon.tier).values())
        assert now["unique_bytes"] == manifests + 6 * size
        assert now["logical_bytes"] == manifests + 10 * size
        assert now["unique_bytes"] < now["logical_bytes"]
        assert now["dedup_ratio"] == round(now["logical_bytes"] / now["unique_bytes"], 3)
        (mine,) = [i for i in now["identities"] if i["identity"] == IDENTITY.digest()]
        assert mine["dedup_saved_bytes"] == 4 * size
        assert mine["block_bytes"] == 6 * size
        # A list shows each entry's bytes stored alone (its file and its 5 blocks), not the
        # manifest's file alone.
        listed = peer.call(
            m.ListEntries(id=peer.next_id(), identity=IDENTITY.digest(), limit=10, after=None)
        )
        assert isinstance(listed, m.ListEntriesReply)
        assert sorted(e.bytes for e in listed.entries) == sorted(
            b.manifest.entry.file_size + 5 * size for b in (first, second)
        )
        assert now["bytes_written"] == manifests + 6 * size
        metrics = kvctl(daemon, "metrics").stdout.splitlines()
        assert f"kvd_unique_bytes {float(now['unique_bytes'])}" in metrics
        assert f"kvd_logical_bytes {float(now['logical_bytes'])}" in metrics
        assert f"kvd_dedup_saved_bytes_total {float(4 * size)}" in metrics
        for n, begun in ((1, first), (2, second)):
            found = look_up(peer, IDENTITY, [*conversation(n), 7])
            assert found is not None
            assert found.header.block_hashes == begun.manifest.hashes
            assert same(found, begun), f"entry {n} restored bit-exactly"
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_v1_entries_are_served_next_to_v2_ones_and_after_a_restart(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put_stored(client, IDENTITY, range(64), seed=1)
        with RawPeer(daemon.socket_path) as peer:
            v2 = put_v2(peer, IDENTITY, conversation(1))
            assert (found := look_up(peer, IDENTITY, [*range(64), 9])) is not None
            assert found.header.block_hashes == ()
            assert same(look_up(peer, IDENTITY, [*conversation(1), 9]), v2)
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        assert status(peer)["entries"] == 2
        assert (found := look_up(peer, IDENTITY, [*range(64), 9])) is not None
        assert found.tensors is not None
        assert same(look_up(peer, IDENTITY, [*conversation(1), 9]), v2)
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_bad_block_requests_are_refused_and_lose_nothing(daemon: Daemon) -> None:
    with RawPeer(daemon.socket_path) as peer:
        stored = put_v2(peer, IDENTITY, conversation(1))
        begun = begin(peer, IDENTITY, conversation(2, own_blocks=2))
        assert isinstance(begun, Begun)
        assert begun.held == 4
        for first, count in ((3, 1), (4, 3), (6, 1)):  # below held, past n
            refused = put_blocks(peer, begun.put, first, count)
            assert isinstance(refused, m.ErrorReply)
            assert refused.code == ErrorCode.BAD_MESSAGE, refused
        unknown = put_blocks(peer, begun.put + 99, 4, 1)
        assert isinstance(unknown, m.ErrorReply)
        assert unknown.code == ErrorCode.NOT_FOUND
        # Block 5 never handed out: the commit is refused, the tier keeps what it had.
        write_blocks(peer, Begun(begun.put, 4, begun.manifest, begun.tensors), first=4)
        partial = begin(peer, IDENTITY, conversation(3, own_blocks=2))
        assert isinstance(partial, Begun)
        fds = put_blocks(peer, partial.put, 4, 1)
        assert not isinstance(fds, m.ErrorReply)
        write_block(fds[0], partial.manifest, partial.tensors, 4)
        os.close(fds[0])
        refused_commit = commit(peer, partial.put)
        assert isinstance(refused_commit, m.ErrorReply)
        assert refused_commit.code == ErrorCode.INVALID_ENTRY
        assert "never handed out" in refused_commit.message
        ticket = commit(peer, begun.put)
        assert isinstance(ticket, int)
        assert wait(peer, ticket).state == "stored"
        found = look_up(peer, IDENTITY, [*conversation(1), 7], release=False)
        assert found is not None
        for first, count in ((0, 6), (2, 4)):  # past its 5 blocks
            reply = peer.call(
                m.OpenBlocks(id=peer.next_id(), lease=found.lease, first=first, count=count)
            )
            assert isinstance(reply, m.ErrorReply)
            assert reply.code == ErrorCode.BAD_MESSAGE, reply
        reply = peer.call(m.OpenBlocks(id=peer.next_id(), lease=found.lease + 99, first=0, count=1))
        assert isinstance(reply, m.ErrorReply)
        assert reply.code == ErrorCode.NOT_FOUND
        end_lease(peer, found.lease)
        assert same(look_up(peer, IDENTITY, [*conversation(1), 7]), stored)
        assert same(look_up(peer, IDENTITY, [*conversation(2, own_blocks=2), 7]), begun)
        assert not os.listdir(daemon.tier / "staging")
        assert status(peer)["staged_bytes"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_a_block_that_disagrees_with_its_manifest_fails_its_put_only(tmp_path: Path) -> None:
    """The put wrote block 4's head and data for another index: its commit finds it and is
    refused, its files go, and the entries the tier had are untouched."""
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        stored = put_v2(peer, IDENTITY, conversation(1))
        bad = begin(peer, IDENTITY, conversation(2))
        assert isinstance(bad, Begun)
        fds = put_blocks(peer, bad.put, 4, 1)
        assert not isinstance(fds, m.ErrorReply), fds
        write_block(fds[0], bad.manifest, bad.tensors, 3)  # block 3's rows and head, at 4
        os.close(fds[0])
        refused = commit(peer, bad.put)
        assert isinstance(refused, m.ErrorReply), refused
        assert refused.code == ErrorCode.INVALID_ENTRY
        assert "block_hash" in refused.message
        assert not serves(look_up(peer, IDENTITY, [*conversation(2), 7]), bad)
        assert same(look_up(peer, IDENTITY, [*conversation(1), 7]), stored)
        wait_until(lambda: not os.listdir(daemon.tier / "staging"), "its files are gone")
        assert status(peer)["staged_bytes"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_evicting_half_keeps_a_leased_entry_and_all_its_blocks(tmp_path: Path) -> None:
    """Eight conversations on one prefix, under a cap that holds four: 2..5 go, their own
    blocks with them, the shared prefix stays; a reader's leased entry (1, the oldest) and
    every block of it stay readable while it holds the lease."""
    with running_daemon(tmp_path / "probe") as probe, RawPeer(probe.socket_path) as peer:
        sizes = put_v2(peer, IDENTITY, conversation(0))
    manifest, block = sizes.manifest.entry.file_size, sizes.manifest.block_size
    cap = 4 * block + 4 * (manifest + block) + manifest // 2
    flags = ["--max-bytes", str(cap)]
    with running_daemon(tmp_path / "run", flags) as daemon, RawPeer(daemon.socket_path) as peer:
        puts = {n: put_v2(peer, IDENTITY, conversation(n)) for n in range(1, 5)}
        held = look_up(peer, IDENTITY, [*conversation(1), 7], release=False)
        assert same(held, puts[1])
        assert held is not None
        puts |= {n: put_v2(peer, IDENTITY, conversation(n)) for n in range(5, 9)}
        now = status(peer)
        assert now["entries"] == 4
        assert now["evictions"] == 4
        assert now["unique_bytes"] <= cap
        reread = look_up(peer, IDENTITY, [*conversation(1), 7], release=False)
        assert same(reread, puts[1]), "the leased entry and its blocks are all there"
        assert reread is not None
        end_lease(peer, reread.lease)
        for gone in (2, 3, 4, 5):
            assert not serves(look_up(peer, IDENTITY, [*conversation(gone), 7]), puts[gone])
        for kept in (6, 7, 8):
            assert same(look_up(peer, IDENTITY, [*conversation(kept), 7]), puts[kept])
        end_lease(peer, held.lease)
        assert status(peer)["blocks"]["count"] == 4 + 4
        assert_counts_equal_the_directory(peer, daemon.tier)


KILL_DURING_A_PUT = """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from blocks_e2e import begin, commit, write_blocks
    from daemon_e2e import IDENTITY, RawPeer

    peer = RawPeer(sys.argv[2])
    first = int(sys.argv[3])
    began = begin(peer, IDENTITY, [*range(1000, 1064), *range(first, first + 16 * 40 + 5)])
    write_blocks(peer, began)
    print("ready", flush=True)
    commit(peer, began.put)
    time.sleep(600)
"""


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05])
def test_a_kill_during_a_put_that_shares_blocks_serves_nothing_broken(
    tmp_path: Path, delay: float
) -> None:
    """kill -9 while a put that holds the shared prefix is committed and written (40 new
    blocks); on restart: no manifest served with a missing or bad block, the refs and bytes
    equal the directory, orphan blocks collected, the stored entry still whole."""
    with running_daemon(tmp_path) as daemon:
        with RawPeer(daemon.socket_path) as peer:
            stored = put_v2(peer, IDENTITY, conversation(1))
        with python_child(KILL_DURING_A_PUT, daemon.socket_path, "5000"):
            time.sleep(delay)
            daemon.kill()
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        assert same(look_up(peer, IDENTITY, [*conversation(1), 7]), stored)
        other = look_up(peer, IDENTITY, [*PREFIX, *range(5000, 5000 + 16 * 40 + 5), 7])
        assert other is not None, "the prefix at least is served"
        assert other.tensors is not None, other.problem
        assert not os.listdir(daemon.tier / "staging")
        assert_counts_equal_the_directory(peer, daemon.tier)


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_restart_collects_orphans_and_quarantines_a_manifest_missing_a_block(
    tmp_path: Path, snapshot: bool
) -> None:
    """Behind a stopped daemon: entry 2 loses its own block, entry 3 its manifest. At start
    entry 2 is quarantined (block_missing), entry 3's block is an orphan and collected, and
    entry 1 is served whole, from the snapshot's rows or from a scan of the headers."""
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        puts = {n: put_v2(peer, IDENTITY, conversation(n)) for n in (1, 2, 3)}
    tier = tmp_path / "tier"
    folder = tier / "entries" / IDENTITY.digest()
    (folder / "blocks" / own_block_name(puts[2])).unlink()
    third = [
        p for p in folder.glob("*.kve") if read_manifest(p).block_hashes == puts[3].manifest.hashes
    ]
    third[0].unlink()
    if not snapshot:
        (tier / "index.snapshot").unlink()
    with running_daemon(tmp_path) as daemon, RawPeer(daemon.socket_path) as peer:
        now = status(peer)
        assert now["entries"] == 1
        assert same(look_up(peer, IDENTITY, [*conversation(1), 7]), puts[1])
        assert not serves(look_up(peer, IDENTITY, [*conversation(2), 7]), puts[2])
        assert not (folder / "blocks" / own_block_name(puts[3])).exists(), "the orphan goes"
        assert now["blocks"]["count"] == 5
        assert [p.suffix for p in (tier / "quarantine").iterdir()] == [".kve"]
        assert_counts_equal_the_directory(peer, daemon.tier)


def own_block_name(begun: Begun) -> str:
    """The file name of a conversation's own block (its fifth, after the shared four)."""
    return begun.manifest.hashes[4].hex() + ".kvb"


def serves(found: Found | None, begun: Begun) -> bool:
    """Whether a lookup served the entry of that put (rather than another, or nothing)."""
    return found is not None and found.header.tokens == begun.manifest.entry.header.tokens


def flip_a_data_byte(path: Path, begun: Begun) -> None:
    """One byte inside the block's first slot flipped: its size unchanged, its head intact."""
    offset = begun.manifest.block_slots[0].start
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 1]))


def test_a_block_removed_or_damaged_behind_the_daemons_back_is_never_served(
    daemon: Daemon,
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        puts = {n: put_v2(peer, IDENTITY, conversation(n)) for n in (1, 2, 3)}
        folder = daemon.tier / "entries" / IDENTITY.digest() / "blocks"
        (folder / own_block_name(puts[1])).unlink()  # removed: the watcher drops its manifest
        wait_until(lambda: status(peer)["entries"] == 2, "entry 1 leaves with its block")
        assert not serves(look_up(peer, IDENTITY, [*conversation(1), 7]), puts[1])
        truncated = folder / own_block_name(puts[2])  # truncated: open_blocks finds it
        os.truncate(truncated, truncated.stat().st_size - 1)
        found = look_up(peer, IDENTITY, [*conversation(2), 7])
        assert found is not None
        assert found.tensors is None
        assert "block_missing" in (found.problem or "")
        flip_a_data_byte(folder / own_block_name(puts[3]), puts[3])  # the reader's checksum
        damaged = look_up(peer, IDENTITY, [*conversation(3), 7])  # released as damaged
        assert damaged is not None
        assert damaged.tensors is None
        wait_until(lambda: status(peer)["entries"] == 0, "every damaged entry goes")
        for n in (1, 2, 3):
            assert not serves(look_up(peer, IDENTITY, [*conversation(n), 7]), puts[n])
        assert status(peer)["blocks"]["count"] == 0
        assert status(peer)["quarantined"] >= 4  # two blocks, at least two manifests
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_kvctl_verify_checks_the_blocks_and_status_shows_them(daemon: Daemon) -> None:
    """A bit flipped in the shared first block: both entries that list it are named
    damaged by it, and --repair quarantines it with both."""
    with RawPeer(daemon.socket_path) as peer:
        first = put_v2(peer, IDENTITY, conversation(1))
        put_v2(peer, IDENTITY, conversation(2))
    shown = kvctl(daemon, "status")
    assert shown.returncode == 0, shown.stderr
    assert "6 blocks" in shown.stdout
    entry = next(p.stem for p in (daemon.tier / "entries").glob("*/*.kve"))
    one = kvctl(daemon, "show", entry)
    assert one.returncode == 0, one.stderr
    assert f"5 shared blocks of {BLOCK_TOKENS} tokens" in one.stdout
    ok = kvctl(daemon, "verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "2 entries verified, 0 damaged" in ok.stdout
    shared = daemon.tier / "entries" / IDENTITY.digest() / "blocks"
    flip_a_data_byte(shared / (first.manifest.hashes[0].hex() + ".kvb"), first)
    bad = kvctl(daemon, "verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stdout.count("block 0") == 2, bad.stdout
    assert "2 entries verified, 2 damaged" in bad.stdout
    repaired = kvctl(daemon, "verify", "--repair")
    assert repaired.returncode == 1
    assert "(quarantined)" in repaired.stdout
    with RawPeer(daemon.socket_path) as peer:
        now = status(peer)
        assert now["entries"] == 0
        assert now["blocks"]["count"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_block_files_appearing_behind_the_daemons_back_are_collected_or_quarantined(
    daemon: Daemon,
) -> None:
    """A valid block no manifest lists (a copy of an evicted entry's) is an orphan and
    collected; a file with a block's name that is not one is quarantined."""
    with RawPeer(daemon.socket_path) as peer:
        begun = put_v2(peer, IDENTITY, conversation(1))
        folder = daemon.tier / "entries" / IDENTITY.digest() / "blocks"
        copy = (folder / own_block_name(begun)).read_bytes()
        evicted = peer.call(m.Evict(id=peer.next_id(), entry=None, identity=None, all=True))
        assert isinstance(evicted, m.EvictReply), evicted
        assert evicted.evicted == 1
        assert evicted.bytes == begun.manifest.entry.file_size + 5 * begun.manifest.block_size
        deleter_idle(peer)
        assert block_files(daemon.tier) == {}, "the blocks go with their last manifest"
        (folder / own_block_name(begun)).write_bytes(copy)
        fake = folder / ("cd" * 16 + ".kvb")
        fake.write_bytes(b"not a block")
        wait_until(
            lambda: block_files(daemon.tier) == {}, "the orphan is collected, the fake moved"
        )
        assert [p.name for p in (daemon.tier / "quarantine").iterdir()] == [fake.name]
        assert status(peer)["blocks"]["count"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_a_put_that_ends_uncommitted_lets_go_of_its_held_blocks(daemon: Daemon) -> None:
    """The blocks a put was told are held stay while it is under way (an eviction cannot
    take them), and go once its connection ends and the last manifest listing them goes."""
    with RawPeer(daemon.socket_path) as peer:
        put_v2(peer, IDENTITY, conversation(1))
        with RawPeer(daemon.socket_path) as putter:
            begun = begin(putter, IDENTITY, conversation(2))
            assert isinstance(begun, Begun)
            assert begun.held == 4
            write_blocks(putter, begun)
            evict = m.Evict(id=peer.next_id(), entry=None, identity=None, all=True)
            assert isinstance(peer.call(evict), m.EvictReply)
            deleter_idle(peer)
            assert len(block_files(daemon.tier)) == 4, "the held prefix is pinned by the put"
        wait_until(lambda: status(peer)["staged_puts"] == 0, "the put is abandoned")
        deleter_idle(peer)
        assert block_files(daemon.tier) == {}
        assert not os.listdir(daemon.tier / "staging")
        assert status(peer)["staged_bytes"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_a_held_block_that_goes_bad_during_a_put_fails_its_commit_cleanly(daemon: Daemon) -> None:
    with RawPeer(daemon.socket_path) as peer:
        stored = put_v2(peer, IDENTITY, conversation(1))
        begun = begin(peer, IDENTITY, conversation(2))
        assert isinstance(begun, Begun)
        assert begun.held == 4
        write_blocks(peer, begun)
        shared = daemon.tier / "entries" / IDENTITY.digest() / "blocks"
        (shared / (stored.manifest.hashes[0].hex() + ".kvb")).unlink()
        wait_until(lambda: status(peer)["entries"] == 0, "the entry listing it goes")
        refused = commit(peer, begun.put)
        assert isinstance(refused, m.ErrorReply)
        assert refused.code == ErrorCode.NOT_FOUND
        assert "block_missing" in refused.message
        deleter_idle(peer)
        assert not os.listdir(daemon.tier / "staging")
        now = status(peer)
        assert (now["staged_bytes"], now["blocks"]["count"]) == (0, 0)
        assert_counts_equal_the_directory(peer, daemon.tier)


def test_an_engine_library_put_has_its_blocks_checked_as_it_hands_them_over(
    daemon: Daemon,
) -> None:
    """A put of more blocks than one batch (put_calls.batch_blocks): each batch is closed
    before the next is asked for, so every block but the last batch's passes its check before
    the commit (Linux: sealed by a read lease; macOS clones them all at the commit), and the
    entry is stored and served whole."""
    tokens = list(range(7000, 7000 + 9 * BLOCK_TOKENS + 5))
    width = 32768  # 8 MiB a block: more than one batch
    layers, tensors = kv_tensors(tokens, width)
    per_batch = batch_blocks(manifest_plan(IDENTITY, tokens, width).block_size)
    last_batch = (9 - 1) % per_batch + 1  # checked at the commit
    assert per_batch < 9
    with RawPeer(daemon.socket_path) as peer:
        before = status(peer)["puts"]
        with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK_TOKENS) as client:
            assert client.put_entry(IDENTITY, tokens, layers, tensors).wait(60).state == "stored"
            assert client.stats.blocks_written == 9
        after = status(peer)["puts"]
        early = 9 - last_batch if sys.platform == "linux" else 0
        assert after["checked_early"] - before["checked_early"] == early
        assert after["sealed_by_copy"] == before["sealed_by_copy"] + (
            0 if sys.platform == "linux" else 10
        )
        hit = look_up(peer, IDENTITY, [*tokens, 7])
        assert hit is not None
        assert hit.tensors is not None, hit.problem
        assert [t.tobytes() for t in hit.tensors] == [t.tobytes() for t in tensors]
