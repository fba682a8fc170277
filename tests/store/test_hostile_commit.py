"""Clients that lie at commit or touch their staging files after it, against a real daemon:
each put is sealed and checked whole by its commit (its blocks as they are handed over, if no
writer of them is left then), so a lie fails alone, there, and what the tier stores and
serves is what was committed, whatever the client does to its descriptors."""

from __future__ import annotations

import mmap
import os
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from blocks_e2e import (
    BLOCK_TOKENS,
    Begun,
    assert_counts_equal_the_directory,
    begin,
    commit,
    kv_tensors,
    look_up,
    manifest_plan,
    put_blocks,
    put_v2,
    same,
    status,
    wait,
    write_block,
    write_blocks,
)
from daemon_e2e import (
    IDENTITY,
    RawPeer,
    entry,
    plan_for,
    put_stored,
    staging_files,
    wait_until,
)
from daemon_process import Daemon
from kvd_client.client import Client
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import messages as m
from kvd_protocol.entry import LayerSpec, TensorSpec, plan_entry
from kvd_protocol.errors import ErrorCode
from kvd_protocol.tokens import pack_tokens

WITNESS = list(range(1000, 1064))
PROMPT = list(range(1, 257))
BIG_WIDTH = 8192  # 32 MiB an entry of PROMPT: still being read when the client strikes
SPREAD_WIDTH = 16384  # 64 MiB an entry of PROMPT: its slots checked on several threads
BLOCKS = list(range(2000, 2000 + 4 * BLOCK_TOKENS + 5))  # four blocks and a tail
BIG_BLOCK_WIDTH = 32768  # 8 MiB a block


@pytest.fixture
def witness(daemon: Daemon) -> Iterator[list[np.ndarray]]:
    """An honest client's entry stored before the trouble, served exactly after it; the
    daemon still up at the end, and its counts those of its directory."""
    with Client.connect(daemon.socket_path, require=True) as client:
        kept = put_stored(client, IDENTITY, WITNESS, seed=1)
    yield kept
    with Client.connect(daemon.socket_path, require=True) as client:
        hit = client.lookup(IDENTITY, [*WITNESS, 7])
        assert hit is not None
        with hit:
            assert [bytes(v) for v in hit.tensors] == [t.tobytes() for t in kept]
    with RawPeer(daemon.socket_path) as peer:
        assert status(peer)["staged_bytes"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)
    assert daemon.stop() == 0  # it never died (a SIGBUS is -7)


def begun_open(
    peer: RawPeer, tokens: Sequence[int], seed: int, *, width: int = 8, created: float | None = None
) -> tuple[int, int, list[np.ndarray]]:
    """put_begin and the entry written into its staging file, whose descriptor the client
    keeps: (put, descriptor, tensors). created: the header's creation time, if not now."""
    layers, tensors = entry(len(tokens), seed, width=width)
    if created is None:
        plan = plan_for(IDENTITY, tokens, layers)
    else:
        plan = plan_entry(IDENTITY, pack_tokens(tokens), layers, created=created, min_reuse=0)
    reply = peer.call(
        m.PutBegin(
            id=peer.next_id(), identity=IDENTITY, tokens=plan.header.tokens, size=plan.file_size
        )
    )
    assert isinstance(reply, m.PutBeginReply), reply
    assert reply.fd is not None
    write_entry(reply.fd, plan, tensor_views(plan, tensors))
    return reply.put, reply.fd, tensors


def served(daemon: Daemon, tokens: Sequence[int]) -> list[bytes] | None:
    """The tensors a lookup of tokens serves, checked against their checksums; None: a miss."""
    with Client.connect(daemon.socket_path, require=True) as client:
        hit = client.lookup(IDENTITY, [*tokens, 7])
        if hit is None:
            return None
        with hit:
            assert hit.header.token_count == len(tokens)
            return [bytes(v) for v in hit.tensors]


def begun_blocks_open(peer: RawPeer, tokens: Sequence[int], width: int) -> tuple[Begun, list[int]]:
    """A v2 put begun, its manifest and every block not held written, the blocks'
    descriptors kept (the first is block begun.held's)."""
    begun = begin(peer, IDENTITY, tokens, width=width)
    assert isinstance(begun, Begun), begun
    count = len(begun.manifest.hashes) - begun.held
    fds = put_blocks(peer, begun.put, begun.held, count)
    assert not isinstance(fds, m.ErrorReply), fds
    for index, fd in enumerate(fds, start=begun.held):
        write_block(fd, begun.manifest, begun.tensors, index)
    return begun, fds


def assert_refused(reply: int | m.Reply, rule: str) -> None:
    """The commit was refused as an invalid entry, for the rule named."""
    assert isinstance(reply, m.ErrorReply), f"the commit was taken: {reply}"
    assert reply.code == ErrorCode.INVALID_ENTRY, reply
    assert rule in reply.message, reply.message


@pytest.mark.parametrize("after_reply", [False, True], ids=["before-the-reply", "after-the-reply"])
def test_a_staging_file_truncated_at_its_commit_takes_nothing_down(
    daemon: Daemon, witness: list[np.ndarray], after_reply: bool
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        put, fd, tensors = begun_open(peer, PROMPT, seed=2, width=BIG_WIDTH)
        try:
            peer.send(m.PutCommit(id=peer.next_id(), put=put))
            if after_reply:
                reply = peer.receive()
                os.ftruncate(fd, 16384)
            else:
                os.ftruncate(fd, 16384)
                reply = peer.receive()
        finally:
            os.close(fd)
        if isinstance(reply, m.PutCommitReply):  # sealed before the truncation: intact
            assert wait(peer, reply.ticket).state == "stored"
            assert served(daemon, PROMPT) == [t.tobytes() for t in tensors]
        else:
            assert isinstance(reply, m.ErrorReply), reply
            assert reply.code == ErrorCode.INVALID_ENTRY, reply
            assert served(daemon, PROMPT) is None


def test_a_block_file_truncated_after_its_commit_takes_nothing_down(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        begun, fds = begun_blocks_open(peer, BLOCKS, BIG_BLOCK_WIDTH)
        try:
            reply = commit(peer, begun.put)
            os.ftruncate(fds[0], 16384)  # the block the writer makes durable first
        finally:
            for fd in fds:
                os.close(fd)
        assert isinstance(reply, int), reply  # every file was whole at its commit
        assert wait(peer, reply).state == "stored"
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), begun)


def test_a_client_that_keeps_its_descriptors_cannot_change_what_is_stored(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """Entry and blocks overwritten through the descriptors the client kept, once stored:
    the tier serves what was committed, from the copies the daemon made at commit; an
    honest put through the engine library (descriptors closed before its commit) takes no
    copy."""
    with Client.connect(daemon.socket_path, require=True, block_tokens=BLOCK_TOKENS) as client:
        tokens = list(range(3000, 3040))  # two blocks and a tail
        layers, tensors = kv_tensors(tokens)
        assert client.put_entry(IDENTITY, tokens, layers, tensors).wait(30).state == "stored"
        assert client.stats.blocks_written == 2
    with RawPeer(daemon.socket_path) as peer:
        # macOS clones every file: the witness's, this manifest and its two blocks.
        before = status(peer)["puts"]["sealed_by_copy"]
        assert before == (4 if sys.platform == "darwin" else 0)
        put, fd, kept = begun_open(peer, PROMPT, seed=3)
        begun, fds = begun_blocks_open(peer, BLOCKS, 8)
        try:
            for put_id in (put, begun.put):
                ticket = commit(peer, put_id)
                assert isinstance(ticket, int), ticket
                assert wait(peer, ticket).state == "stored"
            for held in (fd, *fds):
                size = os.fstat(held).st_size
                os.pwrite(held, b"\xa5" * size, 0)  # header and data, all of it
                os.pwrite(held, b"\x5a" * 4096, size)  # and more
        finally:
            for held in (fd, *fds):
                os.close(held)
        assert served(daemon, PROMPT) == [t.tobytes() for t in kept]
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), begun)
        assert status(peer)["puts"]["sealed_by_copy"] == before + 1 + len(fds)
        assert staging_files(daemon) == []  # the client's files went to be deleted


@pytest.mark.parametrize("lie", [1, 16384], ids=["one-byte", "a-page-too-many"])
def test_a_put_that_lies_about_its_block_size_is_refused_at_its_commit(
    daemon: Daemon, witness: list[np.ndarray], lie: int
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        true_size = manifest_plan(IDENTITY, BLOCKS).block_size
        declared = lie if lie == 1 else true_size + lie
        liar = begin(peer, IDENTITY, BLOCKS, block_size=declared)
        assert isinstance(liar, Begun), liar
        write_blocks(peer, liar)  # each block at its true size
        assert_refused(commit(peer, liar.put), "file_size")
        assert staging_files(daemon) == []
        assert status(peer)["puts"]["refused_at_commit"] == 1
        assert status(peer)["staged_bytes"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)
        honest = put_v2(peer, IDENTITY, BLOCKS)
        assert honest.held == 0  # nothing of the liar's was kept
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), honest)
    assert '"event": "put_refused"' in daemon.logs()


@pytest.mark.parametrize("lie", [1, 16384], ids=["one-byte", "a-page-too-many"])
def test_a_put_that_lies_about_the_size_of_blocks_it_holds_is_refused_at_its_begin(
    daemon: Daemon, witness: list[np.ndarray], lie: int
) -> None:
    """Every block held: nothing of the liar's is written, but its declared size would be
    the entry's (its logical bytes, its snapshot row, and at the next start a block_mismatch
    that quarantines it)."""
    with RawPeer(daemon.socket_path) as peer:
        honest = put_v2(peer, IDENTITY, BLOCKS)
        true_size = honest.manifest.block_size
        declared = lie if lie == 1 else true_size + lie
        liar = begin(peer, IDENTITY, [*BLOCKS, 9, 9, 9], block_size=declared)
        assert isinstance(liar, m.ErrorReply), liar
        assert liar.code == ErrorCode.BAD_MESSAGE, liar
        assert f"{true_size} bytes" in liar.message, liar.message
        assert staging_files(daemon) == []
        assert status(peer)["staged_bytes"] == 0
        assert_counts_equal_the_directory(peer, daemon.tier)
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), honest)


def spoil_a_block(fd: int, begun: Begun) -> None:
    """Bytes of a block's first slot changed behind its valid head (its checksum no longer
    matches)."""
    os.pwrite(fd, b"\xff" * 64, begun.manifest.block_slots[0].start)


def test_a_block_of_garbage_behind_a_valid_head_fails_its_put_alone(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """A liar's spoiled block, committed while an honest put of the same prefix is under
    way, and before one begins: the liar is refused, the honest puts are never told its
    blocks are held, and they store and serve their own."""
    with RawPeer(daemon.socket_path) as liar_peer, RawPeer(daemon.socket_path) as peer:
        liar, fds = begun_blocks_open(liar_peer, BLOCKS, 8)
        spoil_a_block(fds[1], liar)
        for fd in fds:
            os.close(fd)
        honest = begin(peer, IDENTITY, BLOCKS)  # while the liar is pending
        assert isinstance(honest, Begun), honest
        assert honest.held == 0
        write_blocks(peer, honest)
        assert_refused(commit(liar_peer, liar.put), "data_checksum")
        ticket = commit(peer, honest.put)
        assert isinstance(ticket, int), ticket
        assert wait(peer, ticket).state == "stored"
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), honest)

        other = [*BLOCKS[: 2 * BLOCK_TOKENS], *range(5000, 5000 + 2 * BLOCK_TOKENS + 3)]
        liar, fds = begun_blocks_open(liar_peer, other, 8)
        spoil_a_block(fds[1], liar)  # block 3: blocks 0 and 1 are held
        for fd in fds:
            os.close(fd)
        assert_refused(commit(liar_peer, liar.put), "data_checksum")
        after = put_v2(peer, IDENTITY, other)  # begun after the liar's commit
        assert after.held == 2  # the prefix the honest put stored, none of the liar's
        assert same(look_up(peer, IDENTITY, [*other, 7]), after)
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), honest)


@pytest.mark.parametrize(
    "created",
    [time.time() + 365 * 86400, 1e9, 0.0],
    ids=["a-year-ahead", "in-2001", "in-1970"],
)
def test_a_header_with_a_creation_time_out_of_range_is_refused(
    daemon: Daemon, witness: list[np.ndarray], created: float
) -> None:
    with RawPeer(daemon.socket_path) as peer:
        put, fd, _ = begun_open(peer, PROMPT, seed=4, created=created)
        os.close(fd)
        assert_refused(peer.call(m.PutCommit(id=peer.next_id(), put=put)), "creation time")
        assert served(daemon, PROMPT) is None
        assert staging_files(daemon) == []


def test_a_manifest_that_disagrees_with_the_blocks_it_holds_is_refused(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """A liar's manifest over an honest put's blocks (the same tokens, so the same hashes,
    held) declares other shapes for them: refused at its commit. Stored, a reader of it would
    report the blocks damaged, and the daemon's check would quarantine them with the honest
    entry."""
    with RawPeer(daemon.socket_path) as liar_peer, RawPeer(daemon.socket_path) as peer:
        honest = put_v2(peer, IDENTITY, BLOCKS)
        longer = [*BLOCKS, 9, 9, 9]
        # The honest blocks are 8 wide: the liar's are 16, but it declares the size of those
        # it holds (any other is refused at put_begin).
        true_size = honest.manifest.block_size
        liar = begin(liar_peer, IDENTITY, longer, width=16, block_size=true_size)
        assert isinstance(liar, Begun), liar
        assert liar.held == len(liar.manifest.hashes)  # nothing of its own to write
        assert_refused(commit(liar_peer, liar.put), "block_mismatch")
        found = look_up(liar_peer, IDENTITY, [*longer, 7])  # a damage report, if it served one
        assert found is not None
        assert found.header.tokens == honest.manifest.entry.header.tokens
        assert found.problem is None
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), honest)
        assert status(peer)["quarantined"] == 0


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="read leases are Linux's")


def checked_early(peer: RawPeer) -> int:
    count: int = status(peer)["puts"]["checked_early"]
    return count


def handed_over(peer: RawPeer, begun: Begun, first: int, count: int) -> list[int]:
    """Blocks first.. asked for and written; their descriptors, still open."""
    fds = put_blocks(peer, begun.put, first, count)
    assert not isinstance(fds, m.ErrorReply), fds
    for index, fd in enumerate(fds, start=first):
        write_block(fd, begun.manifest, begun.tensors, index)
    return fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


@linux_only
def test_a_block_asked_for_again_after_its_early_check_is_checked_again_at_its_commit(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """Blocks 0 and 1 written and closed, then blocks 2 and 3 asked for: the daemon checks 0
    and 1 meanwhile, and they pass. Block 1 asked for again and spoiled through its new
    descriptor: the check of it no longer holds, the commit checks it again and refuses the
    put; an honest put of the same tokens stores its own blocks."""
    with RawPeer(daemon.socket_path) as peer:
        before = checked_early(peer)
        liar = begin(peer, IDENTITY, BLOCKS)
        assert isinstance(liar, Begun), liar
        assert liar.held == 0
        close_all(handed_over(peer, liar, 0, 2))
        close_all(handed_over(peer, liar, 2, 2))
        wait_until(lambda: checked_early(peer) == before + 2, "blocks 0 and 1 checked early")
        again = put_blocks(peer, liar.put, 1, 1)
        assert not isinstance(again, m.ErrorReply), again
        spoil_a_block(again[0], liar)
        close_all(again)
        assert_refused(commit(peer, liar.put), "data_checksum")
        assert staging_files(daemon) == []
        honest = put_v2(peer, IDENTITY, BLOCKS)
        assert honest.held == 0  # nothing of the liar's was kept
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), honest)


@linux_only
@pytest.mark.parametrize("spoiled", [True, False], ids=["spoiled", "left-alone"])
def test_a_block_still_mapped_writable_is_checked_at_its_commit_not_before(
    daemon: Daemon, witness: list[np.ndarray], spoiled: bool
) -> None:
    """A client that keeps a shared writable mapping of block 1 (its descriptor closed) while
    it asks for the next blocks: block 0 is checked early, block 1 is not (a writer is
    left); at the commit the daemon copies block 1 and checks the copy. Spoiled through the
    mapping after block 0's early check, the put is refused; left alone, it is stored and
    served (the client's file is truncated then: its mapping reaches nothing of the tier)."""
    with RawPeer(daemon.socket_path) as peer:
        before = status(peer)["puts"]
        begun = begin(peer, IDENTITY, BLOCKS)
        assert isinstance(begun, Begun), begun
        first = handed_over(peer, begun, 0, 2)
        size = begun.manifest.block_size
        mapping = mmap.mmap(first[1], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        close_all(first)
        try:
            close_all(handed_over(peer, begun, 2, 2))
            wait_until(
                lambda: checked_early(peer) == before["checked_early"] + 1,
                "block 0 checked early",
            )
            if spoiled:
                at = begun.manifest.block_slots[0].start
                mapping[at : at + 64] = b"\xff" * 64
            reply = commit(peer, begun.put)
        finally:
            mapping.close()
        after = status(peer)["puts"]
        assert after["checked_early"] == before["checked_early"] + 1  # never block 1
        assert after["sealed_by_copy"] == before["sealed_by_copy"] + 1
        if spoiled:
            assert_refused(reply, "data_checksum")
            assert look_up(peer, IDENTITY, [*BLOCKS, 7]) is None
        else:
            assert isinstance(reply, int), reply
            assert wait(peer, reply).state == "stored"
            assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), begun)


@linux_only
def test_a_block_still_open_at_one_put_blocks_is_checked_early_at_a_later_one(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """A client that writes several batches at once (as the daemon's own fetches do): block
    0 is still open while blocks 1 and 2 are asked for, so its checks then find a writer.
    Closed by the time block 3 is asked for, it is checked then, before the commit."""
    with RawPeer(daemon.socket_path) as peer:
        before = checked_early(peer)
        begun = begin(peer, IDENTITY, BLOCKS)
        assert isinstance(begun, Begun), begun
        kept = handed_over(peer, begun, 0, 1)
        try:
            close_all(handed_over(peer, begun, 1, 1))  # block 0's check: a writer is left
            close_all(handed_over(peer, begun, 2, 1))
            # Block 1's check passed: block 0's, begun before it on the same queue, had its
            # lease refused by then.
            wait_until(lambda: checked_early(peer) == before + 1, "block 1 checked early")
        finally:
            close_all(kept)
        close_all(handed_over(peer, begun, 3, 1))
        wait_until(lambda: checked_early(peer) == before + 3, "blocks 0, 1 and 2 checked early")
        ticket = commit(peer, begun.put)
        assert isinstance(ticket, int), ticket
        assert wait(peer, ticket).state == "stored"
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), begun)


@linux_only
def test_a_put_abandoned_while_its_blocks_are_checked_early_leaves_nothing(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """Big blocks still being checked when the client hangs up: the put goes, its files and
    bytes with it, and the same tokens are put afresh."""
    with RawPeer(daemon.socket_path) as peer:
        begun = begin(peer, IDENTITY, BLOCKS, width=BIG_BLOCK_WIDTH)
        assert isinstance(begun, Begun), begun
        close_all(handed_over(peer, begun, 0, 3))
        close_all(handed_over(peer, begun, 3, 1))  # blocks 0..2 checked from here
    with RawPeer(daemon.socket_path) as peer:
        wait_until(lambda: status(peer)["staged_bytes"] == 0, "the put's bytes returned")
        wait_until(lambda: staging_files(daemon) == [], "the put's files removed")
        again = put_v2(peer, IDENTITY, BLOCKS, width=BIG_BLOCK_WIDTH)
        assert again.held == 0
        assert same(look_up(peer, IDENTITY, [*BLOCKS, 7]), again)


def whole_slots(tokens: Sequence[int], width: int) -> list[int]:
    """Where the slots of begun_open's entry of tokens start, in file order."""
    layers, _ = entry(len(tokens), 0, width=width)
    return [slot.start for slot in plan_for(IDENTITY, tokens, layers).slots]


@pytest.mark.parametrize("spoiled", [(0,), (1,), (3,), (1, 3)], ids=["0", "1", "3", "1-and-3"])
def test_a_whole_entry_with_a_spoiled_slot_is_refused_whichever_thread_checks_it(
    daemon: Daemon, witness: list[np.ndarray], spoiled: tuple[int, ...]
) -> None:
    """A whole entry of 64 MiB (four slots, each checked by the commit's thread or a block
    checker's, whichever takes it first) with bytes of some slots changed behind its valid
    head: refused, naming the first spoiled slot in file order; nothing of it stays, and an
    honest put of the same tokens stores and serves its own."""
    starts = whole_slots(PROMPT, SPREAD_WIDTH)
    with RawPeer(daemon.socket_path) as peer:
        put, fd, _ = begun_open(peer, PROMPT, seed=5, width=SPREAD_WIDTH)
        for index in spoiled:
            os.pwrite(fd, b"\xff" * 64, starts[index] + 4096)
        os.close(fd)
        reply = peer.call(m.PutCommit(id=peer.next_id(), put=put))
        assert_refused(reply, "data_checksum")
        assert isinstance(reply, m.ErrorReply)
        assert f"slot at {starts[spoiled[0]]}:" in reply.message, reply.message
        assert served(daemon, PROMPT) is None
        assert staging_files(daemon) == []
        assert status(peer)["staged_bytes"] == 0
    with Client.connect(daemon.socket_path, require=True, block_tokens=0) as client:
        layers, tensors = entry(len(PROMPT), 6, width=SPREAD_WIDTH)
        assert client.put_entry(IDENTITY, PROMPT, layers, tensors).wait(30).state == "stored"
    assert served(daemon, PROMPT) == [t.tobytes() for t in tensors]


def test_a_whole_entry_rewritten_while_its_commit_checks_it_is_never_stored_changed(
    daemon: Daemon, witness: list[np.ndarray]
) -> None:
    """A client that keeps its descriptor and rewrites every slot, first to last, while its
    commit checks them: the commit checks the daemon's copy of the file (a writer was left),
    so it stores the entry as committed or refuses it; what the tier serves is never the
    rewrite."""
    starts = whole_slots(PROMPT, SPREAD_WIDTH)
    with RawPeer(daemon.socket_path) as peer:
        put, fd, tensors = begun_open(peer, PROMPT, seed=7, width=SPREAD_WIDTH)
        try:
            peer.send(m.PutCommit(id=peer.next_id(), put=put))
            for start in starts:
                os.pwrite(fd, b"\xff" * 65536, start)
            reply = peer.receive()
        finally:
            os.close(fd)
        if isinstance(reply, m.PutCommitReply):
            assert wait(peer, reply.ticket).state == "stored"
            assert served(daemon, PROMPT) == [t.tobytes() for t in tensors]
        else:
            assert_refused(reply, "data_checksum")
            assert served(daemon, PROMPT) is None
        assert status(peer)["staged_bytes"] == 0
        assert staging_files(daemon) == []


def test_a_whole_put_of_many_slots_stores_and_restores_exactly(daemon: Daemon) -> None:
    """A whole entry (block_tokens 0) of 32 layers, 64 slots of 1 MiB, its slots checked on
    several threads at its commit: stored, then served byte for byte, also once the daemon
    has started again from its directory."""
    rng = np.random.default_rng(8)
    shape = (1, 2, len(PROMPT), 1024)
    spec = TensorSpec("float16", shape)
    layers = [LayerSpec("kv", (spec, spec), trimmable=True)] * 32
    tensors = [rng.standard_normal(shape).astype(np.float16) for _ in range(64)]
    with Client.connect(daemon.socket_path, require=True, block_tokens=0) as client:
        assert client.put_entry(IDENTITY, PROMPT, layers, tensors).wait(30).state == "stored"
    expected = [t.tobytes() for t in tensors]
    assert served(daemon, PROMPT) == expected
    assert daemon.stop() == 0
    daemon.start()
    assert served(daemon, PROMPT) == expected
