"""What kvd-vllm-mlx relies on in vllm-mlx, checked before it serves.

The server replaces three names of vllm-mlx's modules (the scheduler class the engine builds,
the prefix cache class and mlx-lm's batch generator class the scheduler builds), overrides the
prefix cache's fetch and store and the batch generator's insert, steps and removal, and reads
the serve command's options. A release of vllm-mlx may rename or change any of them:
each is checked against the form the integration is tested with, and a missing or changed one
is an error (VllmMlxChangedError) that names the vllm-mlx version found and the tested range,
the range kvd-client declares for its vllm-mlx extra (client/pyproject.toml).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any, Final

import vllm_mlx
from packaging.specifiers import SpecifierSet

from . import stock_hooks
from .stock_hooks import Hook

log = logging.getLogger("kvd_client")

# What BatchGenerator.insert and insert_segments take after their prompts.
_INSERTED: Final = (
    "max_tokens=None, caches=None, all_tokens=None, samplers=None, logits_processors=None, "
    "state_machines=None"
)
HOOKS: Final = (
    Hook("vllm_mlx.cli", None, "create_parser", "()"),
    Hook("vllm_mlx.cli", None, "serve_command", "(args)"),
    Hook("vllm_mlx.scheduler", "Scheduler", "__init__", "(self, model, tokenizer, config=None)"),
    Hook(
        "vllm_mlx.memory_cache", "MemoryAwarePrefixCache", "__init__", "(self, model, config=None)"
    ),
    Hook("vllm_mlx.memory_cache", "MemoryAwarePrefixCache", "fetch", "(self, tokens)"),
    Hook(
        "vllm_mlx.memory_cache",
        "MemoryAwarePrefixCache",
        "store",
        "(self, tokens, cache, evict_prefixes=True)",
    ),
    # mlx-lm's BatchGenerator as the scheduler builds and drives it (its insert calls
    # insert_segments), and the responses of its prompt steps: vllm_mlx_batch.py.
    Hook("vllm_mlx.scheduler", "BatchGenerator", "insert", f"(self, prompts, {_INSERTED})"),
    Hook(
        "vllm_mlx.scheduler",
        "BatchGenerator",
        "insert_segments",
        f"(self, segments, {_INSERTED})",
    ),
    Hook("vllm_mlx.scheduler", "BatchGenerator", "next", "(self)"),
    Hook("vllm_mlx.scheduler", "BatchGenerator", "extract_cache", "(self, uids)"),
    Hook(
        "vllm_mlx.scheduler", "BatchGenerator", "remove", "(self, uids, return_prompt_caches=False)"
    ),
    Hook("vllm_mlx.scheduler", "BatchGenerator", "_make_new_cache", "(self)"),
    Hook(
        "mlx_lm.generate",
        "PromptProcessingBatch.Response",
        "__init__",
        "(self, uid, progress, end_of_segment, end_of_prompt)",
    ),
)
# Per module: the names replaced before the server starts, each with the method that must look
# it up when called (so that it builds the replacement).
REPLACED: Final = {
    "vllm_mlx.engine_core": {"Scheduler": "EngineCore.__init__"},
    "vllm_mlx.scheduler": {
        "MemoryAwarePrefixCache": "Scheduler.__init__",
        "BatchGenerator": "Scheduler._create_batch_generator",
    },
}
# The serve command's options that decide whether the prefix cache kvd sits under is built.
SERVE_OPTIONS: Final = (
    "command",
    "continuous_batching",
    "enable_prefix_cache",
    "disable_prefix_cache",
    "use_paged_cache",
    "no_memory_aware_cache",
    "ssd_cache_dir",
    "models_config",
    "mllm",
)
# What a fetch of the prefix cache tells the scheduler besides its answer.
CACHE_ATTRIBUTES: Final = ("_last_match_type", "_last_matched_key")


class VllmMlxChangedError(RuntimeError):
    """vllm-mlx is not in the form the integration is tested with."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        tested = tested_range_text()
        super().__init__(
            f"kvd-vllm-mlx does not run on vllm-mlx {vllm_mlx.__version__}: "
            f"{'; '.join(problems)}. It is tested with vllm-mlx{tested}: "
            f"pip install 'vllm-mlx{tested}'"
        )


def tested_range() -> SpecifierSet:
    """The vllm-mlx versions kvd-client declares for its vllm-mlx extra."""
    return stock_hooks.tested_range("vllm-mlx")


def tested_range_text() -> str:
    return stock_hooks.range_text(tested_range())


def check_server() -> None:
    """Every name, method and signature of HOOKS and REPLACED; raises VllmMlxChangedError
    listing what is missing or changed."""
    found = stock_hooks.problems(HOOKS, REPLACED)
    if found:
        raise VllmMlxChangedError(found)


def check_serve_options(options: argparse.Namespace) -> None:
    missing = [name for name in SERVE_OPTIONS if not hasattr(options, name)]
    if missing:
        raise VllmMlxChangedError([f"its serve command has no {', '.join(missing)}"])


def check_cache(cache: Any) -> None:
    """The attributes a built prefix cache must have for a restore to be told as a hit."""
    check_attributes(cache, CACHE_ATTRIBUTES, "MemoryAwarePrefixCache")


def check_attributes(built: Any, names: Sequence[str], what: str) -> None:
    """The attributes an object built (what names its class) must have."""
    missing = [name for name in names if not hasattr(built, name)]
    if missing:
        raise VllmMlxChangedError([f"{what} has no {', '.join(missing)}"])


def warn_if_untested() -> None:
    """A version outside the tested range whose hooks all passed runs, with a warning."""
    if not tested_range().contains(vllm_mlx.__version__, prereleases=True):
        log.warning(
            "kvd: vllm-mlx %s is outside the range kvd-vllm-mlx is tested with (vllm-mlx%s); "
            "every hook it relies on is in place",
            vllm_mlx.__version__,
            tested_range_text(),
        )
