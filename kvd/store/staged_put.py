"""A put begun and not yet committed: what its put_begin declared, the staging files it was
handed, the blocks it was told are held, the checks of its blocks begun before its commit.
Puts (puts.py) keeps them; the commit checks them (commit_check.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kvd_protocol.blocks import block_name
from kvd_protocol.identity import Identity
from kvd_protocol.messages import Retention

from kvd.store.block_checks import BlockChecks
from kvd.store.blocks import Block


@dataclass(frozen=True)
class DeclaredBlocks:
    """What a v2 put_begin says of the entry's blocks: their hashes in order, the tokens in
    each, every block file's exact size. None of them for a v1 entry."""

    hashes: tuple[bytes, ...] = ()
    block_tokens: int = 0
    block_size: int = 0


NO_BLOCKS = DeclaredBlocks()


@dataclass(eq=False)
class Put:
    """A staging file handed to an engine, not yet committed."""

    id: int
    owner: int  # the connection that began it
    identity: Identity
    tokens: bytes
    size: int
    path: Path
    began: float = field(default_factory=time.monotonic)
    declared: DeclaredBlocks = NO_BLOCKS
    pinned: list[Block] = field(default_factory=list)  # the first len(pinned) are held
    block_files: dict[int, Path] = field(default_factory=dict)  # new blocks handed out
    handed: int = 0  # block descriptors handed out (block_files)
    retention: Retention | None = None  # what put_begin asked for (kvd.store.retention)
    checks: BlockChecks = field(default_factory=BlockChecks)  # of block_files, begun early

    @property
    def block_hashes(self) -> tuple[bytes, ...]:
        return self.declared.hashes

    @property
    def block_size(self) -> int:
        return self.declared.block_size

    def block_name(self, index: int) -> str:
        """The name of block index's file in the blocks folder (errors name blocks so)."""
        return block_name(self.block_hashes[index])

    @property
    def held_blocks(self) -> int:
        """How many of its leading blocks the tier held at put_begin (pinned for it)."""
        return len(self.pinned)

    @property
    def reserved(self) -> int:
        """The bytes the put will add: its manifest and the blocks the tier does not hold."""
        return self.size + (len(self.block_hashes) - self.held_blocks) * self.block_size
