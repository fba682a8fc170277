"""Prefill checkpoints against a real daemon: served whole to longer prompts, never trimmed,
never superseded by a longer one, counted apart, kept across restarts, evicted first; and a
hostile mark refused."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from daemon_e2e import RawPeer, report, wait_until
from daemon_process import Daemon, kvctl, running_daemon
from kvd_client import Client, TicketState
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol import Identity, LayerSpec, TensorSpec
from kvd_protocol import messages as m
from kvd_protocol.entry import (
    PREFILL_CHECKPOINT_META,
    Checkpoint,
    EntryPlan,
    MetaValue,
    encode_header,
    plan_entry,
)
from kvd_protocol.errors import ErrorCode
from kvd_protocol.tokens import pack_tokens

IDENTITY = Identity(
    model_id="hybrid/model",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    codec_id="codecs/1",
    runtime="mlx/cpu",
)
PROMPT = list(range(1000, 1128))  # 128 tokens: prefill checkpoints at 32, 64, 96
MARK = {PREFILL_CHECKPOINT_META: True}
OTHER = [*PROMPT[:16], *range(7000, 7048)]  # 64 tokens: 16 of PROMPT, then its own


def layers(tokens: int, hybrid: bool = True) -> tuple[list[LayerSpec], list[np.ndarray]]:
    """A KV layer and, for a hybrid, an SSM state (untrimmable); tensors filled with tokens."""
    kv = TensorSpec("float32", (1, 2, tokens, 4))
    specs = [LayerSpec("kv", (kv, kv), True)]
    if hybrid:
        specs.append(LayerSpec("ssm", (TensorSpec("float32", (1, 3, 5)),), False))
    tensors = [np.full(t.shape, tokens, np.float32) for spec in specs for t in spec.tensors]
    return specs, tensors


def put(
    client: Client, tokens: Sequence[int], *, prefill_checkpoint: bool, hybrid: bool = True
) -> None:
    specs, tensors = layers(len(tokens), hybrid)
    meta = MARK if prefill_checkpoint else None
    ticket = client.put_entry(IDENTITY, list(tokens), specs, tensors, meta=meta)
    assert ticket.wait(30) == TicketState("stored")


def served(client: Client, prompt: Sequence[int]) -> tuple[int, int, bool] | None:
    """(the entry's tokens, tokens matched, whether it is a prefill checkpoint) of a lookup of
    prompt, its data verified; None: a miss."""
    hit = client.lookup(IDENTITY, list(prompt))
    if hit is None:
        return None
    with hit:
        hit.verify()
        assert hit.summary.prefill_checkpoint == hit.header.prefill_checkpoint
        return hit.header.token_count, hit.matched, hit.header.prefill_checkpoint


def diverging_at(t: int) -> list[int]:
    """PROMPT up to token t, then other tokens."""
    return [*PROMPT[:t], *range(5000, 5040)]


def entry_size(hybrid: bool = True) -> int:
    specs, _ = layers(32, hybrid)
    return plan_entry(IDENTITY, pack_tokens(PROMPT[:32]), specs, created=1.0, min_reuse=0).file_size


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "every-layer-trimmable"])
def test_a_prefill_checkpoint_serves_longer_prompts_whole_and_is_counted(
    daemon: Daemon, hybrid: bool
) -> None:
    """Whatever its layers say: a prompt that diverges inside it does not get it."""
    with Client.connect(daemon.socket_path, require=True) as client:
        put(client, PROMPT[:64], prefill_checkpoint=True, hybrid=hybrid)
        assert served(client, diverging_at(64)) == (64, 64, True)
        assert served(client, diverging_at(100)) == (64, 64, True)
        assert served(client, diverging_at(40)) is None  # never trimmed to 40
        status = report(client)
    counts = {"entries": 1, "bytes": entry_size(hybrid), "hits": 2, "restored_tokens": 128}
    assert status["prefill_checkpoints"] == counts
    (identity,) = status["identities"]
    assert identity["prefill_checkpoints"] == counts
    assert (identity["hits"], identity["misses"]) == (2, 1)

    metrics = kvctl(daemon, "metrics").stdout.splitlines()
    assert "kvd_prefill_checkpoint_entries 1.0" in metrics
    assert f"kvd_prefill_checkpoint_bytes {float(counts['bytes'])}" in metrics
    assert "kvd_prefill_checkpoint_hits_total 2.0" in metrics
    assert "kvd_prefill_checkpoint_restored_tokens_total 128.0" in metrics
    labelled = [line for line in metrics if line.startswith("kvd_identity_prefill_checkpoint_")]
    assert len(labelled) == 4
    assert all(f'identity="{IDENTITY.digest()}"' in line for line in labelled)
    assert any(line.endswith(" 128.0") and "restored_tokens_total" in line for line in labelled)

    table = kvctl(daemon, "status").stdout
    assert "prefill checkpoints" in table
    assert "2 hits, 128 prompt tokens restored from them" in table
    (listed,) = json.loads(kvctl(daemon, "list", "--json").stdout)
    assert (listed["prefill_checkpoint"], listed["trimmable"]) == (True, False)
    (row,) = kvctl(daemon, "list").stdout.splitlines()[1:]
    assert "prefill checkpoint" in row
    shown = kvctl(daemon, "show", listed["id"]).stdout
    assert "prefill checkpoint: served whole" in shown


def test_whole_entries_are_not_shown_as_prefill_checkpoints(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put(client, PROMPT[:64], prefill_checkpoint=False)
        assert served(client, diverging_at(100)) == (64, 64, False)
        assert client.status()["prefill_checkpoints"] == {
            "entries": 0,
            "bytes": 0,
            "hits": 0,
            "restored_tokens": 0,
        }
    (listed,) = json.loads(kvctl(daemon, "list", "--json").stdout)
    assert listed.get("prefill_checkpoint", False) is False
    assert "prefill checkpoint" not in kvctl(daemon, "list").stdout


def test_a_longer_prefill_checkpoint_keeps_the_shorter_ones(daemon: Daemon) -> None:
    """Each serves the prompts that diverge after it and before the next."""
    with Client.connect(daemon.socket_path, require=True) as client:
        for end in (32, 64, 96):
            put(client, PROMPT[:end], prefill_checkpoint=True)
        put(client, PROMPT, prefill_checkpoint=False)  # the prompt boundary: a whole entry
        assert client.status()["entries"] == 4
        assert client.status()["superseded"] == 0
        assert served(client, diverging_at(40)) == (32, 32, True)
        assert served(client, diverging_at(64)) == (64, 64, True)
        assert served(client, diverging_at(95)) == (64, 64, True)
        assert served(client, diverging_at(120)) == (96, 96, True)
        assert served(client, [*PROMPT, 7]) == (128, 128, False)
        assert served(client, diverging_at(20)) is None


def test_a_trimmable_whole_entry_supersedes_a_prefill_checkpoint_it_extends(
    daemon: Daemon,
) -> None:
    """It serves the same prefix by trimming; an untrimmable one (a hybrid's) cannot, and
    supersedes nothing."""
    with Client.connect(daemon.socket_path, require=True) as client:
        put(client, PROMPT[:32], prefill_checkpoint=True, hybrid=True)
        put(client, PROMPT[:64], prefill_checkpoint=False, hybrid=True)
        status = report(client)
        assert (status["entries"], status["superseded"]) == (2, 0)
        put(client, PROMPT[:96], prefill_checkpoint=False, hybrid=False)
        status = report(client)
        assert (status["entries"], status["superseded"]) == (1, 2)  # both prefixes went
        assert status["prefill_checkpoints"]["entries"] == 0
        assert served(client, diverging_at(40)) == (96, 40, False)


def test_a_prefill_checkpoint_stays_one_across_restarts(tmp_path: Path) -> None:
    """From the index snapshot, and from the headers when there is none."""
    with running_daemon(tmp_path) as daemon:
        with Client.connect(daemon.socket_path, require=True) as client:
            put(client, PROMPT[:32], prefill_checkpoint=True, hybrid=False)
            put(client, OTHER, prefill_checkpoint=False, hybrid=False)
        for from_snapshot in (True, False):
            assert daemon.stop() == 0
            snapshot = daemon.tier / "index.snapshot"
            assert snapshot.exists()
            if not from_snapshot:
                snapshot.unlink()
            daemon.start()
            opened = [line for line in daemon.logs().splitlines() if "tier_opened" in line]
            assert json.loads(opened[-1])["from_snapshot"] == (2 if from_snapshot else 0)
            with Client.connect(daemon.socket_path, require=True) as client:
                assert report(client)["prefill_checkpoints"]["entries"] == 1
                # The prefill checkpoint is found only where it needs no trim: trimmed, it
                # would match 20 tokens of the second prompt, more than the whole entry's 16.
                assert served(client, diverging_at(32)) == (32, 32, True)
                assert served(client, diverging_at(20)) == (64, 16, False)


def test_under_a_byte_cap_prefill_checkpoints_go_before_a_whole_entry_of_the_same_use(
    tmp_path: Path,
) -> None:
    size = entry_size()
    with (
        running_daemon(tmp_path, ["--max-bytes", str(2 * size)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        put(client, PROMPT[:32], prefill_checkpoint=False)
        put(client, [7, *PROMPT[:31]], prefill_checkpoint=True)  # one use later
        put(client, [8, *PROMPT[:31]], prefill_checkpoint=False)
        assert client.status()["evictions"] == 1
        assert served(client, [*PROMPT[:32], 9]) == (32, 32, False)
        assert served(client, [7, *PROMPT[:31], 9]) is None


def test_a_burst_keeps_the_prefill_checkpoints_the_next_prompts_use(tmp_path: Path) -> None:
    """Four prompts' prefill checkpoints, looked up again after each new put; twelve other
    prompts' checkpoints put meanwhile, never used: those go, oldest first, and the used ones
    all stay, though they are older than most."""
    size = entry_size()
    used = [[n, *PROMPT[:31]] for n in range(4)]
    burst = [[100 + n, *PROMPT[:31]] for n in range(12)]
    with (
        running_daemon(tmp_path, ["--max-bytes", str(8 * size)]) as daemon,
        Client.connect(daemon.socket_path, require=True) as client,
    ):
        for tokens in used:
            put(client, tokens, prefill_checkpoint=True)
        for tokens in burst:
            put(client, tokens, prefill_checkpoint=True)
            for prompt in used:
                assert served(client, [*prompt, 9]) == (32, 32, True)
        status = client.status()
        assert (status["entries"], status["evictions"]) == (8, 8)
        kept = [served(client, [*tokens, 9]) is not None for tokens in burst]
        assert kept == [False] * 8 + [True] * 4


# Values a hostile engine might send as the mark; the planner refuses them, so the file is
# forged: the header of a valid plan with the mark's value changed.
HOSTILE_MARKS = {"a string": "yes", "an int": 2, "one": 1, "a map": {"on": True}}


def forged_plan(tokens: Sequence[int], value: object, generation: bool = False) -> EntryPlan:
    specs, _ = layers(len(tokens))
    plan = plan_entry(
        IDENTITY, pack_tokens(tokens), specs, created=time.time(), min_reuse=0, meta=MARK
    )
    meta = cast(dict[str, MetaValue], {**plan.header.meta, PREFILL_CHECKPOINT_META: value})
    header = replace(plan.header, meta=meta)
    if generation:
        header = replace(header, checkpoint=Checkpoint("gen-1", 1, 2, False, len(tokens), 0))
    length = len(encode_header(header))
    assert header.data_start >= length + 48  # the forged header still fits before the data
    return EntryPlan(header, length)


@pytest.mark.parametrize(
    ("value", "generation", "says"),
    [
        *((v, False, PREFILL_CHECKPOINT_META) for v in HOSTILE_MARKS.values()),
        (True, True, "not both"),
    ],
    ids=[*HOSTILE_MARKS, "beside a generation checkpoint"],
)
def test_a_hostile_prefill_checkpoint_mark_is_refused_and_the_daemon_lives_on(
    daemon: Daemon, value: object, generation: bool, says: str
) -> None:
    tokens = PROMPT[:32]
    plan = forged_plan(tokens, value, generation)
    _, tensors = layers(len(tokens))
    with RawPeer(daemon.socket_path) as peer:
        reply = peer.call(
            m.PutBegin(
                id=peer.next_id(), identity=IDENTITY, tokens=plan.header.tokens, size=plan.file_size
            )
        )
        assert isinstance(reply, m.PutBeginReply), reply
        assert reply.fd is not None
        try:
            write_entry(reply.fd, plan, tensor_views(plan, tensors))
        finally:
            os.close(reply.fd)
        refused = peer.call(m.PutCommit(id=peer.next_id(), put=reply.put))
        assert isinstance(refused, m.ErrorReply), refused
        assert refused.code == ErrorCode.INVALID_ENTRY
        assert says in refused.message, refused.message
    with Client.connect(daemon.socket_path, require=True) as client:
        assert client.status()["entries"] == 0
        put(client, tokens, prefill_checkpoint=True)
        wait_until(lambda: served(client, [*tokens, 9]), "the honest put served")
