"""The engine-facing identity of a model's caches: what the engine knows (model, config,
tokenizer, namespace); the codec set and runtime are filled in by to_protocol(). Its source
trait says where the model came from, for the daemon's names (model_source): a repository id,
else a folder's name, never a path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from kvd_protocol import identity as protocol

from .codecs import CODEC_ID
from .restore import MLX_VERSION

# The files of a tokenizer directory (Hugging Face layouts, sentencepiece, tiktoken).
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges*", "special_tokens_map*", "added_tokens*")
_TOKENIZER_SUFFIXES = (".model", ".tiktoken")
# A folder of a Hugging Face cache: hub/models--<org>--<name>/snapshots/<revision> (an id
# without an org: models--<name>).
_HUB_SNAPSHOT = re.compile(r"models--(?P<repository>[^/]+)/snapshots/[^/]+/?$")
_REPOSITORY_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_NOT_IN_A_TRAIT = re.compile(r"[^A-Za-z0-9._:+@/_-]+")


@dataclass(frozen=True)
class EngineIdentity:
    """traits: what the fingerprints hash, in words for the daemon's names ("kv=8bit-g64,
    template=1a2b3c4d"; kvd_protocol.identity.check_traits); not part of the identity."""

    model_id: str
    config_fingerprint: str
    tokenizer_hash: str
    namespace: str = ""
    traits: str = field(default="", compare=False)  # as kvd_protocol's: no part of it

    @classmethod
    def for_model(
        cls,
        model: Any,
        tokenizer_or_path: Any,
        namespace: str = "",
        *,
        model_id: str | None = None,
    ) -> EngineIdentity:
        """The identity of an mlx-lm model. The fingerprint covers its config (args) and its
        parameters' names, shapes and dtypes, not the weights' values: two fine-tunes of one
        architecture differ only by model_id, which defaults to the tokenizer's path or name
        and else to the model type; pass it when that is not the weights' own name."""
        source = model_source(_tokenizer_source(tokenizer_or_path))
        return cls(
            model_id=model_id or _default_model_id(model, tokenizer_or_path),
            config_fingerprint=config_fingerprint(model),
            tokenizer_hash=tokenizer_hash(tokenizer_or_path),
            namespace=namespace,
            traits=protocol.join_traits({protocol.SOURCE_TRAIT: source}) if source else "",
        )

    def to_protocol(self) -> protocol.Identity:
        return protocol.Identity(
            model_id=self.model_id,
            config_fingerprint=self.config_fingerprint,
            tokenizer_hash=self.tokenizer_hash,
            codec_id=CODEC_ID,
            runtime=runtime(),
            namespace=self.namespace,
            traits=self.traits,
        )


def runtime() -> str:
    """The mlx version and the device that computes: different ones give different KV."""
    if mx.metal.is_available():
        device = f"metal:{mx.device_info().get('architecture', 'unknown')}"
    else:
        device = f"cpu:{platform.machine()}"
    return f"mlx-{MLX_VERSION}/{device}"


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, default=repr, separators=(",", ":")).encode()


def config_fingerprint(model: Any) -> str:
    """A hash of the model's args (or config) and of its parameter names, shapes and dtypes."""
    args = getattr(model, "args", None) or getattr(model, "config", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        config: object = dataclasses.asdict(args)
    else:
        config = vars(args) if args is not None else None
    parameters = _parameter_layout(model.parameters())
    return _digest(_canonical({"class": _qualified(model), "config": config, "params": parameters}))


def _parameter_layout(tree: object, prefix: str = "") -> dict[str, list[object]]:
    layout: dict[str, list[object]] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)  # type: ignore[arg-type]
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, mx.array):
            layout[name] = [list(value.shape), str(value.dtype)]
        elif isinstance(value, dict | list | tuple):
            layout.update(_parameter_layout(value, f"{name}."))
    return layout


def tokenizer_hash(tokenizer_or_path: Any) -> str:
    """A hash of a tokenizer: of its files when given a path (a directory or one file), else
    of its vocabulary and special tokens."""
    if isinstance(tokenizer_or_path, str | os.PathLike):
        return _digest(b"".join(_file_records(Path(tokenizer_or_path))))
    get_vocab = getattr(tokenizer_or_path, "get_vocab", None)
    if get_vocab is None:
        raise TypeError(f"{type(tokenizer_or_path).__name__} is neither a path nor a tokenizer")
    specials = getattr(tokenizer_or_path, "all_special_tokens", [])
    return _digest(_canonical({"vocab": sorted(get_vocab().items()), "special": list(specials)}))


def _file_records(path: Path) -> list[bytes]:
    if path.is_file():
        files = [path]
    else:
        found = {p for pattern in _TOKENIZER_FILES for p in path.glob(pattern) if p.is_file()}
        found.update(p for p in path.iterdir() if p.suffix in _TOKENIZER_SUFFIXES)
        files = sorted(found)
        if not files:
            raise FileNotFoundError(f"no tokenizer files in {path}")
    return [f.name.encode() + b"\0" + _digest(f.read_bytes()).encode() for f in files]


def model_source(name_or_path: str | os.PathLike[str] | None) -> str:
    """Where a model came from, for people: the repository id of a Hugging Face repository
    (given as such, or a snapshot folder of a Hugging Face cache), else the folder's name (a
    file's: its folder's), in the characters a trait holds and at most MAX_TRAIT_VALUE of
    them; "" when nothing is left. Never a path."""
    if name_or_path is None:
        return ""
    text = os.fspath(name_or_path)
    found = _HUB_SNAPSHOT.search(text)
    if found is not None:
        named = found["repository"].replace("--", "/")  # models--org--name: org/name
    elif _REPOSITORY_ID.fullmatch(text) and not os.path.exists(text):
        named = text
    else:
        path = Path(text)
        named = (path.parent if path.is_file() else path).resolve().name
    cleaned = _NOT_IN_A_TRAIT.sub("-", named).strip("-./")
    return cleaned[: protocol.MAX_TRAIT_VALUE].rstrip("-./")


def _tokenizer_source(tokenizer_or_path: Any) -> str | os.PathLike[str] | None:
    """The path or repository id a tokenizer was loaded from, if it says."""
    if isinstance(tokenizer_or_path, str | os.PathLike):
        return tokenizer_or_path
    name = getattr(tokenizer_or_path, "name_or_path", None)
    return name if isinstance(name, str) and name else None


def _default_model_id(model: Any, tokenizer_or_path: Any) -> str:
    if isinstance(tokenizer_or_path, str | os.PathLike):
        path = Path(tokenizer_or_path).resolve()
        return str(path if path.is_dir() else path.parent)
    name = getattr(tokenizer_or_path, "name_or_path", None)
    if isinstance(name, str) and name:
        return name
    return str(getattr(model, "model_type", None) or _qualified(model))


def _qualified(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
