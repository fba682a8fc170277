"""A tenant (an engine of another user) neither exports nor asks the presence of the daemon's
own user's entries: open_entry and presence are refused outside its tenant, and answered
inside it."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from daemon_e2e import IDENTITY, RawPeer, put_stored
from daemon_process import running_daemon
from kvd_client import Client
from kvd_protocol import messages as m
from kvd_protocol.tokens import pack_tokens
from other_user import GROUP, NOBODY, as_nobody

TENANT = f"uid:{NOBODY}/"
PROMPT = list(range(700, 764))


def _code(reply: m.Reply) -> str:
    return reply.code.value if isinstance(reply, m.ErrorReply) else reply.op


def test_a_tenant_cannot_export_or_ask_the_presence_of_the_owners_entries(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--socket-group", GROUP]) as daemon,
        Client.connect(daemon.socket_path) as owner,
    ):
        put_stored(owner, IDENTITY, PROMPT, seed=1)
        [owners] = owner.list_entries(IDENTITY)
        own = replace(IDENTITY, namespace=TENANT)

        def trespass() -> dict[str, str]:
            with Client.connect(daemon.socket_path, require=True) as client:
                put_stored(client, IDENTITY, PROMPT, seed=2)  # under its tenant
            tokens = pack_tokens([*PROMPT, 1])
            with RawPeer(daemon.socket_path) as peer:
                asked = {
                    "open_entry": m.OpenEntry(id=peer.next_id(), entry=owners.id),
                    "by_identity": m.Presence(
                        id=peer.next_id(), identity=IDENTITY, digest=None, tokens=tokens
                    ),
                    "by_digest": m.Presence(
                        id=peer.next_id(), identity=None, digest=IDENTITY.digest(), tokens=tokens
                    ),
                    "its_own": m.Presence(
                        id=peer.next_id(), identity=own, digest=None, tokens=tokens
                    ),
                }
                seen = {name: _code(peer.call(request)) for name, request in asked.items()}
            assert os.getuid() == NOBODY
            return seen

        assert as_nobody(trespass) == {
            "open_entry": "permission_denied",
            "by_identity": "permission_denied",
            "by_digest": "permission_denied",
            "its_own": "presence",
        }
        assert owner.presence(IDENTITY, [*PROMPT, 1]).matched == len(PROMPT)
