"""Tiny model folders in the Hugging Face layout, built on the spot (nothing is downloaded):
`config.json`, random weights as `model.safetensors` (a llama, or a hybrid: qwen3_next,
nemotron_h), and a byte-level BPE tokenizer trained here with a chat template, so that
`mlx_lm.load(folder)` and `mlx_lm.server --model folder` take them like any model."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama, nemotron_h, qwen3_next
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB: Final = 384
SPECIAL: Final = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE: Final = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The small config of each model type a folder is built for (vocab_size and eos_token_id are
# the tokenizer's). The hybrids keep the real models' layer kinds and cache classes: linear
# attention layers (qwen3_next's Gated DeltaNet, nemotron_h's Mamba-2: an ArraysCache of
# convolution and recurrent state) around full attention (KVCache). Head and state sizes are
# multiples of 32, which Metal's gated-delta and SSM kernels need.
SMALL_CONFIGS: Final[Mapping[str, Mapping[str, object]]] = {
    "llama": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # the smallest that MLX quantizes (group size 32)
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,  # random tied embeddings make greedy repeat one token
    },
    "qwen3_next": {  # three Gated DeltaNet layers, then one of attention, as Qwen3-Next
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,  # dense feed-forward: the experts hold no cache
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "moe_intermediate_size": 0,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "nemotron_h": {  # Mamba-2, attention, Mamba-2, feed-forward
        "hybrid_override_pattern": "M*M-",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 32,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
    },
}
_MODULES: Final[Mapping[str, ModuleType]] = {
    "llama": llama,
    "qwen3_next": qwen3_next,
    "nemotron_h": nemotron_h,
}

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


def build_model_folder(
    folder: Path,
    *,
    seed: int,
    shape: Mapping[str, object] | None = None,
    model_type: str = "llama",
) -> Path:
    """A small model of model_type (SMALL_CONFIGS) with random float32 weights drawn from
    seed, and the tokenizer (the same for every seed: folders of other seeds differ in their
    weights only). shape: config values that replace the small default's (layers, heads,
    head_dim...)."""
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    eos = json.loads((folder / "tokenizer.json").read_text())["added_tokens"][1]
    assert eos["content"] == "</s>"
    config = {
        "model_type": model_type,
        **SMALL_CONFIGS[model_type],
        "vocab_size": VOCAB,
        "eos_token_id": eos["id"],
        **(shape or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    model = small_model(config, seed=seed)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder


def small_model(config: Mapping[str, object], *, seed: int) -> Any:
    """The mlx-lm model of config (its model_type's), random float32 weights drawn from seed."""
    module = _MODULES[str(config["model_type"])]
    mx.random.seed(seed)  # parameters are drawn at construction: seed first
    model = module.Model(module.ModelArgs.from_dict(dict(config)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
