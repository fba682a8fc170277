"""`kvd-mlx-lm-server`: stock `mlx_lm.server` with kvd as the tier under its prompt cache.

    kvd-mlx-lm-server --model PATH [mlx_lm.server flags] [--kvd-socket PATH] [--kvd-namespace NAME]
        [--kvd-lookup-timeout SECONDS] [--kvd-block-tokens N] [--kvd-backlog-bytes SIZE]
        [--kvd-checkpoint-interval N] [--kvd-checkpoint-bytes SIZE] [--kvd-warm-prompts FILE]

Its flags (server_flags.py) take sizes and durations as the daemon does (`1G`; seconds).

mlx_lm.server keeps an LRU prompt cache in memory: it stays the hot tier. Under it:
- a prompt with no in-memory prefix, or a shorter one than kvd holds, starts from the longest
  usable prefix in kvd (restored on the generation thread, which owns the MLX stream);
- every cache the server keeps in memory (finished prompt + generation, and the system and user
  segment boundaries the batched path cuts) is also handed to kvd: snapshotted on the generation
  thread (only the rows kvd's blocks do not hold yet are copied; a segment of caches that always
  trim keeps its whole blocks only: the finished turn serves its prefixes), sent by a thread of
  its own; a request never waits for the daemon. So an entry the memory tier evicts is not
  lost, and other server processes of the same model find it;
- models whose caches cannot be trimmed (hybrids: Qwen3.5, Qwen3-Next, Nemotron-H, LFM2; sliding
  windows that wrap) get prefill checkpoints on both paths (prefill_checkpoints.py): the
  prefill stores the caches every N tokens and at the prompt boundary, so a prompt whose end
  changed restores all but the last N tokens, and an exact repeat all but the last token. N
  is chosen per model by cost (a checkpoint writes the model's state, which for Qwen3-Next-80B
  is about 74 MiB, against the prefill time it saves) or set; the KV rows are the blocks the
  checkpoints share, written once;
- a request's hints (request_hints.py: `cache_control` on its messages,
  `prompt_cache_retention`, the `kvd` object) ask kvd to retain its prompt or a prefix of
  it, or to store nothing of it; the stores of its caches follow them (prompt_hints.py). A
  malformed hint is answered 400, as any bad field;
- `--kvd-warm-prompts FILE` prefills the prompts of FILE that kvd does not hold yet, in the
  background once the server answers (warm_up.py);
- the usage block's `cached_tokens` counts restored tokens too, since the server counts what the
  cache it gets back holds.

The identity is the model folder's content (model_folder.py), the KV quantisation and the
adapter. Prompts with images (negative ids in the cache key) stay in memory only. With no
daemon, or one that restarts, lookups miss and stores are skipped (counted in ColdTier.stats,
reconnecting by itself): the server answers as stock mlx_lm.server does. A hung daemon costs
one request the lookup timeout at most: the client's breaker then skips it until a probe
finds it answering, and the stores, on a connection of their own, never hold up a restore.

Six names in the mlx_lm.server module are replaced before its main() runs: LRUPromptCache (its
run() builds the cache from it), ModelProvider (so the tier follows the model loaded), for
the prefill checkpoints BatchGenerator (batch_checkpoints.py) and stream_generate (the
single-request path's), and for the requests' hints ResponseGenerator and _run_http_server
(given the handler that reads them). All else, flags, HTTP API and batching, is
mlx_lm.server's own. What this relies on in mlx-lm is checked at start (mlx_lm_hooks.py): a
missing or changed hook stops the server with an error naming the mlx-lm version found and
the tested range. SIGTERM stops the server as Ctrl-C does, and the snapshots still waiting
are sent before the process exits.
"""

from __future__ import annotations

import argparse
import copy
import logging
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any, Final, NoReturn

import mlx_lm
from kvd_protocol.tokens import common_prefix_tokens, pack_tokens
from mlx_lm import server as _server
from mlx_lm import utils as _utils

from . import mlx_lm_hooks
from .backlog import Kind
from .batch_checkpoints import BatchCheckpoints
from .batch_merge import merge_in_place
from .client import Client
from .identity import EngineIdentity
from .mlx_lm_cache import ColdTier
from .mlx_lm_hooks import MlxLmChangedError
from .model_folder import KvQuantization, folder_identity
from .prompt_hints import PLAIN
from .request_cache import RequestCache, request_tokens
from .request_hints import NO_HINTS, Hints, read_hints
from .server_flags import PROG, kvd_flags, parse_flags
from .server_tier import ServerTier, exit_without_teardown, storable
from .warm_up import WARM_UP_HEADER, Served, WarmUp, server_url

log = logging.getLogger("kvd_client")

# Before the classes below subclass what it checks: this module is the server program, which
# does not start on an mlx-lm whose surface it does not know.
try:
    mlx_lm_hooks.check_server()
except MlxLmChangedError as changed:
    raise SystemExit(str(changed)) from None

# mlx-lm's partial type hints do not cover these: treated as untyped.
stock: Any = _server
mlx_lm_utils: Any = _utils

HINTS_ATTRIBUTE: Final = "kvd_hints"  # a completion request's hints (TieredAPIHandler)
_RUN_HTTP_SERVER: Final = stock._run_http_server  # stock's, called with the handler's class


class TieredPromptCache(stock.LRUPromptCache):  # type: ignore[misc]
    """mlx_lm's in-memory LRU prompt cache, with kvd under it."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, tier: ServerTier) -> None:
        super().__init__(max_size, max_bytes)
        self.tier = tier

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = self._nearest(model, tokens)
        if cache is None or self.tier.cold_tier(model) is None:
            return cache, rest
        # A copy: the single-request path appends the tokens it generates to the list.
        return RequestCache(cache, list(tokens), len(tokens) - len(rest)), rest

    def _nearest(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        cached = len(tokens) - len(rest)
        cold = self.tier.cold_tier(model)
        if cold is None or cached >= len(tokens) - 1 or not storable(tokens):
            return cache, rest
        started = time.perf_counter()
        restored = cold.restore(tokens, min_tokens=cached + 1)
        if restored is None:
            return cache, rest
        took = (time.perf_counter() - started) * 1000
        log.info(
            "kvd: restored %d of %d prompt tokens in %.1f ms", restored.matched, len(tokens), took
        )
        merge_in_place(restored.cache)  # the batched path takes its buffers, room and all
        return restored.cache, tokens[restored.matched :]

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        cold = self.tier.cold_tier(model)
        hints = self.tier.hints.for_store(tokens) if cold is not None else PLAIN
        if cold is not None and tokens and storable(tokens) and hints.store:
            # A snapshot now (memory may evict it at once); the system and user segments of
            # a prompt are prefixes of the request's finished turn.
            kind = Kind.TURN if cache_type == "assistant" else Kind.SEGMENT
            cold.store(tokens, prompt_cache, kind=kind, retention=hints.retention)
        if hints.memory:  # the layers alone: memory keeps no request's tokens beside them
            super().insert_cache(model, tokens, list(prompt_cache), cache_type=cache_type)


def tiered_stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: Any,
    max_tokens: int = 256,
    draft_model: Any = None,
    *,
    tier: ServerTier,
    **kwargs: Any,
) -> Iterator[Any]:
    """mlx-lm's stream_generate as mlx_lm.server's single-request path calls it, with the
    rest of the prompt and the caches its lookup of the prompt cache returned (a RequestCache)
    or a fresh one: for a model the tier serves, its prefill stores prefill checkpoints and
    the prompt boundary, as the batched path does, and its prefill rate is measured. Anything
    else (a draft model, input embeddings, a prompt that is not the request's rest, a request
    that stores nothing) is stock's own."""
    cold = tier.serving(model)
    cache: Any = kwargs.get("prompt_cache")
    plain = draft_model is None and kwargs.get("input_embeddings") is None
    request = request_tokens(prompt, cache) if cold is not None and plain else None
    if request is not None and not tier.hints.for_store(request[0]).store:
        request = None
    if cold is None or request is None:
        return mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
    tokens, start = request
    called, kwargs["prompt_progress_callback"] = cold.prefill_hooks(
        tokens, start, cache, kwargs.get("prompt_progress_callback")
    )
    return _measured(cold, mlx_lm.stream_generate(called, tokenizer, prompt, max_tokens, **kwargs))


def _measured(cold: ColdTier, responses: Iterator[Any]) -> Iterator[Any]:
    """responses, the first one's prefill told to the tier."""
    first = next(responses, None)
    if first is not None:
        cold.measured_prefill(first)
        yield first
        yield from responses


class TieredBatchGenerator(stock.BatchGenerator):  # type: ignore[misc]
    """mlx-lm's BatchGenerator, storing prefill checkpoints (batch_checkpoints.py) of the
    sequences of a model the tier serves, and measuring its prefill rate for the tier."""

    def __init__(self, model: Any, *args: Any, tier: ServerTier, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self.tier = tier
        self._checkpoints = BatchCheckpoints()

    def insert_segments(  # noqa: PLR0917 - mlx-lm's signature (mlx_lm_hooks.HOOKS)
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[Any] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[Any] | None = None,
        stop_sequences: list[Any] | None = None,
    ) -> list[int]:
        insert = partial(
            super().insert_segments,
            max_tokens=max_tokens,
            caches=caches,
            all_tokens=all_tokens,
            samplers=samplers,
            logits_processors=logits_processors,
            stop_sequences=stop_sequences,
        )
        cold = self.tier.serving(self.model)
        cached = all_tokens or [[] for _ in segments]
        layers = caches or [None for _ in segments]
        if cold is None or not len(segments) == len(cached) == len(layers):
            return list(insert(segments))  # stock's own, and its errors
        cuts = [
            self._checkpoints.cut(cold, segment, tokens, cache)
            for segment, tokens, cache in zip(segments, cached, layers, strict=True)
        ]
        uids: list[int] = insert([cut for cut, _ in cuts])
        for uid, tokens, (_, at) in zip(uids, cached, cuts, strict=True):
            self._checkpoints.inserted(uid, len(tokens), at)
        return uids

    def next(self) -> tuple[list[Any], list[Any]]:
        with self.stats() as step:
            prompt_responses, generation_responses = super().next()
        cold = self.tier.serving(self.model)
        if cold is None:
            return prompt_responses, generation_responses
        if step.prompt_tokens:
            self._checkpoints.measured(cold, step.prompt_tokens, step.prompt_time)
        reached = self._checkpoints.reached(prompt_responses)
        if reached:
            for uid, (cache, tokens) in self.extract_cache(list(reached)).items():
                hints = self.tier.hints.for_store(tokens)
                if len(tokens) == reached[uid] and hints.store:
                    kind = Kind.PREFILL_CHECKPOINT
                    cold.store(tokens[:], cache, kind=kind, retention=hints.retention)
        return prompt_responses, generation_responses

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        self._checkpoints.forget(uids)
        return super().remove(uids, return_prompt_caches)


class TieredResponseGenerator(stock.ResponseGenerator):  # type: ignore[misc]
    """mlx_lm.server's response generator, noting each request's prompt with the hints its
    body gave (TieredAPIHandler) as the generation thread tokenizes it (prompt_hints.py); and
    starting the warm-up, if there is one (warm_up.py)."""

    def __init__(
        self,
        model_provider: Any,
        prompt_cache: Any,
        *,
        tier: ServerTier,
        warm_up: WarmUp | None = None,
    ) -> None:
        self.tier = tier  # first: the generation thread starts within __init__
        super().__init__(model_provider, prompt_cache)
        if warm_up is not None:
            warm_up.start(Served(self._identity, self.prompt_tokens))

    def _identity(self) -> EngineIdentity | None:
        """The identity of the model the tier serves now (None before one is loaded)."""
        model = getattr(self.model_provider, "model", None)
        cold = None if model is None else self.tier.serving(model)
        return None if cold is None else cold.identity

    def prompt_tokens(self, body: dict[str, Any]) -> list[int]:
        """The prompt of a chat request's body, as the generation thread tokenizes it (on a
        copy: stock's tokenizing rewrites the messages' content in place)."""
        request = stock.CompletionRequest(
            "chat",
            "",
            copy.deepcopy(body["messages"]),
            body.get("tools") or None,
            body.get("role_mapping"),
        )
        args = SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
        tokenized = super()._tokenize(self.model_provider.tokenizer, request, args)
        return list(tokenized[0])

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        tokenized = super()._tokenize(tokenizer, request, args)
        prompt = tokenized[0]
        hints = getattr(request, HINTS_ATTRIBUTE, NO_HINTS)
        through = partial(self._through, tokenizer, request, args, prompt)
        self.tier.hints.noted(prompt, hints, through)
        return tokenized

    def _through(
        self, tokenizer: Any, request: Any, args: Any, prompt: list[int], index: int
    ) -> int:
        """The tokens of the prompt's prefix through message index: what the chat template
        makes of the messages up to it, as far as that agrees with the prompt (the whole
        prompt without a chat template)."""
        if request.request_type != "chat" or not tokenizer.has_chat_template:
            return len(prompt)
        template_args = dict(self.model_provider.cli_args.chat_template_args)
        template_args.update(args.chat_template_kwargs or {})
        through = tokenizer.apply_chat_template(
            request.messages[: index + 1],
            add_generation_prompt=False,
            tools=request.tools,
            tokenize=True,
            **template_args,
        )
        return common_prefix_tokens(pack_tokens(through), pack_tokens(prompt))


class TieredAPIHandler(stock.APIHandler):  # type: ignore[misc]
    """mlx_lm.server's request handler, reading a completion request's hints for kvd
    (request_hints.py) from its body: a malformed one is the 400 of any bad field (the
    ValueError goes to stock's own answer)."""

    def handle_chat_completions(self) -> Any:
        return _hinted(super().handle_chat_completions(), self._hints())

    def handle_text_completions(self) -> Any:
        return _hinted(super().handle_text_completions(), self._hints())

    def _hints(self) -> Hints:
        hints = read_hints(self.body)
        return replace(hints, memory=False) if self.headers.get(WARM_UP_HEADER) else hints


def _hinted(request: Any, hints: Hints) -> Any:
    """The request, carrying hints to the generation thread (which tokenizes it)."""
    setattr(request, HINTS_ATTRIBUTE, hints)
    return request


class TieredModelProvider(stock.ModelProvider):  # type: ignore[misc]
    """mlx_lm.server's model provider, telling the tier which model is loaded. It follows the
    public load(): after one that changed model_key or the model itself (a reload), the tier
    is told of the model now loaded. stop is called, on the thread that loaded, with a load
    whose outcome is not in the form checked at start; it does not return."""

    def __init__(
        self,
        cli_args: argparse.Namespace,
        *,
        tier: ServerTier,
        stop: Callable[[MlxLmChangedError], NoReturn],
    ) -> None:
        mlx_lm_hooks.check_cli_args(cli_args)
        # Set first: some mlx-lm versions load the default model within __init__.
        self.tier = tier
        self._stop = stop
        # Weakly: a model replaced must be freed before the next one loads.
        self._told: tuple[object, weakref.ref[Any] | None] = (None, None)
        super().__init__(cli_args)
        mlx_lm_hooks.check_provider(self)
        mlx_lm_hooks.warn_if_untested()

    def load(
        self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None
    ) -> tuple[Any, Any]:
        loaded: tuple[Any, Any] = super().load(model_path, adapter_path, draft_model_path)
        key, model = self._told
        if self.model_key != key or model is None or model() is not self.model:
            self._tell_tier()
        return loaded

    def _tell_tier(self) -> None:
        try:
            model_path, adapter_path, draft_model_path = mlx_lm_hooks.loaded_paths(self.model_key)
        except MlxLmChangedError as changed:
            self._stop(changed)
        self._told = (self.model_key, weakref.ref(self.model))
        if draft_model_path is not None:
            self.tier.model_unusable(self.model_key, "speculative decoding is not supported")
            return
        try:
            identity = self._identity(model_path, adapter_path)
        except (OSError, ValueError) as exc:
            self.tier.model_unusable(self.model_key, f"no identity for {model_path}: {exc}")
            return
        self.tier.model_loaded(self.model_key, self.model, self.tokenizer, identity)

    def _identity(self, model_path: str, adapter_path: str | None) -> EngineIdentity:
        folder, source = Path(model_path), None
        if not folder.exists():  # a Hugging Face repository: mlx_lm.load fetched it already
            folder, source = mlx_lm_utils.hf_repo_to_path(model_path), model_path
        args = self.cli_args
        return folder_identity(
            folder,
            chat_template=getattr(self.tokenizer, "chat_template", None),
            kv=KvQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start),
            adapter_dir=Path(adapter_path) if adapter_path else None,
            namespace=self.tier.namespace,
            source=source,
        )


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # mlx_lm.server shuts down cleanly on it


def _exit_changed(changed: MlxLmChangedError) -> NoReturn:
    """End the process at once, from whichever thread found the change, the message its
    last line. Nothing is lost: the tier is told of a model only once it passed the check.
    Not through mlx_lm.server's own shutdown: an interrupt that lands while its HTTP server
    starts leaves that waiting for a serve_forever that never ran."""
    exit_without_teardown(1, str(changed))


def main(argv: Sequence[str] | None = None) -> None:
    flags = kvd_flags()
    args, rest = parse_flags(flags, sys.argv[1:] if argv is None else argv)
    sys.argv = [PROG, *rest]
    if "-h" in rest or "--help" in rest:
        flags.print_help()
        print()
        stock.main()  # prints mlx_lm.server's own flags and exits, with no daemon asked
        return
    client = Client.connect(
        args.kvd_socket,
        name=PROG,
        lookup_timeout=args.kvd_lookup_timeout,
        block_tokens=args.kvd_block_tokens,
    )
    tier = ServerTier(client, args.kvd_namespace, args.kvd_backlog_bytes, args.kvd_checkpoints)
    stock.ModelProvider = partial(TieredModelProvider, tier=tier, stop=_exit_changed)
    stock.LRUPromptCache = partial(TieredPromptCache, tier=tier)
    stock.stream_generate = partial(tiered_stream_generate, tier=tier)
    stock.BatchGenerator = partial(TieredBatchGenerator, tier=tier)
    warm = None
    if args.kvd_warm_prompts:
        warm = WarmUp(args.kvd_warm_prompts, server_url(rest), args.kvd_socket)
    stock.ResponseGenerator = partial(TieredResponseGenerator, tier=tier, warm_up=warm)
    stock._run_http_server = partial(_RUN_HTTP_SERVER, handler_class=TieredAPIHandler)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        stock.main()
    except MlxLmChangedError as changed:  # from the model provider's checks, before serving
        _exit_changed(changed)
    finally:
        tier.close()
    exit_without_teardown()


if __name__ == "__main__":
    main()
