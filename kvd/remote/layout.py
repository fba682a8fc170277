"""An identity's layout in the bucket: what a daemon needs, beside the blocks, to make a local
entry of a prompt's first blocks (protocol/FORMAT.md, "Remote layout").

Manifests are not shared: each holds one daemon's tail and times. The layout is what every
entry of an identity with the same block size and layers has in common: the block size, each
layer's kind, state without its row count ("offset"), trimmability and tensors (dtype, shape
with the token axis 0), the entry meta. A daemon that fetched blocks 0..k-1 of a prompt plans
the manifest of exactly k*B tokens from it (manifest_plan): an ordinary local entry, checked
at commit as any put is.

Only entries whose every layer is blocked share (plain and quantized KV): a hybrid's
recurrent state is not in its blocks. Checkpoints never leave the machine.

A layout read from the bucket holds what the bucket sent: decode_layout refuses one with more
maps and lists than the format needs (most_containers: the layout's own, each layer's map,
meta, slot list and meta nested to META_MAX_DEPTH, each slot's map and shape) as it decodes,
so what it builds is bounded by its limits (msgpack bounds the nesting), whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack
from kvd_protocol import schema
from kvd_protocol.blocks import HASH_BYTES, check_block_tokens, is_hex_digest
from kvd_protocol.dtypes import ITEM_SIZES
from kvd_protocol.entry import (
    MAX_NDIM,
    PREFILL_CHECKPOINT_META,
    TOKEN_AXIS,
    EntryHeader,
    LayerSpec,
    ManifestPlan,
    MetaValue,
    TensorSpec,
    entry_meta,
    plan_manifest,
    state_map,
    with_rows,
)
from kvd_protocol.entry_model import META_MAX_DEPTH, StateValue
from kvd_protocol.identity import TRAITS_META, Identity
from kvd_protocol.limits import DEFAULT_LIMITS, Limits
from kvd_protocol.tokens import TOKEN_BYTES

LAYOUT_VERSION: Final = 1
ROWS_META: Final = "offset"  # a blocked layer's row count (codecs' blocked contract)
# Meta a layout never carries: the mark of a prefill checkpoint (never shared) and the
# identity's traits (each daemon's own identity says them).
_PRIVATE_META: Final = frozenset({PREFILL_CHECKPOINT_META, TRAITS_META})
_KEYS: Final = frozenset({"version", "identity", "block_tokens", "min_reuse", "layers", "meta"})
_LAYER_KEYS: Final = frozenset({"kind", "meta", "trimmable", "slots"})
_SLOT_KEYS: Final = frozenset({"dtype", "shape"})


class LayoutError(ValueError):
    """A layout from the bucket that is not one: never trusted, never used."""


class NotShareable(ValueError):  # noqa: N818 - reads as what the entry is
    """An entry whose blocks do not go to the bucket; its message says why."""


@dataclass(frozen=True)
class LayoutSlot:
    dtype: str
    shape: tuple[int, ...]  # the token axis (2) is 0


@dataclass(frozen=True)
class LayoutLayer:
    kind: str
    meta: Mapping[str, StateValue]  # without its row count
    trimmable: bool
    slots: tuple[LayoutSlot, ...]


@dataclass(frozen=True)
class Layout:
    digest: str  # the identity digest (encoded under "identity")
    block_tokens: int
    min_reuse: int
    layers: tuple[LayoutLayer, ...]
    meta: Mapping[str, MetaValue]

    def fits(self, other: Layout) -> bool:
        """Whether entries of other's layout can share blocks with this one's: the same
        identity, block size and layers (min_reuse and meta are each entry's own)."""
        return (self.digest, self.block_tokens, self.layers) == (
            other.digest,
            other.block_tokens,
            other.layers,
        )


def layout_of(header: EntryHeader) -> Layout:
    """The layout of a stored entry's header; NotShareable when its blocks stay local."""
    if header.checkpoint is not None:
        raise NotShareable("a generation checkpoint")
    if header.prefill_checkpoint:
        raise NotShareable("a prefill checkpoint")
    if not header.block_hashes:
        raise NotShareable("no whole block")
    unblocked = [layer.kind for layer in header.layers if not layer.blocked]
    if unblocked:
        raise NotShareable(f"layers not cut into blocks ({', '.join(sorted(set(unblocked)))})")
    layers = tuple(
        LayoutLayer(
            kind=layer.kind,
            meta={k: v for k, v in layer.meta.items() if k != ROWS_META},
            trimmable=layer.trimmable,
            slots=tuple(LayoutSlot(s.dtype, with_rows(s.shape, 0)) for s in layer.slots),
        )
        for layer in header.layers
    )
    return Layout(
        digest=header.identity.digest(),
        block_tokens=header.block_tokens,
        min_reuse=header.min_reuse,
        layers=layers,
        meta={k: v for k, v in header.meta.items() if k not in _PRIVATE_META},
    )


def encode_layout(layout: Layout) -> bytes:
    """The layout object's bytes (msgpack)."""
    found: dict[str, Any] = {
        "version": LAYOUT_VERSION,
        "identity": layout.digest,
        "block_tokens": layout.block_tokens,
        "min_reuse": layout.min_reuse,
        "layers": [
            {
                "kind": layer.kind,
                "meta": dict(layer.meta),
                "trimmable": layer.trimmable,
                "slots": [{"dtype": s.dtype, "shape": list(s.shape)} for s in layer.slots],
            }
            for layer in layout.layers
        ],
        "meta": dict(layout.meta),
    }
    packed: bytes = msgpack.packb(found, use_bin_type=True)
    return packed


def most_containers(limits: Limits) -> int:
    """The most maps and lists a layout within limits holds."""
    return 3 + limits.max_layers * (3 + META_MAX_DEPTH) + 2 * limits.max_slots


def decode_layout(data: bytes, digest: str, limits: Limits = DEFAULT_LIMITS) -> Layout:
    """The layout in a bucket object that should be identity digest's; LayoutError for
    anything else (bytes of another kind, another identity, a shape no entry has, more maps
    and lists than a layout holds: refused as soon as they are decoded)."""
    most = most_containers(limits)
    made = 0

    def counted(container: Any) -> Any:
        nonlocal made
        made += 1
        if made > most:
            raise LayoutError(f"more than {most} maps and lists")
        return container

    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            list_hook=counted,
            object_pairs_hook=lambda pairs: counted(dict(pairs)),
        )
    except (ValueError, msgpack.UnpackException) as exc:  # ExtraData, StackError, ...
        raise LayoutError(f"not a layout: {exc}") from None
    try:
        layout = _layout(raw, limits)
    except (schema.SchemaError, ValueError) as exc:
        raise LayoutError(f"layout: {exc}") from None
    if layout.digest != digest:
        raise LayoutError(f"layout of identity {layout.digest}, not {digest}")
    return layout


def _layout(raw: object, limits: Limits) -> Layout:
    found = schema.fields(raw, "layout", _KEYS)
    if found["version"] != LAYOUT_VERSION:
        raise LayoutError(f"layout version {found['version']!r}, not {LAYOUT_VERSION}")
    identity = schema.text(found["identity"], "identity", limits.max_name_bytes)
    if not is_hex_digest(identity, HASH_BYTES):
        raise LayoutError(f"identity {identity!r} is not a digest")
    layers = tuple(
        _layer(item, f"layers[{i}]", limits)
        for i, item in enumerate(schema.sequence(found["layers"], "layers", limits.max_layers))
    )
    if not layers:
        raise LayoutError("no layers")
    if sum(len(layer.slots) for layer in layers) > limits.max_slots:
        raise LayoutError(f"more than {limits.max_slots} slots")
    meta = entry_meta(found["meta"], limits)
    if _PRIVATE_META & meta.keys():
        raise LayoutError(f"meta holds {sorted(_PRIVATE_META & meta.keys())}")
    return Layout(
        digest=identity,
        block_tokens=check_block_tokens(found["block_tokens"]),
        min_reuse=schema.integer(found["min_reuse"], "min_reuse", hi=limits.max_tokens),
        layers=layers,
        meta=meta,
    )


def _layer(raw: object, what: str, limits: Limits) -> LayoutLayer:
    found = schema.fields(raw, what, _LAYER_KEYS)
    meta = state_map(found["meta"], f"{what}.meta")
    if ROWS_META in meta:
        raise LayoutError(f"{what}.meta holds its row count")
    slots = tuple(
        _slot(item, f"{what}.slots[{i}]")
        for i, item in enumerate(schema.sequence(found["slots"], f"{what}.slots", limits.max_slots))
    )
    return LayoutLayer(
        kind=schema.text(found["kind"], f"{what}.kind", limits.max_name_bytes),
        meta=meta,
        trimmable=schema.boolean(found["trimmable"], f"{what}.trimmable"),
        slots=slots,
    )


def _slot(raw: object, what: str) -> LayoutSlot:
    found = schema.fields(raw, what, _SLOT_KEYS)
    dtype = schema.text(found["dtype"], f"{what}.dtype", 16)
    if dtype not in ITEM_SIZES:
        raise LayoutError(f"{what}: dtype {dtype!r}")
    shape = tuple(
        schema.integer(n, f"{what}.shape", hi=(1 << 32) - 1)
        for n in schema.sequence(found["shape"], f"{what}.shape", MAX_NDIM)
    )
    if len(shape) <= TOKEN_AXIS or shape[TOKEN_AXIS] != 0:
        raise LayoutError(f"{what}: shape {list(shape)} has no empty token axis {TOKEN_AXIS}")
    return LayoutSlot(dtype, shape)


def manifest_plan(
    layout: Layout,
    identity: Identity,
    tokens: bytes,
    *,
    created: float,
    limits: Limits = DEFAULT_LIMITS,
) -> ManifestPlan:
    """The plan of the entry of exactly tokens (whole blocks: k*B packed tokens) whose blocks
    are the bucket's: each layer's rows and its meta's row count k*B, tails of 0 rows. Raises
    ValueError (LayoutError) for tokens that are not whole blocks, or another identity."""
    if identity.digest() != layout.digest:
        raise LayoutError(f"layout of identity {layout.digest}, not {identity.digest()}")
    rows, left = divmod(len(tokens) // TOKEN_BYTES, layout.block_tokens)
    if left or len(tokens) % TOKEN_BYTES or not rows:
        raise LayoutError(
            f"{len(tokens)} token bytes are not whole blocks of {layout.block_tokens}"
        )
    count = rows * layout.block_tokens
    specs = [
        LayerSpec(
            kind=layer.kind,
            tensors=tuple(TensorSpec(s.dtype, with_rows(s.shape, count)) for s in layer.slots),
            trimmable=layer.trimmable,
            meta={**layer.meta, ROWS_META: count},
            blocked=True,
        )
        for layer in layout.layers
    ]
    return plan_manifest(
        identity,
        tokens,
        specs,
        block_tokens=layout.block_tokens,
        created=created,
        min_reuse=min(layout.min_reuse, count),
        meta=layout.meta,
        limits=limits,
    )
