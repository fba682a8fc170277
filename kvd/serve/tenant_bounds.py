"""A tenant's bounds: a peer of another user names only identities under its tenant (see
kvd.serve.peer); a request that reaches beyond is refused, logged at most every so often."""

from __future__ import annotations

from kvd_protocol import messages as m
from kvd_protocol.errors import ErrorCode, ProtocolError
from kvd_protocol.identity import Identity

from kvd.logs import RateLimited, get_logger
from kvd.serve.peer import Peer
from kvd.store.tier_view import TierView

broken_rules = RateLimited(get_logger("kvd.serve.tenant_bounds"))


def check_identity(peer: Peer, request: m.Request, identity: Identity) -> None:
    """PERMISSION_DENIED unless identity is under the peer's tenant."""
    if not identity.namespace.startswith(peer.tenant):
        raise refused(peer, request, f"namespace {identity.namespace!r}")


def check_digest(view: TierView, peer: Peer, request: m.Request, digest: str) -> None:
    """PERMISSION_DENIED unless the identity of digest is under the peer's tenant, as its
    names say (learnt from a request naming it, or from an entry's header at start). One
    without entries shows nothing: it passes. One whose names are unknown does not."""
    if not view.holds(digest):
        return
    namespace = view.namespace_of(digest)
    if namespace is None:
        raise refused(peer, request, f"identity {digest}, whose namespace kvd does not know")
    if not namespace.startswith(peer.tenant):
        raise refused(peer, request, f"identity {digest} (namespace {namespace!r})")


def refused(
    peer: Peer, request: m.Request, named: str, instead: str = "name identities under it"
) -> ProtocolError:
    """A request of a tenant's that reaches beyond it: logged (rate-limited) and told."""
    broken_rules.warning(
        "identity_not_the_tenants",
        session=peer.session,
        uid=peer.credentials.uid,
        op=request.op,
        tenant=peer.tenant,
    )
    return ProtocolError(
        ErrorCode.PERMISSION_DENIED,
        f"{request.op}: {named} is not under this connection's tenant {peer.tenant!r} "
        f"(uid {peer.credentials.uid}, the hello reply's tenant): {instead}",
    )
