"""PrefixIndex: each lookup rule on its own, then the tree against the linear scan."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_protocol.tokens import pack_tokens

from kvd.store.prefix_index import Match, PrefixIndex, rank, scan_best_match
from kvd.store.records import EntryRecord

_ids = itertools.count()


def entry(
    *tokens: int,
    trimmable: bool = True,
    min_reuse: int = 0,
    last_used: int = 0,
    checkpoint_key: str | None = None,
) -> EntryRecord:
    return EntryRecord(
        id=f"e{next(_ids):06d}",
        digest="id",
        tokens=pack_tokens(tokens),
        nbytes=100,
        trimmable=trimmable,
        min_reuse=min_reuse,
        last_used=last_used,
        checkpoint_key=checkpoint_key,
    )


def index_of(*records: EntryRecord) -> PrefixIndex:
    index = PrefixIndex()
    for record in records:
        index.add(record)
    return index


def lookup(index: PrefixIndex, *prompt: int) -> Match | None:
    return index.best_match(pack_tokens(prompt))


# Rule 1: matched = min(LCP, len(prompt) - 1); zero is no match.


def test_empty_index_has_no_match() -> None:
    assert lookup(PrefixIndex(), 1, 2, 3) is None


def test_match_is_the_common_prefix() -> None:
    e = entry(1, 2, 3)
    assert lookup(index_of(e), 1, 2, 3, 4, 5) == Match(e, 3)


def test_match_is_capped_at_prompt_length_minus_one() -> None:
    e = entry(1, 2, 3)
    assert lookup(index_of(e), 1, 2, 3) == Match(e, 2)


def test_cap_makes_an_untrimmable_exact_entry_unusable() -> None:
    assert lookup(index_of(entry(1, 2, 3, trimmable=False)), 1, 2, 3) is None


def test_one_token_prompt_never_matches() -> None:
    assert lookup(index_of(entry(1), entry(1, 2)), 1) is None


def test_no_shared_first_token_is_no_match() -> None:
    assert lookup(index_of(entry(1, 2, 3)), 9, 2, 3) is None


# Rule 2: an entry longer than the match needs a trim, so it must be trimmable.


def test_longer_trimmable_entry_is_trimmed_to_the_match() -> None:
    e = entry(1, 2, 3, 4, 5)
    assert lookup(index_of(e), 1, 2, 3, 9) == Match(e, 3)


def test_longer_untrimmable_entry_is_unusable() -> None:
    assert lookup(index_of(entry(1, 2, 3, 4, 5, trimmable=False)), 1, 2, 3, 9) is None


def test_untrimmable_entry_that_needs_no_trim_is_usable() -> None:
    e = entry(1, 2, trimmable=False)
    assert lookup(index_of(e), 1, 2, 3) == Match(e, 2)


def test_untrimmable_long_entry_does_not_shadow_a_shorter_usable_one() -> None:
    snapshot = entry(1, 2, 3)
    generated = entry(1, 2, 3, 4, 5, 6, trimmable=False)
    assert lookup(index_of(snapshot, generated), 1, 2, 3, 4, 9) == Match(snapshot, 3)


# Rule 3: matched >= min_reuse.


def test_min_reuse_above_the_match_is_unusable() -> None:
    assert lookup(index_of(entry(1, 2, 3, 4, min_reuse=4)), 1, 2, 3, 9) is None


def test_min_reuse_equal_to_the_match_is_usable() -> None:
    e = entry(1, 2, 3, 4, min_reuse=3)
    assert lookup(index_of(e), 1, 2, 3, 9) == Match(e, 3)


def test_min_reuse_falls_back_to_a_shorter_match() -> None:
    whole_only = entry(1, 2, 3, 4, 5, min_reuse=5)
    short = entry(1, 2)
    assert lookup(index_of(whole_only, short), 1, 2, 3, 9) == Match(short, 2)


def test_min_reuse_picks_a_longer_entry_over_a_shorter_blocked_one() -> None:
    blocked = entry(1, 2, 7, 7, min_reuse=3)
    allowed = entry(1, 2, 8, 8, 8, min_reuse=1)
    assert lookup(index_of(blocked, allowed), 1, 2, 5) == Match(allowed, 2)


# Rule 4: the longest match wins; ties prefer no trim, then shortest, then most recent.


def test_longest_match_wins() -> None:
    short, long = entry(1, 2), entry(1, 2, 3, 4)
    assert lookup(index_of(short, long), 1, 2, 3, 4, 5) == Match(long, 4)


def test_tie_prefers_the_entry_that_needs_no_trim() -> None:
    boundary = entry(1, 2)
    longer = entry(1, 2, 3)  # also matches 2 tokens: the cap
    branch = entry(1, 2, 7)
    assert lookup(index_of(longer, branch, boundary), 1, 2, 3) == Match(boundary, 2)


def test_tie_prefers_the_shortest_entry() -> None:
    short, long = entry(1, 2, 7, 8), entry(1, 2, 6, 6, 6)
    assert lookup(index_of(long, short), 1, 2, 5) == Match(short, 2)


def test_tie_across_the_cap_prefers_the_shortest() -> None:
    # Both match 2: one through the cap (it holds the whole prompt), one by divergence.
    through_cap, diverging = entry(1, 2, 3, 4), entry(1, 2, 9)
    assert lookup(index_of(through_cap, diverging), 1, 2, 3) == Match(diverging, 2)


def test_tie_prefers_the_most_recently_used() -> None:
    a, b = entry(1, 2, 7, 8), entry(1, 2, 6, 6)
    index = index_of(a, b)
    index.touch(a, 1)
    assert lookup(index, 1, 2, 5) == Match(a, 2)
    index.touch(b, 2)
    assert lookup(index, 1, 2, 5) == Match(b, 2)


def test_touch_reranks_entries_with_different_min_reuse() -> None:
    reusable_from_2, reusable_from_0 = entry(1, 2, 7, 7, min_reuse=2), entry(1, 2, 8, 8)
    index = index_of(reusable_from_2, reusable_from_0)
    index.touch(reusable_from_2, 1)
    index.touch(reusable_from_0, 2)
    assert lookup(index, 1, 2, 5) == Match(reusable_from_0, 2)


def test_touch_cannot_move_back_in_time() -> None:
    e = entry(1, 2, last_used=5)
    index = index_of(e)
    with pytest.raises(ValueError, match="only grow"):
        index.touch(e, 4)


def test_touch_of_an_unindexed_entry_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        index_of(entry(1, 2)).touch(entry(1, 2), 1)


# exact, add, remove.


def test_exact_finds_only_the_same_tokens() -> None:
    e = entry(1, 2, 3)
    index = index_of(e, entry(1, 2, 3, 4))
    assert index.exact(pack_tokens([1, 2, 3])) is e
    assert index.exact(pack_tokens([1, 2])) is None
    assert index.exact(pack_tokens([1, 2, 4])) is None


def test_exact_duplicate_is_refused() -> None:
    index = index_of(entry(1, 2, 3))
    with pytest.raises(ValueError, match="already has these tokens"):
        index.add(entry(1, 2, 3))
    assert len(index) == 1


def test_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        PrefixIndex().add(entry(1, 2, checkpoint_key="k"))


def test_entry_without_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="no tokens"):
        PrefixIndex().add(entry())


def test_ragged_token_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        PrefixIndex().best_match(b"\x01\x00\x00\x00\x02")


def test_len_and_iteration_follow_add_and_remove() -> None:
    a, b, c = entry(1, 2), entry(1, 2, 3), entry(4)
    index = index_of(a, b, c)
    assert len(index) == 3
    assert set(index) == {a, b, c}
    index.remove(b)
    assert len(index) == 2
    assert set(index) == {a, c}


def test_remove_of_an_absent_entry_is_a_key_error() -> None:
    index = index_of(entry(1, 2))
    with pytest.raises(KeyError):
        index.remove(entry(1, 2))  # same tokens, another entry
    with pytest.raises(KeyError):
        index.remove(entry(1, 3))


def test_remove_the_best_falls_back_to_the_next() -> None:
    best, next_best, last = entry(1, 2, 7), entry(1, 2, 8, 8), entry(1, 2, 9, 9, 9)
    index = index_of(best, next_best, last)
    index.remove(best)
    assert lookup(index, 1, 2, 3) == Match(next_best, 2)
    index.remove(next_best)
    assert lookup(index, 1, 2, 3) == Match(last, 2)
    index.remove(last)
    assert lookup(index, 1, 2, 3) is None


def test_remove_of_a_branch_point_keeps_the_branches() -> None:
    branch_point = entry(1, 2)
    left, right = entry(1, 2, 3, 4), entry(1, 2, 5, 6)
    index = index_of(branch_point, left, right)
    index.remove(branch_point)
    index.remove(right)  # leaves an inner node with one child: merged away
    assert lookup(index, 1, 2, 3, 4, 9) == Match(left, 4)
    assert index.exact(pack_tokens([1, 2, 3, 4])) is left
    index.add(branch_point)
    assert lookup(index, 1, 2, 9) == Match(branch_point, 2)


# ancestors and covering.


def test_ancestors_are_the_strict_prefixes_shortest_first() -> None:
    a, b, same = entry(1), entry(1, 2, 3), entry(1, 2, 3, 4)
    index = index_of(same, b, a, entry(1, 2, 9), entry(1, 2, 3, 4, 5))
    assert index.ancestors(pack_tokens([1, 2, 3, 4])) == [a, b]
    assert index.ancestors(pack_tokens([7])) == []


def test_covering_is_a_strictly_longer_trimmable_entry() -> None:
    longer = entry(1, 2, 3, 4)
    index = index_of(longer)
    assert index.covering(pack_tokens([1, 2])) is longer  # ends inside an edge
    assert index.covering(pack_tokens([1, 2, 3, 4])) is None  # not strictly longer
    assert index.covering(pack_tokens([1, 2, 5])) is None  # not a prefix


def test_covering_from_a_node_looks_at_its_children() -> None:
    at_node, short, long = entry(1, 2), entry(1, 2, 3), entry(1, 2, 4, 4)
    assert index_of(at_node, long, short).covering(pack_tokens([1, 2])) is short


def test_covering_needs_a_trimmable_entry() -> None:
    assert index_of(entry(1, 2, 3, trimmable=False)).covering(pack_tokens([1, 2])) is None


def test_covering_respects_min_reuse() -> None:
    index = index_of(entry(1, 2, 3, 4, min_reuse=3))
    assert index.covering(pack_tokens([1, 2])) is None
    assert index.covering(pack_tokens([1, 2, 3])) is not None


# The tree against the linear scan, under any sequence of adds, removes and touches, with the
# tokens of each entry its own bytes or (as the snapshot loads them) a view into a larger buffer.


def viewed(record: EntryRecord) -> EntryRecord:
    """record with its tokens a read-only view into the middle of a buffer of its own."""
    record.tokens = memoryview(b"\xff" * 8 + bytes(record.tokens) + b"\xff" * 4)[8:-4]
    return record


_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=5)
# (kind, tokens, trimmable, min_reuse, which present entry): each op reads the fields it needs.
_Op = tuple[str, list[int], bool, int, int]
_ops = st.tuples(
    st.sampled_from(["add", "add", "remove", "touch"]),
    _tokens,
    st.booleans(),
    st.one_of(st.just(0), st.integers(0, 6)),  # mostly 0, as most caches are
    st.integers(0, 1000),
)


def _covering_by_scan(records: list[EntryRecord], tokens: bytes) -> EntryRecord | None:
    found = [
        r
        for r in records
        if r.trimmable
        and len(r.tokens) > len(tokens)
        and bytes(r.tokens).startswith(tokens)
        and r.min_reuse <= len(tokens) // 4
    ]
    return min(found, key=rank, default=None)


# (tokens, trimmable, min_reuse) of an entry added in bulk (PrefixIndex.add_all).
_batch_entry = st.tuples(_tokens, st.booleans(), st.one_of(st.just(0), st.integers(0, 6)))


@settings(max_examples=500, deadline=None)
@given(
    bulk=st.lists(_batch_entry, max_size=4),
    ops=st.lists(_ops, max_size=40),
    probes=st.lists(_tokens, min_size=1, max_size=8),
    views=st.booleans(),
)
def test_tree_agrees_with_the_scan(
    bulk: list[tuple[list[int], bool, int]],
    ops: list[_Op],
    probes: list[list[int]],
    views: bool,
) -> None:
    """From an empty tree, or one a bulk add began (its root's leaves bare records until a
    walk reaches them)."""
    index = PrefixIndex()
    batch = [entry(*t, trimmable=trim, min_reuse=reuse) for t, trim, reuse in bulk]
    batch = [viewed(record) for record in batch] if views else batch
    refused = index.add_all(batch)
    present = [record for record in batch if record not in refused]
    clock = itertools.count(1)
    for kind, tokens, trimmable, min_reuse, pick in ops:
        if kind == "add":
            record = entry(*tokens, trimmable=trimmable, min_reuse=min_reuse)
            if views:
                record = viewed(record)
            if index.exact(record.tokens) is None:
                index.add(record)
                present.append(record)
        elif present:
            record = present[pick % len(present)]
            if kind == "remove":
                index.remove(record)
                present.remove(record)
            else:
                index.touch(record, next(clock))
        assert len(index) == len(present)
        for probe in probes:
            prompt = pack_tokens(probe)
            assert index.best_match(prompt) == scan_best_match(present, prompt)
            assert index.covering(prompt) is _covering_by_scan(present, prompt)
            assert index.ancestors(prompt) == sorted(
                (r for r in present if len(r.tokens) < len(prompt) and prompt.startswith(r.tokens)),
                key=lambda r: len(r.tokens),
            )
    assert set(index) == set(present)


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(_batch_entry, max_size=6),
    batch=st.lists(_batch_entry, max_size=30),
    probes=st.lists(_tokens, min_size=1, max_size=8),
    views=st.booleans(),
)
def test_adding_in_bulk_is_adding_one_by_one(
    before: list[tuple[list[int], bool, int]],
    batch: list[tuple[list[int], bool, int]],
    probes: list[list[int]],
    views: bool,
) -> None:
    def made(fields: tuple[list[int], bool, int]) -> EntryRecord:
        tokens, trimmable, min_reuse = fields
        record = entry(*tokens, trimmable=trimmable, min_reuse=min_reuse)
        return viewed(record) if views else record

    index = PrefixIndex()
    present: list[EntryRecord] = []
    for record in map(made, before):
        if index.exact(record.tokens) is None:
            index.add(record)
            present.append(record)
    records = [made(fields) for fields in batch]
    refused = index.add_all(records)
    for record in records:  # the first of equal tokens joins, as add() one by one has it
        if any(bytes(r.tokens) == bytes(record.tokens) for r in present):
            assert record in refused
        else:
            assert record not in refused
            present.append(record)
    assert len(index) == len(present)
    assert set(index) == set(present)
    for probe in probes:
        prompt = pack_tokens(probe)
        assert index.best_match(prompt) == scan_best_match(present, prompt)
        assert index.covering(prompt) is _covering_by_scan(present, prompt)
    for record in present:  # and it stays a tree that removes, as any other
        index.remove(record)
    assert len(index) == 0


def test_adding_in_bulk_refuses_what_add_refuses() -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        PrefixIndex().add_all([entry(1), entry(2, checkpoint_key="gen")])
    with pytest.raises(ValueError, match="no tokens"):
        PrefixIndex().add_all([entry()])
