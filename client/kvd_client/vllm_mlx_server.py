"""`kvd-vllm-mlx`: stock vllm-mlx's server with kvd as the tier under its prefix cache.

    kvd-vllm-mlx serve MODEL --continuous-batching [vllm-mlx flags] [--kvd-socket PATH]
        [--kvd-namespace NAME] [--kvd-lookup-timeout SECONDS] [--kvd-block-tokens N]
        [--kvd-backlog-bytes SIZE] [--kvd-checkpoint-interval N] [--kvd-checkpoint-bytes SIZE]

The kvd flags are kvd-mlx-lm-server's (server_flags.py), with the same meanings; all else is
vllm-mlx's own command line, read by vllm-mlx.

vllm-mlx's continuous batching keeps a memory-aware prefix cache: it stays the hot tier. Under
it, as under mlx_lm.server's:
- a prompt with no in-memory prefix, or a shorter one than kvd holds, starts from the longest
  usable prefix in kvd, restored in the prefix cache's lookup (which vllm-mlx runs on the
  thread that owns the model);
- every cache vllm-mlx keeps in memory (a finished turn, a hybrid's prompt with its first
  generated token, the pieces of a chunked prefill) is also handed to kvd: snapshotted where
  vllm-mlx stores it, sent by a thread of its own (mlx_lm_cache.ColdTier); a request never
  waits for the daemon. vllm-mlx keys some entries one token past what their caches hold (a
  finished turn's last token was never run through the model): kvd keys them by what the
  caches hold;
- models whose caches cannot be trimmed (hybrids: Qwen3.5, Qwen3-Next, Nemotron-H; sliding
  windows that wrap) get prefill checkpoints and the prompt boundary, as on kvd-mlx-lm-server
  (vllm_mlx_batch.py: the prompt inserted into the batch cut at the checkpoint positions), so
  a prompt whose end changed restores all but the last interval and an exact repeat all but
  its last token; the batch's prefill steps are timed for the tier's cost policy.

The identity is kvd-mlx-lm-server's (model_folder.model_identity: the model folder's content,
the chat template in force, no KV quantisation: vllm-mlx's --kv-cache-quantization quantises
only the copies its memory keeps, and kvd stores the caches as computed), so an entry one
server stored restores on the other where both run the same mlx. With no daemon, or one that
restarts, lookups miss and stores are skipped: the server answers as stock vllm-mlx does. A
hung daemon costs one request the lookup timeout at most (the client's breaker).

Three names are replaced before the server starts: Scheduler in vllm_mlx.engine_core (so the
tier follows the model each engine serves), MemoryAwarePrefixCache and BatchGenerator
(mlx-lm's, for the prefill checkpoints) in vllm_mlx.scheduler. The paged and block-aware
caches, the multimodal scheduler, a registry of several models and vllm-mlx's own SSD tier are
refused with a usage error: the tier is under the memory-aware cache of one text model. What
this relies on is checked at start (vllm_mlx_hooks.py): a missing or changed hook stops the
server with an error naming the vllm-mlx version found and the tested range. SIGTERM stops the
server as vllm-mlx's does (uvicorn's shutdown), and the snapshots still waiting are sent before
the process exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial
from types import FrameType
from typing import Any, Final

from vllm_mlx import cli as _cli
from vllm_mlx import engine_core as _engine_core
from vllm_mlx import scheduler as _scheduler

from . import vllm_mlx_hooks
from .client import Client
from .model_folder import model_identity
from .request_cache import RequestCache
from .server_flags import kvd_flags, parse_flags
from .server_tier import ServerTier, exit_without_teardown, storable
from .vllm_mlx_batch import TieredBatchGenerator
from .vllm_mlx_hooks import VllmMlxChangedError

log = logging.getLogger("kvd_client")

try:
    vllm_mlx_hooks.check_server()
except VllmMlxChangedError as changed:
    raise SystemExit(str(changed)) from None

# vllm-mlx ships no type hints for these: treated as untyped.
stock_cli: Any = _cli
stock_engine_core: Any = _engine_core
stock_scheduler: Any = _scheduler

PROG: Final = "kvd-vllm-mlx"


class TieredMemoryCache(stock_scheduler.MemoryAwarePrefixCache):  # type: ignore[misc]
    """vllm-mlx's memory-aware prefix cache, with kvd under it."""

    def __init__(self, model: Any, config: Any = None, *, tier: ServerTier) -> None:
        super().__init__(model, config)
        vllm_mlx_hooks.check_cache(self)
        self.tier = tier
        self._served = model

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """The caches of the longest prefix of tokens memory or kvd holds, as a RequestCache
        (vllm_mlx_batch.py continues its request's prefill), and the tokens still to run."""
        cache, rest = super().fetch(tokens)
        cached = 0 if cache is None else len(tokens) - len(rest)
        cold = self.tier.serving(self._served)
        if cold is None or not storable(tokens):
            return cache, rest
        restored = None
        if cached < len(tokens) - 1:
            started = time.perf_counter()
            restored = cold.restore(tokens, min_tokens=cached + 1)
        if restored is None:
            return (None if cache is None else RequestCache(cache, list(tokens), cached)), rest
        took = (time.perf_counter() - started) * 1000
        log.info(
            "kvd: restored %d of %d prompt tokens in %.1f ms", restored.matched, len(tokens), took
        )
        # A prefix hit to the scheduler; no key: the entry is not one of memory's to evict.
        self._last_match_type, self._last_matched_key = "prefix", None
        matched = restored.matched
        return RequestCache(restored.cache, list(tokens), matched), list(tokens[matched:])

    def store(self, tokens: list[int], cache: list[Any], evict_prefixes: bool = True) -> bool:
        cold = self.tier.serving(self._served)
        held = held_tokens(cache, len(tokens))
        if cold is not None and held and storable(tokens):
            cold.store(tokens[:held], cache)  # a snapshot now: memory may evict it at once
        stored: bool = super().store(tokens, cache, evict_prefixes)
        return stored


class TieredScheduler(stock_scheduler.Scheduler):  # type: ignore[misc]
    """vllm-mlx's scheduler, telling the tier which model it serves before it builds its
    prefix cache (an engine is built per model load)."""

    def __init__(self, model: Any, tokenizer: Any, config: Any = None, *, tier: ServerTier):
        try:
            identity = model_identity(model, tokenizer, tier.namespace)
        except (OSError, ValueError) as exc:
            tier.model_unusable(model, f"no identity for the model: {exc}")
        else:
            tier.model_loaded(model, model, tokenizer, identity)
        super().__init__(model, tokenizer, config)


def held_tokens(cache: Sequence[Any], tokens: int) -> int:
    """How many of an entry's tokens its caches hold: vllm-mlx keys a finished turn by all of
    its tokens, the last never run through the model. The layers that count tokens tell
    (a recurrent state does not); 0 when they hold more than the key."""
    offsets = [layer.offset for layer in cache if isinstance(getattr(layer, "offset", None), int)]
    held = max(offsets, default=tokens)
    return held if held <= tokens else 0


def refused(options: argparse.Namespace) -> str | None:
    """Why the tier cannot sit under the prefix cache these serve options build, if so."""
    if options.command != "serve":
        return f"{PROG} runs vllm-mlx's serve command only"
    if not options.continuous_batching:
        return "the tier is under the prefix cache of --continuous-batching: add it"
    reasons = {
        "disable_prefix_cache": "--disable-prefix-cache leaves no prefix cache to be under",
        "use_paged_cache": "--use-paged-cache: the tier is under the memory-aware cache",
        "no_memory_aware_cache": "--no-memory-aware-cache: the tier is under that cache",
        "ssd_cache_dir": "--ssd-cache-dir: kvd is the tier under the prefix cache",
        "models_config": "--models-config: the tier serves one model",
        "mllm": "--mllm: the tier serves text models",
    }
    return next((why for name, why in reasons.items() if getattr(options, name)), None)


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Before uvicorn serves, and after: it raises the signal it caught again once it shut
    down, which ends the process unless handled (the tier then never closes)."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    flags = kvd_flags(PROG)
    args, rest = parse_flags(flags, sys.argv[1:] if argv is None else argv)
    sys.argv = ["vllm-mlx", *rest]
    if "-h" in rest or "--help" in rest:
        flags.print_help()
        print()
    options = stock_cli.create_parser().parse_args(rest)  # vllm-mlx's help and usage errors
    try:
        vllm_mlx_hooks.check_serve_options(options)
    except VllmMlxChangedError as changed:
        raise SystemExit(str(changed)) from None
    why = refused(options)
    if why is not None:
        flags.error(why)
    vllm_mlx_hooks.warn_if_untested()
    client = Client.connect(
        args.kvd_socket,
        name=PROG,
        lookup_timeout=args.kvd_lookup_timeout,
        block_tokens=args.kvd_block_tokens,
    )
    tier = ServerTier(client, args.kvd_namespace, args.kvd_backlog_bytes, args.kvd_checkpoints)
    stock_engine_core.Scheduler = partial(TieredScheduler, tier=tier)
    stock_scheduler.MemoryAwarePrefixCache = partial(TieredMemoryCache, tier=tier)
    stock_scheduler.BatchGenerator = partial(TieredBatchGenerator, tier=tier)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        stock_cli.serve_command(options)
    except KeyboardInterrupt:
        pass  # SIGINT or SIGTERM: uvicorn shut the server down, or it had not started
    finally:
        tier.close()
    exit_without_teardown()


if __name__ == "__main__":
    main()
