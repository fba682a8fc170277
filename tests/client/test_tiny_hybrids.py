"""The tiny hybrid models (qwen3_next, nemotron_h): their folders load in mlx-lm as the model
built from the same config and seed, and their caches mix KVCache and ArraysCache. What kvd
restores of them is checked with the other models' in test_models_e2e.py. And the state
bench/checkpoint_bytes.py weighs, from one layer, is what the whole model keeps."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import cache as _mlx_lm_cache
from mlx_lm.models.cache import make_prompt_cache
from model_folders import SMALL_CONFIGS, build_model_folder, small_model
from tiny_models import VOCAB, prefill, prompt, tiny_nemotron_h, tiny_qwen3_next

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import checkpoint_bytes  # bench/ is not a package

mlc: Any = _mlx_lm_cache  # mlx-lm ships no type hints for its cache classes

HYBRIDS: dict[str, Callable[[], Any]] = {
    "qwen3_next": tiny_qwen3_next,
    "nemotron_h": tiny_nemotron_h,
}


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_folder_loads_as_the_model_of_its_config_and_seed(
    tmp_path: Path, model_type: str
) -> None:
    folder = build_model_folder(tmp_path / model_type, seed=3, model_type=model_type)
    loaded, tokenizer = mlx_lm.load(str(folder))[:2]
    assert type(loaded).__module__ == f"mlx_lm.models.{model_type}"
    built = small_model(json.loads((folder / "config.json").read_text()), seed=3)
    tokens = mx.array([tokenizer.encode("cache prefix token restore")])
    assert mx.array_equal(loaded(tokens), built(tokens)).item()


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_caches_mix_kv_and_arrays_caches(model_type: str) -> None:
    model = HYBRIDS[model_type]()
    cache = prefill(model, prompt(12))
    assert {type(c) for c in make_prompt_cache(model)} == {mlc.KVCache, mlc.ArraysCache}
    arrays = [c for c in cache if type(c) is mlc.ArraysCache]
    assert all(c.cache[0] is not None and c.cache[1] is not None for c in arrays)
    assert all(c.offset == 12 for c in cache if type(c) is mlc.KVCache)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_the_state_weighed_from_one_layer_is_what_the_whole_model_keeps(model_type: str) -> None:
    config = {"model_type": model_type, **SMALL_CONFIGS[model_type], "vocab_size": VOCAB}
    model = small_model(config, seed=0)
    model.set_dtype(mx.bfloat16)  # as checkpoint_bytes builds its layer
    kept = [c.cache for c in prefill(model, prompt(12)) if type(c) is mlc.ArraysCache]
    weighed = checkpoint_bytes.layer_state(config)
    assert [[(a.shape, a.dtype) for a in state] for state in kept] == [
        [(a.shape, a.dtype) for a in weighed]
    ] * len(kept)
    assert weighed[1].dtype == mx.float32  # the recurrent state, whatever the weights
