"""Tenants: an engine of another user (a member of the socket group) reaches only the identities
of its own user, under its tenant's namespace; the daemon's own user is not reachable by it."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
from daemon_e2e import IDENTITY, SETTLE_SECONDS, RawPeer, entry, put_stored
from daemon_process import Daemon, running_daemon
from identity_variants import variant
from kvd_client import Client
from kvd_client.link import DEFAULT_BACKOFF, Link
from kvd_protocol import Checkpoint, LayerSpec, TensorSpec
from kvd_protocol import messages as m
from kvd_protocol.tokens import pack_tokens
from other_user import GROUP, NOBODY, as_nobody

TENANT = f"uid:{NOBODY}/"
FLAGS = ["--socket-group", GROUP]
PROMPT = list(range(700, 764))
LONGER = [*PROMPT, *range(900, 964)]  # what would supersede PROMPT's entry


def _code(reply: m.Reply) -> str:
    return reply.code.value if isinstance(reply, m.ErrorReply) else reply.op


def _unconnected(daemon: Daemon) -> Client:
    link = Link(daemon.socket_path, SETTLE_SECONDS, "tenant", DEFAULT_BACKOFF, verify=True)
    return Client(link)


def _put(client: Client, tokens: list[int], seed: int) -> str:
    layers, tensors = entry(len(tokens), seed)
    return client.put_entry(IDENTITY, tokens, layers, tensors).wait(SETTLE_SECONDS).state


def test_a_tenant_cannot_read_replace_or_supersede_the_owners_entry(tmp_path: Path) -> None:
    with running_daemon(tmp_path, FLAGS) as daemon, Client.connect(daemon.socket_path) as owner:
        put_stored(owner, IDENTITY, PROMPT, seed=1)
        [owners] = owner.list_entries(IDENTITY)

        def trespass() -> dict[str, object]:
            seen: dict[str, object] = {}
            with RawPeer(daemon.socket_path, hello=False) as peer:
                hello = m.Hello(id=peer.next_id(), protocol=1, client="tenant", pid=os.getpid())
                told = peer.call(hello)
                assert isinstance(told, m.HelloReply)
                seen["tenant"] = told.tenant
                tokens = pack_tokens(LONGER)
                lookup = m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=tokens)
                seen["lookup"] = _code(peer.call(lookup))
                began = peer.try_begin(IDENTITY, LONGER, seed=2)
                seen["put_begin"] = _code(began) if isinstance(began, m.Reply) else "began"
                pages = [
                    m.ListEntries(id=peer.next_id(), identity=of, limit=9, after=None)
                    for of in (None, IDENTITY.digest())  # every identity; the owner's
                ]
                seen["list"] = [_code(peer.call(page)) for page in pages]
                verify = m.Verify(id=peer.next_id(), entry=owners.id, repair=False)
                seen["verify"] = _code(peer.call(verify))
            with Client.connect(daemon.socket_path, require=True) as client:
                # The same identity and a longer prompt, put by the engine library: under the
                # tenant, out of the owner's way.
                seen["put"] = _put(client, LONGER, seed=2)
                seen["listed"] = [e.tokens for e in client.list_entries(IDENTITY)]
                # A library that ignores the tenant (one that predates it) is refused, and
                # takes it as a failed put and a miss.
                server = client._link.server
                assert server is not None
                client._link.server = replace(server, tenant="")
                seen["unscoped_put"] = _put(client, LONGER, seed=3)
                seen["unscoped_miss"] = client.lookup(IDENTITY, LONGER) is None
                seen["misses"] = dict(client.stats.misses)
            return seen

        seen = as_nobody(trespass)
        assert seen == {
            "tenant": TENANT,
            "lookup": "permission_denied",
            "put_begin": "permission_denied",
            "list": ["permission_denied", "permission_denied"],
            "verify": "permission_denied",
            "put": "stored",
            "listed": [len(LONGER)],
            "unscoped_put": "failed",
            "unscoped_miss": True,
            "misses": {"refused": 1},
        }
        _assert_owners_alone(owner, owners)
        # The tenant's entry names its tenant in its header: a restart keeps it apart too.
        assert daemon.stop() == 0
        daemon.start()
        _assert_owners_alone(owner, owners)
        [tenants] = owner.list_entries(replace(IDENTITY, namespace=TENANT))
        assert tenants.tokens == len(LONGER)


def _assert_owners_alone(owner: Client, owners: m.EntrySummary) -> None:
    """The owner's lookup of the longer prompt gets the owner's entry, the only one under
    its identity."""
    hit = owner.lookup(IDENTITY, LONGER)
    assert hit is not None
    with hit:
        assert (hit.summary.id, hit.matched) == (owners.id, len(PROMPT))
        hit.verify()
    assert [e.id for e in owner.list_entries(IDENTITY)] == [owners.id]


def test_an_engine_of_another_user_restores_its_own_entries_unseen_by_the_owner(
    tmp_path: Path,
) -> None:
    with running_daemon(tmp_path, FLAGS) as daemon, Client.connect(daemon.socket_path) as owner:

        def engine() -> dict[str, object]:
            # Each call of a client made while the daemon was down (not connected) learns
            # the tenant first.
            with _unconnected(daemon) as putter:
                tensors = put_stored(putter, IDENTITY, PROMPT, seed=4)
            with _unconnected(daemon) as client:
                hit = client.lookup(IDENTITY, [*PROMPT, 1])
                assert hit is not None
                with hit:
                    hit.verify()
                    exact = [bytes(v) for v in hit.tensors] == [t.tobytes() for t in tensors]
                    named = hit.header.identity
                    seen = {"matched": hit.matched, "exact": exact, "namespace": named.namespace}
                # An identity read back from a header is under the tenant already.
                again = client.lookup(named, PROMPT)
                assert again is not None
                with again:
                    seen["again"] = again.summary.id == hit.summary.id
            return seen

        assert as_nobody(engine) == {
            "matched": len(PROMPT),
            "exact": True,
            "namespace": TENANT,
            "again": True,
        }
        assert owner.lookup(IDENTITY, [*PROMPT, 1]) is None
        assert owner.list_entries(IDENTITY) == []


def _put_checkpoint(client: Client, key: str) -> None:
    spec = TensorSpec("float32", (1, 2, len(PROMPT) + 1, 4))
    tensors = [np.ones(spec.shape, np.float32)] * 2
    checkpoint = Checkpoint(
        key=key,
        pending_token=5,
        seed=7,
        seed_explicit=False,
        prompt_tokens=len(PROMPT),
        generated_tokens=1,
    )
    layers = [LayerSpec("kv", (spec, spec), True)]
    ticket = client.put_entry(IDENTITY, [*PROMPT, 4], layers, tensors, checkpoint=checkpoint)
    assert ticket.wait(SETTLE_SECONDS).state == "stored"


def test_a_tenant_cannot_find_or_forget_the_owners_checkpoints(tmp_path: Path) -> None:
    with running_daemon(tmp_path, FLAGS) as daemon, Client.connect(daemon.socket_path) as owner:
        _put_checkpoint(owner, "gen-a")

        def forget() -> list[object]:
            with RawPeer(daemon.socket_path) as peer:
                raw = m.ForgetCheckpoint(id=peer.next_id(), identity=IDENTITY, key="gen-a")
                refused = _code(peer.call(raw))
            with Client.connect(daemon.socket_path, require=True) as client:
                found = client.find_checkpoint(IDENTITY, "gen-a", PROMPT)
                return [refused, found, client.forget_checkpoint(IDENTITY, "gen-a")]

        assert as_nobody(forget) == ["permission_denied", None, 0]
        found = owner.find_checkpoint(IDENTITY, "gen-a", PROMPT)
        assert found is not None
        found.release()
        assert owner.forget_checkpoint(IDENTITY, "gen-a") == 1


def test_users_share_identities_when_the_daemon_says_so(tmp_path: Path) -> None:
    flags = [*FLAGS, "--share-between-users", "true"]
    with running_daemon(tmp_path, flags) as daemon, Client.connect(daemon.socket_path) as owner:
        put_stored(owner, IDENTITY, PROMPT, seed=1)

        def share() -> list[object]:
            with Client.connect(daemon.socket_path, require=True) as client:
                server = client._link.server
                hit = client.lookup(IDENTITY, LONGER)
                assert server is not None
                assert hit is not None
                hit.release()
                return [server.tenant, hit.matched, _put(client, LONGER, seed=2)]

        assert as_nobody(share) == ["", len(PROMPT), "stored"]
        # The group member's longer entry superseded the owner's: one cache, shared.
        assert [e.tokens for e in owner.list_entries(IDENTITY)] == [len(LONGER)]


def test_a_tenants_miss_is_explained_by_its_own_identities_only(tmp_path: Path) -> None:
    """That another user's entries hold a prompt is that user's to know: the owner's entry
    under other KV bits explains the owner's miss, never the tenant's."""
    plain, quantised = variant("none"), variant("8bit-g64")
    with running_daemon(tmp_path, FLAGS) as daemon, Client.connect(daemon.socket_path) as owner:
        put_stored(owner, quantised, PROMPT, seed=1)

        def look_up() -> dict[str, object]:
            with Client.connect(daemon.socket_path, require=True) as client:
                assert client.lookup(plain, [*PROMPT, 1]) is None
                put_stored(client, quantised, PROMPT[:40], seed=2)
                assert client.lookup(plain, [*PROMPT, 1]) is None
                return dict(client.stats.misses)

        # Once no entry at all; then its own quantised entry holds 40 tokens of the prompt.
        assert as_nobody(look_up) == {"no entry": 1, "kv differs": 1}
        assert owner.lookup(plain, [*PROMPT, 1]) is None
        assert owner.stats.misses == {"kv differs": 1}
