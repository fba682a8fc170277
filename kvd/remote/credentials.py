"""The bucket's credentials, and the INI files that hold them (credential_source.py says
which source is read, and when again).

A file named by the operator (`remote_credentials_file`) must belong to the daemon's user and be
readable by no one else (0600), as a file holding a secret should; every file is read without
hanging on a FIFO and up to FILE_LIMIT bytes. A secret never reaches a repr, a log line or an
error message: errors name the file, the profile and the line number, never a value.
"""

from __future__ import annotations

import configparser
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

FILE_LIMIT: Final = 1 << 20  # bytes; a credentials file holds a few profiles


class CredentialsError(Exception):
    """No usable credentials; the message never holds a secret."""


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)
    session_token: str = field(default="", repr=False)
    source: str = ""  # where they were read: a file and profile, "environment", a process
    expires: float | None = None  # time.time() when they expire; None: they do not


class NoProfile(CredentialsError):  # noqa: N818 - reads as what the file lacks
    """The file has no section for the profile (another source may have it)."""


def from_file(path: Path, profile: str, *, owned_private: bool) -> Credentials:
    """One profile of an INI credentials file; `owned_private`: refused unless the daemon's
    user owns it and no one else may read or write it (checked on the file opened)."""
    text = read_private(path, owned_private=owned_private)
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as error:
        raise CredentialsError(
            f"{path} is not an INI credentials file ({line_of(error)})"
        ) from None
    if not parser.has_section(profile):
        raise NoProfile(f"{path} has no profile [{profile}]")
    section = parser[profile]
    access_key = section.get("aws_access_key_id", "").strip()
    secret_key = section.get("aws_secret_access_key", "").strip()
    if not (access_key and secret_key):
        raise CredentialsError(
            f"{path} profile [{profile}] lacks aws_access_key_id or aws_secret_access_key"
        )
    return Credentials(
        access_key,
        secret_key,
        section.get("aws_session_token", "").strip(),
        f"{path} [{profile}]",
    )


def line_of(error: configparser.Error) -> str:
    """Where an INI file is wrong, in words: the parser's own message quotes the offending
    line, which may hold a secret."""
    line = getattr(error, "lineno", None) or [n for n, _ in getattr(error, "errors", [])]
    return f"line {line}"


def read_private(path: Path, *, owned_private: bool) -> str:
    """A small file's text (CredentialsError if it cannot be read, is not a file, is over
    FILE_LIMIT, or, owned_private, is not the daemon's own and 0600)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not hang the daemon
    except OSError as error:
        raise CredentialsError(f"cannot read {path}: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CredentialsError(f"{path} is not a file")
        if owned_private and info.st_uid != os.getuid():
            raise CredentialsError(
                f"{path} belongs to uid {info.st_uid}; kvd runs as uid {os.getuid()}: "
                "a credentials file must be the daemon's own"
            )
        if owned_private and info.st_mode & 0o077:
            raise CredentialsError(
                f"{path} is mode {stat.S_IMODE(info.st_mode):04o}: a credentials file must "
                f"be readable by its owner only (chmod 600 {path})"
            )
        if info.st_size > FILE_LIMIT:
            raise CredentialsError(f"{path} is over {FILE_LIMIT} bytes: not a credentials file")
        text = os.read(fd, FILE_LIMIT).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    return text
