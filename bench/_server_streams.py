"""What the server benchmarks share: model folders of a chosen shape, streaming chat requests
through the openai client timed chunk by chunk, the figures kvd-mlx-lm-server logs, tables.

Shapes (random float32 weights, the tests' tokenizer; float16 matmuls on the CPU build do
not use the BLAS):
- tiny: the tests' model folder, 2 llama layers, 1 KiB of KV per token;
- kv4: 4 layers of 8 KV heads of head_dim 128, 32 KiB of float32 KV per token;
- kv8b: the KV of an 8B model (32 layers, 8 KV heads, head_dim 128) with little compute
  around it (hidden 64, 8 query heads): 256 KiB of float32 KV per token, 512 MiB at 2k tokens.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from _daemon import Daemon
from kvd_client.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
from http_servers import HttpServer, chat, http_server  # the tests' server processes
from model_folders import build_model_folder, words  # on the path through _daemon

__all__ = ["HttpServer", "chat", "http_server"]  # the tests' server processes, for the benchmarks

PROMPT_OVERHEAD: Final = 3  # the chat template's tokens around one user message

SHAPES: Final[dict[str, dict[str, int]]] = {
    "tiny": {},
    "kv4": {  # 32 KiB of float32 KV a token: a file's fixed part is small beside it
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
    },
    "kv8b": {
        "num_hidden_layers": 32,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
    },
}


def model_folder(root: Path, shape: str) -> Path:
    """The model folder of the named shape under root, built on first use."""
    folder = root / f"model-{shape}"
    return folder if folder.exists() else build_model_folder(folder, seed=0, shape=SHAPES[shape])


def kv_bytes_per_token(shape: str) -> int:
    """Float32 keys and values of every layer, for one token."""
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 32, **SHAPES[shape]}
    heads = config["num_hidden_layers"] * config["num_key_value_heads"]
    return 2 * heads * config["head_dim"] * 4


def user_message(length: int, seed: int) -> dict[str, str]:
    """A user message of about length tokens."""
    return {"role": "user", "content": words(length, seed)}


def chat_request(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A greedy streaming chat request whose last chunk carries the usage block."""
    return {
        "model": "default_model",
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def prompt_request(length: int, seed: int, max_tokens: int) -> dict[str, Any]:
    """A request whose prompt is length tokens: one user message, the template around it."""
    return chat_request([user_message(length - PROMPT_OVERHEAD, seed)], max_tokens)


@dataclass(frozen=True)
class Timed:
    started: float  # time.perf_counter() when the request was sent
    chunks: list[float]  # seconds from sending the request to each chunk that carried text
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def first_chunk(self) -> float:
        return self.chunks[0]

    @property
    def decoding(self) -> float:
        """Seconds from the first chunk to the last."""
        return self.chunks[-1] - self.chunks[0]

    @property
    def rate(self) -> float:
        """Tokens per second after the first."""
        return (self.completion_tokens - 1) / self.decoding


def timed_stream(server: HttpServer, request: dict[str, Any]) -> Timed:
    started = time.perf_counter()
    chunks, text, usage = [], [], None
    for chunk in server.client().chat.completions.create(**request):
        now = time.perf_counter()
        if chunk.choices:
            chunks.append(now - started)
            text += [choice.delta.content or "" for choice in chunk.choices]
        usage = chunk.usage or usage
    assert usage is not None, "the stream carried no usage block"
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details else 0
    return Timed(
        started, chunks, "".join(text), usage.prompt_tokens, cached, usage.completion_tokens
    )


_RESTORED: Final = re.compile(r"kvd: restored (\d+) of (\d+) prompt tokens in ([\d.]+) ms")


def restores_logged(server: HttpServer) -> list[float]:
    """The milliseconds of each restore kvd-mlx-lm-server logged, in order."""
    return [float(match[3]) for match in _RESTORED.finditer(server.logs())]


def restored_tokens_logged(server: HttpServer) -> list[int]:
    """The prompt tokens of each restore the server logged, in order."""
    return [int(match[1]) for match in _RESTORED.finditer(server.logs())]


_SUPERSEDED: Final = re.compile(r"(\d+) superseded before sending")
_SNAPSHOTS: Final = re.compile(
    r"snapshots: (\d+) taken in ([\d.]+) ms \(max ([\d.]+) ms\), \d+ bytes copied, "
    r"\d+ bytes written \((\d+) per request, \d+ requests\), (\d+) dropped \((\d+) bytes\)"
)


@dataclass(frozen=True)
class ExitSummary:
    """What kvd-mlx-lm-server's exit summary says of its snapshots; None where it does not
    say it (a server before the summary told of them)."""

    superseded: int  # snapshots replaced by a newer one before they were sent
    snapshots: int | None = None
    snapshot_ms: float | None = None  # the generation thread's time per snapshot
    snapshot_max_ms: float | None = None
    written_per_request: int | None = None
    dropped: int | None = None  # snapshots dropped from a full backlog
    dropped_bytes: int | None = None

    def snapshot_cell(self) -> str:
        if self.snapshot_ms is None:
            return "not logged"
        return f"{self.snapshot_ms:,.0f} (max {self.snapshot_max_ms:,.0f})"


def exit_summary(server: HttpServer) -> ExitSummary:
    """The figures of the last exit summary in a stopped kvd-mlx-lm-server's log."""
    logs = server.logs()
    superseded = [int(found[1]) for found in _SUPERSEDED.finditer(logs)]
    assert superseded, f"no exit summary in the log:\n{logs}"
    found = list(_SNAPSHOTS.finditer(logs))
    if not found:
        return ExitSummary(superseded[-1])
    count, total, most, per_request, dropped, dropped_bytes = found[-1].groups()
    return ExitSummary(
        superseded[-1],
        int(count),
        float(total) / max(int(count), 1),
        float(most),
        int(per_request),
        int(dropped),
        int(dropped_bytes),
    )


def _status(daemon: Daemon) -> dict[str, Any]:
    with Client.connect(daemon.socket_path, require=True) as client:
        return client.status()


def settled(daemon: Daemon, quiet: float = 1.0) -> None:
    """Wait until the daemon has written nothing for quiet seconds and holds no put begun or
    queued: what a server stored in the background no longer competes for the cores."""
    last, since = None, time.monotonic()
    while time.monotonic() - since < quiet:
        status = _status(daemon)
        writeback = status["writeback"]
        now = (status["bytes_written"], status["staged_puts"], writeback["pending_count"])
        if now != last or now[1] or now[2]:
            last, since = now, time.monotonic()
        time.sleep(0.1)


def identity_writes(daemon: Daemon) -> int:
    """Bytes the daemon wrote for every identity together (status: bytes_written)."""
    status = _status(daemon)
    identities = status.get("identities")
    assert isinstance(identities, list), f"status without identities: {status}"
    return sum(int(row.get("bytes_written", 0)) for row in identities)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
