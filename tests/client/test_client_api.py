"""Client and AsyncClient stay one API: the same public members, with the same parameters
and docstrings, and each member they do not share a coroutine in the async one; and on a real
daemon, every operation of both gives the same results, of the types mypy gives them
(assert_type: `make lint` checks them)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, assert_type

import numpy as np
import pytest
from daemon_process import Daemon
from kvd_client.async_client import AsyncClient, AsyncLookupResult, AsyncTicket
from kvd_client.client import Client, LookupResult, Ticket
from kvd_client.identity import EngineIdentity
from kvd_client.prompt_cache import Restored
from kvd_client.results import Evicted, TicketState
from kvd_protocol.entry import LayerSpec, TensorSpec
from kvd_protocol.messages import EntrySummary
from tiny_models import prefill, prompt, tiny_llama

PAIRS = [(Client, AsyncClient), (Ticket, AsyncTicket), (LookupResult, AsyncLookupResult)]
ASYNC_NAMES = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
SETTLE_SECONDS = 30.0

IDENTITY = EngineIdentity("tiny/both-clients", "cfg", "tok")
WIRE = IDENTITY.to_protocol()
RAW_TOKENS = [9, 8, 7, 6, 5, 4, 3, 2]


def _public(cls: type) -> dict[str, Any]:
    """cls's public members by name, with blocks by their sync names, as a user reads them."""
    names = [name for name in dir(cls) if not name.startswith("_")]
    names += [name for name in (*ASYNC_NAMES, *ASYNC_NAMES.values()) if hasattr(cls, name)]
    by_sync_name = {value: key for key, value in ASYNC_NAMES.items()}
    return {by_sync_name.get(name, name): getattr(cls, name) for name in names}


@pytest.mark.parametrize(("blocking", "awaiting"), PAIRS, ids=lambda cls: cls.__name__)
def test_the_async_twin_has_every_member_alike(blocking: type, awaiting: type) -> None:
    sync_members, async_members = _public(blocking), _public(awaiting)
    assert sorted(async_members) == sorted(sync_members)
    for name, member in sync_members.items():
        twin = async_members[name]
        where = f"{awaiting.__name__}.{name}"
        assert isinstance(twin, property) == isinstance(member, property), where
        assert _same_doc(member, twin, f"As {blocking.__name__}.{name}"), where
        if twin is member or isinstance(member, property):
            continue  # written once, and it asks nothing of the daemon
        assert not inspect.iscoroutinefunction(member), f"{blocking.__name__}.{name}"
        assert inspect.iscoroutinefunction(twin), where
        sync_signature, async_signature = inspect.signature(member), inspect.signature(twin)
        assert list(async_signature.parameters.values()) == list(
            sync_signature.parameters.values()
        ), where
        returns = str(async_signature.return_annotation).replace("Async", "")
        assert returns == str(sync_signature.return_annotation), where


def _same_doc(member: object, twin: object, reference: str) -> bool:
    """Whether twin's docstring is member's, or one that begins by saying it is."""
    doc, twin_doc = inspect.getdoc(member), inspect.getdoc(twin)
    return twin_doc == doc or (doc is not None and (twin_doc or "").startswith(reference))


def _raw_entry() -> tuple[list[LayerSpec], list[np.ndarray]]:
    shape = (1, 2, len(RAW_TOKENS), 8)
    tensors = [np.full(shape, i, dtype=np.float16) for i in range(2)]
    spec = TensorSpec("float16", shape)
    return [LayerSpec("kv", (spec, spec), trimmable=True, meta={"offset": shape[2]})], tensors


def test_both_clients_run_every_operation_alike(daemon: Daemon) -> None:
    """The same operations in the same order, on a tier emptied before each client: the same
    results from both."""
    model = tiny_llama()
    tokens = prompt(24)
    cache = prefill(model, tokens)
    with Client.connect(daemon.socket_path, require=True) as client:
        blocking = _blocking_run(client, model, tokens, cache)
    awaiting = asyncio.run(_async_run(daemon.socket_path, model, tokens, cache))
    assert blocking == awaiting
    assert blocking[:3] == [TicketState("stored"), len(tokens), TicketState("stored")]


def _blocking_run(client: Client, model: Any, tokens: list[int], cache: list[Any]) -> list[Any]:
    assert_type(client.evict(all=True), Evicted)
    assert_type(client.ping(), float)
    ticket = assert_type(client.put(IDENTITY, tokens, cache), Ticket)
    seen: list[Any] = [assert_type(ticket.wait(SETTLE_SECONDS), TicketState)]
    restored = assert_type(client.get(IDENTITY, [*tokens, 1], model=model), Restored | None)
    seen.append(restored and restored.matched)
    layers, tensors = _raw_entry()
    raw = assert_type(client.put_entry(WIRE, RAW_TOKENS, layers, tensors), Ticket)
    seen.append(raw.wait(SETTLE_SECONDS))
    found = assert_type(client.lookup(WIRE, [*RAW_TOKENS, 1]), LookupResult | None)
    assert found is not None
    with found:
        seen.append([bytes(view) for view in found.tensors])
    assert_type(found.release(), None)
    seen.append(assert_type(client.find_checkpoint(WIRE, "key", tokens), LookupResult | None))
    seen.append(assert_type(client.get_checkpoint(IDENTITY, "key", tokens), Restored | None))
    seen.append(assert_type(client.forget_checkpoint(WIRE, "key"), int))
    assert_type(client.flush(SETTLE_SECONDS), bool)
    listed = assert_type(client.list_entries(WIRE), list[EntrySummary])
    seen.append(sorted(entry.tokens for entry in listed))
    status = assert_type(client.status(), dict[str, object])
    seen.append(sorted(status))
    seen.append(assert_type(client.evict(identity=WIRE.digest()), Evicted).entries)
    return seen


async def _async_run(
    socket_path: str, model: Any, tokens: list[int], cache: list[Any]
) -> list[Any]:
    client = assert_type(await AsyncClient.connect(socket_path, require=True), AsyncClient)
    async with client:
        assert_type(await client.evict(all=True), Evicted)
        assert_type(await client.ping(), float)
        ticket = assert_type(await client.put(IDENTITY, tokens, cache), AsyncTicket)
        seen: list[Any] = [assert_type(await ticket.wait(SETTLE_SECONDS), TicketState)]
        get = client.get(IDENTITY, [*tokens, 1], model=model)
        restored = assert_type(await get, Restored | None)
        seen.append(restored and restored.matched)
        layers, tensors = _raw_entry()
        put_entry = client.put_entry(WIRE, RAW_TOKENS, layers, tensors)
        raw = assert_type(await put_entry, AsyncTicket)
        seen.append(await raw.wait(SETTLE_SECONDS))
        lookup = client.lookup(WIRE, [*RAW_TOKENS, 1])
        found = assert_type(await lookup, AsyncLookupResult | None)
        assert found is not None
        async with found:
            seen.append([bytes(view) for view in found.tensors])
        assert_type(await found.release(), None)
        checkpoint = client.find_checkpoint(WIRE, "key", tokens)
        seen.append(assert_type(await checkpoint, AsyncLookupResult | None))
        restored_checkpoint = client.get_checkpoint(IDENTITY, "key", tokens)
        seen.append(assert_type(await restored_checkpoint, Restored | None))
        seen.append(assert_type(await client.forget_checkpoint(WIRE, "key"), int))
        assert_type(await client.flush(SETTLE_SECONDS), bool)
        listed = assert_type(await client.list_entries(WIRE), list[EntrySummary])
        seen.append(sorted(entry.tokens for entry in listed))
        status = assert_type(await client.status(), dict[str, object])
        seen.append(sorted(status))
        seen.append(assert_type(await client.evict(identity=WIRE.digest()), Evicted).entries)
        return seen
