"""Tiny random-weight mlx-lm models, built locally in float32 (nothing is downloaded), and
greedy decoding helpers for comparing a restored cache with an uninterrupted run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models import falcon_h1, lfm2, llama, llama4, mamba2, nemotron_h, qwen3_next
from mlx_lm.models.cache import make_prompt_cache

VOCAB = 256


def _ready(model: Any, seed: int) -> Any:
    mx.random.seed(seed)  # parameters are drawn at construction: seed first
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def tiny_llama(layers: int = 2, *, sliding_window: int | None = None, seed: int = 0) -> Any:
    """llama, hidden 64; with sliding_window, every other layer is a sliding one
    (RotatingKVCache), the others full attention (KVCache)."""
    layer_types = None
    if sliding_window is not None:
        layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest that MLX quantizes (group size 32)
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,  # random tied embeddings make greedy repeat one token
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    return _ready(llama.Model(args), seed)


def tiny_lfm2(seed: int = 0) -> Any:
    """lfm2 hybrid: convolution layers (ArraysCache) around one attention layer (KVCache)."""
    mx.random.seed(seed)
    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        layer_types=["conv", "full_attention", "conv"],
    )
    return _ready(lfm2.Model(args), seed)


def tiny_mamba2(seed: int = 0) -> Any:
    """mamba2: every layer an ArraysCache (convolution and recurrent state)."""
    mx.random.seed(seed)
    args = mamba2.ModelArgs(
        model_type="mamba2",
        num_heads=4,
        head_dim=16,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        state_size=16,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank=4,
    )
    return _ready(mamba2.Model(args), seed)


def tiny_llama4(seed: int = 0) -> Any:
    """llama4 text: three layers of chunked attention (ChunkedKVCache, chunks of 8) and one
    of full attention (KVCache), mixture-of-experts feed-forward on every other layer."""
    mx.random.seed(seed)
    text = {
        "model_type": "llama4_text",
        "attention_bias": False,
        "attention_chunk_size": 8,
        "head_dim": 32,
        "hidden_size": 64,
        "interleave_moe_layer_step": 2,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 2,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "use_qk_norm": True,
        "vocab_size": VOCAB,
    }
    return _ready(llama4.Model(llama4.ModelArgs(model_type="llama4", text_config=text)), seed)


def tiny_falcon_h1(seed: int = 0) -> Any:
    """falcon_h1 hybrid: every layer a CacheList of an ArraysCache (SSM) and a KVCache."""
    mx.random.seed(seed)
    args = falcon_h1.ModelArgs(
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        mamba_chunk_size=8,
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=16,
        mamba_n_heads=4,
        num_attention_heads=4,
        num_hidden_layers=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    model: Any = falcon_h1.Model  # its constructor has no type hints
    return _ready(model(args), seed)


def tiny_qwen3_next(seed: int = 0) -> Any:
    """qwen3_next hybrid: Gated DeltaNet layers (ArraysCache: convolution state and a float32
    recurrent state) then one attention layer (KVCache), as Qwen3-Next's three to one."""
    mx.random.seed(seed)
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        max_position_embeddings=512,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,  # Metal's gated-delta kernel takes multiples of 32
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=0,  # dense feed-forward: experts hold no cache
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        moe_intermediate_size=0,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
    )
    return _ready(qwen3_next.Model(args), seed)


def tiny_nemotron_h(seed: int = 0) -> Any:
    """nemotron_h hybrid: Mamba-2 layers (ArraysCache: convolution and SSM state) around one
    attention layer (KVCache)."""
    mx.random.seed(seed)
    args = nemotron_h.ModelArgs(
        model_type="nemotron_h",
        vocab_size=VOCAB,
        hybrid_override_pattern=["M", "*", "M"],
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        mamba_num_heads=8,
        mamba_head_dim=8,
        mamba_proj_bias=False,
        ssm_state_size=32,  # Metal's SSM kernel takes multiples of 32
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
    )
    model: Any = nemotron_h.Model  # its constructor has no type hints
    return _ready(model(args), seed)


def prompt(length: int, seed: int = 1) -> list[int]:
    return [int(t) for t in mx.random.randint(0, VOCAB, (length,), key=mx.random.key(seed))]


def prefill(model: Any, tokens: Sequence[int], cache: list[Any] | None = None) -> list[Any]:
    """The cache after running tokens through the model (one chunk)."""
    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def greedy(
    model: Any, cache: list[Any], last: Sequence[int], steps: int
) -> tuple[list[int], mx.array]:
    """Feed last (the prompt's tokens not in cache), then decode steps tokens greedily:
    the tokens and the logits of every step."""
    logits = model(mx.array([list(last)]), cache=cache)[:, -1, :]
    tokens: list[int] = []
    all_logits = [logits]
    for _ in range(steps):
        token = cast(int, mx.argmax(logits).item())  # one sequence: an index into the vocabulary
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        all_logits.append(logits)
    return tokens, mx.concatenate(all_logits)
