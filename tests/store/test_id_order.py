"""IdOrder against a plain sorted list: the same ids, in the same order, from any point."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.store.id_order import BLOCK, IdOrder

IDS = st.text(alphabet="0123456789abcdef", min_size=1, max_size=4)


@given(
    st.lists(st.tuples(st.booleans(), IDS), max_size=3 * BLOCK),
    st.one_of(st.none(), IDS),
)
def test_matches_a_sorted_list(steps: list[tuple[bool, str]], after: str | None) -> None:
    order, model = IdOrder(), set[str]()
    for add, entry_id in steps:
        if add and entry_id not in model:
            order.add(entry_id)
            model.add(entry_id)
        elif not add and entry_id in model:
            order.remove(entry_id)
            model.discard(entry_id)
    assert len(order) == len(model)
    assert list(order.after(None)) == sorted(model)
    assert list(order.after(after)) == sorted(i for i in model if after is None or i > after)


def test_blocks_split_and_empty_out() -> None:
    order = IdOrder()
    ids = [f"{n:05d}" for n in range(5 * BLOCK)]
    for entry_id in reversed(ids):
        order.add(entry_id)
    assert list(order.after(ids[BLOCK])) == ids[BLOCK + 1 :]
    for entry_id in ids[: 4 * BLOCK]:
        order.remove(entry_id)
    assert list(order.after(None)) == ids[4 * BLOCK :]
    with pytest.raises(KeyError):
        order.remove(ids[0])


def test_ids_added_in_bulk_or_one_by_one_between_reads_stay_in_order() -> None:
    order, model = IdOrder(), list[str]()
    batches = [[f"{n:05d}" for n in range(start, 20_000, 7)] for start in range(7)]
    for batch in batches:  # many ids at once: sorted in afresh
        for entry_id in reversed(batch):
            order.add(entry_id)
        model = sorted(model + batch)
        assert list(order.after(None)) == model
    for entry_id in ["00000x", "10000x", "zzzzz"]:  # a few: inserted where they go
        order.add(entry_id)
        model = sorted([*model, entry_id])
        assert list(order.after("09999")) == [i for i in model if i > "09999"]
    order.remove("10000x")
    model.remove("10000x")
    assert len(order) == len(model)
    assert list(order.after(None)) == model
