"""Identity names: the rule (the model, then as few aspects as tell it apart), what a real
daemon shows of them (status, kvctl's tables, the metrics), and across a restart."""

from __future__ import annotations

import json
import re
from dataclasses import replace

from daemon_e2e import put_stored, report
from daemon_process import Daemon, kvctl
from hypothesis import given
from hypothesis import strategies as st
from identity_variants import MODEL, variant
from kvd_client import Client
from kvd_protocol import messages as m
from kvd_protocol.identity import Identity

from kvd.identity_names import NAME_CHARS, START_CHARS, names


def _named(*identities: Identity) -> list[str]:
    found = names({identity.digest(): identity for identity in identities})
    return [found[identity.digest()] for identity in identities]


def test_a_models_only_identity_is_named_by_its_model_id() -> None:
    assert _named(variant("8bit-g64")) == [MODEL]


def test_identities_of_one_model_are_told_apart_by_what_differs_first() -> None:
    assert _named(variant("none"), variant("8bit-g64")) == [
        f"{MODEL},kv=none",
        f"{MODEL},kv=8bit-g64",
    ]
    assert _named(variant(template="1a2b3c4d"), variant(template="99aa77bb")) == [
        f"{MODEL},template=1a2b3c4d",
        f"{MODEL},template=99aa77bb",
    ]
    assert _named(variant(adapter="none"), variant(adapter="lora-5e6f7a8b")) == [
        f"{MODEL},adapter=none",
        f"{MODEL},adapter=lora-5e6f7a8b",
    ]
    assert _named(variant(namespace="team-a"), variant(namespace="team-b")) == [
        f"{MODEL},ns=team-a",
        f"{MODEL},ns=team-b",
    ]


def test_each_name_is_as_short_as_tells_it_apart() -> None:
    plain = variant("none")
    quantised = variant("8bit-g64")
    upgraded = variant("8bit-g64", runtime="mlx-0.30.0/cpu:x86_64")
    assert _named(plain, quantised, upgraded) == [
        f"{MODEL},kv=none",  # the only one without quantised KV: nothing more needed
        f"{MODEL},kv=8bit-g64,runtime=mlx-0.29.1/cpu:x86_64",
        f"{MODEL},kv=8bit-g64,runtime=mlx-0.30.0/cpu:x86_64",
    ]


def test_an_engine_that_says_no_traits_is_told_apart_by_its_fingerprints() -> None:
    old, new = variant("8bit-g64", traits=False), variant("none")
    assert _named(old, new) == [f"{MODEL},kv=-", f"{MODEL},kv=none"]
    a, b = variant("none", traits=False), variant("8bit-g64", traits=False)
    assert _named(a, b) == [f"{MODEL},config=cfg-none", f"{MODEL},config=cfg-8bit"]


def test_a_name_another_model_id_spells_too_ends_with_the_digest() -> None:
    odd = variant(model=f"{MODEL},kv=none")  # model ids are the engines' to choose
    plain, quantised = variant("none"), variant("8bit-g64")
    shown = _named(odd, plain, quantised)
    assert shown[0] == f"{MODEL},kv=none,id={odd.digest()[:12]}"
    assert shown[1] == f"{MODEL},kv=none,id={plain.digest()[:12]}"
    assert shown[2] == f"{MODEL},kv=8bit-g64"


def test_a_trait_beyond_the_librarys_comes_before_the_fields() -> None:
    # Another RoPE scaling: another config fingerprint, which the engine says in a trait.
    scaled = replace(
        variant(), config_fingerprint="cfg-yarn", traits=f"{variant().traits},rope=yarn-4x"
    )
    upgraded = replace(scaled, runtime="mlx-0.30.0/cpu:x86_64")
    plain = variant()
    assert _named(plain, scaled, upgraded) == [
        f"{MODEL},rope=-",
        f"{MODEL},rope=yarn-4x,runtime=mlx-0.29.1/cpu:x86_64",
        f"{MODEL},rope=yarn-4x,runtime=mlx-0.30.0/cpu:x86_64",
    ]


def test_an_identity_is_named_by_its_source_then_what_tells_it_apart() -> None:
    repository = "mlx-community/Llama-3.2-3B-Instruct-4bit"
    assert _named(variant(source=repository)) == [repository]
    assert _named(variant("none", source=repository), variant("8bit-g64", source="Llama-3B")) == [
        f"{repository},kv=none",
        "Llama-3B,kv=8bit-g64",
    ]
    # Without a source (an engine that predates it), the model id, as before.
    assert _named(variant("none", source=repository), variant("8bit-g64")) == [
        f"{repository},kv=none",
        f"{MODEL},kv=8bit-g64",
    ]


def test_two_models_from_folders_of_one_name_are_told_apart_by_their_digests() -> None:
    one, other = (
        variant(model="llama-aaaa", source="model"),
        variant(model="qwen-bbbb", source="model"),
    )
    assert _named(one, other) == [
        f"model,id={one.digest()[:12]}",
        f"model,id={other.digest()[:12]}",
    ]


def test_names_are_bounded_whatever_the_engines_say() -> None:
    long_model = "m" * 1000
    many = [
        variant(kv, runtime=runtime, model=long_model, namespace="n" * 900 + kv)
        for kv in ("none", "8bit-g64")
        for runtime in ("r" * 800 + "1", "r" * 800 + "2")
    ]
    shown = _named(*many)
    assert len(set(shown)) == len(many)
    for identity, name in zip(many, shown, strict=True):
        assert len(name) <= NAME_CHARS
        assert name.startswith("m" * (START_CHARS - 1) + "~")
        if len(name) == NAME_CHARS:  # cut: the digest tells it apart
            assert name.endswith(f"~,id={identity.digest()[:12]}")


def test_an_identity_known_by_digest_only_is_named_by_it() -> None:
    assert names({"0f" * 16: None}) == {"0f" * 16: "0f" * 16}


_choices = st.sampled_from(["a", "b", "c"])


_sources = st.sampled_from(["", "a", "org/b"])


@given(
    st.lists(
        st.tuples(_choices, _choices, _choices, _choices, _choices, st.booleans(), _sources),
        min_size=1,
        max_size=12,
    )
)
def test_names_are_unique_whatever_the_identities(rows: list[tuple[str, ...]]) -> None:
    identities = {
        identity.digest(): identity
        for model, kv, template, runtime, namespace, says, source in rows
        for identity in [
            variant(
                kv,
                template=template,
                runtime=runtime,
                namespace=namespace,
                model=model,
                traits=bool(says),
                source=source,
            )
        ]
    }
    found = names(identities)
    assert len(set(found.values())) == len(identities)
    for digest, name in found.items():
        identity = identities[digest]
        assert name.startswith(identity.trait_map().get("source") or identity.model_id)


def test_status_kvctl_and_metrics_name_each_identity_and_a_restart_keeps_the_names(
    daemon: Daemon,
) -> None:
    plain, quantised, other = variant("none"), variant("8bit-g64"), variant(model="qwen3-aa11")
    with Client.connect(daemon.socket_path, require=True) as client:
        for seed, identity in enumerate((plain, quantised, other)):
            put_stored(client, identity, range(32), seed)
        shown = {i["identity"]: i["name"] for i in report(client)["identities"]}
    expected = {
        plain.digest(): f"{MODEL},kv=none",
        quantised.digest(): f"{MODEL},kv=8bit-g64",
        other.digest(): "qwen3-aa11",
    }
    assert shown == expected
    status_table = kvctl(daemon, "status").stdout
    for digest, name in expected.items():
        assert re.search(rf"^{re.escape(name)}\s+{digest[:12]}\s+1\s", status_table, re.M)
    listed = kvctl(daemon, "list").stdout.splitlines()[1:]
    assert sorted(line.split()[1] for line in listed) == sorted(expected.values())
    entry = json.loads(kvctl(daemon, "list", "--json").stdout)[0]["id"]
    entry_identity = json.loads(kvctl(daemon, "list", "--json").stdout)[0]["identity"]
    show = kvctl(daemon, "show", entry).stdout
    assert re.search(rf"^name\s+{re.escape(expected[entry_identity])}$", show, re.M)
    metrics = kvctl(daemon, "metrics").stdout
    assert f'name="{MODEL},kv=8bit-g64"' in metrics

    # The traits are in the entries' headers: a daemon started anew names them alike.
    daemon.stop()
    daemon.start()
    with Client.connect(daemon.socket_path, require=True) as client:
        again = {i["identity"]: i["name"] for i in report(client)["identities"]}
        traits = {i["identity"]: i["traits"] for i in report(client)["identities"]}
    assert again == expected
    assert traits[quantised.digest()] == "kv=8bit-g64,template=1a2b3c4d,adapter=none"


def test_an_identity_seen_only_in_lookups_is_named_too(daemon: Daemon) -> None:
    with Client.connect(daemon.socket_path, require=True) as client:
        put_stored(client, variant("none"), range(32), 1)
        assert client.lookup(variant("4bit-g32"), [*range(32), 7]) is None
        shown = {i["identity"]: i["name"] for i in report(client)["identities"]}
    assert shown[variant("4bit-g32").digest()] == f"{MODEL},kv=4bit-g32"
    assert shown[variant("none").digest()] == f"{MODEL},kv=none"


def test_a_daemon_that_predates_the_source_is_sent_the_traits_it_takes(daemon: Daemon) -> None:
    """A daemon before identity_source refuses a "/" or "_" in a trait: for one whose hello
    does not offer it (here, the features taken out), the client leaves those traits out."""
    sourced = variant("none", source="mlx-community/Llama_3B")
    with Client.connect(daemon.socket_path, require=True) as client:
        server = client._link.server
        assert server is not None
        older = tuple(f for f in server.features if f != m.IDENTITY_SOURCE_FEATURE)
        client._link.server = replace(server, features=older)
        put_stored(client, sourced, range(32), 1)
        (shown,) = report(client)["identities"]
    assert shown["traits"] == "kv=none,template=1a2b3c4d,adapter=none"
    assert shown["name"] == MODEL
    with Client.connect(daemon.socket_path, require=True) as client:  # offered: said whole
        found = client.lookup(sourced, [*range(32), 7])
        assert found is not None
        found.release()
        (shown,) = report(client)["identities"]
    assert shown["name"] == "mlx-community/Llama_3B"
