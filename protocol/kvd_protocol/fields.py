"""The checkers of message fields: what a value on the wire may be, and its bounds.

A message class declares each wire field with wire(checker) (messages.py); decoding a map
calls each field's checker (record.py). A checker raises schema.SchemaError (a bad message)
or ProtocolError (a specific code, e.g. TOO_LARGE).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Final

from . import schema
from .blocks import HASH_BYTES, MIN_BLOCK_TOKENS
from .errors import ErrorCode, ProtocolError
from .identity import Identity
from .limits import Limits
from .tokens import TOKEN_BYTES

U32: Final = (1 << 32) - 1
U64: Final = (1 << 64) - 1
MAX_FEATURES: Final = 256

# A field checker: (decoded value, field name, limits) -> the field's Python value.
# It raises schema.SchemaError (a bad message) or ProtocolError (a specific code, e.g. TOO_LARGE).
Check = Callable[[object, str, Limits], Any]


def wire(check: Check) -> dict[str, Check]:
    """The metadata of a dataclass field that is on the wire, checked by check when decoded."""
    return {"check": check}


# --- field checkers ---------------------------------------------------------------------------


def _uint(lo: int = 0, hi: int = U64) -> Check:
    def check(value: object, what: str, limits: Limits) -> int:
        if type(value) is int and lo <= value <= hi:  # the usual case, without a call
            return value
        return schema.integer(value, what, lo, hi)

    return check


def _name(value: object, what: str, limits: Limits) -> str:
    return schema.text(value, what, limits.max_name_bytes)


def _prose(value: object, what: str, limits: Limits) -> str:
    """Free text (error messages, reasons): bounded only by the frame."""
    return schema.text(value, what, limits.max_frame_bytes)


def _seconds(value: object, what: str, limits: Limits) -> float:
    return schema.number(value, what, 0.0, sys.float_info.max)


def _at_most(hi: float) -> Check:
    """A finite number in 0..hi (a duration, a measure)."""

    def check(value: object, what: str, limits: Limits) -> float:
        return schema.number(value, what, 0.0, hi)

    return check


def _token_count(value: object, what: str, limits: Limits) -> int:
    """A count of tokens: at most the max_tokens one request may carry."""
    if type(value) is int and 0 <= value <= limits.max_tokens:  # the usual case, without a call
        return value
    return schema.integer(value, what, 0, limits.max_tokens)


def _bool(value: object, what: str, limits: Limits) -> bool:
    return schema.boolean(value, what)


def _optional(check: Check) -> Check:
    return lambda value, what, limits: None if value is None else check(value, what, limits)


def _choice(choices: tuple[str, ...]) -> Check:
    def check(value: object, what: str, limits: Limits) -> str:
        if value not in choices:
            raise schema.SchemaError(f"{what}: expected one of {list(choices)}, got {value!r}")
        return str(value)

    return check


def _tokens(value: object, what: str, limits: Limits) -> bytes:
    max_bytes = limits.max_tokens * TOKEN_BYTES
    if type(value) is bytes and len(value) <= max_bytes and not len(value) % TOKEN_BYTES:
        return value  # the usual case, without a call
    if isinstance(value, bytes) and len(value) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{what}: {len(value) // TOKEN_BYTES} tokens, over the limit of {limits.max_tokens}",
        )
    return schema.binary(value, what, max_bytes, TOKEN_BYTES)


def _hashes(value: object, what: str, limits: Limits) -> bytes:
    """Block hashes, concatenated: as many as max_tokens tokens make blocks at the least."""
    max_bytes = limits.max_tokens // MIN_BLOCK_TOKENS * HASH_BYTES
    return schema.binary(value, what, max_bytes, HASH_BYTES)


def _identity(value: object, what: str, limits: Limits) -> Identity:
    return Identity.from_wire(value, limits)


def _limits(value: object, what: str, limits: Limits) -> Limits:
    names = {f.name for f in dataclasses.fields(Limits)}
    raw = schema.fields(value, what, names)
    return Limits(**{name: schema.integer(raw[name], f"{what}.{name}", 1, U32) for name in names})


def _features(value: object, what: str, limits: Limits) -> tuple[str, ...]:
    items = schema.sequence(value, what, MAX_FEATURES)
    return tuple(_name(item, what, limits) for item in items)


_ERROR_CODES = frozenset(code.value for code in ErrorCode)


def _error_code(value: object, what: str, limits: Limits) -> ErrorCode:
    if not isinstance(value, str) or value not in _ERROR_CODES:
        raise schema.SchemaError(f"{what}: not an error code: {value!r}")
    return ErrorCode(value)


_PLAIN = (type(None), bool, int, float, str, bytes)


def _status(value: object, what: str, limits: Limits) -> dict[str, Any]:
    """Free-form, but maps with string keys holding plain msgpack values (no ext types)."""
    if not isinstance(value, dict):
        raise schema.SchemaError(f"{what}: expected a map, got {type(value).__name__}")
    stack: list[object] = [value]
    while stack:  # iterative: nesting may be deeper than Python's recursion limit
        item = stack.pop()
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise schema.SchemaError(f"{what}: map keys must be strings")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, _PLAIN):
            raise schema.SchemaError(f"{what}: {type(item).__name__} is not allowed")
    return value
