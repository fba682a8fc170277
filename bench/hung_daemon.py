"""Time to first token of new prompts while the daemon is hung (SIGSTOP: a stuck disk, a long
pause), kvd-mlx-lm-server against stock mlx_lm.server (anchor) answering the same prompts.

Each prompt goes to stock, then to kvd-mlx-lm-server (its memory never holds it, so each one
asks kvd), in three phases: the daemon answering (a miss: one lookup's round trip); the first
request once the daemon is hung (it waits out the lookup deadline, and the breaker opens);
the requests after it (the tier skipped). TTFT is the time from sending a streaming request to
its first chunk; the table gives each phase's median and the added time over stock.

    .venv/bin/python bench/hung_daemon.py [--requests 8] [--length 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _daemon import running_daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
from http_servers import http_server  # the tests' server processes
from model_folders import build_model_folder  # on the path through _daemon
from server_ttft import _request, print_table, timed_stream

LOOKUP_TIMEOUT = 0.1  # the server's default, given explicitly


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=8, help="per phase after the first")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens")
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

            def phase(requests: int) -> tuple[float, float]:
                """Median TTFT (ms) of stock and of kvd over requests new prompts."""
                pairs = []
                for _ in range(requests):
                    request = _request(args.length, next(seeds), max_tokens=4)
                    pairs.append((timed_stream(stock, request), timed_stream(kvd, request)))
                return (
                    statistics.median(s.first_chunk for s, _ in pairs) * 1000,
                    statistics.median(k.first_chunk for _, k in pairs) * 1000,
                )

            phase(2)  # both servers warmed up
            answering = phase(args.requests)
            with daemon.paused():
                first = phase(1)
                skipped = phase(args.requests)

    rows = [
        [name, str(count), f"{s:,.1f}", f"{k:,.1f}", f"{k - s:+,.1f}", f"{k / s:.2f}"]
        for name, count, (s, k) in (
            ("daemon answering", args.requests, answering),
            ("daemon hung: first request", 1, first),
            ("daemon hung: the requests after it", args.requests, skipped),
        )
    ]
    print(f"\nTTFT of new {args.length}-token prompts, lookup timeout {LOOKUP_TIMEOUT} s\n")
    header = ["phase", "requests", "stock ms", "kvd ms", "added ms", "× stock"]
    print_table(header, rows)


if __name__ == "__main__":
    main()
