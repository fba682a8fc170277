"""Presence: how much of a prompt the tier would restore now, and why no more, asking the
disk nothing and counting nothing: no hit, no miss, no lease, no admission sighting, no
place in the eviction order. A router in front of several daemons asks it of each
(docs/operations.md, "Asking where a prompt would hit").

What it answers is the lookup's own best match (the prefix index's, capped at the prompt's
length - 1), and the miss reason a lookup would give for going no further
(kvd.store.miss_reasons). A file found unreadable only by the lookup that opens it is the
one thing it cannot foresee.
"""

from __future__ import annotations

from typing import NamedTuple

from kvd_protocol.identity import Identity
from kvd_protocol.tokens import token_count

from kvd.identity_names import DIGEST_SHOWN
from kvd.store import miss_reasons
from kvd.store.catalog import Catalog
from kvd.store.miss_reasons import Miss
from kvd.store.telemetry import Telemetry


class LocalPresence(NamedTuple):
    matched: int  # the tokens a lookup would restore now
    entry: str | None  # from which entry (None: none)
    miss: Miss | None  # why no more; None when all but the prompt's last token would


def local_presence(
    catalog: Catalog,
    telemetry: Telemetry,
    digest: str,
    identity: Identity | None,
    tokens: bytes,
    *,
    tenant: str,
) -> LocalPresence:
    """What a lookup of tokens under the identity of digest would restore now (identity:
    the whole identity when the asker named it, else the one the tier knows of that digest,
    for the miss's reason)."""
    index = catalog.index(digest)
    match = index.best_match(tokens) if index is not None else None
    matched, entry = (match.matched, match.record.id) if match is not None else (0, None)
    if matched >= token_count(tokens) - 1:
        return LocalPresence(matched, entry, None)
    if identity is None:
        known = telemetry.identities.get(digest)
        identity = None if known is None else known.identity
    if identity is None:  # an identity the daemon never heard of: it holds nothing of it
        told = f"identity {digest[:DIGEST_SHOWN]} holds no entry"
        return LocalPresence(matched, entry, Miss(miss_reasons.NO_ENTRY, told))
    miss = miss_reasons.explain(
        catalog,
        telemetry,
        identity,
        tokens,
        reason=miss_reasons.NO_ENTRY,
        matched=matched,
        min_tokens=0,
        tenant=tenant,
    )
    return LocalPresence(matched, entry, miss)
