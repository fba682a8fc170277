"""Generation checkpoints of real caches: an interrupted greedy generation resumes, after the
process that began it is gone, exactly where it stood; prompt lookups never see it."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
from daemon_process import Daemon
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.results import TicketState
from kvd_protocol import Checkpoint
from tiny_models import greedy, prefill, prompt, tiny_lfm2, tiny_llama

IDENTITY = EngineIdentity("tiny/checkpointed", "cfg", "tok")
KEY = "request-42"


def test_an_interrupted_generation_resumes_exactly(daemon: Daemon) -> None:
    for make in (tiny_llama, tiny_lfm2):  # trimmable and untrimmable caches alike
        model = make()
        tokens = prompt(16)
        want, _ = greedy(model, prefill(model, tokens[:-1]), tokens[-1:], 10)

        # The first run: 3 tokens emitted (and fed), the 4th sampled but not yet fed.
        cache = prefill(model, tokens[:-1])
        generated, logits = greedy(model, cache, tokens[-1:], 3)
        pending = cast(int, mx.argmax(logits[-1]).item())
        checkpoint = Checkpoint(
            key=KEY,
            pending_token=pending,
            seed=0,
            seed_explicit=False,
            prompt_tokens=len(tokens),
            generated_tokens=len(generated),
        )
        with Client.connect(daemon.socket_path, require=True) as client:
            ticket = client.put(IDENTITY, [*tokens, *generated], cache, checkpoint=checkpoint)
            assert ticket.wait(30) == TicketState("stored")
            assert client.get(IDENTITY, [*tokens, *generated, pending]) is None

            resumed = client.get_checkpoint(IDENTITY, KEY, tokens, model=model)
            assert resumed is not None
            assert resumed.checkpoint == checkpoint
            assert resumed.matched == len(tokens) + len(generated)
            rest, _ = greedy(model, resumed.cache, [pending], 10 - len(generated) - 1)
            assert [*generated, pending, *rest] == want
            assert client.forget_checkpoint(IDENTITY.to_protocol(), KEY) == 1
        mx.clear_cache()
