"""Credentials from a command: `credential_process` in the AWS config file, as AWS's own tools
run it (SSO helpers, password managers, a vault's agent).

The command is the profile's `credential_process` value of `AWS_CONFIG_FILE` (else
~/.aws/config), `[default]` or `[profile NAME]`, split as a POSIX shell would split it but run
without a shell. It runs with no input, for at most PROCESS_TIMEOUT_S, and may write at most
OUTPUT_LIMIT bytes; past either it is killed (its whole process group). Its output is JSON:

    {"Version": 1, "AccessKeyId": "...", "SecretAccessKey": "...",
     "SessionToken": "...", "Expiration": "2026-12-03T10:00:00Z"}

SessionToken and Expiration are optional (none: the credentials do not expire). An error names
the command's program and what went wrong, and quotes at most the last line of its stderr,
never its output (which holds the secret).
"""

from __future__ import annotations

import configparser
import json
import os
import selectors
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from contextlib import suppress
from datetime import datetime
from pathlib import Path
from typing import Final

from kvd.remote.credentials import Credentials, CredentialsError, line_of, read_private

PROCESS_TIMEOUT_S: Final = 30.0  # a helper that asks a network service answers well within it
OUTPUT_LIMIT: Final = 64 << 10  # bytes of stdout, and of stderr; the JSON is a few KiB
STDERR_SHOWN: Final = 200  # characters of the stderr's last line put in an error


def config_file(environ: Mapping[str, str], home: Path | None = None) -> Path:
    """The AWS config file: AWS_CONFIG_FILE, else ~/.aws/config."""
    named = environ.get("AWS_CONFIG_FILE")
    return Path(named) if named else (home or Path.home()) / ".aws" / "config"


def process_command(path: Path, profile: str) -> list[str] | None:
    """The profile's credential_process, split into its program and arguments; None when the
    file or the profile has none."""
    if not path.exists():
        return None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(read_private(path, owned_private=False), source=str(path))
    except configparser.Error as error:
        raise CredentialsError(f"{path} is not an INI config file ({line_of(error)})") from None
    section = profile if profile == "default" else f"profile {profile}"
    if not parser.has_section(section):
        return None
    command = parser[section].get("credential_process", "").strip()
    if not command:
        return None
    try:
        argv = shlex.split(command)
    except ValueError as error:
        raise CredentialsError(
            f"{path} [{section}] credential_process cannot be split: {error}"
        ) from None
    return argv or None


def run_process(argv: list[str], source: str, *, timeout: float = PROCESS_TIMEOUT_S) -> Credentials:
    """The credentials the command writes (see the module's format); CredentialsError when it
    cannot run, fails, takes too long, writes too much or writes something else."""
    program = Path(argv[0]).name
    what = f"credential_process {program} ({source})"
    try:
        process = subprocess.Popen(  # the operator's own command, no shell
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its children are killed with it
        )
    except OSError as error:
        raise CredentialsError(f"{what} cannot run: {error.strerror}") from None
    try:
        out, err, cut = _read_bounded(process, timeout)
    finally:
        if process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
    if cut:
        raise CredentialsError(f"{what} {cut}")
    if process.returncode != 0:
        line = err.decode("utf-8", errors="replace").strip().rpartition("\n")[2]
        said = f": {line[:STDERR_SHOWN]}" if line else ""
        raise CredentialsError(f"{what} exited with status {process.returncode}{said}")
    return parse_output(out, what)


def _read_bounded(process: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes, str]:
    """stdout and stderr until both end, and "" ; or what was read and why it was cut short
    (the time, or an output past OUTPUT_LIMIT)."""
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    assert process.stderr is not None
    read: dict[int, bytearray] = {process.stdout.fileno(): bytearray()}
    read[process.stderr.fileno()] = bytearray()
    with selectors.DefaultSelector() as selector:
        for fd in read:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", b"", f"gave no answer within {timeout:g} s"
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                read[key.fd] += chunk
                if len(read[key.fd]) > OUTPUT_LIMIT:
                    return b"", b"", f"wrote more than {OUTPUT_LIMIT} bytes"
    left = max(deadline - time.monotonic(), 0.0)
    try:
        process.wait(left)
    except subprocess.TimeoutExpired:
        return b"", b"", f"did not exit within {timeout:g} s"
    return bytes(read[process.stdout.fileno()]), bytes(read[process.stderr.fileno()]), ""


def parse_output(output: bytes, what: str) -> Credentials:
    """The credentials of a credential_process's JSON; the errors never quote it."""
    try:
        found = json.loads(output)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CredentialsError(f"{what} wrote something other than JSON") from None
    if not isinstance(found, dict):
        raise CredentialsError(f"{what} wrote JSON that is not an object")
    if found.get("Version") != 1:
        raise CredentialsError(f"{what} wrote Version {found.get('Version')!r}, not 1")
    fields = {}
    for name in ("AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"):
        value = found.get(name, "")
        if not isinstance(value, str):
            raise CredentialsError(f"{what} wrote a {name} that is not a string")
        fields[name] = value.strip()
    if not (fields["AccessKeyId"] and fields["SecretAccessKey"]):
        raise CredentialsError(f"{what} wrote no AccessKeyId or no SecretAccessKey")
    expires = None
    if fields["Expiration"]:
        try:
            moment = datetime.fromisoformat(fields["Expiration"])
        except ValueError:
            raise CredentialsError(f"{what} wrote an Expiration that is not ISO 8601") from None
        if moment.tzinfo is None:
            raise CredentialsError(f"{what} wrote an Expiration without a time zone")
        expires = moment.timestamp()
    return Credentials(
        fields["AccessKeyId"],
        fields["SecretAccessKey"],
        fields["SessionToken"],
        what,
        expires=expires,
    )
