"""What kvd-mlx-lm-server relies on in mlx-lm's server, checked before it serves.

The server replaces six names of the mlx_lm.server module, overrides public methods of the
classes behind them and reads a few attributes; a release of mlx-lm may rename or change any of
them. Each is checked against the form the integration is tested with, and a missing or changed
one is an error (MlxLmChangedError) that names the mlx-lm version found and the tested range: the
tier never turns itself off unseen. The tested range is the one kvd-client declares for its
mlx-lm extra (client/pyproject.toml), read from the installed package's metadata.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Final

import mlx_lm
from packaging.specifiers import SpecifierSet

from . import stock_hooks
from .stock_hooks import Hook

log = logging.getLogger("kvd_client")


HOOKS: Final = (
    Hook("mlx_lm.server", "ModelProvider", "__init__", "(self, cli_args)"),
    Hook(
        "mlx_lm.server",
        "ModelProvider",
        "load",
        "(self, model_path, adapter_path=None, draft_model_path=None)",
    ),
    Hook(
        "mlx_lm.server", "LRUPromptCache", "__init__", f"(self, max_size=10, max_bytes={1 << 63})"
    ),
    Hook("mlx_lm.server", "LRUPromptCache", "fetch_nearest_cache", "(self, model, tokens)"),
    Hook(
        "mlx_lm.server",
        "LRUPromptCache",
        "insert_cache",
        "(self, model, tokens, prompt_cache, *, cache_type='assistant')",
    ),
    Hook("mlx_lm.utils", None, "hf_repo_to_path", "(hf_repo)"),
    # The single-request path's generation, called with the prefill hooks (mlx_lm_cache.py).
    Hook(
        "mlx_lm.generate",
        None,
        "stream_generate",
        "(model, tokenizer, prompt, max_tokens=256, draft_model=None, "
        "stream=<ThreadLocalStream>, **kwargs)",
    ),
    Hook(
        "mlx_lm.generate",
        None,
        "generate_step",
        "(prompt, model, stream=<ThreadLocalStream>, *, max_tokens=256, sampler=None, "
        "logits_processors=None, max_kv_size=None, prompt_cache=None, prefill_step_size=2048, "
        "kv_bits=None, kv_group_size=64, quantized_kv_start=5000, "
        "prompt_progress_callback=None, input_embeddings=None)",
    ),
    # A fresh cache (what stock makes on a miss) is told by its layers holding nothing.
    Hook("mlx_lm.models.cache", "_BaseCache", "empty", "(self)"),
    # The batched path's prefill checkpoints (batch_checkpoints.py).
    Hook(
        "mlx_lm.generate",
        "BatchGenerator",
        "__init__",
        "(self, model, *, max_tokens=128, stop_tokens=None, sampler=None, "
        "logits_processors=None, completion_batch_size=32, prefill_batch_size=8, "
        "prefill_step_size=2048, max_kv_size=None, stream=None)",
    ),
    Hook(
        "mlx_lm.generate",
        "BatchGenerator",
        "insert_segments",
        "(self, segments, max_tokens=None, caches=None, all_tokens=None, samplers=None, "
        "logits_processors=None, stop_sequences=None)",
    ),
    Hook("mlx_lm.generate", "BatchGenerator", "next", "(self)"),
    Hook("mlx_lm.generate", "BatchGenerator", "extract_cache", "(self, uids)"),
    Hook("mlx_lm.generate", "BatchGenerator", "remove", "(self, uids, return_prompt_caches=False)"),
    Hook("mlx_lm.generate", "BatchGenerator", "stats", "(self)"),
    Hook(
        "mlx_lm.generate",
        "PromptProcessingBatch.Response",
        "__init__",
        "(self, uid, progress, end_of_segment, end_of_prompt)",
    ),
    # A restored cache joins the batch in place (batch_merge.py).
    Hook("mlx_lm.models.cache", "KVCache", "merge", "(caches)"),
    Hook("mlx_lm.models.cache", "BatchKVCache", "__init__", "(self, left_padding)"),
    Hook("mlx_lm.models.cache", "BatchKVCache", "merge", "(caches)"),
    # A request's hints for kvd (request_hints.py): read from its body by the handler, noted
    # with its prompt as the generation thread tokenizes it (its first result: the tokens).
    Hook("mlx_lm.server", "APIHandler", "handle_chat_completions", "(self)"),
    Hook("mlx_lm.server", "APIHandler", "handle_text_completions", "(self)"),
    Hook(
        "mlx_lm.server",
        None,
        "_run_http_server",
        "(host, port, response_generator, server_class=<type>, handler_class=<type>)",
    ),
    Hook("mlx_lm.server", "ResponseGenerator", "__init__", "(self, model_provider, prompt_cache)"),
    Hook("mlx_lm.server", "ResponseGenerator", "_tokenize", "(self, tokenizer, request, args)"),
    # The warm-up tokenizes a request's body as the server does (warm_up.py).
    Hook(
        "mlx_lm.server",
        "CompletionRequest",
        "__init__",
        "(self, request_type, prompt, messages, tools, role_mapping)",
    ),
)
# Module names of mlx_lm.server replaced before its main() runs, each with the function (or
# method) that must look it up when called (so that it builds or calls the replacement).
REPLACED: Final = {
    "ModelProvider": "main",
    "LRUPromptCache": "run",
    "stream_generate": "ResponseGenerator._serve_single",
    "BatchGenerator": "ResponseGenerator._generate",
    "ResponseGenerator": "run",
    "_run_http_server": "run",
}
# Read from the model provider once it is built: its command line's KV quantisation and what
# it holds after a load.
CLI_ARGS: Final = ("kv_bits", "kv_group_size", "quantized_kv_start")
PROVIDER_ATTRIBUTES: Final = ("cli_args", "model_key", "model", "tokenizer")


class MlxLmChangedError(RuntimeError):
    """mlx-lm's server is not in the form the integration is tested with."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        tested = tested_range_text()
        super().__init__(
            f"kvd-mlx-lm-server does not run on mlx-lm {mlx_lm.__version__}: "
            f"{'; '.join(problems)}. It is tested with mlx-lm{tested}: "
            f"pip install 'mlx-lm{tested}'"
        )


def tested_range() -> SpecifierSet:
    """The mlx-lm versions kvd-client declares for its mlx-lm extra."""
    return stock_hooks.tested_range("mlx-lm")


def tested_range_text() -> str:
    """The tested range as pip takes it, lower bound first: ">=0.32.0,<=0.32.2"."""
    return stock_hooks.range_text(tested_range())


def check_server() -> None:
    """Every name, method and signature of HOOKS and REPLACED; raises MlxLmChangedError listing
    what is missing or changed."""
    found = stock_hooks.problems(HOOKS, {"mlx_lm.server": REPLACED})
    if found:
        raise MlxLmChangedError(found)


def check_cli_args(cli_args: argparse.Namespace) -> None:
    """The options of the server's command line that the identity is made of."""
    missing = [name for name in CLI_ARGS if not hasattr(cli_args, name)]
    if missing:
        raise MlxLmChangedError([f"its command line has no {', '.join(missing)}"])


def check_provider(provider: Any) -> None:
    """The attributes a built model provider must have for the tier to follow it."""
    missing = [name for name in PROVIDER_ATTRIBUTES if not hasattr(provider, name)]
    if missing:
        raise MlxLmChangedError([f"ModelProvider has no {', '.join(missing)}"])


def loaded_paths(model_key: object) -> tuple[str, str | None, str | None]:
    """The model, adapter and draft model that a provider's model_key names after a load."""
    match model_key:
        case (str() as model, str() | None as adapter, str() | None as draft):
            return model, adapter, draft
    raise MlxLmChangedError(
        [f"ModelProvider.model_key is {model_key!r}, not (model_path, adapter_path, draft_path)"]
    )


def warn_if_untested() -> None:
    """A version outside the tested range whose hooks all passed runs, with a warning."""
    if not tested_range().contains(mlx_lm.__version__, prereleases=True):
        log.warning(
            "kvd: mlx-lm %s is outside the range kvd-mlx-lm-server is tested with (mlx-lm%s); "
            "every hook it relies on is in place",
            mlx_lm.__version__,
            tested_range_text(),
        )
