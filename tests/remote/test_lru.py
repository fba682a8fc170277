"""LruMap and LruSet: bounded by weight or count (the least recently used member goes) and
by age (a member added longer ago than max_age is forgotten when asked for)."""

from __future__ import annotations

from kvd.remote.lru import LruMap, LruSet


def test_past_its_capacity_the_least_recently_used_member_goes() -> None:
    members: LruSet[str] = LruSet(2)
    members.add("a")
    members.add("b")
    assert "a" in members  # asked: now the most recently used
    members.add("c")
    assert ("a" in members, "b" in members, "c" in members) == (True, False, True)
    assert len(members) == 2


def test_a_member_older_than_max_age_is_forgotten() -> None:
    now = [100.0]
    members: LruSet[str] = LruSet(10, max_age=60.0, clock=lambda: now[0])
    members.add("old")
    now[0] += 30.0
    members.add("young")
    now[0] += 31.0  # old: 61 s, young: 31 s
    assert "old" not in members
    assert "young" in members
    assert len(members) == 1


def test_adding_again_renews_a_members_age() -> None:
    now = [0.0]
    members: LruSet[str] = LruSet(10, max_age=60.0, clock=lambda: now[0])
    members.add("block")
    now[0] = 50.0
    members.add("block")
    now[0] = 100.0
    assert "block" in members


def test_discard_forgets_a_member() -> None:
    members: LruSet[int] = LruSet(4)
    members.add(1)
    members.discard(1)
    members.discard(2)  # not a member: nothing happens
    assert 1 not in members


def test_a_map_forgets_its_least_recently_used_members_past_its_weight() -> None:
    layouts: LruMap[str, bytes] = LruMap(10)
    layouts.set("a", b"aaaa", 4)
    layouts.set("b", b"bbbb", 4)
    assert layouts.get("a") == b"aaaa"  # now the most recently used
    layouts.set("c", b"cccc", 4)  # 12 > 10: b goes
    assert ("a" in layouts, "b" in layouts, "c" in layouts) == (True, False, True)
    assert layouts.figures() == {"size": 2, "weight": 8, "capacity": 10}
    layouts.set("huge", b"x" * 11, 11)  # heavier than the whole: not kept, nothing lost
    assert "huge" not in layouts
    assert layouts.figures() == {"size": 2, "weight": 8, "capacity": 10}
    layouts.set("a", b"a", 1)  # set again: its new weight counts
    assert layouts.pop("a") == b"a"
    assert layouts.figures() == {"size": 1, "weight": 4, "capacity": 10}


def test_a_map_member_older_than_max_age_is_forgotten() -> None:
    now = [0.0]
    found: LruMap[str, int] = LruMap(10, max_age=60.0, clock=lambda: now[0])
    found.set("old", 1)
    now[0] = 61.0
    assert found.get("old") is None
    assert found.figures()["weight"] == 0
