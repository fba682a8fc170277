"""What a commit checks before the tier takes a put: its files sealed, then each checked whole.

A put is the client's word until its commit. There, on a worker thread, its files are sealed
(sealing.py: from then on no client can change them) and checked against what its put_begin
declared and what the tier holds: the header (identity, tokens, size, blocks, a creation time
the daemon can age it by), the heads of the blocks it was told are held, each new block file
(its size, head, place in the manifest and checksums) and the manifest's own checksums. The
new block files are sealed and checked on the block checkers' threads, most of them before
the commit, as the client hands them over (block_checks.py); the slots of a whole entry's
file (or a manifest's), on the commit's thread and those threads at once (slot_checks.py).
A put that fails is refused alone: nothing of it was indexed or offered to another put yet.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import wait
from functools import partial
from pathlib import Path
from typing import Final

from kvd_protocol.blocks import block_name
from kvd_protocol.entry import BlockHeader, EntryHeader
from kvd_protocol.entry_reader import check_block
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

from kvd.store import entry_files, sealing, slot_checks
from kvd.store.block_checks import check_block_file
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
    and the heads of the blocks held for it, then the manifest's own checksums (on the
    block checkers' threads too, for a big file: slot_checks.py), while the block checkers
    check each new block file (sealed, its size, head and checksums: the check
    begun early where it passed, block_checks.py); then each one's place in the manifest; the
    header. copies: each client's file the daemon copied -> its copy, as made (filled even
    when a check fails). Raises EntryFormatError, or OSError when a file can be neither
    sealed nor copied."""
    manifest_copy = dirs.staging_path(f"{put.id}-{new_entry_id()}")
    fd = _sealed(put.path, put.size, manifest_copy, copies)
    try:
        header = entry_files.entry_head(fd, put.path.name, limits)
        check_matches_put(header, put, time.time())
        heads = put.checks.at_commit(
            {
                index: partial(_seal_and_check_block, put, index, dirs, limits, copies)
                for index in put.block_files
            }
        )
        try:
            for index, held in enumerate(put.pinned):
                _check_held(held, header, index, dirs, limits)
            slot_checks.verify_slots(fd, put.path.name, header.slots)
            for index, head in sorted(heads.items()):
                check_block(header, index, head.result(), put.block_name(index))
        finally:
            wait(heads.values())  # none is left copying or reading the put's files
    finally:
        os.close(fd)
    return header


def _seal_and_check_block(
    put: Put, index: int, dirs: TierDir, limits: Limits, copies: dict[Path, Path]
) -> BlockHeader:
    """On a block checker's thread: block index of put sealed (a copy if need be) and
    checked whole; its head."""
    copy_to = dirs.staging_path(f"{put.id}-{index}-{new_entry_id()}")
    block = _sealed(put.block_files[index], put.block_size, copy_to, copies)
    try:
        return check_block_file(block, put.block_name(index), put.block_size, limits)
    finally:
        os.close(block)


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


def _sealed(path: Path, size: int, copy_to: Path, copies: dict[Path, Path]) -> int:
    """A descriptor of path sealed (of its copy, noted in copies, if need be)."""
    sealed = sealing.seal(path, size, copy_to)
    if sealed.copied:
        copies[path] = sealed.path
    return sealed.fd
