"""Time to first token of new prompts while the daemon is hung (SIGSTOP: a stuck disk, a long
pause), kvd-mlx-lm-server against stock mlx_lm.server (anchor) answering the same prompts.

Each prompt goes to stock, then to kvd-mlx-lm-server (its memory never holds it, so each one
asks kvd), in three phases: the daemon answering (a miss: one lookup's round trip); the first
request once the daemon is hung (it waits out the lookup deadline, and the breaker opens);
the requests after it (the tier skipped). The hang is repeated --rounds times, the daemon
resumed and the breaker closed again between them. TTFT is the time from sending a streaming
request to its first chunk; the table gives each phase's median and the time added to stock's.

    .venv/bin/python bench/hung_daemon.py [--rounds 5] [--requests 4] [--length 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _daemon import running_daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
from _server_streams import print_table, prompt_request, timed_stream
from http_servers import http_server  # the tests' server processes
from model_folders import build_model_folder  # on the path through _daemon

LOOKUP_TIMEOUT = 0.1  # the server's default, given explicitly
CLOSED = "answers again"  # the server's log line when the breaker closes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5, help="hangs, each a first request")
    parser.add_argument("--requests", type=int, default=4, help="per round after the first")
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch, running_daemon(Path(scratch)) as daemon:
        root = Path(scratch)
        model = build_model_folder(root / "model", seed=0)
        extra = ["--kvd-lookup-timeout", str(LOOKUP_TIMEOUT)]
        with (
            http_server(model, root / "stock.log", kvd_socket=None) as stock,
            http_server(model, root / "kvd.log", kvd_socket=daemon.socket_path, extra=extra) as kvd,
        ):
            seeds = iter(range(10_000, 20_000))

            def phase(requests: int) -> list[tuple[float, float]]:
                """TTFT (ms) of stock and of kvd for each of requests new prompts."""
                pairs = []
                for _ in range(requests):
                    request = prompt_request(args.length, next(seeds), max_tokens=4)
                    stock_ttft = timed_stream(stock, request).first_chunk
                    pairs.append((stock_ttft * 1000, timed_stream(kvd, request).first_chunk * 1000))
                return pairs

            phase(2)  # both servers warmed up
            answering = phase(args.requests * args.rounds)
            first: list[tuple[float, float]] = []
            after: list[tuple[float, float]] = []
            for round_ in range(1, args.rounds + 1):
                with daemon.paused():
                    first += phase(1)
                    after += phase(args.requests)
                while kvd.logs().count(CLOSED) < round_:  # the probe finds it answering
                    time.sleep(0.01)

    rows = []
    for name, pairs in (
        ("daemon answering", answering),
        ("daemon hung: first request", first),
        ("daemon hung: the requests after it", after),
    ):
        stock_ms = statistics.median(s for s, _ in pairs)
        kvd_ms = statistics.median(k for _, k in pairs)
        added = statistics.median(k - s for s, k in pairs)
        cells = [f"{stock_ms:,.1f}", f"{kvd_ms:,.1f}", f"{added:+,.1f}", f"{kvd_ms / stock_ms:.2f}"]
        rows.append([name, str(len(pairs)), *cells])
    print(
        f"\nTTFT of new {args.length}-token prompts, lookup timeout {LOOKUP_TIMEOUT} s (medians)\n"
    )
    header = ["phase", "requests", "stock ms", "kvd ms", "added ms", "× stock"]
    print_table(header, rows)


if __name__ == "__main__":
    main()
