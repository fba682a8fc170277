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

import pytest
from blocks_e2e import (
    assert_counts_equal_the_directory,
    begin,
    commit,
    look_up,
    put_blocks,
    wait,
    write_block,
)
from daemon_e2e import IDENTITY, SETTLE_SECONDS, RawPeer, entry, report
from daemon_process import Daemon, socket_folder
from fault_shim import SOURCE, Faults, built_or_skip
from kvd_client.client import Client
from kvd_protocol import messages as m
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS

from kvd import entry_files

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
    tickets: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    verified_hits: int = 0
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
    """Puts of fresh entries, each followed by lookups of stored ones, every hit verified."""
    outcomes = Outcomes()
    rng = random.Random(9)
    stored: list[tuple[Identity, list[int]]] = []
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
        for asked, prompt in rng.sample(stored, min(3, len(stored))):
            hit = client.lookup(asked, [*prompt, 1])
            if hit is not None:
                with hit:
                    hit.verify()  # every tensor's bytes against its checksum
                outcomes.verified_hits += 1
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
        f"tickets {dict(outcomes.tickets)}, lookups verified {outcomes.verified_hits}, "
        f"lookups failed {outcomes.failed_lookups}"
    )
    assert total >= 50, f"too few faults to prove anything: {injected}"
    failed_calls = {op for (op, _), count in injected.items() if count}
    # The daemon reads its files by pread (and preadv), never read().
    assert failed_calls >= {"open", "pread", "write", "fsync", "rename", "mkdir", "fallocate"}
    assert outcomes.tickets["stored"] > 0
    assert outcomes.tickets["failed"] > 0
    reasons = outcomes.reasons
    assert all(any(word in reason for word in ERRNO_WORDS) for reason in reasons), reasons


V2_ROUNDS = 150
V2_IDENTITIES = 6  # each with its own shared prefix: blocks held, written, collected


def put_and_look_up_v2(socket_path: str, rounds: int) -> Outcomes:
    """Puts of v2 entries, each sharing its identity's two-block prefix and adding a block of
    its own, each followed by lookups whose every block is checked against its manifest and
    every slot against its checksum as it is read."""
    outcomes = Outcomes()
    rng = random.Random(11)
    stored: list[tuple[Identity, list[int]]] = []
    with RawPeer(socket_path) as peer:
        for round_ in range(rounds):
            owner = identity(round_ % V2_IDENTITIES)
            prefix = list(range(round_ % V2_IDENTITIES * 100, round_ % V2_IDENTITIES * 100 + 32))
            tokens = [*prefix, *rng.sample(range(5000, 9000), 21)]
            state = _put_v2_or_fail(peer, owner, tokens)
            outcomes.tickets[state] += 1
            if state == "stored":
                stored.append((owner, tokens))
            for asked, prompt in rng.sample(stored, min(3, len(stored))):
                found = look_up(peer, asked, [*prompt, 1])
                if found is None or found.tensors is None:
                    outcomes.failed_lookups += 1  # a miss, or a block refused: never bad bytes
                else:
                    outcomes.verified_hits += 1
    return outcomes


def _put_v2_or_fail(peer: RawPeer, owner: Identity, tokens: list[int]) -> str:
    """A whole v2 put; its ticket's state, or "refused" when a request of it failed."""
    begun = begin(peer, owner, tokens)
    if isinstance(begun, m.ErrorReply):
        return "refused"
    count = len(begun.manifest.hashes) - begun.held
    if count:
        fds = put_blocks(peer, begun.put, begun.held, count)
        if isinstance(fds, m.ErrorReply):
            peer.call(m.PutAbort(id=peer.next_id(), put=begun.put))
            return "refused"
        for index, fd in enumerate(fds, start=begun.held):
            try:
                write_block(fd, begun.manifest, begun.tensors, index)
            finally:
                os.close(fd)
    ticket = commit(peer, begun.put)
    if isinstance(ticket, m.ErrorReply):
        return "refused"
    return wait(peer, ticket).state


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
    print(f"\nfaults injected: {sum(injected.values())}; {dict(outcomes.tickets)}")
    assert sum(injected.values()) >= 30, injected
    assert outcomes.tickets["stored"] > 0
    assert outcomes.tickets["failed"] + outcomes.tickets["refused"] > 0
    assert outcomes.verified_hits > 0
