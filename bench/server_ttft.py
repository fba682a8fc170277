"""Time to first token through the OpenAI-compatible HTTP API of mlx_lm.server, with and
without kvd under its prompt cache.

Per prompt length (chat prompts of --lengths tokens):
- cold, stock mlx_lm.server without kvd: a prompt it has never seen, the whole prefill
  (--no-cold: left out, it is the longest part of a run);
- restarted, kvd-mlx-lm-server: a new server process whose memory is empty; the prompt's cache
  was stored in kvd by an earlier process of the same model and is restored from it;
- warm, kvd-mlx-lm-server (anchor): the same prompt again in the same process, served from
  memory. Goal: restarted within 1.1x of warm.
TTFT is the time from sending a streaming request to its first chunk (the first token). The
restarted and warm requests are made --repeat times, each pair in a new process: the table
gives the median and the spread, the ratio is the median of each pair's.

--shape tiny is the tests' model folder (2 llama layers): the prefill it saves is small next
to a real model's, so its TTFT is mostly a request's fixed cost. --shape kv8b has an 8B
model's KV (32 layers, 8 KV heads, head_dim 128, float32: 512 MiB at 2k tokens) and little
compute, so a restore costs what it would for an 8B model (_server_streams.py). OpenBLAS
is preloaded when installed, as bench/ttft.py does.

    .venv/bin/python bench/server_ttft.py [--shape kv8b --lengths 2048 --repeat 3 --no-cold]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _daemon import Daemon, running_daemon
from _server_streams import (
    SHAPES,
    HttpServer,
    Timed,
    http_server,
    model_folder,
    print_table,
    prompt_request,
    restores_logged,
    settled,
    timed_stream,
)
from ttft import use_openblas

HEADER = [
    *("prompt tokens", "server", "cached", "TTFT ms", "× warm"),
    *("restore ms (logged)", "× faster than cold"),
]


def _ms(values: Sequence[float]) -> str:
    """Median and spread of seconds, in milliseconds."""
    median = statistics.median(values) * 1000
    if len(values) == 1:
        return f"{median:,.1f}"
    return f"{median:,.1f} ({min(values) * 1000:,.0f}-{max(values) * 1000:,.0f})"


def _restarted(
    server: HttpServer, daemon: Daemon, request: dict[str, object]
) -> tuple[Timed, Timed, float]:
    """The restored request, the warm one after it, and the restore's own time as logged;
    each once the daemon settled (the server stores each request's caches meanwhile)."""
    settled(daemon)
    restored = timed_stream(server, request)
    settled(daemon)
    warm = timed_stream(server, request)
    logged = restores_logged(server)
    assert len(logged) == 1, f"one restore logged expected, not {logged}"
    return restored, warm, logged[0] / 1000


def ttft_rows(
    model: Path, daemon: Daemon, logs: Path, lengths: list[int], *, repeat: int, cold: bool
) -> list[list[str]]:
    rows = []
    for length in lengths:
        request = prompt_request(length, seed=length, max_tokens=4)
        cold_seconds = None
        if cold:
            with http_server(model, logs / f"stock-{length}.log", kvd_socket=None) as stock:
                timed = timed_stream(stock, request)
            cold_seconds = timed.first_chunk
            cells = [f"{timed.prompt_tokens:,}", "cold, stock mlx_lm.server", "0"]
            rows.append([*cells, _ms([cold_seconds]), "", "", "1.0"])
        socket = daemon.socket_path
        with http_server(model, logs / f"first-{length}.log", kvd_socket=socket) as first:
            timed_stream(first, request)  # computes the prefill and stores it in kvd
            first.stop()  # SIGTERM: what waits to be stored is sent first
        pairs = []
        for run in range(repeat):
            log = logs / f"restarted-{length}-{run}.log"
            with http_server(model, log, kvd_socket=socket) as server:
                pairs.append(_restarted(server, daemon, request))
        restored = [pair[0] for pair in pairs]
        warm = [pair[1] for pair in pairs]
        ratio = statistics.median(r.first_chunk / w.first_chunk for r, w, _ in pairs)
        restore_ms = _ms([pair[2] for pair in pairs])
        for path, runs, times, own in (
            ("warm, same server, from memory (anchor)", warm, "1.00", ""),
            ("restarted, restored from kvd", restored, f"{ratio:.2f}", restore_ms),
        ):
            cells = [f"{runs[0].prompt_tokens:,}", path, f"{runs[0].cached_tokens:,}"]
            seconds = [t.first_chunk for t in runs]
            faster = (
                "" if cold_seconds is None else f"{cold_seconds / statistics.median(seconds):.1f}"
            )
            rows.append([*cells, _ms(seconds), times, own, faster])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeat", type=int, default=1, help="restarted processes per length")
    parser.add_argument("--no-cold", dest="cold", action="store_false")
    args = parser.parse_args()
    use_openblas()  # the servers inherit it: the prefills run on it

    with tempfile.TemporaryDirectory() as scratch, running_daemon(Path(scratch)) as daemon:
        root = Path(scratch)
        model = model_folder(root, args.shape)
        rows = ttft_rows(model, daemon, root, args.lengths, repeat=args.repeat, cold=args.cold)
    print(f"\nTime to first token, {args.shape} model (streaming request to its first chunk)\n")
    print_table(HEADER, rows)


if __name__ == "__main__":
    main()
