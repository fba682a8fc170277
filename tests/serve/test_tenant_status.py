"""What a tenant (a peer of another user, in socket_group) reads of the status: its own
identities, named among themselves, its own user's clients and the tier's totals; never
another user's model ids, names, digests, counts or processes. Through kvctl as that user
(status, --json, list, metrics), against a real daemon; the owner still reads everything."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

from daemon_e2e import IDENTITY, OTHER_IDENTITY, put_stored
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client import Client
from other_user import GROUP, NOBODY, as_nobody

from kvd.ops import kvctl as kvctl_main

TENANT = f"uid:{NOBODY}/"
OWNERS_CLIENT = "owner-engine"
TENANTS_CLIENT = "tenant-engine"


def _kvctl_here(daemon: Daemon, *args: str) -> dict[str, Any]:
    """kvctl run in this process (as whichever user it is): its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvctl_main.main(["--socket", daemon.socket_path, *args])
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def test_a_tenant_reads_its_own_identities_clients_and_the_tiers_totals(tmp_path: Path) -> None:
    with (
        running_daemon(tmp_path, ["--socket-group", GROUP]) as daemon,
        Client.connect(daemon.socket_path, name=OWNERS_CLIENT, require=True) as owner,
    ):
        # The owner's: the model the tenant serves too, and one of its own.
        put_stored(owner, IDENTITY, range(32), seed=1)
        put_stored(owner, OTHER_IDENTITY, range(32), seed=2)

        def tenants_view() -> dict[str, Any]:
            os.environ["HOME"] = os.environ["XDG_CONFIG_HOME"] = "/nonexistent"  # not root's
            with Client.connect(daemon.socket_path, name=TENANTS_CLIENT, require=True) as own:
                put_stored(own, IDENTITY, range(64), seed=3)  # under its tenant
                return {
                    args[0] + (args[1] if len(args) > 1 else ""): _kvctl_here(daemon, *args)
                    for args in (("status", "--json"), ("status",), ("list",), ("metrics",))
                }

        seen = as_nobody(tenants_view)
        status = json.loads(seen["status--json"]["out"])
        [mine] = status["identities"]
        tenants_digest = mine["identity"]
        # Its identity, named as if no other user's were beside it.
        assert (mine["namespace"], mine["name"], mine["entries"]) == (TENANT, IDENTITY.model_id, 1)
        assert status["identities_left_out"] == 0
        assert status["tenant"] == TENANT
        # Its user's processes: its engine and kvctl (this process), none of the owner's.
        assert {c["name"] for c in status["clients"]} == {TENANTS_CLIENT, "kvctl"}
        assert {c["uid"] for c in status["clients"]} == {NOBODY}
        # The tier's totals: every user's entries.
        assert (status["entries"], status["writeback"]["stored"]) == (3, 3)
        owners = (IDENTITY.digest(), OTHER_IDENTITY.digest(), OTHER_IDENTITY.model_id)
        for shown in seen.values():
            assert shown["code"] == 0, shown["err"]
            for secret in (*owners, OWNERS_CLIENT, ",ns="):
                assert secret not in shown["out"], (secret, shown["out"])
        assert tenants_digest in seen["metrics"]["out"]
        assert tenants_digest[:12] in seen["status"]["out"]
        assert "3 in the tier; 1 identities of yours" in seen["status"]["out"]
        assert len(seen["list"]["out"].splitlines()) == 2  # its one entry, listed
        # The owner reads every identity and every client.
        everything = json.loads(kvctl(daemon, "status", "--json").stdout)
        listed = {i["identity"] for i in everything["identities"]}
        assert listed == {IDENTITY.digest(), OTHER_IDENTITY.digest(), tenants_digest}
        assert OWNERS_CLIENT in {c["name"] for c in everything["clients"]}
        assert "tenant" not in everything
