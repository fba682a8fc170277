"""Shared blocks: the token-cut KV of entries (format v2), each stored once per identity.

A block is named by its chained hash within its identity (equal hash: equal tokens and equal
history, interchangeable KV), so manifests that share a prefix share its blocks. The store
holds, per identity (by digest), hash -> Block, and two counts on each:

- refs: the manifests that list it (pending, stored or doomed: a manifest keeps its blocks'
  refs until its own file goes). A lease pins its manifest, so readers need no pins of their
  own: a leased manifest's blocks are never collected.
- pins: the puts in progress that were told the block is held (from put_begin to their
  commit, abort or expiry). A put's own new blocks are not in the store before its commit:
  until then they are staging files of that put alone, never handed to another put as held
  (an aborted put would have left that put a block never written).

Policies:
- a block with no ref and no pin is collected at once: its file unlinked, its bytes uncounted.
  Nothing else removes a block but forget() (gone or quarantined behind the store's back,
  whose manifests the caller drops).
- A block joins pending (its file in staging) when the first manifest listing it commits, or
  durable (its file under blocks/) from a start-up scan; the writer makes a pending one
  durable with placed(). Both kinds are held: a put may name a block still in the queue, and
  the writer persists whichever blocks of a manifest are not durable yet.
- Bytes: every block the store holds counts once (the tier's unique bytes), and once more in
  its identity's share.

Synchronous, owned by the event loop; the only file work here is handing what is collected
to the deleter (deleter.py: moved out of its place now, unlinked off the loop).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvd_protocol.errors import Rule

from kvd.store.deleter import Deleter

# A block's descriptor is handed out at most this many times to one put or lease: a put's
# staging files (put_blocks), a lease's blocks (open_blocks: once to read, once more after a
# failure). What a client that asks and never reads its replies can make the daemon open is
# bounded.
HANDOUTS_PER_BLOCK: Final = 2


@dataclass(slots=True, eq=False)
class Block:
    """One block file of one identity. path: where its file is now (staging while pending).
    mtime_ns: its file's mtime as the snapshot recorded it, while start-up has not listed the
    directory to check that (a block taken from the snapshot); None otherwise."""

    hash: bytes
    digest: str
    size: int
    path: Path
    refs: int = 0
    pins: int = 0
    durable: bool = False
    mtime_ns: int | None = None


class BlockStore:
    """Every block the tier holds, per identity, with its refs, pins and bytes."""

    def __init__(self, deleter: Deleter) -> None:
        self._deleter = deleter  # removes collected block files off the event loop
        self._blocks: dict[str, dict[bytes, Block]] = {}  # identity digest -> hash -> block
        self._identity_bytes: dict[str, int] = {}
        self.bytes = 0  # every block held: the tier's unique block bytes
        self.collected = 0  # blocks collected since start (refs and pins gone)

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())

    def get(self, digest: str, block_hash: bytes) -> Block | None:
        blocks = self._blocks.get(digest)
        return None if blocks is None else blocks.get(block_hash)

    def of_identity(self, digest: str) -> Iterator[Block]:
        return iter(list(self._blocks.get(digest, {}).values()))

    def __iter__(self) -> Iterator[Block]:
        for blocks in list(self._blocks.values()):
            yield from list(blocks.values())

    def identity_bytes(self, digest: str) -> int:
        return self._identity_bytes.get(digest, 0)

    def count_held(self, digest: str, hashes: Sequence[bytes]) -> int:
        """How many of hashes, from the first on, the store holds (pending or durable)."""
        blocks = self._blocks.get(digest, {})
        for count, block_hash in enumerate(hashes):
            if block_hash not in blocks:
                return count
        return len(hashes)

    def lacks(self, digest: str, hashes: Sequence[bytes], size: int) -> str | None:
        """What keeps a manifest listing hashes, each a file of size bytes, from being served:
        a block the store does not hold, or one of another size; None when nothing does."""
        known = self._blocks.get(digest, {})  # one lookup per hash: start-up's hot path
        for index, block_hash in enumerate(hashes):
            block = known.get(block_hash)
            if block is None:
                missing = Rule.BLOCK_MISSING.value
                return f"{missing}: block {index} ({block_hash.hex()}) is not there"
            if block.size != size:
                return (
                    f"{Rule.BLOCK_MISMATCH.value}: block {index} ({block_hash.hex()}) is "
                    f"{block.size} bytes, not {size}"
                )
        return None

    # --- puts in progress ------------------------------------------------------------------

    def pin(self, digest: str, hashes: Sequence[bytes]) -> list[Block]:
        """A put was told these blocks are held: none is collected until unpin(). KeyError,
        with nothing pinned, unless the store holds each of them."""
        blocks = [self._require(digest, h) for h in hashes]
        for block in blocks:
            block.pins += 1
        return blocks

    def unpin(self, blocks: Sequence[Block]) -> None:
        """The put ended (committed, aborted, expired): what it alone kept is collected."""
        for block in blocks:
            block.pins -= 1
            self._collect_if_free(block)

    # --- manifests ---------------------------------------------------------------------------

    def attach(
        self, digest: str, hashes: Sequence[bytes], size: int, staged: Mapping[bytes, Path]
    ) -> tuple[Block, ...]:
        """A manifest listing hashes joins: each block gains a ref. A hash the store does not
        hold joins pending at its staging file in staged (size bytes); a staged copy of a hash
        held already is not needed and goes. KeyError, with nothing changed, for a hash
        neither held nor staged. Returns the manifest's blocks in order, for detach()."""
        known = self._blocks.get(digest, {})
        for block_hash in hashes:
            if block_hash not in known and block_hash not in staged:
                raise KeyError(f"block {block_hash.hex()} is neither held nor written")
        listed = []
        for block_hash in hashes:
            block = known.get(block_hash)
            if block is None:
                block = self._join(digest, block_hash, size, staged[block_hash], durable=False)
                known = self._blocks[digest]
            block.refs += 1
            listed.append(block)
        for block_hash, path in staged.items():
            held = known.get(block_hash)
            if held is None or held.path != path:  # held already (by another put's commit)
                self._deleter.delete(path)
        return tuple(listed)

    def detach(self, blocks: Sequence[Block]) -> None:
        """A manifest's file went: its blocks lose a ref, and those no one keeps are collected.
        Blocks are passed as attach() returned them: one forgotten meanwhile (quarantined)
        is no longer the store's, even if a new block of its hash joined since."""
        for block in blocks:
            block.refs -= 1
            self._collect_if_free(block)

    # --- files ---------------------------------------------------------------------------------

    def adopt(
        self, digest: str, block_hash: bytes, size: int, path: Path, mtime_ns: int | None = None
    ) -> Block:
        """A durable block file found on disk (start-up, reconcile), or recorded in the
        snapshot with its mtime_ns, with no ref yet: the manifests that list it attach to it
        next, and collect_orphans() takes the rest. ValueError if the store holds that hash
        already."""
        if self.get(digest, block_hash) is not None:
            raise ValueError(f"block {block_hash.hex()} of {digest} is held already")
        block = self._join(digest, block_hash, size, path, durable=True)
        block.mtime_ns = mtime_ns
        return block

    def placed(self, block: Block, path: Path) -> bool:
        """The writer renamed a pending block's file into place: it is durable. False when
        the block was collected meanwhile (the caller then removes the file it placed)."""
        if self.get(block.digest, block.hash) is not block:
            return False
        block.path = path
        block.durable = True
        return True

    def forget(self, block: Block) -> None:
        """The block's file is gone or was moved aside (quarantined): out of the store, refs
        or not, nothing unlinked. The caller drops the manifests that list it."""
        if self.get(block.digest, block.hash) is block:
            self._leave(block)

    def collect_orphans(self, among: Iterable[Block] | None = None) -> int:
        """Collect the blocks (of among: those just adopted; default: all, after a scan) no
        manifest lists and no put pinned; how many."""
        orphans = [b for b in (self if among is None else among) if not b.refs and not b.pins]
        for block in orphans:
            self._collect_if_free(block)
        return len(orphans)

    # --- inside --------------------------------------------------------------------------------

    def _require(self, digest: str, block_hash: bytes) -> Block:
        block = self.get(digest, block_hash)
        if block is None:
            raise KeyError(f"block {block_hash.hex()} of {digest} is not held")
        return block

    def _join(
        self, digest: str, block_hash: bytes, size: int, path: Path, *, durable: bool
    ) -> Block:
        block = Block(block_hash, digest, size, path, durable=durable)
        self._blocks.setdefault(digest, {})[block_hash] = block
        self._identity_bytes[digest] = self._identity_bytes.get(digest, 0) + size
        self.bytes += size
        return block

    def _collect_if_free(self, block: Block) -> None:
        if block.refs or block.pins or self.get(block.digest, block.hash) is not block:
            return
        self._leave(block)
        self.collected += 1
        self._deleter.delete(block.path)

    def _leave(self, block: Block) -> None:
        blocks = self._blocks[block.digest]
        del blocks[block.hash]
        self._identity_bytes[block.digest] -= block.size
        if not blocks:
            del self._blocks[block.digest]
            del self._identity_bytes[block.digest]
        self.bytes -= block.size
