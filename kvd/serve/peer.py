"""Who an engine's connection is: its session number, credentials, name and rights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kvd.serve.peercred import PeerCredentials

SERVED_KEPT: Final = 4  # identities a connection named last, kept to say what it serves


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
    # The digests of the identities its lookups and puts named, the last named last.
    served: dict[str, None] = field(default_factory=dict)

    def named(self, digest: str) -> None:
        """A lookup or put named the identity of digest (SERVED_KEPT are kept)."""
        if digest in self.served:
            if next(reversed(self.served)) == digest:  # the usual: the same as before
                return
            del self.served[digest]
        self.served[digest] = None
        if len(self.served) > SERVED_KEPT:
            del self.served[next(iter(self.served))]
