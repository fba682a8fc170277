"""kvd-mlx-lm-server under load, each part against an anchor measured in the same run.

- decode: --streams concurrent streams on the batched path, each a --system-tokens system
  prompt (prefilled once beforehand, from memory after) and a short user message of its own;
  they end one after another, every --step tokens, so the longest keeps decoding while the
  others end and the server snapshots their caches. Per server, stock mlx_lm.server (anchor)
  and kvd-mlx-lm-server storing every request's caches: the longest stream's decode tokens/s
  (goal: kvd >= 0.95x stock), and its stall: the longest gap between two of its chunks once
  every stream has its first token, less the median gap; --repeat rounds in each server, the
  median and the spread.
- wear: one --turns-turn conversation on the --wear-shape model (the tiny one by default;
  --block-tokens: the server's kvd block size), each turn a new user message of
  --turn-tokens and a short answer: the bytes kvd wrote (status: bytes_written of every
  identity) over the KV bytes of the final context (goal <= 1.25x).
- burst: --burst concurrent conversations of --burst-tokens each, then the server stopped
  (SIGTERM: what waits is sent first) and started again, and each conversation's next turn
  sent: how many start from their whole last turn (restored tokens against the tokens of
  its prompt and answer that the next prompt repeats, as the tokenizer makes them).

Decode and burst use the kv8b shape (an 8B model's KV: 512 MiB at 2k tokens; see
_server_streams.py). Each kvd-mlx-lm-server's exit summary is printed as it logged it.
OpenBLAS is preloaded when installed, as bench/ttft.py does.

    .venv/bin/python bench/server_load.py [--parts decode wear burst] [--system-tokens 2048]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from _daemon import Daemon, running_daemon
from _server_streams import (
    SHAPES,
    HttpServer,
    Timed,
    chat,
    chat_request,
    exit_summary,
    http_server,
    identity_writes,
    kv_bytes_per_token,
    model_folder,
    print_table,
    timed_stream,
    user_message,
)
from transformers import AutoTokenizer
from ttft import use_openblas

SERVER_FLAGS = ("--prompt-cache-size", "4")  # both servers: at most 4 caches in memory
PARTS = ("decode", "wear", "burst")
DECODE_HEADER = [
    *("server", "tokens/s (spread)", "× stock", "stall ms (spread)"),
    "gen. thread ms per snapshot (logged)",
]
WEAR_HEADER = [
    "turns",
    "final context tokens",
    "its KV MiB",
    "kvd wrote MiB",
    "× its KV",
    "written per request KiB (logged)",
]
BURST_HEADER = [
    "conversations",
    "last turn tokens (median)",
    "resumed whole",
    "in part",
    "from nothing",
    "restored / last turns' tokens",
    "snapshots dropped (logged)",
]

Messages = list[dict[str, str]]


@contextmanager
def kvd_server(
    model: Path, log: Path, daemon: Daemon | None, flags: Sequence[str] = ()
) -> Iterator[HttpServer]:
    """A server of model, stock with no daemon; its exit summary is printed once it stopped."""
    socket = None if daemon is None else daemon.socket_path
    with http_server(model, log, kvd_socket=socket, extra=[*SERVER_FLAGS, *flags]) as server:
        yield server
        server.stop()
    for line in server.logs().splitlines():
        if "kvd: " in line and "superseded before sending" in line:
            print(f"  [{log.stem}] {line.strip()}")


def _greedy(server: HttpServer, messages: Messages, max_tokens: int) -> Timed:
    return timed_stream(server, chat_request(messages, max_tokens))


# --- decode ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decode:
    rate: float  # the longest stream's tokens/s after its first
    stall: float  # seconds: its longest gap once every stream has its first token, less median


def concurrent_streams(server: HttpServer, args: argparse.Namespace) -> list[Decode]:
    """--repeat rounds of --streams streams, the system prompt prefilled once before."""
    system = {"role": "system", "content": user_message(args.system_tokens - 6, 7)["content"]}
    _greedy(server, [system, user_message(8, 0)], 1)
    lengths = [args.step * (k + 1) for k in range(args.streams)]
    rounds = []
    for round_ in range(args.repeat):
        seeds = range(100 + round_ * args.streams, 100 + (round_ + 1) * args.streams)
        conversations = [[system, user_message(32, seed)] for seed in seeds]
        with ThreadPoolExecutor(args.streams) as pool:
            streams = list(pool.map(partial(_greedy, server), conversations, lengths))
        longest = streams[-1]
        all_running = max(s.started + s.first_chunk for s in streams)
        times = [longest.started + t for t in longest.chunks]
        gaps = [b - a for a, b in itertools.pairwise(times) if a >= all_running]
        rounds.append(Decode(longest.rate, max(gaps) - statistics.median(gaps)))
    return rounds


def decode_rows(
    model: Path, daemon: Daemon, logs: Path, args: argparse.Namespace
) -> list[list[str]]:
    with kvd_server(model, logs / "decode-stock.log", None) as server:
        stock = concurrent_streams(server, args)
    with kvd_server(model, logs / "decode-kvd.log", daemon) as server:
        tiered = concurrent_streams(server, args)
    snapshots = exit_summary(server).snapshot_cell()
    anchor = statistics.median(d.rate for d in stock)
    return [
        ["stock mlx_lm.server (anchor)", *_decode_cells(stock, anchor), ""],
        ["kvd-mlx-lm-server, storing every request", *_decode_cells(tiered, anchor), snapshots],
    ]


def _decode_cells(rounds: list[Decode], anchor: float) -> list[str]:
    """Median (and spread) of the rounds' rates, its ratio to anchor, and their stalls."""
    rates = [d.rate for d in rounds]
    stalls = [d.stall * 1000 for d in rounds]
    median = statistics.median(rates)
    return [
        f"{median:.2f} ({min(rates):.2f}-{max(rates):.2f})",
        f"{median / anchor:.2f}",
        f"{statistics.median(stalls):,.0f} ({min(stalls):,.0f}-{max(stalls):,.0f})",
    ]


# --- wear ------------------------------------------------------------------------------------


def wear_row(model: Path, daemon: Daemon, logs: Path, args: argparse.Namespace) -> list[str]:
    messages: Messages = []
    flags = [] if args.block_tokens is None else ["--kvd-block-tokens", str(args.block_tokens)]
    with kvd_server(model, logs / "wear.log", daemon, flags) as server:
        for turn in range(args.turns):
            messages.append(user_message(args.turn_tokens, 1000 + turn))
            answer = _greedy(server, messages, 16)
            messages.append({"role": "assistant", "content": answer.text})
    context = answer.prompt_tokens + answer.completion_tokens
    kv = context * kv_bytes_per_token(args.wear_shape)
    written = identity_writes(daemon)
    per_request = exit_summary(server).written_per_request
    return [
        str(args.turns),
        f"{context:,}",
        f"{kv / 2**20:.1f}",
        f"{written / 2**20:.1f}",
        f"{written / kv:.2f}",
        "not logged" if per_request is None else f"{per_request / 1024:,.0f}",
    ]


# --- burst -----------------------------------------------------------------------------------


def _prompt(tokenizer: Any, messages: Messages) -> list[int]:
    """The prompt's tokens as mlx_lm.server makes them: the chat template's."""
    tokens: list[int] = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    return tokens


def _repeated(tokenizer: Any, last: Messages, answer: Sequence[int], following: Messages) -> int:
    """How many tokens of the last turn (its prompt and answer) the following prompt repeats,
    at most all of it but its last token: what a server holding the last turn's cache starts
    from."""
    turn = [*_prompt(tokenizer, last), *answer]
    nxt = _prompt(tokenizer, following)
    same = 0
    while same < min(len(turn), len(nxt)) and turn[same] == nxt[same]:
        same += 1
    return min(same, len(nxt) - 1)


def burst_row(model: Path, daemon: Daemon, logs: Path, args: argparse.Namespace) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    firsts = [[user_message(args.burst_tokens - 3, 2000 + k)] for k in range(args.burst)]
    with (
        kvd_server(model, logs / "burst.log", daemon) as server,
        ThreadPoolExecutor(args.burst) as pool,
    ):
        answers = list(pool.map(partial(chat, server, stream=False), firsts))
    nexts = [
        [*first, {"role": "assistant", "content": answer.text}, user_message(16, 3000 + k)]
        for k, (first, answer) in enumerate(zip(firsts, answers, strict=True))
    ]
    summary = exit_summary(server)
    dropped = f"superseded {summary.superseded}"
    if summary.dropped is not None:
        dropped += f", dropped {summary.dropped} ({(summary.dropped_bytes or 0) / 2**20:.0f} MiB)"
    with kvd_server(model, logs / "burst-restarted.log", daemon) as server:
        restored = [chat(server, messages, stream=False).cached_tokens for messages in nexts]
    turns = [
        _repeated(tokenizer, first, answer.tokens or [], following)
        for first, answer, following in zip(firsts, answers, nexts, strict=True)
    ]
    whole = sum(got >= turn for got, turn in zip(restored, turns, strict=True))
    some = sum(0 < got < turn for got, turn in zip(restored, turns, strict=True))
    return [
        str(args.burst),
        f"{statistics.median(turns):,.0f}",
        str(whole),
        str(some),
        str(args.burst - whole - some),
        f"{sum(restored) / sum(turns):.2f}",
        dropped,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--step", type=int, default=8, help="tokens between two streams' ends")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of decode streams")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=440)
    parser.add_argument("--wear-shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--block-tokens", type=int, help="the wear's server: --kvd-block-tokens")
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--burst-tokens", type=int, default=256)
    args = parser.parse_args()
    use_openblas()

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        if "decode" in args.parts:
            with running_daemon(_folder(root, "decode")) as daemon:
                rows = decode_rows(model_folder(root, "kv8b"), daemon, root, args)
            _print(f"Decode of the longest of {args.streams} streams", rows, DECODE_HEADER)
        if "wear" in args.parts:
            with running_daemon(_folder(root, "wear")) as daemon:
                row = wear_row(model_folder(root, args.wear_shape), daemon, root, args)
            _print("Wear of one conversation", [row], WEAR_HEADER)
        if "burst" in args.parts:
            with running_daemon(_folder(root, "burst")) as daemon:
                row = burst_row(model_folder(root, "kv8b"), daemon, root, args)
            _print("A burst of conversations, then a restart", [row], BURST_HEADER)


def _folder(root: Path, name: str) -> Path:
    (root / name).mkdir()
    return root / name


def _print(title: str, rows: list[list[str]], header: list[str]) -> None:
    print(f"\n{title}\n")
    print_table(header, rows)


if __name__ == "__main__":
    main()
