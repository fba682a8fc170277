"""kvctl's human output against a real daemon whose clients chose hostile names: every name a
client supplies (model id, namespace, fingerprints, codec, runtime, its own name) reaches the
operator's terminal with its control characters escaped, in status, watch, list, show, the
metrics and the errors."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import pytest
from daemon_e2e import put_stored
from daemon_process import Daemon, kvctl
from kvd_client import Client
from kvd_protocol.identity import Identity
from kvd_protocol.messages import EntrySummary

# A window title, a bell, a screen clear, a carriage return over what was printed, a
# backspace, a line break and a tab of its own, DEL, and an 8-bit CSI (C1) with its SGR.
HOSTILE = "\x1b]0;owned\x07\x1b[2J\rover\x08\nline\tcell\x7f\x9b31m"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what none of kvctl's own lines holds
ESCAPED = r"\x1b]0;owned\x07\x1b[2J\x0dover\x08\x0aline\x09cell\x7f\x9b31m"
MODEL = f"model{HOSTILE}"


def _identity(runtime: str, namespace: str = "") -> Identity:
    return Identity(
        model_id=MODEL,
        config_fingerprint=f"cfg{HOSTILE}",
        tokenizer_hash=f"tok{HOSTILE}",
        codec_id=f"codec{HOSTILE}",
        runtime=runtime,
        namespace=namespace,
    )


# Two identities of the hostile model: the name of one carries its namespace.
FIRST = _identity(f"mlx{HOSTILE}", namespace=f"team\x00{HOSTILE}")
SECOND = _identity("mlx/cpu")
FIRST_NAME = rf"model{ESCAPED},ns=team\x00{ESCAPED}"


@pytest.fixture
def hostile(daemon: Daemon) -> Iterator[Daemon]:
    """The daemon, holding an entry of each identity, while their client (named as
    hostilely) is connected."""
    with Client.connect(daemon.socket_path, name=f"engine{HOSTILE}", require=True) as client:
        for seed, identity in enumerate((FIRST, SECOND)):
            put_stored(client, identity, range(32), seed)
        yield daemon


def _human(result: subprocess.CompletedProcess[str]) -> str:
    """Everything kvctl wrote, asserted free of a control character other than its own line
    breaks; the escaped hostile text must be in it."""
    written = result.stdout + result.stderr
    assert RAW.search(written) is None, repr(written)
    return written


def test_status_list_and_show_escape_what_clients_named(hostile: Daemon) -> None:
    status = kvctl(hostile, "status")
    assert status.returncode == 0, status.stderr
    assert FIRST_NAME in _human(status)
    assert f"engine{ESCAPED}" in status.stdout  # the client's own name
    # Each identity is one row: a name's line break is escaped, never a row of its own.
    assert sum(line.startswith(f"model{ESCAPED}") for line in status.stdout.splitlines()) == 2
    listed = kvctl(hostile, "list")
    assert listed.returncode == 0, listed.stderr
    assert _human(listed).count(f"model{ESCAPED},ns=") == 2
    assert len(listed.stdout.splitlines()) == 3
    [entry] = [e for e in hostile_entries(hostile) if e.identity == FIRST.digest()]
    shown = kvctl(hostile, "show", entry.id)
    assert shown.returncode == 0, shown.stderr
    text = _human(shown)
    for field in ("config     cfg", "tokenizer  tok", "codec      codec", "runtime    mlx"):
        assert f"{field}{ESCAPED}" in text
    assert rf"namespace  team\x00{ESCAPED}" in text


def test_watch_metrics_and_errors_escape_what_clients_named(hostile: Daemon) -> None:
    watched = kvctl(hostile, "status", "--watch", "--interval", "0.1", "--count", "2")
    assert watched.returncode == 0, watched.stderr
    # Twice a refresh: its identity's row, and its client's (the models that client serves).
    assert _human(watched).count(FIRST_NAME) == 4
    metrics = kvctl(hostile, "metrics")
    assert metrics.returncode == 0, metrics.stderr
    # A label value: the escape's backslash is the exposition format's to escape in turn.
    assert "model" + ESCAPED.replace("\\", "\\\\") in _human(metrics)
    # The model id stands for both its identities: the error lists their names.
    ambiguous = kvctl(hostile, "list", "--identity", MODEL)
    assert ambiguous.returncode == 2
    assert _human(ambiguous).count(f"model{ESCAPED},ns=") == 2
    assert FIRST_NAME in ambiguous.stderr
    unknown = kvctl(hostile, "list", "--identity", f"nothing{HOSTILE}")
    assert unknown.returncode == 2
    assert "no identity is named" in _human(unknown)


def hostile_entries(daemon: Daemon) -> list[EntrySummary]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return [*client.list_entries(FIRST), *client.list_entries(SECOND)]
