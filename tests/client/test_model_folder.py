"""The identity of a model folder: from the files' content, never the path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from kvd_client.identity import EngineIdentity, model_source
from kvd_client.model_folder import DigestCache, KvQuantization, folder_identity
from model_folders import CHAT_TEMPLATE, build_model_folder

PLAIN_KV = KvQuantization()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("folders")
    a = build_model_folder(root / "a", seed=0)
    shutil.copytree(a, root / "copy")
    return {"a": a, "copy": root / "copy", "b": build_model_folder(root / "b", seed=1)}


def _identity(
    folder: Path,
    tmp_path: Path,
    *,
    kv: KvQuantization = PLAIN_KV,
    adapter_dir: Path | None = None,
    namespace: str = "",
) -> EngineIdentity:
    digests = DigestCache(tmp_path / "digests.json")
    return folder_identity(
        folder,
        chat_template=CHAT_TEMPLATE,
        kv=kv,
        adapter_dir=adapter_dir,
        namespace=namespace,
        digests=digests,
    )


def test_two_folders_of_identical_files_have_one_identity(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    a, copy = _identity(folders["a"], tmp_path), _identity(folders["copy"], tmp_path / "other")
    assert a == copy
    assert a.to_protocol().digest() == copy.to_protocol().digest()
    # Each says where it came from, which is no part of the identity.
    assert (a.to_protocol().trait_map()["source"], copy.to_protocol().trait_map()["source"]) == (
        "a",
        "copy",
    )


def test_the_source_is_the_repository_id_else_the_folders_name_never_a_path(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    snapshot = tmp_path / "hub" / "models--mlx-community--Llama-3.2-3B-4bit" / "snapshots" / "ab12"
    shutil.copytree(folders["a"], snapshot)
    assert model_source(snapshot) == "mlx-community/Llama-3.2-3B-4bit"
    assert model_source(tmp_path / "hub" / "models--gpt2" / "snapshots" / "cd34") == "gpt2"
    assert model_source("mlx-community/Qwen3_8B") == "mlx-community/Qwen3_8B"  # not on disk
    assert model_source(folders["a"] / "config.json") == "a"  # a file: its folder's
    assert model_source(tmp_path / "my model (final)!") == "my-model-final"
    assert model_source(tmp_path / ("x" * 200)) == "x" * 48
    assert model_source("/") == ""
    digests = DigestCache(tmp_path / "digests.json")
    by_repository = folder_identity(
        snapshot, chat_template=None, digests=digests, source="mlx-community/Llama-3.2-3B-4bit"
    )
    assert by_repository.traits.endswith(",source=mlx-community/Llama-3.2-3B-4bit")
    assert folder_identity(snapshot, chat_template=None, digests=digests).traits == (
        by_repository.traits
    )


def test_other_weights_of_the_same_architecture_and_tokenizer_are_another_identity(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    a, b = _identity(folders["a"], tmp_path), _identity(folders["b"], tmp_path)
    assert a.config_fingerprint != b.config_fingerprint
    assert a.tokenizer_hash == b.tokenizer_hash
    assert a.model_id != b.model_id


def test_kv_quantisation_chat_template_and_adapter_each_change_the_identity(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    plain = _identity(folders["a"], tmp_path)
    assert _identity(folders["a"], tmp_path, kv=KvQuantization(bits=8)) != plain
    assert _identity(folders["a"], tmp_path, kv=KvQuantization(bits=8, group_size=32)) != (
        _identity(folders["a"], tmp_path, kv=KvQuantization(bits=8))
    )
    digests = DigestCache(tmp_path / "digests.json")
    other_template = folder_identity(folders["a"], chat_template="{{ messages }}", digests=digests)
    assert other_template.tokenizer_hash != plain.tokenizer_hash
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"rank": 8}))
    (adapter / "adapters.safetensors").write_bytes(b"lora weights")
    adapted = _identity(folders["a"], tmp_path, adapter_dir=adapter, namespace="tenant")
    assert adapted.namespace.startswith("adapter-")
    assert adapted.namespace.endswith("/tenant")
    (adapter / "adapters.safetensors").write_bytes(b"other lora weights")
    assert _identity(folders["a"], tmp_path, adapter_dir=adapter, namespace="tenant") != adapted


def test_traits_say_what_differs_and_leave_the_digest_as_it_was(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    plain = _identity(folders["a"], tmp_path)
    template = hashlib.blake2b(CHAT_TEMPLATE.encode(), digest_size=16).hexdigest()[:8]
    assert plain.traits == f"kv=none,template={template},adapter=none,source=a"
    quantised = _identity(folders["a"], tmp_path, kv=KvQuantization(8, 64, 512))
    assert quantised.traits.startswith("kv=8bit-g64-from512,")
    assert _identity(folders["a"], tmp_path, kv=KvQuantization(4, 32)).traits.startswith(
        "kv=4bit-g32,"
    )
    digests = DigestCache(tmp_path / "digests.json")
    untemplated = folder_identity(folders["a"], chat_template=None, digests=digests)
    assert untemplated.traits == "kv=none,template=none,adapter=none,source=a"
    adapter = tmp_path / "my lora (v2)"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"rank": 8}))
    (adapter / "adapters.safetensors").write_bytes(b"lora weights")
    adapted = _identity(folders["a"], tmp_path, adapter_dir=adapter)
    # The folder's name, cut to what a trait holds, and the digest the namespace holds.
    assert adapted.traits.endswith(f",adapter=my-lora-v2-{adapted.namespace[8:16]},source=a")
    for identity in (plain, quantised, untemplated, adapted):
        wire = identity.to_protocol()
        assert wire.traits == identity.traits
        assert wire.digest() == dataclasses.replace(wire, traits="").digest()


def test_a_weight_file_is_read_once_and_again_only_when_it_changes(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    cache = DigestCache(tmp_path / "digests.json")
    first = cache.of(weights)
    assert first.startswith("xxh3-128:")
    remembered = json.loads((tmp_path / "digests.json").read_text())
    assert list(remembered.values()) == [first]
    # A new cache object (a restart) answers from the file without reading the weights:
    # proven by a remembered value the bytes would not give.
    key = next(iter(remembered))
    (tmp_path / "digests.json").write_text(json.dumps({key: "xxh3-128:remembered"}))
    assert DigestCache(tmp_path / "digests.json").of(weights) == "xxh3-128:remembered"
    weights.write_bytes(b"other weights")
    assert DigestCache(tmp_path / "digests.json").of(weights) not in (first, "xxh3-128:remembered")


def test_a_hugging_face_cache_blob_is_named_by_its_sha256(tmp_path: Path) -> None:
    sha = "ab" * 32
    blob = tmp_path / "blobs" / sha
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    os.symlink(blob, snapshot / "model.safetensors")
    assert DigestCache(None).of(snapshot / "model.safetensors") == f"sha256:{sha}"


def test_an_unreadable_digest_cache_only_costs_a_read(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    (tmp_path / "digests.json").write_text("not json")
    assert DigestCache(tmp_path / "digests.json").of(weights) == DigestCache(None).of(weights)
