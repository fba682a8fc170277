"""A get of a small entry in blocks through a real daemon: its block is read on the caller's
thread (no reader thread for so little), its lease's release is sent without waiting for the
answer and is done all the same (the daemon takes the connection's next request after it; a
close hears its answer), and a damaged block read this way is still refused."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from daemon_process import Daemon
from kvd_client.async_client import AsyncClient
from kvd_client.block_io import BlockReads
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol.blocks import BLOCK_SUFFIX
from kvd_protocol.entry_reader import parse_block_head
from tiny_models import prefill, prompt, tiny_llama

BLOCK = 16  # tokens per block: the smallest, so that a tiny prompt spans one block and a tail
IDENTITY = EngineIdentity("tiny/inline", "cfg", "tok")
TOKENS = prompt(BLOCK + 3)
SETTLE_SECONDS = 30.0  # also the clients' lookup_timeout: how long a close waits for releases


@contextmanager
def _stored(daemon: Daemon) -> Iterator[tuple[Client, Any]]:
    """A client that stored TOKENS' caches of a tiny model, in one block and a tail."""
    model = tiny_llama()
    with Client.connect(
        daemon.socket_path, require=True, block_tokens=BLOCK, lookup_timeout=SETTLE_SECONDS
    ) as client:
        ticket = client.put(IDENTITY, TOKENS, prefill(model, TOKENS))
        assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")
        yield client, model


def _read_on(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The threads every block of a get is read on, from now on."""
    threads: list[threading.Thread] = []
    read_block: Callable[..., None] = BlockReads.read_block

    def recorded(blocks: BlockReads, index: int, fd: int) -> None:
        threads.append(threading.current_thread())
        read_block(blocks, index, fd)

    monkeypatch.setattr(BlockReads, "read_block", recorded)
    return threads


def _status(daemon: Daemon) -> dict[str, Any]:
    """The daemon's status, asked on a connection of its own."""
    with Client.connect(daemon.socket_path, require=True) as other:
        return dict(other.status())


def _flip_a_bit(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 1]), offset)
    finally:
        os.close(fd)


def test_a_small_get_reads_its_block_on_the_callers_thread_and_its_lease_ends(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _stored(daemon) as (client, model):
        threads = _read_on(monkeypatch)
        restored = client.get(IDENTITY, [*TOKENS, 7], model=model)
        assert restored is not None
        assert restored.matched == len(TOKENS)
        assert threads == [threading.current_thread()]
        # Answered before the release was: its reply is still to be read...
        assert client._link.replies_due
        # ...and the daemon ended the lease before it took the next request.
        status = client.status()
        assert status["leased_entries"] == 0
        assert status["restores"] == 1
        assert not client._link.replies_due


def test_a_get_whose_caches_are_dropped_leaves_no_lease_once_the_client_closes(
    daemon: Daemon,
) -> None:
    with _stored(daemon) as (client, model):
        for _ in range(3):
            client.get(IDENTITY, [*TOKENS, 7], model=model)  # the caches dropped at once
        assert client._link.replies_due
        closing = time.monotonic()
    assert time.monotonic() - closing < SETTLE_SECONDS / 3  # the answer heard, not waited out
    assert client._link.connection is None
    status = _status(daemon)
    assert status["leased_entries"] == 0
    assert status["restores"] == 3  # every release, with its report, done before close returned


def test_a_damaged_block_read_inline_is_refused_and_reported(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _stored(daemon) as (client, model):
        [block] = sorted((daemon.tier / "entries").rglob(f"*{BLOCK_SUFFIX}"))
        head = parse_block_head(block.name, block.read_bytes(), block.stat().st_size)
        _flip_a_bit(block, head.slots[0].start + 3)  # of a key, as a failing disk would
        threads = _read_on(monkeypatch)
        assert client.get(IDENTITY, [*TOKENS, 7], model=model) is None
        assert threads == [threading.current_thread()]
        assert client.stats.misses == {"data_checksum": 1}
        assert client.stats.restored == 0
        assert client.status()["leased_entries"] == 0
        assert not block.exists()  # reported: the daemon checked the block and dropped it


def test_the_async_client_sends_the_release_and_hears_it_on_close(daemon: Daemon) -> None:
    with _stored(daemon) as (_, model):

        async def run() -> tuple[bool, bool]:
            client = await AsyncClient.connect(
                daemon.socket_path, require=True, block_tokens=BLOCK, lookup_timeout=SETTLE_SECONDS
            )
            restored = await client.get(IDENTITY, [*TOKENS, 7], model=model)
            sent = client._link.replies_due
            closing = time.monotonic()
            await client.close()
            heard = time.monotonic() - closing < SETTLE_SECONDS / 3  # not waited out
            return restored is not None and sent, heard and client._link.connection is None

        assert asyncio.run(run()) == (True, True)
        status = _status(daemon)
        assert status["leased_entries"] == 0
        assert status["restores"] == 1
