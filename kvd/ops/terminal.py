"""Text for the operator's terminal. Names come from clients (model ids, namespaces, traits,
fingerprints), and a client of another user may be among them: whatever they hold, kvctl's
human output writes no control character of theirs, so none moves the cursor, retitles the
window, rings or rewrites what was printed before."""

from __future__ import annotations

import re
from typing import Any

# Unicode's control characters (category Cc): C0, DEL and C1. The tables' own line breaks
# and column gaps are added around the escaped cells, never taken from them.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """text with every control character written as its escape, \\x1b for ESC: what a
    terminal shows as is. Idempotent: an escape is printable already."""
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def printable_strings(value: Any) -> Any:
    """value (a status: dicts, lists, strings, numbers) with each string printable."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(key)): printable_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [printable_strings(item) for item in value]
    return value
