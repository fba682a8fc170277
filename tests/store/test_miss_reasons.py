"""A lookup that finds nothing usable says why, against a real daemon: in its reply to a
client that asks (the engine library does, and logs it), in status (misses by reason per
identity), and never in a reply to a client that predates the reasons."""

from __future__ import annotations

import logging
import socket
from dataclasses import replace

import msgpack
import pytest
from daemon_e2e import SETTLE_SECONDS, RawPeer, put_stored, report
from daemon_process import Daemon
from identity_variants import variant
from kvd_client import Client
from kvd_protocol import messages as m
from kvd_protocol.framing import FrameReader, FrameWriter
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

PLAIN = variant("none")
STORED = list(range(100, 132))  # 32 tokens
PROMPT = [*STORED, 7, 8, 9]


def _explained(
    daemon: Daemon, identity: Identity, prompt: list[int], min_tokens: int = 0
) -> m.LookupReply:
    with RawPeer(daemon.socket_path) as peer:
        reply = peer.call(
            m.Lookup(
                id=peer.next_id(),
                identity=identity,
                tokens=pack_tokens(prompt),
                min_tokens=min_tokens,
                explain=True,
            )
        )
    assert isinstance(reply, m.LookupReply), reply
    assert reply.entry is None
    return reply


def _misses(daemon: Daemon, identity: Identity) -> dict[str, int]:
    with Client.connect(daemon.socket_path, require=True) as client:
        (mine,) = [i for i in report(client)["identities"] if i["identity"] == identity.digest()]
    return dict(mine["misses_by_reason"])


def test_an_identity_with_no_entry_is_told_so(daemon: Daemon) -> None:
    reply = _explained(daemon, PLAIN, PROMPT)
    assert reply.miss == "no entry"
    assert reply.detail == f"identity {PLAIN.digest()[:12]} ({PLAIN.model_id}) holds no entry"
    assert _misses(daemon, PLAIN) == {"no entry": 1}


@pytest.mark.parametrize(
    ("stored", "reason", "told"),
    [
        (variant("8bit-g64"), "kv differs", "kv 8bit-g64, not none"),
        (variant(template="99aa77bb"), "template differs", "template 99aa77bb, not 1a2b3c4d"),
        (variant(adapter="lora-5e6f7a8b"), "adapter differs", "adapter lora-5e6f7a8b, not none"),
        (
            variant(runtime="mlx-0.30.0/cpu:x86_64"),
            "runtime differs",
            "runtime mlx-0.30.0/cpu:x86_64, not mlx-0.29.1/cpu:x86_64",
        ),
    ],
    ids=["kv", "template", "adapter", "runtime"],
)
def test_entries_only_under_an_identity_that_differs_name_it_and_what_differs(
    daemon: Daemon, stored: Identity, reason: str, told: str
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, stored, STORED, 1)
    reply = _explained(daemon, PLAIN, PROMPT)
    assert reply.miss == reason
    assert reply.detail == (
        f"identity {stored.digest()[:12]} of the same model ({stored.model_id}) holds 32 tokens "
        f"of this 35-token prompt, this one ({PLAIN.digest()[:12]}) 0: they differ by {told}"
    )
    assert _misses(daemon, PLAIN) == {reason: 1}


def _engine_held(daemon: Daemon, identity: Identity) -> tuple[int, int]:
    """The identity's engine-held lookups, and the tier's."""
    with Client.connect(daemon.socket_path, require=True) as client:
        status = report(client)
    (mine,) = [i for i in status["identities"] if i["identity"] == identity.digest()]
    return mine["engine_held"], status["engine_held"]


def test_a_match_no_longer_than_the_engine_holds_is_engine_held_not_a_miss(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, PLAIN, STORED, 1)
    reply = _explained(daemon, PLAIN, PROMPT, min_tokens=33)
    assert reply.miss == "below min_tokens"
    assert reply.detail == (
        "the best entry holds 32 tokens of this 35-token prompt, no more than the 32 the "
        "engine holds"
    )
    assert _misses(daemon, PLAIN) == {}
    assert _engine_held(daemon, PLAIN) == (1, 1)


def test_no_entry_while_the_engine_holds_part_of_the_prompt_is_engine_held(
    daemon: Daemon,
) -> None:
    reply = _explained(daemon, PLAIN, PROMPT, min_tokens=2)  # the engine holds one token
    assert reply.miss == "below min_tokens"
    assert _misses(daemon, PLAIN) == {}
    assert _engine_held(daemon, PLAIN) == (1, 1)
    assert _explained(daemon, PLAIN, PROMPT, min_tokens=1).miss == "no entry"  # holds none
    assert _misses(daemon, PLAIN) == {"no entry": 1}
    assert _engine_held(daemon, PLAIN) == (1, 1)


def test_another_identity_holding_more_than_the_engine_is_a_miss_not_engine_held(
    daemon: Daemon,
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, variant("8bit-g64"), STORED, 1)
    assert _explained(daemon, PLAIN, PROMPT, min_tokens=10).miss == "kv differs"
    assert _misses(daemon, PLAIN) == {"kv differs": 1}
    assert _engine_held(daemon, PLAIN) == (0, 0)


def test_a_client_that_does_not_ask_gets_the_reply_of_before(daemon: Daemon) -> None:
    """The reply's map holds exactly the fields a client that predates the reasons decodes."""
    writer, reader = FrameWriter(DEFAULT_LIMITS.max_frame_bytes), FrameReader(1 << 20)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(SETTLE_SECONDS)
        sock.connect(daemon.socket_path)
        hello = m.Hello(id=1, protocol=1, client="old", pid=1)
        lookup = m.Lookup(id=2, identity=PLAIN, tokens=pack_tokens(PROMPT))
        sock.sendall(writer.frame(hello.to_wire()) + writer.frame(lookup.to_wire()))
        bodies: list[dict[str, object]] = []
        while len(bodies) < 2:
            reader.feed(sock.recv(1 << 16))
            while (frame := reader.next_frame()) is not None:
                bodies.append(msgpack.unpackb(frame))
    assert bodies[1] == {"op": "lookup", "id": 2, "matched": 0, "entry": None, "lease": None}
    assert _misses(daemon, PLAIN) == {"no entry": 1}  # counted all the same


def test_the_engine_library_counts_and_logs_the_daemons_reason(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, variant("8bit-g64"), STORED, 1)
        with caplog.at_level(logging.DEBUG, logger="kvd_client"):
            assert client.lookup(PLAIN, PROMPT) is None
        assert client.stats.misses == {"kv differs": 1}
    (line,) = [r.getMessage() for r in caplog.records if "missed" in r.getMessage()]
    assert line.startswith("lookup missed (kv differs): identity ")
    assert line.endswith("they differ by kv 8bit-g64, not none")


def test_a_client_sends_neither_traits_nor_explain_to_a_daemon_that_offers_neither(
    daemon: Daemon,
) -> None:
    """A daemon that predates them refuses a map with a field it does not know: the client
    leaves them out when the hello does not offer them (here, a hello with the features
    taken out, as an older daemon's would be)."""
    older = (m.IDENTITY_TRAITS_FEATURE, m.LOOKUP_MISS_FEATURE)
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, variant("8bit-g64"), STORED, 1)
        server = client._link.server
        assert server is not None
        kept = tuple(f for f in server.features if f not in older)
        client._link.server = replace(server, features=kept)
        assert client.lookup(PLAIN, PROMPT) is None
        assert client.stats.misses == {"no entry": 1}  # told no reason: counted as before
        (mine,) = [i for i in report(client)["identities"] if i["identity"] == PLAIN.digest()]
    assert mine["traits"] == ""  # the lookup named the identity without them
    # The daemon counts the reason all the same; with no traits of the asker to compare, by
    # the first field that differs: the config fingerprint, which hashes the KV bits.
    assert mine["misses_by_reason"] == {"config differs": 1}
