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
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from daemon_e2e import entry, plan_for
from hostile_blocks import (
    block_size_lie,
    blocks_written_after_commit,
    garbage_blocks,
    garbage_shared_blocks,
)
from hostile_liar import FRAME_TIMEOUT, LIARS, MAX_OPEN_PUTS, Liar
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import messages as m
from kvd_protocol.entry import EntryPlan
from kvd_protocol.tokens import pack_tokens

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


def chosen(spec: str, known: list[str], default: list[str]) -> list[str]:
    """The kinds a --kinds value names: "default", "all", or names separated by commas."""
    if spec == "default":
        return default
    if spec == "all":
        return known
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; known: {', '.join(known)}")
    return names


def chosen_kinds(spec: str) -> list[str]:
    return chosen(spec, list(KINDS), [name for name, kind in KINDS.items() if kind.default])
