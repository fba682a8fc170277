"""An async put given up while its bytes are being written (the task cancelled: its thread
goes on writing) never closes a descriptor under a live write: the write's own thread closes
it when it ends. The daemon aborts the put with the connection, and the same prompt is put
again on the same client meanwhile.

The engine runs in a process of its own with a preloaded shim (write_hold_shim.c) that holds
the first write into a staging file until the test lets it go, and logs every close of a
descriptor that a write is still using."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from daemon_e2e import wait_until
from daemon_process import Daemon
from fault_shim import built_or_skip
from kvd_client.async_client import AsyncClient
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity

SHIM = Path(__file__).with_name("write_hold_shim.c")
IDENTITY = EngineIdentity("tiny/cancelled", "cfg", "tok")
BLOCK = 16
WAIT_SECONDS = 60.0  # bound on waiting for the child's next step; none is timed
CHILD_SECONDS = 300.0


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    return built_or_skip(tmp_path, SHIM, "CANCELLED PUT")


@pytest.mark.parametrize(
    ("tokens", "block_tokens"), [(45, BLOCK), (45, 0)], ids=["blocks", "whole entry"]
)
def test_a_cancelled_put_closes_its_descriptors_only_after_its_writes(
    tmp_path: Path, daemon: Daemon, shim: Path, tokens: int, block_tokens: int
) -> None:
    hold, log = tmp_path / "hold", tmp_path / "writes.log"
    hold.touch()
    env = os.environ | {
        "LD_PRELOAD": str(shim),
        "WRITE_HOLD_ROOT": os.path.realpath(daemon.tier / "staging") + "/",
        "WRITE_HOLD_FILE": str(hold),
        "WRITE_HOLD_LOG": str(log),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    args = [daemon.socket_path, str(hold), str(log), str(tokens), str(block_tokens)]
    child = subprocess.run(
        [sys.executable, __file__, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    events = log.read_text().split()
    held = report["held"]
    assert events[:2] == ["held", str(held)]
    assert "busy" not in events, f"a descriptor was closed under a write: {events}"
    assert report["open_after_cancel"], "the held write's descriptor was closed by the cancel"
    assert events.index("wrote") < events.index("closed"), events
    assert report["again"] == "stored"  # the same prompt, on the same client meanwhile

    with Client.connect(daemon.socket_path, require=True) as client:
        wait_until(lambda: client.status()["staged_puts"] == 0, "the cancelled put aborted")
        status = client.status()
        assert status["entries"] == 1
        assert status["abandoned_puts"] == 1
        hit = client.lookup(IDENTITY.to_protocol(), [*report["prompt"], 7])
        assert hit is not None
        with hit:
            assert hit.matched == tokens
            hit.verify()
    assert not any((daemon.tier / "staging").iterdir())


# --- the engine's side, in the child process -----------------------------------------------


async def _wait_for(log: Path, event: str) -> int:
    """The descriptor of the first `event FD` line of the shim's log, once it is there."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        words = log.read_text().split() if log.exists() else []
        if event in words:
            return int(words[words.index(event) + 1])
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no {event!r} in the shim's log")


def _cache(tokens: int) -> list[Any]:
    """Two mlx-lm KVCache layers holding tokens (random keys and values, as a prefill's)."""
    from mlx_lm.models import cache  # noqa: PLC0415 - MLX in the child only

    kv_cache: Any = cache.KVCache  # mlx-lm ships no type hints
    layers = []
    for seed in range(2):
        layer = kv_cache()
        keys, values = mx.random.normal((2, 1, 2, tokens, 32), key=mx.random.key(seed))
        layer.update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
        layers.append(layer)
    return layers


async def _cancelled_put(
    socket: str, hold: Path, log: Path, tokens: int, block_tokens: int
) -> dict[str, object]:
    tokens_put = list(range(1000, 1000 + tokens))
    cache = _cache(tokens)
    client = await AsyncClient.connect(socket, require=True, block_tokens=block_tokens)
    async with client:
        task = asyncio.create_task(client.put(IDENTITY, tokens_put, cache))
        held = await _wait_for(log, "held")
        inode = os.fstat(held).st_ino
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        # The number still names the staging file: nothing closed it under the write.
        try:
            open_after_cancel = os.fstat(held).st_ino == inode
        except OSError:  # closed, and not yet reused
            open_after_cancel = False
        hold.unlink()  # the write goes on, ends, and its thread closes the descriptor
        await _wait_for(log, "closed")
        again = await (await client.put(IDENTITY, tokens_put, cache)).wait(WAIT_SECONDS)
    return {
        "held": held,
        "open_after_cancel": open_after_cancel,
        "again": again.state,
        "prompt": tokens_put,
    }


if __name__ == "__main__":
    socket_path, hold_path, log_path, count, block = sys.argv[1:6]
    outcome = asyncio.run(
        _cancelled_put(socket_path, Path(hold_path), Path(log_path), int(count), int(block))
    )
    print(json.dumps(outcome))
