"""Disk faults injected at random into a running daemon: open, read, write, fsync, rename,
mkdir and posix_fallocate on the tier's files fail with EIO or ENOSPC (fault_shim.c) while an
engine puts and looks up. The daemon keeps serving, a failed put's ticket says failed with the
reason, nothing invalid is served, and after a restart the accounting equals the directory.

pwrite is in the shim too, but the daemon never calls it: engines write the tensor bytes into
the staging file themselves.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from blocks_e2e import (
    BLOCK_TOKENS,
    Begun,
    assert_counts_equal_the_directory,
    begin,
    kv_tensors,
    look_up,
    put_v2,
    put_v2_settled,
    same,
    status,
    wait,
    write_blocks,
)
from daemon_e2e import IDENTITY, SETTLE_SECONDS, RawPeer, entry, put_stored, read_back, report
from daemon_process import Daemon, socket_folder
from fault_shim import SOURCE, Faults, built_or_skip
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens, unpack_tokens

from kvd.store import entry_files

ROUNDS = 300  # puts, each followed by lookups: some seconds of faults
IDENTITIES = 60  # a folder each, made on its first stored put: mkdir meets faults too
FAULT_PROBABILITY = 0.03  # per call on a tier file: most puts meet a dozen such calls
# Calls made a few times a run (a snapshot's write, a new identity's mkdir) fail more often.
RARER_CALLS = {"write": 0.3, "mkdir": 0.1}
FLAGS = [
    "--max-bytes", str(64 * 81920),  # about 64 entries: eviction runs too
    "--snapshot-interval", "0.2",  # snapshots (write, fsync, rename) all the while
    "--reconcile-interval", "1",
]  # fmt: skip
ERRORS_PROVOKED = ("write_failed", "request_failed", "task_failed", "quarantine_failed")
ERRNO_WORDS = ("Input/output error", "No space left on device", "no_space")


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    return built_or_skip(tmp_path, SOURCE, "FAULT INJECTION")


@dataclass
class Outcomes:
    """What the puts and lookups came to. Every hit is exact (its bytes are its put's), a
    damage the checks caught (reported), or the test fails at once: a wrong byte is never
    counted, it is an assertion."""

    tickets: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    exact_hits: int = 0
    damaged_hits: int = 0
    misses: int = 0
    failed_lookups: int = 0


def identity(number: int) -> Identity:
    return Identity(
        model_id=f"faults/model-{number}",
        config_fingerprint=IDENTITY.config_fingerprint,
        tokenizer_hash=IDENTITY.tokenizer_hash,
        codec_id=IDENTITY.codec_id,
        runtime=IDENTITY.runtime,
    )


def put_and_look_up(client: Client, rounds: int) -> Outcomes:
    """Puts of fresh entries, each followed by lookups of stored ones, every hit read back
    and compared byte for byte with what its put wrote."""
    outcomes = Outcomes()
    rng = random.Random(9)
    stored: list[tuple[Identity, list[int]]] = []
    written: dict[tuple[str, bytes], list[bytes]] = {}  # (model, tokens) -> tensors' bytes
    for round_ in range(rounds):
        owner = identity(round_ % IDENTITIES)
        tokens = rng.sample(range(1, 5000), 40)
        layers, tensors = entry(len(tokens), seed=round_)
        state = client.put_entry(owner, tokens, layers, tensors).wait(SETTLE_SECONDS)
        outcomes.tickets[state.state] += 1
        if state.state == "failed":
            assert state.reason, "a failed put says why"
            outcomes.reasons[state.reason] += 1
        elif state.state == "stored":
            stored.append((owner, tokens))
            written[owner.model_id, pack_tokens(tokens)] = [t.tobytes() for t in tensors]
        for asked, prompt in rng.sample(stored, min(3, len(stored))):
            hit = client.lookup(asked, [*prompt, 1])
            if hit is None:
                outcomes.misses += 1
                continue
            with hit:
                try:
                    data = read_back(hit)
                except EntryFormatError:
                    outcomes.damaged_hits += 1
                    continue
            served = hit.header.identity.model_id, hit.header.tokens
            assert written.get(served) == data, f"a hit served bytes its put never wrote: {served}"
            outcomes.exact_hits += 1
        assert client.ping() >= 0
    outcomes.failed_lookups = client.stats.failed_lookups
    return outcomes


def accounting_equals_the_directory(daemon: Daemon) -> None:
    """Every file kept is a valid entry, and the status counts exactly those."""
    with Client.connect(daemon.socket_path, require=True) as client:
        status = report(client)
    files = sorted((daemon.tier / "entries").glob("*/*.kve"))
    for path in files:
        entry_files.verify_data(path, entry_files.read_header(path, DEFAULT_LIMITS))
    assert (status["entries"], status["bytes"]) == (
        len(files),
        sum(p.stat().st_size for p in files),
    )
    assert os.listdir(daemon.tier / "staging") == []


def test_random_disk_faults_never_stop_the_daemon_nor_serve_a_bad_entry(
    tmp_path: Path, shim: Path
) -> None:
    faults = Faults(tmp_path, shim, tmp_path / "tier")
    with socket_folder() as sockets:
        socket_path = os.path.join(sockets, "kvd.sock")
        daemon = Daemon(tmp_path / "tier", socket_path, tmp_path / "log", FLAGS, ERRORS_PROVOKED)
        daemon.start(env=faults.environment())
        with Client.connect(daemon.socket_path, require=True) as client:
            faults.enable(FAULT_PROBABILITY, RARER_CALLS)
            outcomes = put_and_look_up(client, ROUNDS)
            faults.disable()
            assert client.flush(SETTLE_SECONDS)
        injected, calls = faults.injected(), faults.calls()
        faults.close()
        assert daemon.stop() == 0  # it survived every fault, and stops cleanly
        daemon.start()  # no faults now: the directory as the faults left it
        accounting_equals_the_directory(daemon)
        daemon.stop()
    daemon.check()

    total = sum(injected.values())
    print(f"\nfaults injected and survived: {total} in {sum(calls.values())} calls")
    for (op, errno), count in sorted(injected.items()):
        if count:
            print(f"  {op:<10} {errno:<7} {count}")
    print(
        f"tickets {dict(outcomes.tickets)}, hits exact {outcomes.exact_hits}, damaged "
        f"{outcomes.damaged_hits}, misses {outcomes.misses}, failed {outcomes.failed_lookups}"
    )
    assert total >= 50, f"too few faults to prove anything: {injected}"
    failed_calls = {op for (op, _), count in injected.items() if count}
    # The daemon reads its files by pread (and preadv), never read().
    assert failed_calls >= {"open", "pread", "write", "fsync", "rename", "mkdir", "fallocate"}
    assert outcomes.tickets["stored"] > 0
    assert outcomes.tickets["failed"] > 0
    assert outcomes.exact_hits > 0
    reasons = outcomes.reasons
    assert all(any(word in reason for word in ERRNO_WORDS) for reason in reasons), reasons


V2_ROUNDS = 150
V2_IDENTITIES = 6  # each with its own shared prefix: blocks held, written, collected


def put_and_look_up_v2(socket_path: str, rounds: int) -> Outcomes:
    """Puts of v2 entries, each sharing its identity's two-block prefix and adding a block of
    its own, each followed by lookups whose every block is checked against its manifest and
    every slot against its checksum as it is read, and what it served compared byte for byte
    with what the put of those tokens wrote (kv_tensors: a function of the tokens)."""
    outcomes = Outcomes()
    rng = random.Random(11)
    stored: list[tuple[Identity, list[int]]] = []
    with RawPeer(socket_path) as peer:
        for round_ in range(rounds):
            owner = identity(round_ % V2_IDENTITIES)
            prefix = list(range(round_ % V2_IDENTITIES * 100, round_ % V2_IDENTITIES * 100 + 32))
            tokens = [*prefix, *rng.sample(range(5000, 9000), 21)]
            state, _ = put_v2_settled(peer, owner, tokens)
            outcomes.tickets[state] += 1
            if state == "stored":
                stored.append((owner, tokens))
            for asked, prompt in rng.sample(stored, min(3, len(stored))):
                found = look_up(peer, asked, [*prompt, 1])
                if found is None:
                    outcomes.misses += 1
                elif found.tensors is None:
                    outcomes.damaged_hits += 1  # a block refused or caught: reported, not used
                else:
                    served = unpack_tokens(found.header.tokens)
                    _, expected = kv_tensors(served)
                    exact = all(map(np.array_equal, found.tensors, expected))
                    assert exact, f"a hit served bytes its put never wrote: {served[:4]}..."
                    outcomes.exact_hits += 1
    return outcomes


def test_random_disk_faults_with_shared_blocks_never_serve_a_bad_block(
    tmp_path: Path, shim: Path
) -> None:
    """The same faults under v2 puts that share blocks: after a restart without faults every
    manifest's blocks are there and valid, every block is listed, and the counts are the
    directory's."""
    faults = Faults(tmp_path, shim, tmp_path / "tier")
    with socket_folder() as sockets:
        socket_path = os.path.join(sockets, "kvd.sock")
        daemon = Daemon(tmp_path / "tier", socket_path, tmp_path / "log", FLAGS, ERRORS_PROVOKED)
        daemon.start(env=faults.environment())
        faults.enable(FAULT_PROBABILITY, RARER_CALLS)
        outcomes = put_and_look_up_v2(socket_path, V2_ROUNDS)
        faults.disable()
        injected = faults.injected()
        faults.close()
        assert daemon.stop() == 0
        daemon.start()
        with RawPeer(socket_path) as peer:
            assert_counts_equal_the_directory(peer, daemon.tier)
        for path in (daemon.tier / "entries").glob("*/blocks/*.kvb"):
            entry_files.verify_data(path, entry_files.read_block_header(path, DEFAULT_LIMITS))
        daemon.stop()
    daemon.check()
    print(
        f"\nfaults injected: {sum(injected.values())}; {dict(outcomes.tickets)}; hits exact "
        f"{outcomes.exact_hits}, damaged {outcomes.damaged_hits}, misses {outcomes.misses}"
    )
    assert sum(injected.values()) >= 30, injected
    assert outcomes.tickets["stored"] > 0
    assert outcomes.tickets["failed"] + outcomes.tickets["refused"] > 0
    assert outcomes.exact_hits > 0


def test_a_block_whose_fsync_failed_is_never_synced_again_nor_served(
    tmp_path: Path, shim: Path
) -> None:
    """Two puts share a prefix block, both committed before the writer reaches it; the fsync
    of that block fails once (after EIO the kernel may have dropped its pages and marked them
    clean, so a second fsync would succeed with the data lost). The put whose write met it
    fails, the other manifest listing the block does not become durable on a second fsync
    of the same file, nothing of those bytes is listed or served, and both puts made again
    are written afresh and restore exactly."""
    faults = Faults(tmp_path, shim, tmp_path / "tier")
    flags = ["--snapshot-interval", "3600", "--reconcile-interval", "3600"]  # no other fsync
    prefix = list(range(100, 100 + 2 * BLOCK_TOKENS))
    puts = [[*prefix, *range(start, start + 21)] for start in (500, 600)]
    with socket_folder() as sockets:
        socket_path = os.path.join(sockets, "kvd.sock")
        daemon = Daemon(tmp_path / "tier", socket_path, tmp_path / "log", flags, ["write_failed"])
        daemon.start(env=faults.environment())
        with RawPeer(socket_path) as peer:
            put_v2(peer, IDENTITY, list(range(2000, 2040)))  # folders made: the fsync is a block's
            begun = [begin(peer, IDENTITY, tokens) for tokens in puts]
            ready = [one for one in begun if isinstance(one, Begun)]
            assert len(ready) == 2, begun
            for one in ready:
                assert write_blocks(peer, one) == 3  # neither told the other's blocks are held
            faults.enable(0.0, {"fsync": 1.0}, max_faults=1)
            commits = [m.PutCommit(id=peer.next_id(), put=one.put) for one in ready]
            peer.send(*commits)  # read together: the second commits before the first is written
            replies = {reply.id: reply for reply in (peer.receive() for _ in commits)}
            tickets = [replies[c.id] for c in commits]
            states = [wait(peer, t.ticket) for t in tickets if isinstance(t, m.PutCommitReply)]
            assert len(states) == 2, tickets
            faults.disable()
            assert sum(faults.injected().values()) == 1
            assert faults.durable_after_failure() == {"synced": 0, "placed": 0}
            # The commits' checks run side by side: whichever is written first meets the
            # failed fsync and fails. The other is stored only if its check ended after that:
            # then its own copy of the block joined the store afresh and was synced (never the
            # failed file: durable_after_failure says so), and it restores exactly.
            failed = [i for i, state in enumerate(states) if state.state == "failed"]
            assert failed, states
            assert any(word in (states[failed[0]].reason or "") for word in ERRNO_WORDS), states
            stored = [i for i, state in enumerate(states) if state.state == "stored"]
            assert len(stored) <= 1, states
            for i, tokens in enumerate(puts):
                found = look_up(peer, IDENTITY, [*tokens, 1])
                if i in stored:
                    assert same(found, ready[i])
                else:  # at most the other's prefix
                    assert found is None or found.header.tokens != pack_tokens(tokens)
            assert status(peer)["entries"] == 1 + len(stored)
            assert_counts_equal_the_directory(peer, daemon.tier)
            for i, tokens in enumerate(puts):
                if i not in stored:
                    again = put_v2(peer, IDENTITY, tokens)
                    assert again.held < len(again.manifest.hashes) or stored or i == 1
                    assert same(look_up(peer, IDENTITY, [*tokens, 1]), again)
            assert_counts_equal_the_directory(peer, daemon.tier)
        assert faults.durable_after_failure() == {"synced": 0, "placed": 0}
        faults.close()
        assert daemon.stop() == 0
    daemon.check()


def test_an_entry_whose_folder_sync_failed_is_not_left_in_its_place(
    tmp_path: Path, shim: Path
) -> None:
    """The entry's own fsync passes and it is renamed into place; the sync of its folder then
    fails. Its ticket says failed, so the file is taken back out of its place (left there, the
    next listing would adopt and serve an entry its put was told had failed), and the same
    tokens put again are written afresh and restore exactly."""
    faults = Faults(tmp_path, shim, tmp_path / "tier")
    flags = ["--snapshot-interval", "3600"]
    tokens = list(range(300, 340))
    with socket_folder() as sockets:
        socket_path = os.path.join(sockets, "kvd.sock")
        daemon = Daemon(tmp_path / "tier", socket_path, tmp_path / "log", flags, ["write_failed"])
        daemon.start(env=faults.environment())
        with Client.connect(daemon.socket_path, require=True) as client:
            put_stored(client, IDENTITY, list(range(1, 41)), seed=1)  # its folder made
            files = sorted((daemon.tier / "entries").glob("*/*.kve"))
            assert len(files) == 1
            faults.enable(0.0, {"fsync": 1.0}, skip_faults=1, max_faults=1)  # the 2nd: its folder's
            layers, tensors = entry(len(tokens), seed=2)
            state = client.put_entry(IDENTITY, tokens, layers, tensors).wait(SETTLE_SECONDS)
            faults.disable()
            assert sum(faults.injected().values()) == 1
            assert state.state == "failed", state
            assert sorted((daemon.tier / "entries").glob("*/*.kve")) == files
            assert report(client)["entries"] == 1
            assert client.lookup(IDENTITY, [*tokens, 1]) is None
            again = put_stored(client, IDENTITY, tokens, seed=3)
            hit = client.lookup(IDENTITY, [*tokens, 1])
            assert hit is not None
            with hit:
                assert read_back(hit) == [t.tobytes() for t in again]
        assert faults.durable_after_failure() == {"synced": 0, "placed": 0}
        faults.close()
        assert daemon.stop() == 0
    daemon.check()
