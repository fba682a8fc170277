"""kvd's parts import one way (docs/design.md, "Inside the daemon"): ops, then serve, then
remote, then store, then the modules every part shares at the top of kvd/. Only the entry
points reach into any part, and no module but an entry point imports one."""

from __future__ import annotations

from test_packaging import import_graph

import kvd

TOP = "top"
ENTRY_POINTS = {"kvd.__main__", "kvd.cli"}
# Each part and the parts its modules may import, itself included.
MAY_IMPORT = {
    TOP: {TOP},
    "store": {"store", TOP},
    "remote": {"remote", "store", TOP},
    "serve": {"serve", "remote", "store", TOP},
    "ops": {"ops", "serve", "remote", "store", TOP},
}


def part_of(module: str) -> str:
    """kvd.store.tier is in store; kvd.config is at the top."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 2 else TOP


def test_every_module_is_at_the_top_or_in_a_part() -> None:
    graph = import_graph(kvd)
    assert {part_of(module) for module in graph} == set(MAY_IMPORT)


def test_parts_import_only_the_parts_below_them() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph(kvd).items())
        if module not in ENTRY_POINTS
        for target in sorted(targets)
        if part_of(target) not in MAY_IMPORT[part_of(module)]
    ]
    assert not upward, f"imports against the parts' direction: {upward}"


def test_no_module_imports_an_entry_point() -> None:
    importers = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph(kvd).items())
        if module not in ENTRY_POINTS  # __main__ runs cli
        for target in sorted(targets & ENTRY_POINTS)
    ]
    assert not importers
