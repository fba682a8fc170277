"""The prefill checkpoint mark (PREFILL_CHECKPOINT_META): true or absent, never beside a
generation checkpoint; a reader and the planners refuse anything else with a schema error
that names the key."""

from __future__ import annotations

from typing import Any

import pytest
from entry_samples import IDENTITY, data_of, forge, header_of, manifest_layers, read, write
from kvd_protocol.entry import (
    PREFILL_CHECKPOINT_META,
    Checkpoint,
    LayerSpec,
    TensorSpec,
    plan_entry,
    plan_manifest,
)
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.tokens import pack_tokens

TOKENS = pack_tokens(range(32))
GENERATION = Checkpoint("gen-1", 7, 1234, True, 30, 2)
# Values equal to True in Python (1, 1.0) are not the mark: only true is.
HOSTILE = {
    "a string": "true",
    "an int": 2,
    "one": 1,
    "one as a float": 1.0,
    "false": False,
    "a map": {"on": True},
}


def hybrid_layers(tokens: int = 32) -> list[LayerSpec]:
    """A KV layer and an SSM state: a hybrid model's cache."""
    kv = TensorSpec("float16", (1, 2, tokens, 8))
    state = TensorSpec("float32", (1, 3, 5))
    return [LayerSpec("kv", (kv, kv), trimmable=True), LayerSpec("ssm", (state,), trimmable=False)]


def marked(value: object = True, checkpoint: Checkpoint | None = None) -> bytes:
    """A valid prefill checkpoint file, its mark then set to value in the written header."""
    plan = plan_entry(
        IDENTITY,
        TOKENS,
        hybrid_layers(),
        created=1_700_000_000.0,
        min_reuse=0,
        meta={PREFILL_CHECKPOINT_META: True, "mlx_lm": "0.32.2"},
    )
    blob, _ = write(plan)
    header: dict[str, Any] = header_of(blob)
    header["meta"][PREFILL_CHECKPOINT_META] = value
    if checkpoint is not None:
        header["checkpoint"] = checkpoint.to_wire()
    return forge(header, data_of(blob))


def test_a_marked_entry_reads_as_a_prefill_checkpoint_and_an_unmarked_one_does_not() -> None:
    assert read(marked()).prefill_checkpoint
    unmarked = plan_entry(IDENTITY, TOKENS, hybrid_layers(), created=1.0, min_reuse=0)
    assert not unmarked.header.prefill_checkpoint
    assert not read(write(unmarked)[0]).prefill_checkpoint


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_mark_other_than_true_is_a_schema_error_naming_the_key(value: object) -> None:
    with pytest.raises(EntryFormatError) as refused:
        read(marked(value))
    assert refused.value.rule is Rule.SCHEMA
    assert PREFILL_CHECKPOINT_META in str(refused.value)


def test_a_prefill_checkpoint_that_is_also_a_generation_checkpoint_is_refused() -> None:
    with pytest.raises(EntryFormatError) as refused:
        read(marked(True, GENERATION))
    assert refused.value.rule is Rule.SCHEMA
    assert "not both" in str(refused.value)


@pytest.mark.parametrize(
    "value", [v for v in HOSTILE.values() if not isinstance(v, dict)], ids=list(HOSTILE)[:-1]
)
def test_the_planners_refuse_what_a_reader_would(value: bool | float | str) -> None:
    meta = {PREFILL_CHECKPOINT_META: value}
    with pytest.raises(ValueError, match=PREFILL_CHECKPOINT_META):
        plan_entry(IDENTITY, TOKENS, hybrid_layers(), created=1.0, min_reuse=0, meta=meta)
    with pytest.raises(ValueError, match=PREFILL_CHECKPOINT_META):
        plan_manifest(
            IDENTITY,
            TOKENS,
            manifest_layers(32),
            block_tokens=16,
            created=1.0,
            min_reuse=0,
            meta=meta,
        )


def test_the_planners_refuse_both_kinds_at_once() -> None:
    with pytest.raises(ValueError, match="not both"):
        plan_entry(
            IDENTITY,
            TOKENS,
            hybrid_layers(),
            created=1.0,
            min_reuse=0,
            checkpoint=GENERATION,
            meta={PREFILL_CHECKPOINT_META: True},
        )
