"""Blocking file work on entries, run in worker threads: create, validate, persist, quarantine.

Nothing here touches the daemon's state; the tier calls these through anyio.to_thread and
applies the results on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from kvd_protocol.checksum import new_checksum
from kvd_protocol.entry import PREFIX_BYTES, BlockHeader, EntryHeader, Slot
from kvd_protocol.entry_reader import (
    Prefix,
    check_block,
    check_slot_digest,
    check_slot_length,
    parse_block_header,
    parse_header,
    parse_prefix,
)
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.limits import Limits

from kvd.store.durability import preallocate, replace_durably, sync_directory, sync_file


def create_staging(path: Path, size: int) -> int:
    """A new read-write file of exactly size bytes, space reserved; returns its descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        preallocate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def open_staging_files(paths: list[Path], size: int) -> list[int]:
    """Read-write descriptors of staging files of size bytes each: made (space reserved) if
    they do not exist yet, opened again if they do. All or none: on a failure the ones
    opened are closed and the ones made removed."""
    fds: list[int] = []
    made: list[Path] = []
    try:
        for path in paths:
            try:
                fds.append(create_staging(path, size))
                made.append(path)
            except FileExistsError:
                fds.append(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))
    except BaseException:
        for fd in fds:
            os.close(fd)
        for path in made:
            path.unlink(missing_ok=True)
        raise
    return fds


def read_header(path: Path, limits: Limits) -> EntryHeader:
    """Parse and validate an entry's prefix and header against the file's real size.

    Raises EntryFormatError for a bad file (a symbolic link included), OSError if it cannot
    be read.
    """
    fd = _open_regular(path)
    try:
        return entry_head(fd, path.name, limits)
    finally:
        os.close(fd)


def entry_head(fd: int, name: str, limits: Limits) -> EntryHeader:
    """read_header of an open file; name: for errors only."""
    return parse_header(name, *_raw_head(fd, name, limits), limits)


def _raw_head(fd: int, name: str, limits: Limits) -> tuple[Prefix, bytes, int]:
    """An open file's parsed prefix, its header's bytes and the file's real size."""
    size = os.fstat(fd).st_size
    prefix = parse_prefix(name, os.pread(fd, PREFIX_BYTES, 0), limits)
    return prefix, os.pread(fd, prefix.header_length, PREFIX_BYTES), size


class ChangedError(Exception):
    """The file is not the one a record was taken from (another mtime): read it again."""


def open_entry(path: Path, nbytes: int, mtime_ns: int | None = None) -> int:
    """A read-only descriptor of an entry file that still is what the index holds: a regular
    file of nbytes (the header's size), as fstat on the descriptor itself says. A snapshot or
    an earlier read is never trusted over the file: it may have been truncated or replaced.

    mtime_ns: the file's mtime when its record was taken, not checked since: ChangedError for
    another size or mtime (the file is to be read again, not judged). Otherwise raises
    EntryFormatError for a file that is not the entry, OSError if it cannot be opened.
    """
    fd = _open_regular(path)
    try:
        info = os.fstat(fd)
        if mtime_ns is not None and (info.st_size, info.st_mtime_ns) != (nbytes, mtime_ns):
            raise ChangedError(
                f"{info.st_size} bytes modified at {info.st_mtime_ns} ns; recorded: {nbytes} "
                f"bytes at {mtime_ns} ns"
            )
        if info.st_size != nbytes:
            raise EntryFormatError(
                path.name, Rule.FILE_SIZE, f"{info.st_size} bytes on disk, {nbytes} in its header"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_regular(path: Path) -> int:
    """Open read-only a regular file, never through a symbolic link (whatever it points to
    is not the tier's file to read or hand out); EntryFormatError for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EntryFormatError(path.name, Rule.SCHEMA, "a symbolic link") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EntryFormatError(path.name, Rule.SCHEMA, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_block_header(path: Path, limits: Limits) -> BlockHeader:
    """Parse and validate a block file's prefix and header against its real size (its hash
    against its name included); EntryFormatError for a bad file, OSError if unreadable."""
    fd = _open_regular(path)
    try:
        return block_head(fd, path.name, limits)
    finally:
        os.close(fd)


def verify_block(
    path: Path, name: str, manifest: EntryHeader, index: int, limits: Limits
) -> BlockHeader:
    """Validate block file path whole as block index of manifest: its head, that it belongs
    there (check_block) and every slot's checksum. name: the file's name in blocks/ (its
    hash), which a staging file does not have. Raises EntryFormatError."""
    fd = _open_regular(path)
    try:
        return verify_block_at(fd, name, manifest, index, limits)
    finally:
        os.close(fd)


def verify_block_at(
    fd: int, name: str, manifest: EntryHeader, index: int, limits: Limits
) -> BlockHeader:
    """verify_block of an open file."""
    block = block_head(fd, name, limits)
    check_block(manifest, index, block, name)
    verify_slots(fd, name, block.slots)
    return block


def held_block_head(paths: tuple[Path, ...], name: str, limits: Limits) -> BlockHeader | None:
    """The head of a block file at the first of paths it is found at (a pending block moves
    from staging into blocks/ once durable); None when it is at none of them (gone)."""
    for path in paths:
        try:
            fd = _open_regular(path)
        except FileNotFoundError:
            continue
        try:
            return block_head(fd, name, limits)
        finally:
            os.close(fd)
    return None


def block_head(fd: int, name: str, limits: Limits) -> BlockHeader:
    """read_block_header of an open file, named name (its hash) in blocks/."""
    return parse_block_header(name, *_raw_head(fd, name, limits), limits)


def verify_data(path: Path, header: EntryHeader | BlockHeader) -> None:
    """Check every tensor's bytes (of an entry or a block file) against its slot checksum;
    raises EntryFormatError."""
    fd = _open_regular(path)
    try:
        verify_slots(fd, path.name, header.slots)
    finally:
        os.close(fd)


# Slots are checked in pieces of this size, read into one buffer: never through a mapping,
# since a file can shrink behind the daemon's back (a client may still hold a staging file)
# and a mapping read past its end kills the reader (SIGBUS) where pread only comes up short.
VERIFY_CHUNK: Final = 1 << 20


def verify_slots(fd: int, name: str, slots: Sequence[Slot]) -> None:
    """Check every slot's bytes in file fd against its checksum; EntryFormatError for one that
    differs or a file too short to hold it (name: for errors only)."""
    if not slots:
        return
    buffer = slot_buffer(slots)
    for slot in slots:
        verify_slot(fd, name, slot, buffer)


def slot_buffer(slots: Sequence[Slot]) -> memoryview:
    """A buffer for verify_slot to read any of slots through."""
    return memoryview(bytearray(min(VERIFY_CHUNK, max(slot.nbytes for slot in slots))))


def verify_slot(fd: int, name: str, slot: Slot, buffer: memoryview) -> None:
    """Check one slot's bytes in file fd against its checksum, read through buffer (pread:
    callers on several threads each check other slots of the same descriptor)."""
    digest = new_checksum()
    done = 0
    while done < slot.nbytes:
        piece = buffer[: min(len(buffer), slot.nbytes - done)]
        n = os.preadv(fd, [piece], slot.start + done)
        if not n:
            break  # the end of the file: too short
        digest.update(piece[:n])
        done += n
    check_slot_length(name, slot, done)
    check_slot_digest(name, slot, digest.digest())


def verify_entry(path: Path, limits: Limits) -> EntryHeader:
    """Validate an entry file whole, head and every tensor; raises EntryFormatError."""
    header = read_header(path, limits)
    verify_data(path, header)
    return header


def persist(staging: Path, final: Path) -> None:
    """Make a validated staging file a durable entry: full sync, rename, sync the folders.

    On any failure the file is left at staging, for the caller to fail and delete: never
    synced again (after EIO the kernel may have marked its lost pages clean, and a second
    fsync would succeed with the data gone), nor left in its place, where a listing would
    find it and serve an entry its put was told had failed."""
    _make_folder(final.parent)
    try:
        replace_durably(staging, final)
    except OSError:
        if not staging.exists():  # renamed, then a folder's sync failed: take it back
            try:
                os.replace(final, staging)
            except OSError:
                final.unlink(missing_ok=True)
        raise


def place_block(staging: Path, final: Path) -> None:
    """Move a validated block file into its identity's blocks folder, synced: the folder
    itself is synced once for all of a manifest's blocks (sync_directory), before the
    manifest is persisted."""
    _make_folder(final.parent)
    fd = os.open(staging, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        sync_file(fd)
    finally:
        os.close(fd)
    os.replace(staging, final)


def _make_folder(folder: Path) -> None:
    """Make a folder of the tier (and those above it), each one's name synced."""
    if folder.is_dir():
        return
    _make_folder(folder.parent)
    folder.mkdir(mode=0o700, exist_ok=True)
    try:
        sync_directory(folder.parent)
    except OSError:
        # Not made, then: the next file for it makes it again and syncs that (a folder
        # that exists is taken as durable).
        with contextlib.suppress(OSError):
            folder.rmdir()
        raise


def quarantine(path: Path, folder: Path, max_bytes: int) -> bool:
    """Move a file that failed validation aside for inspection, keeping the folder under
    max_bytes by deleting the oldest quarantined files first; False if it was gone already
    (another check quarantined it first)."""
    target = folder / path.name
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return False  # gone meanwhile: nothing left to keep
    # Quarantines run in worker threads side by side: a file listed here may be gone by
    # the time it is looked at, trimmed by another one.
    files = []
    for entry in os.scandir(folder):
        with contextlib.suppress(FileNotFoundError):
            if entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                files.append((info.st_mtime_ns, info.st_size, entry.path))
    files.sort()
    total = sum(size for _, size, _ in files)
    for _, size, oldest in files:
        if total <= max_bytes:
            break
        total -= size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(oldest)
    return True


def unlink_quietly(path: Path) -> None:
    """Remove a file that may already be gone."""
    path.unlink(missing_ok=True)
