"""A tiny mlx-lm engine with the cold tier, for tests: a byte-level tokenizer (nothing is
downloaded) and, run as a script, an engine process holding a conversation.

    python tiny_engine.py SOCKET MODEL_ID MODEL_SEED CONVERSATION_SEED

Each turn extends the previous turn's prompt and reply, and every reply is checked against
an uninterrupted greedy run of the same prompt. Prints a JSON line per turn as it ends
(prompt length, tokens computed, whether the reply equals the uninterrupted one), then one
with the prompts restored and the entries of another identity the daemon offered (the
client rejects those).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx_lm
from kvd_client.client import Client
from kvd_client.identity import EngineIdentity
from kvd_client.mlx_lm_cache import ColdTier
from tiny_models import prompt, tiny_llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SYSTEM = prompt(40, seed=11)  # a system prompt every engine's conversations start with
TURNS = 3
REPLY_TOKENS = 6


def _byte_symbols() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 byte values: what the ByteLevel steps expect.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbols = dict(zip(printable, printable, strict=True))
    symbols.update((b, 256 + i) for i, b in enumerate(others))
    return {b: chr(code) for b, code in symbols.items()}


def byte_tokenizer() -> Any:
    """A tokenizer whose token ids are byte values (0-255, the tiny models' vocabulary);
    byte 0 is the end-of-sequence token."""
    symbols = _byte_symbols()
    tokenizer = Tokenizer(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, eos_token=symbols[0]
    )


def uninterrupted(model: Any, tokenizer: Any, tokens: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of stock mlx-lm from a fresh cache."""
    responses = mlx_lm.stream_generate(model, tokenizer, mx.array(tokens), max_tokens)
    return [response.token for response in responses]


def converse(tier: ColdTier, seed: int) -> Iterator[dict[str, Any]]:
    """TURNS turns of a conversation through tier: what happened in each, then overall."""
    history = list(SYSTEM)
    for turn in range(TURNS):
        tokens = history + prompt(8, seed=seed * 100 + turn)
        computed = tier.stats.computed_tokens
        got = [r.token for r in tier.stream_generate(tokens, REPLY_TOKENS)]
        tier.drain()
        yield {
            "prompt": len(tokens),
            "computed": tier.stats.computed_tokens - computed,
            "same": got == uninterrupted(tier.model, tier.tokenizer, tokens, REPLY_TOKENS),
        }
        history = tokens + got
    yield {"restored": tier.stats.restored, "rejected": tier.client.stats.rejected_entries}


def main(socket_path: str, model_id: str, model_seed: str, seed: str) -> None:
    model = tiny_llama(seed=int(model_seed))
    tokenizer = byte_tokenizer()
    identity = EngineIdentity.for_model(model, tokenizer, model_id=model_id)
    with (
        Client.connect(socket_path, require=True) as client,
        ColdTier(client, model, tokenizer, identity=identity) as tier,
    ):
        for line in converse(tier, int(seed)):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
