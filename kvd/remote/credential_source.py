"""Which credentials the bucket is signed with, and when they are read again.

The sources, the first that has credentials (load_credentials):

1. the file named by `remote_credentials_file` (INI as ~/.aws/credentials), which must be the
   daemon's own and 0600;
2. the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN;
3. the shared file, AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials, when it has the profile;
4. the profile's `credential_process` in the AWS config file (credential_process.py).

The profile is AWS_PROFILE's, else "default".

A CredentialSource reads them when first asked and again, at the next request, when they may
have changed: the files it watches changed (checked at most every AGAIN_S), the credentials
near their Expiration (REFRESH_BEFORE_S before it, or half their life when that is shorter),
or the bucket refused them (renew). Never more often than every AGAIN_S, but for a refusal,
which reads again unless a read came after the refused request was signed: the requests refused
at once cost one read. A refresh ahead of expiry that
fails keeps the credentials it would have replaced until they expire. The environment is read
once: a running process's environment does not change.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from kvd.remote.credential_process import config_file, process_command, run_process
from kvd.remote.credentials import Credentials, CredentialsError, NoProfile, from_file

AGAIN_S: Final = 1.0  # the least time between two reads, or two looks at the files
REFRESH_BEFORE_S: Final = 600.0  # expiring credentials are replaced this long before

Signature = tuple[int, int, int, int] | None  # a file's inode, size, mtime and ctime (ns)


def shared_file(environ: Mapping[str, str], home: Path | None = None) -> Path:
    """The shared credentials file: AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials."""
    named = environ.get("AWS_SHARED_CREDENTIALS_FILE")
    return Path(named) if named else (home or Path.home()) / ".aws" / "credentials"


def load_credentials(
    file: Path | None, environ: Mapping[str, str], home: Path | None = None
) -> Credentials:
    """The credentials of the first source that has any (see the module's order)."""
    profile = environ.get("AWS_PROFILE") or "default"
    if file is not None:
        return from_file(file, profile, owned_private=True)
    access_key = environ.get("AWS_ACCESS_KEY_ID", "")
    secret_key = environ.get("AWS_SECRET_ACCESS_KEY", "")
    if access_key or secret_key:
        if not (access_key and secret_key):
            missing = "AWS_SECRET_ACCESS_KEY" if access_key else "AWS_ACCESS_KEY_ID"
            raise CredentialsError(f"the environment has AWS credentials without {missing}")
        return Credentials(
            access_key, secret_key, environ.get("AWS_SESSION_TOKEN", ""), "environment"
        )
    shared = shared_file(environ, home)
    no_profile: NoProfile | None = None
    if shared.exists():
        try:
            return from_file(shared, profile, owned_private=False)
        except NoProfile as error:
            no_profile = error
    config = config_file(environ, home)
    command = process_command(config, profile)
    if command is not None:
        return run_process(command, f"{config} [{profile}]")
    if no_profile is not None:
        raise no_profile
    raise CredentialsError(
        "no credentials for the remote bucket: set remote_credentials_file, or "
        f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or write {shared}, or give the "
        f"profile [{profile}] a credential_process in {config}"
    )


def _signature(path: Path) -> Signature:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class CredentialSource:
    """The credentials as they are now (current), for the worker threads that sign requests;
    thread-safe. Reads as the module says."""

    def __init__(
        self,
        file: Path | None,
        environ: Mapping[str, str],
        home: Path | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._file = file
        self._environ = dict(environ)
        self._home = home
        self._clock = clock
        self._wall = wall
        # The files whose change may change the credentials.
        self._watched = (
            (file,) if file else (shared_file(environ, home), config_file(environ, home))
        )
        self._lock = threading.Lock()  # one read at a time: a process is run once, not per thread
        self._credentials: Credentials | None = None
        self._error = CredentialsError("the credentials were not read yet")
        self._refused = False  # the bucket refused the current ones
        self._read_at = -math.inf  # clock() of the last read
        self._looked_at = -math.inf  # clock() of the last look at the files
        self._refresh_at = math.inf  # wall() after which expiring credentials are replaced
        self._seen: tuple[Signature, ...] = ()  # the files' signatures at the last read

    def __repr__(self) -> str:
        return f"CredentialSource({self._credentials!r})"

    def current(self) -> Credentials:
        """The credentials to sign with, read again first when due; CredentialsError when
        there are none (the last read's error, no secret in it)."""
        with self._lock:
            if self._due():
                self._read()
            if self._credentials is None:
                raise self._error
            return self._credentials

    def renew(self, refused: Credentials, signed_at: float) -> bool:
        """The bucket refused `refused`, signed at clock() time signed_at: read again now,
        unless they were read since (another refused request of the same moment did); whether
        that gave other credentials to try."""
        with self._lock:
            self._refused = True
            if self._read_at <= signed_at:
                self._read()
            return self._credentials is not None and self._credentials is not refused

    def changed(self) -> bool:
        """Whether a watched file changed since the last read (a look at them, no read; never
        waits for a read under way)."""
        return tuple(_signature(path) for path in self._watched) != self._seen

    def _due(self) -> bool:
        now = self._clock()
        if now - self._read_at < AGAIN_S:
            return False
        if self._credentials is None or self._refused or self._wall() >= self._refresh_at:
            return True
        if now - self._looked_at < AGAIN_S:
            return False
        self._looked_at = now
        return self.changed()

    def _read(self) -> None:
        self._read_at = self._looked_at = self._clock()
        seen = tuple(_signature(path) for path in self._watched)  # before: a change while
        try:  # reading is seen at the next look
            fresh = load_credentials(self._file, self._environ, self._home)
        except CredentialsError as error:
            self._error = error
            self._seen = seen
            current = self._credentials
            expired = current is None or (
                current.expires is not None and self._wall() >= current.expires
            )
            if self._refused or expired:
                self._credentials = None
            return
        self._seen = seen
        self._refused = False
        if fresh != self._credentials:
            self._credentials = fresh
        self._refresh_at = self._refresh_time(fresh)

    def _refresh_time(self, credentials: Credentials) -> float:
        if credentials.expires is None:
            return math.inf
        life = credentials.expires - self._wall()
        return credentials.expires - min(REFRESH_BEFORE_S, max(life, 0.0) / 2)
