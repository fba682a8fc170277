"""The tier read without changing anything: its entries by id, the durable ones, an entry's
blocks, the identities it holds and the names the daemon learnt for them, a prompt's
presence. What the remote tier's uploads, a tenant's bounds, presence and the status read of
the tier."""

from __future__ import annotations

from collections.abc import Iterator

from kvd_protocol.identity import Identity

from kvd.store.blocks import Block
from kvd.store.catalog import Catalog
from kvd.store.presence import LocalPresence, local_presence
from kvd.store.records import EntryRecord
from kvd.store.telemetry import Telemetry


class TierView:
    """The catalog's and the telemetry's answers that change nothing."""

    def __init__(self, catalog: Catalog, telemetry: Telemetry) -> None:
        self._catalog = catalog
        self._telemetry = telemetry

    def __len__(self) -> int:
        """The entries in the tier, pending ones included."""
        return len(self._catalog)

    def entry(self, entry: str) -> EntryRecord | None:
        """The entry by id; None without such an entry."""
        return self._catalog.records.get(entry)

    def stored_entries(self) -> Iterator[EntryRecord]:
        """The durable entries (not those pending in the write-behind queue)."""
        return self._catalog.durable()

    def blocks_of(self, record: EntryRecord) -> tuple[Block, ...]:
        """The blocks an entry lists, in order (none for a v1 entry)."""
        return self._catalog.blocks_of(record)

    def holds(self, digest: str) -> bool:
        """Whether the tier holds an entry of the identity (pending ones included)."""
        return self._catalog.holds(digest)

    def identity_of(self, entry: str) -> str | None:
        """The digest of the identity of the entry by id; None without such an entry."""
        record = self._catalog.records.get(entry)
        return None if record is None else record.digest

    def namespace_of(self, digest: str) -> str | None:
        """The identity's namespace, as a request or an entry's header told; None if unknown."""
        names = self._telemetry.identities.get(digest)
        return None if names is None else names.namespace

    def presence(
        self, digest: str, identity: Identity | None, tokens: bytes, tenant: str
    ) -> LocalPresence:
        """What a lookup of tokens would restore now, counting nothing (see local_presence)."""
        return local_presence(
            self._catalog, self._telemetry, digest, identity, tokens, tenant=tenant
        )

    def known_identities(self) -> dict[str, Identity | None]:
        """Every identity the daemon knows, by digest, with what requests or headers said of
        it (None: nothing yet)."""
        return {digest: t.identity for digest, t in self._telemetry.identities.items()}
