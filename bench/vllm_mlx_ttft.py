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
from pathlib import Path

from _daemon import running_daemon
from _server_streams import model_folder, print_table, restores_logged, settled
from model_folders import words

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kvd_vllm_mlx"))
from vllm_servers import SERVED, VllmServer, vllm_server  # the tests' server processes

VENV = Path(__file__).resolve().parent.parent / ".venv-vllm-mlx-0.6.0"
HEADER = ["prompt tokens", "server", "TTFT ms", "× warm", "restore ms (logged)"]


def first_chunk(server: VllmServer, length: int) -> float:
    """Seconds from sending a greedy streaming request of about length tokens to its first
    chunk with text."""
    started = time.perf_counter()
    stream = server.client().chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": words(length, seed=length)}],
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


def measure(model: Path, root: Path, length: int) -> list[list[str]]:
    with running_daemon(root / f"kvd-{length}") as daemon:
        socket = daemon.socket_path
        with vllm_server(model, root / f"cold-{length}.log", kvd_socket=None) as stock:
            cold = first_chunk(stock, length)
        with vllm_server(model, root / f"first-{length}.log", kvd_socket=socket) as first:
            first_chunk(first, length)
            first.stop()
        settled(daemon)
        with vllm_server(model, root / f"kvd-{length}.log", kvd_socket=socket) as server:
            restored = first_chunk(server, length)
            warm = first_chunk(server, length)
            logged = restores_logged(server)
    ssd = ["--ssd-cache-dir", str(root / f"ssd-{length}")]
    log = root / f"ssd-{length}.log"  # both processes: one home, one SSD tier
    for _ in range(2):
        with vllm_server(model, log, kvd_socket=None, extra=ssd) as stock:
            ssd_seconds = first_chunk(stock, length)
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
    print("\nTime to first token, vllm-mlx, tiny model (streaming request to its first chunk)\n")
    print_table(HEADER, rows)


if __name__ == "__main__":
    main()
