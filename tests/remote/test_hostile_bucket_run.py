"""The randomized hostile-bucket run (bench/hostile_bucket.py), short: a bucket that misbehaves in
every way on by default (BUCKET_KINDS) under a daemon beside honest engines. The run is seeded: a
failure names its seed, and `bench/hostile_bucket.py --seed N --seconds S` replays it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import hostile_bucket  # bench/ is not a package

SECONDS = float(os.environ.get("KVD_HOSTILE_SECONDS", "8"))
SEED = int(os.environ.get("KVD_HOSTILE_SEED", "1"))


@pytest.mark.hostile_run
def test_a_hostile_bucket_never_stalls_grows_or_silences_the_daemon(tmp_path: Path) -> None:
    """Every misbehaviour on by default, at random, beside honest engines: the daemon stays
    up and answers every ping and lookup in time, its counts equal the directory, staging is
    empty, every local and fetched entry restores exactly, SIGTERM ends it with 0 within its
    deadline, and it logs no error and no traceback."""
    kinds = hostile_bucket.chosen_kinds("default")
    result = hostile_bucket.run(tmp_path, SECONDS, SEED, rate=0.3, kinds=kinds)
    hostile_bucket.print_table(result, SECONDS, SEED, 0.3, kinds)
    assert not result.problems, f"seed {SEED}: {result.problems}"
    assert result.exit_code == 0
    answered = result.hostility.answered
    assert sum(answered[kind] for kind in kinds) >= len(kinds) // 2  # the bucket misbehaved
    assert answered["honest"] > 0
    assert result.final["local: exact"] > 0  # honest entries were there to harm
