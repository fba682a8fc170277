"""What every hostile client of bench/hostile.py shares, and its means: the run's limits and
identities, the tally of requests, errors and problems, the honest entries stored, and the
Liar each kind is handed (its connection, calls and v1 puts, and its rng)."""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from blocks_e2e import BLOCK_TOKENS
from daemon_e2e import RawPeer, entry
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import messages as m
from kvd_protocol.entry import EntryPlan, plan_entry
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

REPLY_SECONDS = 10.0  # a hostile client's wait for any one reply
# The daemon's limits in a run (hostile.py passes them as flags), which some kinds test.
FRAME_TIMEOUT = 2.0
MAX_OPEN_PUTS = 4


def identity(name: str) -> Identity:
    return Identity(f"hostile/{name}", "cfg", "tok", "codecs/1", "mlx/cpu")


HONEST = [identity(f"honest-{i}") for i in range(2)]
LIARS = [identity(f"liar-{i}") for i in range(2)]
SHARED_PREFIX = list(range(7000, 7000 + 3 * BLOCK_TOKENS))  # honest v2 puts share its blocks


# --- what the run shares ------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts of the whole run, and the problems found (a problem fails the run)."""

    requests: Counter[str] = field(default_factory=Counter)  # hostile actions, by kind
    errors: Counter[str] = field(default_factory=Counter)  # error replies, by code
    honest: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, counter: Counter[str], key: str) -> None:
        with self.lock:
            counter[key] += 1

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


@dataclass
class Stored:
    """The honest entries stored: hostile clients aim at them, the end restores them. And the
    liars' puts under an honest identity whose commit was accepted: legitimate in substance
    (a lie moot where the blocks were held, or told after the commit sealed what they wrote),
    stored beside the honest ones, so the end looks them up apart."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    whole: dict[tuple[str, bytes], list[bytes]] = field(default_factory=dict)  # its tensors
    shared: set[tuple[str, bytes]] = field(default_factory=set)  # v2: kv_tensors(tokens)
    ids: set[str] = field(default_factory=set)  # entry ids lookups told
    liars: set[tuple[str, bytes]] = field(default_factory=set)  # v2: kv_tensors(tokens)

    def add_whole(self, owner: Identity, tokens: list[int], data: list[bytes]) -> None:
        with self.lock:
            self.whole[owner.model_id, pack_tokens(tokens)] = data

    def add_shared(self, owner: Identity, tokens: list[int]) -> None:
        with self.lock:
            self.shared.add((owner.model_id, pack_tokens(tokens)))

    def add_liars(self, owner: Identity, tokens: list[int]) -> None:
        with self.lock:
            self.liars.add((owner.model_id, pack_tokens(tokens)))

    def pick(self, rng: random.Random) -> tuple[Identity, bytes] | None:
        with self.lock:
            pool = [*self.whole, *self.shared]
        if not pool:
            return None
        model, tokens = rng.choice(pool)
        return next(i for i in HONEST if i.model_id == model), tokens


@dataclass
class Shared:
    """What every client of a run shares: the daemon's socket, the tally, the honest entries
    stored, and the signal to stop."""

    socket_path: str
    tally: Tally = field(default_factory=Tally)
    stored: Stored = field(default_factory=Stored)
    stop: threading.Event = field(default_factory=threading.Event)


class Liar:
    """One hostile client's means: the run's shared state and its own rng."""

    def __init__(self, shared: Shared, rng: random.Random) -> None:
        self.socket_path, self.tally, self.stored = shared.socket_path, shared.tally, shared.stored
        self.rng = rng
        self.tensors: list[np.ndarray] = []  # those of the last entry begin() planned

    def peer(self) -> RawPeer:
        peer = RawPeer(self.socket_path)
        peer.sock.settimeout(REPLY_SECONDS)
        return peer

    def call(self, peer: RawPeer, request: m.Request) -> m.Reply:
        reply = peer.call(request)
        if isinstance(reply, m.ErrorReply):
            self.tally.count(self.tally.errors, reply.code.value)
        return reply

    def begin(self, peer: RawPeer, **lies: float) -> tuple[int, int, EntryPlan] | None:
        """put_begin of a v1 entry of its own; (put, staging fd, plan) or None when refused.
        lies: size (declared, by default the plan's), prefill_cost, created (its header's);
        and width, its bytes per token over 16 (an honest knob: large entries)."""
        tokens = [self.rng.randrange(1, 50_000) for _ in range(self.rng.randrange(2, 300))]
        width = int(lies.pop("width", 8))  # bytes per token: 16 * width
        layers, self.tensors = entry(len(tokens), self.rng.randrange(1 << 30), width=width)
        created = lies.pop("created", time.time())
        try:
            plan = plan_entry(
                self.rng.choice(LIARS), pack_tokens(tokens), layers, created=created, min_reuse=0
            )
        except ValueError:
            self.tally.count(self.tally.errors, "refused by plan_entry")
            return None
        size = int(lies.pop("size", plan.file_size))
        request = m.PutBegin(
            id=peer.next_id(),
            identity=plan.header.identity,
            tokens=plan.header.tokens,
            size=size,
            **lies,  # type: ignore[arg-type]
        )
        reply = self.call(peer, request)
        if not isinstance(reply, m.PutBeginReply) or reply.fd is None:
            return None
        return reply.put, reply.fd, plan

    def put(
        self,
        peer: RawPeer,
        before: Callable[[int, EntryPlan], None] | None = None,
        after: Callable[[int, EntryPlan], None] | None = None,
        store_ms: float | None = None,
        **lies: float,
    ) -> None:
        """A v1 put of its own, with the lies of begin(): the entry written, before(fd, plan)
        done, committed (saying store_ms), after(fd, plan) done; its descriptor closed last."""
        begun = self.begin(peer, **lies)
        if begun is None:
            return
        put, fd, plan = begun
        try:
            write_entry(fd, plan, tensor_views(plan, self.tensors))
            if before is not None:
                before(fd, plan)
            self.call(peer, m.PutCommit(id=peer.next_id(), put=put, store_ms=store_ms))
            if after is not None:
                after(fd, plan)
        finally:
            os.close(fd)

    def float_lie(self) -> float:
        return self.rng.choice([math.nan, math.inf, -math.inf, 1e308, -1.0, 5e-324, 0.0])
