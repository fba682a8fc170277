"""Where the store's credentials come from, which files are refused, and that a secret never
shows in a repr or an error."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest

from kvd.remote.credential_source import load_credentials
from kvd.remote.credentials import Credentials, CredentialsError
from kvd.remote.s3 import S3Store
from kvd.remote.sigv4 import Signer

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYSECRET"
TOKEN = "FQoGZXIvYXdzEXAMPLE-TOKEN"
ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_SECRET_ACCESS_KEY": "env-secret"}


def credentials_file(path: Path, mode: int = 0o600, text: str = "") -> Path:
    path.write_text(
        text
        or f"[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = {SECRET}\n"
        f"aws_session_token = {TOKEN}\n\n"
        "[team]\naws_access_key_id = TEAMKEY\naws_secret_access_key = team-secret\n"
    )
    path.chmod(mode)
    return path


def refusal(file: Path | None, environ: dict[str, str], home: Path) -> str:
    with pytest.raises(CredentialsError) as raised:
        load_credentials(file, environ, home)
    message = str(raised.value)
    assert SECRET not in message
    assert SECRET not in "".join(traceback.format_exception(raised.value))
    return message


def test_the_named_file_comes_first(tmp_path: Path) -> None:
    file = credentials_file(tmp_path / "credentials")
    found = load_credentials(file, ENVIRONMENT, tmp_path)
    assert found == Credentials("FILEKEY", SECRET, TOKEN, f"{file} [default]")
    team = load_credentials(file, {"AWS_PROFILE": "team"}, tmp_path)
    assert (team.access_key, team.secret_key, team.session_token) == ("TEAMKEY", "team-secret", "")


def test_a_named_file_others_may_read_is_refused(tmp_path: Path) -> None:
    for mode in (0o644, 0o640, 0o604, 0o660):
        file = credentials_file(tmp_path / f"credentials-{mode:o}", mode)
        message = refusal(file, ENVIRONMENT, tmp_path)
        assert f"is mode {mode:04o}" in message
        assert f"chmod 600 {file}" in message
    assert load_credentials(credentials_file(tmp_path / "read-only", 0o400), {}, tmp_path)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_a_named_file_of_another_user_is_refused(tmp_path: Path) -> None:
    file = credentials_file(tmp_path / "credentials")
    os.chown(file, 65534, 65534)
    message = refusal(file, ENVIRONMENT, tmp_path)
    assert f"belongs to uid 65534; kvd runs as uid {os.getuid()}" in message


def test_a_named_file_that_is_missing_or_bad_is_refused(tmp_path: Path) -> None:
    assert "cannot read" in refusal(tmp_path / "absent", ENVIRONMENT, tmp_path)
    assert "is not a file" in refusal(tmp_path, ENVIRONMENT, tmp_path)
    os.mkfifo(tmp_path / "fifo")
    assert "is not a file" in refusal(tmp_path / "fifo", ENVIRONMENT, tmp_path)
    no_profile = credentials_file(tmp_path / "credentials")
    assert "has no profile [ops]" in refusal(no_profile, {"AWS_PROFILE": "ops"}, tmp_path)
    half = credentials_file(tmp_path / "half", text="[default]\naws_access_key_id = K\n")
    assert "lacks aws_access_key_id or aws_secret_access_key" in refusal(half, {}, tmp_path)


def test_a_file_that_is_not_ini_is_refused_without_quoting_it(tmp_path: Path) -> None:
    """The INI parser quotes the line it cannot read: the message says the line number."""
    for text in (f"aws_secret_access_key = {SECRET}\n", f"[default]\n{SECRET}\n"):
        file = credentials_file(tmp_path / "credentials", text=text)
        message = refusal(file, {}, tmp_path)
        assert "is not an INI credentials file (line " in message


def test_the_environment_comes_next(tmp_path: Path) -> None:
    credentials_file(tmp_path / ".aws-credentials")
    environ = {**ENVIRONMENT, "AWS_SESSION_TOKEN": TOKEN}
    assert load_credentials(None, environ, tmp_path) == Credentials(
        "ENVKEY", "env-secret", TOKEN, "environment"
    )
    half = {"AWS_ACCESS_KEY_ID": "ENVKEY"}
    assert "without AWS_SECRET_ACCESS_KEY" in refusal(None, half, tmp_path)
    assert "without AWS_ACCESS_KEY_ID" in refusal(None, {"AWS_SECRET_ACCESS_KEY": "s"}, tmp_path)


def test_the_shared_file_comes_last(tmp_path: Path) -> None:
    """~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE names another), AWS_PROFILE's
    profile; as AWS's tools do, its mode is not checked."""
    (tmp_path / ".aws").mkdir()
    home_file = credentials_file(tmp_path / ".aws" / "credentials", 0o644)
    assert load_credentials(None, {}, tmp_path).source == f"{home_file} [default]"
    other = credentials_file(tmp_path / "other", 0o644)
    environ = {"AWS_SHARED_CREDENTIALS_FILE": str(other), "AWS_PROFILE": "team"}
    assert load_credentials(None, environ, tmp_path).source == f"{other} [team]"


def test_no_source_at_all_is_refused(tmp_path: Path) -> None:
    message = refusal(None, {}, tmp_path)
    assert "no credentials for the remote store" in message
    assert str(tmp_path / ".aws" / "credentials") in message


def test_the_secret_is_in_no_repr(tmp_path: Path) -> None:
    credentials = Credentials("AKID", SECRET, TOKEN, "test")
    store = S3Store("http://127.0.0.1:9", "bucket", credentials)
    for shown in (credentials, store, Signer(credentials, "us-east-1")):
        assert SECRET not in repr(shown)
        assert TOKEN not in repr(shown)
    assert "AKID" in repr(credentials)
