"""Who an engine's connection is: its session number, credentials, name and rights."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.serve.peercred import PeerCredentials


def tenant_of(uid: int) -> str:
    """The namespace prefix of the identities a peer of uid may name (see Peer.tenant)."""
    return f"uid:{uid}/"


@dataclass
class Peer:
    session: int
    credentials: PeerCredentials
    name: str = ""
    admin: bool = False  # the daemon's own uid or root: may evict
    # "" (the daemon's uid, root, or every peer when share_between_users): any identity; else
    # every identity the peer names has a namespace that starts with this (its hello reply
    # says so): its entries are its own, out of reach of other users' engines and of theirs.
    tenant: str = ""
