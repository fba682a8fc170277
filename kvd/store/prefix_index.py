"""The prefix index of one identity: which stored entry serves a prompt best.

A radix tree (compressed trie) over token ids. Edge labels are packed token bytes, always a
whole number of 4-byte tokens, keyed in their parent by their first token; a node is where an
entry ends or where entries branch. A label is a slice of the tokens of an entry below it: a
view, for an entry whose tokens are a view (records.Tokens), so the tree copies no tokens of
the entries loaded from the snapshot; it compares them through a bytes copy of one side, made
only when there is an edge to compare.
Lookup walks the prompt once, so its cost grows with the prompt's length and not with the
number of entries.

The lookup rules (docs/design.md, "Keying and lookup"), stated as code by `scan_best_match`:

1. matched = min(LCP(entry, prompt), len(prompt) - 1): the engine needs at least one prompt
   token to compute logits. matched == 0 is no match.
2. An entry longer than matched needs a trim, so it is usable only if it is trimmable.
3. matched must be at least the entry's min_reuse.
4. The longest matched wins. On a tie: the entry that needs no trim, then the shortest (the
   least to trim), then the most recently used, then the smallest id (only so that the answer
   is deterministic).

Rule 2 is the one that keeps an untrimmable longer entry (a wrapped rotating cache, SSM state)
from shadowing a shorter usable one: it never ranks at all.

To apply rules 2-4 without visiting every entry below a node, each node keeps a frontier: the
trimmable entries of its subtree that some threshold m could select as "the best with
min_reuse <= m", sorted best first (so min_reuse strictly decreases along it). With min_reuse
0 everywhere it holds one entry. add, remove and touch keep the frontiers right along the
entry's path. A leaf's frontier is its own entry (if trimmable), so it is not stored; the
root keeps none, as every match is of one token at least: no lookup reads the root's.

A leaf of the root that a bulk add made (start-up's, where nearly every entry is one) is kept
as its bare record, whose whole tokens are its label: the first walk to reach it makes its
node (_node). A start-up so makes no object per entry here beyond a key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import repeat
from operator import attrgetter, is_not, itemgetter
from typing import NamedTuple

from kvd_protocol.tokens import TOKEN_BYTES, common_prefix_tokens, token_count

from kvd.store.records import EntryRecord, Tokens

_FIRST_TOKEN = slice(0, TOKEN_BYTES)


class Match(NamedTuple):
    record: EntryRecord
    matched: int  # tokens of the prompt the entry serves; trim the entry to this length


def rank(record: EntryRecord) -> tuple[int, int, str]:
    """Order among candidates with the same match: shortest, most recently used, smallest id."""
    # The length in bytes orders as the token count does, without two calls per rank.
    return (len(record.tokens), -record.last_used, record.id)


def usable_match(record: EntryRecord, prompt: bytes) -> int:
    """Tokens of prompt that record serves under rules 1-3, or 0 if it is not usable."""
    matched = min(common_prefix_tokens(bytes(record.tokens), prompt), token_count(prompt) - 1)
    if matched <= 0 or matched < record.min_reuse:
        return 0
    if record.token_count > matched and not record.trimmable:
        return 0
    return matched


def scan_best_match(records: Iterable[EntryRecord], prompt: bytes) -> Match | None:
    """The lookup rules as a linear scan: the specification PrefixIndex.best_match meets."""
    best: Match | None = None
    best_key: tuple[int, bool, tuple[int, int, str]] | None = None
    for record in records:
        matched = usable_match(record, prompt)
        if not matched:
            continue
        key = (-matched, record.token_count > matched, rank(record))
        if best_key is None or key < best_key:
            best, best_key = Match(record, matched), key
    return best


class _Node:
    __slots__ = ("_frontier", "children", "label", "record")

    def __init__(self, label: Tokens, record: EntryRecord | None = None) -> None:
        self.label = label  # tokens from the parent to here
        self.children: dict[bytes, _Child] | None = None  # by first token; None at a leaf
        self.record = record  # the entry that ends exactly here
        self._frontier: tuple[EntryRecord, ...] = ()  # an inner node's

    @property
    def frontier(self) -> tuple[EntryRecord, ...]:
        """A leaf's is its own entry if that is trimmable: made when read, not kept (most
        nodes are leaves, and a tuple each is 48 bytes per entry)."""
        if self.children is None:
            record = self.record
            return (record,) if record is not None and record.trimmable else ()
        return self._frontier

    @frontier.setter
    def frontier(self, frontier: tuple[EntryRecord, ...]) -> None:
        self._frontier = () if self.children is None else frontier


# A child: a node, or a leaf of the root kept as its bare record (see the module docstring).
_Child = _Node | EntryRecord


def _node(children: dict[bytes, _Child], key: bytes) -> _Node | None:
    """The child by key, as a node: a bare record's is made now, in its place."""
    child = children.get(key)
    if child is None or isinstance(child, _Node):
        return child
    node = children[key] = _Node(child.tokens, child)
    return node


def _frontier_of(child: _Child) -> tuple[EntryRecord, ...]:
    if isinstance(child, _Node):
        return child.frontier
    return (child,) if child.trimmable else ()


def _sweep(candidates: Iterable[EntryRecord]) -> tuple[EntryRecord, ...]:
    """Keep, best first, each candidate whose min_reuse is below that of every better one."""
    candidates = list(candidates)
    best = min(candidates, key=rank, default=None)
    if best is None or not best.min_reuse:  # the usual case, without a sort: best alone
        return () if best is None else (best,)
    kept: list[EntryRecord] = []
    for record in sorted(candidates, key=rank):
        if not kept or record.min_reuse < kept[-1].min_reuse:
            kept.append(record)
    return tuple(kept)


def _first_usable(frontier: tuple[EntryRecord, ...], matched: int) -> EntryRecord | None:
    for record in frontier:
        if record.min_reuse <= matched:
            return record
    return None


def _subtree_frontier(node: _Node) -> tuple[EntryRecord, ...]:
    candidates = [node.record] if node.record is not None and node.record.trimmable else []
    for child in (node.children or {}).values():
        candidates.extend(_frontier_of(child))
    return _sweep(candidates)


def _comparable(label: Tokens, length: int) -> bytes:
    """label, or of a view its first length bytes (as much as is compared), as bytes."""
    return label if isinstance(label, bytes) else bytes(label[:length])


def _check_tokens(tokens: Tokens) -> None:
    if len(tokens) % TOKEN_BYTES:
        raise ValueError(f"token bytes length {len(tokens)} is not a multiple of {TOKEN_BYTES}")


def _check_indexable(record: EntryRecord) -> None:
    if record.checkpoint_key is not None:
        raise ValueError(f"entry {record.id} is a generation checkpoint, not a prompt cache")
    _check_tokens(record.tokens)
    if not record.tokens:
        raise ValueError(f"entry {record.id} has no tokens")


class PrefixIndex:
    """The entries of one identity, by their tokens; at most one entry per token sequence.

    Generation checkpoints are never added: they are not prompt caches. An exact duplicate is
    refused; the caller decides which of the two to keep (exact() finds the present one).
    The tie on recency reads last_used, so change it through touch() only.
    """

    def __init__(self) -> None:
        self._root = _Node(b"")
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[EntryRecord]:
        stack: list[_Child] = [self._root]
        while stack:
            node = stack.pop()
            if not isinstance(node, _Node):
                yield node
                continue
            if node.record is not None:
                yield node.record
            if node.children:
                stack.extend(node.children.values())

    def _exact_path(self, tokens: Tokens) -> list[_Node] | None:
        """The nodes from the root to the node where tokens end, or None if none ends there."""
        _check_tokens(tokens)
        tokens = bytes(tokens)  # a view's copy, to compare with
        node, pos, path = self._root, 0, [self._root]
        while pos < len(tokens):
            child = _node(node.children, tokens[pos : pos + TOKEN_BYTES]) if node.children else None
            if child is None or not tokens.startswith(child.label, pos):
                return None
            node, pos = child, pos + len(child.label)
            path.append(node)
        return path if pos == len(tokens) else None

    def exact(self, tokens: Tokens) -> EntryRecord | None:
        """The entry whose tokens are exactly tokens."""
        path = self._exact_path(tokens)
        return path[-1].record if path else None

    def add(self, record: EntryRecord) -> None:
        """Index record; ValueError for a checkpoint, no tokens, or an exact duplicate."""
        _check_indexable(record)
        view = record.tokens
        # A view's copy, to compare with, made once an edge is to be compared: an entry whose
        # first token starts no edge yet (most of a start-up's) copies only that token.
        tokens = view if isinstance(view, bytes) else None
        node, pos, path = self._root, 0, [self._root]
        while pos < len(view):
            key = bytes(view[pos : pos + TOKEN_BYTES])
            children = node.children
            if children is None:  # a leaf becomes an inner node: its frontier is kept now
                node._frontier = node.frontier
                children = node.children = {}
            child = _node(children, key)
            if child is None:  # the rest is a new leaf (the whole view: no new one)
                node = children[key] = _Node(view[pos:] if pos else view)
                path.append(node)
                break
            if tokens is None:
                tokens = bytes(view)
            if not tokens.startswith(child.label, pos):
                # Split the edge where tokens leave it; the new inner node has the same subtree.
                shared = TOKEN_BYTES * common_prefix_tokens(
                    _comparable(child.label, len(tokens) - pos),
                    tokens[pos : pos + len(child.label)],
                )
                inner = _Node(child.label[:shared])
                child.label = child.label[shared:]
                inner.children = {bytes(child.label[:TOKEN_BYTES]): child}
                inner.frontier = child.frontier
                child = children[key] = inner
            node, pos = child, pos + len(child.label)
            path.append(node)
        if node.record is not None:
            raise ValueError(f"entry {node.record.id} already has these tokens")
        node.record = record
        self._count += 1
        if record.trimmable:
            self._promote(path, record)

    def add_all(self, records: Iterable[EntryRecord]) -> list[EntryRecord]:
        """add() each record, in order; the ones refused as exact duplicates are returned
        (ValueError, as add() raises it, for a checkpoint or no tokens).

        In bulk, as start-up indexes: a record whose first token starts no edge and no other
        record of the batch becomes a leaf of the root at once (its bare record); the others
        are added one by one. The tree is the same either way: it depends on the set of
        entries, not on their order. When every first token is new (the usual start-up), the
        checks, keys and leaves are made by C loops (map), without a Python step per record.
        """
        batch = list(records)
        tokens = list(map(attrgetter("tokens"), batch))
        lengths = list(map(len, tokens))
        if (
            any(map(is_not, map(attrgetter("checkpoint_key"), batch), repeat(None)))
            or not all(lengths)
            or any(map(TOKEN_BYTES.__rmod__, lengths))
        ):
            for record in batch:
                _check_indexable(record)  # raises
        root = self._root
        children = root.children or {}
        keys = list(map(bytes, map(itemgetter(_FIRST_TOKEN), tokens)))
        leaves, rest = batch, []
        if len(set(keys)) == len(keys) and children.keys().isdisjoint(keys):
            children.update(zip(keys, batch, strict=True))
        else:
            firsts = Counter(keys)  # how many of the batch start with each first token
            leaves = []
            for record, key in zip(batch, keys, strict=True):
                if firsts[key] > 1 or key in children:
                    rest.append(record)
                else:
                    leaves.append(record)
                    children[key] = record
        self._count += len(leaves)
        root.children = children or None
        refused = []
        for record in rest:
            try:
                self.add(record)
            except ValueError:
                refused.append(record)
        return refused

    def _promote(self, path: list[_Node], record: EntryRecord) -> None:
        """Let record (new, or ranked higher) into the frontiers along its path.

        Where it does not get in, some better entry with no larger min_reuse is in that subtree,
        and so in every subtree above: the frontiers above cannot change.
        """
        key = rank(record)
        alone = (record,)
        for node in reversed(path[1:]):  # not the root: it keeps no frontier
            frontier = node.frontier
            # The common case when entries arrive (or are used) in turn, O(1): record ranks
            # first and reuses as short a prefix as any in the frontier, so it alone remains.
            if not frontier or (
                (frontier[0] is record or key < rank(frontier[0]))
                and record.min_reuse <= frontier[-1].min_reuse
            ):
                node.frontier = alone  # one tuple shared by every node it is alone in
                continue
            best = frontier[0]
            # The other common case, O(1): a better entry that reuses at least as short a prefix.
            if best is not record and rank(best) < key and best.min_reuse <= record.min_reuse:
                return
            frontier = _sweep([*(r for r in frontier if r is not record), record])
            if record not in frontier:
                return
            node.frontier = frontier

    def remove(self, record: EntryRecord) -> None:
        """Remove record; KeyError if it is not indexed here."""
        path = self._exact_path(record.tokens)
        if path is None or path[-1].record is not record:
            raise KeyError(record.id)
        node = path[-1]
        node.record = None
        self._count -= 1
        # From the node's parent when it is a leaf (its frontier is its own entry, now none),
        # up to the root's child.
        for above in reversed(path[1:] if node.children else path[1:-1]):
            if record not in above.frontier:
                break  # not in this subtree's frontier, so in none above
            above.frontier = _subtree_frontier(above)
        self._prune(path)

    def _prune(self, path: list[_Node]) -> None:
        """Drop a node left with no entry and no children; merge one left with a single child."""
        node = path.pop()
        if node.record is not None or node is self._root:
            return
        if not node.children:
            parent = path.pop()
            siblings = parent.children
            assert siblings is not None
            del siblings[bytes(node.label[:TOKEN_BYTES])]
            parent.children = siblings or None
            if parent.record is not None or parent is self._root:
                return
            node = parent
        if node.children and len(node.children) == 1:
            # A node with no entry and one child has that child's frontier already.
            (child,) = node.children.values()
            assert isinstance(child, _Node)  # only the root keeps bare records
            child.label = b"".join((node.label, child.label))
            siblings = path[-1].children
            assert siblings is not None
            siblings[bytes(node.label[:TOKEN_BYTES])] = child

    def touch(self, record: EntryRecord, last_used: int) -> None:
        """Record a use at logical time last_used (never earlier than the one recorded)."""
        if last_used < record.last_used:
            raise ValueError(f"last_used may only grow: {last_used} < {record.last_used}")
        path = self._exact_path(record.tokens)
        if path is None or path[-1].record is not record:
            raise KeyError(record.id)
        record.last_used = last_used
        if record.trimmable:
            self._promote(path, record)

    def best_match(self, prompt: bytes) -> Match | None:
        """The entry that serves prompt best under the lookup rules, and how many tokens."""
        _check_tokens(prompt)
        cap = token_count(prompt) - 1
        if cap <= 0:
            return None
        # Walk the prompt: every node it passes whole, then where it leaves the tree.
        positions: list[tuple[_Node, int, bool]] = []  # (node, depth in tokens, passed whole)
        node, pos = self._root, 0
        while pos < len(prompt) and node.children:
            child = _node(node.children, prompt[pos : pos + TOKEN_BYTES])
            if child is None:
                break
            if prompt.startswith(child.label, pos):
                node, pos = child, pos + len(child.label)
                positions.append((node, pos // TOKEN_BYTES, True))
                continue
            # The prompt leaves (or ends) inside this edge: every entry below shares exactly
            # the tokens up to that point.
            label = _comparable(child.label, len(prompt) - pos)
            shared = common_prefix_tokens(label, prompt[pos : pos + len(child.label)])
            positions.append((child, pos // TOKEN_BYTES + shared, False))
            break
        # Deepest first: every entry below a position shares at least its depth with the
        # prompt, so the first position with a usable entry has the longest match. Its
        # frontier also holds the deeper entries, but one of those that passed the test here
        # (trimmable, min_reuse <= matched) would have been usable deeper already.
        for i in range(len(positions) - 1, -1, -1):
            node, depth, whole = positions[i]
            matched = min(depth, cap)
            if i and min(positions[i - 1][1], cap) == matched:
                continue  # the cap made the position above equal: its subtree holds this one
            own = node.record
            if whole and own is not None and depth == matched and own.min_reuse <= matched:
                return Match(own, matched)  # needs no trim: preferred on a tie
            best = _first_usable(node.frontier, matched)
            if best is not None:
                return Match(best, matched)
        return None

    def ancestors(self, tokens: Tokens) -> list[EntryRecord]:
        """Entries whose tokens are a strict prefix of tokens, shortest first.

        A new trimmable entry supersedes these (an untrimmable one never does: rule 2).
        """
        _check_tokens(tokens)
        tokens = bytes(tokens)  # a view's copy, to compare with
        found: list[EntryRecord] = []
        node, pos = self._root, 0
        while node.children:
            child = _node(node.children, tokens[pos : pos + TOKEN_BYTES])
            if child is None or not tokens.startswith(child.label, pos):
                break
            node, pos = child, pos + len(child.label)
            if pos == len(tokens):
                break
            if node.record is not None:
                found.append(node.record)
        return found

    def covering(self, tokens: bytes) -> EntryRecord | None:
        """A trimmable entry that tokens strictly prefixes and may be trimmed to them, or None.

        A put of tokens that such an entry covers needs no write: a lookup gets the same
        prefix from it. The best by rank() is chosen.
        """
        _check_tokens(tokens)
        needed = token_count(tokens)
        if not needed:
            return None
        node, pos = self._root, 0
        while pos < len(tokens):
            child = _node(node.children, tokens[pos : pos + TOKEN_BYTES]) if node.children else None
            if child is None:
                return None
            if not tokens.startswith(child.label, pos):
                # tokens end inside this edge, or leave it: everything below is longer.
                ends_inside = pos + len(child.label) > len(tokens)
                if ends_inside and tokens.startswith(child.label[: len(tokens) - pos], pos):
                    return _first_usable(child.frontier, needed)
                return None
            node, pos = child, pos + len(child.label)
        # Ending on a node: its own entry is no strict extension; its children's entries are.
        below = (_first_usable(_frontier_of(c), needed) for c in (node.children or {}).values())
        return min((r for r in below if r is not None), key=rank, default=None)
