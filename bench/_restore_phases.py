"""bench/restore.py --breakdown: one get of an entry in blocks taken apart into its phases,
each run alone on this thread with the library's own parts, timed and its page faults
counted.

A get overlaps some of these (past restore.INLINE_BYTES its reads and checksums run on four
reader threads while it waits; allocation goes before every read of a block entry): the
phases' sum is what the get would cost done one after another, as it is done at and below
INLINE_BYTES. The phases:

- lookup: the Lookup exchange, the manifest's descriptor, its head read and checked
  (calls.lookup);
- lease: the block descriptors, asked for under the lookup's lease (calls.open_blocks);
- allocation: every buffer of the restore, allocated by MLX (restore.allocated);
- room: the rooms for growth zeroed (platform_memory.zero_rooms, inside the codecs' load);
- MLX arrays: the rest of the codecs' load (cache objects around the buffers, their
  destinations taken), the trim to the match and the evaluation of every state;
- reads: every block read into the buffers, unverified: the first touch of each buffer's
  pages, so its page faults are those of fresh memory;
- checksums: the same reads checksummed, less the same reads unverified (both into pages
  already in memory): what verifying adds;
- release: the Release sent, as a get sends it (its answer not waited for: read by the next
  exchange).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvd_client import calls, platform_memory, prompt_cache, restore
from kvd_client.block_io import BlockReads
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.restore import Fill, Filling
from kvd_client.results import LookupHit
from kvd_protocol.messages import MAX_BLOCK_BATCH

PHASES = (
    "lookup",
    "lease",
    "allocation",
    "room",
    "MLX arrays",
    "reads",
    "checksums",
    "release",
)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass
class Clock:
    """Seconds and page faults by phase, of one run."""

    seconds: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        faults, started = _faults(), time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started, _faults() - faults)

    def add(self, name: str, seconds: float, faults: int) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.faults[name] = self.faults.get(name, 0) + faults

    def timing(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """call, its time and faults added to phase name whenever it runs."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return call(*args, **kwargs)

        return timed


class _Recorded(Filling):
    """Fills handed over are kept, to be run later by the breakdown, not by reader threads."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Callable[[], None]] = []

    def deferred(self, fill: Fill) -> Fill:
        def keep(pieces: Sequence[memoryview]) -> None:
            self.kept.append(partial(fill, pieces))

        return keep


@contextmanager
def _patched(module: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def one_run(client: Client, identity: EngineIdentity, tokens: Sequence[int]) -> Clock:
    """The phases of one get of tokens' longest prefix (an entry stored in blocks)."""
    clock = Clock()
    link = client._link  # the parts a get drives, driven here one at a time
    with clock.phase("lookup"):
        hit = client._run(calls.lookup(link, identity.to_protocol(), tokens))
    if hit is None or not hit.entry.header.block_hashes:
        raise RuntimeError("the breakdown needs a hit on an entry stored in blocks")
    try:
        _restore_phases(client, hit, clock)
    finally:
        hit.entry.close()
        with clock.phase("release"):
            client._run(calls.release_lease(link, hit.lease, hit.epoch, awaited=False))
    return clock


def _restore_phases(client: Client, hit: LookupHit, clock: Clock) -> None:
    header, link = hit.entry.header, client._link
    count = len(header.block_hashes)
    fds: list[int] = []
    with clock.phase("lease"):
        for first in range(0, count, MAX_BLOCK_BATCH):
            batch = min(MAX_BLOCK_BATCH, count - first)
            fds.extend(client._run(calls.open_blocks(link, hit, first, batch)))
    try:
        codecs = prompt_cache._codecs(header, hit.matched, None)
        destinations: dict[int, Sequence[memoryview]] = {}
        unverified = BlockReads(header, verify=False, limits=link.limits)
        taking = unverified.fill

        def fill(index: int, tail: Fill) -> Fill:  # what each cut tensor's buffer is
            take = taking(index, tail)

            def taken(pieces: Sequence[memoryview]) -> None:
                destinations[index] = pieces
                take(pieces)

            return taken

        unverified.fill = fill  # type: ignore[method-assign]
        filling = _Recorded()
        started, faults = time.perf_counter(), _faults()
        with (
            _patched(restore, "allocated", clock.timing("allocation", restore.allocated)),
            _patched(restore, "zero_rooms", clock.timing("room", platform_memory.zero_rooms)),
        ):
            caches = prompt_cache._loaded(
                header, codecs, hit.entry.fills(verify=False), filling, unverified
            )
            trimmed = prompt_cache._trimmed(caches, header.token_count - hit.matched)
        inside = sum(clock.seconds.get(name, 0.0) for name in ("allocation", "room"))
        inside_faults = sum(clock.faults.get(name, 0) for name in ("allocation", "room"))
        clock.add(
            "MLX arrays", time.perf_counter() - started - inside, _faults() - faults - inside_faults
        )
        with clock.phase("reads"):
            _read(unverified, filling.kept, fds)
        verified = BlockReads(header, verify=True, limits=link.limits)
        for index, pieces in destinations.items():
            verified.fill(index, lambda _: None)(pieces)
        again = Clock()
        with again.phase("unverified"):
            _read(unverified, [], fds)
        with again.phase("verified"):
            _read(verified, [], fds)
        clock.add("checksums", again.seconds["verified"] - again.seconds["unverified"], 0)
        del trimmed
    finally:
        for fd in fds:
            os.close(fd)


def _read(blocks: BlockReads, tails: Sequence[Callable[[], None]], fds: Sequence[int]) -> None:
    for tail in tails:
        tail()
    for index, fd in enumerate(fds):
        blocks.read_block(index, fd)


@dataclass(frozen=True)
class Breakdown:
    """The median of each phase over runs, its faults' median, and the runs' median sum."""

    runs: tuple[Clock, ...]

    def seconds(self, name: str) -> float:
        return statistics.median(run.seconds.get(name, 0.0) for run in self.runs)

    def faults(self, name: str) -> int:
        return int(statistics.median(run.faults.get(name, 0) for run in self.runs))

    @property
    def total(self) -> float:
        return statistics.median(sum(run.seconds.values()) for run in self.runs)


def breakdown(
    client: Client,
    identity: EngineIdentity,
    tokens: Sequence[int],
    repeat: int,
    before: Callable[[], None] | None = None,
) -> Breakdown:
    """repeat runs (before, untimed, precedes each; else one untimed warm-up first)."""
    if before is None:
        one_run(client, identity, tokens)
    runs = []
    for _ in range(repeat):
        if before is not None:
            before()
        runs.append(one_run(client, identity, tokens))
    return Breakdown(tuple(runs))
