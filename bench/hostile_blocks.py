"""The hostile kinds of bench/hostile.py that lie about v2 puts' blocks: garbage rows, a size
cut or declared falsely, block descriptors written into after commit (KINDS, in
bench/hostile_kinds.py, switches them)."""

from __future__ import annotations

import os
import time

from blocks_e2e import (
    BLOCK_TOKENS,
    Begun,
    begin,
    put_blocks,
    write_block,
)
from daemon_e2e import RawPeer
from hostile_liar import HONEST, LIARS, SHARED_PREFIX, Liar
from kvd_protocol import messages as m
from kvd_protocol.identity import Identity


def _v2_begin(
    liar: Liar, peer: RawPeer, owner: Identity, tokens: list[int], block_size: int | None = None
) -> Begun | None:
    begun = begin(peer, owner, tokens, block_size=block_size)
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


def _v2_put(
    liar: Liar, peer: RawPeer, owner: Identity, tokens: list[int], block_size: int | None = None
) -> tuple[Begun, list[int]] | None:
    """A v2 put begun (declaring block_size, if given) and the staging descriptors of the
    blocks it must write; None when either is refused."""
    begun = _v2_begin(liar, peer, owner, tokens, block_size)
    if begun is None:
        return None
    fds = _v2_blocks(liar, peer, begun.put, begun.held, len(begun.manifest.hashes))
    if fds is None:
        return None
    return begun, fds


def _commit_as_honest(
    liar: Liar, peer: RawPeer, put: int, owner: Identity, tokens: list[int]
) -> None:
    """Commit a put made under an honest identity: accepted, its entry is the liars' (told
    apart from the honest ones at the end)."""
    if isinstance(liar.call(peer, m.PutCommit(id=peer.next_id(), put=put)), m.PutCommitReply):
        liar.stored.add_liars(owner, tokens)


def _put_as_honest(
    liar: Liar,
    peer: RawPeer,
    owner: Identity,
    tokens: list[int],
    *,
    garble: bool,
    block_size: int | None = None,
) -> None:
    """A v2 put under an honest identity (declaring block_size, if given): each block it must
    write written whole, then its rows garbled if garble; committed (_commit_as_honest)."""
    started = _v2_put(liar, peer, owner, tokens, block_size)
    if started is None:
        return
    begun, fds = started
    for index, fd in enumerate(fds, start=begun.held):
        try:
            write_block(fd, begun.manifest, begun.tensors, index)
            if garble:
                os.pwrite(fd, os.urandom(64), begun.manifest.block_slots[0].start)
        finally:
            os.close(fd)
    _commit_as_honest(liar, peer, begun.put, owner, tokens)


def garbage_blocks(liar: Liar) -> None:
    """A v2 put of its own whose blocks have valid heads and garbage rows (checksums that
    differ), or are cut to another size, committed."""
    with liar.peer() as peer:
        tokens = [
            liar.rng.randrange(1, 50_000)
            for _ in range(liar.rng.randrange(2, 6) * BLOCK_TOKENS + 3)
        ]
        started = _v2_put(liar, peer, liar.rng.choice(LIARS), tokens)
        if started is None:
            return
        begun, fds = started
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
        _put_as_honest(liar, peer, owner, tokens, garble=True)


def blocks_written_after_commit(liar: Liar) -> None:
    """A v2 put of the shared prefix and a block of its own, whose block descriptors are kept
    and written into after commit, while other puts may be told those blocks are held. Its
    entry, accepted, must restore as written."""
    with liar.peer() as peer:
        owner = liar.rng.choice(HONEST)
        own = BLOCK_TOKENS + 5  # a block no other put holds: always one to write into
        tokens = [*SHARED_PREFIX, *(liar.rng.randrange(1, 50_000) for _ in range(own))]
        started = _v2_put(liar, peer, owner, tokens)
        if started is None:
            return
        begun, fds = started
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
        _put_as_honest(liar, peer, owner, tokens, garble=False, block_size=1)
