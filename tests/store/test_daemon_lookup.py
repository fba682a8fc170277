"""Lookup, supersession and skipped puts, end to end against a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

from daemon_e2e import (
    IDENTITY,
    OTHER_IDENTITY,
    SETTLE_SECONDS,
    RawPeer,
    entry,
    looked_up_tokens,
    put_stored,
    report,
)
from daemon_process import Daemon
from kvd_client.client import Client
from kvd_client.results import TicketState
from kvd_protocol import messages as m
from kvd_protocol.tokens import pack_tokens

BASE = list(range(100, 164))  # 64 tokens


def _listed_tokens(client: Client) -> list[int]:
    return sorted(e.tokens for e in client.list_entries(IDENTITY))


def test_a_lookup_right_after_commit_finds_the_pending_entry(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        layers, tensors = entry(len(BASE), seed=1)
        ticket = client.put_entry(IDENTITY, BASE, layers, tensors)
        assert ticket.state.state == "pending"  # answered at commit, before any write
        result = client.lookup(IDENTITY, [*BASE, 1])
        assert result is not None
        with result:
            assert result.matched == len(BASE)
            assert [bytes(v) for v in result.tensors] == [t.tobytes() for t in tensors]
            result.verify()
        assert ticket.wait(SETTLE_SECONDS) == TicketState("stored")


def test_a_stored_trimmable_descendant_supersedes_its_ancestors(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE[:16], seed=1)
        put_stored(client, IDENTITY, [*BASE[:8], 7, 7], seed=2)  # a sibling, not an ancestor
        assert _listed_tokens(client) == [10, 16]
        put_stored(client, IDENTITY, BASE[:32], seed=3)
        assert _listed_tokens(client) == [10, 32]
        put_stored(client, IDENTITY, BASE, seed=4)
        assert _listed_tokens(client) == [10, 64]
        status = report(client)
        assert status["entries"] == 2
        assert status["superseded"] == 2
        # The descendant serves the ancestors' prompts, trimmed.
        assert looked_up_tokens(client, IDENTITY, [*BASE[:16], 1]) == 64


def test_an_untrimmable_long_entry_neither_shadows_nor_supersedes_a_shorter_one(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE[:16], seed=1)
        put_stored(client, IDENTITY, BASE, seed=2, trimmable=False)
        assert _listed_tokens(client) == [16, 64]
        # The prompt leaves the long entry at token 40: only a trim could serve it.
        diverging = [*BASE[:40], 9, 9]
        result = client.lookup(IDENTITY, diverging)
        assert result is not None
        with result:
            assert result.header.token_count == 16
            assert result.matched == 16
        # The whole of it, plus one token, needs no trim: the long entry serves that.
        assert looked_up_tokens(client, IDENTITY, [*BASE, 1]) == 64


def test_a_match_is_capped_at_one_token_short_of_the_prompt(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE, seed=1)
        result = client.lookup(IDENTITY, BASE)  # the prompt is the entry itself
        assert result is not None
        with result:
            assert result.matched == len(BASE) - 1
        assert client.lookup(IDENTITY, BASE[:1]) is None  # nothing left to compute from


def test_an_untrimmable_entry_cannot_serve_its_own_prompt(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE, seed=1, trimmable=False)
        assert client.lookup(IDENTITY, BASE) is None  # the cap would need a trim


def test_an_exact_duplicate_put_is_skipped(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE, seed=1)
        layers, tensors = entry(len(BASE), seed=2)
        ticket = client.put_entry(IDENTITY, BASE, layers, tensors)
        assert ticket.state == TicketState("stored", "duplicate")
        assert report(client)["entries"] == 1
        # Another identity holds its own copy.
        put_stored(client, OTHER_IDENTITY, BASE, seed=3)
        assert report(client)["entries"] == 2


def test_a_put_covered_by_a_stored_trimmable_descendant_is_skipped(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE, seed=1)
        layers, tensors = entry(16, seed=2)
        ticket = client.put_entry(IDENTITY, BASE[:16], layers, tensors)
        assert ticket.state == TicketState("stored", "covered")
        assert _listed_tokens(client) == [64]
        # An untrimmable descendant covers nothing.
        put_stored(client, IDENTITY, [*BASE, 5, 5], seed=3, trimmable=False)
        put_stored(client, IDENTITY, [*BASE, 5], seed=4)
        assert _listed_tokens(client) == [65, 66]


def test_concurrent_client_processes_get_their_own_bytes(daemon: Daemon) -> None:
    """Four processes, two identities, puts and lookups interleaved; each checks every byte."""
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[3])
        from daemon_e2e import IDENTITY, OTHER_IDENTITY, SETTLE_SECONDS, entry
        from kvd_client.client import Client

        worker = int(sys.argv[2])
        identity = (IDENTITY, OTHER_IDENTITY)[worker % 2]
        with Client.connect(sys.argv[1], require=True) as client:
            for i in range(12):
                tokens = [worker * 1000 + i, *range(32 + i)]
                layers, tensors = entry(len(tokens), seed=worker * 100 + i)
                ticket = client.put_entry(identity, tokens, layers, tensors)
                assert ticket.state.state == "pending", ticket.state
                result = client.lookup(identity, [*tokens, 1])
                assert result is not None, ("miss", worker, i)
                with result:
                    assert result.matched == len(tokens)
                    assert [bytes(v) for v in result.tensors] == [t.tobytes() for t in tensors]
                    result.verify()
                assert ticket.wait(SETTLE_SECONDS).state == "stored"
            assert client.flush(SETTLE_SECONDS)
        """
    )
    here = str(Path(__file__).parents[1])
    workers = [
        subprocess.Popen([sys.executable, "-c", script, daemon.socket_path, str(w), here])
        for w in range(4)
    ]
    codes = [w.wait(120) for w in workers]
    assert codes == [0, 0, 0, 0]
    with Client.connect(daemon.socket_path, require=True) as client:
        assert len(client.list_entries(IDENTITY)) == 24
        assert len(client.list_entries(OTHER_IDENTITY)) == 24
        assert report(client)["entries"] == 48


def test_a_lookup_with_min_tokens_finds_nothing_when_the_best_match_is_shorter(
    daemon: Daemon,
) -> None:
    """Nothing the engine's memory did not hold already: engine-held, neither hit nor miss."""
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE[:32], seed=1)
        before = report(client)
        assert client.lookup(IDENTITY, [*BASE[:32], 1], min_tokens=33) is None
        after = report(client)
        assert (after["misses"], after["hits"], after["engine_held"]) == (
            before["misses"],
            before["hits"],
            before["engine_held"] + 1,
        )
        found = client.lookup(IDENTITY, [*BASE[:32], 1], min_tokens=32)
        assert found is not None
        with found:
            assert found.matched == 32


def test_min_tokens_is_applied_by_the_client_when_the_daemon_does_not_offer_it(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, IDENTITY, BASE[:32], seed=1)
        server = client._link.server
        assert server is not None
        # As a daemon that predates the feature: it answers the best match whatever its length.
        old = [f for f in server.features if f != "lookup_min_tokens"]
        client._link.server = replace(server, features=tuple(old))
        assert client.lookup(IDENTITY, [*BASE[:32], 1], min_tokens=33) is None
        assert report(client)["leased_entries"] == 0  # the unmapped answer: released
        found = client.lookup(IDENTITY, [*BASE[:32], 1], min_tokens=32)
        assert found is not None
        found.release()


def test_a_damage_report_the_file_does_not_bear_out_removes_nothing(daemon: Daemon) -> None:
    with (
        Client.connect(daemon.socket_path, require=True) as client,
        RawPeer(daemon.socket_path) as peer,
    ):
        put_stored(client, IDENTITY, BASE, seed=1)
        found = peer.call(m.Lookup(id=peer.next_id(), identity=IDENTITY, tokens=pack_tokens(BASE)))
        assert isinstance(found, m.LookupReply)
        assert found.lease is not None
        assert found.fd is not None
        os.close(found.fd)
        reply = peer.call(m.Release(id=peer.next_id(), lease=found.lease, damaged="data_checksum"))
        assert isinstance(reply, m.ReleaseReply)
        assert len(client.list_entries()) == 1  # the file is whole: a client's word is not enough
        assert report(client)["quarantined"] == 0
        assert report(client)["leased_entries"] == 0
        result = client.lookup(IDENTITY, BASE)
        assert result is not None
        result.release()
