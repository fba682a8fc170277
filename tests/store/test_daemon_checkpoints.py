"""Generation checkpoints: found by key only, newest wins, forgotten on request, kept apart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from daemon_process import Daemon, running_daemon
from kvd_client import Client, TicketState
from kvd_protocol import Checkpoint, Identity, LayerSpec, TensorSpec

IDENTITY = Identity(
    model_id="ckpt/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
PROMPT = list(range(500, 540))


def put_checkpoint(client: Client, key: str, generated: list[int], pending: int) -> None:
    tokens = [*PROMPT, *generated]
    spec = TensorSpec("float32", (1, 2, len(tokens), 4))
    tensors = [np.full(spec.shape, len(generated), np.float32) for _ in range(2)]
    checkpoint = Checkpoint(
        key=key,
        pending_token=pending,
        seed=7,
        seed_explicit=False,
        prompt_tokens=len(PROMPT),
        generated_tokens=len(generated),
    )
    ticket = client.put_entry(
        IDENTITY, tokens, [LayerSpec("kv", (spec, spec), True)], tensors, checkpoint=checkpoint
    )
    assert ticket.wait(30) == TicketState("stored")


def test_the_newest_checkpoint_of_a_key_is_found_and_replaces_the_older(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_checkpoint(client, "gen-a", [1, 2, 3], pending=4)
        put_checkpoint(client, "gen-a", [1, 2, 3, 4, 5, 6], pending=7)
        put_checkpoint(client, "gen-b", [9], pending=10)
        found = client.find_checkpoint(IDENTITY, "gen-a", PROMPT)
        assert found is not None
        with found:
            assert found.matched == len(PROMPT) + 6
            assert found.header.checkpoint is not None
            assert found.header.checkpoint.pending_token == 7
            assert found.header.checkpoint.generated_tokens == 6
            found.verify()
        # The older checkpoint of gen-a went once the newer one was durable.
        assert client.status()["entries"] == 2


def test_checkpoints_never_answer_prompt_lookups(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_checkpoint(client, "gen-a", [1, 2, 3], pending=4)
        assert client.lookup(IDENTITY, [*PROMPT, 1, 2, 3, 4]) is None
        assert client.lookup(IDENTITY, PROMPT) is None


def test_a_checkpoint_must_extend_the_prompt_and_match_the_key(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_checkpoint(client, "gen-a", [1, 2, 3], pending=4)
        assert client.find_checkpoint(IDENTITY, "gen-b", PROMPT) is None
        assert client.find_checkpoint(IDENTITY, "gen-a", [*PROMPT[:-1], 0]) is None
        assert client.find_checkpoint(IDENTITY, "gen-a", [*PROMPT, 1, 2, 3]) is None  # no longer


def test_forget_removes_every_checkpoint_of_the_key(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_checkpoint(client, "gen-a", [1, 2, 3], pending=4)
        put_checkpoint(client, "gen-b", [5], pending=6)
        assert client.forget_checkpoint(IDENTITY, "gen-a") == 1
        assert client.find_checkpoint(IDENTITY, "gen-a", PROMPT) is None
        assert client.find_checkpoint(IDENTITY, "gen-b", PROMPT) is not None
        assert client.forget_checkpoint(IDENTITY, "gen-a") == 0


def test_checkpoints_survive_a_restart(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put_checkpoint(client, "gen-a", [1, 2, 3], pending=4)
            put_checkpoint(client, "gen-a", [1, 2, 3, 4], pending=5)
        assert daemon.stop() == 0
        daemon.start()
        with Client.connect(daemon.socket_path, require=True) as client:
            found = client.find_checkpoint(IDENTITY, "gen-a", PROMPT)
            assert found is not None
            with found:
                assert found.header.checkpoint is not None
                assert found.header.checkpoint.pending_token == 5
