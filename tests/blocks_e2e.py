"""Entries of format v2 (a manifest and its shared blocks) put and read by hand over the raw
protocol, as an engine does: plan_manifest, put_begin naming the hashes, put_blocks for the
blocks not held, each block and the manifest written and checksummed; a lookup, open_blocks,
each block checked against the manifest and read back."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from daemon_e2e import SETTLE_SECONDS, RawPeer, wait_until
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import messages as m
from kvd_protocol.checksum import checksum
from kvd_protocol.entry import PREFIX_BYTES, EntryHeader, LayerSpec, ManifestPlan, TensorSpec
from kvd_protocol.entry import plan_manifest as plan
from kvd_protocol.entry_reader import (
    check_block,
    parse_block_header,
    parse_header,
    parse_prefix,
    verify_slot,
)
from kvd_protocol.errors import EntryFormatError
from kvd_protocol.identity import Identity
from kvd_protocol.tokens import pack_tokens

BLOCK_TOKENS = 16  # the smallest block: tiny entries still have several
WIDTH = 8


def kv_tensors(
    tokens: Sequence[int], width: int = WIDTH
) -> tuple[list[LayerSpec], list[np.ndarray]]:
    """Two blocked KV layers whose every row depends only on its position and token: entries
    that share a prefix share its blocks' bytes, as a model's KV does. width: the values per
    head and token (4 bytes a block's token per unit)."""
    count = len(tokens)
    position = np.arange(count, dtype=np.float32)[:, None]
    token = np.asarray(tokens, dtype=np.float32)[:, None]
    lane = np.arange(width, dtype=np.float32)[None, :]
    tensors = []
    for k in range(4):
        rows = ((token * 7 + position * 3 + lane + k * 11) % 97).astype(np.float16)
        tensors.append(np.ascontiguousarray(np.broadcast_to(rows, (1, 2, count, width))))
    spec = TensorSpec("float16", (1, 2, count, width))
    return [LayerSpec("kv", (spec, spec), trimmable=True, blocked=True)] * 2, tensors


def manifest_plan(identity: Identity, tokens: Sequence[int], width: int = WIDTH) -> ManifestPlan:
    layers, _ = kv_tensors(tokens, width)
    return plan(
        identity,
        pack_tokens(tokens),
        layers,
        block_tokens=BLOCK_TOKENS,
        created=time.time(),
        min_reuse=0,
    )


def write_block(fd: int, manifest: ManifestPlan, tensors: Sequence[np.ndarray], index: int) -> None:
    """Block index of the entry into fd: each cut tensor's rows of the block, then its head."""
    rows = slice(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS)
    sums = []
    for slot, t in zip(manifest.block_slots, manifest.blocked_tensors, strict=True):
        data = np.ascontiguousarray(tensors[t][:, :, rows]).tobytes()
        os.pwrite(fd, data, slot.start)
        sums.append(checksum(data))
    os.pwrite(fd, manifest.block_head(index, sums), 0)


def write_manifest(fd: int, manifest: ManifestPlan, tensors: Sequence[np.ndarray]) -> None:
    """The manifest into fd: the tails of the cut tensors (the others whole), then its head."""
    tail = slice(len(manifest.hashes) * BLOCK_TOKENS, None)
    cut = set(manifest.blocked_tensors)
    parts = [np.ascontiguousarray(t[:, :, tail]) if i in cut else t for i, t in enumerate(tensors)]
    write_entry(fd, manifest.entry, tensor_views(manifest.entry, parts))


@dataclass
class Begun:
    """A v2 put begun: its id, how many blocks the daemon said it holds, its plan and data."""

    put: int
    held: int
    manifest: ManifestPlan
    tensors: list[np.ndarray]


def begin(
    peer: RawPeer,
    identity: Identity,
    tokens: Sequence[int],
    *,
    width: int = WIDTH,
    block_size: int | None = None,
) -> Begun | m.ErrorReply:
    """put_begin naming the blocks, and the manifest written into its staging file.
    block_size: the size declared for each block file, if not its true one."""
    manifest = manifest_plan(identity, tokens, width)
    _, tensors = kv_tensors(tokens, width)
    reply = peer.call(
        m.PutBegin(
            id=peer.next_id(),
            identity=identity,
            tokens=pack_tokens(tokens),
            size=manifest.entry.file_size,
            blocks=b"".join(manifest.hashes),
            block_tokens=BLOCK_TOKENS,
            block_size=manifest.block_size if block_size is None else block_size,
        )
    )
    if isinstance(reply, m.ErrorReply):
        return reply
    assert isinstance(reply, m.PutBeginReply), reply
    assert reply.fd is not None, reply
    try:
        write_manifest(reply.fd, manifest, tensors)
    finally:
        os.close(reply.fd)
    return Begun(reply.put, reply.held, manifest, tensors)


def put_blocks(peer: RawPeer, put: int, first: int, count: int) -> list[int] | m.ErrorReply:
    reply = peer.call(m.PutBlocks(id=peer.next_id(), put=put, first=first, count=count))
    if isinstance(reply, m.ErrorReply):
        return reply
    assert isinstance(reply, m.PutBlocksReply), reply
    return list(reply.fds)


def write_blocks(peer: RawPeer, begun: Begun, first: int | None = None) -> int:
    """Ask for and write blocks first (default: held) to the last; how many were written."""
    start = begun.held if first is None else first
    total = len(begun.manifest.hashes)
    for batch in range(start, total, m.MAX_BLOCK_BATCH):
        count = min(m.MAX_BLOCK_BATCH, total - batch)
        fds = put_blocks(peer, begun.put, batch, count)
        assert not isinstance(fds, m.ErrorReply), fds
        for index, fd in enumerate(fds, start=batch):
            try:
                write_block(fd, begun.manifest, begun.tensors, index)
            finally:
                os.close(fd)
    return max(0, total - start)


def commit(peer: RawPeer, put: int) -> int | m.ErrorReply:
    reply = peer.call(m.PutCommit(id=peer.next_id(), put=put))
    if isinstance(reply, m.ErrorReply):
        return reply
    assert isinstance(reply, m.PutCommitReply), reply
    return reply.ticket


def wait(peer: RawPeer, ticket: int) -> m.TicketReply:
    reply = peer.call(m.WaitTicket(id=peer.next_id(), ticket=ticket, timeout=SETTLE_SECONDS))
    assert isinstance(reply, m.TicketReply), reply
    return reply


def put_v2_settled(
    peer: RawPeer, identity: Identity, tokens: Sequence[int]
) -> tuple[str, str | None]:
    """A whole v2 put made as an engine makes it, for a test that lets it fail: its ticket's
    state and reason once settled, or "refused" and the error code when a request of it was
    refused (the put aborted)."""
    begun = begin(peer, identity, tokens)
    if isinstance(begun, m.ErrorReply):
        return "refused", begun.code.value
    count = len(begun.manifest.hashes) - begun.held
    if count:
        fds = put_blocks(peer, begun.put, begun.held, count)
        if isinstance(fds, m.ErrorReply):
            peer.call(m.PutAbort(id=peer.next_id(), put=begun.put))
            return "refused", fds.code.value
        for index, fd in enumerate(fds, start=begun.held):
            try:
                write_block(fd, begun.manifest, begun.tensors, index)
            finally:
                os.close(fd)
    ticket = commit(peer, begun.put)
    if isinstance(ticket, m.ErrorReply):
        return "refused", ticket.code.value
    reply = wait(peer, ticket)
    return reply.state, reply.reason


def put_v2(peer: RawPeer, identity: Identity, tokens: Sequence[int], width: int = WIDTH) -> Begun:
    """A whole v2 put, waited for until stored; what it began with."""
    begun = begin(peer, identity, tokens, width=width)
    assert isinstance(begun, Begun), begun
    write_blocks(peer, begun)
    ticket = commit(peer, begun.put)
    assert isinstance(ticket, int), ticket
    state = wait(peer, ticket)
    assert state.state == "stored", state
    return begun


@dataclass
class Found:
    """A lookup's lease and what it served: the manifest's header and the whole tensors."""

    lease: int
    header: EntryHeader
    tensors: list[np.ndarray] | None  # None when a block could not be had or checked
    problem: str | None = None


def look_up(
    peer: RawPeer, identity: Identity, prompt: Sequence[int], *, release: bool = True
) -> Found | None:
    """A lookup, then every block of what it found opened, checked and read back into whole
    tensors; None on a miss. With release, the lease ends (damaged, when a block failed)."""
    reply = peer.call(m.Lookup(id=peer.next_id(), identity=identity, tokens=pack_tokens(prompt)))
    assert isinstance(reply, m.LookupReply), reply
    if reply.lease is None:
        return None
    assert reply.fd is not None
    try:
        header = read_header(reply.fd)
        found = Found(reply.lease, header, None)
        try:
            found.tensors = read_tensors(peer, reply.lease, reply.fd, header)
        except (EntryFormatError, AssertionError) as exc:
            found.problem = str(exc)
    finally:
        os.close(reply.fd)
    if release:
        end_lease(peer, found.lease, found.problem)
    return found


def end_lease(peer: RawPeer, lease: int, damaged: str | None = None) -> None:
    reply = peer.call(m.Release(id=peer.next_id(), lease=lease, damaged=damaged))
    assert isinstance(reply, m.ReleaseReply), reply


def read_header(fd: int) -> EntryHeader:
    size = os.fstat(fd).st_size
    prefix = parse_prefix("entry", os.pread(fd, PREFIX_BYTES, 0))
    return parse_header("entry", prefix, os.pread(fd, prefix.header_length, PREFIX_BYTES), size)


def read_tensors(peer: RawPeer, lease: int, fd: int, header: EntryHeader) -> list[np.ndarray]:
    """The entry's tensors whole: its blocks' rows in order, then the manifest's tail; every
    block checked against the manifest, every slot against its checksum. ValueError (an
    EntryFormatError) for a block that is not right, AssertionError for one not had."""
    parts: list[list[bytes]] = [[] for _ in header.slots]
    count = len(header.block_hashes)
    for first in range(0, count, m.MAX_BLOCK_BATCH):
        reply = peer.call(
            m.OpenBlocks(
                id=peer.next_id(),
                lease=lease,
                first=first,
                count=min(m.MAX_BLOCK_BATCH, count - first),
            )
        )
        assert isinstance(reply, m.OpenBlocksReply), reply
        for index, block_fd in enumerate(reply.fds, start=first):
            try:
                for slot_index, data in enumerate(read_block(block_fd, header, index)):
                    parts[slot_index].append(data)
            finally:
                os.close(block_fd)
    tensors = []
    for slot, pieces in zip(header.slots, parts, strict=True):
        tail = os.pread(fd, slot.nbytes, slot.start)
        verify_slot("entry", slot, tail)
        pieces.append(tail)
        rows = [np.frombuffer(p, dtype=np.float16) for p in pieces]
        width = slot.shape[:2]
        blocks = [r.reshape(*width, -1, slot.shape[3]) for r in rows]
        tensors.append(np.concatenate(blocks, axis=2))
    return tensors


def read_block(fd: int, manifest: EntryHeader, index: int) -> list[bytes]:
    """Block index's slots' bytes, the block checked against the manifest."""
    name = f"block {index}"
    size = os.fstat(fd).st_size
    prefix = parse_prefix(name, os.pread(fd, PREFIX_BYTES, 0))
    block = parse_block_header(name, prefix, os.pread(fd, prefix.header_length, PREFIX_BYTES), size)
    check_block(manifest, index, block, name)
    data = []
    for slot in block.slots:
        piece = os.pread(fd, slot.nbytes, slot.start)
        verify_slot(name, slot, piece)
        data.append(piece)
    return data


def same(found: Found | None, begun: Begun) -> bool:
    """Whether a lookup served exactly the tensors a put wrote."""
    if found is None or found.tensors is None:
        return False
    return all(np.array_equal(a, b) for a, b in zip(found.tensors, begun.tensors, strict=True))


def block_files(tier: Path) -> dict[str, int]:
    """Every block file under the tier's entries: name -> size."""
    return {p.name: p.stat().st_size for p in (tier / "entries").glob("*/blocks/*")}


def manifest_files(tier: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (tier / "entries").glob("*/*.kve")}


def status(peer: RawPeer) -> dict[str, Any]:
    reply = peer.call(m.Status(id=peer.next_id()))
    assert isinstance(reply, m.StatusReply), reply
    return dict(reply.status)


def deleter_idle(peer: RawPeer) -> None:
    """Wait until the files the daemon let go of have left (its deleter moves them out of
    their place on a thread of its own)."""
    wait_until(lambda: status(peer)["deleting_files"] == 0, "the deleter is idle")


def assert_counts_equal_the_directory(peer: RawPeer, tier: Path) -> None:
    """Blocks, bytes and entries as the daemon counts them, against the files on disk; and
    no block file that no manifest lists; once the files the daemon let go of have left."""
    deleter_idle(peer)
    now = status(peer)
    blocks, manifests = block_files(tier), manifest_files(tier)
    assert now["blocks"] == {"count": len(blocks), "bytes": sum(blocks.values())}
    assert now["entries"] == len(manifests)
    assert now["unique_bytes"] == sum(blocks.values()) + sum(manifests.values())
    listed = set()
    for path in (tier / "entries").glob("*/*.kve"):
        header = read_manifest(path)
        listed |= {h.hex() + ".kvb" for h in header.block_hashes}
        assert all(h.hex() + ".kvb" in blocks for h in header.block_hashes), (
            "a manifest lacks a block"
        )
    assert set(blocks) == listed, "a block file no manifest lists"


def read_manifest(path: Path) -> EntryHeader:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd)
    finally:
        os.close(fd)
