"""Where the bucket's credentials come from, which files are refused, and that a secret never
shows in a repr or an error."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kvd.remote.bucket import Bucket
from kvd.remote.credential_process import OUTPUT_LIMIT, PROCESS_TIMEOUT_S, run_process
from kvd.remote.credential_source import (
    AGAIN_S,
    REFRESH_BEFORE_S,
    CredentialSource,
    load_credentials,
)
from kvd.remote.credentials import Credentials, CredentialsError
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
    assert "no credentials for the remote bucket" in message
    assert str(tmp_path / ".aws" / "credentials") in message


def test_the_secret_is_in_no_repr(tmp_path: Path) -> None:
    credentials = Credentials("AKID", SECRET, TOKEN, "test")
    bucket = Bucket("http://127.0.0.1:9", "bucket", credentials)
    for shown in (credentials, bucket, Signer(credentials, "us-east-1")):
        assert SECRET not in repr(shown)
        assert TOKEN not in repr(shown)
    assert "AKID" in repr(credentials)


# --- credential_process -------------------------------------------------------------------------


def helper(folder: Path, body: str) -> list[str]:
    """A credential_process of its own: a Python script of body."""
    script = folder / "helper.py"
    script.write_text(f"import json, sys, time\n{body}\n")
    return [sys.executable, str(script)]


def issued(key: str = "AKPROC", expiration: str = "2030-01-01T00:00:00Z", **more: object) -> str:
    return json.dumps(
        {
            "Version": 1,
            "AccessKeyId": key,
            "SecretAccessKey": SECRET,
            "SessionToken": TOKEN,
            "Expiration": expiration,
            **more,
        }
    )


def process_refusal(argv: list[str], timeout: float = PROCESS_TIMEOUT_S) -> str:
    with pytest.raises(CredentialsError) as raised:
        run_process(argv, "test", timeout=timeout)
    message = str(raised.value)
    assert SECRET not in message
    assert TOKEN not in message
    return message


def test_a_process_gives_credentials_with_their_expiration(tmp_path: Path) -> None:
    found = run_process(helper(tmp_path, f"print({issued()!r})"), "cfg [default]")
    assert (found.access_key, found.secret_key, found.session_token) == ("AKPROC", SECRET, TOKEN)
    assert found.expires == datetime(2030, 1, 1, tzinfo=UTC).timestamp()
    assert found.source == f"credential_process {Path(sys.executable).name} (cfg [default])"
    plain = json.dumps({"Version": 1, "AccessKeyId": "K", "SecretAccessKey": "s"})
    assert run_process(helper(tmp_path, f"print({plain!r})"), "x").expires is None


def test_a_process_that_fails_is_refused_with_its_last_stderr_line(tmp_path: Path) -> None:
    argv = helper(
        tmp_path,
        "print('a', file=sys.stderr); print('token expired', file=sys.stderr); sys.exit(2)",
    )
    message = process_refusal(argv)
    assert message.endswith("exited with status 2: token expired")
    assert "cannot run: No such file or directory" in process_refusal([str(tmp_path / "absent")])


@pytest.mark.parametrize(
    ("output", "said"),
    [
        (f"'{SECRET} not json'", "wrote something other than JSON"),
        ("'[1]'", "JSON that is not an object"),
        (repr(issued(Version=2)), "wrote Version 2, not 1"),
        (repr(json.dumps({"Version": 1, "SecretAccessKey": SECRET})), "no AccessKeyId"),
        (repr(issued(expiration="tomorrow")), "Expiration that is not ISO 8601"),
        (repr(issued(expiration="2030-01-01T00:00:00")), "Expiration without a time zone"),
        (repr(issued(key=7)), "AccessKeyId that is not a string"),  # type: ignore[arg-type]
    ],
)
def test_a_process_output_that_is_not_credentials_is_refused_unquoted(
    tmp_path: Path, output: str, said: str
) -> None:
    assert said in process_refusal(helper(tmp_path, f"print({output})"))


def test_a_process_is_bounded_in_time_and_output(tmp_path: Path) -> None:
    began = time.monotonic()
    slow = helper(tmp_path, "time.sleep(30)")
    assert "gave no answer within 0.5 s" in process_refusal(slow, timeout=0.5)
    assert time.monotonic() - began < 10
    chatty = helper(tmp_path, f"sys.stdout.write('x' * {2 * OUTPUT_LIMIT}); time.sleep(30)")
    assert f"wrote more than {OUTPUT_LIMIT} bytes" in process_refusal(chatty)
    assert time.monotonic() - began < 20, "killed at the limit, not waited for"


def test_the_config_file_names_the_process_of_the_profile(tmp_path: Path) -> None:
    (tmp_path / ".aws").mkdir()
    argv = helper(tmp_path, f"print({issued(key='FROMCFG')!r})")
    (tmp_path / ".aws" / "config").write_text(
        f"[default]\nregion = x\n\n[profile ops]\ncredential_process = {argv[0]} '{argv[1]}'\n"
    )
    assert load_credentials(None, {"AWS_PROFILE": "ops"}, tmp_path).access_key == "FROMCFG"
    assert "no credentials for the remote bucket" in refusal(None, {}, tmp_path)
    other = tmp_path / "other-config"
    other.write_text(f"[default]\ncredential_process = {argv[0]} {argv[1]}\n")
    environ = {"AWS_CONFIG_FILE": str(other)}
    assert load_credentials(None, environ, tmp_path).access_key == "FROMCFG"
    credentials_file(tmp_path / ".aws" / "credentials", 0o644)  # its [default] comes first
    assert load_credentials(None, environ, tmp_path).access_key == "FILEKEY"
    team = {"AWS_CONFIG_FILE": str(other), "AWS_PROFILE": "nobody"}
    assert "has no profile [nobody]" in refusal(None, team, tmp_path)


# --- reading again ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_source_reads_a_changed_file_again_at_most_every_second(tmp_path: Path) -> None:
    file = credentials_file(tmp_path / "credentials")
    clock = Clock()
    source = CredentialSource(file, {}, tmp_path, clock=clock)
    first = source.current()
    assert source.current() is first
    credentials_file(file, text="[default]\naws_access_key_id = NEW\naws_secret_access_key = n\n")
    assert source.changed()
    assert source.current() is first, "looked at within the second"
    clock.now += AGAIN_S
    assert source.current().access_key == "NEW"
    assert not source.changed()


def test_a_refusal_reads_again_once_for_the_requests_refused_together(tmp_path: Path) -> None:
    file = credentials_file(tmp_path / "credentials")
    clock = Clock()
    source = CredentialSource(file, {}, tmp_path, clock=clock)
    first = source.current()
    signed_at = clock.now
    assert not source.renew(first, signed_at), "the same credentials: nothing new to try"
    os.utime(file, ns=(1, 1))  # the file unchanged as far as a look can tell
    credentials_file(file, text="[default]\naws_access_key_id = NEW\naws_secret_access_key = n\n")
    os.utime(file, ns=(1, 1))
    clock.now += 0.1
    refused_later = source.current()
    assert refused_later is first
    assert source.renew(first, clock.now), "read again at once: other credentials"
    assert source.current().access_key == "NEW"
    assert source.renew(first, clock.now - 0.05), "read since: the new ones, not read again"


def test_expiring_credentials_are_read_again_before_they_expire(tmp_path: Path) -> None:
    clock, wall = Clock(), Clock()
    runs = tmp_path / "runs"
    body = (
        f"runs = open({str(runs)!r}, 'a'); runs.write('x'); runs.close()\n"
        "expires = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(float(sys.argv[1])))\n"
        "print(json.dumps({'Version': 1, 'AccessKeyId': 'K', 'SecretAccessKey': 's', "
        "'Expiration': expires}))"
    )
    argv = helper(tmp_path, body)
    config = tmp_path / "config"
    life = 3600.0
    wall.now = time.time()
    config.write_text(f"[default]\ncredential_process = {argv[0]} {argv[1]} {wall.now + life}\n")
    source = CredentialSource(
        None, {"AWS_CONFIG_FILE": str(config)}, tmp_path, clock=clock, wall=wall
    )
    first = source.current()
    assert first.expires is not None
    clock.now += 10
    wall.now = first.expires - REFRESH_BEFORE_S - 1
    assert source.current() is first
    wall.now += 2
    source.current()
    assert runs.read_text() == "xx", "run again within REFRESH_BEFORE_S of the expiry"
