"""Time to first token through the OpenAI-compatible HTTP API of mlx_lm.server, with and
without kvd under its prompt cache, and decode speed while kvd stores in the background.

Per prompt length (chat prompts of --lengths tokens):
- cold, stock mlx_lm.server without kvd (anchor): a prompt it has never seen, the whole prefill;
- restarted, kvd-mlx-lm-server: a new server process whose memory is empty; the prompt's cache
  was stored in kvd by an earlier process of the same model and is restored from it;
- warm, kvd-mlx-lm-server: the same prompt again in the same process, served from memory.
TTFT is the time from sending a streaming request to its first chunk (the first token).

Decode: --decode-requests requests of --decode-tokens tokens each, prompts of 2k tokens, one
after another: each request's cache is stored in kvd while the next one decodes. Tokens per
second from the first chunk to the last, median over the requests, kvd-mlx-lm-server against
stock mlx_lm.server.

The model is the tests' tiny model folder (2 llama layers, hidden 64, random float32 weights,
a tokenizer trained on the spot): the prefill it saves is small next to a real model's, so the
restored TTFT here is mostly the fixed cost of a request; a 32k-token cold prefill is the
longest part of the run (docs/benchmarks.md).

    .venv/bin/python bench/server_ttft.py [--lengths 2048 8192 32768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _daemon import running_daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
from http_servers import HttpServer, http_server  # the tests' server processes
from model_folders import build_model_folder, words  # on the path through _daemon

PROMPT_OVERHEAD = 3  # the chat template's tokens around one user message


def _request(length: int, seed: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "default_model",
        "messages": [{"role": "user", "content": words(length - PROMPT_OVERHEAD, seed)}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True)
class Timed:
    first_chunk: float  # seconds from sending the request
    decoding: float  # seconds from the first chunk to the last
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def timed_stream(server: HttpServer, request: dict[str, Any]) -> Timed:
    started = time.perf_counter()
    first = last = 0.0
    usage = None
    for chunk in server.client().chat.completions.create(**request):
        now = time.perf_counter()
        if chunk.choices:
            first = first or now
            last = now
        usage = chunk.usage or usage
    assert usage is not None, "the stream carried no usage block"
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details else 0
    return Timed(
        first - started, last - first, usage.prompt_tokens, cached, usage.completion_tokens
    )


def ttft_rows(model: Path, socket: str, logs: Path, lengths: list[int]) -> list[list[str]]:
    rows = []
    for length in lengths:
        request = _request(length, seed=length, max_tokens=4)
        with http_server(model, logs / f"stock-{length}.log", kvd_socket=None) as stock:
            cold = timed_stream(stock, request)
        with http_server(model, logs / f"first-{length}.log", kvd_socket=socket) as first:
            timed_stream(first, request)  # computes the prefill and stores it in kvd
            first.stop()  # SIGTERM: what waits to be stored is sent first
        with http_server(model, logs / f"second-{length}.log", kvd_socket=socket) as second:
            restored = timed_stream(second, request)
            warm = timed_stream(second, request)
        for path, timed in (
            ("cold, stock mlx_lm.server (anchor)", cold),
            ("restarted server, restored from kvd", restored),
            ("warm, same server, from memory", warm),
        ):
            seconds = timed.first_chunk
            speedup = cold.first_chunk / seconds
            cells = [f"{timed.prompt_tokens:,}", path, f"{timed.cached_tokens:,}"]
            rows.append([*cells, f"{seconds * 1000:,.1f}", f"{speedup:.1f}"])
    return rows


def decode_rate(server: HttpServer, requests: int, tokens: int) -> float:
    rates = []
    for seed in range(requests):
        timed = timed_stream(server, _request(2048, 1000 + seed, tokens))
        rates.append((timed.completion_tokens - 1) / timed.decoding)
    return statistics.median(rates)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--decode-requests", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=256)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch, running_daemon(Path(scratch)) as daemon:
        root = Path(scratch)
        model = build_model_folder(root / "model", seed=0)
        rows = ttft_rows(model, daemon.socket_path, root, args.lengths)
        print("\nTime to first token (streaming request to its first chunk)\n")
        print_table(["prompt tokens", "server", "cached tokens", "TTFT ms", "× faster"], rows)

        with http_server(model, root / "decode-stock.log", kvd_socket=None) as stock:
            plain = decode_rate(stock, args.decode_requests, args.decode_tokens)
        with http_server(model, root / "decode-kvd.log", kvd_socket=daemon.socket_path) as tiered:
            stored = decode_rate(tiered, args.decode_requests, args.decode_tokens)
        print(f"\nDecode, {args.decode_tokens} tokens per request (median of the requests)\n")
        rows = [
            ["stock mlx_lm.server (anchor)", f"{plain:,.0f}", "1.00"],
            ["kvd-mlx-lm-server, storing each request", f"{stored:,.0f}", f"{stored / plain:.2f}"],
        ]
        print_table(["server", "tokens/s", "× stock"], rows)


if __name__ == "__main__":
    main()
