"""kvd-mlx-lm-server with hybrid models (qwen3_next, nemotron_h: recurrent state that cannot be
trimmed): prefill checkpoints on the batched and the single-request path. Real kvd, real
server processes, tiny hybrid model folders built here, the openai client at temperature 0;
every answer is compared with stock mlx_lm.server's for the same request, and every restore is
on a server started after the prompts it restores from were sent (its memory holds nothing)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx_lm
import pytest
from daemon_process import Daemon, running_daemon
from http_servers import SETTLE_SECONDS, Answer, HttpServer, Messages, chat, http_server
from kvd_client.batch_checkpoints import cut_segments
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.mlx_lm_server import TieredBatchGenerator
from kvd_client.prefill_checkpoints import ASSUMED_PREFILL_RATE, CheckpointSettings
from kvd_client.server_tier import ServerTier
from mlx_lm.tokenizer_utils import load as load_tokenizer
from model_folders import build_model_folder, words

INTERVAL = 256  # tokens between checkpoints: two of the server's 128-token blocks
CHECKPOINTS = ["--kvd-checkpoint-interval", str(INTERVAL)]
MODEL_TYPES = ("qwen3_next", "nemotron_h")
BURST = 8  # questions after the first, AT_ONCE at a time
AT_ONCE = 2
# Tier caps the burst overflows (it stores about 5.9 MB): about half of it, and a third, where
# the document's KV (10 blocks of 64 KiB) and checkpoints fit with the last wave's own tails.
TIER_BYTES = (3 << 20, 2 << 20)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: build_model_folder(root / kind, seed=0, model_type=kind) for kind in MODEL_TYPES}


@pytest.fixture(scope="module")
def stock(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, HttpServer]]:
    """Stock mlx_lm.server of each folder, without kvd: the answers to match."""
    logs = tmp_path_factory.mktemp("stock")
    with (
        http_server(folders["qwen3_next"], logs / "q.log", kvd_socket=None) as qwen3_next,
        http_server(folders["nemotron_h"], logs / "n.log", kvd_socket=None) as nemotron_h,
    ):
        yield {"qwen3_next": qwen3_next, "nemotron_h": nemotron_h}


def _server(folder: Path, log: Path, daemon: Daemon, extra: list[str] = CHECKPOINTS) -> Any:
    return http_server(folder, log, kvd_socket=daemon.socket_path, extra=extra)


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def _shared(folder: Path, one: Messages, other: Messages) -> int:
    """The tokens two prompts share from their start, as the server's tokenizer and chat
    template make them."""
    tokenizer: Any = load_tokenizer(folder)  # mlx-lm ships no type hints
    a, b = (tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in (one, other))
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def _same_answer(answer: Answer, expected: Answer) -> None:
    assert answer.text == expected.text
    assert answer.tokens == expected.tokens
    assert answer.prompt_tokens == expected.prompt_tokens


def _restored_logged(server: HttpServer) -> list[tuple[int, int]]:
    found = re.findall(r"kvd: restored (\d+) of (\d+) prompt tokens", server.logs())
    return [(int(held), int(prompt)) for held, prompt in found]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_prompt_whose_end_changed_restores_all_but_one_interval_on_both_paths(
    daemon: Daemon,
    folders: dict[str, Path],
    stock: dict[str, HttpServer],
    tmp_path: Path,
    model_type: str,
) -> None:
    """Batched (no seed) and single-request (a seed) path alike: the last 100 of 2,000 words
    changed, a fresh server restores the shared tokens to within one interval and answers as
    stock; an exact repeat on the single-request path restores all but the last token."""
    folder, reference = folders[model_type], stock[model_type]
    seeds = (None, 7)  # by the request's seed: the batched path, the single-request path
    first = {seed: _user(f"{words(1900, seed or 0)} {words(100, 100)}") for seed in seeds}
    changed = {seed: _user(f"{words(1900, seed or 0)} {words(100, 200)}") for seed in seeds}
    with _server(folder, tmp_path / "first.log", daemon) as server:
        for seed, messages in first.items():
            chat(server, messages, stream=False, seed=seed)
        assert server.stop() == 0
    with _server(folder, tmp_path / "fresh.log", daemon) as fresh:
        answers = []
        for seed, messages in changed.items():
            answer = chat(fresh, messages, stream=False, seed=seed)
            _same_answer(answer, chat(reference, messages, stream=False, seed=seed))
            shared = _shared(folder, first[seed], messages)
            assert shared - INTERVAL <= answer.cached_tokens <= shared, seed
            answers.append(answer)
        repeat = chat(fresh, first[7], stream=False, seed=7)
        _same_answer(repeat, chat(reference, first[7], stream=False, seed=7))
        assert repeat.cached_tokens == repeat.prompt_tokens - 1
        assert fresh.stop() == 0
    assert _restored_logged(fresh) == [
        (a.cached_tokens, a.prompt_tokens) for a in (*answers, repeat)
    ]
    with Client.connect(daemon.socket_path, require=True) as client:
        checkpoints: Any = client.status()["prefill_checkpoints"]
    assert checkpoints["hits"] == len(answers)  # the repeat: from its prompt boundary
    assert checkpoints["restored_tokens"] == sum(a.cached_tokens for a in answers)


def test_each_turn_of_a_conversation_is_restored_from_kvd_on_a_fresh_server(
    daemon: Daemon, folders: dict[str, Path], stock: dict[str, HttpServer], tmp_path: Path
) -> None:
    """With the interval chosen by cost (the default)."""
    folder = folders["qwen3_next"]
    messages = _user(words(600, seed=31))
    last_prompt = 0
    for turn in range(5):
        with _server(folder, tmp_path / f"turn{turn}.log", daemon, extra=[]) as server:
            answer = chat(server, messages, stream=False)
            assert server.stop() == 0
        _same_answer(answer, chat(stock["qwen3_next"], messages, stream=False))
        # At least the last turn's prompt but its last token: its boundary, or the whole
        # last turn where the answer's text gives back the tokens generated.
        assert answer.cached_tokens >= last_prompt - 1
        assert (answer.cached_tokens > 0) == (turn > 0)
        last_prompt = answer.prompt_tokens
        messages = [
            *messages,
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": words(80, seed=40 + turn)},
        ]


@pytest.mark.parametrize("tier_bytes", TIER_BYTES)
def test_a_burst_on_one_document_keeps_the_checkpoints_the_next_question_uses(
    folders: dict[str, Path], stock: dict[str, HttpServer], tmp_path: Path, tier_bytes: int
) -> None:
    """A question on a long document, then a burst of others on it, batched, on a tier whose
    byte cap the burst overflows: each restores from the document's last checkpoint and
    stores its own tail (a checkpoint, its prompt boundary, its turn: no other prompt's);
    eviction keeps the checkpoint the questions use, so a new question on a fresh server
    restores all of the document but one interval at most."""
    folder = folders["qwen3_next"]
    document = words(1500, seed=51)

    def asked(i: int) -> Messages:
        return _user(f"{document} question {words(40, seed=600 + i)}")

    with running_daemon(tmp_path, ["--max-bytes", str(tier_bytes)]) as daemon:
        log = tmp_path / "burst.log"
        with _server(folder, log, daemon) as server:
            first = chat(server, asked(0), stream=False)
            _wait_for_tokens(daemon, first.prompt_tokens - 1)  # its prompt boundary, the last
            answers: list[Answer] = []
            for wave in range(0, BURST, AT_ONCE):
                threads = [
                    threading.Thread(
                        target=lambda i=i: answers.append(chat(server, asked(i), stream=False))
                    )
                    for i in range(1 + wave, 1 + wave + AT_ONCE)
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            assert server.stop() == 0
        assert len(answers) == BURST
        shared = _shared(folder, asked(0), asked(99))
        assert all(shared - INTERVAL <= a.cached_tokens <= shared for a in answers)
        with Client.connect(daemon.socket_path, require=True) as client:
            evictions: Any = client.status()["evictions"]
        assert evictions > 0  # the burst overflowed the tier
        with _server(folder, tmp_path / "fresh.log", daemon) as fresh:
            answer = chat(fresh, asked(99), stream=False)
            assert fresh.stop() == 0
    _same_answer(answer, chat(stock["qwen3_next"], asked(99), stream=False))
    assert shared - INTERVAL <= answer.cached_tokens <= shared
    summary = re.search(
        r"prefill checkpoints: \d+ taken \(\d+ bytes copied\), (\d+) prompts restored from them "
        r"\((\d+) tokens\)",
        fresh.logs(),
    )
    assert summary is not None
    assert (int(summary[1]), int(summary[2])) == (1, answer.cached_tokens)


def _wait_for_tokens(daemon: Daemon, tokens: int) -> None:
    """Until the daemon holds an entry of exactly tokens tokens (stores are in the
    background)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    with Client.connect(daemon.socket_path, require=True) as client:
        while tokens not in {e.tokens for e in client.list_entries()}:
            assert time.monotonic() < deadline, f"kvd never held an entry of {tokens} tokens"
            time.sleep(0.05)


def test_the_batched_prefill_stores_a_checkpoint_at_each_cut_and_shows_the_server_its_own_ends(
    daemon: Daemon, folders: dict[str, Path]
) -> None:
    """In process, mlx_lm.server's BatchGenerator as the server builds it: a system and a user
    segment; the server sees its own segment ends only (the system's, and the user's but the
    last token, which mlx-lm splits off), the cuts between are stored as prefill
    checkpoints, and the prefill rate measured is the tier's."""
    loaded: Any = mlx_lm.load(str(folders["qwen3_next"]))  # its hints name a 3-tuple too
    model, tokenizer = loaded
    system, user = words(300, seed=81), words(500, seed=82)
    segments = [tokenizer.encode(text, add_special_tokens=False) for text in (system, user)]
    length = sum(map(len, segments))
    assert INTERVAL < len(segments[0]) < 2 * INTERVAL  # cuts: one in the system segment,
    assert 3 * INTERVAL < length - 1 < 4 * INTERVAL  # two in the user segment
    with Client.connect(daemon.socket_path, require=True) as client:
        tier = ServerTier(client, checkpoints=CheckpointSettings(interval=INTERVAL))
        tier.model_loaded("key", model, tokenizer, EngineIdentity.for_model(model, tokenizer))
        cold = tier.cold_tier("key")
        assert cold is not None
        generator = TieredBatchGenerator(model, tier=tier)
        (uid,) = generator.insert_segments([segments], max_tokens=[2])
        ends, finished = [], False
        while not finished:
            prompt_responses, generated = generator.next()
            ends += [r.progress[0] for r in prompt_responses if r.end_of_segment]
            finished = any(r.uid == uid and r.finish_reason for r in generated)
        assert ends == [len(segments[0]), length - 1, length]  # the last: the prompt's end
        assert cold.drain(SETTLE_SECONDS)
        assert cold.stats.checkpoints == 3
        stored = sorted((e.tokens, e.prefill_checkpoint) for e in client.list_entries())
        assert stored == [(256, True), (512, True), (768, True)]
        assert cold.prefill_rate != ASSUMED_PREFILL_RATE
        tier.close()


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--kvd-checkpoint-interval", "200"], "200 is not a multiple of 128 tokens"),
        (
            ["--kvd-block-tokens", "64", "--kvd-checkpoint-interval", "-64"],
            "not a number of tokens",
        ),
    ],
)
def test_a_checkpoint_setting_out_of_range_is_a_usage_error(flags: list[str], problem: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "kvd_client.mlx_lm_server", "--model", "unused", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 2
    assert problem in ran.stderr
    assert "Traceback" not in ran.stderr


def test_segments_are_cut_inside_only_and_a_position_at_a_segment_end_is_the_servers() -> None:
    """The prompt from token 100 on, in the server's segments [100, 300) [300, 700); the
    positions 256 and 512 cut, 300 is the server's own end, 600 cuts."""
    system, user = list(range(100, 300)), list(range(300, 700))
    cut, inside = cut_segments([system, user], 100, [256, 300, 512, 600])
    assert inside == [256, 512, 600]
    assert [(s[0], s[-1] + 1) for s in cut] == [
        (100, 256),
        (256, 300),
        (300, 512),
        (512, 600),
        (600, 700),
    ]
    assert cut_segments([user], 300, []) == ([user], [])
