"""What a prefill checkpoint writes of its own for real hybrid models: the untrimmable state of
their linear-attention layers (Gated DeltaNet, Mamba-2), from their config.json values.

A checkpoint's attention layers (KVCache) share the tier's blocks with the checkpoint before
it; what it writes of its own is each ArraysCache: a convolution state and a recurrent state.
Their shapes and dtypes are taken from mlx-lm's own code: one linear-attention layer of each
model is built at its real size (random bfloat16 weights, no checkpoint is read) and runs one
token into an ArraysCache, whose arrays are weighed. The KV bytes per token (bfloat16) are
2 x key/value heads x head_dim x 2 bytes per attention layer.

Break-even: the prefill tokens whose compute takes as long as writing one checkpoint's state
at --ssd-gbps; a checkpoint every N tokens is worth its write when N is well above it. The
bytes column "KV tokens" is how many tokens of KV the same bytes hold. The last column is the
interval the engine chooses by cost (kvd_client.prefill_checkpoints.choose_interval, its
own write rate, the default 1 GiB of checkpoints per prompt) for prompts of 8K and 64K
tokens, in kvd-mlx-lm-server's blocks.

    .venv/bin/python bench/checkpoint_bytes.py [--ssd-gbps 2.0]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
from kvd_client.prefill_checkpoints import choose_interval
from kvd_client.server_flags import SERVER_BLOCK_TOKENS
from mlx_lm.models import nemotron_h, qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache

KV_BYTES = 2  # bfloat16 keys and values
PROMPTS = (8192, 65536)  # prompt tokens the interval by cost is shown for


@dataclass(frozen=True)
class RealModel:
    name: str
    config: dict[str, Any]  # config.json values (those the layer classes read)
    linear_layers: int
    attention_layers: int
    prefill_tps: float  # prompt tokens per second on an M-series Mac
    prefill_source: str


# The Gated DeltaNet layers of both Qwen models (their config.json values, cited below).
QWEN_GATED_DELTANET = {
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}

# Qwen3.5-9B: the model card (hidden 4096; 32 layers as 8 x (3 Gated DeltaNet, 1 gated
# attention); DeltaNet 32 value / 16 query-key heads of 128; attention 16 query / 4 KV heads
# of 256) and the text_config of a Qwen/Qwen3.5-9B config.json
# (huggingface.co/khtsly/Mini-Coder/blob/main/config.json: linear_conv_kernel_dim 4,
# full_attention_interval 4, intermediate_size 12288).
QWEN3_5_9B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "full_attention_interval": 4,
    "intermediate_size": 12288,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    **QWEN_GATED_DELTANET,
    "vocab_size": 248320,
}

# Qwen3-Next-80B-A3B-Instruct: its config.json
# (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json: hidden_size 2048,
# head_dim 256, linear_num_value_heads 32, linear_num_key_heads 16, linear_key_head_dim and
# linear_value_head_dim 128, linear_conv_kernel_dim 4, full_attention_interval 4,
# intermediate_size 5120, moe_intermediate_size 512, decoder_sparse_step 1) and transformers'
# Qwen3NextConfig, whose defaults are that model's (docs.vllm.ai .../configs/qwen3_next:
# 48 layers, 16 attention heads, 2 key/value heads). The experts hold no cache.
QWEN3_NEXT_80B = {
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    **QWEN_GATED_DELTANET,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 512,
    "moe_intermediate_size": 512,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 262144,
}

# Nemotron-H-8B: NVIDIA's Megatron-Bridge model page
# (docs.nvidia.com/nemo/megatron-bridge/latest/models/llm/nemotronh.html: 52 layers of the
# pattern below, hidden 4096, FFN 21504, 32 query heads, 8 key-value groups, KV channels 128,
# Mamba heads 128 of dim 64, state dim 128) and its NemotronHModelProvider (mamba_num_groups
# 8); conv_kernel 4 as in the nemotron_h config.json files.
NEMOTRON_H_8B = {
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "vocab_size": 131072,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "mamba_proj_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "use_conv_bias": True,
    "layer_norm_epsilon": 1e-5,
}

# The one public M-series prefill figure found for these models: Qwen3-Next-80B-A3B 8-bit
# through mlx-lm on a Mac Studio, 60K tokens in 71.6 s (github.com/ml-explore/mlx-lm/issues/
# 1162). For the 9B-class models 1,000 tokens/s is assumed (4-bit on an M-series Max), not
# measured: the break-even scales with it.
QWEN3_NEXT_TPS = 60_000 / 71.6
ASSUMED_9B_TPS = 1_000.0


def _interleaved(config: dict[str, Any]) -> tuple[int, int]:
    """Linear and attention layers: mlx-lm's rule, every full_attention_interval-th layer is
    attention."""
    interval = config["full_attention_interval"]
    attention = sum((i + 1) % interval == 0 for i in range(config["num_hidden_layers"]))
    return config["num_hidden_layers"] - attention, attention


def _patterned(config: dict[str, Any]) -> tuple[int, int]:
    pattern = config["hybrid_override_pattern"]
    return pattern.count("M"), pattern.count("*")


MODELS = (
    RealModel(
        "Qwen3.5-9B",
        {"model_type": "qwen3_5", **QWEN3_5_9B},
        *_interleaved(QWEN3_5_9B),
        ASSUMED_9B_TPS,
        "assumed",
    ),
    RealModel(
        "Qwen3-Next-80B-A3B",
        {"model_type": "qwen3_next", **QWEN3_NEXT_80B},
        *_interleaved(QWEN3_NEXT_80B),
        QWEN3_NEXT_TPS,
        "mlx-lm #1162",
    ),
    RealModel(
        "Nemotron-H-8B",
        {"model_type": "nemotron_h", **NEMOTRON_H_8B},
        *_patterned(NEMOTRON_H_8B),
        ASSUMED_9B_TPS,
        "assumed",
    ),
)


# model_type: mlx-lm's module, its args class, its linear-attention layer class.
LINEAR_LAYERS: dict[str, tuple[ModuleType, str, str]] = {
    "qwen3_5": (qwen3_5, "TextModelArgs", "GatedDeltaNet"),
    "qwen3_next": (qwen3_next, "ModelArgs", "Qwen3NextGatedDeltaNet"),
    "nemotron_h": (nemotron_h, "ModelArgs", "NemotronHMamba2Mixer"),
}


def layer_state(config: dict[str, Any]) -> list[mx.array]:
    """The arrays one linear-attention layer of config, at its real size as mlx-lm builds
    it, keeps in its ArraysCache after a token."""
    module, args_class, layer_class = LINEAR_LAYERS[config["model_type"]]
    layer = getattr(module, layer_class)(getattr(module, args_class).from_dict(config))
    layer.set_dtype(mx.bfloat16)
    cache: Any = ArraysCache(size=2)  # mlx-lm's annotations are of an empty cache
    layer(mx.zeros((1, 1, config["hidden_size"]), dtype=mx.bfloat16), None, cache)
    state: list[mx.array] = cache.cache
    mx.eval(state)
    return state


def kv_bytes_per_token(model: RealModel) -> int:
    heads, head_dim = int(model.config["num_key_value_heads"]), int(model.config["head_dim"])
    return model.attention_layers * 2 * heads * head_dim * KV_BYTES


def _described(state: list[mx.array]) -> str:
    return " + ".join(f"{tuple(a.shape)} {str(a.dtype).removeprefix('mlx.core.')}" for a in state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ssd-gbps", type=float, default=2.0, help="SSD write, GB/s")
    args = parser.parse_args()
    print(
        "| model | linear / attention layers | state of one linear layer (conv + recurrent) "
        "| state per checkpoint | KV per token (bf16) | KV tokens of the same bytes "
        f"| write at {args.ssd_gbps:g} GB/s | prefill tok/s (source) | break-even tokens "
        "| checkpoints per GiB | interval by cost, 8K / 64K prompt |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in MODELS:
        state = layer_state(model.config)
        nbytes = model.linear_layers * sum(a.nbytes for a in state)
        kv = kv_bytes_per_token(model)
        write = nbytes / (args.ssd_gbps * 1e9)
        intervals = [
            choose_interval(
                state_bytes=nbytes,
                prefill_rate=model.prefill_tps,
                prompt_tokens=tokens,
                unit=SERVER_BLOCK_TOKENS,
            )
            for tokens in PROMPTS
        ]
        print(
            f"| {model.name} | {model.linear_layers} / {model.attention_layers} "
            f"| {_described(state)} | {nbytes / (1 << 20):,.1f} MiB | {kv / 1024:,.0f} KiB "
            f"| {nbytes / kv:,.0f} | {write * 1e3:,.1f} ms "
            f"| {model.prefill_tps:,.0f} ({model.prefill_source}) "
            f"| {write * model.prefill_tps:,.0f} | {(1 << 30) // nbytes:,} "
            f"| {' / '.join(f'{n:,}' for n in intervals)} |"
        )


if __name__ == "__main__":
    main()
