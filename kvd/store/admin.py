"""The tier's administration: a page of the entries, eviction by request, a whole-file check
of one entry, a flush of the write-behind queue, and the status report's figures."""

from __future__ import annotations

import time
from typing import Any

from kvd_protocol.messages import EntrySummary

from kvd.config import Config
from kvd.store.admission import Admission
from kvd.store.catalog import Catalog
from kvd.store.entry_checks import EntryChecks
from kvd.store.eviction import Eviction
from kvd.store.leases import Leases
from kvd.store.puts import Puts
from kvd.store.records import summary
from kvd.store.retention import Retaining
from kvd.store.telemetry import Telemetry
from kvd.store.tickets import Tickets
from kvd.store.tier_report import tier_report
from kvd.store.writer import Writer


class Admin:
    """What kvctl asks of the tier (list, evict, verify, flush, status)."""

    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        *,
        eviction: Eviction,
        writer: Writer,
        checks: EntryChecks,
        puts: Puts,
        leases: Leases,
        telemetry: Telemetry,
        tickets: Tickets,
        admission: Admission,
        retention: Retaining,
    ) -> None:
        self._config = config
        self._catalog = catalog
        self._eviction = eviction
        self._writer = writer
        self._checks = checks
        self._puts = puts
        self._leases = leases
        self._telemetry = telemetry
        self._tickets = tickets
        self._admission = admission
        self._retention = retention
        self._started = time.time()

    def list_entries(
        self, digest: str | None, limit: int, after: str | None
    ) -> tuple[list[EntrySummary], bool]:
        """A page of entries ordered by id (stable across pages), at most limit of them."""
        records, more = self._catalog.page(digest, after, limit)
        return [summary(r) for r in records], more

    def evict(self, entry: str | None, digest: str | None, everything: bool) -> tuple[int, int]:
        """Remove entries by id, by identity (its digest) or all of them; (count, bytes).
        See kvd.store.eviction for which go."""
        return self._eviction.by_request(entry, digest, everything)

    async def verify(self, owner: int, entry: str, repair: bool) -> tuple[str | None, bool]:
        """Check one durable entry by id for owner's connection: see EntryChecks.verify."""
        return await self._checks.verify(owner, entry, repair)

    async def flush(self, timeout: float | None) -> tuple[bool, int]:
        """Wait until every put accepted so far is durable, within timeout seconds (None: no
        deadline): whether all are, and how many are not."""
        return await self._writer.flush(timeout)

    def report(self) -> dict[str, Any]:
        """The status report's figures of the tier (see tier_report)."""
        return tier_report(
            config=self._config,
            catalog=self._catalog,
            puts=self._puts.counts(),
            queue=self._writer.queue,
            telemetry=self._telemetry,
            leases=self._leases,
            checks=self._checks.counts(),
            tickets=self._tickets,
            admission=self._admission,
            retained=self._retention.retained_bytes(),
            started=self._started,
        )
