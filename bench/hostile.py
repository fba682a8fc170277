"""Hostile clients against one daemon while honest ones put and get; seeded, so a failure
reproduces.

N raw clients send well-formed but lying requests, each drawn from the kinds enabled (KINDS:
one switch each, so that a kind whose fix is not in yet is left off and turned on once it
is); M honest clients (the real kvd_client.Client for whole entries, and v2 puts of shared
blocks made by hand as an engine makes them) put and look up real entries, every hit compared
byte for byte with what its put wrote. At the end: the daemon is still up, its counts equal
the directory (entries against the manifests, unique bytes against the files' sizes), every
honest entry still listed restores exactly, and so does every entry a liar put under an
honest identity and had accepted (its lie refused or moot), these two being all that is
listed under the honest identities; SIGTERM ends it with 0, and its log holds no error it was
not expected to write. Prints a table: requests by kind, errors by code, honest puts stored
and restored, the liars' accepted under honest identities, the daemon's RSS and descriptors
at start, peak and end.

    .venv/bin/python bench/hostile.py [--seconds 60] [--seed 1] [--hostile 6] [--honest 2]
        [--kinds default | all | kind,kind,...]

Exits 1 when a check failed, each problem printed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
from _daemon import Daemon, socket_folder
from blocks_e2e import (  # the end-to-end tests' raw clients
    kv_tensors,
    look_up,
    put_v2_settled,
    read_manifest,
    status,
)
from daemon_e2e import RawPeer, entry, read_back
from hostile_kinds import KINDS, chosen_kinds
from hostile_liar import (
    FRAME_TIMEOUT,
    HONEST,
    MAX_OPEN_PUTS,
    SHARED_PREFIX,
    Liar,
    Shared,
    Stored,
)
from kvd_client.client import Client
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

SAMPLE_SECONDS = 0.1
SETTLE_SECONDS = 30.0
PUT_TIMEOUT = 2.0  # abandoned puts expire within the run
FLAGS = [
    "--max-bytes", "32M",  # eviction runs
    "--writeback-max-bytes", "8M",
    "--put-timeout", str(PUT_TIMEOUT),
    "--frame-timeout", str(FRAME_TIMEOUT),
    "--max-open-puts", str(MAX_OPEN_PUTS),
]  # fmt: skip
# Error-level events a hostile run provokes by design: a lying put's file fails its write.
EXPECTED_ERRORS = ("write_failed",)


# --- honest clients -----------------------------------------------------------------------------


def restores_exactly(client: Client, owner: Identity, tokens: bytes, stored: Stored) -> str:
    """Look a whole honest entry up and read it back: "exact" (it, byte for byte what its
    put wrote), "other" (another honest entry served, exact: this one is gone), "miss",
    "refused" (a damage the checks caught) or "wrong" (bytes no put of them wrote)."""
    hit = client.lookup(owner, [*np.frombuffer(tokens, "<u4").tolist(), 1])
    if hit is None:
        return "miss"
    with hit:
        try:
            data = read_back(hit)
        except EntryFormatError:
            return "refused"
        served = hit.header.identity.model_id, hit.header.tokens
        with stored.lock:
            stored.ids.add(hit.summary.id)
            expected = stored.whole.get(served)
    if expected != data:
        return "wrong"
    return "exact" if hit.header.tokens == tokens else "other"


def shared_restores_exactly(peer: RawPeer, owner: Identity, tokens: bytes) -> str:
    """As restores_exactly, for a v2 entry (its tensors are kv_tensors of its tokens)."""
    found = look_up(peer, owner, [*np.frombuffer(tokens, "<u4").tolist(), 1])
    if found is None:
        return "miss"
    if found.tensors is None:
        return "refused"
    served = np.frombuffer(found.header.tokens, "<u4").tolist()
    if not all(map(np.array_equal, found.tensors, kv_tensors(served)[1])):
        return "wrong"
    return "exact" if found.header.tokens == tokens else "other"


def put_outcome(state: str, reason: str | None) -> str:
    """A put's state, and for one not stored what its reason starts with (an error's code)."""
    if state == "stored" or not reason:
        return state
    return f"{state} ({reason.split(':')[0]})"


def honest_whole(shared: Shared, rng: random.Random) -> None:
    """The real client: whole entries put, then some of its stored ones looked up and read."""
    tally, stored = shared.tally, shared.stored
    mine: list[tuple[Identity, bytes]] = []
    with Client.connect(shared.socket_path, require=True, timeout=SETTLE_SECONDS) as client:
        while not shared.stop.is_set():
            owner = rng.choice(HONEST)
            tokens = [rng.randrange(1, 50_000) for _ in range(rng.randrange(16, 400))]
            layers, tensors = entry(len(tokens), rng.randrange(1 << 30))
            state = client.put_entry(owner, tokens, layers, tensors).wait(SETTLE_SECONDS)
            tally.count(tally.honest, f"whole put {put_outcome(state.state, state.reason)}")
            if state.state == "stored":
                stored.add_whole(owner, tokens, [t.tobytes() for t in tensors])
                mine.append((owner, pack_tokens(tokens)))
                # The newest entry is the last the policy evicts: gone at once, its "stored"
                # was a lie (written, then evicted for want of room).
                if restores_exactly(client, owner, pack_tokens(tokens), stored) == "miss":
                    tally.problem("an honest put was answered stored and is gone at once")
            for asked, prompt in rng.sample(mine, min(2, len(mine))):
                outcome = restores_exactly(client, asked, prompt, stored)
                tally.count(tally.honest, f"whole lookup {outcome}")
                if outcome == "wrong":
                    tally.problem(f"an honest whole entry restored wrong: {asked.model_id}")


def honest_shared(shared: Shared, rng: random.Random) -> None:
    """v2 puts that share a prefix of three blocks, made as an engine makes them, then looked
    up and read block by block."""
    tally = shared.tally
    mine: list[tuple[Identity, bytes]] = []
    with RawPeer(shared.socket_path) as peer:
        while not shared.stop.is_set():
            owner = rng.choice(HONEST)
            tail = [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 40))]
            tokens = [*SHARED_PREFIX, *tail]
            state, reason = put_v2_settled(peer, owner, tokens)
            tally.count(tally.honest, f"shared put {put_outcome(state, reason)}")
            if state != "stored" and "block" in (reason or ""):  # its own blocks are sound
                tally.problem(f"an honest put paid for another's block: {state}, {reason}")
            if state == "stored":
                shared.stored.add_shared(owner, tokens)
                mine.append((owner, pack_tokens(tokens)))
            for asked, prompt in rng.sample(mine, min(2, len(mine))):
                outcome = shared_restores_exactly(peer, asked, prompt)
                tally.count(tally.honest, f"shared lookup {outcome}")
                if outcome == "wrong":
                    tally.problem(f"an honest v2 entry restored wrong: {asked.model_id}")


# --- the run --------------------------------------------------------------------------------


@dataclass
class Samples:
    """The daemon's RSS and open descriptors, sampled all the run."""

    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def take(self, process: psutil.Process) -> None:
        self.rss.append(process.memory_info().rss)
        self.fds.append(process.num_fds())


def _hostile(liar: Liar, kinds: list[str], stop: threading.Event) -> None:
    while not stop.is_set():
        kind = liar.rng.choice(kinds)
        liar.tally.count(liar.tally.requests, kind)
        try:
            KINDS[kind].action(liar)
        except (TimeoutError, OSError, EOFError):
            liar.tally.count(liar.tally.errors, "connection closed")
        except Exception as exc:  # the protocol refused what the daemon sent back, say
            liar.tally.problem(f"{kind}: {type(exc).__name__}: {exc}")


def _honest(client: Callable[[Shared, random.Random], None], shared: Shared, seed: int) -> None:
    try:
        client(shared, random.Random(seed))
    except Exception as exc:
        shared.tally.problem(f"{client.__name__} failed: {type(exc).__name__}: {exc}")


@dataclass
class Result:
    shared: Shared
    samples: Samples = field(default_factory=Samples)
    exit_code: int | None = None
    final: Counter[str] = field(default_factory=Counter)  # the end's restores, by outcome
    liars: Counter[str] = field(default_factory=Counter)  # those of Stored.liars

    @property
    def problems(self) -> list[str]:
        return self.shared.tally.problems


def run(
    folder: Path, seconds: float, seed: int, *, hostile: int, honest: int, kinds: list[str]
) -> Result:
    """The whole run against a daemon of its own in folder; problems in the result. Client
    n's rng is seeded with seed * 1000 + n: the same seed tells the same lies."""
    with socket_folder() as sockets:
        shared = Shared(os.path.join(sockets, "kvd.sock"))
        result = Result(shared)
        daemon = Daemon(folder / "tier", shared.socket_path, folder / "log", FLAGS, EXPECTED_ERRORS)
        daemon.start()
        process = psutil.Process(daemon.pid)
        result.samples.take(process)
        honest_clients = [honest_whole, honest_shared] * honest
        threads = [
            threading.Thread(target=_honest, args=(client, shared, seed * 1000 + n))
            for n, client in enumerate(honest_clients)
        ]
        threads += [
            threading.Thread(
                target=_hostile,
                args=(Liar(shared, random.Random(seed * 1000 + 500 + n)), kinds, shared.stop),
            )
            for n in range(hostile)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and _alive(daemon):
            result.samples.take(process)
            time.sleep(SAMPLE_SECONDS)
        shared.stop.set()
        for thread in threads:
            thread.join(SETTLE_SECONDS * 2)
        if _alive(daemon):
            _check_the_end(daemon, result)
            result.samples.take(process)
            result.exit_code = daemon.stop()
            if result.exit_code != 0:
                shared.tally.problem(f"SIGTERM ended the daemon with {result.exit_code}")
        else:
            result.exit_code = daemon.process.returncode if daemon.process else None
            shared.tally.problem(f"the daemon died during the run (exit {result.exit_code})")
        for line in daemon.unexpected_errors()[:20]:
            shared.tally.problem(f"the daemon logged: {line[:400]}")
    return result


def _alive(daemon: Daemon) -> bool:
    return daemon.process is not None and daemon.process.poll() is None


def _check_the_end(daemon: Daemon, result: Result) -> None:
    """Everything accepted made durable; counts against the directory; every honest entry
    still listed restores exactly, and so does every liars' entry under an honest identity
    (Stored.liars); as many are listed under the honest identities as restore."""
    shared, tally = result.shared, result.shared.tally
    time.sleep(PUT_TIMEOUT + 1)  # every hostile connection is closed: its puts end by then
    with shared.stored.lock:
        whole, blocked = list(shared.stored.whole), sorted(shared.stored.shared)
        liars = sorted(shared.stored.liars)
    with (
        Client.connect(shared.socket_path, require=True, timeout=SETTLE_SECONDS) as client,
        RawPeer(shared.socket_path) as peer,
    ):
        if not client.flush(SETTLE_SECONDS):
            tally.problem("flush did not make everything durable")
        for model, tokens in whole + blocked:
            owner = next(i for i in HONEST if i.model_id == model)
            if (model, tokens) in shared.stored.whole:
                outcome = restores_exactly(client, owner, tokens, shared.stored)
            else:
                outcome = shared_restores_exactly(peer, owner, tokens)
            result.final[outcome] += 1
            if outcome in {"wrong", "refused"}:
                tally.problem(f"an honest entry of {model} is listed, and {outcome} at the end")
        for model, tokens in liars:
            owner = next(i for i in HONEST if i.model_id == model)
            outcome = shared_restores_exactly(peer, owner, tokens)
            result.liars[outcome] += 1
            if outcome in {"wrong", "refused"}:
                tally.problem(f"a liar's entry under {model} is listed, and {outcome} at the end")
        for problem in accounting_problems(peer, daemon.tier):
            tally.problem(problem)
        listed = sum(len(client.list_entries(owner)) for owner in HONEST)
        exact, theirs = result.final["exact"], result.liars["exact"]
        if listed != exact + theirs:
            tally.problem(
                f"{listed} entries listed under the honest identities, {exact} honest ones"
                f" and {theirs} of the liars' restore exact"
            )


def accounting_problems(peer: RawPeer, tier: Path) -> list[str]:
    """Where the daemon's counts differ from the directory: entries against the manifests,
    blocks and unique bytes against the files' sizes, a block no manifest lists or a
    manifest's block missing, and (every put having ended) bytes or files still staged."""
    now = status(peer)
    # By path: two identities may hold blocks of the same name (the same tokens).
    blocks = {p: p.stat().st_size for p in (tier / "entries").glob("*/blocks/*")}
    manifests = {p: p.stat().st_size for p in (tier / "entries").glob("*/*.kve")}
    listed: set[Path] = set()
    problems = []
    for path in manifests:
        try:
            folder = path.parent / "blocks"
            listed |= {folder / f"{h.hex()}.kvb" for h in read_manifest(path).block_hashes}
        except EntryFormatError as exc:
            problems.append(f"an invalid file stored as an entry: {exc}")
    found = {
        "entries": len(manifests),
        "blocks": {"count": len(blocks), "bytes": sum(blocks.values())},
        "unique_bytes": sum(blocks.values()) + sum(manifests.values()),
        "staged_bytes": 0,
    }
    problems += [
        f"status says {key} {now.get(key)}, the directory {value}"
        for key, value in found.items()
        if now.get(key) != value
    ]
    if set(blocks) - listed:
        problems.append(f"{len(set(blocks) - listed)} block files no manifest lists")
    if listed - set(blocks):
        problems.append(f"{len(listed - set(blocks))} blocks listed by manifests are missing")
    staging = os.listdir(tier / "staging")
    if staging:
        problems.append(f"{len(staging)} files left in staging/ with no put under way")
    return problems


# --- the table --------------------------------------------------------------------------------


def _row(key: str, count: int | str) -> None:
    print(f"{key:<50}{count:>8}")


def print_table(result: Result, seconds: float, seed: int, kinds: list[str]) -> None:
    tally, samples = result.shared.tally, result.samples
    print(f"hostile run: {seconds:g} s, seed {seed}, kinds on: {', '.join(kinds)}")
    sections = {
        "hostile action": sorted(tally.requests.items()),
        "error replies, by code": sorted(tally.errors.items()),
        "honest": sorted(tally.honest.items())
        + [(f"at the end: {key}", count) for key, count in sorted(result.final.items())],
    }
    if accepted := len(result.shared.stored.liars):
        sections["liars, under honest identities"] = [("puts accepted", accepted)] + [
            (f"at the end: {key}", count) for key, count in sorted(result.liars.items())
        ]
    for title, rows in sections.items():
        print()
        _row(title, "count")
        for key, count in rows:
            _row(key, count)
    print_samples(samples)
    print(f"\nexit code on SIGTERM: {result.exit_code}")
    for problem in result.problems:
        print(f"PROBLEM: {problem}")


def print_samples(samples: Samples) -> None:
    """The daemon's RSS and descriptors at start, peak and end of a run."""
    if not samples.rss:
        return
    mib = 1 << 20
    print(f"\n{'daemon':<12}{'start':>10}{'peak':>10}{'end':>10}")
    rss = [samples.rss[0] / mib, max(samples.rss) / mib, samples.rss[-1] / mib]
    print(f"{'RSS MiB':<12}" + "".join(f"{value:>10.1f}" for value in rss))
    print(f"{'open fds':<12}{samples.fds[0]:>10}{max(samples.fds):>10}{samples.fds[-1]:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hostile", type=int, default=6, help="hostile clients")
    parser.add_argument("--honest", type=int, default=1, help="honest pairs (whole, v2)")
    parser.add_argument(
        "--kinds", default="default", help="default, all, or names: " + ", ".join(KINDS)
    )
    args = parser.parse_args()
    kinds = chosen_kinds(args.kinds)
    with tempfile.TemporaryDirectory(prefix="kvd-hostile-") as folder:
        result = run(
            Path(folder),
            args.seconds,
            args.seed,
            hostile=args.hostile,
            honest=args.honest,
            kinds=kinds,
        )
        print_table(result, args.seconds, args.seed, kinds)
    sys.exit(1 if result.problems else 0)


if __name__ == "__main__":
    main()
