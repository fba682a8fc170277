"""Why a lookup found nothing usable: its reason, from a fixed set (status counts misses by
it, per identity), and a sentence for the engine's log.

- "no entry": no entry of the identity shares a prefix with the prompt;
- "below min_tokens": the best one (or none) holds no more of it than the engine's own memory
  does (min_tokens is what that covers + 1, and at least 2): the status counts these apart, as
  engine-held, not as misses of the tier;
- "unreadable": the best one's file cannot be opened now;
- "<aspect> differs" (kv, template, adapter, trait, ns, runtime, codec, config, tokenizer):
  either of the first two, while another identity of the same model holds more of the prompt
  than the engine asked for; the aspect is the first that tells the two apart
  (identity_names.differences), and the sentence names that identity and all of them.

Looking at the other identities costs a prefix walk of the prompt in each, on a miss only, in
at most OTHERS_LOOKED_AT of them: a miss is about to cost the engine a whole prefill. A tenant
is told of its own identities only: that another user's entries hold a prompt is that user's.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from kvd_protocol.identity import Identity
from kvd_protocol.tokens import TOKEN_BYTES

from kvd.identity_names import (
    DIGEST_SHOWN,
    FIELD_ASPECTS,
    OTHER_TRAIT,
    TRAIT_ASPECTS,
    differences,
)
from kvd.store.catalog import Catalog
from kvd.store.telemetry import Telemetry

NO_ENTRY: Final = "no entry"
BELOW_MIN_TOKENS: Final = "below min_tokens"
UNREADABLE: Final = "unreadable"
OTHERS_LOOKED_AT: Final = 8


class Miss(NamedTuple):  # not a dataclass: one is made per miss, at a third of the cost
    reason: str
    detail: str


def explain(
    catalog: Catalog,
    telemetry: Telemetry,
    identity: Identity,
    tokens: bytes,
    *,
    reason: str,
    matched: int,
    min_tokens: int,
    tenant: str = "",
) -> Miss:
    """The miss of a lookup of tokens under identity whose own best match held matched
    tokens and was refused for reason, from a peer of tenant ("": the daemon's user's)."""
    prompt = len(tokens) // TOKEN_BYTES
    digest = identity.digest()
    if reason == UNREADABLE:
        return Miss(reason, f"the best entry ({matched} tokens) cannot be opened now")
    wanted = max(min_tokens, matched + 1, 1)
    elsewhere = _best_elsewhere(catalog, telemetry, identity, tokens, wanted=wanted, tenant=tenant)
    if elsewhere is not None:
        other, held = elsewhere
        told = differences(identity, other)
        aspect = told[0][0] if told else "config"
        described = "; ".join(f"{key} {value}, not {asked}" for key, value, asked in told)
        return Miss(
            f"{OTHER_TRAIT if aspect not in _NAMED else aspect} differs",
            f"identity {other.digest()[:DIGEST_SHOWN]} of the same model ({other.model_id}) "
            f"holds {held} tokens of this {prompt}-token prompt, this one "
            f"({digest[:DIGEST_SHOWN]}) {matched}: they differ by {described or 'digest'}",
        )
    if reason == BELOW_MIN_TOKENS:
        return Miss(
            reason,
            f"the best entry holds {matched} tokens of this {prompt}-token prompt, no more than "
            f"the {min_tokens - 1} the engine holds",
        )
    if not catalog.holds(digest):
        holds = "holds no entry"
    elif matched:  # a presence query's: a lookup's matches are hits
        holds = (
            f"holds no entry usable for more than {matched} tokens of this {prompt}-token prompt"
        )
    else:
        holds = "holds none usable for this prompt"
    return Miss(reason, f"identity {digest[:DIGEST_SHOWN]} ({identity.model_id}) {holds}")


_NAMED: Final = frozenset(TRAIT_ASPECTS + FIELD_ASPECTS)  # the others are OTHER_TRAIT


def _best_elsewhere(
    catalog: Catalog,
    telemetry: Telemetry,
    identity: Identity,
    tokens: bytes,
    *,
    wanted: int,
    tenant: str,
) -> tuple[Identity, int] | None:
    """The identity of the same model under tenant (other than identity) whose entries hold
    the most of tokens, at least wanted, and how many; None if none does."""
    others = telemetry.by_model.get(identity.model_id)
    digest = identity.digest()
    if others is None or (len(others) == 1 and digest in others):  # the usual: no other
        return None
    best: tuple[Identity, int] | None = None
    looked_at = 0
    for other in sorted(others):
        index = catalog.index(other)
        known = telemetry.identities.get(other)
        if other == digest or index is None or known is None or known.identity is None:
            continue
        if not known.identity.namespace.startswith(tenant):
            continue
        looked_at += 1
        match = index.best_match(tokens)
        if match is not None and match.matched >= max(wanted, best[1] + 1 if best else 0):
            best = known.identity, match.matched
        if looked_at == OTHERS_LOOKED_AT:
            break
    return best
