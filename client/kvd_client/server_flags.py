"""The kvd flags of kvd-mlx-lm-server and kvd-vllm-mlx, `--kvd-*`, read before the stock
server (mlx_lm.server, vllm-mlx) reads the rest; the same names and meanings in both.

They follow the daemon's conventions: sizes as `1G`, `512M`, `1.5T` or bytes, durations in
seconds, each parsed by the daemon's own parser (kvd_protocol.quantities) and refused with its
words. Parsing never touches the daemon, so `--help` and a usage error need none.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from kvd_protocol.blocks import check_block_tokens
from kvd_protocol.quantities import duration, format_size, positive_size

from .link import DEFAULT_LOOKUP_TIMEOUT
from .mlx_lm_cache import BACKLOG_BYTES
from .prefill_checkpoints import PROMPT_BYTES, UNIT_TOKENS, CheckpointSettings
from .warm_up import read_prompts

PROG: Final = "kvd-mlx-lm-server"
# Half the library's default block: a conversation's turns each rewrite their tail (half a
# block on average) in the next turn's block; at 128 a 20-turn conversation writes 1.16x its
# final KV, at 256 1.29x (docs/benchmarks.md, "Wear"). Still two blocks per mlx-lm KV step.
SERVER_BLOCK_TOKENS: Final = 128

T = TypeVar("T")


def kvd_flags(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    kvd = parser.add_argument_group("kvd (the shared cold tier under the prompt cache)")
    kvd.add_argument(
        "--kvd-socket",
        default=None,
        metavar="PATH",
        help="the kvd daemon's socket (default: $KVD_SOCKET, else the platform default)",
    )
    kvd.add_argument(
        "--kvd-lookup-timeout",
        type=_as_flag(duration),
        default=DEFAULT_LOOKUP_TIMEOUT,
        metavar="SECONDS",
        help="a lookup not answered this long is a miss, and the daemon is skipped until it "
        f"answers again (default: {DEFAULT_LOOKUP_TIMEOUT})",
    )
    kvd.add_argument(
        "--kvd-namespace",
        default="",
        metavar="NAME",
        help="keep this server's entries apart from others of the same model (default: none)",
    )
    kvd.add_argument(
        "--kvd-block-tokens",
        type=_block_tokens,
        default=SERVER_BLOCK_TOKENS,
        metavar="N",
        help="tokens per block of the caches stored (a power of two in 16..65536; 0: whole "
        "entries). Smaller blocks rewrite less of a growing conversation (each turn's tail "
        "is written again in the next turn's block) in more files "
        f"(default: {SERVER_BLOCK_TOKENS})",
    )
    kvd.add_argument(
        "--kvd-backlog-bytes",
        type=_as_flag(positive_size),
        default=BACKLOG_BYTES,
        metavar="SIZE",
        help="what the snapshots waiting to be sent to kvd may hold; beyond it segments are "
        f"dropped first, then the oldest (default: {format_size(BACKLOG_BYTES)})",
    )
    kvd.add_argument(
        "--kvd-checkpoint-interval",
        type=_tokens,
        default=None,
        metavar="N",
        help="tokens between the prefill checkpoints of a model whose caches cannot be "
        "trimmed (hybrids, sliding windows): a prompt whose end changed restores all but the "
        "last N; a multiple of --kvd-block-tokens, 0: none (default: chosen per model by "
        "cost, the bytes of its state against the prefill time it saves)",
    )
    kvd.add_argument(
        "--kvd-checkpoint-bytes",
        type=_as_flag(positive_size),
        default=PROMPT_BYTES,
        metavar="SIZE",
        help="what the prefill checkpoints of one prompt may write of their own state, with "
        f"the interval chosen by cost (default: {format_size(PROMPT_BYTES)})",
    )
    kvd.add_argument(
        "--kvd-warm-prompts",
        type=_as_flag(read_prompts),
        default=None,
        metavar="FILE",
        help="JSON lines, each a chat request's body (messages, tools, hints): at start, in "
        "the background, each prompt kvd does not hold is prefilled and stored (default: none)",
    )
    return parser


def parse_flags(
    flags: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """The kvd flags and the rest (the stock server's); exits with a usage error for a bad value,
    or a checkpoint interval that is not a multiple of the block size."""
    args, rest = flags.parse_known_args(argv)
    try:
        args.kvd_checkpoints = CheckpointSettings(
            args.kvd_checkpoint_interval, args.kvd_checkpoint_bytes
        )
        args.kvd_checkpoints.check_unit(args.kvd_block_tokens or UNIT_TOKENS)
    except ValueError as exc:
        flags.error(f"--kvd-checkpoint-interval: {exc} (--kvd-block-tokens)")
    return args, rest


def _as_flag(parse: Callable[[str], T]) -> Callable[[str], T]:
    """A setting's parser as an argparse type: its ValueError, its words, as the usage error."""

    def parse_flag(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_flag


def _block_tokens(text: str) -> int:
    try:
        value = int(text)
        return value and check_block_tokens(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not 0 or a power of two in 16..65536 tokens"
        ) from None


def _tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens")
    return value
