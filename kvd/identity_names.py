"""Identities as people tell them apart: their aspects, the names the daemon derives from
them, and the `--identity` argument kvctl resolves against those names.

An identity's aspects are the traits its engine says (kv, template, adapter, then any other,
in the engine's order; not its source), then what its fields hold: its namespace, runtime,
codec, and the first 8 hex digits of its config fingerprint and tokenizer hash. A trait an
engine did not say is UNSAID.

Its name starts with where its model came from, as the engine says it in its source trait (a
repository id such as `mlx-community/Llama-3.2-3B-Instruct-4bit`, else the model folder's name),
or else with its model id; then come as few of the aspects that differ among the identities
of its model (its model id) as tell it apart from each of them, in that order:
`Llama-3.2-3B-Instruct-4bit` while it is the model's only identity,
`Llama-3.2-3B-Instruct-4bit,kv=8bit-g64` beside `Llama-3.2-3B-Instruct-4bit,kv=none`. A name is
unique among the identities named together (the tier's); should two still share one (two
models from folders of one name; model ids are the engines' to choose), each ends with `,id=`
and 12 digits of its digest. So a name can change as identities of its model come and go; the
digest never does. Names are bounded whatever engines say: the start at START_CHARS
characters, each aspect's value at VALUE_CHARS, the whole at NAME_CHARS (then cut, ending with
`,id=` and the digest's 12 digits).
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvd_protocol.identity import SOURCE_TRAIT, Identity

TRAIT_ASPECTS: Final = ("kv", "template", "adapter")  # the engine library's, first
FIELD_ASPECTS: Final = ("ns", "runtime", "codec", "config", "tokenizer")
_FIELDS: Final = frozenset(FIELD_ASPECTS)
# A field aspect that differs because a trait does says nothing more: config hashes kv,
# tokenizer the template, the namespace the adapter.
EXPLAINED_BY: Final = {"config": "kv", "tokenizer": "template", "ns": "adapter"}
OTHER_TRAIT: Final = "trait"  # a trait beyond TRAIT_ASPECTS, as a miss reason names it
UNSAID: Final = "-"
SHORT_HASH: Final = 8
DIGEST_SHOWN: Final = 12
DIGEST_HEX: Final = 32  # Identity.digest()'s length
CANDIDATES_SHOWN: Final = 10  # of an ambiguous --identity, listed in its error
_HEX: Final = frozenset(string.hexdigits.lower())
START_CHARS: Final = 64
VALUE_CHARS: Final = 48
NAME_CHARS: Final = 160
CUT: Final = "~"  # ends a start or a value cut short


def aspects(identity: Identity) -> dict[str, str]:
    """identity's aspects, in order (see the module)."""
    traits = identity.trait_map()
    traits.pop(SOURCE_TRAIT, None)  # the name's start, not an aspect
    found = {key: traits.pop(key, UNSAID) for key in TRAIT_ASPECTS}
    found.update(traits)  # the others, in the engine's order
    found.update(
        ns=identity.namespace or UNSAID,
        runtime=identity.runtime,
        codec=identity.codec_id,
        config=identity.config_fingerprint[:SHORT_HASH],
        tokenizer=identity.tokenizer_hash[:SHORT_HASH],
    )
    return found


def differences(asked: Identity, other: Identity) -> list[tuple[str, str, str]]:
    """What tells other from asked: (aspect, other's value, asked's), traits first; a trait
    either did not say is not compared, nor a field aspect that a differing trait explains."""
    mine, theirs = aspects(asked), aspects(other)
    found = []
    for key in theirs.keys() - _FIELDS:
        value, asked_value = theirs[key], mine.get(key, UNSAID)
        if UNSAID not in (value, asked_value) and value != asked_value:
            found.append((key, value, asked_value))
    traits = {key for key, _, _ in found}
    for key in FIELD_ASPECTS:
        if theirs[key] != mine[key] and EXPLAINED_BY.get(key) not in traits:
            found.append((key, theirs[key], mine[key]))
    order = list(theirs)
    return sorted(found, key=lambda item: order.index(item[0]))


def names(identities: Mapping[str, Identity | None]) -> dict[str, str]:
    """Each identity's name, by digest (see the module); one known by digest only is named
    by its digest. O(identities x aspects^2)."""
    found: dict[str, str] = {}
    models: dict[str, list[tuple[str, str, dict[str, str]]]] = {}
    for digest, identity in identities.items():
        if identity is None:
            found[digest] = digest
        else:
            start = _cut(identity.trait_map().get(SOURCE_TRAIT) or identity.model_id, START_CHARS)
            models.setdefault(identity.model_id, []).append((digest, start, aspects(identity)))
    for members in models.values():
        found.update(_model_names(members))
    taken = Counter(found.values())
    for digest, name in found.items():
        told = f"{name},id={digest[:DIGEST_SHOWN]}" if taken[name] > 1 and name != digest else name
        if len(told) > NAME_CHARS:  # cut, and told apart by the digest
            told = told[: NAME_CHARS - DIGEST_SHOWN - 5] + f"{CUT},id={digest[:DIGEST_SHOWN]}"
        found[digest] = told
    return found


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + CUT


def _model_names(members: Sequence[tuple[str, str, dict[str, str]]]) -> dict[str, str]:
    """The names of one model's identities (digest, the name's start, aspects): each its
    start and the shortest prefix of the aspects that vary among them which no other member
    shares."""
    if len(members) == 1:
        return {members[0][0]: members[0][1]}
    traits = dict.fromkeys(key for _, _, found in members for key in found if key not in _FIELDS)
    keys = [*traits, *FIELD_ASPECTS]  # the traits any of them says first, as aspects() has it
    varying = [k for k in keys if len({found.get(k, UNSAID) for _, _, found in members}) > 1]
    rows = {
        digest: [_cut(found.get(k, UNSAID), VALUE_CHARS) for k in varying]
        for digest, _, found in members
    }
    starts = {digest: start for digest, start, _ in members}
    shared = Counter(tuple(row[:n]) for row in rows.values() for n in range(len(row) + 1))
    named = {}
    for digest, row in rows.items():
        n = next((n for n in range(1, len(row) + 1) if shared[tuple(row[:n])] == 1), len(row))
        parts = [f",{key}={value}" for key, value in zip(varying[:n], row[:n], strict=True)]
        if shared[tuple(row)] > 1:  # the same aspects (hashes cut short): the digest tells
            parts.append(f",id={digest[:DIGEST_SHOWN]}")
        named[digest] = starts[digest] + "".join(parts)
    return named


class IdentityNameError(LookupError):
    """An --identity that names no identity, or more than one: its lines, the first saying
    which, each other a candidate."""

    def __str__(self) -> str:
        return "\n".join(map(str, self.args))


def resolve(listed: Sequence[Mapping[str, Any]], given: str, left_out: int = 0) -> str:
    """The digest of the identity that given names, among the status's identities (listed;
    left_out more not listed): a name, a digest, or a digest's unique prefix; a model id, or
    a name's start (its source) whose identities have longer names, stands for all of them.
    A whole digest passes as it is (the daemon may hold an identity the status does not
    list). Raises IdentityNameError,
    listing the candidates of an ambiguous one (CANDIDATES_SHOWN of them at most)."""
    if not given:
        raise IdentityNameError("an empty identity names none: `kvctl status` lists them")
    named = [i for i in listed if i.get("name") == given]
    if len(named) == 1:
        return str(named[0]["identity"])
    lowered = given.lower()
    if len(lowered) == DIGEST_HEX and set(lowered) <= _HEX:
        return lowered
    candidates = named or [
        i
        for i in listed
        if (set(lowered) <= _HEX and str(i["identity"]).startswith(lowered))
        or str(i.get("name", "")).startswith(f"{given},")
        or i.get("model_id") == given
    ]
    if len(candidates) == 1:
        return str(candidates[0]["identity"])
    if candidates:
        shown = candidates[:CANDIDATES_SHOWN]
        rows = [f"  {i.get('name', '')}  {i['identity']}" for i in shown]
        more = len(candidates) - len(shown)
        rows += [f"  and {more} more"] if more else []
        raise IdentityNameError(f"{given!r} names {len(candidates)} identities:", *rows)
    unlisted = f"; {left_out} more it does not list go by their whole digest" if left_out else ""
    raise IdentityNameError(
        f"no identity is named {given!r}, nor has a digest starting so: `kvctl status` "
        f"lists them{unlisted}"
    )
