"""Tiny model folders in the Hugging Face layout, built on the spot (nothing is downloaded):
`config.json`, random llama weights as `model.safetensors`, and a byte-level BPE tokenizer
trained here with a chat template, so that `mlx_lm.load(folder)` and `mlx_lm.server --model
folder` take them like any model."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB: Final = 384
SPECIAL: Final = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE: Final = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS: Final = (
    *("cache", "prefix", "token", "model", "layer", "daemon", "socket", "restore", "store"),
    *("entry", "tier", "memory", "disk", "prompt", "answer", "question", "system", "user"),
    *("assistant", "value", "key", "query", "shared", "cold", "warm", "hot"),
)


def words(count: int, seed: int) -> str:
    """Text of count words drawn from a small vocabulary (a long prompt is many of them)."""
    pick = random.Random(seed)
    return " ".join(pick.choice(_WORDS) for _ in range(count))


def build_tokenizer(folder: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([words(2000, seed) for seed in range(4)], trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def build_model_folder(folder: Path, *, seed: int, shape: Mapping[str, int] | None = None) -> Path:
    """A two-layer llama with random float32 weights drawn from seed, and the tokenizer
    (the same for every seed: folders of other seeds differ in their weights only).
    shape: config values that replace the small default's (layers, heads, head_dim...)."""
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    eos = json.loads((folder / "tokenizer.json").read_text())["added_tokens"][1]
    assert eos["content"] == "</s>"
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "eos_token_id": eos["id"],
        **(shape or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    model.set_dtype(mx.float32)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder
