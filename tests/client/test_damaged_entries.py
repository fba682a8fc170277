"""Entry files damaged on disk behind a real daemon: truncated, grown, a header bit flipped,
a tensor bit flipped. The engine never restores them, never raises, never dies (a mapping read past
the end of a shrunk file would kill it with SIGBUS), counts each miss by its reason, and the
daemon, told of the damage, quarantines the file.

The damage is done as bit rot and a careless operator do it, out of the daemon's sight: through
a hard link outside the tier (the watcher sees no event for it), and once the daemon has
checked the file and handed out its descriptor (its own checks come first otherwise).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from daemon_process import Daemon
from kvd_client import prompt_cache
from kvd_client.async_client import AsyncClient
from kvd_client.calls import Call
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol.entry import PREFIX_BYTES
from kvd_protocol.entry_reader import parse_head
from tiny_models import prefill, prompt, tiny_llama

T = TypeVar("T")

SETTLE_SECONDS = 30.0
IDENTITY = EngineIdentity("tiny/llama", "cfg", "tok")
TOKENS = prompt(20)


def _stored_entry(daemon: Daemon, client: Client, model: Any) -> Path:
    """The caches of TOKENS[:-1] put and stored; the path of their entry file."""
    ticket = client.put(IDENTITY, TOKENS[:-1], prefill(model, TOKENS[:-1]))
    assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
    (entry,) = client.list_entries()
    return daemon.tier / "entries" / entry.identity / f"{entry.id}.kve"


def _unseen(path: Path, folder: Path) -> Path:
    """A hard link to path in folder: changes made through it raise no watcher event."""
    link = folder / path.name
    os.link(path, link)
    return link


def _damage(link: Path, damage: str) -> None:
    size = link.stat().st_size
    if damage in ("truncated", "grown"):
        os.truncate(link, size // 2 if damage == "truncated" else size + 4096)
        return
    if damage == "header bit":
        offset = PREFIX_BYTES + 3
    else:
        last = parse_head(link.name, link.read_bytes(), size).slots[-1]
        offset = last.start + last.nbytes // 2
    with link.open("r+b") as file:  # one bit, in place: same file, same size
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x10]))


def _after_first_step(call: Call[T], action: Callable[[], None]) -> Call[T]:
    """call, with action done once its first step (the lookup) is answered: the daemon has
    checked the entry and handed out its descriptor, and the engine has not read it yet."""
    result: object = yield next(call)
    action()
    error: Exception | None = None
    while True:
        try:
            step = call.send(result) if error is None else call.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        error = None
        try:
            result = yield step
        except Exception as exc:
            error = exc


def _get_damaged(client: Client, model: Any, link: Path, damage: str) -> Any:
    call = prompt_cache.get(client._link, IDENTITY, TOKENS, model=model)
    return client._run(_after_first_step(call, lambda: _damage(link, damage)))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncated", "truncated"),
        ("grown", "file_size"),
        ("header bit", "header_checksum"),
        ("data bit", "data_checksum"),
    ],
)
def test_a_damaged_entry_is_a_miss_by_reason_and_is_quarantined(
    daemon: Daemon, tmp_path: Path, damage: str, reason: str
) -> None:
    model = tiny_llama()
    with Client.connect(daemon.socket_path, require=True) as client:
        path = _stored_entry(daemon, client, model)
        assert _get_damaged(client, model, _unseen(path, tmp_path), damage) is None
        assert client.stats.misses == Counter({reason: 1})
        assert client.stats.rejected_entries == 1
        assert client.stats.restored == 0
        assert not path.exists()
        assert (daemon.tier / "quarantine" / path.name).exists()
        assert client.list_entries() == []
        assert client.status()["quarantined"] == 1
        assert client.status()["leased_entries"] == 0
        assert client.get(IDENTITY, TOKENS, model=model) is None  # gone for every engine
        assert client.stats.misses["no entry"] == 1


def test_a_flipped_data_bit_is_restored_only_without_verification(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = tiny_llama()
    with (
        Client.connect(daemon.socket_path, require=True) as client,
        Client.connect(daemon.socket_path, require=True, verify=False) as unchecked,
    ):
        path = _stored_entry(daemon, client, model)
        _damage(_unseen(path, tmp_path), "data bit")
        assert unchecked.get(IDENTITY, TOKENS, model=model) is not None
        assert client.get(IDENTITY, TOKENS, model=model) is None
        assert client.stats.misses == Counter({"data_checksum": 1})


def test_a_daemon_that_predates_damage_reports_gets_a_plain_release(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = tiny_llama()
    with Client.connect(daemon.socket_path, require=True) as client:
        path = _stored_entry(daemon, client, model)
        server = client._link.server
        assert server is not None
        # As a daemon without the feature: a release with damaged set would be a bad message.
        old = tuple(f for f in server.features if f != "release_damaged")
        client._link.server = replace(server, features=old)
        _damage(_unseen(path, tmp_path), "data bit")
        assert client.get(IDENTITY, TOKENS, model=model) is None
        assert client.stats.misses == Counter({"data_checksum": 1})
        assert path.exists()  # not told, nothing quarantined
        assert client.status()["leased_entries"] == 0  # the lease ended all the same
        assert client.stats.failed_lookups == 0


def test_the_async_client_counts_and_reports_damage_alike(daemon: Daemon, tmp_path: Path) -> None:
    model = tiny_llama()
    with Client.connect(daemon.socket_path, require=True) as client:
        path = _stored_entry(daemon, client, model)
    _damage(_unseen(path, tmp_path), "data bit")

    async def main() -> tuple[object, Counter[str]]:
        async with await AsyncClient.connect(daemon.socket_path, require=True) as engine:
            return await engine.get(IDENTITY, TOKENS, model=model), engine.stats.misses

    restored, misses = asyncio.run(main())
    assert restored is None
    assert misses == Counter({"data_checksum": 1})
    assert (daemon.tier / "quarantine" / path.name).exists()


def test_a_file_truncated_while_held_fails_cleanly_never_with_sigbus(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The raw layer holds the looked-up entry when the file shrinks under it: reading what
    is left raises, in a process that lives on."""
    model = tiny_llama()
    with Client.connect(daemon.socket_path, require=True) as client:
        link = _unseen(_stored_entry(daemon, client, model), tmp_path)
    script = textwrap.dedent(f"""
        import os
        from kvd_client.client import Client
        from kvd_client.identity import EngineIdentity
        from kvd_client.prompt_cache import decode
        from kvd_protocol.errors import EntryFormatError
        from tiny_models import prompt
        identity = EngineIdentity("tiny/llama", "cfg", "tok").to_protocol()
        with Client.connect({daemon.socket_path!r}, require=True) as client:
            result = client.lookup(identity, prompt(20))
            os.truncate({str(link)!r}, os.path.getsize({str(link)!r}) // 2)
            for attempt in (result.verify, lambda: decode(result.header, result.fills(), 19)):
                try:
                    attempt()
                except EntryFormatError as exc:
                    print(exc.rule.value)
            try:
                result.tensors
            except EntryFormatError as exc:
                print(exc.rule.value)
            result.release()
    """)
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=here,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["truncated", "truncated", "truncated"]
