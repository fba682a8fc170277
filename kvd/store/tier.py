"""The cold tier: the daemon's state, owned by its one event loop, in rooms and services.

The rooms, each with one job: the catalog (catalog.py: records, indexes, counts), eviction
(eviction.py: every rule of it; retention.py wraps its policy with the retention rule), the
writer (writer.py: the write-behind queue and its task), tickets (tickets.py), leases
(leases.py), the quarantine, the entry checks and adoption (adoption.py: files made behind the
daemon's back). The services are what other parts call, each on the rooms it needs: the puts
(puts.py), the reads (reads.py: lookups, checkpoints, leases and descriptors), administration
(admin.py: list, evict, verify, flush, status), the life cycle (life_cycle.py: open, settle,
snapshots, the periodic tasks, adopt, close), the tickets' waits, the read-only view
(tier_view.py) and the notices (notices.py: "stored" and "hit", which listeners subscribe
to). Tier builds and wires them; it answers nothing itself.
No locks: only the event loop touches this state; blocking file work (validation, fsync,
rename, scans) runs in worker threads via entry_files.

An entry's life: put_begin creates a staging file -> commit seals it and checks it whole,
indexes it (readable at once: read-your-writes) and queues it -> the writer syncs it and
renames it into place -> stored (durable). Or: refused at commit (bad data), dropped (queue
overflow, superseded, duplicate), failed (disk full), or abandoned (the putter went away
before commit).
"""

from __future__ import annotations

from kvd_protocol.limits import Limits

from kvd.config import Config
from kvd.store.admin import Admin
from kvd.store.admission import ADMISSION_POLICIES
from kvd.store.adoption import Adoption
from kvd.store.catalog import Catalog
from kvd.store.entry_checks import EntryChecks
from kvd.store.eviction import EVICTION_POLICIES, Eviction
from kvd.store.leases import Leases
from kvd.store.life_cycle import LifeCycle
from kvd.store.notices import Notices
from kvd.store.puts import Puts
from kvd.store.quarantine import Quarantine
from kvd.store.reads import Reads
from kvd.store.retention import Retaining
from kvd.store.telemetry import Telemetry
from kvd.store.tickets import Tickets
from kvd.store.tier_dir import TierDir
from kvd.store.tier_view import TierView
from kvd.store.writer import Writer


class Tier:
    """The tier directory and everything the daemon knows about it: its rooms (for the
    services and the tests of kvd/store) and its services (for the rest of the daemon)."""

    def __init__(self, config: Config, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        # --- the rooms
        self.dirs = TierDir(config.dir)
        # A lambda: the catalog is made next, with the eviction policy that reads the telemetry.
        self.telemetry = Telemetry(has_entries=lambda digest: self.catalog.holds(digest))  # noqa: PLW0108
        policy = EVICTION_POLICIES[config.eviction_policy](self.telemetry.prefill_cost)
        # A lambda: the view that names an identity's namespace is made after the catalog.
        self.retention = Retaining(
            policy,
            config.max_retention,
            lambda digest: self.view.namespace_of(digest),  # noqa: PLW0108
        )
        self.catalog = catalog = Catalog(self.dirs, self.retention)
        self.eviction = Eviction(catalog, config.max_bytes, config.min_free)
        self.quarantine = Quarantine(self.dirs, config.quarantine_max_bytes, catalog.counters)
        self.admission = ADMISSION_POLICIES[config.admission](
            config.admission_min_tokens, config.admission_window
        )
        self.leases = Leases(catalog)
        self.writer = Writer(
            config,
            catalog,
            eviction=self.eviction,
            tickets=(tickets := Tickets()),
            quarantine=self.quarantine,
            telemetry=self.telemetry,
            notices=(notices := Notices()),
        )
        self.checks = EntryChecks(catalog, self.quarantine, self.writer, limits)
        self.adoption = Adoption(catalog, self.writer, self.quarantine, limits)
        # --- the services
        self.tickets = tickets  # a put's ticket, waited for
        self.notices = notices  # whom stored entries and lookup hits are told of
        self.view = TierView(catalog, self.telemetry)
        self.puts = Puts(
            config,
            limits,
            catalog=catalog,
            eviction=self.eviction,
            writer=self.writer,
            tickets=tickets,
            admission=self.admission,
            telemetry=self.telemetry,
            retention=self.retention,
        )
        self.reads = Reads(
            config,
            catalog,
            leases=self.leases,
            quarantine=self.quarantine,
            writer=self.writer,
            checks=self.checks,
            telemetry=self.telemetry,
            admission=self.admission,
            notices=notices,
        )
        self.admin = Admin(
            config,
            catalog,
            eviction=self.eviction,
            writer=self.writer,
            checks=self.checks,
            puts=self.puts,
            leases=self.leases,
            telemetry=self.telemetry,
            tickets=tickets,
            admission=self.admission,
            retention=self.retention,
        )
        self.life = LifeCycle(
            config,
            limits,
            self.dirs,
            catalog,
            eviction=self.eviction,
            quarantine=self.quarantine,
            writer=self.writer,
            puts=self.puts,
            leases=self.leases,
            adoption=self.adoption,
            telemetry=self.telemetry,
        )
