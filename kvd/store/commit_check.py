"""What a commit checks before the tier takes a put: its files sealed, then each checked whole.

A put is the client's word until its commit. There, on a worker thread, its files are sealed
(sealing.py: from then on no client can change them) and checked against what its put_begin
declared and what the tier holds: the header (identity, tokens, size, blocks, a creation time
the daemon can age it by), the heads of the blocks it was told are held, each new block file
(its size, head, place in the manifest and checksums) and the manifest's own checksums. A put
that fails is refused alone: nothing of it was indexed or offered to another put yet.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

from kvd_protocol.blocks import block_name
from kvd_protocol.entry import EntryHeader
from kvd_protocol.entry_reader import check_block
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

from kvd.store import entry_files, sealing
from kvd.store.blocks import Block
from kvd.store.staged_put import Put
from kvd.store.tier_dir import TierDir, new_entry_id

# An entry's creation time (eviction ages entries by it) is not before 2020 (no entry file
# was written then) nor ahead of the daemon's clock by more than this: engines run on the
# daemon's machine, under its clock.
CREATED_FIRST: Final = 1577836800.0  # 2020-01-01 UTC
CREATED_SKEW_SECONDS: Final = 3600.0


def seal_and_check(
    put: Put, dirs: TierDir, limits: Limits, copies: dict[Path, Path]
) -> EntryHeader:
    """On a worker thread: seal the manifest, check its header against the declaration
    and the heads of the blocks held for it, then each new block file (sealed, its size,
    head and place in the manifest, its checksums), then the manifest's own checksums; the
    header. copies: each client's file the daemon copied -> its copy, as made (filled even
    when a check fails). Raises EntryFormatError, or OSError when a file can be neither
    sealed nor copied."""
    manifest_copy = dirs.staging_path(f"{put.id}-{new_entry_id()}")
    fd = _sealed(put.path, put.size, manifest_copy, copies)
    try:
        header = entry_files.entry_head(fd, put.path.name, limits)
        check_matches_put(header, put, time.time())
        digest = put.identity.digest()
        for index, held in enumerate(put.pinned):
            _check_held(held, header, index, dirs, limits)
        for index, path in sorted(put.block_files.items()):
            copy_to = dirs.staging_path(f"{put.id}-{index}-{new_entry_id()}")
            block = _sealed(path, put.block_size, copy_to, copies)
            try:
                name = dirs.block_path(digest, put.block_hashes[index]).name
                _check_block_size(block, name, put.block_size)
                entry_files.verify_block_at(block, name, header, index, limits)
            finally:
                os.close(block)
        entry_files.verify_slots(fd, put.path.name, header.slots)
    finally:
        os.close(fd)
    return header


def check_matches_put(header: EntryHeader, put: Put, now: float) -> None:
    """The file must hold what its put_begin declared: the daemon indexes by the declaration.
    Its creation time must be one the daemon can age it by."""
    problems = []
    if not CREATED_FIRST <= header.created <= now + CREATED_SKEW_SECONDS:
        problems.append(f"its creation time {header.created} is not between 2020 and now")
    if header.identity != put.identity:
        problems.append("its identity differs from the one declared at put_begin")
    if header.tokens != put.tokens:
        problems.append("its tokens differ from the ones declared at put_begin")
    if header.file_size != put.size:
        problems.append(f"its size {header.file_size} differs from the declared {put.size}")
    if header.block_hashes != put.block_hashes or header.block_tokens != put.declared.block_tokens:
        problems.append("its blocks differ from the ones declared at put_begin")
    if problems:
        raise EntryFormatError(put.path.name, Rule.SCHEMA, "; ".join(problems))


def _check_held(
    block: Block, manifest: EntryHeader, index: int, dirs: TierDir, limits: Limits
) -> None:
    """A block the put was told is held must be the one its manifest lists there: else a
    reader of the manifest would report the block damaged, and the daemon's check would
    take it, with every other manifest listing it. Its head is enough: the block itself
    was checked whole at its own put's commit. One gone since is the caller's to see."""
    name = block_name(block.hash)
    final = dirs.block_path(block.digest, block.hash)
    head = entry_files.held_block_head((block.path, final), name, limits)
    if head is not None:
        check_block(manifest, index, head, name)


def _check_block_size(fd: int, name: str, declared: int) -> None:
    """A block file must be of the size its put_begin declared: the tier counts it so."""
    size = os.fstat(fd).st_size
    if size != declared:
        raise EntryFormatError(
            name, Rule.FILE_SIZE, f"{size} bytes, where put_begin declared {declared} a block"
        )


def _sealed(path: Path, size: int, copy_to: Path, copies: dict[Path, Path]) -> int:
    """A descriptor of path sealed (of its copy, noted in copies, if need be)."""
    sealed = sealing.seal(path, size, copy_to)
    if sealed.copied:
        copies[path] = sealed.path
    return sealed.fd
