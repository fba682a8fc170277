"""kvd's parts import one way (docs/design.md, "Inside the daemon"): ops, then serve, then
remote, then store, then the modules every part shares at the top of kvd/. Only the entry
points reach into any part, and no module but an entry point imports one. A request is
dispatched by the op table alone (docs/design.md, "The daemon's shape"), and the tier is
reached through its services' methods alone (docs/design.md, "Inside the daemon")."""

from __future__ import annotations

import ast

from kvd_protocol import ops
from test_packaging import import_graph, module_sources

import kvd
from kvd.serve import handlers
from kvd.store.admin import Admin
from kvd.store.life_cycle import LifeCycle
from kvd.store.notices import Notices
from kvd.store.puts import Puts
from kvd.store.reads import Reads
from kvd.store.tickets import Tickets
from kvd.store.tier_view import TierView

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


OP_TABLE = "kvd.serve.handlers"
REQUEST_OPS = frozenset(ops.OPS)
REQUEST_TYPES = frozenset(op.request.__name__ for op in ops.OPS.values())


def _name(node: ast.AST) -> str | None:
    """What an expression names, as `x` or `m.x` do (None for anything else)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _handler_table(node: ast.AST) -> list[str]:
    """The op names a mapping display (or dict(...) call) keys to something not constant."""
    if isinstance(node, ast.Dict):
        pairs = [
            (k.value if isinstance(k, ast.Constant) else None, v)
            for k, v in zip(node.keys, node.values, strict=True)
        ]
    elif isinstance(node, ast.Call) and _name(node.func) == "dict":
        pairs = [(k.arg, k.value) for k in node.keywords]
    else:
        return []
    return [k for k, v in pairs if k in REQUEST_OPS and not isinstance(v, ast.Constant)]


def _op_compared(node: ast.AST) -> list[str]:
    """The op names an `op` (a request's, or a variable so named) is compared with."""
    if not isinstance(node, ast.Compare):
        return []
    sides = [node.left, *node.comparators]
    if not any(_name(side) == "op" for side in sides):
        return []
    return sorted(
        {
            n.value
            for side in sides
            for n in ast.walk(side)
            if isinstance(n, ast.Constant) and n.value in REQUEST_OPS
        }
    )


def _type_compared(node: ast.AST) -> list[str]:
    """The request classes a type is compared with (`is`, `==`, isinstance)."""
    if isinstance(node, ast.Compare):
        if not any(isinstance(o, ast.Is | ast.IsNot | ast.Eq | ast.NotEq) for o in node.ops):
            return []
    elif not (isinstance(node, ast.Call) and _name(node.func) == "isinstance"):
        return []
    return sorted({name for n in ast.walk(node) if (name := _name(n)) in REQUEST_TYPES})


def dispatches(source: str) -> list[str]:
    """The places in source that pick code by a request's op or type: a mapping keyed by two
    op names or more to something other than constants (handlers), a comparison of an `op`
    with a name, or of a type with a request's class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if len(table := _handler_table(node)) >= 2:
            found.append(f"line {line}: a table of {table}")
        if ops := _op_compared(node):
            found.append(f"line {line}: op compared with {ops}")
        if types := _type_compared(node):
            found.append(f"line {line}: a type compared with {types}")
    return found


def test_the_dispatch_finder_finds_each_kind() -> None:
    source = """
table = {"ping": self._ping, "lookup": self._lookup}
other = dict(put_begin=put_begin, verify=verify)
if request.op in ("open_blocks", "put_blocks"): pass
op = request.op; big = op == "verify"
if type(asked) is m.Lookup: pass
if isinstance(asked, m.Release): pass
exit_codes = {"ping": "refused", "list": "refused"}
"""
    assert [place.split(":")[0] for place in dispatches(source)] == [
        "line 2",
        "line 3",
        "line 4",
        "line 5",
        "line 6",
        "line 7",
    ]


def test_the_op_table_answers_every_request() -> None:
    assert set(handlers.OPS) == REQUEST_OPS
    assert handlers.op_table(None) is handlers.OPS


def test_the_op_table_is_the_only_dispatch() -> None:
    elsewhere = {
        module: places
        for module, path in sorted(module_sources(kvd).items())
        if module != OP_TABLE and (places := dispatches(path.read_text()))
    }
    assert not elsewhere, f"requests dispatched outside the op table: {elsewhere}"


# The tier's services, by the attribute of Tier that holds each (kvd/store/tier.py): what the
# rest of the daemon calls, each by its public methods alone. Of Tier itself, only these and
# its settings are read outside kvd/store; its rooms (catalog, writer, ...) are the services'.
SERVICES: dict[str, type] = {
    "puts": Puts,
    "reads": Reads,
    "admin": Admin,
    "life": LifeCycle,
    "view": TierView,
    "tickets": Tickets,
    "notices": Notices,
}
TIER_PUBLIC = {*SERVICES, "limits", "config"}


def _methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and name[0] != "_"}


def _chain(node: ast.Attribute) -> list[str]:
    """The names of an attribute chain, outermost first: `c.tier.puts.begin` -> [c, tier,
    puts, begin] (a call or subscript on the way ends it)."""
    names: list[str] = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name):
        names.append(current.id)
    return names[::-1]


def reaches_in(source: str) -> list[str]:
    """The places in source that read more of the tier than its services' methods: an
    attribute of `tier` (or `_tier`) that is not a service nor a setting, and a member of a
    service (held under its name, with or without a leading underscore) that is not one of
    its public methods."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        names = _chain(node)
        for here, name in enumerate(names[:-1]):
            after = names[here + 1]
            if name.lstrip("_") == "tier" and after not in TIER_PUBLIC:
                found.add(f"line {node.lineno}: tier.{after}")
            service = SERVICES.get(name.lstrip("_"))
            if service is not None and here and after not in _methods(service):
                found.add(f"line {node.lineno}: {name}.{after}")
    return sorted(found)


def test_the_reach_finder_finds_each_kind() -> None:
    source = """
c.tier.catalog.records
self.tier.writer.queue
tier.notices.stored.append(listener)
self._local.reads._leases
tier.puts.staged_bytes
c.tier.reads.lookup(owner)
tier.notices.on_stored(listener)
c.tier.limits
c.peer.admin
"""
    assert reaches_in(source) == [
        "line 2: tier.catalog",
        "line 3: tier.writer",
        "line 4: notices.stored",
        "line 5: reads._leases",
        "line 6: puts.staged_bytes",
    ]


def test_no_module_outside_the_store_reaches_into_the_tier() -> None:
    reaching = {
        module: places
        for module, path in sorted(module_sources(kvd).items())
        if part_of(module) != "store" and (places := reaches_in(path.read_text()))
    }
    assert not reaching, f"reaching past the tier's services: {reaching}"


def test_the_remote_tier_holds_no_tier_and_no_service() -> None:
    """kvd.remote is handed the parts of the local tier it uses (kvd.remote.local_tier): it
    imports none of the tier's services that do the work, nor the Tier that wires them (the
    notices' Listener is the type of the hooks it is handed)."""
    working = (Puts, Reads, Admin, LifeCycle, TierView, Tickets)
    services = {cls.__module__ for cls in working} | {"kvd.store.tier"}
    reaching = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph(kvd).items())
        if part_of(module) == "remote"
        for target in sorted(targets & services)
    ]
    assert not reaching
