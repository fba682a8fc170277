"""The layout in the bucket: made from a stored manifest, read back only when well formed, and
enough to plan the manifest of a prompt's first k blocks whose block files are the ones the
first daemon wrote, byte for byte (so the fetched files check against it at commit)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgpack
import pytest
from entry_samples import IDENTITY, manifest_layers
from kvd_protocol.entry import (
    PREFILL_CHECKPOINT_META,
    Checkpoint,
    LayerSpec,
    ManifestPlan,
    TensorSpec,
    plan_manifest,
)
from kvd_protocol.identity import Identity
from kvd_protocol.limits import DEFAULT_LIMITS
from kvd_protocol.tokens import pack_tokens

from kvd.remote.layout import (
    Layout,
    LayoutError,
    NotShareable,
    decode_layout,
    encode_layout,
    layout_of,
    manifest_plan,
    most_containers,
)

B = 16
TOKENS = pack_tokens(range(500, 500 + 3 * B + 5))  # 3 blocks and a tail of 5
KV = TensorSpec("float16", (1, 2, len(TOKENS) // 4, 8))
PACKED = TensorSpec("uint32", (1, 2, len(TOKENS) // 4, 2))
SCALES = TensorSpec("float16", (1, 2, len(TOKENS) // 4, 1))


def kv_manifest(
    block_tokens: int = B,
    meta: dict[str, Any] | None = None,
    checkpoint: Checkpoint | None = None,
    tokens: bytes = TOKENS,
) -> ManifestPlan:
    """Plain KV and 4-bit quantized KV layers: every layer blocked, as a shared entry's."""
    count = len(tokens) // 4
    kv = dataclasses.replace(KV, shape=(1, 2, count, 8))
    packed = dataclasses.replace(PACKED, shape=(1, 2, count, 2))
    scales = dataclasses.replace(SCALES, shape=(1, 2, count, 1))
    layers = [
        LayerSpec("kv", (kv, kv), trimmable=True, meta={"offset": count}, blocked=True),
        LayerSpec(
            "quantized_kv",
            (packed, scales, scales, packed, scales, scales),
            trimmable=True,
            meta={"offset": count, "bits": 4, "group_size": 8},
            blocked=True,
        ),
    ]
    return plan_manifest(
        Identity(**{**IDENTITY.to_wire(), "traits": "kv=4bit"}),
        tokens,
        layers,
        block_tokens=block_tokens,
        created=1_700_000_000.5,
        min_reuse=2,
        checkpoint=checkpoint,
        meta={"mlx_lm": "0.32.2", **(meta or {})},
    )


def sums(plan: ManifestPlan, index: int) -> list[bytes]:
    return [bytes([index, k, 7, 7, 7, 7, 7, 7]) for k in range(len(plan.block_slots))]


def test_a_layout_round_trips_and_keeps_no_private_meta() -> None:
    layout = layout_of(kv_manifest().entry.header)
    assert layout.digest == IDENTITY.digest()
    assert layout.block_tokens == B
    assert layout.min_reuse == 2
    assert [layer.kind for layer in layout.layers] == ["kv", "quantized_kv"]
    assert all("offset" not in layer.meta for layer in layout.layers)
    assert layout.layers[1].meta == {"bits": 4, "group_size": 8}
    assert all(s.shape[2] == 0 for layer in layout.layers for s in layer.slots)
    assert dict(layout.meta) == {"mlx_lm": "0.32.2"}  # the traits are each daemon's own
    assert decode_layout(encode_layout(layout), IDENTITY.digest()) == layout


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_plan_for_k_blocks_has_the_first_daemons_block_files(k: int) -> None:
    """The block heads planned from the layout are the original's, byte for byte: a fetched
    block file belongs to the new manifest exactly as to the one it was written for."""
    original = kv_manifest()
    layout = decode_layout(encode_layout(layout_of(original.entry.header)), IDENTITY.digest())
    plan = manifest_plan(layout, IDENTITY, TOKENS[: k * B * 4], created=time.time())
    assert plan.hashes == original.hashes[:k]
    assert plan.block_size == original.block_size
    for i in range(k):
        assert plan.block_head(i, sums(plan, i)) == original.block_head(i, sums(original, i))
    header = plan.entry.header
    assert header.token_count == k * B
    assert header.block_hashes == original.hashes[:k]
    assert all(layer.meta["offset"] == k * B for layer in header.layers)
    assert all(s.shape[2] == 0 for s in header.slots)  # tails of 0 rows
    assert header.layers[1].meta["bits"] == 4
    assert header.min_reuse == 2
    assert header.checkpoint is None
    assert not header.prefill_checkpoint
    assert header.meta["mlx_lm"] == "0.32.2"


def test_the_plan_needs_whole_blocks_of_the_layouts_identity() -> None:
    layout = layout_of(kv_manifest().entry.header)
    with pytest.raises(LayoutError, match="whole blocks"):
        manifest_plan(layout, IDENTITY, TOKENS[: (B + 1) * 4], created=0.0)
    with pytest.raises(LayoutError, match="whole blocks"):
        manifest_plan(layout, IDENTITY, b"", created=0.0)
    other = Identity("org/other", "c", "t", "codec-1", "mlx")
    with pytest.raises(LayoutError, match="identity"):
        manifest_plan(layout, other, TOKENS[: B * 4], created=0.0)


def test_checkpoints_hybrids_and_short_entries_are_not_shareable() -> None:
    with pytest.raises(NotShareable, match="generation checkpoint"):
        layout_of(kv_manifest(checkpoint=Checkpoint("g", 1, 2, False, 3, 1)).entry.header)
    with pytest.raises(NotShareable, match="prefill checkpoint"):
        layout_of(kv_manifest(meta={PREFILL_CHECKPOINT_META: True}).entry.header)
    hybrid = plan_manifest(
        IDENTITY,
        TOKENS,
        manifest_layers(len(TOKENS) // 4),  # an SSM state and a rotating window beside its KV
        block_tokens=B,
        created=0.0,
        min_reuse=0,
    )
    with pytest.raises(NotShareable, match="not cut into blocks"):
        layout_of(hybrid.entry.header)
    with pytest.raises(NotShareable, match="no whole block"):
        layout_of(kv_manifest(tokens=TOKENS[: (B - 1) * 4]).entry.header)


def test_layouts_fit_only_with_the_same_block_size_and_layers() -> None:
    mine = layout_of(kv_manifest().entry.header)
    assert mine.fits(layout_of(kv_manifest(meta={"other": 1}).entry.header))
    assert not mine.fits(layout_of(kv_manifest(block_tokens=2 * B).entry.header))
    wider = dataclasses.replace(mine, layers=mine.layers[:1])
    assert not mine.fits(wider)


def _encoded(**changes: Any) -> bytes:
    found = msgpack.unpackb(encode_layout(layout_of(kv_manifest().entry.header)))
    for path, value in changes.items():
        target = found
        *folders, last = path.split("__")
        for name in folders:
            target = target[int(name)] if name.isdigit() else target[name]
        if value is KeyError:
            del target[last]
        else:
            target[int(last) if last.isdigit() else last] = value
    return msgpack.packb(found, use_bin_type=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "not a layout"),
        (b"\xc1", "not a layout"),
        (msgpack.packb([1, 2]), "expected a map"),
        (_encoded(version=2), "version"),
        (_encoded(version=KeyError), "missing"),
        (_encoded(extra=1), "unknown"),
        (_encoded(identity="00" * 16), "identity"),
        (_encoded(identity="not hex"), "digest"),
        (_encoded(block_tokens=15), "block size"),
        (_encoded(block_tokens=True), "block size"),
        (_encoded(min_reuse=-1), "min_reuse"),
        (_encoded(layers=[]), "no layers"),
        (_encoded(layers=7), "expected a list"),
        (_encoded(layers__0__meta__offset=5), "row count"),
        (_encoded(layers__0__trimmable=1), "trimmable"),
        (_encoded(layers__0__slots__0__dtype="float128"), "dtype"),
        (_encoded(layers__0__slots__0__shape=[1, 2, 16, 8]), "token axis"),
        (_encoded(layers__0__slots__0__shape=[1, 2]), "token axis"),
        (_encoded(layers__0__slots__0__shape=[1, 2, 0, -8]), "shape"),
        (_encoded(meta={PREFILL_CHECKPOINT_META: True}), "meta holds"),
        (_encoded(meta={"identity_traits": "kv=4bit"}), "meta holds"),
        (_encoded(meta=[1]), "meta"),
    ],
)
def test_a_hostile_layout_is_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        decode_layout(data, IDENTITY.digest())


def test_a_layout_over_the_limits_is_refused() -> None:
    data = encode_layout(layout_of(kv_manifest().entry.header))
    tight = dataclasses.replace(DEFAULT_LIMITS, max_layers=1)
    with pytest.raises(LayoutError, match="over the limit"):
        decode_layout(data, IDENTITY.digest(), tight)
    assert isinstance(decode_layout(data, IDENTITY.digest()), Layout)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        # A million empty maps in a MiB: more than any layout holds.
        (b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x80" * ((1 << 20) - 5), "maps and lists"),
        # Lists nested a hundred thousand deep.
        (b"\x91" * 100_000 + b"\x00", "not a layout"),
    ],
    ids=["many maps", "deep"],
)
def test_what_a_layout_may_hold_is_bounded_as_it_is_decoded(data: bytes, why: str) -> None:
    """Refused part-way, in far less work than decoding it whole would take."""
    started = time.perf_counter()
    with pytest.raises(LayoutError, match=why):
        decode_layout(data, IDENTITY.digest())
    assert time.perf_counter() - started < 1.0


def test_the_largest_layout_the_limits_allow_is_within_the_bound() -> None:
    """most_containers is what a layout of max_layers layers holding max_slots slots needs."""
    limits = dataclasses.replace(DEFAULT_LIMITS, max_layers=64, max_slots=256)
    layer = {"kind": "kv", "meta": {"a": {"b": [1]}}, "trimmable": True}
    slot = {"dtype": "float16", "shape": [1, 2, 0, 8]}
    layers = [{**layer, "slots": [slot] * 4} for _ in range(64)]
    found = {**msgpack.unpackb(_encoded()), "layers": layers}
    layout = decode_layout(msgpack.packb(found), IDENTITY.digest(), limits)
    assert len(layout.layers) == 64
    assert most_containers(limits) >= 3 + 64 * 5 + 2 * 256
