"""Three engine processes share one daemon: two workers of one tiny model and one engine of
another model of the same architecture (other weights, so its caches would load without
complaint if the daemon mixed identities up). Each holds its own conversation, restores its
prefixes while the others put and get theirs, and checks every reply against an
uninterrupted run of its own model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from daemon_process import Daemon
from tiny_engine import TURNS

ENGINE_SECONDS = 120.0
HERE = Path(__file__).parent


def _engine(daemon: Daemon, model_id: str, model_seed: int, seed: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "tiny_engine.py",
            daemon.socket_path,
            model_id,
            str(model_seed),
            str(seed),
        ],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(engine: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, err = engine.communicate(timeout=ENGINE_SECONDS)
    assert engine.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_engines_of_two_models_share_one_daemon(daemon: Daemon) -> None:
    first = _engine(daemon, "tiny-llama-a", 0, seed=1)
    second = _engine(daemon, "tiny-llama-a", 0, seed=2)
    try:
        assert first.stdout is not None
        opening = json.loads(first.stdout.readline())  # its first turn is stored by now
        # The same conversation on other weights: model a's entries match its first prompt.
        other = _engine(daemon, "tiny-llama-b", 7, seed=1)
        engines = {"a1": [opening, *_lines(first)], "a2": _lines(second), "b": _lines(other)}
    finally:
        for engine in (first, second):
            engine.kill()

    for lines in engines.values():
        *turns, summary = lines
        assert len(turns) == TURNS
        assert all(turn["same"] for turn in turns)  # every reply equals its own model's
        assert summary["rejected"] == 0  # never offered an entry of another identity
        # Every later turn restored the conversation so far: only its 8 new tokens computed.
        assert summary["restored"] >= TURNS - 1
        assert [turn["computed"] for turn in turns[1:]] == [8] * (TURNS - 1)
    # Model b computed its first prompt whole, though model a had stored it.
    assert engines["b"][0]["computed"] == engines["b"][0]["prompt"]
