"""Time to first token through vllm-mlx's OpenAI-compatible HTTP API (continuous batching),
with kvd under its prefix cache and with vllm-mlx's own SSD tier.

Per prompt length (one user message of about --lengths tokens, the tests' tiny model folder):
- cold, stock vllm-mlx: a prompt it has never seen, the whole prefill;
- restored from kvd, kvd-vllm-mlx: a new server process whose memory is empty; an earlier
  process of the same model stored the prompt's cache in kvd;
- warm, kvd-vllm-mlx: the same prompt again in that process, found in vllm-mlx's memory;
- stock's SSD tier, restarted: stock vllm-mlx with --ssd-cache-dir and the same home as an
  earlier process of the model, which saved its prefix cache at exit (vllm-mlx loads it at
  start) and spilled to its SSD tier.
And per length, with the tests' tiny hybrid folder (qwen3_next: Gated DeltaNet layers, whose
state cannot be trimmed, and attention), a prompt whose last sixteenth changed:
- cold, stock vllm-mlx: the whole prefill;
- restored from kvd, kvd-vllm-mlx: a new server process; an earlier one was sent the prompt
  with its first ending and stored its prefill checkpoints (the interval chosen by cost).
TTFT is the time from sending a streaming request to its first chunk. Runs in the virtualenv
of make test-vllm-mlx-VERSION (vllm-mlx without torch); from another it runs itself there, or
says how to make it.

    .venv-vllm-mlx-0.6.0/bin/python bench/vllm_mlx_ttft.py [--lengths 2048 8192]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _daemon import running_daemon
from _server_streams import (
    model_folder,
    print_table,
    restored_tokens_logged,
    restores_logged,
    settled,
)
from model_folders import build_model_folder, words

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kvd_vllm_mlx"))
from vllm_servers import SERVED, VllmServer, vllm_server  # the tests' server processes

VENV = Path(__file__).resolve().parent.parent / ".venv-vllm-mlx-0.6.0"
HEADER = ["prompt tokens", "server", "TTFT ms", "× warm", "restore ms (logged)"]
HYBRID_HEADER = ["prompt tokens", "server", "TTFT ms", "× cold", "tokens restored", "restore ms"]


def first_chunk(server: VllmServer, text: str) -> float:
    """Seconds from sending a greedy streaming request of one user message to its first chunk
    with text."""
    started = time.perf_counter()
    stream = server.client().chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": text}],
        temperature=0.0,
        max_tokens=4,
        stream=True,
    )
    seconds = None
    for chunk in stream:
        if seconds is None and chunk.choices and chunk.choices[0].delta.content:
            seconds = time.perf_counter() - started
    assert seconds is not None, "the stream carried no text"
    return seconds


@dataclass(frozen=True)
class Restart:
    """A prompt's TTFT cold on stock, then restored from kvd in a new kvd-vllm-mlx process
    (an earlier one was sent another prompt, or the same), and again in that process."""

    cold: float
    restored: float
    again: float
    held: list[int]  # the tokens of each restore the process logged
    took: list[float]  # and its milliseconds


def restart(model: Path, root: Path, name: str, stored: str, sent: str) -> Restart:
    with running_daemon(root / f"kvd-{name}") as daemon:
        socket = daemon.socket_path
        with vllm_server(model, root / f"cold-{name}.log", kvd_socket=None) as stock:
            cold = first_chunk(stock, sent)
        with vllm_server(model, root / f"first-{name}.log", kvd_socket=socket) as first:
            first_chunk(first, stored)
            first.stop()
        settled(daemon)
        with vllm_server(model, root / f"kvd-{name}.log", kvd_socket=socket) as server:
            restored = first_chunk(server, sent)
            again = first_chunk(server, sent)
            held, took = restored_tokens_logged(server), restores_logged(server)
    return Restart(cold, restored, again, held, took)


def measure(model: Path, root: Path, length: int) -> list[list[str]]:
    text = words(length, seed=length)
    run = restart(model, root, str(length), text, text)
    cold, restored, warm, logged = run.cold, run.restored, run.again, run.took
    ssd = ["--ssd-cache-dir", str(root / f"ssd-{length}")]
    log = root / f"ssd-{length}.log"  # both processes: one home, one SSD tier
    for _ in range(2):
        with vllm_server(model, log, kvd_socket=None, extra=ssd) as stock:
            ssd_seconds = first_chunk(stock, text)
            stock.stop()
    rows = []
    for name, seconds in (
        ("cold, stock vllm-mlx", cold),
        ("restored from kvd, kvd-vllm-mlx", restored),
        ("warm, kvd-vllm-mlx", warm),
        ("stock's SSD tier, restarted", ssd_seconds),
    ):
        restore = f"{logged[0]:,.1f}" if logged and name.startswith("restored") else ""
        rows.append(
            [f"{length:,}", name, f"{seconds * 1000:,.1f}", f"{seconds / warm:.2f}", restore]
        )
    return rows


def measure_hybrid(model: Path, root: Path, length: int) -> list[list[str]]:
    """The hybrid's rows: a prompt whose end changed, cold on stock and restored from kvd."""
    kept = length - length // 16
    first, changed = (f"{words(kept, seed=length)} {words(length - kept, seed=s)}" for s in (1, 2))
    run = restart(model, root, f"hybrid-{length}", first, changed)
    return [
        [f"{length:,}", "cold, stock vllm-mlx", f"{run.cold * 1000:,.1f}", "1.00", "", ""],
        [
            f"{length:,}",
            "end changed, restored from kvd, kvd-vllm-mlx",
            f"{run.restored * 1000:,.1f}",
            f"{run.restored / run.cold:.2f}",
            f"{run.held[0]:,}" if run.held else "none",
            f"{run.took[0]:,.1f}" if run.took else "",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    args = parser.parse_args()
    if importlib.util.find_spec("vllm_mlx") is None:
        python = VENV / "bin" / "python"
        if not python.exists():
            print(f"vllm-mlx is not installed here: make {VENV.name}/.installed, then run again")
            return
        os.execv(python, [str(python), *sys.argv])
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = model_folder(root, "tiny")
        rows = [row for length in args.lengths for row in measure(model, root, length)]
        hybrid = build_model_folder(root / "model-hybrid", seed=0, model_type="qwen3_next")
        hybrid_rows = [row for n in args.lengths for row in measure_hybrid(hybrid, root, n)]
    print("\nTime to first token, vllm-mlx, tiny model (streaming request to its first chunk)\n")
    print_table(HEADER, rows)
    print("\nThe same, tiny hybrid model (qwen3_next), a prompt whose last sixteenth changed\n")
    print_table(HYBRID_HEADER, hybrid_rows)


if __name__ == "__main__":
    main()
