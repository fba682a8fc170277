"""The hostile clients of bench/hostile.py: each kind of lie a client can tell the daemon, one
function a kind, each on a connection of its own. KINDS switches them: a kind is off by
default when it is a lie the daemon is not meant to withstand (it trusts a client's word on
identities), or a known break whose fix is not in yet (turned on once it is).

A lie is well-formed on the wire (the protocol's own checks are not what is tried here):
sizes, counts, floats and files that say what is not so, descriptors kept and used after
they should be, connections closed at the worst moment, requests others would not send.
"""

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
from blocks_e2e import (
    BLOCK_TOKENS,
    Begun,
    begin,
    kv_tensors,
    manifest_plan,
    put_blocks,
    write_block,
    write_manifest,
)
from daemon_e2e import RawPeer, entry, plan_for
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


# --- the hostile kinds: each one lie, told on a connection of its own ------------------------


def lying_size(liar: Liar) -> None:
    """put_begin declares a size other than the entry's, from 1 byte to 2**62; what fits is
    written (write_entry itself refuses a file of the wrong size) and committed."""
    size = liar.rng.choice([1, 17, 16384, 1 << 20, 1 << 40, 1 << 62])
    with liar.peer() as peer:
        begun = liar.begin(peer, size=size)
        if begun is not None:
            os.pwrite(begun[1], os.urandom(4096), 0)
            os.close(begun[1])
            liar.call(peer, m.PutCommit(id=peer.next_id(), put=begun[0]))


def lying_header(liar: Liar) -> None:
    """The file holds another entry (other tokens of the same count) than put_begin named."""

    def other(fd: int, plan: EntryPlan) -> None:
        tokens = [t + 1 for t in np.frombuffer(plan.header.tokens, "<u4").tolist()]
        layers, tensors = entry(len(tokens), 1)
        lie = plan_for(plan.header.identity, tokens, layers)
        write_entry(fd, lie, tensor_views(lie, tensors))

    with liar.peer() as peer:
        liar.put(peer, before=other)


def truncated_before_commit(liar: Liar) -> None:
    """The staging file cut short (or grown) before commit."""
    sizes = [0, 100, 0.5, 2.0]  # bytes, or a share of the entry's size
    choice = liar.rng.choice(sizes)

    def cut(fd: int, plan: EntryPlan) -> None:
        os.ftruncate(fd, int(choice * plan.file_size) if isinstance(choice, float) else choice)

    with liar.peer() as peer:
        liar.put(peer, before=cut)


def written_after_commit(liar: Liar) -> None:
    """The staging descriptor kept and written into after commit (its own entry's bytes)."""

    def scribble(fd: int, plan: EntryPlan) -> None:
        for _ in range(20):
            os.pwrite(fd, os.urandom(512), liar.rng.randrange(plan.file_size))
            time.sleep(0.005)

    with liar.peer() as peer:
        liar.put(peer, after=scribble)


def truncated_after_commit(liar: Liar) -> None:
    """The staging file of a large entry truncated just after commit, while the writer may
    be reading it."""

    def cut(fd: int, plan: EntryPlan) -> None:
        time.sleep(liar.rng.random() * 0.02)
        os.ftruncate(fd, plan.file_size // 4)

    with liar.peer() as peer:
        liar.put(peer, after=cut, width=4096)


def grown_staging(liar: Liar) -> None:
    """A MiB written 16 MiB past the size declared, before commit: disk the cap never saw
    (until the commit refuses the file)."""

    def grow(fd: int, plan: EntryPlan) -> None:
        os.pwrite(fd, bytes(1 << 20), plan.file_size + (16 << 20))

    with liar.peer() as peer:
        liar.put(peer, before=grow)


def wire_floats(liar: Liar) -> None:
    """Non-finite, negative and huge floats where the wire takes a float: prefill cost, store
    time, ticket and flush timeouts. Out of the protocol's bounds, each is a bad_message and
    the connection goes on."""
    with liar.peer() as peer:
        liar.put(peer, prefill_cost=liar.float_lie(), store_ms=liar.float_lie())
        ticket = liar.rng.randrange(1, 1000)
        for request in (
            m.WaitTicket(id=peer.next_id(), ticket=ticket, timeout=liar.float_lie()),
            m.Flush(id=peer.next_id(), timeout=min(liar.float_lie(), 0.5)),
        ):
            try:
                liar.call(peer, request)
            except ValueError:
                liar.tally.count(liar.tally.errors, "refused by the client's own checks")
        try:
            answered = isinstance(peer.call(m.Ping(id=peer.next_id())), m.PingReply)
        except (EOFError, OSError):
            answered = False
        if not answered:
            liar.tally.problem("a connection sent floats out of bounds was not served after")


def header_floats(liar: Liar) -> None:
    """An entry whose header's creation time is far past, far future or not a number."""
    with liar.peer() as peer:
        liar.put(peer, created=liar.rng.choice([0.0, -1.0, 1e18, 1e300, math.nan, math.inf]))


def closed_mid_put(liar: Liar) -> None:
    """The connection closed with a put half written."""
    peer = liar.peer()
    begun = liar.begin(peer)
    if begun is not None:
        os.pwrite(begun[1], os.urandom(4096), 0)
        os.close(begun[1])
    peer.close()


def closed_mid_frame(liar: Liar) -> None:
    """Half a frame, then the connection closed."""
    peer = liar.peer()
    frame = peer.conn.send(m.Status(id=peer.next_id()))
    peer.sock.sendall(frame[: liar.rng.randrange(1, len(frame))])
    peer.close()


def unread_descriptors(liar: Liar) -> None:
    """Lookups of honest entries and put_begins sent, their descriptors never read."""
    peer = liar.peer()
    requests: list[m.Request] = []
    for _ in range(liar.rng.randrange(1, 30)):
        aim = liar.stored.pick(liar.rng)
        if aim is not None:
            requests.append(
                m.Lookup(id=peer.next_id(), identity=aim[0], tokens=aim[1] + pack_tokens([1]))
            )
    try:
        peer.send(*requests)
        time.sleep(liar.rng.random() * 0.2)
    finally:
        peer.close()


def false_damage(liar: Liar) -> None:
    """An honest entry leased, then released as damaged, which it is not."""
    aim = liar.stored.pick(liar.rng)
    if aim is None:
        return
    with liar.peer() as peer:
        reply = liar.call(
            peer, m.Lookup(id=peer.next_id(), identity=aim[0], tokens=aim[1] + pack_tokens([1]))
        )
        if isinstance(reply, m.LookupReply) and reply.lease is not None:
            if reply.fd is not None:
                os.close(reply.fd)
            liar.call(
                peer,
                m.Release(id=peer.next_id(), lease=reply.lease, damaged="checksum differs (a lie)"),
            )


def verify_flood(liar: Liar) -> None:
    """Verify asked of honest entries, many at once, with and without repair."""
    with liar.stored.lock:
        ids = sorted(liar.stored.ids)
    if not ids:
        return
    with liar.peer() as peer:
        requests = [
            m.Verify(id=peer.next_id(), entry=liar.rng.choice(ids), repair=liar.rng.random() < 0.5)
            for _ in range(32)
        ]
        peer.send(*requests)
        for _ in requests:
            reply = peer.receive()
            if isinstance(reply, m.ErrorReply):
                liar.tally.count(liar.tally.errors, reply.code.value)
            elif isinstance(reply, m.VerifyReply) and reply.quarantined:
                liar.tally.problem(f"verify quarantined an honest entry: {reply.problem}")
            elif isinstance(reply, m.VerifyReply) and reply.problem:
                # An entry evicted while it is checked reads as unreadable (ENOENT): no harm
                # to it, the answer is only misleading. Counted, to be seen.
                liar.tally.count(liar.tally.errors, f"verify: {reply.problem.split(':')[0]}")


def wrong_ids(liar: Liar) -> None:
    """Tickets, leases and puts that are not the client's (or not at all); a commit twice;
    an abort after commit; blocks asked of a v1 put and of a lease out of range."""
    with liar.peer() as peer:
        rng = liar.rng
        strangers: tuple[m.Request, ...] = (
            m.WaitTicket(id=peer.next_id(), ticket=rng.randrange(1, 10_000), timeout=0.0),
            m.Release(id=peer.next_id(), lease=rng.randrange(1, 10_000)),
            m.PutAbort(id=peer.next_id(), put=rng.randrange(1, 10_000)),
            m.PutCommit(id=peer.next_id(), put=rng.randrange(1, 10_000)),
            m.OpenBlocks(id=peer.next_id(), lease=rng.randrange(1, 10_000), first=0, count=64),
        )
        for request in strangers:
            liar.call(peer, request)
        begun = liar.begin(peer)
        if begun is not None:
            put, fd, plan = begun
            try:
                write_entry(fd, plan, tensor_views(plan, liar.tensors))
            finally:
                os.close(fd)
            misuses: tuple[m.Request, ...] = (
                m.PutBlocks(id=peer.next_id(), put=put, first=0, count=64),
                m.PutCommit(id=peer.next_id(), put=put),
                m.PutCommit(id=peer.next_id(), put=put),
                m.PutAbort(id=peer.next_id(), put=put),
            )
            for misuse in misuses:
                liar.call(peer, misuse)
        aim = liar.stored.pick(rng)
        if aim is not None:
            reply = liar.call(
                peer, m.Lookup(id=peer.next_id(), identity=aim[0], tokens=aim[1] + pack_tokens([1]))
            )
            if isinstance(reply, m.LookupReply) and reply.lease is not None:
                if reply.fd is not None:
                    os.close(reply.fd)
                opened = liar.call(
                    peer,
                    m.OpenBlocks(
                        id=peer.next_id(), lease=reply.lease, first=rng.randrange(0, 70), count=64
                    ),
                )
                for fd in getattr(opened, "fds", ()):
                    os.close(fd)
                liar.call(peer, m.Release(id=peer.next_id(), lease=reply.lease))
                liar.call(peer, m.Release(id=peer.next_id(), lease=reply.lease))


def abandoned_puts(liar: Liar) -> None:
    """Puts begun up to the connection's limit and never committed; the connection stays
    open past the put timeout."""
    with liar.peer() as peer:
        for _ in range(liar.rng.randrange(1, 10)):
            begun = liar.begin(peer)
            if begun is not None:
                os.close(begun[1])
        time.sleep(liar.rng.random() * 3)
        liar.call(peer, m.Ping(id=peer.next_id()))


def _v2_begin(liar: Liar, peer: RawPeer, owner: Identity, tokens: list[int]) -> Begun | None:
    begun = begin(peer, owner, tokens)
    if isinstance(begun, m.ErrorReply):
        liar.tally.count(liar.tally.errors, begun.code.value)
        return None
    return begun


def _v2_blocks(liar: Liar, peer: RawPeer, put: int, first: int, total: int) -> list[int] | None:
    """The staging descriptors of blocks first to total (none asked when none is left), or
    None when refused."""
    if first == total:
        return []
    fds = put_blocks(peer, put, first, total - first)
    if isinstance(fds, m.ErrorReply):
        liar.tally.count(liar.tally.errors, fds.code.value)
        return None
    return fds


def _commit_as_honest(
    liar: Liar, peer: RawPeer, put: int, owner: Identity, tokens: list[int]
) -> None:
    """Commit a put made under an honest identity: accepted, its entry is the liars' (told
    apart from the honest ones at the end)."""
    if isinstance(liar.call(peer, m.PutCommit(id=peer.next_id(), put=put)), m.PutCommitReply):
        liar.stored.add_liars(owner, tokens)


def garbage_blocks(liar: Liar) -> None:
    """A v2 put of its own whose blocks have valid heads and garbage rows (checksums that
    differ), or are cut to another size, committed."""
    with liar.peer() as peer:
        tokens = [
            liar.rng.randrange(1, 50_000)
            for _ in range(liar.rng.randrange(2, 6) * BLOCK_TOKENS + 3)
        ]
        begun = _v2_begin(liar, peer, liar.rng.choice(LIARS), tokens)
        if begun is None:
            return
        fds = _v2_blocks(liar, peer, begun.put, begun.held, len(begun.manifest.hashes))
        if fds is None:
            return
        cut = liar.rng.random() < 0.5
        for index, fd in enumerate(fds, start=begun.held):
            try:
                write_block(fd, begun.manifest, begun.tensors, index)
                if cut:
                    os.ftruncate(fd, liar.rng.choice([0, 100, begun.manifest.block_size * 2]))
                else:
                    os.pwrite(fd, os.urandom(64), begun.manifest.block_slots[0].start)
            finally:
                os.close(fd)
        liar.call(peer, m.PutCommit(id=peer.next_id(), put=begun.put))


def garbage_shared_blocks(liar: Liar) -> None:
    """The honest clients' shared prefix put first, under their identity, with garbage rows:
    an honest put told its blocks are held must not pay for it. Once they are held, the put
    has no block to lie in: accepted, its entry is honest in substance."""
    with liar.peer() as peer:
        owner = liar.rng.choice(HONEST)
        tokens = [*SHARED_PREFIX, *(liar.rng.randrange(1, 50_000) for _ in range(5))]
        begun = _v2_begin(liar, peer, owner, tokens)
        if begun is None:
            return
        fds = _v2_blocks(liar, peer, begun.put, begun.held, len(begun.manifest.hashes))
        if fds is None:
            return
        for index, fd in enumerate(fds, start=begun.held):
            try:
                write_block(fd, begun.manifest, begun.tensors, index)
                os.pwrite(fd, os.urandom(64), begun.manifest.block_slots[0].start)
            finally:
                os.close(fd)
        _commit_as_honest(liar, peer, begun.put, owner, tokens)


def blocks_written_after_commit(liar: Liar) -> None:
    """A v2 put of the shared prefix and a block of its own, whose block descriptors are kept
    and written into after commit, while other puts may be told those blocks are held. Its
    entry, accepted, must restore as written."""
    with liar.peer() as peer:
        owner = liar.rng.choice(HONEST)
        own = BLOCK_TOKENS + 5  # a block no other put holds: always one to write into
        tokens = [*SHARED_PREFIX, *(liar.rng.randrange(1, 50_000) for _ in range(own))]
        begun = _v2_begin(liar, peer, owner, tokens)
        if begun is None:
            return
        fds = _v2_blocks(liar, peer, begun.put, begun.held, len(begun.manifest.hashes))
        if fds is None:
            return
        try:
            for index, fd in enumerate(fds, start=begun.held):
                write_block(fd, begun.manifest, begun.tensors, index)
            _commit_as_honest(liar, peer, begun.put, owner, tokens)
            time.sleep(0.05)
            for fd in fds:
                os.pwrite(fd, os.urandom(64), begun.manifest.block_slots[0].start)
        finally:
            for fd in fds:
                os.close(fd)


def block_size_lie(liar: Liar) -> None:
    """A v2 put of the honest clients' shared prefix declaring block_size 1 for blocks it
    writes whole: an honest put told they are held must not pay for it. (The daemon refuses
    it at put_begin when it holds them, at commit when it does not.)"""
    with liar.peer() as peer:
        tokens = [*SHARED_PREFIX, *(liar.rng.randrange(1, 50_000) for _ in range(5))]
        owner = liar.rng.choice(HONEST)
        manifest = manifest_plan(owner, tokens)
        _, tensors = kv_tensors(tokens)
        reply = liar.call(
            peer,
            m.PutBegin(
                id=peer.next_id(),
                identity=owner,
                tokens=pack_tokens(tokens),
                size=manifest.entry.file_size,
                blocks=b"".join(manifest.hashes),
                block_tokens=BLOCK_TOKENS,
                block_size=1,
            ),
        )
        if not isinstance(reply, m.PutBeginReply) or reply.fd is None:
            return
        try:
            write_manifest(reply.fd, manifest, tensors)
        finally:
            os.close(reply.fd)
        fds = _v2_blocks(liar, peer, reply.put, reply.held, len(manifest.hashes))
        if fds is None:
            return
        for index, fd in enumerate(fds, start=reply.held):
            try:
                write_block(fd, manifest, tensors, index)
            finally:
                os.close(fd)
        _commit_as_honest(liar, peer, reply.put, owner, tokens)


def pipelined_begins(liar: Liar) -> None:
    """Ten times max_open_puts put_begins, sent in one write: no more than max_open_puts
    may be granted."""
    with liar.peer() as peer:
        requests = [
            m.PutBegin(id=peer.next_id(), identity=LIARS[0], tokens=pack_tokens([n, 1]), size=4096)
            for n in liar.rng.sample(range(1, 50_000), 10 * MAX_OPEN_PUTS)
        ]
        peer.send(*requests)
        granted = 0
        for _ in requests:
            reply = peer.receive()
            if isinstance(reply, m.ErrorReply):
                liar.tally.count(liar.tally.errors, reply.code.value)
            elif isinstance(reply, m.PutBeginReply) and reply.fd is not None:
                granted += 1
                os.close(reply.fd)
        if granted > MAX_OPEN_PUTS:
            liar.tally.problem(
                f"{granted} puts begun at once on one connection, of {MAX_OPEN_PUTS}"
            )


def trickled_frame(liar: Liar) -> None:
    """A frame sent a byte at a time, each byte just inside the frame timeout: the daemon
    must close the connection once the frame has taken longer than the timeout in all."""
    peer = liar.peer()
    try:
        frame = peer.conn.send(m.Lookup(id=peer.next_id(), identity=LIARS[0], tokens=bytes(4096)))
        started = time.monotonic()
        for byte in frame[: int(3 * FRAME_TIMEOUT / (FRAME_TIMEOUT * 0.75)) + 1]:
            peer.sock.sendall(bytes([byte]))
            time.sleep(FRAME_TIMEOUT * 0.75)
        peer.sock.settimeout(0.5)
        try:
            closed = peer.sock.recv(1 << 16) == b""  # an error frame comes first, then the end
        except TimeoutError:
            closed = False
        if not closed:
            held = time.monotonic() - started
            liar.tally.problem(
                f"a frame trickled for {held:.1f} s, past frame_timeout {FRAME_TIMEOUT} s"
            )
    except OSError:
        pass  # closed by the daemon: as it should
    finally:
        peer.close()


def hoarded_leases(liar: Liar) -> None:
    """Leases of honest entries taken, as many as a connection may, and held for seconds."""
    with liar.peer() as peer:
        for _ in range(256):
            aim = liar.stored.pick(liar.rng)
            if aim is None:
                return
            lookup = m.Lookup(id=peer.next_id(), identity=aim[0], tokens=aim[1] + pack_tokens([1]))
            reply = liar.call(peer, lookup)
            if isinstance(reply, m.LookupReply) and reply.fd is not None:
                os.close(reply.fd)
        time.sleep(3)


def poisoned_prefix(liar: Liar) -> None:
    """An entry put under an honest identity, extending an honest entry's tokens by one,
    with well-checksummed bytes of its own: it supersedes the honest entry and is what its
    engine's next lookup restores. Identities are the client's word, not checked."""
    aim = liar.stored.pick(liar.rng)
    if aim is None:
        return
    owner, tokens = aim
    prompt = [*np.frombuffer(tokens, "<u4").tolist(), 1]
    layers, tensors = entry(len(prompt), liar.rng.randrange(1 << 30))
    plan = plan_for(owner, prompt, layers)
    with liar.peer() as peer:
        request = m.PutBegin(
            id=peer.next_id(), identity=owner, tokens=plan.header.tokens, size=plan.file_size
        )
        reply = liar.call(peer, request)
        if isinstance(reply, m.PutBeginReply) and reply.fd is not None:
            try:
                write_entry(reply.fd, plan, tensor_views(plan, tensors))
            finally:
                os.close(reply.fd)
            liar.call(peer, m.PutCommit(id=peer.next_id(), put=reply.put))


@dataclass(frozen=True)
class Kind:
    action: Callable[[Liar], None]
    default: bool  # off: a trust limit, or a known break whose fix is not in yet


KINDS: dict[str, Kind] = {
    "lying_size": Kind(lying_size, True),
    "lying_header": Kind(lying_header, True),
    "truncated_before_commit": Kind(truncated_before_commit, True),
    "grown_staging": Kind(grown_staging, True),
    "wire_floats": Kind(wire_floats, True),
    "header_floats": Kind(header_floats, True),
    "closed_mid_put": Kind(closed_mid_put, True),
    "closed_mid_frame": Kind(closed_mid_frame, True),
    "unread_descriptors": Kind(unread_descriptors, True),
    "false_damage": Kind(false_damage, True),
    "verify_flood": Kind(verify_flood, True),
    "wrong_ids": Kind(wrong_ids, True),
    "abandoned_puts": Kind(abandoned_puts, True),
    "garbage_blocks": Kind(garbage_blocks, True),
    "truncated_after_commit": Kind(truncated_after_commit, True),
    "written_after_commit": Kind(written_after_commit, True),
    "garbage_shared_blocks": Kind(garbage_shared_blocks, True),
    "blocks_written_after_commit": Kind(blocks_written_after_commit, True),
    "block_size_lie": Kind(block_size_lie, True),
    "pipelined_begins": Kind(pipelined_begins, True),
    "trickled_frame": Kind(trickled_frame, True),
    "hoarded_leases": Kind(hoarded_leases, True),
    # Not a bug of the daemon's but of the trust it is given: any client may put under any
    # identity, so one can supersede and replace another engine's entries (a threat-model
    # fact, off so the run checks the rest).
    "poisoned_prefix": Kind(poisoned_prefix, False),
}


def chosen_kinds(spec: str) -> list[str]:
    if spec == "default":
        return [name for name, kind in KINDS.items() if kind.default]
    if spec == "all":
        return list(KINDS)
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in KINDS]
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    return names
