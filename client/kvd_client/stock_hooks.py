"""What a kvd server relies on in the stock server it runs (mlx_lm.server, vllm-mlx), checked
before it serves: the functions and methods it calls or overrides, each with its signature,
and the names of a module it replaces, each with the function that must look it up when
called. The versions it is tested with are the range kvd-client declares for the stock
server's extra (client/pyproject.toml), read from the installed package's metadata."""

from __future__ import annotations

import dis
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import import_module, metadata
from types import ModuleType
from typing import Any, Final

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet


@dataclass(frozen=True)
class Hook:
    """A function of a module of the stock server (owner None) or a method of one of its
    classes (a nested class: dotted), with the signature the integration calls or overrides
    (parameters and defaults, no annotations; a default that is not a plain value shows as its
    type): a caller of a changed one would pass what the override does not take."""

    module: str
    owner: str | None
    name: str
    signature: str

    @property
    def where(self) -> str:
        return ".".join(part for part in (self.module, self.owner, self.name) if part)


def problems(hooks: Iterable[Hook], replaced: Mapping[str, Mapping[str, str]]) -> list[str]:
    """What is missing or changed of hooks, and of the names replaced (per module, name: the
    function or "Class.method" that must look it up), each said once."""
    found = [p for hook in hooks if (p := _hook_problem(import_module(hook.module), hook))]
    for module, names in replaced.items():
        replaced_in = import_module(module)
        for name, user in names.items():
            if not _reads_global(_lookup(replaced_in, user), name):
                found.append(f"{module}.{user} no longer looks up {name} by that name")
    return list(dict.fromkeys(found))  # a missing class once


def tested_range(package: str) -> SpecifierSet:
    """The versions of package kvd-client declares for its extra."""
    for line in metadata.requires("kvd-client") or ():
        requirement = Requirement(line)
        if requirement.name == package:
            return requirement.specifier
    raise LookupError(f"kvd-client's metadata declares no {package} range")


def range_text(versions: SpecifierSet) -> str:
    """A range as pip takes it, lower bound first: ">=0.32.0,<=0.32.2"."""
    return ",".join(sorted(map(str, versions), key=lambda bound: bound[0] != ">"))


def _hook_problem(module: ModuleType, hook: Hook) -> str | None:
    owner: Any = module if hook.owner is None else _lookup(module, hook.owner)
    if owner is None or (hook.owner is not None and not inspect.isclass(owner)):
        return f"{hook.module} has no class {hook.owner}"
    function = getattr(owner, hook.name, None)
    if not callable(function):
        return f"{hook.where} is missing"
    found = _bare_signature(function)
    if found != hook.signature:
        return f"{hook.where} is {found}, not {hook.signature}"
    return None


def _lookup(module: ModuleType, dotted: str) -> Any:
    """The attribute of module that dotted names ("Class.method"), or None."""
    found: Any = module
    for part in dotted.split("."):
        found = getattr(found, part, None)
    return found


def _reads_global(function: object, name: str) -> bool:
    """Whether function looks name up in its module when it runs (not an import's alias)."""
    if not inspect.isfunction(function):
        return False
    return any(
        step.opname == "LOAD_GLOBAL" and step.argval == name
        for step in dis.get_instructions(function)
    )


def _bare_signature(function: Callable[..., Any]) -> str:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return "(unknown)"
    bare = [
        p.replace(annotation=inspect.Parameter.empty, default=_Default.of(p.default))
        for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


class _Default:
    """A default shown by its type: an object's repr may name the machine (an MLX stream's
    device)."""

    PLAIN: Final = (type(None), bool, int, float, str, bytes, tuple)

    def __init__(self, value: object) -> None:
        self.value = value

    @classmethod
    def of(cls, value: object) -> object:
        return (
            value
            if value is inspect.Parameter.empty or isinstance(value, cls.PLAIN)
            else cls(value)
        )

    def __repr__(self) -> str:
        return f"<{type(self.value).__name__}>"
