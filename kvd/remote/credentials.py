"""The store's credentials, from the standard AWS sources in order:

1. the file named by `remote_credentials_file` (INI as ~/.aws/credentials), which must belong to
   the daemon's user and be readable by no one else (0600), as a file holding a secret should;
2. the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN;
3. the shared file: AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials.

From a file, the profile is AWS_PROFILE's, else "default". A secret never reaches a repr, a log
line or an error message: errors name the file, the profile and the line number, never a value.
"""

from __future__ import annotations

import configparser
import os
import stat
from collections.abc import Mapping
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
    source: str = ""  # where they were read: a file and profile, or "environment"


def load_credentials(
    file: Path | None, environ: Mapping[str, str], home: Path | None = None
) -> Credentials:
    """The credentials of the first source that has any (see the module's order)."""
    profile = environ.get("AWS_PROFILE") or "default"
    if file is not None:
        return _from_file(file, profile, owned_private=True)
    access_key = environ.get("AWS_ACCESS_KEY_ID", "")
    secret_key = environ.get("AWS_SECRET_ACCESS_KEY", "")
    if access_key or secret_key:
        if not (access_key and secret_key):
            missing = "AWS_SECRET_ACCESS_KEY" if access_key else "AWS_ACCESS_KEY_ID"
            raise CredentialsError(f"the environment has AWS credentials without {missing}")
        return Credentials(
            access_key, secret_key, environ.get("AWS_SESSION_TOKEN", ""), "environment"
        )
    shared = environ.get("AWS_SHARED_CREDENTIALS_FILE")
    shared_file = Path(shared) if shared else (home or Path.home()) / ".aws" / "credentials"
    if not shared_file.exists():
        raise CredentialsError(
            "no credentials for the remote store: set remote_credentials_file, or "
            f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or write {shared_file}"
        )
    return _from_file(shared_file, profile, owned_private=False)


def _from_file(path: Path, profile: str, *, owned_private: bool) -> Credentials:
    """One profile of an INI credentials file; `owned_private`: refused unless the daemon's
    user owns it and no one else may read or write it (checked on the file opened)."""
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
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as error:
        # The parser's own message quotes the offending line, which may hold a secret.
        line = getattr(error, "lineno", None) or [n for n, _ in getattr(error, "errors", [])]
        raise CredentialsError(f"{path} is not an INI credentials file (line {line})") from None
    if not parser.has_section(profile):
        raise CredentialsError(f"{path} has no profile [{profile}]")
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
