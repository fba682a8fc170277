"""The tier's directory: where each kind of file lives, and the lock that makes it one daemon's.

<dir>/lock                          taken (flock) by the running daemon
<dir>/staging/<put>.tmp              files being written by engines; reaped at start
<dir>/entries/<digest>/<id>.kve      durable entries, one folder per identity, named by its digest
<dir>/entries/<digest>/blocks/<hash>.kvb   their shared blocks (format v2), by hash
<dir>/quarantine/<id>.kve            files that failed validation, capped in bytes
<dir>/deleting/<random>.gone         files taken out of the tier, being unlinked (deleter.py)
<dir>/index.snapshot                 the index as of the last snapshot (a start-up shortcut)
<dir>/uploads.journal                uploads to the remote tier pending (kvd.remote.upload_journal)
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from kvd_protocol.blocks import block_name

ENTRY_SUFFIX = ".kve"
BLOCKS_FOLDER = "blocks"
STAGING_SUFFIX = ".tmp"


class TierLockedError(RuntimeError):
    """Another daemon holds the tier directory."""


@dataclass(frozen=True)
class TierDir:
    root: Path

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def deleting(self) -> Path:
        return self.root / "deleting"

    @property
    def snapshot(self) -> Path:
        return self.root / "index.snapshot"

    @property
    def upload_journal(self) -> Path:
        return self.root / "uploads.journal"

    def entry_path(self, digest: str, entry_id: str) -> Path:
        return self.entries / digest / f"{entry_id}{ENTRY_SUFFIX}"

    def blocks_folder(self, digest: str) -> Path:
        return self.entries / digest / BLOCKS_FOLDER

    def block_path(self, digest: str, block_hash: bytes) -> Path:
        return self.blocks_folder(digest) / block_name(block_hash)

    def staging_path(self, name: str) -> Path:
        return self.staging / f"{name}{STAGING_SUFFIX}"

    def create(self) -> None:
        """Create the folders, private to the owner (entries may hold anyone's prompts).

        A shared folder (sticky or world-writable, such as /tmp) is refused as the tier's
        root rather than made private: that would lock everyone else out of it.
        """
        refusal = self.refusal()
        if refusal is not None:
            raise PermissionError(refusal)
        for path in (self.root, self.staging, self.entries, self.quarantine, self.deleting):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)

    def refusal(self) -> str | None:
        """Why create() refuses the root as it is now; None when it takes it."""
        if self.root.is_dir() and self.root.stat().st_mode & (stat.S_ISVTX | stat.S_IWOTH):
            return (
                f"{self.root} is shared with other users; the tier needs a folder of its own, "
                f"such as {self.root / 'kvd'}"
            )
        return None

    def lock(self) -> int:
        """Take the tier's lock for the life of the process; returns the lock's descriptor."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TierLockedError(
                f"another kvd is using the tier directory {self.root} (it has the lock)"
            ) from None
        return fd


def new_entry_id() -> str:
    """A fresh, unguessable entry name: 128 random bits in hex."""
    return secrets.token_hex(16)
