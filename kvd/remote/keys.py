"""Where things live in the bucket (docs/remote.md, "Keys").

    <prefix>/v2/<identity digest>/layout                the identity's layers, for manifests
    <prefix>/v2/<identity digest>/b/<block hash>.kvb    a block file, byte for byte

The identity digest is the local tier's folder name: it hashes the model, tokenizer, template,
KV quantisation, codec set and MLX runtime, so only daemons whose engines would make the same
bytes share. A block's name is its chained hash (kvd_protocol.blocks), so equal names are equal
blocks and a key is written once (a conditional create).
"""

from __future__ import annotations

from typing import Final

from kvd_protocol.blocks import block_name

KEY_VERSION: Final = "v2"  # the block file format's version


def identity_key(prefix: str, digest: str) -> str:
    """The folder of one identity's objects."""
    return f"{prefix}/{KEY_VERSION}/{digest}" if prefix else f"{KEY_VERSION}/{digest}"


def layout_key(prefix: str, digest: str) -> str:
    return f"{identity_key(prefix, digest)}/layout"


def block_key(prefix: str, digest: str, block_hash: bytes) -> str:
    return f"{identity_key(prefix, digest)}/b/{block_name(block_hash)}"
