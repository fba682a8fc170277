"""mlx-lm with the cold tier: a stock engine restores the longest cached prefix of each prompt
from kvd and hands its caches back after prefill and generation.

    tier = ColdTier(Client.connect(), model, tokenizer)       # model, tokenizer = mlx_lm.load(...)
    for response in tier.stream_generate(prompt, max_tokens=256):   # was mlx_lm.stream_generate
        print(response.text, end="")

What is stored when (the places mlx-lm's server snapshots its in-memory cache):
- after generation, prompt + generated tokens: the next turn of a conversation extends them;
- when the model's caches may become untrimmable (rotating windows that wrap, chunked
  attention, recurrent state), so that the entry stored after generation could not serve this
  prompt again: at the prompt boundary, all of the prompt but its last token (the daemon caps
  a match at the prompt's length - 1, so that snapshot serves both a repeat of the prompt and
  any extension), and prefill checkpoints along the prompt (prefill_checkpoints.py), so that
  a prompt whose end changed restores all but the last interval. Caches that always trim need
  neither: the longer entry serves by trimming.

Puts never block the engine on the daemon: the caches are snapshotted on the caller's thread
(copies of the live tokens, the only MLX work) and one background thread writes the snapshot
into the daemon's staging file, on a connection of its own (Client.twin): a put stuck in a
hung daemon holds nothing a lookup needs. A snapshot copies only what is new (snapshots.py):
rows in blocks the daemon holds, or that a snapshot still waiting copied, are not copied
again. No copy beyond the snapshot is needed while decoding goes on: mlx-lm writes into cache
buffers in place (KVCache.update_and_fetch, a wrapped RotatingKVCache), but MLX only does so
when nothing else references the buffer, and the pending put holds a reference to every array
it reads until they are written. The snapshots waiting are bounded in bytes (backlog.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, cast

import mlx.core as mx
import mlx_lm
from kvd_protocol.messages import Retention
from mlx_lm.models import cache as _mlx_lm_cache
from mlx_lm.models.cache import make_prompt_cache

from . import prefill_checkpoints, snapshots
from .backlog import Admission, Backlog, Kind, covers, memory_bytes
from .block_io import BlocksNotHeld
from .codecs import CodecError
from .drops import Drops
from .identity import EngineIdentity
from .link import MIN_MEASURED_PREFILL
from .model_folder import model_identity
from .prefill_checkpoints import CheckpointedModel, CheckpointSettings
from .prompt_cache import snapshot_layers
from .request_hints import longer
from .snapshots import Memo, Plan, Snapshot

if TYPE_CHECKING:
    from mlx_lm.generate import GenerationResponse

    from .client import Client, Ticket
    from .prompt_cache import Restored

log = logging.getLogger("kvd_client")

mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes

# Cache classes that can be trimmed to any shorter prefix however long they grow.
_ALWAYS_TRIMMABLE: Final = (mlc.KVCache, mlc.QuantizedKVCache)

ProgressCallback = Callable[[int, int], None]

# The snapshots that may wait to be sent, in bytes. A fixed figure rather than a share of
# memory: it bounds what the tier adds to the engine's memory whatever the machine, and 1 GiB
# holds two whole 512 MiB caches (an 8B model's 4k tokens) or, since snapshots copy only new
# rows, the new turns of a burst of many conversations.
BACKLOG_BYTES: Final = 1 << 30


@dataclass
class ColdTierStats:
    restored: int = 0  # prompts that started from a restored prefix
    fresh: int = 0  # prompts for which the tier had no prefix (or none longer than asked)
    lookups_unavailable: int = 0  # of those, lookups the daemon did not answer (down, slow)
    memory_held: int = 0  # of those, answered while the engine held part of the prompt already
    restored_tokens: int = 0  # prompt tokens restored instead of computed
    checkpoint_restores: int = 0  # of the prompts restored, those from a prefill checkpoint
    checkpoint_restored_tokens: int = 0  # the tokens those restored
    computed_tokens: int = 0  # prompt tokens prepare() left to compute after restoring
    stored: int = 0  # snapshots the daemon accepted
    unavailable: int = 0  # snapshots not handed over: the daemon was down or slow
    failed: int = 0  # snapshots refused by the codecs or the daemon
    superseded: int = 0  # snapshots a newer one covered before they were sent (or not taken)
    dropped: int = 0  # snapshots dropped from a full backlog (logged at warning)
    dropped_bytes: int = 0  # what they held
    aborted: int = 0  # puts aborted: the daemon no longer held blocks the snapshot left out
    requests: int = 0  # finished turns handed to store() (Kind.TURN)
    checkpoints: int = 0  # prefill checkpoints handed to store()
    checkpoint_bytes: int = 0  # copied for them
    snapshots: int = 0  # store() calls, each on the engine's thread
    snapshot_seconds: float = 0.0  # the engine's time in them, all told
    snapshot_max_seconds: float = 0.0  # the longest one
    bytes_copied: int = 0  # copied by them
    bytes_written: int = 0  # into the daemon's files by their puts
    prefill_seconds_per_token: float = 0.0  # the engine's last measure (0: none yet)

    @property
    def prefill_saved_seconds(self) -> float | None:
        """The prefill the restores saved: the tokens restored at the engine's last measured
        cost a token; None before any prefill of MIN_MEASURED_PREFILL tokens was timed."""
        cost = self.prefill_seconds_per_token
        return self.restored_tokens * cost if cost else None


class ColdTier:
    """The cold tier of one model in one engine. Thread use: call prepare, store and the
    generate helpers from the thread that runs the model; puts happen on a thread of its own."""

    def __init__(
        self,
        client: Client,
        model: Any,
        tokenizer: Any,
        *,
        identity: EngineIdentity | None = None,
        namespace: str = "",
        backlog_bytes: int = BACKLOG_BYTES,
        checkpoints: CheckpointSettings = prefill_checkpoints.BY_COST,
    ) -> None:
        """tokenizer: what mlx_lm.load returned. identity: by default the content of the model
        folder the tokenizer was loaded from, as kvd-mlx-lm-server keys it
        (model_folder.model_identity: pass one when the KV cache is quantised).
        backlog_bytes: what the snapshots waiting while one is sent may hold (copies of the
        caches' rows); beyond it checkpoints and segments go first, then the oldest
        (backlog.py). checkpoints: the prefill checkpoints' interval and bytes; a fixed
        interval must be a multiple of the client's block size (ValueError)."""
        self.unit = client.block_tokens or prefill_checkpoints.UNIT_TOKENS
        checkpoints.check_unit(self.unit)
        self.checkpoints = checkpoints
        self.client = client
        self._stores = client.twin()  # puts on a connection of their own: never before a lookup
        self.model = model
        self.tokenizer = tokenizer
        self.identity = identity or model_identity(model, tokenizer, namespace)
        self.stats = ColdTierStats()
        self._wire = self.identity.to_protocol()
        self._backlog: Backlog[Snapshot] = Backlog(backlog_bytes)
        self._futures: dict[Snapshot, Future[Ticket]] = {}
        self._retentions: dict[Snapshot, Retention] = {}  # of those waiting that have one
        self._memo = Memo()
        self._untold = Drops()  # dropped, not yet told to the daemon: with the next commit
        self._state_bytes: int | None = None  # a checkpoint's own (prefill_checkpoints.py)
        self._prefill_rate = prefill_checkpoints.ASSUMED_PREFILL_RATE  # tokens/s
        self._busy = False
        self._closed = False
        self._changed = threading.Condition()
        self._sender = threading.Thread(target=self._send_forever, name="kvd-put", daemon=True)
        self._sender.start()

    # --- the two calls an engine needs ---

    def prepare(self, tokens: Sequence[int]) -> tuple[list[Any], list[int]]:
        """A cache for a prompt and the tokens still to run through the model: the longest
        cached prefix restored, or a fresh cache; at least one token is always left (the
        logits of the last one are the first token's). Never raises for the daemon's sake."""
        if not tokens:
            raise ValueError("an empty prompt has no token to compute logits from")
        restored = self.restore(tokens)
        matched = 0 if restored is None else restored.matched
        self.stats.computed_tokens += len(tokens) - matched
        if restored is None:
            return make_prompt_cache(self.model), list(tokens)
        return restored.cache, list(tokens[matched:])

    def restore(self, tokens: Sequence[int], *, min_tokens: int = 0) -> Restored | None:
        """The caches of the longest cached prefix of tokens (at most all but the last), or
        None: no entry, or none of at least min_tokens (what the engine holds already).
        Never raises for the daemon's sake."""
        failed_lookups = self.client.stats.failed_lookups
        restored = self.client.get(self.identity, tokens, model=self.model, min_tokens=min_tokens)
        if restored is None:
            self.stats.fresh += 1
            unavailable = self.client.stats.failed_lookups > failed_lookups
            self.stats.lookups_unavailable += unavailable
            # The daemon counts these as engine-held: memory served as well as kvd could.
            self.stats.memory_held += not unavailable and min_tokens > 1
        else:
            self.stats.restored += 1
            self.stats.restored_tokens += restored.matched
            if restored.prefill_checkpoint:
                self.stats.checkpoint_restores += 1
                self.stats.checkpoint_restored_tokens += restored.matched
            if restored.block_tokens == self.client.block_tokens:
                with self._changed:
                    self._memo.mark_held(restored.block_hashes)
        return restored

    def store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        kind: Kind = Kind.TURN,
        retention: Retention | None = None,
    ) -> Future[Ticket]:
        """Hand the caches (holding exactly tokens) to the daemon: snapshot now, send in the
        background. kind: a finished turn, or worth less: a segment (a prefix on the way to
        a longer entry: a prompt boundary, the server's system and user segments; of caches
        that always trim only its whole blocks are stored, snapshots.plan) or a prefill
        checkpoint (the daemon keeps it as one). The future gives the
        daemon's ticket; it is cancelled if the snapshot was not needed (a waiting or newer
        one covers it, or nothing of a segment is) or dropped for room. Never raises for the
        daemon's sake, nor for a cache the codecs refuse (the future then holds the
        CodecError). retention: the put's (Client.put_entry), carried over to the snapshot
        that supersedes this one or covers it while they wait."""
        started = time.perf_counter()
        future: Future[Ticket] = Future()
        try:
            self._store(future, tokens, cache, kind, retention)
        finally:
            took = time.perf_counter() - started
            self.stats.snapshots += 1
            self.stats.requests += kind is Kind.TURN
            self.stats.checkpoints += kind is Kind.PREFILL_CHECKPOINT
            self.stats.snapshot_seconds += took
            self.stats.snapshot_max_seconds = max(self.stats.snapshot_max_seconds, took)
        return future

    def _store(
        self,
        future: Future[Ticket],
        tokens: Sequence[int],
        cache: Sequence[Any],
        kind: Kind,
        retention: Retention | None,
    ) -> None:
        with self._changed:
            if self._closed:
                raise RuntimeError("store() on a closed ColdTier")
            try:
                plan = snapshots.plan(
                    self._memo,
                    tokens,
                    cache,
                    block_tokens=self.client.block_tokens,
                    kind=kind,
                )
            except CodecError as exc:
                self.stats.failed += 1
                log.warning("cold tier: caches of %d tokens not stored: %s", len(tokens), exc)
                future.set_exception(exc)
                return
            if plan is None:
                future.cancel()
                return
            taken, retention = self._admitted(plan, retention)
            if not taken:
                future.cancel()
                return
        self._state_seen(prefill_checkpoints.state_bytes(plan.layers, plan.arrays))
        snapshot = snapshots.take(plan)  # the copies, with the lock let go
        self.stats.bytes_copied += snapshot.copied
        if kind is Kind.PREFILL_CHECKPOINT:
            self.stats.checkpoint_bytes += snapshot.copied
        with self._changed:
            self._memo.copied(snapshot.copies)
            self._backlog.append(snapshot)
            self._futures[snapshot] = future
            if retention is not None:
                self._retentions[snapshot] = retention
            self._changed.notify_all()

    def _admitted(self, plan: Plan, retention: Retention | None) -> tuple[bool, Retention | None]:
        """Whether the backlog takes plan, dropping what it decides (under the lock); and
        the retention it is put with: its own and those of the snapshots it supersedes (one
        that covers it takes its retention instead)."""
        admission: Admission[Snapshot] = self._backlog.admit(plan)
        for snapshot in admission.superseded:
            self._futures.pop(snapshot).cancel()
            retention = longer(retention, self._retentions.pop(snapshot, None))
            self.stats.superseded += 1
        for snapshot in admission.dropped:
            self._dropped(snapshot.tokens, memory_bytes([snapshot]))
            self._futures.pop(snapshot).cancel()
            self._retentions.pop(snapshot, None)
        if admission.covered:
            self.stats.superseded += 1
            if retention is not None:
                for waiting in [w for w in self._futures if covers(w, plan)]:
                    self._retentions[waiting] = longer(retention, self._retentions.get(waiting))
        elif not admission.taken:
            self._dropped(plan.tokens, plan.nbytes)
        return admission.taken, retention

    def _dropped(self, tokens: Sequence[int], nbytes: int) -> None:
        self.stats.dropped += 1
        self.stats.dropped_bytes += nbytes
        self._untold.add(1, nbytes)
        log.warning(
            "cold tier: a snapshot of %d tokens (%d bytes) dropped: the backlog holds %d of "
            "its %d bytes",
            len(tokens),
            nbytes,
            self._backlog.nbytes,
            self._backlog.max_bytes,
        )

    # --- prefill checkpoints and the prompt boundary ---

    def prefill_hooks(
        self,
        tokens: Sequence[int],
        start: int,
        cache: Sequence[Any],
        progress: ProgressCallback | None = None,
    ) -> tuple[Any, ProgressCallback]:
        """For mlx-lm's generate_step prefilling tokens[start:] into cache (which holds the
        first start): the model to call, its prefill cut at the prefill checkpoints (each
        stored), and a progress callback that stores the prompt boundary when the caches may
        become untrimmable, then calls progress with what it was given."""
        untrimmable = may_become_untrimmable(cache)
        at = self.checkpoint_positions(tokens, start, cache)  # none for caches that trim

        def take(position: int, caches: Sequence[Any]) -> None:
            self.store(tokens[:position], caches, kind=Kind.PREFILL_CHECKPOINT)

        def boundary(done: int, total: int) -> None:
            # Called after each prefill chunk is evaluated; done == total - 1 is the last one.
            if untrimmable and 0 < done == total - 1:
                self.store(tokens[: len(tokens) - 1], cache, kind=Kind.SEGMENT)
            if progress is not None:
                progress(done, total)

        model = CheckpointedModel(self.model, start, at, take) if at else self.model
        return model, boundary

    def checkpoint_positions(
        self, tokens: Sequence[int], start: int, cache: Sequence[Any] | None = None
    ) -> list[int]:
        """Where a prefill of tokens from start (cache holds the first start; None: a fresh
        one) stores prefill checkpoints: none when they are off or the caches always trim."""
        layers = make_prompt_cache(self.model) if cache is None else cache
        if self.checkpoints.interval == 0 or not may_become_untrimmable(layers):
            return []
        interval = self.checkpoints.interval or self._interval(len(tokens))
        return prefill_checkpoints.positions(start, len(tokens) - 1, interval) if interval else []

    def measured_prefill(self, response: GenerationResponse) -> None:
        """The first response of a generation: its prefill rate (mlx-lm's prompt_tps), for
        the checkpoint interval and the daemon's cost policy."""
        if response.prompt_tps > 0:
            seconds = response.prompt_tokens / response.prompt_tps
            self.measured_prefill_time(response.prompt_tokens, seconds)

    @property
    def prefill_rate(self) -> float:
        """The engine's prefill rate in tokens/s the interval is chosen by: the last measured
        over at least MIN_MEASURED_PREFILL tokens, else ASSUMED_PREFILL_RATE."""
        return self._prefill_rate

    def measured_prefill_time(self, tokens: int, seconds: float) -> None:
        """The engine computed tokens of prefill in seconds (a batch's, all sequences told):
        the rate for the checkpoint interval and the daemon's cost policy."""
        self.client.measured_prefill(tokens, seconds)
        if tokens >= MIN_MEASURED_PREFILL and seconds > 0:
            self._prefill_rate = tokens / seconds
            self.stats.prefill_seconds_per_token = seconds / tokens

    def _interval(self, prompt_tokens: int) -> int:
        """The interval by cost (prefill_checkpoints.choose_interval); 0 when the caches have
        no codec (nothing of them is stored): checkpoints are then off for the model."""
        if self._state_bytes is None:  # once per model: a one-token forward on scratch caches
            scratch = make_prompt_cache(self.model)
            self.model(mx.array([[0]]), cache=scratch)
            mx.eval([layer.state for layer in scratch])
            try:
                self._state_seen(prefill_checkpoints.state_bytes(*snapshot_layers(scratch, 1)))
            except CodecError:
                self.checkpoints = replace(self.checkpoints, interval=0)  # not asked again
                return 0
        assert self._state_bytes is not None
        return prefill_checkpoints.choose_interval(
            state_bytes=self._state_bytes,
            prefill_rate=self._prefill_rate,
            prompt_tokens=prompt_tokens,
            unit=self.unit,
            prompt_bytes=self.checkpoints.prompt_bytes,
        )

    def _state_seen(self, state_bytes: int) -> None:
        self._state_bytes = max(state_bytes, self._state_bytes or 0)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot stored so far was sent (the daemon serves it from then
        on); whether that happened within timeout seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._backlog and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Send what is waiting (at most timeout seconds), then stop the sending thread.
        The client stays open: it is the caller's."""
        self.drain(timeout)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._sender.join(timeout)
        self._stores.close()

    def __enter__(self) -> ColdTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- mlx-lm's generate functions, with the cold tier ---

    def stream_generate(
        self,
        prompt: str | Sequence[int] | mx.array,
        max_tokens: int = 256,
        *,
        prompt_progress_callback: ProgressCallback | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationResponse]:
        """mlx_lm.stream_generate(model, tokenizer, prompt, ...) with the cold tier: the
        prompt's cached prefix is restored, what remains is computed, and the caches are
        stored at the prompt boundary (when needed) and after generation, also when the
        caller stops early. The progress callback counts the whole prompt, restored part
        included. Speculative decoding (draft_model) is not supported."""
        if "draft_model" in kwargs or "prompt_cache" in kwargs:
            raise TypeError("stream_generate with the cold tier takes no draft_model or cache")
        tokens = self._tokens(prompt)
        cache, remaining = self.prepare(tokens)
        matched = len(tokens) - len(remaining)

        def progress(done: int, total: int) -> None:
            if prompt_progress_callback is not None:
                prompt_progress_callback(matched + done, matched + total)

        model, hooked = self.prefill_hooks(tokens, matched, cache, progress)
        responses = mlx_lm.stream_generate(
            model,
            self.tokenizer,
            mx.array(remaining),
            max_tokens,
            prompt_cache=cache,
            prompt_progress_callback=hooked,
            **kwargs,
        )
        # Every token a response carries has been run through the model: the caches
        # hold the prompt and all of them.
        generated: list[int] = []
        try:
            for response in responses:
                if not generated:
                    self.measured_prefill(response)
                generated.append(response.token)
                yield response
        except GeneratorExit:
            responses.close()
            self.store([*tokens, *generated], cache)
            raise
        self.store([*tokens, *generated], cache)

    def generate(self, prompt: str | Sequence[int] | mx.array, **kwargs: Any) -> str:
        """mlx_lm.generate(model, tokenizer, prompt, ...) with the cold tier: the text."""
        return "".join(response.text for response in self.stream_generate(prompt, **kwargs))

    # --- internals ---

    def _tokens(self, prompt: str | Sequence[int] | mx.array) -> list[int]:
        if isinstance(prompt, str):
            # As mlx_lm.stream_generate encodes a text prompt.
            bos = getattr(self.tokenizer, "bos_token", None)
            special = bos is None or not prompt.startswith(bos)
            return list(self.tokenizer.encode(prompt, add_special_tokens=special))
        if isinstance(prompt, mx.array):
            return [int(t) for t in cast(list[int], prompt.tolist())]
        return [int(t) for t in prompt]

    def _send_forever(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._backlog or self._closed)
                if not self._backlog:
                    return
                snapshot = self._backlog.popleft()
                future = self._futures.pop(snapshot)
                retention = self._retentions.pop(snapshot, None)
                self._busy = future.set_running_or_notify_cancel()  # False: the caller cancelled
            if self._busy:
                self._send(future, snapshot, retention)
            del future, snapshot  # the arrays go now, not when the next snapshot comes
            with self._changed:
                self._busy = False
                self._changed.notify_all()

    def _send(
        self, future: Future[Ticket], snapshot: Snapshot, retention: Retention | None
    ) -> None:
        written = self._stores.stats.bytes_written
        with self._changed:
            told = self._untold.report()
        try:
            ticket = self._stores.put_entry(
                self._wire,
                snapshot.tokens,
                snapshot.layers,
                snapshot.tensors,
                meta=snapshot.meta,
                dropped=told,
                retention=retention,
            )
        except BlocksNotHeld as exc:  # evicted since: the next snapshot copies them
            with self._changed:
                self._memo.forget(snapshot.hashes[exc.held_blocks :])
            self.stats.aborted += 1
            log.info("cold tier: put of %d tokens aborted: %s", len(snapshot.tokens), exc)
            future.set_exception(exc.with_traceback(None))  # its frames hold the snapshot
        except Exception as exc:  # a put must never end the thread that sends them all
            self.stats.failed += 1
            log.warning("cold tier: put of %d tokens failed: %s", len(snapshot.tokens), exc)
            future.set_exception(exc.with_traceback(None))
        else:
            with self._changed:
                if ticket.id is not None:  # committed: the daemon has heard of told
                    self._untold.told(told)
                if ticket.state.state in ("pending", "stored"):
                    self._memo.mark_held(snapshot.hashes)
            self._count(ticket.state.state)
            future.set_result(ticket)
        finally:
            self.stats.bytes_written += self._stores.stats.bytes_written - written

    def _count(self, state: str) -> None:
        if state in ("pending", "stored"):
            self.stats.stored += 1
        elif state == "unavailable":
            self.stats.unavailable += 1
        else:
            self.stats.failed += 1


def may_become_untrimmable(layers: Sequence[Any]) -> bool:
    """Whether caches may become untrimmable (recurrent state, a window that wraps): their
    prefill stores the prompt boundary and prefill checkpoints."""
    return not all(_always_trimmable(layer) for layer in layers)


def _always_trimmable(layer: Any) -> bool:
    if type(layer) is mlc.CacheList:
        return all(_always_trimmable(child) for child in layer.caches)
    return type(layer) in _ALWAYS_TRIMMABLE
