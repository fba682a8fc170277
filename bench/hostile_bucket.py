"""A hostile bucket under one daemon while honest engines use it; seeded, so a failure
reproduces.

A fake S3 bucket on loopback (tests/remote/fake_bucket.py) first takes the honest uploads of a
seeding daemon (prompts of the `remote` identity, whole blocks). Then a second daemon, the one
under test, shares that bucket while the bucket misbehaves: each request is answered by one of
the kinds enabled (BUCKET_KINDS: one switch each) with probability --hostility, else honestly.
Beside it, honest engines on the daemon under test: one puts and looks up entries of its own
(local ones, uploaded through the same bucket), one looks up the seeded prompts (their fetches
go through the hostile bucket; what it restores must equal what was seeded), one pings. Now
and then the fetched entries are evicted, so that fetches keep coming.

At the end, the bucket honest again: the daemon is still up; no ping and no lookup waited past
PING_LIMIT; seeded prompts no one asked for during the run are fetched and restore exactly
(nothing the bucket did kept a fetch slot or a request token), the others restore exactly or
miss (a chain found damaged is remembered); its counts equal the directory, nothing is left in
staging; every local entry restores exactly; SIGTERM ends it with 0 within its shutdown deadline
and a margin; its log holds no error and no traceback. Prints a table: the bucket's answers by
kind, the honest engines' outcomes, the remote's misses by reason, ping and lookup times, the
daemon's RSS and descriptors at start, peak and end, its log's lines.

    .venv/bin/python bench/hostile_bucket.py [--seconds 60] [--seed 1] [--hostility 0.3]
        [--kinds default | all | kind,kind,...]

Exits 1 when a check failed, each problem printed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgpack
import psutil
from _daemon import Daemon, DaemonProcessError, socket_folder
from blocks_e2e import BLOCK_TOKENS, look_up, put_v2, put_v2_settled
from daemon_e2e import RawPeer
from hostile import Samples, accounting_problems, print_samples, shared_restores_exactly
from hostile_kinds import chosen
from hostile_liar import Tally, identity
from kvd_protocol import messages as m
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "remote"))
import fake_bucket as fb

PREFIX: Final = "run"
REMOTE: Final = identity("remote")  # the seeded prompts, fetched through the hostile bucket
LOCAL: Final = identity("local")  # the honest engine's own entries
SEEDED: Final = 8  # prompts the seeding daemon uploads, looked up during the run
UNTOUCHED: Final = 4  # seeded prompts first looked up once the bucket is honest again
SEEDED_BLOCKS: Final = 6  # whole blocks each (and a tail of 3 tokens)
PING_LIMIT: Final = 1.0  # seconds: no answer may take this long, whatever the bucket does
DEADLINE: Final = 0.1  # an engine's lookup deadline: the table counts answers slower
STOP_MARGIN: Final = 5.0  # seconds a stop may take past shutdown_deadline
SHUTDOWN_DEADLINE: Final = 5.0
SAMPLE_SECONDS: Final = 0.1
EVICT_EVERY: Final = 1.5  # seconds between evictions of the fetched entries
SETTLE_SECONDS: Final = 30.0  # for the fetches under way at the end to commit or abort
RECOVERY_SECONDS: Final = 70.0  # the health's longest backoff (60 s) and a fetch
FLAGS: Final = [
    "--remote-min-tokens", str(2 * BLOCK_TOKENS),
    "--remote-fetch-timeout", "2",
    "--remote-request-timeout", "1",
    "--remote-requests", "4",
    "--shutdown-deadline", str(SHUTDOWN_DEADLINE),
]  # fmt: skip


# --- the bucket's misbehaviours -------------------------------------------------------------------


def _flip(data: bytes) -> bytes:
    """The same size, a byte in every KiB changed: only the commit's checksums can tell (one
    byte alone may fall in padding no checksum covers)."""
    if not data:
        return b"x"
    flipped = bytearray(data)
    for offset in range(len(flipped) // 2 % 1024, len(flipped), 1024):
        flipped[offset] ^= 0xFF
    return bytes(flipped)


def _deep_layout() -> bytes:
    nested: Any = 0
    for _ in range(500):
        nested = [nested]
    return bytes(msgpack.packb({"version": 1, "layers": nested}))


def _mangled(transform: Callable[[bytes], bytes], bucket: fb.FakeBucket) -> fb.Answer:
    """The object as stored, transformed (a missing one answered as honestly missing)."""

    def answer(connection: Any, request: fb.Request) -> None:
        data = bucket.objects.get(request.key or "")
        if data is None or request.method != "GET":
            bucket.honest(connection, request)
            return
        fb.body(transform(data))(connection, request)

    return answer


def _cut_short(bucket: fb.FakeBucket) -> fb.Answer:
    def answer(connection: Any, request: fb.Request) -> None:
        data = bucket.objects.get(request.key or "")
        if data is None or request.method != "GET":
            bucket.honest(connection, request)
            return
        fb.body(data[: len(data) // 2], declared=len(data))(connection, request)

    return answer


@dataclass(frozen=True)
class BucketKind:
    """One misbehaviour: the answer it gives (made for the run's bucket), and whether it is on
    by default (off: a kind the daemon is not meant to withstand, said why)."""

    answer: Callable[[fb.FakeBucket], fb.Answer]
    on: bool = True
    why_off: str = ""


BUCKET_KINDS: Final[dict[str, BucketKind]] = {
    "slow_down": BucketKind(lambda _: fb.status(503, "SlowDown")),
    "too_many_requests": BucketKind(lambda _: fb.status(429, "TooManyRequests")),
    "internal_error": BucketKind(lambda _: fb.status(500, "InternalError")),
    "reset": BucketKind(lambda _: fb.reset),
    "hang": BucketKind(fb.hang),
    "trickled_body": BucketKind(lambda b: fb.trickle(b, every=0.05, chunk=64)),
    "trickled_head": BucketKind(lambda b: fb.trickle_head(b, every=0.05)),
    "html_page": BucketKind(lambda _: fb.html()),
    "huge_declared": BucketKind(lambda _: fb.body(b"", declared=1 << 40)),
    "wrong_size": BucketKind(lambda b: _mangled(lambda data: data + b"x", b)),
    "flipped_byte": BucketKind(lambda b: _mangled(_flip, b)),
    "cut_short": BucketKind(_cut_short),
    "garbage": BucketKind(lambda b: _mangled(lambda data: os.urandom(len(data)), b)),
    "deep_object": BucketKind(lambda _: fb.body(_deep_layout())),
    "credentials_refused": BucketKind(
        lambda _: fb.status(403, "SignatureDoesNotMatch"),
        on=False,
        why_off="a refusal takes the remote down for a minute by design: nothing else is tried",
    ),
}


def chosen_kinds(spec: str) -> list[str]:
    on = [name for name, kind in BUCKET_KINDS.items() if kind.on]
    return chosen(spec, list(BUCKET_KINDS), on)


class Hostility:
    """The bucket's one rule: each request answered by a kind drawn at random, or honestly."""

    def __init__(self, bucket: fb.FakeBucket, kinds: list[str], rate: float, seed: int) -> None:
        self._bucket = bucket
        self._answers = {name: BUCKET_KINDS[name].answer(bucket) for name in kinds}
        self._rate = rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.answered: Counter[str] = Counter()

    def answer(self, connection: Any, request: fb.Request) -> None:
        with self._lock:
            hostile = self._rng.random() < self._rate
            name = self._rng.choice(list(self._answers)) if hostile else "honest"
            self.answered[name] += 1
        (self._answers.get(name) or self._bucket.honest)(connection, request)


# --- the honest engines --------------------------------------------------------------------------


@dataclass
class Times:
    """Round trips of the requests an engine waits on, in seconds."""

    pings: list[float] = field(default_factory=list)
    lookups: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, which: list[float], seconds: float) -> None:
        with self.lock:
            which.append(seconds)


@dataclass
class Engines:
    socket_path: str
    seeded: list[list[int]]  # looked up during the run
    untouched: list[list[int]]  # looked up at the end only
    tally: Tally = field(default_factory=Tally)
    times: Times = field(default_factory=Times)
    local: set[bytes] = field(default_factory=set)  # LOCAL's entries stored
    stop: threading.Event = field(default_factory=threading.Event)


def timed_lookup(engines: Engines, peer: RawPeer, owner: Identity, prompt: list[int]) -> str:
    """A lookup (its answer timed) and the restore of what it found: exact, miss, wrong..."""
    began = time.monotonic()
    found = look_up(peer, owner, prompt)
    engines.times.add(engines.times.lookups, time.monotonic() - began)
    if found is None:
        return "miss"
    if found.tensors is None:
        return "refused"
    return shared_restores_exactly(peer, owner, found.header.tokens)


def local_engine(engines: Engines, rng: random.Random) -> None:
    """Puts of its own entries (uploaded through the hostile bucket), each looked up again."""
    with RawPeer(engines.socket_path) as peer:
        while not engines.stop.is_set():
            tokens = [rng.randrange(1, 50_000) for _ in range(rng.randrange(20, 120))]
            state, reason = put_v2_settled(peer, LOCAL, tokens)
            engines.tally.count(engines.tally.honest, f"local put {state}")
            if state != "stored":
                engines.tally.problem(f"an honest local put was not stored: {state} {reason}")
                continue
            engines.local.add(pack_tokens(tokens))
            outcome = timed_lookup(engines, peer, LOCAL, [*tokens, 1])
            engines.tally.count(engines.tally.honest, f"local lookup {outcome}")
            if outcome != "exact":
                engines.tally.problem(f"an honest local entry looked up again: {outcome}")


def remote_engine(engines: Engines, rng: random.Random) -> None:
    """Lookups of the seeded prompts: each starts a fetch through the hostile bucket, or finds
    the entry a fetch committed, which must be exactly what was seeded."""
    with RawPeer(engines.socket_path) as peer:
        while not engines.stop.is_set():
            prompt = rng.choice(engines.seeded)
            outcome = timed_lookup(engines, peer, REMOTE, [*prompt, 1])
            engines.tally.count(engines.tally.honest, f"remote lookup {outcome}")
            if outcome in {"wrong", "refused"}:
                engines.tally.problem(f"a fetched entry restored {outcome}")
            engines.stop.wait(0.05)


def pinger(engines: Engines, rng: random.Random) -> None:
    with RawPeer(engines.socket_path) as peer:
        while not engines.stop.is_set():
            began = time.monotonic()
            reply = peer.call(m.Ping(id=peer.next_id()))
            engines.times.add(engines.times.pings, time.monotonic() - began)
            if not isinstance(reply, m.PingReply):
                engines.tally.problem(f"a ping was answered {reply}")
            engines.stop.wait(0.02)


def evicter(engines: Engines, rng: random.Random) -> None:
    """The fetched entries evicted now and then, so that fetches keep coming."""
    digest = REMOTE.digest()
    with RawPeer(engines.socket_path) as peer:
        while not engines.stop.wait(EVICT_EVERY):
            peer.call(m.Evict(id=peer.next_id(), entry=None, identity=digest, all=False))
            engines.tally.count(engines.tally.honest, "evictions of the fetched")


def _engine(run: Callable[[Engines, random.Random], None], engines: Engines, seed: int) -> None:
    try:
        run(engines, random.Random(seed))
    except Exception as exc:
        engines.tally.problem(f"{run.__name__} failed: {type(exc).__name__}: {exc}")


# --- the run -------------------------------------------------------------------------------


@dataclass
class Result:
    engines: Engines
    hostility: Hostility
    samples: Samples = field(default_factory=Samples)
    remote: dict[str, Any] = field(default_factory=dict)  # the remote status at the end
    final: Counter[str] = field(default_factory=Counter)  # the end's restores
    stop_seconds: float | None = None
    exit_code: int | None = None
    log_lines: int = 0

    @property
    def problems(self) -> list[str]:
        return self.engines.tally.problems


def _credentials(folder: Path) -> Path:
    path = folder / "credentials"
    path.write_text("[default]\naws_access_key_id = AKID\naws_secret_access_key = secret\n")
    path.chmod(0o600)
    return path


def _remote_flags(bucket: fb.FakeBucket, folder: Path) -> list[str]:
    return [
        "--remote", f"s3://{bucket.bucket}/{PREFIX}",
        "--remote-endpoint", bucket.endpoint,
        "--remote-credentials-file", str(_credentials(folder)),
        *FLAGS,
    ]  # fmt: skip


def seed_bucket(bucket: fb.FakeBucket, folder: Path, rng: random.Random) -> list[list[int]]:
    """The seeded prompts, put on a daemon of their own and uploaded to the (honest) bucket."""
    prompts = [
        [rng.randrange(1, 50_000) for _ in range(SEEDED_BLOCKS * BLOCK_TOKENS + 3)]
        for _ in range(SEEDED + UNTOUCHED)
    ]
    with socket_folder() as sockets:
        seeder = Daemon(
            folder / "seeder",
            os.path.join(sockets, "kvd.sock"),
            folder / "seeder.log",
            _remote_flags(bucket, folder),
        )
        seeder.start()
        try:
            with RawPeer(seeder.socket_path) as peer:
                for prompt in prompts:
                    put_v2(peer, REMOTE, prompt)
                reply = peer.call(m.Flush(id=peer.next_id(), timeout=60.0, remote=True))
                if not isinstance(reply, m.FlushReply) or not reply.durable:
                    raise SystemExit(f"the seeding daemon did not upload: {reply}")
        finally:
            seeder.stop()
    return prompts


def run(folder: Path, seconds: float, seed: int, *, rate: float, kinds: list[str]) -> Result:
    """The whole run in folder; problems in the result. Engine n's rng is seeded with
    seed * 1000 + n, the bucket's with seed: the same seed misbehaves the same way."""
    with fb.running_bucket() as bucket:
        prompts = seed_bucket(bucket, folder, random.Random(seed))
        hostility = Hostility(bucket, kinds, rate, seed)
        with socket_folder() as sockets:
            engines = Engines(os.path.join(sockets, "kvd.sock"), prompts[:SEEDED], prompts[SEEDED:])
            result = Result(engines, hostility)
            daemon = Daemon(
                folder / "tier", engines.socket_path, folder / "log", _remote_flags(bucket, folder)
            )
            daemon.start()
            process = psutil.Process(daemon.pid)
            result.samples.take(process)
            bucket.on(fb.every_request, hostility.answer)
            runs = [local_engine, remote_engine, remote_engine, pinger, evicter]
            threads = [
                threading.Thread(target=_engine, args=(r, engines, seed * 1000 + n))
                for n, r in enumerate(runs)
            ]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and daemon.process.poll() is None:  # type: ignore[union-attr]
                result.samples.take(process)
                time.sleep(SAMPLE_SECONDS)
            engines.stop.set()
            for thread in threads:
                thread.join(60)
            bucket.clear()  # honest again: what is under way ends, nothing new goes wrong
            if daemon.process.poll() is None:  # type: ignore[union-attr]
                _check_the_end(daemon, result)
                result.samples.take(process)
                began = time.monotonic()
                try:
                    result.exit_code = daemon.stop()
                except DaemonProcessError:  # it ignored SIGTERM, and was killed
                    result.exit_code = None
                result.stop_seconds = time.monotonic() - began
                _check_the_stop(result)
            else:
                result.exit_code = daemon.process.returncode  # type: ignore[union-attr]
                engines.tally.problem(f"the daemon died during the run (exit {result.exit_code})")
            logs = daemon.logs()
            result.log_lines = len(logs.splitlines())
            if "Traceback" in logs:
                engines.tally.problem("the daemon logged a traceback")
            for line in daemon.unexpected_errors()[:20]:
                engines.tally.problem(f"the daemon logged: {line[:400]}")
    return result


def _check_the_end(daemon: Daemon, result: Result) -> None:
    """The bucket honest again: the untouched prompts fetched exactly, the others exact or
    missed; then counts against the directory (once the fetches those lookups started ended)
    and every local entry restored exactly."""
    engines, tally = result.engines, result.engines.tally
    with RawPeer(engines.socket_path) as peer:
        for prompt in engines.untouched:
            outcome = _fetched_again(engines, peer, prompt)
            result.final[f"untouched, fetched: {outcome}"] += 1
            if outcome != "exact":
                tally.problem(f"a prompt first asked for once the bucket is honest: {outcome}")
        for prompt in engines.seeded:  # a chain found damaged is remembered: a miss is fair
            outcome = timed_lookup(engines, peer, REMOTE, [*prompt, 1])
            result.final[f"seeded, at the end: {outcome}"] += 1
            if outcome in {"wrong", "refused"}:
                tally.problem(f"a seeded prompt at the end: {outcome}")
        reply = peer.call(m.Flush(id=peer.next_id(), timeout=30.0, remote=False))
        if not isinstance(reply, m.FlushReply) or not reply.durable:
            tally.problem(f"the flush did not make everything durable: {reply}")
        for problem in _settled_accounting(peer, daemon):
            tally.problem(problem)
        result.remote = dict(_status(peer).get("remote") or {})
        for tokens in sorted(engines.local):
            outcome = shared_restores_exactly(peer, LOCAL, tokens)
            result.final[f"local: {outcome}"] += 1
            if outcome != "exact":
                tally.problem(f"a local entry at the end: {outcome}")
    slowest = max(engines.times.pings + engines.times.lookups, default=0.0)
    if slowest > PING_LIMIT:
        tally.problem(f"an answer took {slowest:.2f} s (limit {PING_LIMIT:g} s)")


def _settled_accounting(peer: RawPeer, daemon: Daemon) -> list[str]:
    """Where the counts differ from the directory once the fetches the last lookups started
    in the background have ended (each commits, or aborts, within the fetch timeout): asked
    again until none differs, SETTLE_SECONDS at most; the last answer."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        problems = accounting_problems(peer, daemon.tier)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.2)


def _fetched_again(engines: Engines, peer: RawPeer, prompt: list[int]) -> str:
    """The prompt looked up until a fetch brings it in exactly (the bucket is honest
    again: the daemon's health comes back within its backoff, and no fetch slot or request
    token was kept by the misbehaviours); the last outcome within RECOVERY_SECONDS."""
    deadline = time.monotonic() + RECOVERY_SECONDS
    while True:
        outcome = timed_lookup(engines, peer, REMOTE, [*prompt, 1])
        if outcome != "miss" or time.monotonic() > deadline:
            return outcome
        time.sleep(0.2)


def _check_the_stop(result: Result) -> None:
    tally = result.engines.tally
    if result.exit_code is None:
        tally.problem("the daemon ignored SIGTERM (killed)")
    elif result.exit_code != 0:
        tally.problem(f"SIGTERM ended the daemon with {result.exit_code}")
    if result.stop_seconds is not None and result.stop_seconds > SHUTDOWN_DEADLINE + STOP_MARGIN:
        tally.problem(f"the stop took {result.stop_seconds:.1f} s")


def _status(peer: RawPeer) -> dict[str, Any]:
    reply = peer.call(m.Status(id=peer.next_id()))
    assert isinstance(reply, m.StatusReply), reply
    return reply.status


# --- the table -----------------------------------------------------------------------------


def _row(key: str, value: object) -> None:
    print(f"{key:<50}{value!s:>12}")


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered) * 1000:.1f} / {p99 * 1000:.1f} / {ordered[-1] * 1000:.1f}"


def print_table(result: Result, seconds: float, seed: int, rate: float, kinds: list[str]) -> None:
    engines, samples, remote = result.engines, result.samples, result.remote
    print(
        f"hostile bucket: {seconds:g} s, seed {seed}, hostility {rate:g}, kinds: {', '.join(kinds)}"
    )
    sections: dict[str, list[tuple[str, object]]] = {
        "bucket answers": sorted(result.hostility.answered.items()),
        "honest engines": sorted(engines.tally.honest.items()),
        "at the end": sorted(result.final.items()),
        "remote misses, by reason": sorted((remote.get("misses_by_reason") or {}).items()),
        "remote": [
            (key, remote[key])
            for key in ("state", "hits", "downloaded_blocks", "uploaded_blocks", "upload_drops")
            if key in remote
        ],
    }
    for title, rows in sections.items():
        print()
        _row(title, "count")
        for key, value in rows:
            _row(key, value)
    times = engines.times
    print()
    _row("answers, ms", "p50 / p99 / max")
    _row(f"pings ({len(times.pings)})", _ms(times.pings))
    _row(f"lookups ({len(times.lookups)})", _ms(times.lookups))
    slow = sum(t > DEADLINE for t in times.pings + times.lookups)
    _row(f"answers past an engine's {DEADLINE:g} s deadline", slow)
    print_samples(samples)
    stop = "-" if result.stop_seconds is None else f"{result.stop_seconds:.2f} s"
    print(f"\nlog lines: {result.log_lines}; SIGTERM: exit {result.exit_code} in {stop}")
    for problem in result.problems:
        print(f"PROBLEM: {problem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hostility", type=float, default=0.3, help="share of requests")
    parser.add_argument(
        "--kinds", default="default", help="default, all, or names: " + ", ".join(BUCKET_KINDS)
    )
    args = parser.parse_args()
    kinds = chosen_kinds(args.kinds)
    with tempfile.TemporaryDirectory(prefix="kvd-hostile-bucket-") as folder:
        result = run(Path(folder), args.seconds, args.seed, rate=args.hostility, kinds=kinds)
        print_table(result, args.seconds, args.seed, args.hostility, kinds)
    sys.exit(1 if result.problems else 0)


if __name__ == "__main__":
    main()
