"""What the tier holds: every entry's record, the indexes that find them, and their counts.

The catalog is the one place an entry joins (add) and leaves (drop) the tier; every index and
count follows in the same step, so queries (status, a list page) read them instead of walking
the records. Prompt entries live in a PrefixIndex per identity, generation checkpoints apart,
by (identity, key). An entry dropped while leased is kept as doomed until its last lease ends,
its bytes still counted. A v2 entry (a manifest) lists shared blocks (blocks.py): it keeps
their refs from add until its file goes, so the blocks of a leased manifest stay too. The
tier's bytes are its manifests and its unique blocks; eviction (eviction.py has its rules)
removes manifests with drop(), the blocks they alone listed go with them, and drop() says the
bytes really freed. Synchronous, owned by the event loop: the only file work here is opening
an entry to serve and handing one that left to the deleter (moved out of its place now,
unlinked off the loop).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from types import MappingProxyType

from kvd_protocol.errors import EntryFormatError

from kvd.logs import get_logger
from kvd.store import entry_files
from kvd.store.blocks import Block, BlockStore
from kvd.store.counters import Counters
from kvd.store.deleter import Deleter
from kvd.store.durability import disk_free
from kvd.store.eviction import EvictionPolicy
from kvd.store.id_order import IdOrder
from kvd.store.prefix_index import PrefixIndex
from kvd.store.records import EntryRecord
from kvd.store.tier_dir import TierDir

log = get_logger("kvd.store.catalog")


@dataclass
class IdentityCounts:
    """One identity's share of the tier: its entries (not doomed ones), their manifest files'
    bytes, their ids in order; and of those, its prefill checkpoints and their files' bytes
    (the blocks they share are counted with the blocks)."""

    entries: int = 0
    bytes: int = 0
    ids: IdOrder = field(default_factory=IdOrder)
    prefill_checkpoints: int = 0
    prefill_checkpoint_bytes: int = 0

    def count(self, record: EntryRecord, sign: int) -> None:
        """Count one entry in (sign 1) or out (-1)."""
        self.entries += sign
        self.bytes += sign * record.nbytes
        if record.prefill_checkpoint:
            self.prefill_checkpoints += sign
            self.prefill_checkpoint_bytes += sign * record.nbytes


class Catalog:
    """Every entry of the tier, indexed per identity, with its counts kept as it comes and goes."""

    def __init__(self, dirs: TierDir, policy: EvictionPolicy) -> None:
        self.dirs = dirs
        self.policy = policy  # the eviction order
        self._records: dict[str, EntryRecord] = {}
        # Entries whose file is not at its place under entries/ (pending ones: in staging).
        self._staged: dict[str, Path] = {}
        self._indexes: dict[str, PrefixIndex] = {}  # identity digest -> its prompt index
        # Generation checkpoints by (identity, key), oldest first: apart from prompt lookups.
        self._checkpoints: dict[tuple[str, str], list[EntryRecord]] = {}
        self._doomed: dict[str, EntryRecord] = {}  # out of the indexes, still leased
        self._identities: dict[str, IdentityCounts] = {}
        self._ids = IdOrder()
        self._clock = itertools.count(1)
        self.deleter = Deleter(dirs.deleting)  # unlinks off the event loop
        self.block_store = BlockStore(self.deleter)
        self._blocks_of: dict[str, tuple[Block, ...]] = {}  # entry id -> the blocks it keeps
        self.manifest_bytes = 0  # every entry file the tier holds: pending, stored, doomed
        # What those entries would take without shared blocks: each its manifest and blocks.
        self.logical_bytes = 0
        self.leased = 0  # entries (doomed ones included) with at least one lease
        # What eviction cannot free while leases last: the files of those entries and the
        # blocks they list, each block once however many leased entries list it.
        self.leased_bytes = 0
        self._leased_blocks: dict[Block, int] = {}  # block -> leased entries listing it
        # Until start-up has listed the directory: the mtime the snapshot recorded for an
        # entry taken from it unchecked (None: not one of those), compared when it is opened.
        self._recorded_mtime: Callable[[str], int | None] | None = None
        self._disowned: set[str] = set()  # doomed entries whose file is no longer theirs
        self.version = 0  # bumped by every change to the set of entries or their durability
        self.counters = Counters()

    # --- read-only queries ----------------------------------------------------------------

    @property
    def records(self) -> Mapping[str, EntryRecord]:
        """The entries the tier serves, by id (doomed ones not included)."""
        return MappingProxyType(self._records)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def total_bytes(self) -> int:
        """What the tier holds on disk, the byte cap's measure: entry files and unique blocks."""
        return self.manifest_bytes + self.block_store.bytes

    def blocks_of(self, record: EntryRecord) -> tuple[Block, ...]:
        """The blocks an entry lists, in order (none for a v1 entry)."""
        return self._blocks_of.get(record.id, ())

    def listing(self, block: Block) -> list[EntryRecord]:
        """The indexed entries that list a block: a walk of its identity's entries, none for
        a block with no ref, and ending once its refs are found (a folder of blocks removed
        at once costs about one walk, as the first blocks' manifests take the others' refs)."""
        found: list[EntryRecord] = []
        counts = self._identities.get(block.digest)
        if not block.refs or counts is None:
            return found
        for entry_id in counts.ids.after(None):
            record = self._records[entry_id]
            if block in self.blocks_of(record):
                found.append(record)
                if len(found) == block.refs:
                    break
        return found

    def is_doomed(self, entry_id: str) -> bool:
        """Out of the index but kept on disk until its last lease ends."""
        return entry_id in self._doomed

    def index(self, digest: str) -> PrefixIndex | None:
        """The prompt index of an identity; None when it holds no prompt entry."""
        return self._indexes.get(digest)

    def checkpoints(self, digest: str, key: str) -> Sequence[EntryRecord]:
        """The checkpoints of one generation of an identity, oldest first."""
        return tuple(self._checkpoints.get((digest, key), ()))

    def holds(self, digest: str) -> bool:
        """Whether the identity has entries (not doomed ones)."""
        return digest in self._identities

    def identities(self) -> list[tuple[str, IdentityCounts]]:
        """Each identity with entries, by digest: O(identities)."""
        return sorted(self._identities.items())

    def page(
        self, digest: str | None, after: str | None, limit: int
    ) -> tuple[list[EntryRecord], bool]:
        """Up to limit entries (of one identity, or all) with ids after `after`, in id order;
        and whether more follow. Costs the page and a bisection, not the tier."""
        if digest is None:
            order = self._ids
        else:
            counts = self._identities.get(digest)
            if counts is None:
                return [], False
            order = counts.ids
        ids = order.after(after)
        chosen = [self._records[i] for i in itertools.islice(ids, limit)]
        return chosen, next(ids, None) is not None

    def an_entry(self, digest: str) -> EntryRecord | None:
        """One entry of an identity, the quickest found: a start-up reads one header of each
        for its names, before the first list page has sorted the ids."""
        index = self._indexes.get(digest)
        if index is not None and len(index):
            return next(iter(index))
        counts = self._identities.get(digest)
        first = None if counts is None else next(counts.ids.after(None), None)
        return None if first is None else self._records[first]

    def of_identity(self, digest: str) -> list[EntryRecord]:
        """The entries of one identity, in id order."""
        counts = self._identities.get(digest)
        return [] if counts is None else [self._records[i] for i in counts.ids.after(None)]

    def durable(self) -> Iterator[EntryRecord]:
        """The stored entries (not pending ones): what a snapshot holds."""
        return (r for r in self._records.values() if r.durable)

    def path_of(self, record: EntryRecord) -> Path:
        """Where the entry's file is: its place under entries/, unless it is still staged."""
        staged = self._staged.get(record.id)
        return staged if staged is not None else self.dirs.entry_path(record.digest, record.id)

    # --- entries joining and leaving --------------------------------------------------------

    def tick(self) -> int:
        """The next value of the logical clock that orders uses (larger: more recent)."""
        return next(self._clock)

    def unservable(self, record: EntryRecord) -> str | None:
        """Why an entry found on disk cannot join (a block of its missing or of the wrong
        size), or None. A record read from its header learns its block size here, from its
        first block's file."""
        if not record.block_hashes:
            return None
        if not record.block_size:
            first = self.block_store.get(record.digest, record.block_hashes[0])
            record.block_size = 0 if first is None else first.size
        return self.block_store.lacks(record.digest, record.block_hashes, record.block_size)

    def add(
        self,
        record: EntryRecord,
        staged: Path | None = None,
        staged_blocks: Mapping[bytes, Path] = MappingProxyType({}),
    ) -> None:
        """Index an entry whose file is at its place, or at staged while it is pending; its
        blocks are held or, new ones, at their staging files in staged_blocks.

        ValueError, with nothing changed, for the same tokens as an entry already indexed;
        KeyError for a block neither held nor staged.
        """
        if record.checkpoint_key is None:
            index = self._indexes.get(record.digest) or PrefixIndex()
            index.add(record)  # first: one of the two steps that may refuse
            self._indexes[record.digest] = index
        try:
            self._join(record, staged_blocks)
        except KeyError:
            if record.checkpoint_key is None:
                self._unindex(record)
            raise
        self.policy.add(record)
        if staged is not None:
            self._staged[record.id] = staged

    def add_found(self, records: Iterable[EntryRecord]) -> list[tuple[EntryRecord, str]]:
        """Index entry files found in their places (start-up), least recently used first, each
        the most recent as it joins: add() for each, the prompt indexes built in bulk
        (PrefixIndex.add_all). An id the tier holds already is passed over. Returns the ones
        refused, with why (a block missing or of another size, the same tokens as another
        entry): their files are the caller's to quarantine."""
        refused: list[tuple[EntryRecord, str]] = []
        joining: list[EntryRecord] = []
        prompts: dict[str, list[EntryRecord]] = {}
        for record in records:
            if record.id in self._records or record.id in self._doomed:
                continue
            record.last_used = next(self._clock)
            problem = self.unservable(record)
            if problem is not None:
                refused.append((record, problem))
                continue
            if record.checkpoint_key is None:
                prompts.setdefault(record.digest, []).append(record)
            joining.append(record)
        duplicates: list[EntryRecord] = []
        for digest, batch in prompts.items():
            index = self._indexes.get(digest) or PrefixIndex()
            duplicates += index.add_all(batch)
            if len(index):
                self._indexes[digest] = index
        refused += [(record, "a duplicate of another entry") for record in duplicates]
        refused_ids = {record.id for record in duplicates}
        joined = [record for record in joining if record.id not in refused_ids]
        plain: dict[str, list[EntryRecord]] = {}  # by identity: no blocks, no checkpoint
        for record in joined:
            if record.block_hashes or record.checkpoint_key is not None:
                self._join(record)  # every block is held: unservable() said so
            else:
                plain.setdefault(record.digest, []).append(record)
        for digest, records_of in plain.items():
            self._join_plain(digest, records_of)
        for record in joined:  # in their order across identities: the eviction order
            self.policy.add(record)
        return refused

    def _join_plain(self, digest: str, records: list[EntryRecord]) -> None:
        """_join() of entries of one identity with no blocks and no checkpoint key, in bulk
        (their file's bytes are their logical bytes)."""
        ids = [record.id for record in records]
        self._records.update(zip(ids, records, strict=True))
        counts = self._identities.get(digest)
        if counts is None:
            counts = self._identities[digest] = IdentityCounts()
        added = sum(map(attrgetter("nbytes"), records))
        counts.entries += len(records)
        counts.bytes += added
        for record in filter(attrgetter("prefill_checkpoint"), records):  # a C loop over most
            counts.prefill_checkpoints += 1
            counts.prefill_checkpoint_bytes += record.nbytes
        counts.ids.update(ids)
        self._ids.update(ids)
        self.version += len(records)
        self.manifest_bytes += added
        self.logical_bytes += added

    def _join(
        self, record: EntryRecord, staged_blocks: Mapping[bytes, Path] = MappingProxyType({})
    ) -> None:
        """Everything of add() but the prompt index and the eviction order; KeyError, nothing
        changed, for a block neither held nor staged."""
        if record.block_hashes:
            self._blocks_of[record.id] = self.block_store.attach(
                record.digest, record.block_hashes, record.block_size, staged_blocks
            )
        if record.checkpoint_key is not None:
            self._checkpoints.setdefault((record.digest, record.checkpoint_key), []).append(record)
        self._records[record.id] = record
        counts = self._identities.get(record.digest)
        if counts is None:
            counts = self._identities[record.digest] = IdentityCounts()
        counts.count(record, 1)
        counts.ids.add(record.id)
        self._ids.add(record.id)
        self.version += 1
        self.manifest_bytes += record.nbytes
        self.logical_bytes += record.logical_bytes

    def expect_mtimes(self, recorded_mtime: Callable[[str], int | None] | None) -> None:
        """Entries were taken from the snapshot before the directory was listed: until this is
        called again with None, an entry that recorded_mtime(id) knows is served only while
        its file still has that mtime (open_entry checks the size in any case)."""
        self._recorded_mtime = recorded_mtime

    def drop(self, record: EntryRecord) -> int:
        """Take an entry out of the tier; its file goes now, or when its last lease ends. Its
        bytes: its file's and those of the blocks that went with it (none while it is leased)."""
        before = self.block_store.bytes
        self._leave(record)
        return record.nbytes + before - self.block_store.bytes

    def forget(self, record: EntryRecord) -> None:
        """Take an entry out of the tier but leave its file: it is not the file the record
        describes (changed since the snapshot), so it is listed and read again, not deleted."""
        if record.id in self._records:
            self._disowned.add(record.id)
            self._leave(record)

    def _leave(self, record: EntryRecord) -> None:
        if self._records.pop(record.id, None) is None:
            return
        self.version += 1
        if record.checkpoint_key is None:
            self._unindex(record)
        else:
            key = (record.digest, record.checkpoint_key)
            self._checkpoints[key].remove(record)
            if not self._checkpoints[key]:
                del self._checkpoints[key]
        counts = self._identities[record.digest]
        counts.count(record, -1)
        counts.ids.remove(record.id)
        if not counts.entries:
            del self._identities[record.digest]
        self._ids.remove(record.id)
        self.policy.remove(record)
        if record.leases:
            self._doomed[record.id] = record
        else:
            self._delete_file(record)

    def _unindex(self, record: EntryRecord) -> None:
        index = self._indexes[record.digest]
        index.remove(record)
        if not len(index):
            del self._indexes[record.digest]

    def moved(self, record: EntryRecord, path: Path) -> None:
        """The entry's file is now at path (quarantined): drop() unlinks that, not its place."""
        self._staged[record.id] = path

    def placed(self, record: EntryRecord) -> None:
        """The writer renamed a pending entry's file into its place: it is durable."""
        self._staged.pop(record.id, None)
        record.durable = True
        self.version += 1

    def _delete_file(self, record: EntryRecord) -> None:
        path = self.path_of(record)
        self._staged.pop(record.id, None)
        if record.id in self._disowned:
            self._disowned.discard(record.id)
        else:
            self.deleter.delete(path)
        self.manifest_bytes -= record.nbytes
        self.logical_bytes -= record.logical_bytes
        self.block_store.detach(self._blocks_of.pop(record.id, ()))

    # --- serving ------------------------------------------------------------------------------

    def open(self, record: EntryRecord, damaged: Callable[[Path, str], None]) -> int | None:
        """Open an entry read-only, checked against its record (entry_files.open_entry); a
        file gone behind our back takes its entry with it, and so does one that is not what
        the record says (truncated, replaced), after damaged(path, reason) moved it aside.
        One that cannot be opened now (an I/O error, no descriptor free) is only not served;
        one taken from the snapshot whose file changed since (before start-up's listing
        checked it) is forgotten, its file left for the listing to read again."""
        candidates = [self.path_of(record)]
        if not record.durable:  # the writer may have renamed it a moment ago
            candidates.append(self.dirs.entry_path(record.digest, record.id))
        mtime = None if self._recorded_mtime is None else self._recorded_mtime(record.id)
        for path in candidates:
            try:
                return entry_files.open_entry(path, record.nbytes, mtime)
            except FileNotFoundError:
                continue
            except entry_files.ChangedError as exc:  # the listing reads it again
                log.warning("entry_changed_since_snapshot", entry=record.id, reason=str(exc))
                self.forget(record)
                return None
            except EntryFormatError as exc:  # never handed out
                damaged(path, str(exc))
                break
            except OSError as exc:  # EIO, or out of descriptors: a miss now, the entry kept
                log.warning("entry_unreadable", entry=record.id, error=str(exc))
                return None
        else:
            log.warning("entry_file_missing", entry=record.id)
        self._staged.pop(record.id, None)
        self.drop(record)
        return None

    def lease_taken(self, record: EntryRecord) -> None:
        """A reader took a lease: a use, so the entry becomes the most recent."""
        self.policy.touch(record)
        record.leases += 1
        if record.leases == 1:
            self.leased += 1
            self.leased_bytes += record.nbytes
            for block in self.blocks_of(record):
                count = self._leased_blocks.get(block, 0)
                self._leased_blocks[block] = count + 1
                self.leased_bytes += block.size if not count else 0

    def lease_ended(self, record: EntryRecord) -> None:
        """A lease ended; the last one of a doomed entry takes its file."""
        record.leases -= 1
        if record.leases:
            return
        self.leased -= 1
        self.leased_bytes -= record.nbytes
        for block in self.blocks_of(record):
            count = self._leased_blocks.pop(block) - 1
            if count:
                self._leased_blocks[block] = count
            else:
                self.leased_bytes -= block.size
        if self._doomed.pop(record.id, None) is not None:
            self._delete_file(record)

    # --- what eviction measures (kvd.store.eviction) ----------------------------------------

    def disk_free(self) -> int:
        """The disk's free bytes, counting those of files the deleter has yet to unlink (they
        are no longer the tier's). Raises OSError when the disk cannot say."""
        return disk_free(self.dirs.root) + self.deleter.pending_bytes

    def identity_bytes(self, digest: str) -> int:
        """One identity's share of the tier: its entry files and its unique blocks."""
        counts = self._identities.get(digest)
        return (0 if counts is None else counts.bytes) + self.block_store.identity_bytes(digest)
