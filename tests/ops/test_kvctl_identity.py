"""`kvctl ... --identity` against a real daemon: a name, a digest, or a digest's unique
prefix, in list, evict and verify alike; an ambiguous one lists its candidates, an unknown
one says so, and neither touches anything."""

from __future__ import annotations

import json

import pytest
from daemon_e2e import put_stored
from daemon_process import Daemon, kvctl
from identity_variants import MODEL, variant
from kvd_client import Client
from kvd_protocol.identity import Identity

PLAIN = variant("none")
QUANTISED = variant("8bit-g64")


def _sharing_a_first_digit() -> tuple[Identity, Identity]:
    """Two identities of another model whose digests start with the same hex digit."""
    seen: dict[str, Identity] = {}
    for n in range(100):
        identity = variant(model="qwen3-aa11", namespace=f"team-{n}")
        first = identity.digest()[0]
        if first in seen:
            return seen[first], identity
        seen[first] = identity
    raise AssertionError("17 digests always share a first digit")


ONE, TWO = _sharing_a_first_digit()


@pytest.fixture
def stocked(daemon: Daemon) -> Daemon:
    """A daemon holding an entry of each: PLAIN, QUANTISED, ONE and TWO."""
    with Client.connect(daemon.socket_path, require=True) as client:
        for seed, identity in enumerate((PLAIN, QUANTISED, ONE, TWO)):
            put_stored(client, identity, range(32), seed)
    return daemon


def _listed(daemon: Daemon, given: str) -> set[str]:
    result = kvctl(daemon, "list", "--json", "--identity", given)
    assert result.returncode == 0, result.stderr
    return {entry["identity"] for entry in json.loads(result.stdout)}


def test_list_takes_a_name_a_digest_or_its_unique_prefix(stocked: Daemon) -> None:
    assert _listed(stocked, f"{MODEL},kv=8bit-g64") == {QUANTISED.digest()}
    assert _listed(stocked, PLAIN.digest()) == {PLAIN.digest()}
    assert _listed(stocked, PLAIN.digest()[:12]) == {PLAIN.digest()}
    assert _listed(stocked, PLAIN.digest()[:12].upper()) == {PLAIN.digest()}


def test_an_ambiguous_identity_lists_its_candidates_and_touches_nothing(stocked: Daemon) -> None:
    shared = ONE.digest()[0]
    for command in (["list"], ["verify"], ["evict"]):
        result = kvctl(stocked, *command, "--identity", shared)
        assert result.returncode == 2, result.stdout
        assert f"'{shared}' names 2 identities" in result.stderr
        for identity in (ONE, TWO):
            assert identity.digest() in result.stderr
            assert f"qwen3-aa11,ns={identity.namespace}" in result.stderr
    # The model id alone stands for each of its identities.
    by_model = kvctl(stocked, "evict", "--identity", MODEL)
    assert by_model.returncode == 2
    assert f"{MODEL},kv=none  {PLAIN.digest()}" in by_model.stderr
    assert f"{MODEL},kv=8bit-g64  {QUANTISED.digest()}" in by_model.stderr
    assert len(json.loads(kvctl(stocked, "list", "--json").stdout)) == 4


def test_an_unknown_identity_says_so(stocked: Daemon) -> None:
    for command in (["list"], ["verify"], ["evict"]):
        result = kvctl(stocked, *command, "--identity", "mistral-7b")
        assert result.returncode == 2
        assert "no identity is named 'mistral-7b', nor has a digest starting so" in result.stderr
    assert len(json.loads(kvctl(stocked, "list", "--json").stdout)) == 4


def test_evict_and_verify_take_a_name(stocked: Daemon) -> None:
    verified = kvctl(stocked, "verify", "--identity", f"{MODEL},kv=none")
    assert verified.returncode == 0, verified.stderr
    assert "1 entries verified, 0 damaged" in verified.stdout
    evicted = kvctl(stocked, "evict", "--identity", f"{MODEL},kv=8bit-g64")
    assert evicted.returncode == 0, evicted.stderr
    assert evicted.stdout.startswith("evicted 1 entries")
    left = {entry["identity"] for entry in json.loads(kvctl(stocked, "list", "--json").stdout)}
    assert left == {PLAIN.digest(), ONE.digest(), TWO.digest()}
    # Its telemetry stays (the status lists identities with entries or traffic), and with
    # it its name: the other keeps its own.
    assert _listed(stocked, f"{MODEL},kv=8bit-g64") == set()
    assert _listed(stocked, f"{MODEL},kv=none") == {PLAIN.digest()}


def test_an_ambiguous_identity_lists_ten_candidates_and_counts_the_others(daemon: Daemon) -> None:
    many = [variant(model="gemma-12", namespace=f"team-{n}") for n in range(13)]
    with Client.connect(daemon.socket_path, require=True) as client:
        for seed, identity in enumerate(many):
            put_stored(client, identity, range(8), seed)
    result = kvctl(daemon, "list", "--identity", "gemma-12")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "kvctl: 'gemma-12' names 13 identities:"
    assert sum(line.startswith("  gemma-12") for line in lines) == 10
    assert lines[-1] == "  and 3 more"
