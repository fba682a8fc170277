"""kvd under one server process of a stock server (kvd-mlx-lm-server, kvd-vllm-mlx): the
client of its restores, the ColdTier of the model loaded now, and the summary each model's tier
logs when it is retired (a reload, the server's exit)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, Final, NoReturn

from kvd_protocol.errors import DaemonUnavailableError
from kvd_protocol.identity import SOURCE_TRAIT

from .breaker import BreakerStats
from .client import Client
from .identity import EngineIdentity
from .link import MIN_MEASURED_PREFILL, DaemonError
from .mlx_lm_cache import BACKLOG_BYTES, ColdTier, ColdTierStats
from .prefill_checkpoints import BY_COST, CheckpointSettings
from .prompt_hints import PromptHints

log = logging.getLogger("kvd_client")

CLOSE_SECONDS: Final = 10.0  # at exit, for the snapshots still waiting to be sent


class ServerTier:
    """kvd under one server process: one client (the restores'; the ColdTier sends its puts on
    a twin of it, sharing its breaker), and the ColdTier of the model loaded now (the server
    holds one model at a time). Used from the generation thread only."""

    def __init__(
        self,
        client: Client,
        namespace: str = "",
        backlog_bytes: int = BACKLOG_BYTES,
        checkpoints: CheckpointSettings = BY_COST,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.backlog_bytes = backlog_bytes
        self.checkpoints = checkpoints
        self.hints = PromptHints()  # the requests' hints, for the stores of their caches
        self._key: object = None
        self._cold: ColdTier | None = None

    def model_loaded(
        self, key: object, model: Any, tokenizer: Any, identity: EngineIdentity
    ) -> None:
        self._retire()
        cold = ColdTier(
            self.client,
            model,
            tokenizer,
            identity=identity,
            backlog_bytes=self.backlog_bytes,
            checkpoints=self.checkpoints,
        )
        self._key, self._cold = key, cold
        source = identity.to_protocol().trait_map().get(SOURCE_TRAIT, identity.model_id)
        log.info(
            "kvd: model %s (%s) is served from %s",
            source,
            identity.model_id,
            self.client.socket_path,
        )

    def model_unusable(self, key: object, why: str) -> None:
        self._retire()
        self._key = key
        log.warning("kvd: the tier is off for this model: %s", why)

    def cold_tier(self, key: object) -> ColdTier | None:
        return self._cold if key == self._key else None

    def serving(self, model: Any) -> ColdTier | None:
        """The ColdTier of model, if the tier serves it."""
        return self._cold if self._cold is not None and self._cold.model is model else None

    def close(self) -> None:
        self._retire()
        self.client.close()
        breaker = self.client.breaker
        if breaker is not None and breaker.stats.opened:
            log.info("kvd: %s", describe_breaker(breaker.stats))

    def _retire(self) -> None:
        if self._cold is not None:
            self._cold.close(CLOSE_SECONDS)
            stats = self._cold.stats
            measured = None
            if stats.restored_tokens and not stats.prefill_seconds_per_token:
                measured = self._daemons_cost(self._cold.identity)
            log.info("kvd: %s", describe(stats, measured))
        self._key, self._cold = None, None

    def _daemons_cost(self, identity: EngineIdentity) -> float | None:
        """Seconds a token of prefill costs the model as the daemon has it from the engines
        that measured it (this server timed none); None when it has none or does not answer."""
        digest = self.client.scoped(identity.to_protocol()).digest()
        try:
            status = self.client.status()
        except (DaemonUnavailableError, DaemonError):
            return None
        rows = status.get("identities")
        for row in rows if isinstance(rows, list) else []:
            cost = row.get("prefill_ms_per_token") if isinstance(row, dict) else None
            if row.get("identity") == digest and isinstance(cost, int | float) and cost > 0:
                return float(cost) / 1000
        return None


def describe(stats: ColdTierStats, daemons_cost: float | None = None) -> str:
    """The exit summary; daemons_cost: the model's prefill cost a token as the daemon has it,
    which values the restores when this server timed no prefill."""
    return (
        f"{stats.restored} prompts restored ({stats.restored_tokens} tokens), "
        + _described_saving(stats, daemons_cost)
        + f"; {stats.fresh} lookups found nothing longer than memory "
        f"({stats.lookups_unavailable} with the daemon unavailable, {stats.memory_held} while "
        f"memory held part of the prompt: engine-held); {stats.stored} caches "
        f"stored, {stats.unavailable} skipped with the daemon unavailable, {stats.failed} "
        f"failed, {stats.superseded} superseded before sending; "
        + _described_snapshots(stats)
        + f"; prefill checkpoints: {stats.checkpoints} taken ({stats.checkpoint_bytes} bytes "
        f"copied), {stats.checkpoint_restores} prompts restored from them "
        f"({stats.checkpoint_restored_tokens} tokens)"
    )


def _described_saving(stats: ColdTierStats, daemons_cost: float | None) -> str:
    """The prefill the restores saved, at this server's measured cost, else at the one the
    daemon has from the model's engines, or why it is unknown."""
    saved = stats.prefill_saved_seconds
    if not stats.restored_tokens:
        return "no prefill saved"
    if saved is not None:
        return (
            f"prefill saved {saved:.2f} s (the tokens restored at the "
            f"{stats.prefill_seconds_per_token * 1000:.3f} ms a token this server last measured)"
        )
    if daemons_cost is not None:
        return (
            f"prefill saved {stats.restored_tokens * daemons_cost:.2f} s (the tokens restored at "
            f"the {daemons_cost * 1000:.3f} ms a token the daemon has from this model's engines)"
        )
    return (
        "prefill saved not measured (no prefill of this model timed: this server timed none of "
        f"{MIN_MEASURED_PREFILL} tokens or more, the daemon has none)"
    )


def _described_snapshots(stats: ColdTierStats) -> str:
    """The snapshots' part of the exit summary (benchmarks read it: keep its wording)."""
    per_request = stats.bytes_written // stats.requests if stats.requests else 0
    return (
        f"snapshots: {stats.snapshots} taken in {stats.snapshot_seconds * 1000:.1f} ms "
        f"(max {stats.snapshot_max_seconds * 1000:.1f} ms), {stats.bytes_copied} bytes copied, "
        f"{stats.bytes_written} bytes written ({per_request} per request, {stats.requests} "
        f"requests), {stats.dropped} dropped ({stats.dropped_bytes} bytes), "
        f"{stats.aborted} aborted"
    )


def describe_breaker(stats: BreakerStats) -> str:
    return (
        f"the daemon was skipped {stats.opened} times for not answering: "
        f"{stats.skipped_lookups} lookups and {stats.skipped_puts} stores skipped"
    )


def storable(tokens: Sequence[int]) -> bool:
    """Token ids kvd can key by: mlx_lm.server marks image patches with negative ids."""
    return min(tokens, default=0) >= 0


def exit_without_teardown(status: int = 0, last_line: str | None = None) -> NoReturn:
    """Ends a server process, from any thread, skipping the interpreter's teardown: MLX's
    stream threads are still joinable then, and destroying them aborts the process (SIGABRT,
    which a service manager takes for a crash). The logs are flushed first; last_line, if
    any, is the last line on stderr."""
    logging.shutdown()
    sys.stdout.flush()
    if last_line is not None:
        print(last_line, file=sys.stderr)
    sys.stderr.flush()
    os._exit(status)
