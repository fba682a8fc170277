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
is preloaded when installed, as bench/ttft.py does. --plot FILE.png also draws the medians
against prompt length (docs/figures/ttft.png).

    .venv/bin/python bench/server_ttft.py [--shape kv8b --lengths 2048 --repeat 3 --no-cold]
        [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _daemon import Daemon, running_daemon
from _plot import Figure, Panel, Series, machine_caption, save
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

# What each --shape is, in a figure's title.
MODELS = {
    "tiny": "a tiny model (2 llama layers, random weights)",
    "kv4": "4 layers of 32 KiB of KV a token, little compute",
    "kv8b": "an 8B model's KV (32 layers, 8 KV heads), little compute",
}
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


@dataclass(frozen=True)
class Length:
    """The runs of one prompt length: cold (None with --no-cold), then per restarted process
    its restored request, the warm one after it, and the restore's own seconds as logged."""

    cold: Timed | None
    restored: list[Timed]
    warm: list[Timed]
    restores_logged: list[float]

    @property
    def prompt_tokens(self) -> int:
        return self.restored[0].prompt_tokens


def _median_ms(runs: list[Timed]) -> float:
    return statistics.median(run.first_chunk for run in runs) * 1000


def measure(
    model: Path, daemon: Daemon, logs: Path, lengths: list[int], *, repeat: int, cold: bool
) -> list[Length]:
    measured = []
    for length in lengths:
        request = prompt_request(length, seed=length, max_tokens=4)
        cold_run = None
        if cold:
            with http_server(model, logs / f"stock-{length}.log", kvd_socket=None) as stock:
                cold_run = timed_stream(stock, request)
        socket = daemon.socket_path
        with http_server(model, logs / f"first-{length}.log", kvd_socket=socket) as first:
            timed_stream(first, request)  # computes the prefill and stores it in kvd
            first.stop()  # SIGTERM: what waits to be stored is sent first
        pairs = []
        for run in range(repeat):
            log = logs / f"restarted-{length}-{run}.log"
            with http_server(model, log, kvd_socket=socket) as server:
                pairs.append(_restarted(server, daemon, request))
        restored, warm, logged = (list(runs) for runs in zip(*pairs, strict=True))
        measured.append(Length(cold_run, restored, warm, logged))
    return measured


def table_rows(measured: list[Length]) -> list[list[str]]:
    rows = []
    for length in measured:
        cold_seconds = None if length.cold is None else length.cold.first_chunk
        if cold_seconds is not None:
            cells = [f"{length.prompt_tokens:,}", "cold, stock mlx_lm.server", "0"]
            rows.append([*cells, _ms([cold_seconds]), "", "", "1.0"])
        pairs = zip(length.restored, length.warm, strict=True)
        ratio = statistics.median(r.first_chunk / w.first_chunk for r, w in pairs)
        restore_ms = _ms(length.restores_logged)
        for path, runs, times, own in (
            ("warm, same server, from memory (anchor)", length.warm, "1.00", ""),
            ("restarted, restored from kvd", length.restored, f"{ratio:.2f}", restore_ms),
        ):
            cells = [f"{runs[0].prompt_tokens:,}", path, f"{runs[0].cached_tokens:,}"]
            seconds = [t.first_chunk for t in runs]
            faster = (
                "" if cold_seconds is None else f"{cold_seconds / statistics.median(seconds):.1f}"
            )
            rows.append([*cells, _ms(seconds), times, own, faster])
    return rows


def figure(measured: list[Length], shape: str, repeat: int) -> Figure:
    """Median TTFT against prompt length, one line per path (cold only when it ran)."""
    cold = [(m.prompt_tokens, m.cold.first_chunk * 1000) for m in measured if m.cold]
    series = [
        Series("cold: stock mlx_lm.server computes the prefill", cold),
        Series(
            "restored from kvd by a restarted server",
            [(m.prompt_tokens, _median_ms(m.restored)) for m in measured],
        ),
        Series(
            "warm: the same server, from memory",
            [(m.prompt_tokens, _median_ms(m.warm)) for m in measured],
        ),
    ]
    return Figure(
        title="Time to first token by prompt length",
        x_label="prompt length (tokens)",
        y_label="time to first token (ms, log scale)",
        panels=[Panel(f"mlx_lm.server, {MODELS[shape]}", [s for s in series if s.points])],
        caption=machine_caption(f"restored and warm: medians of {repeat} restarted servers"),
        x_tick=lambda x: f"{x / 1024:,.0f}k" if x >= 1024 else f"{x:,.0f}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeat", type=int, default=1, help="restarted processes per length")
    parser.add_argument("--no-cold", dest="cold", action="store_false")
    parser.add_argument("--plot", type=Path, help="also draw the figure into this PNG")
    args = parser.parse_args()
    use_openblas()  # the servers inherit it: the prefills run on it

    with tempfile.TemporaryDirectory() as scratch, running_daemon(Path(scratch)) as daemon:
        root = Path(scratch)
        model = model_folder(root, args.shape)
        measured = measure(model, daemon, root, args.lengths, repeat=args.repeat, cold=args.cold)
    print(f"\nTime to first token, {args.shape} model (streaming request to its first chunk)\n")
    print_table(HEADER, table_rows(measured))
    if args.plot is not None:
        save(figure(measured, args.shape, args.repeat), args.plot)


if __name__ == "__main__":
    main()
