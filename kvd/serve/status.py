"""The status report: what `kvctl status` shows and the status request answers.

The tier's figures are its own (Admin.report, kvd.store.tier_report); this adds the clients and
the daemon's process. It is strict JSON: a number that is not finite is reported as null.
A tenant (a peer of another user, see kvd.serve.peer) reads its own part of it: its
identities, named among themselves, its user's clients, and the tier's totals.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import psutil
from kvd_protocol.identity import Identity

from kvd import __version__, identity_names
from kvd.config import settings_of
from kvd.remote.remote import Remote
from kvd.serve.peer import SERVED_KEPT, Peer
from kvd.store.tier import Tier

_process = psutil.Process()


def status_report(
    tier: Tier, peers: Iterable[Peer], remote: Remote | None = None
) -> dict[str, Any]:
    """O(identities + peers): every figure is a count the tier keeps up as entries change.
    remote: the remote tier, when `remote` is set (its section is null otherwise)."""
    report: dict[str, Any] = finite(_report(tier, peers, remote))
    return report


def _report(tier: Tier, peers: Iterable[Peer], remote: Remote | None) -> dict[str, Any]:
    report = tier.admin.report()
    report["remote"] = None if remote is None else remote.status()
    report["clients"] = clients(peers)
    report["daemon"] |= {
        "settings": settings_of(tier.config),  # for kvctl doctor: the running daemon's
        "pid": os.getpid(),
        "rss_bytes": _process.memory_info().rss,
        "version": __version__,
    }
    return report


def clients(peers: Iterable[Peer]) -> list[dict[str, Any]]:
    """The client processes, each once by the name it gave (an engine holds two connections:
    its lookups' and its puts'): pid, uid, name, its connections, and the digests of the
    identities they named last (what it serves), the last named last."""
    found: dict[tuple[int, int, str], dict[str, Any]] = {}
    for peer in peers:
        key = (peer.credentials.pid, peer.credentials.uid, peer.name or _name(peer))
        client = found.get(key)
        if client is None:
            client = found[key] = {
                "pid": key[0],
                "uid": key[1],
                "name": key[2],
                "connections": 0,
                "identities": {},
            }
        client["connections"] += 1
        client["identities"].update(peer.served)
    for client in found.values():
        client["identities"] = list(client["identities"])[-SERVED_KEPT:]
    return list(found.values())


def tenant_report(
    report: Mapping[str, Any], peer: Peer, known: Mapping[str, Identity | None]
) -> dict[str, Any]:
    """What the tenant peer reads of the status report: of the identities, those under its
    tenant, each named as if the tier held no other user's (a name tells apart only what it
    is shown beside), and how many of its own the report left out; of the clients, its
    user's; every other figure (the tier's totals, the daemon's) as it is. known: every
    identity the daemon knows, by digest (the telemetry's)."""
    tenant = peer.tenant
    own = [i for i in report["identities"] if str(i.get("namespace") or "").startswith(tenant)]
    names = identity_names.names({i["identity"]: known.get(i["identity"]) for i in own})
    theirs = sum(1 for i in known.values() if i is not None and i.namespace.startswith(tenant))
    return {
        **report,
        "tenant": tenant,
        "identities": [{**i, "name": names[i["identity"]]} for i in own],
        "identities_left_out": max(0, theirs - len(own)),
        "clients": [c for c in report["clients"] if c.get("uid") == peer.credentials.uid],
    }


def finite(value: Any) -> Any:
    """value with every float that is not finite (inf, NaN) replaced by None: strict JSON.
    A report is mostly counts and names: those are taken as they are, without a call each
    (a status is asked for many times a second, on the event loop)."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: v if type(v) in _AS_THEY_ARE else finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [v if type(v) in _AS_THEY_ARE else finite(v) for v in value]
    return value


_AS_THEY_ARE = frozenset({int, str, bool, type(None)})  # finite's values never changed


def _name(peer: Peer) -> str:
    """The client's process name, when it did not say (psutil may be denied on macOS)."""
    try:
        return str(psutil.Process(peer.credentials.pid).name())
    except (psutil.Error, OSError):
        return ""
