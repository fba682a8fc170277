"""A whole entry's slots checked on the commit's thread and the block checkers' at once
(kvd/store/slot_checks.py), on a real entry file: every slot checked, and the refusal names
the first bad slot in file order, as a check on one thread would."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvd_client.entry_io import tensor_views, write_entry
from kvd_protocol.entry import LayerSpec, Slot, TensorSpec, plan_entry
from kvd_protocol.errors import EntryFormatError, Rule
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

from kvd.store import entry_files, slot_checks

TOKENS = 256
SHAPE = (1, 2, TOKENS, 1024)  # 1 MiB a slot in float16, 64 slots: 64 MiB, spread
LAYERS = 32


@pytest.fixture
def whole_entry(tmp_path: Path) -> Iterator[tuple[int, tuple[Slot, ...]]]:
    """A whole entry file of 64 slots, written as the engine library writes it: a read-write
    descriptor of it and its slots as its head gives them."""
    spec = TensorSpec("float16", SHAPE)
    layers = [LayerSpec("kv", (spec, spec), trimmable=True)] * LAYERS
    rng = np.random.default_rng(3)
    tensors = [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(2 * LAYERS)]
    identity = Identity("test/slots", "cfg", "tok", "codecs/1", "mlx/cpu")
    plan = plan_entry(
        identity, pack_tokens(range(TOKENS)), layers, created=time.time(), min_reuse=0
    )
    path = tmp_path / "whole.kvs"
    fd = entry_files.create_staging(path, plan.file_size)
    try:
        write_entry(fd, plan, tensor_views(plan, tensors))
        slots = entry_files.read_header(path, DEFAULT_LIMITS).slots
        assert sum(slot.nbytes for slot in slots) >= slot_checks.SPREAD_BYTES
        yield fd, slots
    finally:
        os.close(fd)


def test_an_intact_entry_passes(whole_entry: tuple[int, tuple[Slot, ...]]) -> None:
    fd, slots = whole_entry
    slot_checks.verify_slots(fd, "whole.kvs", slots)


@pytest.mark.parametrize(
    "spoiled", [(0,), (1,), (32,), (63,), (7, 50), (62, 63)], ids=lambda s: "-".join(map(str, s))
)
def test_the_first_spoiled_slot_in_file_order_is_named(
    whole_entry: tuple[int, tuple[Slot, ...]], spoiled: tuple[int, ...]
) -> None:
    fd, slots = whole_entry
    for index in spoiled:
        os.pwrite(fd, b"\xff" * 64, slots[index].start + 1000)
    with pytest.raises(EntryFormatError) as failed:
        slot_checks.verify_slots(fd, "whole.kvs", slots)
    assert failed.value.rule == Rule.DATA_CHECKSUM
    assert f"slot at {slots[spoiled[0]].start}:" in str(failed.value)


def test_a_file_cut_short_is_refused_at_the_first_slot_it_lacks(
    whole_entry: tuple[int, tuple[Slot, ...]],
) -> None:
    """Every slot from the cut on is short; the one cut through is named."""
    fd, slots = whole_entry
    os.ftruncate(fd, slots[40].start + 4096)
    with pytest.raises(EntryFormatError) as failed:
        slot_checks.verify_slots(fd, "whole.kvs", slots)
    assert failed.value.rule == Rule.TRUNCATED
    assert f"slot at {slots[40].start}: 4096 of" in str(failed.value)
