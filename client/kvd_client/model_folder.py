"""The identity of a model as `mlx_lm.load` finds it in a folder: from the files' content,
never their path. Two folders of identical files share entries; the same architecture with
other weights never does.

- config fingerprint: config.json, the digest of every weight file, and the KV quantisation
  the engine applies (kv_bits, group size, the token it starts at), which changes every cache;
- tokenizer hash: the tokenizer files and the chat template in force (a template passed on the
  command line renders other tokens for the same conversation);
- namespace: the adapter's content, then the caller's own namespace;
- model id: the model type and a short weights digest, a name for people that is itself content;
- traits (not part of the identity, for the daemon's names): the KV quantisation, 8 hex digits of
  the chat template's digest, the adapter's folder name with 8 of its digest, and the source:
  where the model came from (identity.model_source: the repository id, else the folder's name),
  which the daemon names the identity by. The same files in another folder are the same
  identity; its name says the source an engine said last.

model_identity gives a model that mlx_lm.load returned the identity kvd-mlx-lm-server gives it
(ColdTier's default), from the folder its tokenizer was loaded from.

A weight file's digest is the SHA-256 that names it in a Hugging Face cache (its symlink points
at `blobs/<sha256>`), else an xxh3-128 of its bytes, remembered per (file, size, mtime, inode) in
a small digest cache so that a restart does not read the weights twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import xxhash
from kvd_protocol.identity import SOURCE_TRAIT, join_traits

from .identity import EngineIdentity, model_source, tokenizer_hash

_HUB_BLOB: Final = re.compile(r"[0-9a-f]{64}")
_WEIGHT_PATTERN: Final = "*.safetensors"
_ADAPTER_FILES: Final = ("adapter_config.json", "*.safetensors")
_CHUNK: Final = 16 << 20
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._+-]+")  # characters a trait's value may not hold
_ADAPTER_NAME: Final = 24


@dataclass(frozen=True)
class KvQuantization:
    """How the engine quantises its KV cache (mlx_lm's --kv-bits and friends); bits None: never."""

    bits: int | None = None
    group_size: int = 64
    start: int = 0

    def describe(self) -> str:
        return "none" if self.bits is None else f"{self.bits}/{self.group_size}@{self.start}"

    def trait(self) -> str:
        """For people: none, 8bit-g64, or 8bit-g64-from512 when it starts at a token."""
        if self.bits is None:
            return "none"
        start = f"-from{self.start}" if self.start else ""
        return f"{self.bits}bit-g{self.group_size}{start}"


def folder_identity(
    model_dir: Path,
    *,
    chat_template: str | None = None,
    kv: KvQuantization = KvQuantization(),
    adapter_dir: Path | None = None,
    namespace: str = "",
    digests: DigestCache | None = None,
    source: str | None = None,
) -> EngineIdentity:
    """The identity of the model in model_dir as an engine serves it. source: where it came
    from, for people (a repository id); by default model_dir's (identity.model_source)."""
    digests = digests or DigestCache.default()
    config = (model_dir / "config.json").read_bytes()
    weights = _files_digest(model_dir, (_WEIGHT_PATTERN,), digests)
    fingerprint = _blake(b"\0".join([config, weights.encode(), kv.describe().encode()]))
    template = (chat_template or "").encode()
    tokens = _blake(tokenizer_hash(model_dir).encode() + b"\0" + template)
    model_type = json.loads(config).get("model_type", "model")
    adapter, adapter_trait = "", "none"
    if adapter_dir is not None:
        adapter = _files_digest(adapter_dir, _ADAPTER_FILES, digests)
        adapter_trait = _adapter_trait(adapter_dir, adapter)
    traits = {
        "kv": kv.trait(),
        "template": _blake(template)[:8] if template else "none",
        "adapter": adapter_trait,
    }
    said = model_source(model_dir if source is None else source)
    if said:
        traits[SOURCE_TRAIT] = said
    return EngineIdentity(
        model_id=f"{model_type}-{weights[:12]}",
        config_fingerprint=fingerprint,
        tokenizer_hash=tokens,
        namespace=_namespace(adapter, namespace),
        traits=join_traits(traits),
    )


def model_identity(model: Any, tokenizer: Any, namespace: str = "") -> EngineIdentity:
    """The identity of a model as mlx_lm.load returned it with its tokenizer: of the content
    of the folder the tokenizer was loaded from, with the chat template in force and the KV
    cache not quantised, as kvd-mlx-lm-server gives it (folder_identity); when the tokenizer
    names no such folder, EngineIdentity.for_model's."""
    folder = _loaded_from(tokenizer)
    if folder is None:
        return EngineIdentity.for_model(model, tokenizer, namespace)
    template = getattr(tokenizer, "chat_template", None)
    return folder_identity(
        folder, chat_template=template if isinstance(template, str) else None, namespace=namespace
    )


def _loaded_from(tokenizer: Any) -> Path | None:
    """The model folder (config.json and weights) a tokenizer was loaded from, if any."""
    name = getattr(tokenizer, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    folder = Path(name)
    try:
        if (folder / "config.json").is_file() and any(folder.glob(_WEIGHT_PATTERN)):
            return folder
    except OSError:
        pass
    return None


def _namespace(adapter: str, namespace: str) -> str:
    parts = [f"adapter-{adapter[:16]}"] if adapter else []
    if namespace:
        parts.append(namespace)
    return "/".join(parts)


def _adapter_trait(folder: Path, digest: str) -> str:
    """An adapter for people: its folder's name (what a trait may hold of it) and its digest's
    first 8 hex digits, since folders of one name ("adapters") often hold different ones."""
    name = _UNSAFE.sub("-", folder.resolve().name)[:_ADAPTER_NAME].strip("-.")
    return f"{name}-{digest[:8]}" if name else digest[:8]


def _files_digest(folder: Path, patterns: tuple[str, ...], digests: DigestCache) -> str:
    files = sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})
    if not files:
        raise FileNotFoundError(f"no {' or '.join(patterns)} in {folder}")
    return _blake(b"".join(f.name.encode() + b"\0" + digests.of(f).encode() for f in files))


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class DigestCache:
    """File digests remembered across runs in one JSON file (best effort: a cache that cannot
    be read or written only costs reading the file again)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._known: dict[str, str] | None = None

    @classmethod
    def default(cls) -> DigestCache:
        return cls(_user_cache_dir() / "kvd-client" / "weight-digests.json")

    def of(self, file: Path) -> str:
        target = file.resolve()
        if _HUB_BLOB.fullmatch(target.name):
            return f"sha256:{target.name}"
        info = target.stat()
        key = f"{target}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}"
        known = self._load()
        if key not in known:
            known[key] = f"xxh3-128:{_xxh3_file(target)}"
            self._save(known)
        return known[key]

    def _load(self) -> dict[str, str]:
        if self._known is None:
            self._known = {}
            if self.path is not None:
                try:
                    loaded = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    loaded = {}
                if isinstance(loaded, dict):
                    self._known = {str(k): str(v) for k, v in loaded.items()}
        return self._known

    def _save(self, known: dict[str, str]) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False) as out:
                json.dump(known, out)
            os.replace(out.name, self.path)
        except OSError:
            pass


def _xxh3_file(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb", buffering=0) as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _user_cache_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
